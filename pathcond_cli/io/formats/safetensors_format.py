"""safetensors checkpoints, one file or a sharded index: reading their tensors (each only when
used), writing them back bit for bit, and the :class:`~.interface.Format`. The architecture a
checkpoint is read with is resolved in :mod:`.architecture`.

Sharded checkpoints follow the Hugging Face layout: ``NAME.safetensors.index.json`` holds
``{"metadata": {...}, "weight_map": {tensor key: shard file}}`` and the shards lie beside it.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import safetensors
import safetensors.torch
import torch

from ...engine.layouts import held_within_budget, layout_of
from ...engine.model import LoadedModel
from ...errors import InputError, OutputError
from ..companions import SHARD_INDEX_SUFFIX, checkpoint_stem, is_companion_name, named_by_another_file, shard_name
from ..fileio import atomic_write, describe, file_state
from .architecture import SPEC_METADATA_KEY, architecture_files, check_parameters, resolve_architecture, unused_tensors
from .common import (
    INPUT_COPIES,
    InputShape,
    check_weight_types,
    contained_file,
    parse_json,
    refuse_beyond_memory,
    shown,
    some_keys,
)
from .spec import dump_spec, spec_from_graph

# safetensors itself refuses larger headers; a larger length field means corruption.
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = 100_000_000
_SAFETENSORS_ERRORS = (safetensors.SafetensorError, OSError, ValueError, RuntimeError, TypeError)
# The element types the safetensors format defines (its header's "dtype" names), as torch types.
# safetensors' own table is private (safetensors.torch._TYPES); tests/test_safetensors_format.py
# checks this one against the names save_file writes.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "C64": torch.complex64,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}


@dataclass(frozen=True)
class Shard:
    """One file of a sharded checkpoint: its name relative to the index, keys and metadata."""

    file: str
    keys: tuple[str, ...]
    metadata: dict[str, str]


@dataclass(frozen=True)
class SafetensorsPayload:
    """What writing the checkpoint back needs beyond its tensors.

    ``metadata`` is the file's ``__metadata__`` (str→str), or for a sharded checkpoint the
    index's ``metadata`` object; ``shards`` is the shard layout, empty for a single file.
    """

    metadata: dict[str, Any]
    shards: tuple[Shard, ...] = ()


def load_safetensors(
    source: str | Path | bytes,
    *,
    arch: str | None = None,
    input_shape: InputShape | None = None,
    name: str | None = None,
    allow_unused: bool = False,
) -> LoadedModel:
    """Read a safetensors checkpoint (file, index json or bytes) and resolve its architecture.

    ``arch`` is a spec file (.yaml/.yml/.json) or a factory ``module.path:callable``;
    ``input_shape`` is batch-free and overrides the spec's input shape; ``name`` is how the
    checkpoint is called in messages (default: its path, or ``<bytes>``). Tensors the
    architecture does not use are an error (a spec that forgot a layer describes another
    network) unless ``allow_unused``: then they are kept and named in ``warnings``.
    """
    path = None if isinstance(source, bytes) else Path(source)
    display = name or (str(path) if path is not None else "<bytes>")
    files: list[Path] = []
    if path is None:
        params, payload = _read_bytes(source, display)
    elif path.name.endswith(".json"):
        params, payload = _read_index(path, display)
        files = [path, *(path.parent / shard.file for shard in payload.shards)]
    else:
        params, payload = _read_file(path, display)
        files = [path]
    graph, arch_source, spec_file, notes, constants = resolve_architecture(
        arch, path, payload.metadata, input_shape, display, params
    )
    if spec_file is not None:
        files.append(spec_file)
    # The finiteness check's read is the analysis's too: held until the analysis ends.
    params = held_within_budget(params)
    check_weight_types(graph, params, display)
    check_parameters(graph, params, display, from_factory=arch is not None and spec_file is None)
    unused = unused_tensors(graph, params, display, constants)
    if unused and not allow_unused:
        # A factory's operations whose result reaches no output were dropped: their tensors are unused.
        dropped = "".join(
            f"\n{note}. Their tensors are unused; --allow-unused carries them through unchanged." for note in notes
        )
        raise InputError(
            unused + "\nA spec that leaves tensors unused describes another network than the checkpoint: "
            "add the missing layers, or pass --allow-unused to carry these tensors through unchanged." + dropped
        )
    return LoadedModel(
        graph,
        params,
        "safetensors",
        display,
        payload,
        [*notes, *([unused] if unused else [])],
        files,
        arch_source=arch_source,
    )


def write_safetensors(
    model: LoadedModel,
    changed: Mapping[str, torch.Tensor],
    destination: Path,
    metadata: Mapping[str, str],
    *,
    companion_name: Callable[[str], str] = str,
) -> None:
    """Write ``model`` with ``changed`` tensors replaced, atomically.

    Every other tensor is written from its loaded bytes, so it stays bit-identical. The
    original metadata is kept and extended with ``metadata`` and the graph's spec under
    ``pathcond.spec``, so the output reads back without ``--arch``. A sharded checkpoint is
    written shard by shard beside ``destination`` (the new index json, written last), shards
    named ``<stem>-00001-of-0000N.safetensors`` after it, or what ``companion_name`` makes of
    that name.
    """
    destination = Path(destination)
    tensors = _tensors_to_write(model.params, changed)
    payload = model.payload if isinstance(model.payload, SafetensorsPayload) else SafetensorsPayload({})
    added = {**metadata, SPEC_METADATA_KEY: dump_spec(spec_from_graph(model.graph))}
    if payload.shards:
        _write_sharded(tensors, model.params, payload, destination, added, companion_name)
    else:
        _write_file(destination, tensors, model.params, {**payload.metadata, **added})


# -- reading ----------------------------------------------------------------------------------


def _read_file(path: Path, display: str) -> tuple[Mapping[str, torch.Tensor], SafetensorsPayload]:
    try:
        with open(path, "rb") as handle:
            metadata = _read_metadata(handle, os.fstat(handle.fileno()).st_size, display)
    except OSError as exc:
        raise InputError(f"{display}: cannot read the checkpoint: {exc.strerror or exc}") from None
    if _utf8_path(path):
        return _load_tensors(lambda: MappedTensors(path), display), SafetensorsPayload(metadata)
    # safetensors takes paths as UTF-8 strings only: read a file with another name's bytes ourselves.
    return _load_tensors(lambda: safetensors.torch.load(path.read_bytes()), display), SafetensorsPayload(metadata)


class MappedTensors(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file, each read from the open file only when asked for.

    Loading costs no memory: a tensor's bytes are read (``pread``) when it is used and freed
    when it is let go. The file stays open, so reads keep seeing the file as it was opened even
    if its name is later replaced (an in-place run renames the rescaled file onto it). Reading
    rather than mapping is deliberate: a mapped file that another process truncates (a training
    job saving over its checkpoint) kills the reader with SIGBUS, without a word; read, it is an
    input error naming the file. safetensors before 0.8 can only map. A file written in place
    while it is read (its size or time changed, the name still the opened file) is the same
    error: later reads would mix its old and new bytes.
    """

    def __init__(self, path: Path):
        self._path = path
        try:
            self._file = safetensors.safe_open(str(path), framework="pt", backend="pread")
        except TypeError:  # safetensors < 0.8 has no backend argument
            self._file = safetensors.safe_open(str(path), framework="pt")
        self._opened = file_state(path)
        self._keys = tuple(self._file.keys())
        self._known = frozenset(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._known:
            raise KeyError(key)
        try:
            tensor = self._file.get_tensor(key)
        except _SAFETENSORS_ERRORS as exc:
            raise self._changed(key, str(exc)) from None
        now = file_state(self._path)
        # A name now naming another file (renamed over, deleted) leaves the opened one as it was.
        if now is not None and self._opened is not None and now[:2] == self._opened[:2] and now != self._opened:
            raise self._changed(key, "its size or modification time changed")
        return tensor

    def layout(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The tensor's shape and dtype, from the header: its bytes are not read."""
        if key not in self._known:
            raise KeyError(key)
        stored = self._file.get_slice(key)
        dtype = SAFETENSORS_DTYPES.get(stored.get_dtype())
        if dtype is None:
            raise InputError(
                f"{describe(self._path)}: tensor '{shown(key)}' has element type {stored.get_dtype()}, "
                "which torch has no type for"
            )
        return tuple(stored.get_shape()), dtype

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def _changed(self, key: str, reason: str) -> InputError:
        return InputError(
            f"{describe(self._path)}: tensor '{shown(key)}' can no longer be read as it was ({reason}): the file "
            "was truncated or written in place while pathcond read it. Run again once nothing writes it."
        )

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _utf8_path(path: Path) -> bool:
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_bytes(data: bytes, display: str) -> tuple[Mapping[str, torch.Tensor], SafetensorsPayload]:
    metadata = _read_metadata(io.BytesIO(data), len(data), display)
    return _load_tensors(lambda: safetensors.torch.load(data), display), SafetensorsPayload(metadata)


def _load_tensors(load: Callable[[], Mapping[str, torch.Tensor]], display: str) -> Mapping[str, torch.Tensor]:
    """Run safetensors' own reader (after our envelope checks), its errors as InputError."""
    try:
        return load()
    except _SAFETENSORS_ERRORS as exc:
        raise InputError(f"{display}: corrupt or truncated safetensors file ({exc})") from None


def _read_metadata(stream: BinaryIO, size: int, display: str) -> dict[str, str]:
    if size < 8:
        raise InputError(f"{display}: not a safetensors file: {size} bytes, too short even for the header length")
    length = int.from_bytes(stream.read(8), "little")
    if length > MAX_HEADER_BYTES:
        raise InputError(
            f"{display}: not a safetensors file: its header length field says {length} bytes "
            f"(safetensors allows at most {MAX_HEADER_BYTES})"
        )
    if 8 + length > size:
        raise InputError(
            f"{display}: truncated or not a safetensors file: the header claims {length} bytes "
            f"but only {size - 8} follow"
        )
    try:
        header = parse_json(stream.read(length), display, "the safetensors header")
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise InputError(f"{display}: not a safetensors file: its header is not JSON") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{display}: not a safetensors file: malformed header")
    return metadata


def _read_index(path: Path, display: str) -> tuple[Mapping[str, torch.Tensor], SafetensorsPayload]:
    weight_map, metadata = _index_entries(path, display)
    shard_files = sorted(set(weight_map.values()))
    # Every shard is checked before any is opened: an entry leaving the folder reads nothing.
    shard_paths = {file: contained_file(path.parent, file, display, "shard") for file in shard_files}
    params: ChainedTensors = ChainedTensors()
    shards = []
    for file in shard_files:
        tensors, payload = _read_file(shard_paths[file], f"{display}: shard '{shown(file)}'")
        listed = {key for key, shard_file in weight_map.items() if shard_file == file}
        if set(tensors) != listed:
            raise InputError(
                f"{display}: the index and shard '{shown(file)}' disagree: listed but absent: "
                f"{some_keys(listed - set(tensors))}; present but not listed: {some_keys(set(tensors) - listed)}"
            )
        params.add(tensors)
        shards.append(Shard(file, tuple(sorted(tensors)), payload.metadata))
    return params, SafetensorsPayload(metadata, tuple(shards))


def own_shards(path: Path) -> list[Path]:
    """The shards of the index at ``path`` that provably belong to it alone, and that replacing
    it may therefore delete. Each is:

    - named ``<stem>-NNNNN-of-NNNNN.safetensors`` after the index (``model`` for
      ``model.safetensors.index.json``), or that name tagged as pathcond tags companions, with no
      folder part, a regular file (not a link);
    - a safetensors file holding exactly the tensors the index maps to it, and nothing after them;
    - named by no other ``.json`` file in the folder.

    Nothing is listed when the index cannot be read.
    """
    try:
        weight_map, _ = _index_entries(path, str(path))
        stem = checkpoint_stem(path.name)
        own = []
        for file in sorted(set(weight_map.values())):
            numbered = re.findall(r"-(\d{5})-of-(\d{5})", file)
            if (
                any(is_companion_name(file, shard_name(stem, number, total)) for number, total in numbered)
                and _holds_exactly(path.parent / file, {k for k, f in weight_map.items() if f == file})
                and not named_by_another_file(path, file, ".json")
            ):
                own.append(path.parent / file)
        return own
    except (OSError, ValueError, TypeError, KeyError, InputError):
        return []


def _holds_exactly(shard: Path, keys: set[str]) -> bool:
    """Whether ``shard`` is a safetensors file of exactly the tensors ``keys`` and nothing more."""
    if shard.is_symlink() or not shard.is_file():
        return False
    with open(shard, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        length = int.from_bytes(handle.read(8), "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            return False
        header = parse_json(handle.read(length), str(shard), "the safetensors header")
    if not isinstance(header, dict):
        return False
    entries = {key: entry for key, entry in header.items() if key != "__metadata__"}
    end = max((int(entry["data_offsets"][1]) for entry in entries.values()), default=0)
    return set(entries) == keys and 8 + length + end == size


class ChainedTensors(Mapping[str, torch.Tensor]):
    """The tensors of several shards as one mapping, each read from its own shard's mapping."""

    def __init__(self):
        self._owner: dict[str, Mapping[str, torch.Tensor]] = {}

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._owner.update(dict.fromkeys(tensors, tensors))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._owner[key][key]

    def layout(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return layout_of(self._owner[key], key)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def __iter__(self):
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


def index_shards(path: Path) -> list[Path]:
    """The shard files an index names (each inside the index's folder)."""
    weight_map, _ = _index_entries(path, str(path))
    return [contained_file(path.parent, file, str(path), "shard") for file in sorted(set(weight_map.values()))]


def _index_entries(path: Path, display: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The ``weight_map`` and ``metadata`` of a shard index, validated."""
    try:
        size = path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise InputError(f"{display}: a safetensors index of {size} bytes is refused (at most {MAX_INDEX_BYTES}).")
        index = parse_json(path.read_bytes().decode("utf-8"), display, "the index")
    except OSError as exc:
        raise InputError(f"{display}: cannot read the checkpoint index: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InputError(f"{display}: not a safetensors index: invalid JSON ({shown(str(exc))})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    metadata = index.get("metadata", {}) if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not isinstance(metadata, dict)
        or not all(isinstance(f, str) for f in weight_map.values())
    ):
        raise InputError(
            f'{display}: not a safetensors index: expected {{"metadata": {{...}}, "weight_map": {{key: shard file}}}}'
        )
    return weight_map, metadata


# -- writing ----------------------------------------------------------------------------------


def _tensors_to_write(
    params: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """Every checkpoint tensor, ``changed`` ones replaced, looked up (and so computed) only when written."""
    unknown = [key for key in changed if key not in params]
    if unknown:
        raise ValueError(f"changed tensor '{unknown[0]}' must replace a checkpoint tensor of the same shape and dtype")
    return ChainMap(changed, params)


def _write_file(
    destination: Path,
    tensors: Mapping[str, torch.Tensor],
    originals: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    keys: Sequence[str] | None = None,
) -> None:
    atomic_write(
        destination, lambda tmp: write_tensors(tensors, tmp, originals=originals, metadata=metadata, keys=keys)
    )


def write_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: Path,
    *,
    originals: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    keys: Sequence[str] | None = None,
) -> None:
    """Write a safetensors file holding the tensors ``keys`` (default: every key of
    ``originals``) with the values of ``tensors``, one tensor at a time: the header is laid out
    from ``originals`` (each written tensor must have its original's shape and dtype), then each
    tensor is fetched, written and let go, so a checkpoint is never held whole in memory
    (safetensors' own writer serialises it at once). The layout comes from the originals' header
    when they are read from a file: only the tensors' values are read, once."""
    if sys.byteorder != "little":
        raise OutputError("safetensors stores little-endian values; pathcond cannot write them on a big-endian machine")
    layouts = {key: _stored_layout(originals, key) for key in (originals if keys is None else keys)}
    order = sorted(layouts, key=lambda key: _layout_rank(layouts[key][0]) + (key,))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        dtype, shape, size = layouts[key]
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for key in order:
            tensor = tensors[key]
            if (tensor.dtype, tuple(tensor.shape)) != layouts[key][:2]:
                raise ValueError(f"changed tensor '{key}' must replace a checkpoint tensor of the same shape and dtype")
            out.write(memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor  # before the next tensor is computed, not when it is assigned


def _stored_layout(tensors: Mapping[str, torch.Tensor], key: str) -> tuple[torch.dtype, tuple[int, ...], int]:
    """A tensor's dtype, shape and size in bytes: what the header says of it."""
    shape, dtype = layout_of(tensors, key)
    return dtype, shape, math.prod(shape) * dtype.itemsize


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# save_file's layout: by dtype in this order (its Dtype enum reversed), then by name. Sizes never
# grow along it, so every tensor stays aligned; the header then equals save_file's.
_SAVE_FILE_DTYPE_ORDER = (
    "U64",
    "I64",
    "F64",
    "C64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)


def _layout_rank(dtype: torch.dtype) -> tuple[int, int]:
    name = _DTYPE_NAMES[dtype]
    known = _SAVE_FILE_DTYPE_ORDER.index(name) if name in _SAVE_FILE_DTYPE_ORDER else len(_SAVE_FILE_DTYPE_ORDER)
    return -torch.empty((), dtype=dtype).element_size(), known


def _write_sharded(
    tensors: Mapping[str, torch.Tensor],
    originals: Mapping[str, torch.Tensor],
    payload: SafetensorsPayload,
    destination: Path,
    added: Mapping[str, str],
    companion_name: Callable[[str], str],
) -> None:
    if not destination.name.endswith(".json"):
        raise OutputError(
            f"cannot write '{destination}': a sharded checkpoint is written as an index; "
            "name the output like 'model.safetensors.index.json'"
        )
    stem = checkpoint_stem(destination.name)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(payload.shards, start=1):
        file = companion_name(shard_name(stem, f"{number:05d}", f"{len(payload.shards):05d}"))
        _write_file(destination.with_name(file), tensors, originals, shard.metadata, keys=shard.keys)
        weight_map.update(dict.fromkeys(shard.keys, file))
    index = {"metadata": {**payload.metadata, **added}, "weight_map": dict(sorted(weight_map.items()))}
    text = json.dumps(index, indent=2) + "\n"
    atomic_write(destination, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# -- the format -------------------------------------------------------------------------------


class SafetensorsFormat:
    """Safetensors checkpoints (one file, or an index and its shards) with their architecture: the
    :class:`~.interface.Format`."""

    name = "safetensors"

    def detect(self, path: Path | None, structure: str | None) -> str | None:
        if path is not None:
            # Any .json is read as a shard index (the index reader explains what it expected);
            # onnx.load would otherwise parse it as a JSON ModelProto.
            if path.name.endswith(SHARD_INDEX_SUFFIX) or path.suffix.lower() == ".json":
                return "safetensors-index"
            if path.suffix == ".onnx":
                return None  # named an ONNX model, whatever its bytes look like
            if path.suffix == ".safetensors":
                return "safetensors"
        return "safetensors" if structure == "safetensors" else None

    def load(
        self,
        source: Path | bytes,
        *,
        arch: str | None,
        input_shape: InputShape | None,
        name: str | None,
        allow_unused: bool,
    ) -> LoadedModel:
        model = load_safetensors(source, arch=arch, input_shape=input_shape, name=name, allow_unused=allow_unused)
        for node in model.graph.inputs:
            # The spec's shapes are only known by running the network; its input bounds the cost.
            elements = math.prod(node.shape)
            refuse_beyond_memory(
                8 * INPUT_COPIES * elements,
                model.source,
                f"input '{shown(node.name)}' has shape {shown(str(tuple(node.shape)))} per example",
            )
        return model

    def write(
        self,
        model: LoadedModel,
        changed: Mapping[str, torch.Tensor],
        destination: Path,
        metadata: Mapping[str, str],
        *,
        companion_name: Callable[[str], str],
        self_contained: bool,
    ) -> None:
        write_safetensors(model, changed, destination, metadata, companion_name=companion_name)

    def check_streamable(self, model: LoadedModel) -> None:
        """A safetensors file has no size limit: any model can be sent to stdout."""

    def companions(self, path: Path) -> list[Path]:
        try:
            return index_shards(path)
        except (InputError, OSError, ValueError):
            return []  # not an index pathcond can read: it consists of itself

    def architecture_files(self, path: Path | None, arch: str | None) -> list[Path]:
        return architecture_files(path, arch)

    def own_companions(self, path: Path) -> list[Path]:
        return own_shards(path)


FORMAT = SafetensorsFormat()
