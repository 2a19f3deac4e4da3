"""Checkpoint formats: detect, load and write. Every loader returns a :class:`LoadedModel`."""

from __future__ import annotations

import io
import json
import math
import os
import pickletools
import re
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...engine.layouts import stand_ins
from ...engine.model import LoadedModel
from ...errors import InputError, UsageError
from ..fileio import describe, file_state

if TYPE_CHECKING:
    import torch

    from ...engine.graph import Graph

SHARD_INDEX_SUFFIX = ".safetensors.index.json"


TORCH_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
# A MODEL named so is a spec given in place of the checkpoint (a .json MODEL is read as a shard index).
YAML_SUFFIXES = (".yaml", ".yml")
# torch.save writes a zip archive (since 1.6) or a bare pickle (protocol 2 to 5) before that.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))
# Names and keys quoted in messages are cut to this many characters.
SHOWN_CHARS = 120
# Index and spec JSON nested deeper than this is refused before parsing (Python's parser recurses).
MAX_JSON_DEPTH = 64
# Fraction of the available memory the passes may plan to use.
MEMORY_SHARE = 0.8
# float64 copies of a spec network's input the passes hold at least (a verification batch of 8, twice).
INPUT_COPIES = 16


# A batch-free input shape: one shape for a model with one input, or a shape per input name.
InputShape = tuple[int, ...] | Mapping[str, tuple[int, ...]]


def shapes_by_input(input_shape: InputShape | None, inputs: Sequence[str], label: str) -> dict[str, tuple[int, ...]]:
    """The batch-free shape given for each input, by name (inputs without one are left out).

    ``input_shape`` is one shape, for a model with a single input, or a mapping from input
    names; a name the model has no input for, or one shape for several inputs, is a usage error.
    """
    if input_shape is None:
        return {}
    names = ", ".join(f"'{shown(name)}'" for name in inputs) or "none"
    if isinstance(input_shape, Mapping):
        unknown = [name for name in input_shape if name not in inputs]
        if unknown:
            raise UsageError(f"{label}: --input-shape names {', '.join(repr(shown(n)) for n in unknown)}, which "
                             f"is not an input of the model (its inputs: {names}).")
        return dict(input_shape)
    if len(inputs) != 1:
        raise UsageError(f"{label}: one input shape was given, but the model has {len(inputs)} inputs ({names}); "
                         "give each its shape by name: --input-shape NAME:SHAPE, once per input.")
    return {inputs[0]: input_shape}


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


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters, printable on any terminal, for messages."""
    text = describe(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def contained_file(folder: Path, name: object, label: str, what: str) -> Path:
    """``folder / name`` when ``name`` is a relative path that stays inside ``folder``.

    ``name`` comes from the file being read (a shard of an index, an ONNX external data
    location): an absolute path, a ``..`` component or a symbolic link that leaves ``folder``
    is refused before anything is opened, as is anything that is not a regular file.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InputError(f"{label}: {what} {shown(repr(name))} is not a file name.")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise InputError(
            f"{label}: {what} '{shown(name)}' points outside the model's folder; pathcond only reads files "
            f"inside '{shown(str(folder))}' (no absolute paths, no '..'). Nothing was read."
        )
    path = folder / relative
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise InputError(
            f"{label}: {what} '{shown(name)}' is a symbolic link that leaves the model's folder "
            f"'{shown(str(folder))}'; pathcond does not follow it. Nothing was read."
        )
    if not path.is_file():
        problem = "does not exist" if not os.path.lexists(path) else "is not a regular file"
        raise InputError(f"{label}: {what} '{shown(name)}' {problem}.")
    return path


def parse_json(text: str | bytes, label: str, what: str):
    """``json.loads`` with nesting refused beyond :data:`MAX_JSON_DEPTH` (the parser recurses)."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InputError(f"{label}: {what} nests {depth} levels deep (at most {MAX_JSON_DEPTH} are accepted).")
    return json.loads(text)


def _json_depth(text: str | bytes) -> int:
    """Deepest bracket nesting outside strings, counted without parsing."""
    import numpy as np

    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    data = _JSON_STRING.sub(b"", data)
    codes = np.frombuffer(data, dtype=np.uint8)
    steps = np.zeros(codes.shape, dtype=np.int64)
    steps[(codes == 0x5B) | (codes == 0x7B)] = 1
    steps[(codes == 0x5D) | (codes == 0x7D)] = -1
    return int(np.cumsum(steps).max()) if steps.size else 0


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def check_readable(path: Path) -> None:
    """A regular file that can be opened, or an InputError saying why not (exit 3)."""
    label = shown(str(path), 300)
    try:
        is_dir = path.is_dir()
        exists = is_dir or path.exists()
    except OSError as exc:  # a name too long for the file system, a loop of links, ...
        raise InputError(f"cannot read '{label}': {exc.strerror or exc}.") from None
    if not exists:
        raise InputError(f"cannot read '{label}': no such file.")
    if is_dir:
        raise InputError(f"cannot read '{label}': it is a directory, not a checkpoint file.")
    if not path.is_file():
        raise InputError(f"cannot read '{label}': it is not a regular file (a FIFO, device or socket).")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"cannot read '{label}': {exc.strerror}.") from None


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
    if kind == "onnx":
        from google.protobuf import json_format, text_format

        from .onnx_format import load_onnx

        if arch is not None:
            raise InputError(f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph.")
        try:
            model = load_onnx(source, input_shape=input_shape, name=name)
        except (text_format.Error, json_format.Error) as exc:
            # onnx.load picks a text parser from extensions such as .textproto or .pbtxt.
            label = name or str(source)
            raise InputError(f"cannot read '{label}': it is not a valid ONNX model ({exception_line(exc)}).") from None
        check_weight_types(model.graph, model.params, model.source)
    else:
        from .safetensors_format import load_safetensors

        model = load_safetensors(source, arch=arch, input_shape=input_shape, name=name, allow_unused=allow_unused)
        for node in model.graph.inputs:
            # The spec's shapes are only known by running the network; its input bounds the cost.
            elements = math.prod(node.shape)
            refuse_beyond_memory(8 * INPUT_COPIES * elements, model.source,
                                 f"input '{shown(node.name)}' has shape {shown(str(tuple(node.shape)))} per example")
    model.file_states = {path: file_state(path) for path in model.files}
    return model


# Element types the passes compute with; anything else (fp8, integers) cannot be a weight.
WEIGHT_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def check_weight_types(graph: Graph, params: Mapping[str, torch.Tensor], source: str) -> None:
    """Every tensor the network reads is a non-empty float16/bfloat16/float32/float64 tensor."""
    params = stand_ins(params)
    problems = []
    for node in graph.nodes:
        for role, key in node.parameter_keys().items():
            tensor = params.get(key)
            if tensor is None:
                continue
            if str(tensor.dtype) not in WEIGHT_DTYPES:
                problems.append(
                    f"tensor '{shown(key)}' ({role} of '{shown(node.name)}') has element type "
                    f"{str(tensor.dtype).removeprefix('torch.')}; pathcond rescales float16, bfloat16, float32 "
                    "and float64 weights (convert fp8 or quantised weights to one of them first)"
                )
            elif tensor.numel() == 0:
                problems.append(
                    f"tensor '{shown(key)}' ({role} of '{shown(node.name)}') is empty (shape {tuple(tensor.shape)}): "
                    "a layer with no units has nothing to rescale"
                )
        problem = _bias_size_problem(node, params)
        if problem:
            problems.append(problem)
    if problems:
        raise InputError(f"{source}: the network's tensors cannot be rescaled:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def _bias_size_problem(node, params: Mapping[str, torch.Tensor]) -> str | None:
    """A layer's bias holds one value per output unit: a bias broadcast from fewer values (ONNX
    allows a [1] bias for Gemm) ties the units together, and cannot be rescaled unit by unit."""
    from ...engine.rules import rule_for

    rule = rule_for(node)
    keys = node.parameter_keys()
    weight, bias = params.get(keys.get("weight", "")), params.get(keys.get("bias", ""))
    if weight is None or bias is None or not hasattr(rule, "out_channels") or weight.dim() not in type(node).roles["weight"]:
        return None
    units = rule.out_channels(node, params)
    if bias.dim() == 1 and bias.numel() == units:
        return None
    return (f"tensor '{shown(keys['bias'])}' (bias of '{shown(node.name)}') has shape {tuple(bias.shape)}; the layer has "
            f"{units} output units and needs one bias value for each")


def checkpoint_files(path: Path) -> list[Path]:
    """The files a checkpoint on disk consists of (the file itself first), for replacing it.

    Only files inside the checkpoint's folder are listed; an unreadable or foreign file is
    just itself. Never raises.
    """
    from google.protobuf.message import DecodeError

    files = [path]
    try:
        if path.name.endswith(".json"):
            from .safetensors_format import index_shards

            files += index_shards(path)
        elif path.suffix == ".onnx":
            from .onnx_format import external_data_files

            files += external_data_files(path)
    except (InputError, OSError, ValueError, DecodeError):
        pass  # not a checkpoint pathcond can read: it consists of itself
    return files


def replaced_companions(path: Path) -> tuple[list[Path], list[Path]]:
    """The companion files of the checkpoint at ``path``: those provably its own, which replacing
    it deletes (see ``own_shards`` and ``own_external_data``), and the others it names, which are
    left in place. Never raises."""
    named = checkpoint_files(path)[1:]
    if path.name.endswith(".json"):
        from .safetensors_format import own_shards

        own = own_shards(path)
    elif path.suffix == ".onnx":
        from .onnx_format import own_external_data

        own = own_external_data(path)
    else:
        own = []
    return own, [file for file in named if file not in own]


def named_by_another_file(path: Path, name: str, suffix: str) -> bool:
    """Whether a file ending in ``suffix`` beside ``path``, other than ``path``, holds the bytes
    of ``name`` (a model or index that names it as its data must): a cheap scan, erring towards
    yes."""
    import mmap

    needle = name.encode("utf-8", "surrogateescape")
    for entry in os.scandir(path.parent):
        if not entry.name.lower().endswith(suffix) or not entry.is_file() or os.path.samefile(entry.path, path):
            continue
        with open(entry.path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                continue
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(needle) >= 0:
                    return True
    return False


def check_streamable(model: LoadedModel) -> None:
    """Refuse, before any work, a model that cannot be sent to stdout as one file: an ONNX
    model whose tensors, all inline, exceed what protobuf holds in one message (2 GiB)."""
    if model.format != "onnx":
        return
    from ...errors import OutputError
    from .onnx_format import PROTOBUF_MAX_BYTES

    size = model.payload.ByteSize()
    if size > PROTOBUF_MAX_BYTES:
        raise OutputError(
            f"{shown(model.source)}: cannot send the rescaled model to stdout (-o -): stdout takes one "
            f"self-contained file, and with its external data inline this model takes {size / 2**30:.3g} GiB, "
            "beyond the 2 GiB protobuf allows; write it with -o FILE.onnx instead (its large tensors then go "
            "to an external data file beside it). Nothing was written."
        )


def files_read(path: Path | None, arch: str | None) -> list[Path]:
    """Every file a run on checkpoint ``path`` (None for stdin) with ``--arch arch`` may read,
    known before loading, the checkpoint first: its shards or external data, the spec file, the
    sidecar specs beside it when ``arch`` is not given (whether or not the embedded spec makes
    reading one unnecessary), the Python source of a factory. Never raises."""
    from .safetensors_format import SPEC_SUFFIXES, sidecar_candidates

    files = checkpoint_files(path) if path is not None else []
    if arch is not None and arch.lower().endswith(SPEC_SUFFIXES):
        files.append(Path(arch))
    elif arch is not None and ":" in arch:
        from .fx_import import factory_source_files

        files += factory_source_files(arch)
    elif arch is None and path is not None and path.suffix != ".onnx":
        files += [candidate for candidate in sidecar_candidates(path) if os.path.lexists(candidate)]
    return files


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit; None if unknown."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            left = int(limit) - used
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def refuse_beyond_memory(estimate: int, label: str, detail: str) -> None:
    """InputError when ``estimate`` bytes exceed the memory available (unknown memory: no check)."""
    available = available_memory()
    if available is not None and estimate > MEMORY_SHARE * available:
        raise InputError(
            f"{label}: the passes over this network need about {_gib(estimate)} of memory, and "
            f"{_gib(available)} is available; {detail}. Nothing was allocated. Check the input shape "
            "(--input-shape), or run on a machine with more memory."
        )


def _gib(size: int) -> str:
    try:
        return f"{size / 2**30:.3g} GiB"
    except OverflowError:  # an estimate from a spec's integers has no bound
        return f"10^{math.log10(size) - 30 * math.log10(2):.0f} GiB"


def exception_line(exc: BaseException) -> str:
    """An exception as one line of at most :data:`EXCEPTION_CHARS` characters, for a message (it
    may quote a file, or a third-party library's multi-line report)."""
    return shown(" ".join(f"{type(exc).__name__}: {exc}".split()), EXCEPTION_CHARS)


EXCEPTION_CHARS = 300


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
    if model.format == "onnx":
        from .onnx_format import write_onnx

        write_onnx(model, changed, destination, metadata, companion_name=companion_name,
                   self_contained=self_contained)
    elif model.format == "safetensors":
        from .safetensors_format import write_safetensors

        write_safetensors(model, changed, destination, metadata, companion_name=companion_name)
    else:
        raise InputError(f"{model.source}: models of format '{model.format}' are written with torch, not by pathcond.")
