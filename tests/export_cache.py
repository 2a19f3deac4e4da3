"""ONNX exports made once per test run and shared by its workers.

Tests in different files export the same network (the parity test and the padding, format and
difference tests export the same small networks; the families and the spec tests the same
ResNet), and pytest-xdist runs them on different workers: each export took 0.4–4 s, about
twelve seconds of a run. :func:`shared_export` keeps each export in a folder of the run
(``tests/conftest.py`` makes it before the workers start and removes it at the end), under the
hash of everything the export reads:

- the exporter;
- each submodule's class, mode, attributes (tensors by their dtype, shape and bytes, anything
  else, hooks included, by its ``repr``) and the values of its parameters and buffers;
- the example: for the TorchScript exporter, whose trace follows the values, the tensor itself;
  for the dynamo exporter its dtype and shape without the batch size (torch.export keeps the
  batch dimension symbolic, refuses an export that would specialise it, and guards rather than
  follows the values).

Two networks with one key export to the same bytes. An attribute whose ``repr`` holds an
address (a function, a hook, a plain object) changes between processes: such networks are
exported again, never mixed up. Without the folder (a test module imported outside pytest) every call
exports.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

FOLDER_VARIABLE = "PATHCOND_TEST_EXPORTS"
# Entries of a module's __dict__ read separately (its registries), or whose repr's order is the
# process's string hashing (a set: the buffers themselves are read).
_NOT_ATTRIBUTES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


_made: list[str] = []


def start_sharing() -> None:
    """Make the run's folder; the workers pytest-xdist starts afterwards inherit its name."""
    if FOLDER_VARIABLE not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="pathcond-exports-"))
        os.environ[FOLDER_VARIABLE] = _made[-1]


def stop_sharing() -> None:
    """Remove the folder :func:`start_sharing` made (not one an enclosing run made)."""
    while _made:
        os.environ.pop(FOLDER_VARIABLE, None)
        shutil.rmtree(_made.pop(), ignore_errors=True)


def shared_export(module: nn.Module, example: torch.Tensor, exporter: str, export: Callable[[], bytes]) -> bytes:
    """``export()``'s bytes, made by whichever worker of the run asked first."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return export()
    stored = Path(folder) / f"{_key(module, example, exporter)}.onnx"
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
    digest = hashlib.sha256()
    if exporter == "dynamo":
        digest.update(repr((exporter, str(example.dtype), tuple(example.shape[1:]))).encode())
    else:
        _add(digest, exporter, example)
    for name, submodule in module.named_modules(remove_duplicate=False):
        kind = type(submodule)
        digest.update(repr((name, kind.__module__, kind.__qualname__, submodule.training)).encode())
        for key, value in sorted(vars(submodule).items()):
            if key not in _NOT_ATTRIBUTES:
                _add(digest, key, value)
        for key, value in (*submodule._parameters.items(), *submodule._buffers.items()):
            _add(digest, key, value)
    return digest.hexdigest()


def _add(digest, key: str, value: object) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(repr((key, str(tensor.dtype), tuple(tensor.shape))).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr((key, value)).encode())
