"""A checkpoint's tensor shapes, dtypes and keys, learnt without reading the tensors' values.

A checkpoint read from its file when used (a safetensors file) answers them from the file's
header; a tensor in memory answers for itself. Checks of keys, shapes and dtypes, shape
inference and the layout of a written file go through :func:`stand_ins`, so that a tensor's
bytes are read only by a pass that needs its values (0.6.0 answered these questions by reading
the tensors: more than half of a `rescale`'s reads, benchmarks/bench_reads.py).
"""

from __future__ import annotations

import functools
import math
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


def reads_from_file(params: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``params`` is :class:`HeaderTensors`, decided once per type: an isinstance check
    against a runtime-checkable protocol takes some 30 µs, and shape questions ask it for every
    tensor (0.2 ms a layer of a spec of 20,000 layers' loading)."""
    return _is_header_type(type(params))


@functools.cache
def _is_header_type(kind: type) -> bool:
    return issubclass(kind, HeaderTensors)


def layout_of(params: Mapping[str, torch.Tensor], key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``params[key]``, from the file's header when ``params`` reads from one."""
    if reads_from_file(params):
        return params.layout(key)
    tensor = params[key]
    return tuple(tensor.shape), tensor.dtype


def stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` and ``dtype`` that take no memory: one zero, broadcast (stride 0)."""
    return torch.zeros((), dtype=dtype).expand(shape)


class _OverFile(Mapping[str, torch.Tensor]):
    """A view of the keys of ``params``, tensors read from a file: its subclasses say what a
    key's tensor is."""

    def __init__(self, params: HeaderTensors):
        self._params = params

    def __contains__(self, key: object) -> bool:
        return key in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class StandIns(_OverFile):
    """The tensors of ``params`` (read from a file when used) as :func:`stand_in` zeros of their
    shapes and dtypes: for questions of shape, dtype and membership, and for shape inference,
    never for values."""

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._params:
            raise KeyError(key)
        return stand_in(*self._params.layout(key))


def stand_ins(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` as :class:`StandIns` when its tensors are read from a file; else ``params`` itself,
    whose tensors in memory answer shape and dtype questions at no cost."""
    return StandIns(params) if reads_from_file(params) else params


# The most a checkpoint read from a file holds of its values, for its analysis (see
# :class:`HeldValues`): half of the memory bound's constant (peak RSS ≤ 1.5 × checkpoint + 1 GiB),
# on top of what the analysis streams; a larger checkpoint is read by each pass, as before.
HOLD_BUDGET_BYTES = 512 * 2**20


class HeldValues(_OverFile):
    """The tensors of ``params`` (read from a file when used), each kept once read until
    :meth:`release`, then read from the file at each use again, as ``params`` reads them.

    The loader's finiteness check and the analysis's passes (the groups' biases, the
    balancing, diag(G)'s forward and backward sweeps, the path norms) each need every tensor's
    values: held, they share one read of the file instead of making six. The values are what
    the file held when read, as an ONNX model's are (those are held from the load on). Held only
    within :data:`HOLD_BUDGET_BYTES` (:func:`held_within_budget`), and only until the analysis
    ends: a `rescale`'s peak is in its write and verification, which read the file again. On
    test_memory_bound's 46 MB MLP (bound 0.125 GiB above `import torch`): `inspect` peaks at
    0.094 GiB held (0.055 streamed), `rescale` at 0.108; holding the values through the
    verification too made it 0.129.
    """

    def __init__(self, params: HeaderTensors):
        super().__init__(params)
        self._held: dict[str, torch.Tensor] | None = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._held is None:
            return self._params[key]
        if key not in self._held:
            self._held[key] = self._params[key]
        return self._held[key]

    def layout(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return layout_of(self._params, key)

    def release(self) -> None:
        """Let the held values go; each later use reads the file."""
        self._held = None


def held_within_budget(params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` as :class:`HeldValues` when its tensors are read from a file and all of them
    fit in :data:`HOLD_BUDGET_BYTES`; else ``params`` itself."""
    if not reads_from_file(params):
        return params
    total = 0
    for key in params:
        shape, dtype = params.layout(key)
        total += math.prod(shape) * dtype.itemsize
    return HeldValues(params) if total <= HOLD_BUDGET_BYTES else params


def release_held(params: Mapping[str, torch.Tensor]) -> None:
    """End the holding of :class:`HeldValues` (nothing for any other mapping)."""
    if isinstance(params, HeldValues):
        params.release()
