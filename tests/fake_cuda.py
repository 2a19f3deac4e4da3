"""A fake CUDA device for CPU machines: catches device mixes without a GPU (test-only).

:class:`FakeCuda` is a torch function mode. Tensors created for ``cuda`` (factories with
``device="cuda"``, ``.to("cuda")``, ``.cuda()``) are ordinary CPU tensors tagged as living on
the fake device; every tensor computed from a tagged one is tagged too, and ``.device``,
``.is_cuda`` and ``.get_device()`` answer as a real CUDA tensor would. An operation that
mixes a tagged tensor with an untagged CPU tensor of one or more dimensions raises the
error CUDA raises ("Expected all tensors to be on the same device"); zero-dimensional CPU
tensors may mix, as on CUDA. Reductions that CUDA lacks for booleans raise as CUDA does.
Host transfers are explicit and allowed (``.cpu()``, ``.to("cpu")``, ``.item()``,
``.tolist()``, ``float()``/``int()``/``bool()``) and counted in :attr:`FakeCuda.syncs`;
``.numpy()`` of a tagged tensor raises, as on CUDA.

:func:`install` also makes ``torch.cuda.is_available()`` true (one device), so that
``resolve_device("auto")`` and ``--device cuda`` pick the fake device. The test suite runs
under it when ``PATHCOND_FAKE_CUDA=1`` (see ``conftest.py``); CLI subprocesses inherit the
variable and start through ``fake_cuda_main.py``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

ENV = "PATHCOND_FAKE_CUDA"
FAKE = torch.device("cuda", 0)
_TAG = "_pathcond_fake_cuda"

# Reading a value on the host: a transfer and a host–device synchronisation on a real GPU.
_SYNCS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__format__",
    "__repr__",
    "nonzero",
    "equal",
}
# Methods that legitimately take tensors from two devices.
_TRANSFERS = {
    "to",
    "cpu",
    "cuda",
    "copy_",
    "__set__",
    "__setitem__",
    "type_as",
    "new_tensor",
    "swap_tensors",
    "_has_compatible_shallow_copy_type",
    "is_same_size",
}
# Indexing a CUDA tensor with CPU indices is allowed by torch (it moves them).
_INDEXING = {"__getitem__", "__setitem__"}
# Reductions whose CUDA kernels have no boolean version (the CPU's have one), as seen on an H200
# with torch 2.11: "cuda_scatter_gather_base_kernel_func" not implemented for 'Bool'.
_NO_BOOL_ON_CUDA = {"scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_"}


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def on_fake(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _TAG, False)


def _tag(value, on: bool):
    if isinstance(value, torch.Tensor):
        setattr(value, _TAG, on)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tag(item, on)
    return value


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _as_device(value) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    """The fake device (see the module docstring); ``syncs`` counts host reads by kind, and
    ``on_sync``, when set, is called with the kind at each one (while the read's caller is still
    on the Python stack, so that a benchmark can name the code that waited)."""

    def __init__(self):
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.on_sync: Callable[[str], None] | None = None

    def _synced(self, kind: str) -> None:
        self.syncs[kind] += 1
        if self.on_sync is not None:
            self.on_sync(kind)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        descriptor = (
            getattr(getattr(func, "__self__", None), "__name__", None) if name in ("__get__", "__set__") else None
        )
        if descriptor is not None:
            return self._descriptor(func, descriptor, name, args)
        tagged = [t for t in _tensors((args, kwargs)) if on_fake(t)]
        if name in _SYNCS and tagged:
            self._synced(name)
        if name in ("numpy", "__array__") and tagged:
            raise TypeError(
                f"can't convert {FAKE} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        if name in ("to", "cuda", "cpu"):
            return self._move(func, name, args, kwargs)
        if name == "get_device" and tagged:
            return 0
        target = kwargs.get("device")
        if _is_cuda(target):
            kwargs = {**kwargs, "device": "cpu"}
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type != "cuda":
                raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{generator.device.type}'")
        elif tagged and name not in _TRANSFERS:
            self._check_mix(name, args, kwargs)
        if tagged and name in _NO_BOOL_ON_CUDA and any(t.dtype == torch.bool for t in tagged):
            raise NotImplementedError(
                f"\"cuda_scatter_gather_base_kernel_func\" not implemented for 'Bool' [fake CUDA: {name}]"
            )
        out = func(*args, **kwargs)
        on = _is_cuda(target) if target is not None else bool(tagged)
        if name in _INDEXING and args and isinstance(args[0], torch.Tensor):
            on = on_fake(args[0])
        return _tag(out, on) if on or target is not None else out

    def _descriptor(self, func, descriptor: str, name: str, args):
        if name == "__set__":
            owner, value = args[0], args[1]
            func(*args)
            if descriptor == "data" and isinstance(value, torch.Tensor):
                _tag(owner, on_fake(value))
            return None
        tensor = args[0]
        value = func(*args)
        if not (isinstance(tensor, torch.Tensor) and on_fake(tensor)):
            return value
        if descriptor == "device":
            return FAKE
        if descriptor == "is_cuda":
            return True
        if descriptor == "is_cpu":
            return False
        return _tag(value, True) if isinstance(value, torch.Tensor) else value

    def _move(self, func, name: str, args, kwargs):
        source = args[0]
        if name == "cuda":
            return source if on_fake(source) else _tag(source.clone(), True)
        if name == "cpu":
            if not on_fake(source):
                return func(*args, **kwargs)
            self._synced("cpu")
            return _tag(source.clone(), False)
        target, rest = None, []
        for value in args[1:]:
            if target is None and isinstance(value, torch.Tensor):
                target = FAKE if on_fake(value) else value.device
                rest += ["cpu", value.dtype]
            elif target is None and not isinstance(value, (torch.dtype, bool)) and _as_device(value) is not None:
                target = _as_device(value)
                rest.append("cpu")
            else:
                rest.append(value)
        kwargs = dict(kwargs)
        if kwargs.get("device") is not None:
            target = torch.device(kwargs.pop("device"))
        out = func(source, *rest, **kwargs)
        if target is None or _is_cuda(target) == on_fake(source):
            return out if out is source else _tag(out, on_fake(source))
        if not _is_cuda(target):
            self._synced("cpu")
        return _tag(source.clone() if out is source else out, _is_cuda(target))

    def _check_mix(self, name: str, args, kwargs) -> None:
        """Raise as CUDA would when a tagged tensor meets an untagged CPU tensor with dimensions."""
        if name in _INDEXING:
            if on_fake(args[0]):
                return
            raise RuntimeError(
                f"indices should be either on cpu or on the same device as the indexed tensor (cpu) [fake CUDA: {name}]"
            )
        stray = [t for t in _tensors((args, kwargs)) if not on_fake(t) and t.dim() > 0 and t.device.type == "cpu"]
        if stray:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but got a tensor of shape "
                f"{tuple(stray[0].shape)} on cpu, different from other tensors on {FAKE} "
                f"[fake CUDA: {name}]"
            )


def _no_op(*args, **kwargs):
    return None


# What torch.cuda answers while the fake device is installed.
_CUDA_ANSWERS = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "get_device_name": lambda *a, **k: "fake CUDA (pathcond tests)",
    "synchronize": _no_op,
    "reset_peak_memory_stats": _no_op,
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_allocated": lambda *a, **k: 0,
    "empty_cache": _no_op,
}
# torch.cuda's own answers, as imported.
_REAL_CUDA = {name: getattr(torch.cuda, name) for name in _CUDA_ANSWERS}


@contextmanager
def _cuda_answering(answers: dict) -> Iterator[None]:
    saved = {name: getattr(torch.cuda, name) for name in answers}
    for name, value in answers.items():
        setattr(torch.cuda, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@contextmanager
def installed() -> Iterator[FakeCuda]:
    """The fake device active, and torch.cuda reporting one device, until the block ends."""
    mode = FakeCuda()
    with _cuda_answering(_CUDA_ANSWERS), mode:
        yield mode


@contextmanager
def suspended() -> Iterator[None]:
    """Run a block on the plain CPU (e.g. building a test input with torch's exporters): without
    the mode, and with torch.cuda's own answers (believing in a device, torch.export asks it for
    its random state, fails half-way and leaves the dispatcher's state broken for later tests)."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], FakeCuda):
        yield
        return
    with _pop_mode_temporarily(), _cuda_answering(_REAL_CUDA):
        yield
