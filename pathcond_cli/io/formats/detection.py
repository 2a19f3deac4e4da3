"""Which format a checkpoint is in, from its name and its structure; torch pickles refused unread."""

from __future__ import annotations

import io
import json
import os
import pickletools
import zipfile
from pathlib import Path

from ...errors import InputError
from .common import shown

SHARD_INDEX_SUFFIX = ".safetensors.index.json"
# The format (:attr:`LoadedModel.format`) of each kind of file :func:`detect_format` tells apart.
FORMAT_OF_KIND = {"onnx": "onnx", "safetensors": "safetensors", "safetensors-index": "safetensors"}
TORCH_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
# A MODEL named so is a spec given in place of the checkpoint (a .json MODEL is read as a shard index).
YAML_SUFFIXES = (".yaml", ".yml")
# torch.save writes a zip archive (since 1.6) or a bare pickle (protocol 2 to 5) before that.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))


def detect_format(source: Path | bytes) -> str:
    """``onnx``, ``safetensors`` or ``safetensors-index``, from the name and the file's structure.

    A torch pickle (a zip archive or a bare pickle, each recognised by its whole structure, never
    by its first bytes alone) is refused here, before anything parses it: pathcond never unpickles.
    A safetensors file is recognised by its header: 8 bytes of little-endian length, then that many
    bytes of JSON object within the file, whatever the length's bytes happen to look like.
    """
    if isinstance(source, Path):
        with open(source, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            structure = _structure(handle, size)
        if source.suffix.lower() in TORCH_PICKLE_SUFFIXES or structure == "torch-pickle":
            raise InputError(_torch_pickle_message(str(source)))
        if source.suffix.lower() in YAML_SUFFIXES:
            raise InputError(f"cannot read '{shown(str(source))}' as a checkpoint: it is named as an architecture "
                             "spec (YAML). Give the checkpoint as MODEL and the spec with --arch, e.g. "
                             "pathcond rescale model.safetensors --arch model.yaml")
        # Any .json is read as a shard index (the safetensors reader takes any *.json index and
        # explains what it expected); onnx.load would otherwise parse it as a JSON ModelProto.
        if source.name.endswith(SHARD_INDEX_SUFFIX) or source.suffix.lower() == ".json":
            return "safetensors-index"
        if source.suffix == ".onnx":
            return "onnx"
        if source.suffix == ".safetensors":
            return "safetensors"
    else:
        structure = _structure(io.BytesIO(source), len(source))
        if structure == "torch-pickle":
            raise InputError(_torch_pickle_message("<stdin>"))
    return "safetensors" if structure == "safetensors" else "onnx"


# The safetensors library refuses headers beyond 100 MB; nothing longer is read to recognise one.
_SAFETENSORS_HEADER_LIMIT = 100_000_000


def _structure(handle, size: int) -> str | None:
    """``safetensors`` or ``torch-pickle`` when the whole structure of the file (at ``handle``'s
    start, ``size`` bytes) is one, else None. Parsing never runs code: pickles are walked
    opcode by opcode with :mod:`pickletools`, never loaded."""
    head = handle.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 2 <= length <= min(size - 8, _SAFETENSORS_HEADER_LIMIT):
            header = head[8:] + handle.read(length - 1)
            try:
                if isinstance(json.loads(header), dict):
                    return "safetensors"
            except (ValueError, RecursionError):
                pass
    if head.startswith(_ZIP_MAGIC):
        handle.seek(0)
        return "torch-pickle" if zipfile.is_zipfile(handle) else None
    if head.startswith(_PICKLE_MAGIC):
        handle.seek(0)
        try:
            for opcode, _arg, _position in pickletools.genops(handle):
                if opcode.name == "STOP":
                    return "torch-pickle"
        except Exception:  # noqa: BLE001 - any malformed opcode stream: not a pickle
            return None
    return None


def _torch_pickle_message(label: str) -> str:
    return (
        f"cannot read '{shown(label)}': it is a torch pickle (torch.save / a .pt, .pth or .bin checkpoint), and "
        "pathcond never unpickles files, because unpickling runs code from the file. Convert it once, where you "
        "trust it: safetensors.torch.save_file(model.state_dict(), \"model.safetensors\") plus an architecture "
        "spec (--arch, see docs/spec-format.md), or torch.onnx.export(model, example_input, \"model.onnx\")."
    )


def output_format_mismatch(source: Path | bytes, destination: Path) -> str | None:
    """Why ``destination``'s name does not fit the format ``source`` is written in, or None.

    A suffix that names no checkpoint format is accepted (the format is the input's).
    """
    kind = detect_format(source)
    name = destination.name.lower()
    if name.endswith(".onnx"):
        wanted = "onnx"
    elif name.endswith(".json"):
        wanted = "safetensors-index"
    elif name.endswith(".safetensors"):
        wanted = "safetensors"
    elif destination.suffix.lower() in TORCH_PICKLE_SUFFIXES:
        return f"pathcond writes the input's format ({_FORMAT_NAMES[kind]}), never a torch pickle"
    else:
        return None
    if wanted == kind:
        return None
    return (f"the input is {_FORMAT_NAMES[kind]} and pathcond writes the input's format, but the output name "
            f"'{shown(str(destination))}' says {_FORMAT_NAMES[wanted]}; name it like "
            f"'{_EXAMPLE_NAMES[kind]}'")


_FORMAT_NAMES = {"onnx": "an ONNX model", "safetensors": "a safetensors file",
                 "safetensors-index": "a sharded safetensors checkpoint (an index .json and its shards)"}


_EXAMPLE_NAMES = {"onnx": "out.onnx", "safetensors": "out.safetensors",
                  "safetensors-index": "out.safetensors.index.json"}
