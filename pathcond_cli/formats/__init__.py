"""Checkpoint formats: detect, load and write. Every loader returns a :class:`LoadedModel`."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..model import LoadedModel

SHARD_INDEX_SUFFIX = ".safetensors.index.json"


def detect_format(source: Path | bytes) -> str:
    """``onnx``, ``safetensors`` or ``safetensors-index``, from the name or the first bytes."""
    if isinstance(source, Path):
        # Any .json is read as a shard index (the safetensors reader takes any *.json index and
        # explains what it expected); onnx.load would otherwise parse it as a JSON ModelProto.
        if source.name.endswith(SHARD_INDEX_SUFFIX) or source.suffix.lower() == ".json":
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
        from google.protobuf import json_format, text_format

        from .onnx_format import load_onnx

        if arch is not None:
            raise InputError(f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph.")
        try:
            return load_onnx(source, input_shape=input_shape, name=name)
        except (text_format.Error, json_format.Error) as exc:
            # onnx.load picks a text parser from extensions such as .textproto or .pbtxt.
            label = name or str(source)
            raise InputError(f"cannot read '{label}': it is not a valid ONNX model ({_one_line(exc)}).") from None
        except (ValueError, TypeError) as exc:
            # What the checker lets through but decoding trips on (a tensor whose raw data does
            # not fit its dims or type, ...): the file is inconsistent, say which part.
            raise InputError(_inconsistent_onnx_message(source, name, exc)) from None
    from .safetensors_format import load_safetensors

    return load_safetensors(source, arch=arch, input_shape=input_shape, name=name)


def _inconsistent_onnx_message(source: Path | bytes, name: str | None, exc: Exception) -> str:
    import onnx
    from onnx import numpy_helper

    label = name or (str(source) if isinstance(source, Path) else "<stdin>")
    detail = _one_line(exc)
    try:
        model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source), load_external_data=False)
        tensors = [*model.graph.initializer,
                   *(a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value")]
    except Exception:  # noqa: BLE001 - only used to improve the message
        tensors = []
    bad = []
    for tensor in tensors:
        try:
            numpy_helper.to_array(tensor)
        except Exception:  # noqa: BLE001
            bad.append(tensor.name)
    if bad:
        return (f"cannot read '{label}': tensor(s) {', '.join(map(repr, bad))} hold data that does not match "
                f"their declared shape or element type ({detail}).")
    return f"cannot read '{label}': the ONNX model is inconsistent ({detail})."


def _one_line(exc: Exception) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


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
