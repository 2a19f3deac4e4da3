"""Can the rescaled tensors be stored in their own dtype?

A neuron scale factor e^{u_h} multiplies or divides the checkpoint's values; with ‖u‖∞ of
tens, float16, bfloat16 and even float32 values overflow or fall below the dtype's smallest
normal number (becoming subnormal, with fewer significant bits, or zero). Before anything is
written every rescaled tensor is checked against the dtype it will be stored in:

- overflow (a finite value becomes ±inf) refuses the write;
- values that were normal and are now subnormal or zero: a few are a warning, more than
  ``LOST_FRACTION`` of the tensor's normal values refuse the write (the values are lost).

Refusals and warnings suggest a ``--max-log-scale`` that keeps every rescaled tensor inside
its dtype's normal range: a weight changes by at most e^{2U} (scale of its two ends), a
vector (bias, BatchNorm γ, β) by e^{U}.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import VerificationError
from .groups import RescalingGroups

LOST_FRACTION = 0.01


# Tensors named in the single warning about values flushed below the smallest normal.
_TENSORS_LISTED = 8


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
            parts.append(f"{self.overflowed:,} of {self.numel:,} values would exceed {name}'s largest value {info.max:.4g}")
        if self.flushed:
            parts.append(f"{self.flushed:,} of its {self.normal:,} normal values would fall below {name}'s "
                         f"smallest normal {info.tiny:.3g} (stored as subnormals or zero)")
        return f"tensor '{self.key}' ({name}): " + " and ".join(parts)


def safe_log_scale(groups: RescalingGroups, params: Mapping[str, torch.Tensor]) -> float:
    """The largest bound U on |u_h| that keeps every rescalable tensor's normal values normal
    and finite in its own dtype (0 when a tensor already spans its dtype's whole range)."""
    limit = math.inf
    for wb in groups.writebacks:
        tensor = params[wb.key]
        if not tensor.is_floating_point():
            continue
        info = torch.finfo(tensor.dtype)
        magnitude = tensor.detach().abs().to(torch.float64)
        normal = magnitude[(magnitude >= info.tiny) & torch.isfinite(magnitude)]
        if not normal.numel():
            continue
        headroom = min(math.log(info.max / float(normal.max())), math.log(float(normal.min()) / info.tiny))
        sides = 1 if wb.layout == "vector" else (wb.dst is not None) + (wb.src is not None)
        limit = min(limit, max(headroom, 0.0) / max(sides, 1))
    return limit


def check_storage(original: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor]) -> list[StorageCheck]:
    """One entry per rescaled floating-point tensor that overflows or loses normal values."""
    problems = []
    for key, new in changed.items():
        old = original[key]
        if not new.is_floating_point() or not new.numel():
            continue
        tiny = torch.finfo(new.dtype).tiny
        magnitude = new.abs()
        low, high = magnitude.aminmax()
        # Every value finite and normal (NaN fails the first test): nothing overflowed or was
        # flushed, known from one reduction; the element-wise accounting is for the rest.
        if math.isfinite(float(high)) and float(low) >= tiny:
            continue
        overflowed = int((torch.isfinite(old) & ~torch.isfinite(new)).sum())
        was_normal = old.abs() >= tiny
        flushed = int((was_normal & (magnitude < tiny)).sum())
        if overflowed or flushed:
            problems.append(StorageCheck(key, new.dtype, new.numel(), overflowed, flushed, int(was_normal.sum())))
    return problems


def ensure_storable(source: str, groups: RescalingGroups, original: Mapping[str, torch.Tensor],
                    changed: Mapping[str, torch.Tensor], u_inf: float) -> list[str]:
    """Warnings for tensors that keep their values with a few flushed below the smallest normal;
    :class:`VerificationError` naming the tensors that would overflow or lose their values."""
    problems = check_storage(original, changed)
    if not problems:
        return []
    bound = safe_log_scale(groups, original)
    advice = (f"rerun with --max-log-scale {math.floor(bound * 10) / 10:g} (max_log_scale= in the API), which bounds "
              f"every neuron scale factor to e^±U and keeps every rescaled tensor inside its dtype's normal range"
              if math.isfinite(bound) and bound > 0 else
              "a tensor already spans its dtype's whole range, so no rescaling keeps it representable; "
              "convert the checkpoint to a wider dtype first")
    fatal = [p for p in problems if p.lost]
    if fatal:
        listed = "; ".join(p.describe() for p in fatal)
        raise VerificationError(
            f"{source}: the rescaling (largest log scale |u| = {u_inf:.3g}) cannot be stored in the checkpoint's "
            f"dtypes: {listed}. Nothing was written; {advice}."
        )
    if len(problems) == 1:
        return [f"{source}: after rescaling (largest log scale |u| = {u_inf:.3g}), {problems[0].describe()}; {advice}."]
    # One warning for all tensors: an fp16 network has one such tensor per layer, each saying the same.
    flushed = sum(p.flushed for p in problems)
    listed = ", ".join(f"'{p.key}' {p.flushed:,}/{p.normal:,}" for p in problems[:_TENSORS_LISTED])
    more = f" and {len(problems) - _TENSORS_LISTED} more" if len(problems) > _TENSORS_LISTED else ""
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in problems}))
    return [f"{source}: after rescaling (largest log scale |u| = {u_inf:.3g}), {flushed:,} normal values of "
            f"{len(problems)} {dtypes} tensors would fall below their dtype's smallest normal (stored as subnormals "
            f"or zero; flushed/normal values per tensor: {listed}{more}); {advice}."]
