"""Device values read on the host in one transfer: on a GPU each copy to the host waits for the
device, so a copy per tensor costs a round trip per tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Each tensor's bytes start at a multiple of this in the buffer, so that its part of the buffer can
# be viewed as its dtype (the widest, complex128, takes 16 bytes).
_ALIGNMENT = 16


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (one device, any dtypes and shapes) copied to the CPU in one transfer, each with
    its dtype and shape: their bytes travel as one buffer, of which the copies are views (any of
    them keeps it all)."""
    parts = []
    for tensor in tensors:
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # a strided view of one element, such as a complex's .imag
            flat = flat.clone(memory_format=torch.contiguous_format)
        raw = flat.view(torch.uint8)
        parts += [raw, raw.new_empty(-raw.numel() % _ALIGNMENT)]  # padding: never read
    if not parts:
        return []
    buffer = torch.cat(parts[:-1]).cpu()
    copies, start = [], 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        copies.append(buffer[start : start + size].view(tensor.dtype).reshape(tensor.shape))
        start += size + (-size % _ALIGNMENT)
    return copies
