"""``max_log_scale``: which bound on |u_h|, if any, a PathCond rescaling uses.

- ``auto`` (the default): the unbounded optimum, unless the checkpoint's dtypes cannot hold it
  (:func:`~pathcond_cli.solve.dtype_limits.check_storage` refuses it); then the optimum over
  |u_h| ≤ U with U = :func:`~pathcond_cli.solve.dtype_limits.safe_log_scale`, the largest bound for
  which every u in the box is storable, so the bounded optimum always is;
- a number U ≥ 0 (``user``): the optimum over |u_h| ≤ U, refused if it cannot be stored;
- ``none`` (or None): the unbounded optimum, refused if it cannot be stored.

A refusal is :class:`~pathcond_cli.errors.StorageError` (exit code 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

import torch

from ..engine.groups import RescalingGroups
from .dtype_limits import StorageCheck, safe_log_scale
from .options import AUTO
from .solvers import SolveResult

# ln of float16's largest value: a neuron scaled beyond e^±11 pushes activations of order 1
# out of a float16 copy's range.
FLOAT16_LOG_RANGE = math.log(torch.finfo(torch.float16).max)


@dataclass
class BoundChoice:
    """How a run chose its bound. ``unbounded`` is the unbounded solve when the run made one
    (``auto`` and ``none``); ``lost`` lists what that optimum would have lost in storage when
    the ``auto`` rule then bounded it (empty otherwise)."""

    rule: str
    unbounded: SolveResult | None = None
    lost: list[StorageCheck] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        """Whether the auto rule replaced the unbounded optimum by a bounded one."""
        return bool(self.lost)

    def share_of_decrease_kept(self, final: SolveResult) -> float | None:
        """(F(0) − F(u_U)) / (F(0) − F(u*)) under the auto rule: 1 when the unbounded optimum was kept."""
        if self.rule != AUTO or self.unbounded is None:
            return None
        if not self.applied:
            return 1.0
        whole = self.unbounded.decrease
        return final.decrease / whole if whole > 0 else None

    def warnings(self, source: str, final: SolveResult) -> list[str]:
        notes = []
        if self.applied:
            share = self.share_of_decrease_kept(final)
            kept = f"{100 * share:.1f}%" if share is not None else "all"
            tensors = "; ".join(p.describe() for p in self.lost[:3]) + (
                f" (and {len(self.lost) - 3} more tensor(s))" if len(self.lost) > 3 else ""
            )
            notes.append(
                f"{source}: the unbounded PathCond optimum (‖u*‖∞ = {self.unbounded.u_inf:.4g}) cannot be stored in "
                f"the checkpoint's dtypes: {tensors}. --max-log-scale auto (the default) bounded every |u_h| by "
                f"U = {final.max_log_scale:.4g}, the largest bound that keeps every rescaled tensor storable: "
                f"{final.groups_at_bound:,} of {final.u.numel():,} groups sit at the bound and the bounded optimum "
                f"keeps {kept} of the unbounded decrease of F ({final.decrease:.6g} of {self.unbounded.decrease:.6g}). "
                "--max-log-scale none refuses such a rescaling instead (exit 8)."
            )
        if final.u_inf > FLOAT16_LOG_RANGE:
            notes.append(
                f"{source}: ‖u‖∞ = {final.u_inf:.4g} scales some neurons by more than e^{FLOAT16_LOG_RANGE:.1f} "
                "(float16's range): a float16 copy of the rescaled network would overflow or flush its "
                f"activations. To run it in float16, rescale with --max-log-scale {math.floor(FLOAT16_LOG_RANGE)} "
                "or less."
            )
        return notes


def within_dtype(
    groups: RescalingGroups,
    params: Mapping[str, torch.Tensor],
    unbounded: SolveResult,
    changed: MutableMapping[str, torch.Tensor],
    resolve: Callable[[float], SolveResult],
    problems: list[StorageCheck],
) -> tuple[SolveResult, MutableMapping[str, torch.Tensor], BoundChoice]:
    """The auto rule: keep the unbounded solve if its tensors are storable (``problems``: what
    :func:`~pathcond_cli.solve.dtype_limits.check_storage` found for ``changed``), else ``resolve`` at
    the dtype-safe bound. Returns the solve kept, its changed tensors (not yet checked when
    bounded) and the choice."""
    lost = [p for p in problems if p.lost]
    choice = BoundChoice(AUTO, unbounded, lost)
    if not lost:
        return unbounded, changed, choice
    bounded = resolve(safe_log_scale(groups, params))
    return bounded, groups.apply(params, bounded.u), choice
