"""ONNX import and export: an ONNX ReLU network as a :class:`Graph`, and the rescaled file back.

Import translates the nodes that carry the activation (the values computed from the graph
input) into graph nodes; everything else — weight initializers, ``Constant`` nodes, the
``Transpose``/``Identity`` exporters put in front of weights, and shape arithmetic feeding
``Reshape`` — is static and only read. Shapes come from ONNX shape inference (with data
propagation, so the ``Shape → Gather → Concat`` chains of the TorchScript exporter resolve).

Export copies the original ``ModelProto`` and replaces only the tensors the rescaling changed,
so every other byte of the model (opset, producer, doc strings, untouched tensors) survives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from math import prod
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError
from onnx import external_data_helper, numpy_helper

from ...engine.graph import (
    AdaptiveAvgPool, Add, AvgPool, BatchNorm, ChannelAffine, ChannelBias, Concat, Conv, ConvTranspose, Flatten, Graph,
    Identity, Input, LeakyReLU, Linear, MaxPool, Node, Pad, PReLU, ReLU, Scale, Upsample,
)
from ...engine.model import LoadedModel
from ...errors import InputError, OutputError, UnsupportedModelError, UsageError
from ..companions import external_data_name, is_companion_name, named_by_another_file
from ..fileio import atomic_write, describe, output_error_from
from .common import (InputShape, check_weight_types, contained_file, exception_line, refuse_beyond_memory,
                     shapes_by_input, shown)
from .movement import UnsupportedMovement, movement_layer
from .offenders import grouped, offender_note
from .onnx_fold import SHAPE_QUERIES, fold_shape_arithmetic
from .spec import LAYER_TYPES

MIN_OPSET = 13
# A model read with external data is written with its float initializers of at least this many
# bytes in an external data file (onnx's own default threshold); everything else stays inline.
EXTERNAL_MIN_BYTES = 1024
# The largest message protobuf serialises: a self-contained model must fit in it.
PROTOBUF_MAX_BYTES = 2**31 - 1
# Initializers larger than this are weights to shape inference: it reads their dims, never their values.
SHAPE_DATA_MAX_ELEMENTS = 1024
_TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                       "string_data")
DEFAULT_DOMAINS = ("", "ai.onnx")

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
}
_ONNX_TYPE_OF = {dtype: onnx_type for onnx_type, dtype in _FLOAT_TYPES.items()}
_FLOAT8_TYPES = {
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    onnx.TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    onnx.TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}


_NOT_HOMOGENEOUS = {
    "Sigmoid", "Tanh", "Gelu", "Erf", "Softmax", "LogSoftmax", "LayerNormalization", "Elu", "Selu",
    "Celu", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "Mish", "Exp", "Log", "Sqrt", "Pow",
    "InstanceNormalization", "GroupNormalization", "LpNormalization", "Clip", "Reciprocal", "Div", "Mul",
    "MatMul", "Einsum", "Attention", "Cos", "Sin", "Abs", "Neg", "ReduceMax", "ReduceSum", "ReduceL2", "Tan",
    "HardSwish", "Swish", "ThresholdedRelu", "Shrink",
}


class _Unsupported(Exception):
    """Why one ONNX node cannot become part of the ReLU DAG (collected, never shown alone)."""


class _NotHomogeneous(_Unsupported):
    """The node computes a function that is not positively homogeneous (grouped by op type)."""


# --------------------------------------------------------------------------- reading


def load_onnx(
    source: str | Path | bytes,
    *,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    name: str | None = None,
) -> LoadedModel:
    """Read an ONNX ReLU network: its DAG, every tensor it stores, and the model for writing back.

    ``input_shape`` (batch excluded; or ``{input name: shape}``, the only form for a model with
    several inputs) overrides the shape the model declares and is required for each input with
    a symbolic non-batch dimension. Each graph input becomes an input node of the DAG. ``params``
    holds every initializer and ``Constant`` tensor by ONNX name, plus, for a stored tensor that several layers read
    through ``Identity`` nodes, one copy per such Identity keyed by its output name.
    """
    label = name or (str(source) if not isinstance(source, bytes) else "<stdin>")
    model, external, serialized = _parse(source, label)
    _check(model, serialized, label)
    del serialized  # the whole file (97 MB for ResNet-50): not held through the rest of the load
    graph_inputs = fed_inputs(model, label)
    given = shapes_by_input(input_shape, [i.name for i in graph_inputs], label)
    several = len(graph_inputs) > 1
    shapes = {i.name: _input_shape(i, given.get(i.name), label, several=several) for i in graph_inputs}
    inferred = _folded(_infer_shapes(model, shapes, label), shapes, label)
    check_memory(_value_shapes(inferred), inferred, label)
    params = _read_tensors(model, label)
    translation = _Translator(inferred, label, read_nodes=model.graph.node, written=model.graph)
    graph = translation.translate(shapes)
    for alias, key in translation.aliases.items():
        params[alias] = params[key].clone()
    for alias, key, node_index, position in translation.splits:
        # One stored tensor read by several layers (torch.export deduplicates equal tensors,
        # e.g. zero biases and running means), or by a layer and another node: each extra
        # reader gets its own copy.
        params[alias] = params[key].clone()
        copy = onnx.TensorProto()
        copy.CopyFrom(translation.stored_proto(key))
        copy.name = alias
        model.graph.initializer.append(copy)
        model.graph.node[node_index].input[position] = alias
    files = [] if isinstance(source, bytes) else [Path(source), *external]
    return LoadedModel(graph=graph, params=params, format="onnx", source=label, payload=model, files=files,
                       arch_source="onnx graph", warnings=translation.notes)


# The metadata onnxscript's rewriter puts on a node it made by a rewrite rule, and the rules that
# fold a BatchNorm into the Conv or Gemm before it (torch.onnx.export(dynamo=True) runs them).
_REWRITE_RULE_KEY = "pkg.onnxscript.rewriter.rule_name"
_BATCHNORM_FOLDS = ("FuseBatchNormIntoConv", "FuseBatchNormIntoConvTranspose", "FuseBatchNormIntoGemm")


def batchnorm_folded_tensors(model: onnx.ModelProto) -> list[str]:
    """The stored inputs (weight, bias) of every node that onnxscript's rewriter made by folding a
    BatchNorm into it: their values are the folded ones, whatever their names (torch.export's
    optimiser keeps ``conv1.weight`` for the folded weight and names a new bias ``conv1.weight_bias``)."""
    folded = []
    for node in model.graph.node:
        # A node rewritten by several rules lists them all: "FuseBatchNormIntoConv, RemoveOptionalBias".
        rules = [rule.strip() for entry in node.metadata_props if entry.key == _REWRITE_RULE_KEY
                 for rule in entry.value.split(",")]
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
            f"corrupted; the protobuf parser says: {_one_line(exc)})."
        ) from None
    if not model.HasField("graph") or model.ir_version == 0 or not model.opset_import:
        raise InputError(f"cannot read '{label}': it is not an ONNX model (no graph, IR version or opset).")
    if not _external_tensors(model):
        return model, [], serialized
    if isinstance(source, bytes):
        raise InputError(
            f"cannot read '{label}': its tensors live in external data files, which can only be found "
            "from the model's path; pass the .onnx file itself rather than its bytes."
        )
    return model, _load_external_data(model, Path(source), label), None


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in external_data_helper._get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]


def _external_location(tensor: onnx.TensorProto) -> str | None:
    return next((entry.value for entry in tensor.external_data if entry.key == "location"), None)


def _load_external_data(model: onnx.ModelProto, path: Path, label: str) -> list[Path]:
    """Read every external tensor's bytes, each location checked to lie inside the model's folder
    before anything is opened."""
    folder = path.parent
    tensors = _external_tensors(model)
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
    model = onnx.load(str(path), load_external_data=False)
    locations = dict.fromkeys(_external_location(t) for t in _external_tensors(model))
    return [contained_file(path.parent, location, str(path), "external data") for location in locations]


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
        model = onnx.load(str(path), load_external_data=False)
        extents: dict[str, list[tuple[int, int | None]]] = {}
        for tensor in _external_tensors(model):
            info = external_data_helper.ExternalDataInfo(tensor)
            extents.setdefault(info.location, []).append((info.offset or 0, info.length))
        return [path.parent / location for location, spans in extents.items()
                if is_companion_name(location, external_data_name(path.name))
                and _exactly_covered(path.parent / location, spans)
                and not named_by_another_file(path, location, ".onnx")]
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


def _check(model: onnx.ModelProto, serialized: bytes | None, label: str) -> None:
    """onnx's checker on ``model``, given as ``serialized`` when those are its bytes (serialising
    a large model again costs more than checking it)."""
    try:
        onnx.checker.check_model(serialized if serialized is not None else model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise InputError(f"'{label}' is not a valid ONNX model: {_one_line(exc)}") from None
    opset = _default_opset(model)
    if opset is not None and opset < MIN_OPSET:
        raise UnsupportedModelError(
            f"{label}: the model uses ONNX opset {opset}; pathcond reads opset {MIN_OPSET} and later. "
            f"Re-export it with opset_version={MIN_OPSET} or newer."
        )


def _default_opset(model: onnx.ModelProto) -> int | None:
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    return versions[0] if versions else None


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
            "its outputs are constants, not a network of its input.")
    return inputs


def _input_shape(graph_input: onnx.ValueInfoProto, override: tuple[int, ...] | None, label: str,
                 *, several: bool = False) -> tuple[int, ...]:
    """The batch-free shape of one input: ``override`` if given, else the model's declared
    dimensions (``several``: the model has other inputs, so a shape must name its input)."""
    tensor_type = graph_input.type.tensor_type
    declared = (
        [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.HasField("shape") else None
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
            + (f"(for example {named}), once for each input whose shape the model leaves open." if several
               else f"(for example --input-shape 3,224,224 or {named}).")
        )
    return tuple(declared[1:])


def _infer_shapes(
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
        given = ", ".join(f"'{name}' {shape}" for name, shape in shapes.items()) if len(shapes) > 1 else \
            str(next(iter(shapes.values())))
        raise InputError(
            f"{label}: ONNX shape inference fails for input shape {given}: {_one_line(exc)}"
        ) from None
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
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    weights = {}
    for index, tensor in enumerate(model.graph.initializer):
        if prod(tensor.dims) > SHAPE_DATA_MAX_ELEMENTS:
            weights[index] = tensor
            stripped = copy.graph.initializer[index]
            for data_field in _TENSOR_DATA_FIELDS:
                stripped.ClearField(data_field)
    return copy, weights


def _folded(inferred: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], label: str) -> onnx.ModelProto:
    """``inferred`` with its run-time shape arithmetic folded to constants, shapes inferred again."""
    first = next(iter(shapes))
    batch = next(i for i in inferred.graph.input if i.name == first).type.tensor_type.shape.dim[0].dim_value

    def other_batch(model: onnx.ModelProto) -> onnx.ModelProto | None:
        try:
            return _infer_shapes(model, shapes, label, batch=batch + 1)
        except InputError:
            return None  # a graph fixed to its batch: every folded value counts as batch-dependent

    # Each pass can make more shapes known (a Slice with folded bounds gets an inferred shape
    # that later Shape nodes read): fold until nothing new becomes a constant.
    while True:
        folded = fold_shape_arithmetic(inferred, other_batch)
        if _constant_count(folded) == _constant_count(inferred):
            return inferred
        inferred = _infer_shapes(folded, shapes, label, batch=batch)


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
            largest = (_node_label(node) if node is not None else value, shape[1:], elements)
    parameter_elements = sum(math.prod(t.dims) for t in model.graph.initializer)
    estimate = 8 * (2 * activation_elements + 4 * parameter_elements)
    node, shape, _ = largest
    refuse_beyond_memory(estimate, label, f"the largest activation is the output of node '{node[:120]}', "
                         f"of shape {tuple(shape)} per example")


def _read_tensors(model: onnx.ModelProto, label: str) -> dict[str, torch.Tensor]:
    """Every initializer and every ``Constant`` tensor, bit-exact, keyed by its ONNX name.

    A tensor whose stored data does not fit its declared dims or element type is an input
    error naming the tensor; only onnx's decoding is guarded, so a bug elsewhere stays a bug.
    """
    tensors = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        value = _constant_tensor(node)
        if value is not None:
            tensors[node.output[0]] = value
    params = {}
    for key, proto in tensors.items():
        try:
            array = numpy_helper.to_array(proto)
        except (ValueError, TypeError) as exc:
            raise InputError(
                f"cannot read '{label}': tensor '{key[:120]}' holds data that does not match its declared shape "
                f"{tuple(proto.dims)} or element type ({_one_line(exc)})."
            ) from None
        tensor = _to_torch(proto, array)
        if tensor is not None:
            params[key] = tensor
    return params


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
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
            return onnx.helper.make_tensor(node.output[0], data_type, dims,
                                           list(values) if a.name.endswith("s") else [values])
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


# --------------------------------------------------------------------------- translation


@dataclasses.dataclass
class _Weight:
    """A static tensor read as a parameter: its checkpoint key and whether a Transpose flips it."""

    key: str
    transposed: bool


class _Translator:
    """Builds the :class:`Graph` of a shape-inferred model, collecting every unsupported node."""

    def __init__(self, model: onnx.ModelProto, label: str, read_nodes=None, written: onnx.GraphProto | None = None):
        """``read_nodes``: the nodes of the model as written back, position by position (``model``'s
        own by default); shape arithmetic folded for translation still reads there what it read.
        ``written``: the graph written back, whose names copies of parameters must avoid too."""
        self.label = label
        self.onnx_nodes = list(model.graph.node)
        self.read_nodes = list(read_nodes) if read_nodes is not None else self.onnx_nodes
        self.graph_outputs = [o.name for o in model.graph.output]
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.constants = {n.output[0]: n for n in self.onnx_nodes if n.op_type == "Constant"}
        self.producer = {out: n for n in self.onnx_nodes for out in n.output if out}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.onnx_nodes:
            for value in n.input:
                self.consumers.setdefault(value, []).append(n)
        self.shapes = _value_shapes(model)
        self.nodes: dict[str, Node] = {}
        self.node_shapes: dict[str, tuple[int | None, ...] | None] = {}
        self.node_of_value: dict[str, str] = {}
        self.activations: set[str] = set()
        # Values computed by pure data movement: (source value with a graph node, index map, the op).
        self.moves: dict[str, tuple[str, torch.Tensor, onnx.NodeProto]] = {}
        self.aliases: dict[str, str] = {}
        self.claimed: set[str] = set()
        # Every name the graph (as translated and as written back) already gives a value: a copy
        # of a parameter is named apart from all of them.
        self.taken: set[str] = {v.name for graph in (model.graph, written) if graph is not None
                                for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)}
        self.taken.update(name for n in (*self.onnx_nodes, *self.read_nodes) for name in (*n.input, *n.output))
        self.splits: list[tuple[str, str, int, int]] = []
        # Where parameters are read: (node index, input position), and the values read that way
        # (the stored tensors and the Identity/Transpose outputs between them and their layer).
        self.parameter_reads: set[tuple[int, int]] = set()
        self.parameter_values: set[str] = set()
        self.index_of = {id(n): i for i, n in enumerate(self.onnx_nodes)}
        self.current: onnx.NodeProto | None = None
        self.notes: list[str] = []
        self.problems: list[str] = []
        self.offenders: list[tuple[str, str]] = []
        # Problems of nodes that read, directly or through other nodes, the output of a node
        # already refused: consequences, reported after the root causes and counted.
        self.follow_on: list[str] = []
        self.after_refusal: set[str] = set()

    # ---- driver

    def translate(self, shapes: dict[str, tuple[int, ...]]) -> Graph:
        """The DAG, with an input node for each of ``shapes`` (ONNX input name → batch-free shape)."""
        for input_name, input_shape in shapes.items():
            self._emit(Input(self._unique(input_name), shape=input_shape), input_name)
            self.activations.add(input_name)
        needed = self._needed_values()
        for node in self.onnx_nodes:
            if not any(out in needed for out in node.output):
                continue
            if node.op_type in SHAPE_QUERIES or not any(value in self.activations for value in node.input):
                continue
            self.activations.update(out for out in node.output if out)
            self._translate_node(node)
        self._separate_other_reads(needed)
        outputs = self._outputs()
        problems = grouped(self.offenders) + self.problems
        if problems or self.follow_on:
            raise UnsupportedModelError(
                f"{self.label}: the network is not a ReLU DAG pathcond can rescale exactly; "
                f"{len(problems)} problem(s):",
                problems,
                self.follow_on,
                note=offender_note(self.offenders),
            )
        return Graph(list(self.nodes.values()), outputs, source=self.label)

    def _translate_node(self, node: onnx.NodeProto) -> None:
        self.current = node
        handler = _HANDLERS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        follows_refusal = any(value in self.after_refusal for value in node.input)
        if follows_refusal:
            self.after_refusal.update(node.output)
        try:
            if handler is None:
                if node.domain in DEFAULT_DOMAINS and node.op_type in _NOT_HOMOGENEOUS:
                    raise _NotHomogeneous()
                raise _Unsupported(_unsupported_reason(node))
            handler(self, node)
        except _NotHomogeneous:
            self.offenders.append((_op_label(node), _node_label(node)))
            self.after_refusal.update(node.output)
        except _Unsupported as exc:
            problem = f"node '{_node_label(node)}' ({_op_label(node)}): {exc}"
            (self.follow_on if follows_refusal else self.problems).append(problem)
            self.after_refusal.update(node.output)

    def _separate_other_reads(self, needed: set[str]) -> None:
        """Every read of a parameter that is not the read of its layer (a ``Mul`` by the same
        scalar, a ``Cast`` of it, ...) gets its own copy of the original value (recorded in
        ``splits``), so that rescaling the parameter leaves that reader as pathcond read it.

        A reader of a value computed from a parameter (the output of the ``Transpose`` in front
        of a weight) cannot be given a copy: that is a problem of the model.
        """
        for index, node in enumerate(self.read_nodes):
            if node.op_type in SHAPE_QUERIES or not any(out in needed for out in node.output):
                continue
            for position, value in enumerate(node.input):
                if value not in self.parameter_values or (index, position) in self.parameter_reads:
                    continue
                reader = f"node '{_node_label(node)}' ({_op_label(node)}) reads it as input {position}"
                if not (self._is_stored(value) or value in self.aliases):
                    self.problems.append(
                        f"'{value}', computed from a parameter for its layer, is also read elsewhere: {reader}; "
                        "rescaling the parameter would change that reader"
                    )
                    continue
                alias, suffix = f"{value}.original_for_{_node_label(node)}", 1
                while alias in self.taken or alias in self.claimed:
                    alias, suffix = f"{value}.original_for_{_node_label(node)}_{suffix}", suffix + 1
                self.claimed.add(alias)
                self.splits.append((alias, value, index, position))
                self.notes.append(
                    f"tensor '{value}' is a parameter pathcond rescales, and {reader}: that reader keeps the "
                    f"original value, in a copy named '{alias}'"
                )

    def stored_proto(self, key: str) -> onnx.TensorProto:
        """The stored tensor behind parameter ``key`` (an Identity alias stands for its source)."""
        key = self.aliases.get(key, key)
        return self.initializers[key] if key in self.initializers else _constant_tensor(self.constants[key])

    def _needed_values(self) -> set[str]:
        """Values the graph outputs depend on (nodes outside this set are dead and ignored).

        A value only measured by Shape is not needed: its node need not be translatable.
        """
        needed = set(self.graph_outputs)
        for node in reversed(self.onnx_nodes):
            if node.op_type not in SHAPE_QUERIES and any(out in needed for out in node.output):
                needed.update(v for v in node.input if v)
        return needed

    def _outputs(self) -> tuple[str, ...]:
        outputs = []
        for value in self.graph_outputs:
            if value not in self.activations:
                self.problems.append(f"graph output '{value}' does not depend on the network input")
            elif value in self.moves:
                try:
                    outputs.append(self._source(self._materialised(value)))
                except _Unsupported as exc:
                    self.problems.append(f"graph output '{value}': {exc}")
            elif value in self.node_of_value:
                outputs.append(self.node_of_value[value])
        return tuple(outputs)

    # ---- graph nodes and activations

    def _unique(self, preferred: str) -> str:
        name, suffix = preferred, 1
        while name in self.nodes:
            name, suffix = f"{preferred}_{suffix}", suffix + 1
        return name

    def _add_node(self, node: Node, shape: tuple[int | None, ...] | None) -> Node:
        """Add ``node``, whose output has batch-free ``shape`` in the graph."""
        self.nodes[node.name] = node
        self.node_shapes[node.name] = shape
        return node

    def _emit(self, node: Node, value: str) -> Node:
        """Add ``node`` as the producer of ONNX ``value``."""
        self.node_of_value[value] = node.name
        return self._add_node(node, self._known_batch_free_shape(value))

    def _emit_for(self, onnx_node: onnx.NodeProto, make: Callable[..., Node], *inputs: str, **attributes) -> Node:
        """Add the graph node standing for ``onnx_node`` (named after its weight, or after it) reading ``inputs``."""
        name = self._unique(_layer_name(onnx_node, attributes.get("weight")))
        node = make(name=name, inputs=tuple(self._source(v) for v in inputs), **attributes)
        return self._emit(self._claim(onnx_node, node), onnx_node.output[0])

    def _claim(self, onnx_node: onnx.NodeProto, node: Node) -> Node:
        """``node`` reading its own copy of each initializer another layer (or role) already reads.

        Only initializers that are direct inputs of ``onnx_node`` are split (recorded in
        ``splits`` and applied to the model on loading); sharing through other nodes is left
        for the graph to report.
        """
        changes: dict[str, str] = {}
        used: set[int] = set()
        for role, key in node.parameter_keys().items():
            positions = [i for i, v in enumerate(onnx_node.input) if v == key and i not in used]
            used.update(positions[:1])
            if key not in self.claimed:
                self.claimed.add(key)
            elif positions and key in self.initializers:
                alias, suffix = f"{key}.{role}_of_{_node_label(onnx_node)}", 1
                while alias in self.taken or alias in self.claimed:
                    alias, suffix = f"{key}.{role}_of_{_node_label(onnx_node)}_{suffix}", suffix + 1
                self.claimed.add(alias)
                self.splits.append((alias, key, self.onnx_nodes.index(onnx_node), positions[0]))
                changes[role] = alias
        return dataclasses.replace(node, **changes) if changes else node

    def _source(self, value: str) -> str:
        """The graph node producing activation ``value`` (its ONNX name while a problem hides it)."""
        return self.node_of_value.get(value, value)

    def _viewed_activation(self, node: onnx.NodeProto) -> str:
        """Input 0, an activation that may be a pending data movement of the graph node behind it."""
        value = node.input[0]
        if value not in self.activations:
            raise _Unsupported(f"input 0 ('{value}') is expected to be computed from the network input")
        return value

    def _activation(self, node: onnx.NodeProto, index: int = 0) -> str:
        value = node.input[index] if index < len(node.input) else ""
        if value not in self.activations:
            raise _Unsupported(f"input {index} ('{value}') is expected to be computed from the network input")
        return self._materialised(value) if value in self.moves else value

    def _materialised(self, value: str) -> str:
        """A pending data movement turned into the graph node it amounts to (once per value)."""
        if value in self.node_of_value:
            return value
        source, index, op = self.moves[value]
        batch = index.shape[0]
        per_example = index.numel() // batch if batch else 0
        origin_shape = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
        examples = index.reshape(batch, -1) // max(prod(origin_shape), 1)
        if per_example and not bool((examples == torch.arange(batch)[:, None]).all()):
            raise _Unsupported(f"its input '{value}' comes from node '{_node_label(op)}' ({op.op_type}), which mixes examples of the batch")
        try:
            layer = movement_layer(tuple(origin_shape), index[:1])
        except UnsupportedMovement as exc:
            raise _Unsupported(f"its input '{value}' comes from node '{_node_label(op)}' ({op.op_type}): {exc}") from None
        if layer is None:
            self.node_of_value[value] = self._source(source)
        else:
            kind = layer.pop("type")
            node = LAYER_TYPES[kind].node(name=self._unique(_node_label(op)), inputs=(self._source(source),), **layer)
            self._emit(node, value)
        return value

    def _move(self, node: onnx.NodeProto, transform: Callable[[torch.Tensor], torch.Tensor | list[torch.Tensor]]) -> None:
        """Record ``node`` (Reshape, Transpose, Split, Slice, ...) as data movement of its input 0."""
        source, index = self._index_map(self._viewed_activation(node))
        try:
            results = transform(index)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise _Unsupported(f"cannot be replayed on its input's index map ({_one_line(exc)})") from None
        results = results if isinstance(results, list) else [results]
        for value, result in zip(node.output, results):
            if value:
                self.moves[value] = (source, result, node)

    def _index_map(self, value: str) -> tuple[str, torch.Tensor]:
        """Activation ``value`` as (the activation it moves, index map): its pending data
        movement, or itself and the identity."""
        if value in self.moves:
            source, index, _ = self.moves[value]
            return source, index
        shape = self.shapes.get(value)
        if shape is None or any(d is None for d in shape):
            raise _Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return value, torch.arange(prod(shape)).reshape(shape)

    def _is_static(self, value: str) -> bool:
        return bool(value) and value not in self.activations

    def _readers(self, value: str) -> int:
        return len(self.consumers.get(value, [])) + (value in self.graph_outputs)

    def _require_unused(self, node: onnx.NodeProto, *indices: int) -> None:
        for i in indices:
            if i < len(node.output) and node.output[i] and self._readers(node.output[i]):
                raise _Unsupported(f"its output {i} ('{node.output[i]}') is used; only inference outputs are supported")

    # ---- shapes

    def _known_batch_free_shape(self, value: str) -> tuple[int | None, ...] | None:
        shape = self.shapes.get(value)
        return None if shape is None else tuple(shape[1:])

    def _rank(self, value: str) -> int:
        shape = self.shapes.get(value)
        if shape is None:
            raise _Unsupported(f"the rank of '{value}' is unknown after shape inference")
        return len(shape)

    def _batch_free_shape(self, value: str) -> tuple[int, ...]:
        shape = self._known_batch_free_shape(value)
        if shape is None or any(d is None for d in shape):
            raise _Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return shape

    # ---- static tensors

    def _is_stored(self, value: str) -> bool:
        constant = self.constants.get(value)
        return value in self.initializers or (constant is not None and _constant_tensor(constant) is not None)

    def _record_read(self, reader: onnx.NodeProto, value: str) -> None:
        self.parameter_values.add(value)
        index = self.index_of[id(reader)]
        self.parameter_reads.update((index, position) for position, v in enumerate(reader.input) if v == value)

    def _weight(self, value: str, reader: onnx.NodeProto | None = None) -> _Weight:
        """Resolve a static input of ``reader`` (default: the node being translated) to the stored
        tensor it is (through Identity and Transpose), recording each read on the way."""
        self._record_read(reader or self.current, value)
        if self._is_stored(value):
            return _Weight(value, False)
        producer = self.producer.get(value)
        if producer is None:
            raise _Unsupported(f"its tensor input '{value}' is neither an initializer nor a Constant")
        if producer.op_type == "Identity":
            source = producer.input[0]
            if self._is_stored(source) and self._readers(source) > 1:
                # One stored tensor behind several Identity nodes (TorchScript deduplicates
                # equal tensors this way): each reader becomes its own parameter.
                self.aliases[value] = source
                self._record_read(producer, source)
                return _Weight(value, False)
            return self._weight(source, producer)
        if not producer.input:
            what = (f"a Constant node '{_node_label(producer)}' holding no numeric tensor"
                    if producer.op_type == "Constant" else
                    f"a {producer.op_type} node '{_node_label(producer)}', which has no inputs")
            raise _Unsupported(
                f"its tensor input '{value}' is computed by {what}; only stored tensors (initializers and "
                "Constant nodes) can be rescaled: store the value as an initializer"
            )
        is_matrix_transpose = producer.op_type == "Transpose" and self._rank(producer.input[0]) == 2 and _ints(producer, "perm", [1, 0]) == [1, 0]
        if producer.op_type == "Transpose" and is_matrix_transpose:
            inner = self._weight(producer.input[0], producer)
            return _Weight(inner.key, not inner.transposed)
        raise _Unsupported(
            f"its tensor input '{value}' is computed by a {producer.op_type} node; only stored tensors are supported"
        )

    def _plain_weight(self, value: str, role: str, expected_rank: int) -> str:
        weight = self._weight(value)
        shape = self.shapes.get(value)
        if weight.transposed or shape is None or len(shape) != expected_rank:
            raise _Unsupported(f"its {role} '{value}' must be a stored tensor of rank {expected_rank}")
        return weight.key

    def _static_ints(self, value: str) -> list[int] | None:
        """An int tensor stored in the model (axes of ReduceMean, Squeeze, ...), or None."""
        constant = self.constants.get(value)
        if constant is None:
            proto = self.initializers.get(value)
            return None if proto is None else [int(v) for v in numpy_helper.to_array(proto).reshape(-1)]
        tensor = _constant_tensor(constant)
        if tensor is not None:
            return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
        if _has(constant, "value_ints"):
            return _ints(constant, "value_ints", [])
        if _has(constant, "value_int"):
            return [_int(constant, "value_int", 0)]
        return None

    def _static_floats(self, value: str) -> list[float] | None:
        """A small float tensor stored in the model (Mul/Div constants, Pad's value), or None."""
        key = value
        while key not in self.initializers and key not in self.constants:
            producer = self.producer.get(key)
            if producer is None or producer.op_type not in ("Identity", "Cast"):
                return None
            key = producer.input[0]
        proto = self.initializers.get(key) or _constant_tensor(self.constants[key])
        return None if proto is None else [float(v) for v in numpy_helper.to_array(proto).reshape(-1)]

    def _axes(self, node: onnx.NodeProto) -> list[int] | None:
        """The ``axes`` of a reduction or squeeze: an input from opset 13/18 on, an attribute before."""
        if len(node.input) > 1 and node.input[1]:
            return self._static_ints(node.input[1])
        return _ints(node, "axes", None)

    # ---- handlers: one per ONNX op type

    def _gemm(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        if _int(node, "transA", 0) != 0:
            raise _Unsupported("transA=1 is not supported")
        has_bias = len(node.input) > 2 and bool(node.input[2])
        if _float(node, "alpha", 1.0) != 1.0 or (has_bias and _float(node, "beta", 1.0) != 1.0):
            raise _Unsupported("alpha and beta other than 1 are not supported")
        self._linear(node, x, node.input[1], stored_in_out=_int(node, "transB", 0) == 0,
                     bias=node.input[2] if has_bias else None)

    def _matmul(self, node: onnx.NodeProto) -> None:
        self._linear(node, self._activation(node), node.input[1], stored_in_out=True, bias=None)

    def _linear(self, node: onnx.NodeProto, x: str, weight_value: str, *, stored_in_out: bool, bias: str | None) -> None:
        """``stored_in_out``: the op reads its weight input as ``[in, out]`` (MatMul, Gemm transB=0)."""
        if not self._is_static(weight_value):
            raise _NotHomogeneous()  # a product of two activations, whatever their ranks
        if self._rank(x) != 2:
            raise _Unsupported(f"input '{x}' has rank {self._rank(x)}; only (batch, features) inputs are supported")
        if self._rank(weight_value) != 2:
            raise _Unsupported(f"weight '{weight_value}' must have rank 2")
        weight = self._weight(weight_value)
        bias_key = self._plain_weight(bias, "bias", 1) if bias is not None else None
        self._emit_for(node, Linear, x, weight=weight.key, bias=bias_key,
                       weight_transposed=stored_in_out != weight.transposed)

    def _conv(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        rank = self._rank(node.input[1])
        if rank not in (3, 4, 5):
            raise _Unsupported(f"only 1-d, 2-d and 3-d convolutions are supported (kernel rank {rank})")
        weight = self._plain_weight(node.input[1], "kernel", rank)
        bias = self._plain_weight(node.input[2], "bias", 1) if len(node.input) > 2 and node.input[2] else None
        spatial = rank - 2
        begin, end = _pads(node, spatial)
        if begin != end:
            # torch.export folds a ZeroPad before a conv into the conv's (asymmetric) pads.
            pad = Pad(name=self._unique(f"{_node_label(node)}/pad"), inputs=(self._source(x),), begin=begin, end=end)
            self._add_node(pad, None)
            padded = f"{node.output[0]}/padded"
            self.node_of_value[padded] = pad.name
            x, begin = padded, (0,) * spatial
        self._emit_for(
            node, Conv, x, weight=weight, bias=bias,
            stride=tuple(_ints(node, "strides", [1] * spatial)),
            padding=begin,
            dilation=tuple(_ints(node, "dilations", [1] * spatial)),
            groups=_int(node, "group", 1),
        )

    def _conv_transpose(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        rank = self._rank(node.input[1])
        if rank not in (3, 4, 5):
            raise _Unsupported(f"only 1-d, 2-d and 3-d transposed convolutions are supported (kernel rank {rank})")
        if _has(node, "output_shape"):
            raise _Unsupported("an explicit output_shape is not supported; export with output_padding")
        weight = self._plain_weight(node.input[1], "kernel", rank)
        bias = self._plain_weight(node.input[2], "bias", 1) if len(node.input) > 2 and node.input[2] else None
        spatial = rank - 2
        self._emit_for(
            node, ConvTranspose, x, weight=weight, bias=bias,
            stride=tuple(_ints(node, "strides", [1] * spatial)),
            padding=_symmetric_pads(node, spatial),
            output_padding=tuple(_ints(node, "output_padding", [0] * spatial)),
            dilation=tuple(_ints(node, "dilations", [1] * spatial)),
            groups=_int(node, "group", 1),
        )

    def _prelu(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        if not self._is_static(node.input[1]):
            raise _Unsupported("a slope computed from the network input is not a PReLU")
        weight = self._weight(node.input[1])
        slope_shape = tuple(self.shapes.get(node.input[1]) or ())
        channels = self._batch_free_shape(x)[0]
        # Broadcast against (batch, C, *spatial): one slope, or one per channel on the channel axis.
        per_channel = len(slope_shape) >= len(self.shapes[x]) - 1 and slope_shape[-(len(self.shapes[x]) - 1)] == channels
        if weight.transposed or not (prod(slope_shape) == 1 or (prod(slope_shape) == channels and per_channel)):
            raise _Unsupported(f"only one slope per channel or one shared slope is supported (slope shape {slope_shape})")
        self._emit_for(node, PReLU, x, weight=weight.key)

    def _scale(self, node: onnx.NodeProto) -> None:
        """Mul or Div by a stored scalar: a fixed edge of that weight. Mul by a stored per-channel
        tensor: a per-channel scale (its DAG parameters), whose shift an Add may follow."""
        static = [i for i, v in enumerate(node.input) if self._is_static(v)]
        if len(static) != 1:
            raise _NotHomogeneous()
        if node.op_type == "Div" and static[0] == 0:
            raise _Unsupported("dividing a constant by an activation is not homogeneous")
        x = self._activation(node, 1 - static[0])
        if node.op_type == "Mul" and self._is_per_channel(node.input[static[0]], x):
            self._emit_for(node, ChannelAffine, x, weight=self._weight(node.input[static[0]]).key)
            return
        constant = self._static_floats(node.input[static[0]])
        if constant is None or len(constant) != 1:
            raise _Unsupported(f"only multiplication by a stored scalar or a per-channel tensor, or division by a "
                               f"stored scalar, is supported ('{node.input[static[0]]}')")
        factor = constant[0]
        if node.op_type == "Div":
            if factor == 0:
                raise _Unsupported("division by zero")
            factor = 1.0 / factor
        if not math.isfinite(factor):
            raise _Unsupported(f"the constant factor {factor} is not finite")
        self._emit_for(node, Scale, x, factor=factor)

    def _is_per_channel(self, value: str, x: str) -> bool:
        """Whether stored ``value`` holds one value per channel of activation ``x`` (broadcast
        along every other axis, e.g. ``[C, 1, 1]`` against ``(N, C, H, W)``)."""
        shape, x_shape = self.shapes.get(value), self.shapes.get(x)
        if shape is None or x_shape is None or len(shape) > len(x_shape) or None in shape or x_shape[1] in (None, 1):
            return False
        aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
        return aligned[1] == x_shape[1] and all(size == 1 for axis, size in enumerate(aligned) if axis != 1)

    def _pad(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        onnx_mode = _string(node, "mode", "constant")
        rank = self._rank(x)
        pads = self._static_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        value = self._static_floats(node.input[2]) if len(node.input) > 2 and node.input[2] else [0.0]
        axes = self._static_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else list(range(rank))
        mode = _PAD_MODES.get(onnx_mode)
        if mode is None:
            raise _Unsupported(f"mode {onnx_mode!r} is not supported (constant, reflect, edge, wrap)")
        if mode == "zeros" and value == [-math.inf]:
            mode = "-inf"
        elif mode == "zeros" and value not in ([0.0], [0]):
            raise _Unsupported(f"padding with the constant {value} is not positively homogeneous (a padded neuron "
                               "keeps its value whatever its channel's scale); only 0, and −inf before max pooling, are")
        if pads is None or axes is None:
            raise _Unsupported("its pads and axes must be stored tensors")
        begin, end = [0] * rank, [0] * rank
        for axis, before, after in zip(axes, pads[:len(axes)], pads[len(axes):]):
            begin[axis % rank], end[axis % rank] = before, after
        if begin[:2] != [0, 0] or end[:2] != [0, 0]:
            raise _Unsupported(f"only padding or cropping (negative pads) of the spatial axes is supported "
                               f"(pads {pads})")
        if mode == "circular":
            shape = self.shapes.get(x) or ()
            for axis in range(2, min(rank, len(shape))):
                size = shape[axis]
                if size is not None and max(begin[axis], end[axis]) > size:
                    raise _Unsupported(
                        f"wrap padding of {max(begin[axis], end[axis])} on axis {axis}, of size {size}, wraps around "
                        "more than once; pathcond pads circularly by at most the size of the axis (torch's "
                        "circular padding)"
                    )
        self._emit_for(node, Pad, x, begin=tuple(begin[2:]), end=tuple(end[2:]), mode=mode)

    def _resize(self, node: onnx.NodeProto) -> None:
        """Resize as torch exports nn.Upsample/F.interpolate: nearest (asymmetric, floor) or linear
        (half_pixel, pytorch_half_pixel, align_corners), with constant scales or known sizes."""
        x = self._activation(node)
        mode, transform, nearest = (_string(node, name, default) for name, default in
                                    (("mode", "nearest"), ("coordinate_transformation_mode", "half_pixel"),
                                     ("nearest_mode", "round_prefer_floor")))
        if _int(node, "antialias", 0) or _string(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
            raise _Unsupported("antialias and keep_aspect_ratio_policy other than stretch are not supported")
        rank = self._rank(x)
        if _has(node, "axes") and sorted(a % rank for a in _ints(node, "axes", [])) != list(range(rank)):
            raise _Unsupported("resizing a subset of the axes (axes attribute) is not supported")
        if mode == "nearest" and (transform, nearest) != ("asymmetric", "floor"):
            raise _Unsupported(
                f"nearest mode is supported as torch's 'nearest' exports it (coordinate_transformation_mode "
                f"asymmetric, nearest_mode floor), not {transform}/{nearest}"
            )
        if mode == "linear" and transform not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            raise _Unsupported(f"linear mode with coordinate_transformation_mode {transform!r} is not supported "
                               "(half_pixel, pytorch_half_pixel, align_corners)")
        if mode not in ("nearest", "linear"):
            raise _Unsupported(f"mode {mode!r} is not supported (nearest and linear only)")
        if rank not in (3, 4, 5):
            raise _Unsupported(f"only 1-d, 2-d and 3-d feature maps can be resized ('{x}' has rank {rank})")
        has_scales = len(node.input) > 2 and bool(node.input[2])
        if has_scales == (len(node.input) > 3 and bool(node.input[3])):
            raise _Unsupported("exactly one of scales and sizes must be given")
        in_shape = self._batch_free_shape(x)
        if has_scales:
            scales = self._concatenated_floats(node.input[2])
            if scales is None or len(scales) != rank or min(scales) <= 0:
                raise _Unsupported(f"its scales must be a stored constant of {rank} positive numbers (got {scales})")
            # Shape inference does not follow scales through a Concat: the output size as ONNX defines it.
            out_shape = tuple(math.floor(n * scale) for n, scale in zip(in_shape, scales[1:]))
            self.shapes[node.output[0]] = (self.shapes[x][0], *out_shape)
            resize: dict[str, tuple] = {"scale_factor": tuple(scales[2:])}
        else:
            out_shape = self._batch_free_shape(node.output[0])
            resize = {"size": tuple(out_shape[1:])}
        if in_shape[0] != out_shape[0] or (has_scales and scales[0] != 1):
            raise _Unsupported("resizing the batch or channel axis is not supported")
        if transform == "pytorch_half_pixel" and 1 in out_shape[1:]:
            raise _Unsupported("pytorch_half_pixel with an output size of 1 does not match torch's interpolation")
        self._emit_for(node, Upsample, x, mode=mode, align_corners=transform == "align_corners", **resize)

    def _concatenated_floats(self, value: str) -> list[float] | None:
        """A stored float tensor, or a Concat of them (the TorchScript exporter without folding)."""
        producer = self.producer.get(value)
        if producer is not None and producer.op_type == "Concat":
            parts = [self._static_floats(v) for v in producer.input]
            return None if None in parts else [f for part in parts for f in part]
        return self._static_floats(value)

    def _batch_norm(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        if _int(node, "training_mode", 0) != 0:
            raise _Unsupported("training_mode=1 (batch statistics) is not an inference graph")
        self._require_unused(node, 1, 2)
        roles = ("scale", "bias", "mean", "variance")
        scale, bias, mean, var = (self._plain_weight(v, role, 1) for v, role in zip(node.input[1:5], roles))
        # ONNX momentum weighs the running statistic, torch's the batch statistic.
        self._emit_for(node, BatchNorm, x, weight=scale, bias=bias, running_mean=mean, running_var=var,
                       eps=_float(node, "epsilon", 1e-5), momentum=1.0 - _float(node, "momentum", 0.9))

    def _relu(self, node: onnx.NodeProto) -> None:
        self._emit_for(node, ReLU, self._activation(node))

    def _leaky_relu(self, node: onnx.NodeProto) -> None:
        self._emit_for(node, LeakyReLU, self._activation(node), negative_slope=_float(node, "alpha", 0.01))

    def _identity(self, node: onnx.NodeProto) -> None:
        self._emit_for(node, Identity, self._activation(node))

    def _dropout(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        training = node.input[2] if len(node.input) > 2 else ""
        if training and self._static_ints(training) != [0]:
            raise _Unsupported("training_mode must be absent or a constant false")
        self._require_unused(node, 1)
        self._emit_for(node, Identity, x)

    def _max_pool(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        self._require_unused(node, 1)
        spatial = self._spatial_rank(x)
        self._emit_for(
            node, MaxPool, x, kernel=tuple(_ints(node, "kernel_shape", [])),
            stride=tuple(_ints(node, "strides", [1] * spatial)),
            padding=_symmetric_pads(node, spatial),
            dilation=tuple(_ints(node, "dilations", [1] * spatial)),
            ceil_mode=bool(_int(node, "ceil_mode", 0)),
        )

    def _average_pool(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        spatial = self._spatial_rank(x)
        if any(d != 1 for d in _ints(node, "dilations", [1] * spatial)):
            raise _Unsupported("dilated average pooling is not supported")
        self._emit_for(
            node, AvgPool, x, kernel=tuple(_ints(node, "kernel_shape", [])),
            stride=tuple(_ints(node, "strides", [1] * spatial)),
            padding=_symmetric_pads(node, spatial),
            ceil_mode=bool(_int(node, "ceil_mode", 0)),
            count_include_pad=bool(_int(node, "count_include_pad", 0)),
        )

    def _global_average_pool(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        self._emit_for(node, AdaptiveAvgPool, x, output_size=(1,) * self._spatial_rank(x))

    def _reduce_mean(self, node: onnx.NodeProto) -> None:
        """A mean over every spatial axis is global average pooling (torch.export's form of it).

        Its input may be a data movement of a graph node (torch.export pools 1-d maps as
        (C, 1, L)): as long as each channel keeps exactly its own elements, the mean is over
        the same elements.
        """
        x = self._viewed_activation(node)
        rank, axes = self._rank(x), self._axes(node)
        if axes is None or rank < 3 or sorted(a % rank for a in axes) != list(range(2, rank)):
            raise _Unsupported(f"only a mean over all spatial axes is supported (axes {axes} of a rank-{rank} input)")
        if x in self.moves and x not in self.node_of_value:
            with contextlib.suppress(_Unsupported):
                self._materialised(x)  # a channel slice or shuffle becomes a node of its own
        if x in self.moves and x not in self.node_of_value:
            source, index, _ = self.moves[x]
            channels, *spatial = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
            per_channel = prod(spatial)
            own = torch.arange(channels * per_channel).reshape(1, channels, per_channel)
            if tuple(index.shape[:2]) != (index.shape[0], channels) or not torch.equal(
                    index[:1].reshape(1, channels, -1).sort(dim=2).values, own):
                raise _Unsupported(f"its input '{x}' does not keep the channels of '{source}'")
        else:
            source = self._activation(node)
            channels, *spatial = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
        if len(spatial) not in (1, 2, 3):
            raise _Unsupported(f"its input '{x}' is not a 1-d, 2-d or 3-d feature map of the graph")
        pooled_shape = (channels,) + (1,) * len(spatial)
        pool = self._add_node(
            AdaptiveAvgPool(name=self._unique(_node_label(node)), inputs=(self._source(source),),
                            output_size=(1,) * len(spatial)),
            pooled_shape,
        )
        if not _int(node, "keepdims", 1):
            self._emit(Flatten(name=self._unique(f"{pool.name}/flatten"), inputs=(pool.name,)), node.output[0])
            return
        pooled_value = f"{node.output[0]}/pooled"
        self.node_of_value[pooled_value] = pool.name
        self.activations.add(pooled_value)
        out_shape = self._batch_free_shape(node.output[0])
        batch = self.shapes[x][0]
        self.moves[node.output[0]] = (pooled_value, torch.arange(batch * channels).reshape(batch, *out_shape), node)

    def _reshape(self, node: onnx.NodeProto) -> None:
        """Reshape, Flatten, Squeeze, Unsqueeze: data movement to the inferred output shape."""
        out_shape = self.shapes.get(node.output[0])
        if out_shape is None or any(d is None for d in out_shape):
            raise _Unsupported(f"ONNX shape inference cannot determine the shape of '{node.output[0]}'")
        self._move(node, lambda index: index.reshape(out_shape))

    def _transpose(self, node: onnx.NodeProto) -> None:
        perm = _ints(node, "perm", None)
        self._move(node, lambda index: index.permute(perm) if perm is not None else index.permute(*reversed(range(index.dim()))))

    def _split(self, node: onnx.NodeProto) -> None:
        x = self._viewed_activation(node)
        axis = _int(node, "axis", 0) % self._rank(x)
        sizes = self._static_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is None:
            if len(node.input) > 1 and node.input[1]:
                raise _Unsupported(f"its split sizes '{node.input[1]}' are not a stored tensor")
            sizes = [self.shapes[out][axis] for out in node.output]
        self._move(node, lambda index: list(torch.split(index, sizes, dim=axis)))

    def _slice(self, node: onnx.NodeProto) -> None:
        x = self._viewed_activation(node)
        rank = self._rank(x)
        starts, ends = self._static_ints(node.input[1]), self._static_ints(node.input[2])
        axes = self._static_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else list(range(len(starts or [])))
        steps = self._static_ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1] * len(axes or [])
        if None in (starts, ends, axes, steps):
            raise _Unsupported("its starts, ends, axes and steps must be stored tensors")
        if any(step != 1 for step in steps):
            raise _Unsupported(f"only slices with step 1 are supported (steps {steps})")

        def transform(index: torch.Tensor) -> torch.Tensor:
            key = [slice(None)] * rank
            for start, end, axis in zip(starts, ends, axes):
                key[axis % rank] = slice(start, end)
            return index[tuple(key)]

        self._move(node, transform)

    def _add(self, node: onnx.NodeProto) -> None:
        static = [v for v in node.input if self._is_static(v)]
        if not static:
            # Broadcasting is checked with the graph's shapes (graph.broadcast_problem).
            values = [self._activation(node, i) for i in range(len(node.input))]
            self._emit_for(node, Add, *values)
            return
        if len(node.input) != 2 or len(static) != 1:
            raise _Unsupported("only a sum of activations, or a stored constant added to one, is supported")
        x = self._activation(node, 1 - list(node.input).index(static[0]))
        added = self._static_floats(static[0])
        if added is not None and not any(added) and self._adds_no_axis(node, x):
            # MobileOne's ``out += identity`` with identity = 0 in its stem: nothing is added.
            self._emit_for(node, Identity, x)
            return
        self._fuse_bias(node, x, static[0])

    def _adds_no_axis(self, node: onnx.NodeProto, x: str) -> bool:
        """Whether the sum has the shape of activation ``x`` (the constant broadcasts into it)."""
        shape, x_shape = self.shapes.get(node.output[0]), self.shapes.get(x)
        return shape is not None and shape == x_shape

    def _fuse_bias(self, node: onnx.NodeProto, x: str, bias_value: str) -> None:
        """``MatMul`` then ``Add`` of a stored vector: that vector is the Linear layer's bias; a
        per-channel scale (Mul) then ``Add`` of a stored per-channel tensor: its shift. Any other
        stored per-channel tensor added is a bias of its own on fixed edges (a ChannelBias)."""
        layer = self.nodes.get(self._source(x))
        if isinstance(layer, ChannelAffine) and layer.bias is None and self._readers(x) == 1 and self._is_per_channel(
                bias_value, x):
            bias = self._weight(bias_value).key
            if self.aliases.get(bias, bias) == self.aliases.get(layer.weight, layer.weight):
                raise _Unsupported(
                    f"it adds '{bias_value}', the tensor node '{layer.name}' multiplies by: one tensor as both the "
                    "per-channel scale and the shift after it cannot be rescaled (the scale changes by the ratio of "
                    "two channel factors, the shift by one); store the shift as a tensor of its own"
                )
        elif isinstance(layer, Linear) and layer.bias is None and self._readers(x) == 1:
            bias = self._plain_weight(bias_value, "bias", 1)
        elif self._is_per_channel(bias_value, x):
            self._emit_for(node, ChannelBias, x, bias=self._weight(bias_value).key)
            return
        else:
            raise _Unsupported(
                f"adding the constant '{bias_value}' is only supported as the bias of a MatMul, or as a tensor "
                "holding one value per channel (broadcast along every other axis), which rescales with its "
                "channel: a constant shared by several channels (or varying within one) would have to rescale "
                "by two factors at once, which is not positively homogeneous"
            )
        self.nodes[layer.name] = dataclasses.replace(layer, bias=bias)
        self.node_of_value[node.output[0]] = layer.name

    def _concat(self, node: onnx.NodeProto) -> None:
        axis = _int(node, "axis", 1) % self._rank(node.output[0])
        if axis != 1:
            self._concat_moves(node, axis)
            return
        values = [self._activation(node, i) for i in range(len(node.input))]
        self._emit_for(node, Concat, *values)

    def _concat_moves(self, node: onnx.NodeProto, axis: int) -> None:
        """Concat along another axis of pieces of one activation (the TorchScript exporter writes
        circular padding as Slices and a Concat): data movement of that activation."""
        pieces = []
        for i, value in enumerate(node.input):
            if value not in self.activations:
                raise _Unsupported(f"only concatenation along the channel axis, or of pieces of one activation, is "
                                   f"supported (axis={axis}; input {i} is a constant)")
            pieces.append(self._index_map(value))
        if len({source for source, _ in pieces}) != 1:
            raise _Unsupported(f"only concatenation along the channel axis, or of pieces of one activation, is "
                               f"supported (axis={axis})")
        self.moves[node.output[0]] = (pieces[0][0], torch.cat([index for _, index in pieces], dim=axis), node)

    def _spatial_rank(self, value: str) -> int:
        rank = self._rank(value)
        if rank not in (3, 4, 5):
            raise _Unsupported(f"pooling needs a 1-d, 2-d or 3-d feature map ('{value}' has rank {rank})")
        return rank - 2


# ONNX Pad modes as the graph's (a constant is zeros or -inf by its value).
_PAD_MODES = {"constant": "zeros", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}

_HANDLERS: dict[str, Callable[[_Translator, onnx.NodeProto], None]] = {
    "Gemm": _Translator._gemm,
    "MatMul": _Translator._matmul,
    "Conv": _Translator._conv,
    "ConvTranspose": _Translator._conv_transpose,
    "PRelu": _Translator._prelu,
    "Mul": _Translator._scale,
    "Div": _Translator._scale,
    "Pad": _Translator._pad,
    "Resize": _Translator._resize,
    "Transpose": _Translator._transpose,
    "Split": _Translator._split,
    "Slice": _Translator._slice,
    "Sum": _Translator._add,
    "BatchNormalization": _Translator._batch_norm,
    "Relu": _Translator._relu,
    "LeakyRelu": _Translator._leaky_relu,
    "Identity": _Translator._identity,
    "Dropout": _Translator._dropout,
    "MaxPool": _Translator._max_pool,
    "AveragePool": _Translator._average_pool,
    "GlobalAveragePool": _Translator._global_average_pool,
    "ReduceMean": _Translator._reduce_mean,
    "Flatten": _Translator._reshape,
    "Reshape": _Translator._reshape,
    "Squeeze": _Translator._reshape,
    "Unsqueeze": _Translator._reshape,
    "Add": _Translator._add,
    "Concat": _Translator._concat,
}


def _value_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Every value's inferred shape (None for an unknown dimension), initializers included."""
    shapes: dict[str, tuple[int | None, ...]] = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for info in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
    for node in model.graph.node:
        tensor = _constant_tensor(node)
        if tensor is not None:
            shapes[node.output[0]] = tuple(tensor.dims)
    return shapes


def _has(node: onnx.NodeProto, name: str) -> bool:
    return any(a.name == name for a in node.attribute)


def _attribute(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _string(node: onnx.NodeProto, name: str, default: str) -> str:
    value = _attribute(node, name, default)
    return value.decode() if isinstance(value, bytes) else value


def _int(node: onnx.NodeProto, name: str, default: int) -> int:
    return int(_attribute(node, name, default))


def _float(node: onnx.NodeProto, name: str, default: float) -> float:
    return float(_attribute(node, name, default))


def _ints(node: onnx.NodeProto, name: str, default: list[int] | None) -> list[int] | None:
    value = _attribute(node, name, default)
    return None if value is None else [int(v) for v in value]


def _pads(node: onnx.NodeProto, spatial: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``pads`` as per-axis (begin, end)."""
    auto_pad = _attribute(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return (0,) * spatial, (0,) * spatial
    if auto_pad != "NOTSET":
        raise _Unsupported(f"auto_pad={auto_pad} is not supported; export with explicit pads")
    pads = _ints(node, "pads", [0] * (2 * spatial))
    return tuple(pads[:spatial]), tuple(pads[spatial:])


def _symmetric_pads(node: onnx.NodeProto, spatial: int) -> tuple[int, ...]:
    """``pads`` as torch's per-axis padding; torch has no asymmetric padding for these ops."""
    begin, end = _pads(node, spatial)
    if begin != end:
        raise _Unsupported(f"asymmetric padding {list(begin + end)} is not supported")
    return begin


def _node_label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def _layer_name(node: onnx.NodeProto, weight_key: str | None) -> str:
    """The layer's name: its weight's, as the exporter kept it from the module (``layer1.0.conv1``
    for ``layer1.0.conv1.weight``, where torch.export names the node ``node_Conv_292``); the
    node's name when the weight has no module name (``onnx::Conv_193`` of a folded export)."""
    suffix = ".weight"
    if weight_key and weight_key.endswith(suffix) and len(weight_key) > len(suffix) and "::" not in weight_key:
        return weight_key[: -len(suffix)]
    return _node_label(node)


def _op_label(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"


def _unsupported_reason(node: onnx.NodeProto) -> str:
    if node.domain not in DEFAULT_DOMAINS:
        return f"operators of domain '{node.domain}' are not supported"
    return "this operator is not supported on the activation path"


# --------------------------------------------------------------------------- writing


def write_onnx(
    model: LoadedModel,
    changed: dict[str, torch.Tensor],
    destination: Path,
    metadata: dict[str, str],
    *,
    companion_name: Callable[[str], str] = str,
    self_contained: bool = False,
) -> None:
    """Write the loaded model with the tensors in ``changed`` replaced and ``metadata`` recorded.

    Every other part of the model — graph, opset, producer, doc strings, metadata already there,
    and each tensor not in ``changed`` — is written back exactly as it was read. A model read
    with external data is written with external data too, unless ``self_contained``: its float
    initializers of :data:`EXTERNAL_MIN_BYTES` or more go to one file beside ``destination``,
    ``<name>.data`` or what ``companion_name`` makes of it; every other tensor (small ones, and
    integer shapes and axes, which runtimes read while loading the graph) stays in the model.
    A model that protobuf cannot hold in one message (2 GiB) is refused with ``OutputError``
    when it must be self-contained.
    """
    destination = Path(destination)
    proto = onnx.ModelProto()
    proto.CopyFrom(model.payload)
    _replace_tensors(proto.graph, _with_detached_aliases(proto.graph, changed, model.params))
    _update_metadata(proto, metadata)
    if self_contained and proto.ByteSize() > PROTOBUF_MAX_BYTES:
        raise OutputError(
            f"cannot write '{describe(destination)}' as one self-contained model: it holds "
            f"{proto.ByteSize() / 2**30:.3g} GiB, beyond protobuf's 2 GiB; write it to a file (-o out.onnx), "
            "whose large tensors go to an external data file beside it. Nothing was written."
        )
    if len(model.files) > 1 and not self_contained:
        location = companion_name(external_data_name(destination.name))
        for tensor in proto.graph.initializer:
            if tensor.data_type in _FLOAT_TYPES and len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
                external_data_helper.set_external_data(tensor, location)
        try:
            # onnx writes the data file beside the model it saves, named by the location itself.
            onnx.save_model(proto, str(destination))
        except OSError as exc:
            raise output_error_from(exc, destination) from None
    else:
        atomic_write(destination, lambda tmp: onnx.save_model(proto, str(tmp)))


def _with_detached_aliases(
    graph: onnx.GraphProto, changed: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``changed`` plus each Identity alias (a parameter of its own) whose shared tensor changes.

    Such an alias must stop reading the shared tensor and keep the value it had.
    """
    detached = dict(changed)
    for node in graph.node:
        if node.op_type == "Identity" and node.output[0] in params and node.input[0] in changed:
            detached.setdefault(node.output[0], params[node.output[0]])
    return detached


def _replace_tensors(graph: onnx.GraphProto, changed: dict[str, torch.Tensor]) -> None:
    remaining = dict(changed)
    for tensor in graph.initializer:
        if tensor.name in remaining:
            _set_tensor_data(tensor, remaining.pop(tensor.name))
    for node in graph.node:
        key = node.output[0] if node.output else ""
        if key not in remaining:
            continue
        stored = _constant_tensor(node)
        if stored is not None:
            _set_tensor_data(stored, remaining.pop(key))
            if not any(a.name == "value" for a in node.attribute):
                # value_floats, sparse_value, ...: the rescaled tensor is held as a dense value.
                del node.attribute[:]
                node.attribute.append(onnx.helper.make_attribute("value", stored))
        elif node.op_type == "Identity":
            _identity_to_constant(node, remaining.pop(key))
    if remaining:
        raise KeyError(f"no initializer or Constant named {', '.join(map(repr, remaining))} in the model")


def _identity_to_constant(node: onnx.NodeProto, tensor: torch.Tensor) -> None:
    """Give an Identity that aliased a shared tensor its own, rescaled, value."""
    value = onnx.TensorProto(name=node.output[0], data_type=_ONNX_TYPE_OF[tensor.dtype], dims=tensor.shape)
    _set_tensor_data(value, tensor)
    node.op_type = "Constant"
    del node.input[:]
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("value", value))


def _set_tensor_data(proto: onnx.TensorProto, tensor: torch.Tensor) -> None:
    """Store ``tensor`` in ``proto`` as raw little-endian bytes, keeping name, type and dims."""
    dtype = _FLOAT_TYPES.get(proto.data_type)
    if dtype is None or tuple(tensor.shape) != tuple(proto.dims):
        raise ValueError(
            f"tensor '{proto.name}': cannot store {tuple(tensor.shape)} {tensor.dtype} values "
            f"in a {tuple(proto.dims)} {onnx.TensorProto.DataType.Name(proto.data_type)} tensor"
        )
    data = tensor.detach().to("cpu", dtype).contiguous()
    if dtype == torch.bfloat16:
        data = data.view(torch.int16)
    for field in (*_TENSOR_DATA_FIELDS, "external_data"):
        proto.ClearField(field)
    proto.data_location = onnx.TensorProto.DEFAULT
    array = data.numpy()
    proto.raw_data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _update_metadata(proto: onnx.ModelProto, metadata: dict[str, str]) -> None:
    existing = {entry.key: entry for entry in proto.metadata_props}
    for key, value in metadata.items():
        entry = existing.get(key) or proto.metadata_props.add(key=key)
        entry.value = str(value)


# --------------------------------------------------------------------------- verification


def reference_outputs(source: Path | bytes, inputs: np.ndarray | dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs on ``inputs`` by ONNX's own reference evaluator (independent of ours).

    ``inputs`` is the one input's array, or arrays by input name; each is cast to the element
    type the model declares for its input.
    """
    from onnx.reference import ReferenceEvaluator

    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(str(source))
    graph_inputs = fed_inputs(model, "<reference>")
    arrays = inputs if isinstance(inputs, dict) else {graph_inputs[0].name: inputs}
    feeds = {i.name: np.asarray(arrays[i.name]).astype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
             for i in graph_inputs}
    return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]


# --------------------------------------------------------------------------- the format


class OnnxFormat:
    """ONNX models (``.onnx``, or any file that is not safetensors): the :class:`~.interface.Format`."""

    name = "onnx"

    def load(self, source: Path | bytes, *, arch: str | None, input_shape: InputShape | None, name: str | None,
             allow_unused: bool) -> LoadedModel:
        if arch is not None:
            raise InputError(f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph.")
        try:
            model = load_onnx(source, input_shape=input_shape, name=name)
        except (text_format.Error, json_format.Error) as exc:
            # onnx.load picks a text parser from extensions such as .textproto or .pbtxt.
            label = name or str(source)
            raise InputError(f"cannot read '{label}': it is not a valid ONNX model ({exception_line(exc)}).") from None
        check_weight_types(model.graph, model.params, model.source)
        return model

    def write(self, model: LoadedModel, changed: dict[str, torch.Tensor], destination: Path, metadata: dict[str, str],
              *, companion_name: Callable[[str], str], self_contained: bool) -> None:
        write_onnx(model, changed, destination, metadata, companion_name=companion_name,
                   self_contained=self_contained)

    def check_streamable(self, model: LoadedModel) -> None:
        """Refuse a model whose tensors, all inline, exceed what protobuf holds in one message (2 GiB)."""
        size = model.payload.ByteSize()
        if size > PROTOBUF_MAX_BYTES:
            raise OutputError(
                f"{shown(model.source)}: cannot send the rescaled model to stdout (-o -): stdout takes one "
                f"self-contained file, and with its external data inline this model takes {size / 2**30:.3g} GiB, "
                "beyond the 2 GiB protobuf allows; write it with -o FILE.onnx instead (its large tensors then go "
                "to an external data file beside it). Nothing was written."
            )

    def companions(self, path: Path) -> list[Path]:
        try:
            return external_data_files(path)
        except (InputError, OSError, ValueError, DecodeError):
            return []  # not a model pathcond can read: it consists of itself

    def own_companions(self, path: Path) -> list[Path]:
        return own_external_data(path)


FORMAT = OnnxFormat()
