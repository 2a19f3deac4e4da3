"""Reading ONNX files: parsing (external data inside the model's folder only), nodes put in
dependency order, checks, older opsets converted in memory, input shapes, shape inference with
the shape arithmetic folded, the memory estimate, the stored tensors, the companions a model
names and owns, ONNX's reference evaluator, and a node's attributes."""

from __future__ import annotations

import heapq
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from math import prod
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import external_data_helper, numpy_helper, version_converter
from onnx.reference import ReferenceEvaluator

from ...errors import InputError, UnsupportedModelError, UsageError
from ..companions import external_data_name, file_holds, is_companion_name, named_by_another_file
from .common import InputShape, contained_file, refuse_beyond_memory, shapes_by_input
from .onnx_fold import fold_shape_arithmetic

# The opset the translator reads: an older model is converted to it in memory (the file written
# back keeps the model's own opset).
READ_OPSET = 13
# onnx.reference's BatchNormalization before opset 14 uses batch statistics whenever momentum is
# set, and before opset 9 returns a tuple: an older model is evaluated converted to this opset.
REFERENCE_OPSET = 14
# Initializers larger than this are weights to shape inference: it reads their dims, never their values.
SHAPE_DATA_MAX_ELEMENTS = 1024
TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
DEFAULT_DOMAINS = ("", "ai.onnx")
_FLOAT8_TYPES = {
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    onnx.TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    onnx.TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}
# The metadata onnxscript's rewriter puts on a node it made by a rewrite rule, and the rules that
# fold a BatchNorm into the Conv or Gemm before it (torch.onnx.export(dynamo=True) runs them).
_REWRITE_RULE_KEY = "pkg.onnxscript.rewriter.rule_name"
_BATCHNORM_FOLDS = ("FuseBatchNormIntoConv", "FuseBatchNormIntoConvTranspose", "FuseBatchNormIntoGemm")


def read_onnx(
    source: str | Path | bytes, input_shape: InputShape | None, label: str
) -> tuple[onnx.ModelProto, list[Path], dict[str, tuple[int, ...]], onnx.ModelProto, Sequence[onnx.NodeProto]]:
    """The model at ``source`` checked, with its external data loaded, as the file holds it; the
    external data files it was read from; each input's batch-free shape (``input_shape`` over
    what the model declares); the model as read, its shapes inferred and its shape arithmetic
    folded, the memory the passes will need checked; and the nodes of the model as read before
    folding, position by position (see :func:`readable_model`)."""
    model, external, serialized = _parse(source, label)
    order = dependency_order(model.graph, label)
    _check(model, order, serialized, label)
    del serialized  # the whole file (97 MB for ResNet-50): not held through the rest of the load
    graph_inputs = fed_inputs(model, label)
    given = shapes_by_input(input_shape, [i.name for i in graph_inputs], label)
    several = len(graph_inputs) > 1
    shapes = {i.name: _input_shape(i, given.get(i.name), label, several=several) for i in graph_inputs}
    readable = readable_model(model, order, label)
    inferred = infer_shapes(readable, shapes, label)
    if readable is not model:
        _put_back_weights(inferred, model, label)
    inferred = _folded(inferred, shapes, label)
    check_memory(value_shapes(inferred), inferred, label)
    return model, external, shapes, inferred, readable.graph.node


def batchnorm_folded_tensors(model: onnx.ModelProto) -> list[str]:
    """The stored inputs (weight, bias) of every node that onnxscript's rewriter made by folding a
    BatchNorm into it: their values are the folded ones, whatever their names (torch.export's
    optimiser keeps ``conv1.weight`` for the folded weight and names a new bias ``conv1.weight_bias``)."""
    folded = []
    for node in model.graph.node:
        # A node rewritten by several rules lists them all: "FuseBatchNormIntoConv, RemoveOptionalBias".
        rules = [
            rule.strip()
            for entry in node.metadata_props
            if entry.key == _REWRITE_RULE_KEY
            for rule in entry.value.split(",")
        ]
        if any(rule in _BATCHNORM_FOLDS for rule in rules):
            folded += [value for value in node.input[1:] if value]
    return list(dict.fromkeys(folded))


def _parse(source: str | Path | bytes, label: str) -> tuple[onnx.ModelProto, list[Path], bytes | None]:
    """The model with its external data loaded, the external data files it was read from, and
    the binary protobuf it was parsed from when that is the whole model (None when it was text
    or its tensors were read from external data)."""
    try:
        if isinstance(source, bytes):
            serialized = source
            model = onnx.load_from_string(source)
        else:
            # The format onnx.load would pick from the extension (text formats included); the
            # bytes are kept so that the checker need not serialise the model again.
            suffix = os.path.splitext(str(source))[1]
            file_format = onnx.serialization.registry.get_format_from_file_extension(suffix) or "protobuf"
            with open(source, "rb") as handle:
                data = handle.read()
            model = onnx.load_model_from_string(data, format=file_format)
            serialized = data if file_format == "protobuf" else None
    except FileNotFoundError as exc:
        raise InputError(f"cannot read '{label}': {exc.strerror or exc} ({exc.filename}).") from None
    except IsADirectoryError:
        raise InputError(f"cannot read '{label}': it is a directory, not an ONNX file.") from None
    except PermissionError:
        raise InputError(f"cannot read '{label}': permission denied.") from None
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise InputError(
            f"cannot read '{label}': it is not a valid ONNX model (the file may be truncated or "
            f"corrupted; the protobuf parser says: {one_line(exc)})."
        ) from None
    if not model.HasField("graph") or model.ir_version == 0 or not model.opset_import:
        raise InputError(f"cannot read '{label}': it is not an ONNX model (no graph, IR version or opset).")
    if not external_tensors(model):
        return model, [], serialized
    if isinstance(source, bytes):
        raise InputError(
            f"cannot read '{label}': its tensors live in external data files, which can only be found "
            "from the model's path; pass the .onnx file itself rather than its bytes."
        )
    return model, _load_external_data(model, Path(source), label), None


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in external_data_helper._get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]


def _external_location(tensor: onnx.TensorProto) -> str | None:
    return next((entry.value for entry in tensor.external_data if entry.key == "location"), None)


def _load_external_data(model: onnx.ModelProto, path: Path, label: str) -> list[Path]:
    """Read every external tensor's bytes, each location checked to lie inside the model's folder
    before anything is opened."""
    folder = path.parent
    tensors = external_tensors(model)
    files = {}
    for tensor in tensors:
        location = _external_location(tensor)
        files[location] = contained_file(folder, location, label, f"the external data of tensor '{tensor.name[:120]}'")
    for tensor in tensors:
        try:
            info = external_data_helper.ExternalDataInfo(tensor)
        except ValueError:
            entries = ", ".join(f"{e.key}={e.value!r}" for e in tensor.external_data if e.key in ("offset", "length"))
            raise InputError(
                f"{label}: tensor '{tensor.name[:120]}' has external data entries {entries[:300]}; offset and length "
                "must be non-negative integers (in bytes)."
            ) from None
        size = files[info.location].stat().st_size
        offset = info.offset or 0
        length = info.length if info.length is not None else size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise InputError(
                f"{label}: tensor '{tensor.name[:120]}' claims bytes {offset}..{offset + length} of its external data "
                f"file '{info.location}', which has {size}: the file is truncated or belongs to another model."
            )
        try:
            with open(files[info.location], "rb") as handle:
                handle.seek(offset)
                tensor.raw_data = handle.read(length)
        except OSError as exc:
            raise InputError(f"{label}: cannot read external data '{info.location}': {exc.strerror or exc}.") from None
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return list(dict.fromkeys(files.values()))


def external_data_files(path: Path) -> list[Path]:
    """The external data files an ONNX file on disk names (each inside its folder)."""
    if not _may_name_external_data(path):
        return []
    model = onnx.load(str(path), load_external_data=False)
    locations = dict.fromkeys(_external_location(t) for t in external_tensors(model))
    return [contained_file(path.parent, location, str(path), "external data") for location in locations]


def _may_name_external_data(path: Path) -> bool:
    """Whether the ONNX file at ``path`` may name external data files, told without parsing it
    (0.14 s for a 100 MB model, which loading it parses again; the search takes less than half):
    a ``.onnx`` file is read as binary protobuf, where onnx names each file in an entry keyed
    ``location``, stored as those bytes, so a file without them names none (anything but a
    regular file names none)."""
    return file_holds(path, b"location")


# Zero bytes an external data writer may leave between two tensors to align the next one.
ALIGNMENT_PADDING_MAX_BYTES = 65536


def own_external_data(path: Path) -> list[Path]:
    """The external data files that provably belong to the ONNX model at ``path`` alone, and
    that replacing it may therefore delete. Each is:

    - named ``<model file name>.data``, or that name tagged as pathcond tags companions
      (``out-1a2b3c4d.onnx.data``), with no folder part, a regular file (not a link);
    - exactly the model's tensors: their extents, in offset order, start at byte 0, never
      overlap, end at the file's last byte, and leave nothing between them but zero padding
      of less than 64 KiB (alignment);
    - named by no other ``.onnx`` file in the folder.

    Anything else the model names (``thesis.txt``, another model's weights) is never listed;
    nor is anything when the model cannot be parsed.
    """
    try:
        if not _may_name_external_data(path):
            return []
        model = onnx.load(str(path), load_external_data=False)
        extents: dict[str, list[tuple[int, int | None]]] = {}
        for tensor in external_tensors(model):
            info = external_data_helper.ExternalDataInfo(tensor)
            extents.setdefault(info.location, []).append((info.offset or 0, info.length))
        return [
            path.parent / location
            for location, spans in extents.items()
            if is_companion_name(location, external_data_name(path.name))
            and _exactly_covered(path.parent / location, spans)
            and not named_by_another_file(path, location, ".onnx")
        ]
    except (OSError, ValueError, TypeError, DecodeError):
        return []


def _exactly_covered(file: Path, spans: list[tuple[int, int | None]]) -> bool:
    if file.is_symlink() or not file.is_file():
        return False
    size = file.stat().st_size
    end = 0
    with open(file, "rb") as handle:
        for offset, length in sorted(spans):
            gap = offset - end
            if length is None or length < 0 or gap < 0 or gap >= ALIGNMENT_PADDING_MAX_BYTES:
                return False
            handle.seek(end)
            if handle.read(gap).strip(b"\0"):
                return False
            end = offset + length
    return end == size


def dependency_order(graph: onnx.GraphProto, label: str) -> list[onnx.NodeProto] | None:
    """The graph's nodes, each after the nodes whose outputs it reads (those of its subgraphs'
    nodes included), ties in the file's order; None when the file's order is one already.

    keras2onnx writes nodes out of order: onnxruntime runs such files, onnx's checker refuses
    them. A value that no node, initializer or graph input gives, and nodes that read each
    other's outputs in a cycle, are an input error naming them.
    """
    nodes = graph.node
    given = (
        {""}
        | {v.name for v in graph.input}
        | {t.name for t in graph.initializer}
        | {t.values.name for t in graph.sparse_initializer}
    )
    producer: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for value in node.output:
            producer.setdefault(value, index)
    for node in nodes:
        for value in node.input:
            if value not in given and value not in producer:
                raise InputError(
                    f"'{label}' is not a valid ONNX model: node '{node_label(node)[:120]}' ({node.op_type}) reads "
                    f"'{value[:120]}', which no node, initializer or graph input of the graph gives."
                )
    for output in graph.output:
        if output.name not in given and output.name not in producer:
            raise InputError(
                f"'{label}' is not a valid ONNX model: graph output '{output.name[:120]}' is given by "
                "no node, initializer or graph input of the graph."
            )
    # reads[i]: (value, producing node) for each value node i reads from another node.
    reads = [{(value, producer[value]) for value in _values_read(node) if value in producer} for node in nodes]
    if all(source < index for index, node_reads in enumerate(reads) for _, source in node_reads):
        return None
    waiting = [len({source for _, source in node_reads}) for node_reads in reads]
    readers: list[set[int]] = [set() for _ in nodes]
    for index, node_reads in enumerate(reads):
        for _, source in node_reads:
            readers[source].add(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) < len(nodes):
        raise InputError(
            f"'{label}' is not a valid ONNX model: its nodes form a cycle, "
            f"{_cycle(nodes, reads, set(order))}; no order of the nodes computes their values."
        )
    return [nodes[index] for index in order]


def _values_read(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads: its inputs and every value its subgraphs' nodes read."""
    values = set(node.input)
    for attribute in node.attribute:
        for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
            for inner in subgraph.node:
                values |= _values_read(inner)
    return values


def _cycle(nodes: Sequence[onnx.NodeProto], reads: list[set[tuple[str, int]]], placed: set[int]) -> str:
    """A cycle among the nodes not ``placed``, each of which reads a value of another one not
    placed, as "node 'a' (Add) reads 'v' of node 'b' (Relu), which reads ... of node 'a'"."""
    start = next(index for index in range(len(nodes)) if index not in placed)
    path: list[tuple[int, str]] = []
    seen: dict[int, int] = {}
    index = start
    while index not in seen:
        seen[index] = len(path)
        value, source = min((value, source) for value, source in reads[index] if source not in placed)
        path.append((index, value))
        index = source
    loop = path[seen[index] :]
    shown = [f"node '{node_label(nodes[position])[:120]}' ({nodes[position].op_type})" for position, _ in loop]
    steps = [f"reads '{value[:120]}' of {shown[(k + 1) % len(loop)]}" for k, (_, value) in enumerate(loop)]
    return f"{shown[0]} " + ", which ".join(steps)


def _check(model: onnx.ModelProto, order: list[onnx.NodeProto] | None, serialized: bytes | None, label: str) -> None:
    """onnx's checker on ``model``, with its nodes in ``order`` when given (else as they are, and
    given as ``serialized`` when those are its bytes: serialising a large model again costs more
    than checking it)."""
    if order is not None:
        checked = onnx.ModelProto()
        checked.CopyFrom(model)
        del checked.graph.node[:]
        checked.graph.node.extend(order)
    else:
        checked = serialized if serialized is not None else model
    try:
        onnx.checker.check_model(checked)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise InputError(f"'{label}' is not a valid ONNX model: {one_line(exc)}") from None


def default_opset(model: onnx.ModelProto) -> int | None:
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    return versions[0] if versions else None


def readable_model(model: onnx.ModelProto, order: list[onnx.NodeProto] | None, label: str) -> onnx.ModelProto:
    """The model as the translator reads it: ``model`` itself when its nodes are in dependency
    order and its opset is :data:`READ_OPSET` or later; else a copy whose weights hold no data
    (:func:`_put_back_weights` restores them by name after shape inference), its nodes in
    ``order``, converted in memory to :data:`READ_OPSET` by ``onnx.version_converter``.

    The converter keeps the names of values, initializers and nodes; what it adds (the
    ``Flatten`` and ``Reshape`` around an opset-9 ``Softmax``) exists in the model as read only.
    An ``Upsample`` or ``Resize``-10 is held through it (:func:`_hold_resizes`); an opset
    the installed onnx does not define is refused.
    """
    opset = default_opset(model)
    if opset is not None and opset > onnx.defs.onnx_opset_version():
        raise UnsupportedModelError(
            f"{label}: the model declares ONNX opset {opset}, which does not exist for the installed onnx "
            f"{onnx.__version__} (it defines opsets up to {onnx.defs.onnx_opset_version()}): no operator of the "
            "model has a known meaning. A file exported with a released opset is read (pathcond reads opsets 7 "
            f"and later, {READ_OPSET} and later without conversion)."
        )
    convert = opset is not None and opset < READ_OPSET
    if order is None and not convert:
        return model
    readable, _ = _without_weight_data(model)
    if order is not None:
        del readable.graph.node[:]
        readable.graph.node.extend(order)
    if not convert:
        return readable
    try:
        return _converted(readable, opset, READ_OPSET, label)
    except _CONVERTER_ERRORS as exc:
        raise _unconvertible(readable, opset, label, exc) from None


def _converted(model: onnx.ModelProto, opset: int, target: int, label: str) -> onnx.ModelProto:
    """``model``, of opset ``opset``, converted to opset ``target`` by onnx.version_converter,
    its Upsample and Resize-10 nodes held through the conversion (``model`` holds them after)."""
    _hold_resizes(model, opset, label)
    converted = version_converter.convert_version(model, target)
    _put_back_resizes(converted)
    return converted


# Upsample (opsets 7 to 9) and Resize-10 compute the source coordinate as asymmetric and, when
# nearest, round it down (onnxruntime agrees). onnx.version_converter makes them a Resize-11
# without attributes, whose defaults (half_pixel, round_prefer_floor) mean something else for a
# scale that is not an integer, under a new output name. They are held through the converter
# as nodes of a domain of pathcond's own, and put back as the Resize-13 that computes the same.
_HELD_DOMAIN = "pathcond.held_through_conversion"


def _hold_resizes(model: onnx.ModelProto, opset: int, label: str) -> None:
    """Every Upsample, and every Resize of opset 10, of ``model`` (opset ``opset`` < 13) moved to
    :data:`_HELD_DOMAIN` with its scales as input 1 (an Upsample-7 holds them as an attribute),
    which :func:`_put_back_resizes` makes a Resize-13 after conversion."""
    graph = model.graph
    if not any(_is_held(node, opset) for node in graph.node):
        return
    taken = (
        {name for node in graph.node for name in (*node.input, *node.output)}
        | {t.name for t in graph.initializer}
        | {v.name for v in graph.input}
    )
    # From the last node back, so that a Constant put in front of a node moves no node still to come.
    for position in reversed(range(len(graph.node))):
        node = graph.node[position]
        if not _is_held(node, opset):
            continue
        mode = string_attribute(node, "mode", "nearest")
        scales = next((list(a.floats) for a in node.attribute if a.name == "scales"), None)
        if scales is not None:
            name = _unused_name(f"{node_label(node)}.scales", taken)
            node.input.append(name)
            graph.node.insert(
                position,
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [name],
                    value=onnx.helper.make_tensor(name, onnx.TensorProto.FLOAT, [len(scales)], scales),
                ),
            )
            node = graph.node[position + 1]
        else:
            scales = _stored_floats(graph, node.input[1]) if len(node.input) > 1 else None
        if mode == "nearest" and scales is not None and min(scales) < 1:
            raise UnsupportedModelError(
                f"{label}: node '{node_label(node)[:120]}' ({node.op_type} of ONNX opset {opset}) shrinks an axis in "
                f"nearest mode (scales {[float(s) for s in scales]}): below a scale of 1 how it rounds is its "
                "runtime's own (onnxruntime rounds a Resize-10 its own way and refuses an Upsample), which no Resize "
                f"of a later opset computes; exported again with opset {READ_OPSET} or later, the model says how it "
                "rounds."
            )
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("mode", mode))
        node.domain = _HELD_DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(_HELD_DOMAIN, 1))


def _is_held(node: onnx.NodeProto, opset: int) -> bool:
    return node.domain in DEFAULT_DOMAINS and (node.op_type == "Upsample" or (node.op_type == "Resize" and opset == 10))


def _put_back_resizes(model: onnx.ModelProto) -> None:
    """Each node :func:`_hold_resizes` held, in the converted ``model``, as the Resize-13 that
    computes what it computed (asymmetric coordinates, floor rounding when nearest), with the
    node's own name and output."""
    held = [node for node in model.graph.node if node.domain == _HELD_DOMAIN]
    if not held:
        return
    for node in held:
        mode = string_attribute(node, "mode", "nearest")
        rounding = {"nearest_mode": "floor"} if mode == "nearest" else {}
        resize = onnx.helper.make_node(
            "Resize",
            [node.input[0], "", node.input[1]],
            list(node.output),
            name=node.name,
            mode=mode,
            coordinate_transformation_mode="asymmetric",
            **rounding,
        )
        node.CopyFrom(resize)
    kept = [entry for entry in model.opset_import if entry.domain != _HELD_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _unused_name(preferred: str, taken: set[str]) -> str:
    name, suffix = preferred, 1
    while name in taken:
        name, suffix = f"{preferred}_{suffix}", suffix + 1
    taken.add(name)
    return name


def _stored_floats(graph: onnx.GraphProto, value: str) -> list[float] | None:
    """The values of a small stored tensor (an initializer or a Constant node), or None."""
    for tensor in graph.initializer:
        if tensor.name == value:
            return [float(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
    for node in graph.node:
        if value in node.output:
            tensor = constant_tensor(node)
            return None if tensor is None else [float(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
    return None


# What onnx.version_converter raises: its C++ assertions and shape inference errors surface as these.
_CONVERTER_ERRORS = (RuntimeError, ValueError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def _unconvertible(model: onnx.ModelProto, opset: int, label: str, error: Exception) -> UnsupportedModelError:
    """The refusal of a model that the converter cannot take from ``opset`` to :data:`READ_OPSET`,
    naming the step (converted one opset at a time to find it) and the operator it fails on: the
    one the converter names, else those of the nodes it fails on alone, else those whose
    definition changes at that step."""
    step = opset
    for target in range(opset + 1, READ_OPSET + 1):
        try:
            model = version_converter.convert_version(model, target)
        except _CONVERTER_ERRORS as exc:
            error = exc
            break
        step = target
    message = one_line(error)
    ops = list(dict.fromkeys(n.op_type for n in model.graph.node if n.domain in DEFAULT_DOMAINS))
    named = {match.lower() for pattern in _CONVERTER_NAMES for match in re.findall(pattern, message)}
    changing = [op for op in ops if _changes_at(op, step + 1)]
    culprits = [op for op in ops if op.lower() in named] or _failing_alone(model, changing, step) or changing
    if culprits:
        nodes = [node_label(n) for n in model.graph.node if n.op_type in culprits and n.domain in DEFAULT_DOMAINS]
        shown_nodes = ", ".join(f"'{name[:80]}'" for name in nodes[:3]) + (
            f" and {len(nodes) - 3} more" if len(nodes) > 3 else ""
        )
        what = (
            f"operator {' or '.join(repr(op) for op in culprits)} of opset {opset} "
            f"(node{'s' if len(nodes) > 1 else ''} {shown_nodes})"
        )
    else:
        what = "the model"
    return UnsupportedModelError(
        f"{label}: the model uses ONNX opset {opset}; pathcond reads opset {READ_OPSET} and converts older models "
        f"to it in memory with onnx.version_converter, which cannot carry {what} from opset {step} to {step + 1} "
        f"(it says: {message}). Exported again with opset {READ_OPSET} or later, the model is read without conversion."
    )


def _failing_alone(model: onnx.ModelProto, ops: list[str], step: int) -> list[str]:
    """The ``ops`` of which some node of ``model`` (of opset ``step``), in a model of its own with
    its inputs and outputs typed as shape inference finds them in ``model``, is one the converter
    cannot take to opset ``step + 1``."""
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError):
        typed = model
    infos = {v.name: v for v in (*typed.graph.input, *typed.graph.value_info, *typed.graph.output)}
    for tensor in typed.graph.initializer:
        infos.setdefault(tensor.name, onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    failing = []
    for node in typed.graph.node:
        if node.op_type not in ops or node.op_type in failing or node.domain not in DEFAULT_DOMAINS:
            continue
        inputs, outputs = (
            [infos.get(v, onnx.ValueInfoProto(name=v)) for v in values if v] for values in (node.input, node.output)
        )
        alone = onnx.helper.make_model(
            onnx.helper.make_graph([node], "alone", inputs, outputs),
            opset_imports=[onnx.helper.make_opsetid("", step)],
            ir_version=model.ir_version,
        )
        try:
            version_converter.convert_version(alone, step + 1)
        except _CONVERTER_ERRORS:
            failing.append(node.op_type)
    return [op for op in ops if op in failing]


# Where the converter's messages name the operator: "No Adapter From Version $5 for Cast",
# "(op_type:TopK, node name: n1)", "adapt_scan_8_9: Assertion ...".
_CONVERTER_NAMES = (r"\bfor (\w+)\s*$", r"op_type:\s*(\w+)", r"adapt_([a-z0-9]+)_\d+_\d+")


def _changes_at(op: str, version: int) -> bool:
    """Whether the definition of ONNX operator ``op`` has a new version at opset ``version``."""
    try:
        return onnx.defs.get_schema(op, version, "").since_version == version
    except onnx.defs.SchemaError:
        return False


def _put_back_weights(inferred: onnx.ModelProto, model: onnx.ModelProto, label: str) -> None:
    """Give each initializer of ``inferred`` that :func:`readable_model` emptied the data of its
    namesake in ``model``; one the converter changed (its dims or type) has none to take."""
    originals = {t.name: t for t in model.graph.initializer}
    for tensor in inferred.graph.initializer:
        if prod(tensor.dims) <= SHAPE_DATA_MAX_ELEMENTS:
            continue
        original = originals.get(tensor.name)
        if original is None or original.dims != tensor.dims or original.data_type != tensor.data_type:
            raise UnsupportedModelError(
                f"{label}: converting the model from ONNX opset {default_opset(model)} to {READ_OPSET} (which "
                f"pathcond reads) changes its tensor '{tensor.name[:120]}', so the rescaled file could not keep the "
                f"model as it is; exported again with opset {READ_OPSET} or later, it is read without conversion."
            )
        tensor.CopyFrom(original)


def declared_batch(graph_inputs: Iterable[onnx.ValueInfoProto]) -> int | None:
    """The batch size the first input that declares one declares (None when all are symbolic):
    one batch for every input."""
    for graph_input in graph_inputs:
        dims = graph_input.type.tensor_type.shape.dim
        if len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return dims[0].dim_value
    return None


def fed_inputs(model: onnx.ModelProto, label: str) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds, in the graph's order: those that are not initializers
    (an initializer listed as an input is a stored tensor with an overridable default)."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    if not inputs:
        raise UnsupportedModelError(
            f"{label}: the ONNX graph has no input to feed (every graph input is an initializer): "
            "its outputs are constants, not a network of its input."
        )
    return inputs


def _input_shape(
    graph_input: onnx.ValueInfoProto, override: tuple[int, ...] | None, label: str, *, several: bool = False
) -> tuple[int, ...]:
    """The batch-free shape of one input: ``override`` if given, else the model's declared
    dimensions (``several``: the model has other inputs, so a shape must name its input)."""
    tensor_type = graph_input.type.tensor_type
    declared = (
        [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.HasField("shape")
        else None
    )
    if declared is not None and len(declared) < 2:
        raise InputError(
            f"{label}: input '{graph_input.name}' has rank {len(declared)}; pathcond expects a batch "
            "dimension followed by features or by channels and spatial dimensions."
        )
    if override is not None:
        override = tuple(int(d) for d in override)
        if any(d <= 0 for d in override):
            raise UsageError(f"{label}: --input-shape {override} must have positive dimensions.")
        if declared is not None and len(declared) != len(override) + 1:
            raise UsageError(
                f"{label}: --input-shape {override} has {len(override)} dimension(s), but input "
                f"'{graph_input.name}' has {len(declared) - 1} besides the batch dimension (the shape is batch-free)."
            )
        return override
    if declared is None or any(d is None for d in declared[1:]):
        shown = "unknown" if declared is None else "(" + ", ".join("?" if d is None else str(d) for d in declared) + ")"
        named = f"--input-shape {graph_input.name}:3,224,224"
        raise UsageError(
            f"{label}: the shape of input '{graph_input.name}' is {shown}; pass --input-shape "
            f"{'NAME:SHAPE' if several else '[NAME:]SHAPE'} with the dimensions after the batch dimension "
            + (
                f"(for example {named}), once for each input whose shape the model leaves open."
                if several
                else f"(for example --input-shape 3,224,224 or {named})."
            )
        )
    return tuple(declared[1:])


def infer_shapes(
    model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], label: str, batch: int | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` with each input's non-batch dimensions fixed to its entry of
    ``shapes`` and every value's shape inferred.

    One batch for every input: ``batch`` if given, else the first one an input declares, else 2.
    """
    copy, weights = _without_weight_data(model)
    graph_inputs = {i.name: i for i in copy.graph.input if i.name in shapes}
    # A concrete batch lets inference resolve the Shape → Gather → Concat → Reshape chains that
    # exporters emit for ``x.view(x.size(0), -1)``; 2 cannot be mistaken for a squeezable axis.
    if batch is None:
        batch = declared_batch(graph_inputs.values()) or 2
    for name, shape in shapes.items():
        dims = graph_inputs[name].type.tensor_type.shape.dim
        del dims[:]
        for d in (batch, *shape):
            dims.add().dim_value = d
    # Shapes recorded at export time hold for the export's input size only: infer them afresh.
    del copy.graph.value_info[:]
    for output in copy.graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError) as exc:
        given = (
            ", ".join(f"'{name}' {shape}" for name, shape in shapes.items())
            if len(shapes) > 1
            else str(next(iter(shapes.values())))
        )
        raise InputError(f"{label}: ONNX shape inference fails for input shape {given}: {one_line(exc)}") from None
    initializers = inferred.graph.initializer
    for index, tensor in weights.items():
        initializers[index].CopyFrom(tensor)
    return inferred


def _without_weight_data(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[int, onnx.TensorProto]]:
    """A copy of ``model`` whose initializers of more than :data:`SHAPE_DATA_MAX_ELEMENTS`
    elements hold no data, and those initializers (by position) to put back.

    Shape inference reads stored values only where they are shapes, sizes, bounds or scales
    (a handful of elements) and otherwise only the dims and element type; without the weights
    the model it serialises, infers and parses back is a few kilobytes instead of the whole
    checkpoint.
    """

    def is_weight(tensor: onnx.TensorProto) -> bool:
        return prod(tensor.dims) > SHAPE_DATA_MAX_ELEMENTS

    weights = {index: tensor for index, tensor in enumerate(model.graph.initializer) if is_weight(tensor)}
    return copy_without_data(model, is_weight), weights


def copy_without_data(model: onnx.ModelProto, emptied: Callable[[onnx.TensorProto], bool]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers for which ``emptied`` holds have no data (their name,
    dims and type kept; told apart by the test, not by name, so that each is exactly one the
    caller later fills): their bytes are never copied, which ``CopyFrom`` would do, and protobuf's
    arena would then keep them beside whatever replaces them (a third of a rescaled VGG-11-BN's
    peak; a 100 MB copy per shape inference of ResNet-50).

    The model, its graph and those initializers are copied field by field, everything under them
    whole. Fields the installed onnx does not know are copied only by ``CopyFrom``: a model with
    any at those levels is copied whole, and the data cleared after."""
    graph = model.graph
    cleared = {*TENSOR_DATA_FIELDS, "external_data", "data_location"}
    targets = [emptied(tensor) for tensor in graph.initializer]
    chosen = [tensor for tensor, target in zip(graph.initializer, targets) if target]
    proto = onnx.ModelProto()
    if not chosen or any(_has_unknown_fields(message) for message in (model, graph, *chosen)):
        proto.CopyFrom(model)
        for tensor, target in zip(proto.graph.initializer, targets):
            if target:
                for name in cleared:
                    tensor.ClearField(name)
        return proto
    _copy_fields(model, proto, leave_out={"graph"})
    _copy_fields(graph, proto.graph, leave_out={"initializer"})
    for tensor, target in zip(graph.initializer, targets):
        copy = proto.graph.initializer.add()
        if target:
            _copy_fields(tensor, copy, leave_out=cleared)
        else:
            copy.CopyFrom(tensor)
    return proto


def _copy_fields(source, target, *, leave_out: set[str]) -> None:
    for field, value in source.ListFields():
        if field.name in leave_out:
            continue
        if _is_repeated(field):
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _is_repeated(field) -> bool:
    # protobuf 6 added is_repeated; protobuf 7 removed label
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


def _has_unknown_fields(message) -> bool:
    """Whether ``message`` holds fields the installed onnx does not know; True when this protobuf
    cannot say (then the model is copied whole)."""
    try:
        from google.protobuf import unknown_fields
    except ImportError:  # protobuf before 4.22, which added the module: the message's own method
        try:
            return len(message.UnknownFields()) > 0
        except (AttributeError, NotImplementedError):
            # upb (4.21's default backend) raises NotImplementedError for UnknownFields(), a backend
            # without the method AttributeError: neither can tell, so the model is copied whole,
            # which keeps every field.
            return True
    return len(unknown_fields.UnknownFieldSet(message)) > 0


def _folded(inferred: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], label: str) -> onnx.ModelProto:
    """``inferred`` with its run-time shape arithmetic folded to constants, shapes inferred again."""
    first = next(iter(shapes))
    batch = next(i for i in inferred.graph.input if i.name == first).type.tensor_type.shape.dim[0].dim_value

    def other_batch(model: onnx.ModelProto) -> onnx.ModelProto | None:
        try:
            return infer_shapes(model, shapes, label, batch=batch + 1)
        except InputError:
            return None  # a graph fixed to its batch: every folded value counts as batch-dependent

    # Each pass can make more shapes known (a Slice with folded bounds gets an inferred shape
    # that later Shape nodes read): fold until nothing new becomes a constant.
    while True:
        folded = fold_shape_arithmetic(inferred, other_batch)
        if _constant_count(folded) == _constant_count(inferred):
            return inferred
        inferred = infer_shapes(folded, shapes, label, batch=batch)


def _constant_count(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "Constant" for node in model.graph.node)


def check_memory(shapes: dict[str, tuple[int | None, ...]], model: onnx.ModelProto, label: str) -> None:
    """Refuse, before allocating anything, a model whose passes cannot fit in the memory available.

    The estimate counts every activation the graph computes (float64, forward and backward
    of the diag(G) pass) and every stored tensor (original, rescaled and squared copies).
    """
    stored = {t.name for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    activation_elements = 0
    largest = ("", (), 0)
    for value, shape in shapes.items():
        if value in stored or not shape or any(d is None for d in shape):
            continue
        elements = math.prod(shape[1:]) if len(shape) > 1 else 1
        activation_elements += elements
        if elements > largest[2]:
            node = producer.get(value)
            largest = (node_label(node) if node is not None else value, shape[1:], elements)
    parameter_elements = sum(math.prod(t.dims) for t in model.graph.initializer)
    estimate = 8 * (2 * activation_elements + 4 * parameter_elements)
    node, shape, _ = largest
    refuse_beyond_memory(
        estimate,
        label,
        f"the largest activation is the output of node '{node[:120]}', of shape {tuple(shape)} per example",
    )


def read_tensors(model: onnx.ModelProto, label: str) -> dict[str, torch.Tensor]:
    """Every initializer and every ``Constant`` tensor, bit-exact, keyed by its ONNX name.

    A tensor whose stored data does not fit its declared dims or element type is an input
    error naming the tensor; only onnx's decoding is guarded, so a bug elsewhere stays a bug.
    """
    tensors = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        value = constant_tensor(node)
        if value is not None:
            tensors[node.output[0]] = value
    params = {}
    for key, proto in tensors.items():
        try:
            array = numpy_helper.to_array(proto)
        except (ValueError, TypeError) as exc:
            raise InputError(
                f"cannot read '{label}': tensor '{key[:120]}' holds data that does not match its declared shape "
                f"{tuple(proto.dims)} or element type ({one_line(exc)})."
            ) from None
        tensor = _to_torch(proto, array)
        if tensor is not None:
            params[key] = tensor
    return params


def constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The numeric tensor a ``Constant`` node holds, whichever attribute holds it, or None.

    ``value`` is returned as stored (the writer sets its data in place); ``value_float(s)``,
    ``value_int(s)`` and ``sparse_value`` as a new dense tensor (the writer turns a rescaled one
    into ``value``). Strings are no numeric tensor: None.
    """
    if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS or len(node.output) != 1:
        return None
    for a in node.attribute:
        if a.name == "value":
            return a.t
        if a.name in ("value_float", "value_floats", "value_int", "value_ints"):
            data_type = onnx.TensorProto.FLOAT if a.name.startswith("value_float") else onnx.TensorProto.INT64
            values = onnx.helper.get_attribute_value(a)
            dims = [len(values)] if a.name.endswith("s") else []
            return onnx.helper.make_tensor(
                node.output[0], data_type, dims, list(values) if a.name.endswith("s") else [values]
            )
        if a.name == "sparse_value":
            return _dense(a.sparse_tensor, node.output[0])
    return None


def _dense(sparse: onnx.SparseTensorProto, name: str) -> onnx.TensorProto:
    """A sparse tensor as the dense tensor it stands for (indices linear, [NNZ], or per axis, [NNZ, rank])."""
    values = numpy_helper.to_array(sparse.values).reshape(-1)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dims = tuple(int(d) for d in sparse.dims)
    dense = np.zeros(math.prod(dims), dtype=values.dtype)
    if indices.ndim == 2:
        indices = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(-1)
    dense[indices.reshape(-1)] = values
    return numpy_helper.from_array(dense.reshape(dims), name)


def _to_torch(proto: onnx.TensorProto, array: np.ndarray) -> torch.Tensor | None:
    """The tensor as torch holds it, or None for element types torch lacks (strings, fp8, ...)."""
    if proto.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if proto.data_type in _FLOAT8_TYPES:
        # Kept as torch's fp8 so that a weight stored this way is named in a clear refusal.
        return torch.from_numpy(array.view(np.uint8).copy()).view(_FLOAT8_TYPES[proto.data_type])
    try:
        return torch.from_numpy(np.array(array))  # a copy: to_array may return a read-only view
    except TypeError:
        return None


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def value_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Every value's inferred shape (None for an unknown dimension), initializers included."""
    shapes: dict[str, tuple[int | None, ...]] = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for info in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
    for node in model.graph.node:
        tensor = constant_tensor(node)
        if tensor is not None:
            shapes[node.output[0]] = tuple(tensor.dims)
    return shapes


def node_label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def reference_outputs(source: Path | bytes, inputs: np.ndarray | dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs on ``inputs`` by ONNX's own reference evaluator (independent of ours).

    ``inputs`` is the one input's array, or arrays by input name; each is cast to the element
    type the model declares for its input.
    """
    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source))
    graph_inputs = fed_inputs(model, "<reference>")
    arrays = inputs if isinstance(inputs, dict) else {graph_inputs[0].name: inputs}
    feeds = {
        i.name: np.asarray(arrays[i.name]).astype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
        for i in graph_inputs
    }
    return [np.asarray(o) for o in reference_evaluator(model).run(None, feeds)]


def reference_evaluator(model: onnx.ModelProto) -> ReferenceEvaluator:
    """ONNX's reference evaluator of ``model``, converted to :data:`REFERENCE_OPSET` first when older."""
    opset = default_opset(model)
    if opset is not None and opset < REFERENCE_OPSET:
        held = onnx.ModelProto()
        held.CopyFrom(model)
        model = _converted(held, opset, REFERENCE_OPSET, "<reference>")
    return ReferenceEvaluator(model)


# A node's attributes, read as the translator and the op handlers read them (``default`` where the
# node has none of that name).


def has_attribute(node: onnx.NodeProto, name: str) -> bool:
    return any(a.name == name for a in node.attribute)


def attribute(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def string_attribute(node: onnx.NodeProto, name: str, default: str) -> str:
    value = attribute(node, name, default)
    return value.decode() if isinstance(value, bytes) else value


def int_attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return int(attribute(node, name, default))


def float_attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    return float(attribute(node, name, default))


def ints_attribute(node: onnx.NodeProto, name: str, default: list[int] | None) -> list[int] | None:
    value = attribute(node, name, default)
    return None if value is None else [int(v) for v in value]
