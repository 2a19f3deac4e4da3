"""The companion-file rules in one place: what a checkpoint's companions (safetensors shards, ONNX
external data) are named, how a taken name is tagged, and when a companion provably belongs to
one checkpoint alone (named after it, and named by no other file beside it). The formats' readers,
writers, :mod:`.fileio`'s stage and :mod:`.destinations` all ask here. Imports nothing of pathcond."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

# The name that makes a file a sharded safetensors checkpoint's index.
SHARD_INDEX_SUFFIX = ".safetensors.index.json"
# Bytes of the random tag in a companion's name when the preferred name is taken.
COMPANION_TAG_BYTES = 4
# What the companion writer inserts before the first dot of a name already taken, and its length.
TAKEN_TAG = f"-[0-9a-f]{{{2 * COMPANION_TAG_BYTES}}}"
TAKEN_TAG_CHARS = 1 + 2 * COMPANION_TAG_BYTES


def is_companion_name(name: str, preferred: str) -> bool:
    """Whether ``name`` is one that :meth:`Stage.companion_name` gives for ``preferred``."""
    stem, dot, suffix = preferred.partition(".")
    tagged = re.escape(stem) + TAKEN_TAG + re.escape(dot + suffix)
    return name == preferred or re.fullmatch(tagged, name, re.DOTALL) is not None


def named_by_another_file(path: Path, name: str, suffix: str) -> bool:
    """Whether a file ending in ``suffix`` beside ``path``, other than ``path``, holds the bytes
    of ``name`` (a model or index that names it as its data must): a cheap scan, erring towards
    yes."""
    needle = name.encode("utf-8", "surrogateescape")
    for entry in os.scandir(path.parent):
        if not entry.name.lower().endswith(suffix) or not entry.is_file() or os.path.samefile(entry.path, path):
            continue
        if file_holds(Path(entry.path), needle):
            return True
    return False


# Bytes read at a time by :func:`file_holds`.
SEARCH_CHUNK_BYTES = 16 * 2**20


def file_holds(path: Path, needle: bytes) -> bool:
    """Whether the regular file at ``path`` holds the bytes ``needle`` (False for anything else,
    which is not read: a FIFO's one reader is whoever reads it for its content). Read in chunks,
    not mapped: a file truncated meanwhile comes up short instead of faulting the process."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or not needle:
            return False
        # At least a byte, so that the reads go on to the end of a file that has grown since.
        buffer = bytearray(min(SEARCH_CHUNK_BYTES, status.st_size + 1))
        overlap = len(needle) - 1
        tail = b""
        with open(descriptor, "rb", buffering=0, closefd=False) as handle:
            while read := handle.readinto(buffer):
                # A needle across two reads lies in the last bytes read before and the first of this one.
                if needle in tail + buffer[: min(read, overlap)] or buffer.find(needle, 0, read) >= 0:
                    return True
                tail = (tail + buffer[max(0, read - overlap) : read])[-overlap:] if overlap else b""
        return False
    finally:
        os.close(descriptor)


# Longest first: what is left is the name sidecars and output shards are named after.
_CHECKPOINT_SUFFIXES = (".safetensors.index.json", ".index.json", ".safetensors", ".json")


def checkpoint_stem(file_name: str) -> str:
    """``model`` for ``model.safetensors`` and ``model.safetensors.index.json``."""
    for suffix in _CHECKPOINT_SUFFIXES:
        if file_name.endswith(suffix) and len(file_name) > len(suffix):
            return file_name[: -len(suffix)]
    return Path(file_name).stem


def companion_format(path: Path) -> str | None:
    """The format whose companions a checkpoint named like ``path`` may have: an index (any
    ``.json``) names shards, an ``.onnx`` model external data; None for any other name."""
    if path.name.endswith(".json"):
        return "safetensors"
    if path.suffix == ".onnx":
        return "onnx"
    return None


def external_data_name(model_name: str) -> str:
    """The name the ONNX writer prefers for the external data of the model named ``model_name``."""
    return f"{model_name}.data"


def shard_name(stem: str, number: str, total: str) -> str:
    """The name the safetensors writer prefers for shard ``number`` of ``total`` (both written
    with five digits) of the index whose :func:`checkpoint_stem` is ``stem``."""
    return f"{stem}-{number}-of-{total}.safetensors"


def preferred_companion(kind: str, name: str, number: str) -> str | None:
    """The name the writer of format ``kind`` prefers for a companion of output ``name``, with
    ``number`` in place of a shard's number and count."""
    if kind == "onnx":
        return external_data_name(name)
    if kind == "safetensors-index":
        return shard_name(checkpoint_stem(name), number, number)
    return None
