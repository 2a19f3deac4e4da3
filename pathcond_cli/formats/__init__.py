"""Checkpoint formats: detect, load and write. Every loader returns a :class:`LoadedModel`."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..model import LoadedModel

SHARD_INDEX_SUFFIX = ".safetensors.index.json"


def detect_format(source: Path | bytes) -> str:
    """``onnx``, ``safetensors`` or ``safetensors-index``, from the name or the first bytes."""
    if isinstance(source, Path):
        if source.name.endswith(SHARD_INDEX_SUFFIX):
            return "safetensors-index"
        if source.suffix == ".onnx":
            return "onnx"
        if source.suffix == ".safetensors":
            return "safetensors"
        with open(source, "rb") as handle:
            head = handle.read(9)
    else:
        head = source[:9]
    return "safetensors" if len(head) == 9 and head[8:9] == b"{" else "onnx"


def check_readable(path: Path) -> None:
    if not path.exists():
        raise InputError(f"cannot read '{path}': no such file.")
    if path.is_dir():
        raise InputError(f"cannot read '{path}': it is a directory, not a checkpoint file.")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"cannot read '{path}': {exc.strerror}.") from None


def load_model(
    source: Path | bytes,
    *,
    arch: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    name: str | None = None,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (with its architecture) from a path or bytes."""
    if isinstance(source, Path):
        check_readable(source)
    kind = detect_format(source)
    if kind == "onnx":
        from .onnx_format import load_onnx

        if arch is not None:
            raise InputError(f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph.")
        return load_onnx(source, input_shape=input_shape, name=name)
    from .safetensors_format import load_safetensors

    return load_safetensors(source, arch=arch, input_shape=input_shape, name=name)


def write_model(model: LoadedModel, changed: dict, destination: Path, metadata: dict[str, str]) -> None:
    """Write ``model`` with ``changed`` tensors replaced, in its own format, atomically."""
    if model.format == "onnx":
        from .onnx_format import write_onnx

        write_onnx(model, changed, destination, metadata)
    elif model.format == "safetensors":
        from .safetensors_format import write_safetensors

        write_safetensors(model, changed, destination, metadata)
    else:
        raise InputError(f"{model.source}: models of format '{model.format}' are written with torch, not by pathcond.")
