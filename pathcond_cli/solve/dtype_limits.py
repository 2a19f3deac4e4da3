"""Can the rescaled tensors be stored in their own dtype?

A neuron scale factor e^{u_h} multiplies or divides the checkpoint's values; with ‖u‖∞ of
tens, float16, bfloat16 and even float32 values overflow or fall below the dtype's smallest
normal number (becoming subnormal, with fewer significant bits, or zero). Before anything is
written every rescaled tensor is checked against the dtype it will be stored in:

- overflow (a finite value becomes ±inf) refuses the write;
- values that were normal and are now subnormal or zero: a few are a warning, more than
  ``LOST_FRACTION`` of the tensor's normal values refuse the write (the values are lost).

:func:`safe_log_scale` is the bound ``--max-log-scale auto`` (the default) applies when the
unbounded optimum fails that check: the largest U for which every u with |u_h| ≤ U passes it.
A refusal (only with ``--max-log-scale none`` or a bound of the user's) names that bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..engine.groups import RescalingGroups, blocks
from ..errors import StorageError

LOST_FRACTION = 0.01
ROUNDING_MARGIN = 1e-9


@dataclass
class StorageCheck:
    """What rescaling does to one stored tensor's representability."""

    key: str
    dtype: torch.dtype
    numel: int
    overflowed: int
    flushed: int
    normal: int

    @property
    def lost(self) -> bool:
        return self.overflowed > 0 or self.flushed > LOST_FRACTION * max(self.normal, 1)

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        info = torch.finfo(self.dtype)
        parts = []
        if self.overflowed:
            parts.append(
                f"{self.overflowed:,} of {self.numel:,} values would exceed {name}'s largest value {info.max:.4g}"
            )
        if self.flushed:
            parts.append(
                f"{self.flushed:,} of its {self.normal:,} normal values would fall below {name}'s "
                f"smallest normal {info.tiny:.3g} (stored as subnormals or zero)"
            )
        return f"tensor '{self.key}' ({name}): " + " and ".join(parts)


def safe_log_scale(groups: RescalingGroups, params: Mapping[str, torch.Tensor]) -> float:
    """The largest bound U such that every u with |u_h| ≤ U passes :func:`check_storage`.

    An element moved by ``s`` free groups (s = 2 for a weight between two free groups, 1 for a
    bias, a BatchNorm γ or β, or a weight with one fixed end, 0 inside one group) changes by
    at most e^{sU}, and some u in the box reaches that factor, up or down, for every element
    of a tensor at once (one sign for its output groups, the other for its input groups). So
    per tensor U is limited by its largest |value| reaching the dtype's largest value and by
    the (K+1)-th element to fall below the smallest normal, K the flushed values the check
    allows (``LOST_FRACTION`` of its normal values); the bound is the smallest limit over the
    rescalable tensors, 0 when a tensor already spans its dtype's range. It is exact (U plus
    any ε fails for some u) unless a tensor's output and input groups overlap, where it is
    conservative; a relative margin of ``ROUNDING_MARGIN`` absorbs the rounding of e^{sU}.
    """
    on = {"dtype": torch.float64, "device": groups.device}
    free = torch.cat([torch.ones(groups.num_free, **on), torch.zeros(1, **on)])
    ids = torch.cat([torch.arange(1, groups.num_free + 1, **on), torch.zeros(1, **on)])
    limit = math.inf
    for wb in groups.writebacks:
        tensor = params[wb.key]
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        shape = tuple(tensor.shape)
        # The write-back maps live on the analysis device, the checkpoint's tensors where they were read.
        sides = (wb.log_factor(free, -free, shape) * (wb.log_factor(ids, ids, shape) != 0)).to(tensor.device)
        magnitude = tensor.detach().abs().to(torch.float64)
        sides = torch.broadcast_to(sides, magnitude.shape)
        moved = (sides > 0) & (magnitude > 0)
        if not bool(moved.any()):
            continue
        info = torch.finfo(tensor.dtype)
        moved_magnitude, s = magnitude[moved], sides[moved]
        log_m = moved_magnitude.log()
        limit = min(limit, float(((math.log(info.max) - log_m) / s).min()))
        normal = moved_magnitude >= info.tiny
        allowed = math.floor(LOST_FRACTION * max(int((magnitude >= info.tiny).sum()), 1))
        if int(normal.sum()) > allowed:
            flush_at = (log_m[normal] - math.log(info.tiny)) / s[normal]
            limit = min(limit, float(torch.kthvalue(flush_at, allowed + 1).values))
    return max(limit * (1 - ROUNDING_MARGIN), 0.0) if math.isfinite(limit) else limit


def check_storage(original: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor]) -> list[StorageCheck]:
    """One entry per rescaled floating-point tensor that overflows or loses normal values."""
    # One key at a time: a rescaled tensor and its original are let go before the next is read.
    return [problem for key in changed if (problem := storage_problem(key, original, changed[key])) is not None]


def storage_problem(key: str, original: Mapping[str, torch.Tensor], new: torch.Tensor) -> StorageCheck | None:
    if not new.is_floating_point() or not new.numel():
        return None
    tiny = torch.finfo(new.dtype).tiny
    # Every value finite and normal: nothing overflowed or was flushed, known from one
    # reduction per block (no tensor-sized |new|); the element-wise accounting is for the rest.
    new_values = new.detach().reshape(-1)
    # The block size is read now, not when this module was imported.
    parts = blocks(new_values.numel(), 1)
    if all(_finite_and_normal(magnitudes, tiny) for magnitudes in _magnitudes(new_values, parts)):
        return None
    old_values = original[key].reshape(-1)
    overflowed = flushed = normal = 0
    for old_block, new_block in ((old_values[part], new_values[part]) for part in parts):
        was_normal = old_block.abs() >= tiny
        overflowed += int((torch.isfinite(old_block) & ~torch.isfinite(new_block)).sum())
        flushed += int((was_normal & (new_block.abs() < tiny)).sum())
        normal += int(was_normal.sum())
    if overflowed or flushed:
        return StorageCheck(key, new.dtype, new.numel(), overflowed, flushed, normal)
    return None


def _finite_and_normal(magnitudes: torch.Tensor, tiny: float) -> bool:
    low, high = magnitudes.aminmax()
    # NaN fails the first test.
    return math.isfinite(float(high)) and float(low) >= tiny


def _magnitudes(values: torch.Tensor, parts: list[slice]) -> Iterator[torch.Tensor]:
    """|values| block by block, in one buffer: no allocation (and its page faults) per block."""
    buffer = torch.empty_like(values[parts[0]])
    for part in parts:
        block = values[part]
        yield torch.abs(block, out=buffer[: block.numel()])


def ensure_storable(
    source: str,
    groups: RescalingGroups,
    original: Mapping[str, torch.Tensor],
    changed: Mapping[str, torch.Tensor],
    u_inf: float,
    *,
    problems: list[StorageCheck] | None = None,
) -> list[str]:
    """Warnings for tensors that keep their values with a few flushed below the smallest normal;
    :class:`StorageError` naming the tensors that would overflow or lose their values, and the
    auto bound. A warning does not name that bound: auto bounds only a rescaling that loses
    values, so it would write the same values as the run warned. ``problems``: what
    :func:`check_storage` found for ``changed`` when the caller ran it already (each rescaled
    tensor is then not computed again)."""
    problems = check_storage(original, changed) if problems is None else problems
    fatal = [p for p in problems if p.lost]
    if fatal:
        advice = _advice(safe_log_scale(groups, original))
        listed = "; ".join(p.describe() for p in fatal[:LISTED_TENSORS])
        if len(fatal) > LISTED_TENSORS:
            listed += f"; and {len(fatal) - LISTED_TENSORS} more tensor(s)"
        raise StorageError(
            f"{source}: the rescaling (largest log scale |u| = {u_inf:.3g}) cannot be stored in the checkpoint's "
            f"dtypes: {listed}. Nothing was written; {advice}."
        )
    if len(problems) <= 1:
        return [f"{source}: after rescaling (largest log scale |u| = {u_inf:.3g}), {p.describe()}." for p in problems]
    # One warning for all tensors: an fp16 network has one such tensor per layer, each saying the same.
    flushed = sum(p.flushed for p in problems)
    listed = ", ".join(f"'{p.key}' {p.flushed:,}/{p.normal:,}" for p in problems[:LISTED_TENSORS])
    more = f" and {len(problems) - LISTED_TENSORS} more" if len(problems) > LISTED_TENSORS else ""
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in problems}))
    return [
        f"{source}: after rescaling (largest log scale |u| = {u_inf:.3g}), {flushed:,} normal values of "
        f"{len(problems)} {dtypes} tensors would fall below their dtype's smallest normal (stored as subnormals "
        f"or zero; flushed/normal values per tensor: {listed}{more})."
    ]


LISTED_TENSORS = 5  # the message stays one readable paragraph; the advice comes after the list


def _advice(bound: float) -> str:
    """What to do about a rescaling the checkpoint's dtypes cannot hold, given the auto bound."""
    if math.isfinite(bound) and bound > 0:
        return (
            f"--max-log-scale auto (the default; max_log_scale='auto' in the API) bounds every neuron scale "
            f"factor to e^±U with U = {bound:.4g}, the largest bound that keeps every rescaled tensor storable"
        )
    return (
        "a tensor already spans its dtype's whole range, so no rescaling keeps it representable; "
        "convert the checkpoint to a wider dtype first"
    )


def lost_values(original: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor]) -> list[StorageCheck]:
    """The tensors whose rescaled values the checkpoint's dtype cannot hold (a refusal, not a warning)."""
    return [p for p in check_storage(original, changed) if p.lost]
