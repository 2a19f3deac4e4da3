"""What every format module shares: messages' quoting, input shapes, contained file names,
bounded JSON, the memory check and the weights' element types. Imports nothing of ``formats/``."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

try:
    import resource
except ImportError:  # Windows: no address-space limit to honour
    resource = None

import numpy as np

from ...engine.layouts import stand_ins
from ...engine.rules import rule_for
from ...errors import InputError, UsageError
from ..fileio import describe

if TYPE_CHECKING:
    import torch

    from ...engine.graph import Graph


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
            raise UsageError(
                f"{label}: --input-shape names {', '.join(repr(shown(n)) for n in unknown)}, which "
                f"is not an input of the model (its inputs: {names})."
            )
        return dict(input_shape)
    if len(inputs) != 1:
        raise UsageError(
            f"{label}: one input shape was given, but the model has {len(inputs)} inputs ({names}); "
            "give each its shape by name: --input-shape NAME:SHAPE, once per input."
        )
    return {inputs[0]: input_shape}


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
        raise InputError(
            f"{label}: {what} '{shown(name)}' {problem} (looked for in '{shown(os.path.abspath(folder))}')."
        )
    return path


def parse_json(text: str | bytes, label: str, what: str):
    """``json.loads`` with nesting refused beyond :data:`MAX_JSON_DEPTH` (the parser recurses)."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InputError(f"{label}: {what} nests {depth} levels deep (at most {MAX_JSON_DEPTH} are accepted).")
    return json.loads(text)


def _json_depth(text: str | bytes) -> int:
    """Deepest bracket nesting outside strings, counted without parsing."""
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
        raise InputError(f"{source}: the network's tensors cannot be rescaled:", problems)


def _bias_size_problem(node, params: Mapping[str, torch.Tensor]) -> str | None:
    """A layer's bias holds one value per output unit: a bias broadcast from fewer values (ONNX
    allows a [1] bias for Gemm) ties the units together, and cannot be rescaled unit by unit."""
    rule = rule_for(node)
    keys = node.parameter_keys()
    weight, bias = params.get(keys.get("weight", "")), params.get(keys.get("bias", ""))
    if (
        weight is None
        or bias is None
        or not hasattr(rule, "out_channels")
        or weight.dim() not in type(node).roles["weight"]
    ):
        return None
    units = rule.out_channels(node, params)
    if bias.dim() == 1 and bias.numel() == units:
        return None
    return (
        f"tensor '{shown(keys['bias'])}' (bias of '{shown(node.name)}') has shape {tuple(bias.shape)}; the layer has "
        f"{units} output units and needs one bias value for each"
    )


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit and by the
    address space left under its limit (``ulimit -v``); None if unknown."""
    available = address_space_left()
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    available = free if available is None else min(available, free)
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


def address_space_left() -> int | None:
    """Bytes of address space this process may still map under its limit (``ulimit -v``,
    RLIMIT_AS), which every allocation and thread stack counts against whether or not it is
    touched; None without a limit, or where the mapped size is unknown (no /proc)."""
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            mapped = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        return None
    return max(limit - mapped, 0)


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


# Keys (and layers of keys) a message names before it says how many more there are.
KEYS_SHOWN = 20


def some_keys(keys: set[str]) -> str:
    """``keys`` sorted and quoted for a message, at most :data:`KEYS_SHOWN` of them, or ``none``."""
    listed = sorted(keys)
    if not listed:
        return "none"
    text = ", ".join(shown(k) for k in listed[:KEYS_SHOWN])
    return text + (f" and {len(listed) - KEYS_SHOWN} more" if len(listed) > KEYS_SHOWN else "")
