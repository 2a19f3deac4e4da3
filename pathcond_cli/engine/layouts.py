"""A checkpoint's tensor shapes, dtypes and keys, learnt without reading the tensors' values.

A checkpoint read from its file when used (a safetensors file) answers them from the file's
header; a tensor in memory answers for itself. Checks of keys, shapes and dtypes, shape
inference and the layout of a written file go through :func:`stand_ins`, so that a tensor's
bytes are read only by a pass that needs its values (0.6.0 answered these questions by reading
the tensors: more than half of a `rescale`'s reads, benchmarks/bench_reads.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class HeaderTensors(Protocol):
    """A tensor mapping that reads a tensor's values from a file when asked for it, and knows its
    shape and dtype without reading them (from the file's header)."""

    def layout(self, key: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...


def layout_of(params: Mapping[str, torch.Tensor], key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``params[key]``, from the file's header when ``params`` reads from one."""
    if isinstance(params, HeaderTensors):
        return params.layout(key)
    tensor = params[key]
    return tuple(tensor.shape), tensor.dtype


def stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` and ``dtype`` that take no memory: one zero, broadcast (stride 0)."""
    return torch.zeros((), dtype=dtype).expand(shape)


class StandIns(Mapping[str, torch.Tensor]):
    """The tensors of ``params`` (read from a file when used) as :func:`stand_in` zeros of their
    shapes and dtypes: for questions of shape, dtype and membership, and for shape inference,
    never for values."""

    def __init__(self, params: HeaderTensors):
        self._params = params

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._params:
            raise KeyError(key)
        return stand_in(*self._params.layout(key))

    def __contains__(self, key: object) -> bool:
        return key in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def stand_ins(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` as :class:`StandIns` when its tensors are read from a file; else ``params`` itself,
    whose tensors in memory answer shape and dtype questions at no cost."""
    return StandIns(params) if isinstance(params, HeaderTensors) else params
