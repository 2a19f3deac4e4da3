"""Checkpoint formats: detect, load and write. Every loader returns a :class:`LoadedModel`.

This module only dispatches, to the :class:`~.interface.Format` of each format (ONNX in
:mod:`.onnx_format`, safetensors in :mod:`.safetensors_format`): each tells which files it reads,
their companions and the other files its loading reads. What the format modules share is in
:mod:`.common`, what detection starts from (and refuses) in :mod:`.detection`, the companion-file
policy in :mod:`pathcond_cli.io.companions`. The names other layers use are re-exported here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from ...engine.model import LoadedModel
from ...errors import InputError
from ..companions import SHARD_INDEX_SUFFIX, companion_format
from ..fileio import file_state
from .common import (
    InputShape,
    available_memory,
    check_readable,
    check_weight_types,
    exception_line,
    refuse_beyond_memory,
    shapes_by_input,
    shown,
)
from .detection import FORMAT_OF_KIND, checked_structure, format_mismatch
from .interface import Format

__all__ = [
    "SHARD_INDEX_SUFFIX",
    "Format",
    "InputShape",
    "available_memory",
    "check_readable",
    "check_streamable",
    "check_weight_types",
    "checkpoint_files",
    "detect_format",
    "exception_line",
    "files_read",
    "format_mismatch",
    "format_named",
    "load_model",
    "refuse_beyond_memory",
    "replaced_companions",
    "shapes_by_input",
    "shown",
    "write_model",
]

# Each format's module, imported when the format is first used: importing onnx takes about 0.2 s,
# which `pathcond --help` and a safetensors run never pay.
_MODULES = {"onnx": ".onnx_format", "safetensors": ".safetensors_format"}
# The order formats are asked whether they read a file: safetensors claims its files by name or
# structure and ONNX any other, so a safetensors run never imports onnx.
_DETECTION_ORDER = ("safetensors", "onnx")


def format_named(name: str) -> Format:
    """The format ``name`` (``onnx`` or ``safetensors``, as in :attr:`LoadedModel.format`)."""
    return importlib.import_module(_MODULES[name], __name__).FORMAT


def detect_format(source: Path | bytes) -> str:
    """The kind of checkpoint ``source`` is (``onnx``, ``safetensors`` or ``safetensors-index``),
    as the first format that reads it tells, from the name and the file's structure; torch
    pickles and YAML specs refused unread (see :func:`~.detection.checked_structure`)."""
    structure = checked_structure(source)
    path = source if isinstance(source, Path) else None
    return next(kind for name in _DETECTION_ORDER if (kind := format_named(name).detect(path, structure)) is not None)


def load_model(
    source: Path | bytes,
    *,
    arch: str | None = None,
    input_shape: InputShape | None = None,
    name: str | None = None,
    allow_unused: bool = False,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (with its architecture) from a path or bytes.

    ``input_shape`` is batch-free: one shape, or a mapping from input names to shapes.

    Checkpoint tensors the architecture does not use are an error unless ``allow_unused``
    (then they are carried through unchanged and named in ``warnings``).
    """
    if isinstance(source, Path):
        check_readable(source)
    try:
        kind = detect_format(source)
    except OSError as exc:
        raise InputError(f"cannot read '{shown(name or str(source))}': {exc.strerror or exc}.") from None
    model = format_named(FORMAT_OF_KIND[kind]).load(
        source, arch=arch, input_shape=input_shape, name=name, allow_unused=allow_unused
    )
    model.file_states = {path: file_state(path) for path in model.files}
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The files a checkpoint on disk consists of (the file itself first), for replacing it.

    Only files inside the checkpoint's folder are listed; an unreadable or foreign file is
    just itself. Never raises.
    """
    kind = companion_format(path)
    return [path, *(format_named(kind).companions(path) if kind is not None else [])]


def replaced_companions(path: Path) -> tuple[list[Path], list[Path]]:
    """The companion files of the checkpoint at ``path``: those provably its own, which replacing
    it deletes (see ``own_shards`` and ``own_external_data``), and the others it names, which are
    left in place. Never raises."""
    named = checkpoint_files(path)[1:]
    kind = companion_format(path)
    own = format_named(kind).own_companions(path) if kind is not None else []
    return own, [file for file in named if file not in own]


def check_streamable(model: LoadedModel) -> None:
    """Refuse, before any work, a model that cannot be sent to stdout as one file: an ONNX
    model whose tensors, all inline, exceed what protobuf holds in one message (2 GiB)."""
    if model.format in _MODULES:
        format_named(model.format).check_streamable(model)


def files_read(path: Path | None, arch: str | None) -> list[Path]:
    """Every file a run on checkpoint ``path`` (None for stdin) with ``--arch arch`` may read,
    known before loading, the checkpoint first: its companions, then the files finding its
    architecture reads (see :meth:`~.interface.Format.architecture_files`). Never raises."""
    files = checkpoint_files(path) if path is not None else []
    # An ONNX model carries its graph; any other MODEL, or a run with --arch (which loading an ONNX
    # model refuses), has its architecture found as safetensors finds it.
    carries_graph = arch is None and path is not None and path.suffix == ".onnx"
    return files + format_named("onnx" if carries_graph else "safetensors").architecture_files(path, arch)


def write_model(
    model: LoadedModel,
    changed: dict,
    destination: Path,
    metadata: dict[str, str],
    *,
    companion_name: Callable[[str], str] = str,
    self_contained: bool = False,
) -> None:
    """Write ``model`` with ``changed`` tensors replaced, in its own format, atomically.

    Companion files (shards, ONNX external data) are written beside ``destination`` under the
    names ``companion_name`` returns for the names the format prefers; with ``self_contained``
    an ONNX model is written as one file, its external data inline.
    """
    if model.format not in _MODULES:
        raise InputError(f"{model.source}: models of format '{model.format}' are written with torch, not by pathcond.")
    format_named(model.format).write(
        model, changed, destination, metadata, companion_name=companion_name, self_contained=self_contained
    )
