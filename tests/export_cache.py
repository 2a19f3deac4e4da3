"""ONNX exports made once per test run and shared by its workers.

Tests in different files export the same network (the parity test and the padding, format and
difference tests export the same small networks; the families and the spec tests the same
ResNet), and pytest-xdist runs them on different workers: each export took 0.4–4 s. Through
:func:`shared_export`, ``onnx_models.export`` keeps each export in a folder of the run
(``tests/conftest.py`` makes it before the workers start and removes it at the end), under the
hash of what the export reads:

- the exporter, and the versions of torch, onnx and onnxscript;
- each submodule's place in the tree, class, mode and attributes, and its parameters and
  buffers: each by its kind, name, dtype, shape and bytes, a buffer with whether the state dict
  keeps it, a tensor held twice by where it was first met (tied weights, shared submodules);
- the example: for the TorchScript exporter, whose trace follows the values, the tensor itself;
  for the dynamo exporter its dtype and shape without the batch size (torch.export keeps the
  batch dimension symbolic, refuses an export that would specialise it, and guards rather than
  follows the values).

An attribute is read when it is a tensor, a number, a string, a dtype, a device or a tuple, list
or dict of those. A network with any other attribute (a function, an array, an object), or whose
class is defined inside a function (its forward may read the function's variables), is exported
again on every call: its key would not see everything the export reads. What no key sees is what
``forward`` reads outside the network (a module's globals): the suite's networks read none.
Without the folder (a test module imported outside pytest) every call exports.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

FOLDER_VARIABLE = "PATHCOND_TEST_EXPORTS"
# A module's registries, read as its parameters and buffers
_REGISTRIES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class _Unkeyable(Exception):
    """The network holds something its key cannot read."""


_run: dict[str, str | None] = {}


def start_sharing() -> None:
    """Make the run's folder; the workers pytest-xdist starts afterwards inherit its name. A
    folder named by the environment beforehand is not used: it may hold another tree's exports."""
    _run["previous"] = os.environ.get(FOLDER_VARIABLE)
    _run["folder"] = os.environ[FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="pathcond-exports-")


def stop_sharing() -> None:
    """Remove the run's folder, and give the variable back its value from before the run."""
    folder = _run.pop("folder", None)
    if folder is None:
        return
    shutil.rmtree(folder, ignore_errors=True)
    previous = _run.pop("previous", None)
    if previous is None:
        os.environ.pop(FOLDER_VARIABLE, None)
    else:
        os.environ[FOLDER_VARIABLE] = previous


def shared_export(module: nn.Module, example: torch.Tensor, exporter: str, export: Callable[[], bytes]) -> bytes:
    """``export()``'s bytes, made by whichever worker of the run asked first; ``export`` must be
    ``onnx_models``' export of ``module`` and ``example`` by ``exporter`` (the key does not read it)."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return export()
    try:
        key = _key(module, example, exporter)
    except _Unkeyable:
        return export()
    stored = Path(folder) / f"{key}.onnx"
    with open(stored.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for this export instead of repeating it
        if stored.exists():
            return stored.read_bytes()
        data = export()
        staged = stored.with_suffix(".partial")
        staged.write_bytes(data)
        os.replace(staged, stored)
        return data


def _key(module: nn.Module, example: torch.Tensor, exporter: str) -> str:
    """The hash of what the export reads (see the module's docstring); :class:`_Unkeyable` when
    the network holds something it cannot read."""
    digest = hashlib.sha256()
    digest.update(repr((exporter, torch.__version__, *map(_version, ("onnx", "onnxscript")))).encode())
    if exporter == "dynamo":
        digest.update(repr((str(example.dtype), tuple(example.shape[1:]))).encode())
    else:
        _add(digest, "example", example)
    first_met: dict[int, int] = {}

    def identity(thing: object) -> None:
        digest.update(repr(("met", first_met.setdefault(id(thing), len(first_met)))).encode())

    for name, submodule in module.named_modules(remove_duplicate=False):
        kind = type(submodule)
        if "<locals>" in kind.__qualname__:
            raise _Unkeyable(kind.__qualname__)
        digest.update(repr(("module", name, kind.__module__, kind.__qualname__, submodule.training)).encode())
        identity(submodule)
        for key, value in sorted(vars(submodule).items()):
            if key not in _REGISTRIES:
                _add(digest, f"attribute {key}", value)
        for key, value in submodule._parameters.items():
            _add(digest, f"parameter {key}", value)
            identity(value)
        for key, value in submodule._buffers.items():
            _add(digest, f"buffer {key} {key not in submodule._non_persistent_buffers_set}", value)
            identity(value)
    return digest.hexdigest()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _add(digest, label: str, value: object) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(repr((label, "tensor", str(tensor.dtype), tuple(tensor.shape))).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, _PLAIN):
        digest.update(repr((label, value)).encode())
    elif isinstance(value, (tuple, list)):
        digest.update(repr((label, type(value).__name__, len(value))).encode())
        for index, item in enumerate(value):
            _add(digest, f"{label}[{index}]", item)
    elif isinstance(value, dict):
        digest.update(repr((label, type(value).__name__, len(value))).encode())
        for key, item in value.items():
            if not isinstance(key, _PLAIN):
                raise _Unkeyable(f"{label}: a key {key!r}")
            _add(digest, f"{label}[{key!r}]", item)
    else:
        raise _Unkeyable(f"{label}: {type(value).__name__}")
