"""What every format's detection starts from: the structure of a file (safetensors, a torch
pickle, or neither), the files refused before any format is asked (torch pickles, unread; YAML
specs given as MODEL), and whether an output's name fits the kind of checkpoint written."""

from __future__ import annotations

import io
import json
import os
import pickletools
import zipfile
from pathlib import Path

from ...errors import InputError
from .common import shown

# The format (:attr:`LoadedModel.format`) of each kind of checkpoint the formats' ``detect`` tell apart.
FORMAT_OF_KIND = {"onnx": "onnx", "safetensors": "safetensors", "safetensors-index": "safetensors"}
TORCH_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
# A MODEL named so is a spec given in place of the checkpoint (a .json MODEL is read as a shard index).
YAML_SUFFIXES = (".yaml", ".yml")
# torch.save writes a zip archive (since 1.6) or a bare pickle (protocol 2 to 5) before that.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))


def checked_structure(source: Path | bytes) -> str | None:
    """What :func:`file_structure` finds ``source`` to be, once the files pathcond refuses to read
    as a checkpoint are refused: a torch pickle (a zip archive or a bare pickle, each recognised by
    its whole structure, never by its first bytes alone, or named like one), refused before anything
    parses it, since pathcond never unpickles; and a file named as a YAML spec."""
    if isinstance(source, Path):
        with open(source, "rb") as handle:
            structure = file_structure(handle, os.fstat(handle.fileno()).st_size)
        if source.suffix.lower() in TORCH_PICKLE_SUFFIXES or structure == "torch-pickle":
            raise InputError(_torch_pickle_message(str(source)))
        if source.suffix.lower() in YAML_SUFFIXES:
            raise InputError(
                f"cannot read '{shown(str(source))}' as a checkpoint: it is named as an architecture "
                "spec (YAML). Give the checkpoint as MODEL and the spec with --arch, e.g. "
                "pathcond rescale model.safetensors --arch model.yaml"
            )
        return structure
    structure = file_structure(io.BytesIO(source), len(source))
    if structure == "torch-pickle":
        raise InputError(_torch_pickle_message("<stdin>"))
    return structure


# The safetensors library refuses headers beyond 100 MB; nothing longer is read to recognise one.
_SAFETENSORS_HEADER_LIMIT = 100_000_000


def file_structure(handle, size: int) -> str | None:
    """``safetensors`` or ``torch-pickle`` when the whole structure of the file (at ``handle``'s
    start, ``size`` bytes) is one, else None. A safetensors file is recognised by its header: 8
    bytes of little-endian length, then that many bytes of JSON object within the file, whatever
    the length's bytes happen to look like. Parsing never runs code: pickles are walked opcode by
    opcode with :mod:`pickletools`, never loaded."""
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
        'trust it: safetensors.torch.save_file(model.state_dict(), "model.safetensors") plus an architecture '
        'spec (--arch, see docs/spec-format.md), or torch.onnx.export(model, example_input, "model.onnx").'
    )


def format_mismatch(kind: str, destination: Path) -> str | None:
    """Why ``destination``'s name does not fit a checkpoint of ``kind`` (what a format's
    :meth:`~.interface.Format.detect` tells), which pathcond writes in its own format, or None.

    A suffix that names no checkpoint format is accepted (the format is the input's).
    """
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
    return (
        f"the input is {_FORMAT_NAMES[kind]} and pathcond writes the input's format, but the output name "
        f"'{shown(str(destination))}' says {_FORMAT_NAMES[wanted]}; name it like "
        f"'{_EXAMPLE_NAMES[kind]}'"
    )


_FORMAT_NAMES = {
    "onnx": "an ONNX model",
    "safetensors": "a safetensors file",
    "safetensors-index": "a sharded safetensors checkpoint (an index .json and its shards)",
}


_EXAMPLE_NAMES = {
    "onnx": "out.onnx",
    "safetensors": "out.safetensors",
    "safetensors-index": "out.safetensors.index.json",
}
