"""Pure data movement (view, reshape, transpose, split, slicing) as ReLU DAG nodes.

Importers replay a chain of such operations on an index tensor (each element holds its own
flat position in the source) and ask :func:`movement_layer` what the chain amounts to: the
identity, a flatten, a channel slice, a channel shuffle, any other selection of whole
channels (a gather), a crop of the spatial axes (a pad of negative widths), a reflect,
replicate or circular padding, or else the element-wise copy it is (a rearrange: an NHWC
layout, an unflatten to channels), described as a strided view of the input when it is one (a
few numbers for any tensor size) and element by element otherwise. Only a movement across the
batch is refused.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch

from ...engine.graph import COPYING_PAD_MODES
from .offenders import UnsupportedMovement


def movement_layer(shape: tuple[int, ...], index: torch.Tensor) -> dict[str, Any] | None:
    """The spec layer of a data movement from batch-free ``shape`` (None: the identity).

    ``index`` holds, for every element of the moved tensor (batch axis first, batch of 1),
    the flat batch-free index of the element of the source it is.
    """
    if index.shape[0] != 1:
        raise UnsupportedMovement(
            f"it moves data across the batch axis (batch-axis size {index.shape[0]} for a batch of 1)"
        )
    index = index[0]
    total = prod(shape)
    if tuple(index.shape) == shape and torch.equal(index.reshape(-1), torch.arange(total)):
        return None
    if index.dim() == 1 and torch.equal(index, torch.arange(total)) and len(shape) > 1:
        return {"type": "flatten"}
    per_channel = prod(shape[1:])
    if index.dim() == len(shape) and tuple(index.shape[1:]) == shape[1:]:
        channels = index.reshape(index.shape[0], -1)[:, 0] // per_channel
        expected = channels[:, None] * per_channel + torch.arange(per_channel)
        if torch.equal(index.reshape(index.shape[0], -1), expected):
            start = int(channels[0])
            if torch.equal(channels, torch.arange(start, start + len(channels))):
                return {"type": "channel_slice", "start": start, "stop": start + len(channels)}
            for groups in range(2, shape[0] + 1):
                if (
                    shape[0] % groups == 0
                    and len(channels) == shape[0]
                    and torch.equal(channels, torch.arange(shape[0]).reshape(groups, -1).t().reshape(-1))
                ):
                    return {"type": "channel_shuffle", "groups": groups}
            return {"type": "channel_gather", "channels": channels.tolist()}
    pad = _crop(shape, index) or _copying_pad(shape, index)
    if pad is not None:
        return pad
    if index.dim() == 0:
        raise UnsupportedMovement(
            f"it reduces {shape} (batch excluded) to a single value per example: a value "
            "of the graph keeps a channel axis"
        )
    view = _strided_view(index.reshape(-1))
    if view is None:
        return {"type": "rearrange", "shape": tuple(index.shape), "elements": tuple(index.reshape(-1).tolist())}
    sizes, strides = view
    return {
        "type": "rearrange",
        "shape": tuple(index.shape),
        "sizes": sizes,
        "strides": strides,
        "offset": int(index.reshape(-1)[0]) if index.numel() else 0,
    }


def _strided_view(flat: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(sizes, strides)`` such that ``flat`` is ``flat[0] + Σ_k i_k·strides[k]`` over the
    row-major multi-indices of ``sizes``, or None (a Gather, say).

    Innermost axis first: the longest arithmetic run from the start is one axis. For a strided
    map a run can only end where an axis does (were the next value on the run, the next block
    would continue it too), so the run's length divides what is left, and the run's starts
    form the same problem one level up. The whole map is compared at the end.
    """
    if not flat.numel():
        return None
    sizes: list[int] = []
    strides: list[int] = []
    starts = flat
    while len(starts) > 1:
        steps = starts[1:] - starts[:-1]
        breaks = steps != steps[0]
        run = int(breaks.to(torch.uint8).argmax()) + 1 if bool(breaks.any()) else len(starts)
        if len(starts) % run:
            return None
        sizes.insert(0, run)
        strides.insert(0, int(steps[0]))
        starts = starts[::run]
    expected = flat[0].clone()
    for size, stride in zip(sizes, strides):
        expected = expected.unsqueeze(-1) + torch.arange(size) * stride
    if not torch.equal(expected.reshape(-1), flat):
        return None
    return tuple(sizes), tuple(strides)


def _crop(shape: tuple[int, ...], index: torch.Tensor) -> dict[str, Any] | None:
    """The pad layer of negative widths an index map amounts to when it keeps every channel and,
    on each spatial axis, one contiguous range of positions, the same for every channel
    (``x[:, :, 1:, :-1]``, a spatial ONNX Slice), or None."""
    if len(shape) < 2 or index.dim() != len(shape) or index.shape[0] != shape[0] or not index.numel():
        return None
    strides = [prod(shape[axis + 1 :]) for axis in range(len(shape))]
    first = int(index.reshape(-1)[0])
    starts = [first // strides[axis] % shape[axis] for axis in range(1, len(shape))]
    expected = torch.arange(shape[0]).reshape(-1, *[1] * (len(shape) - 1)) * strides[0]
    for axis, start in enumerate(starts, start=1):
        view = [1] * len(shape)
        view[axis] = index.shape[axis]
        expected = expected + (start + torch.arange(index.shape[axis])).reshape(view) * strides[axis]
    stops = [start + index.shape[axis] for axis, start in enumerate(starts, start=1)]
    if any(stop > size for stop, size in zip(stops, shape[1:])) or not torch.equal(index, expected):
        return None
    return {
        "type": "pad",
        "begin": tuple(-start for start in starts),
        "end": tuple(stop - size for stop, size in zip(stops, shape[1:])),
        "mode": "zeros",
    }


def _pad_sources(size: int, begin: int, end: int, mode: str) -> torch.Tensor:
    """The input position each output position of a 1-d pad copies."""
    positions = torch.arange(-begin, size + end)
    if mode == "circular":
        return positions % size
    if mode == "replicate":
        return positions.clamp(0, size - 1)
    period = 2 * (size - 1)
    folded = positions % period
    return torch.where(folded >= size, period - folded, folded)


def _computable(size: int, begin: int, end: int, mode: str) -> bool:
    """Whether torch's F.pad computes this pad (a reflection shorter than the axis, a wrap no longer)."""
    limit = {"circular": size, "reflect": size - 1}.get(mode)
    return limit is None or max(begin, end) <= limit


def _copying_pad(shape: tuple[int, ...], index: torch.Tensor) -> dict[str, Any] | None:
    """The pad layer an index map amounts to when every output pixel copies an input pixel of
    its own channel in reflect, replicate or circular fashion (the TorchScript exporter writes
    circular padding as Slices and Concats), or None."""
    if len(shape) < 2 or index.dim() != len(shape) or index.shape[0] != shape[0]:
        return None
    strides = [prod(shape[axis + 1 :]) for axis in range(len(shape))]
    # Circular first: on an axis of one or two elements a wrap is also a replication or a reflection.
    for mode in sorted(COPYING_PAD_MODES, key=lambda mode: mode != "circular"):
        begins, ends, expected = [], [], torch.arange(shape[0]).reshape(-1, *[1] * (len(shape) - 1)) * strides[0]
        for axis, size in enumerate(shape[1:], start=1):
            extra = index.shape[axis] - size
            if extra < 0 or (mode == "reflect" and size < 2):
                break
            profile = (
                index.select(0, 0).movedim(axis - 1, 0).reshape(index.shape[axis], -1)[:, 0] // strides[axis] % size
            )
            begin = next(
                (
                    b
                    for b in range(extra + 1)
                    if _computable(size, b, extra - b, mode)
                    and torch.equal(_pad_sources(size, b, extra - b, mode), profile)
                ),
                None,
            )
            if begin is None:
                break
            begins.append(begin)
            ends.append(extra - begin)
            view = [1] * len(shape)
            view[axis] = index.shape[axis]
            expected = expected + _pad_sources(size, begin, extra - begin, mode).reshape(view) * strides[axis]
        else:
            if torch.equal(index, expected.expand(index.shape)):
                return {"type": "pad", "begin": tuple(begins), "end": tuple(ends), "mode": mode}
    return None
