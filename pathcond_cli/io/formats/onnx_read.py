"""Reading ONNX files: parsing (external data inside the model's folder only), checks, input
shapes, shape inference with the shape arithmetic folded, the memory estimate, the stored
tensors, the companions a model names and owns, and ONNX's reference evaluator."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from math import prod
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import external_data_helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ...errors import InputError, UnsupportedModelError, UsageError
from ..companions import external_data_name, is_companion_name, named_by_another_file
from .common import InputShape, contained_file, refuse_beyond_memory, shapes_by_input
from .onnx_fold import fold_shape_arithmetic

MIN_OPSET = 13
# Initializers larger than this are weights to shape inference: it reads their dims, never their values.
SHAPE_DATA_MAX_ELEMENTS = 1024
TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                       "string_data")
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


def read_onnx(source: str | Path | bytes, input_shape: InputShape | None,
              label: str) -> tuple[onnx.ModelProto, list[Path], dict[str, tuple[int, ...]], onnx.ModelProto]:
    """The model at ``source`` checked, with its external data loaded; the external data files it
    was read from; each input's batch-free shape (``input_shape`` over what the model declares);
    and the model with its shapes inferred and its shape arithmetic folded, the memory the passes
    will need checked."""
    model, external, serialized = _parse(source, label)
    _check(model, serialized, label)
    del serialized  # the whole file (97 MB for ResNet-50): not held through the rest of the load
    graph_inputs = fed_inputs(model, label)
    given = shapes_by_input(input_shape, [i.name for i in graph_inputs], label)
    several = len(graph_inputs) > 1
    shapes = {i.name: _input_shape(i, given.get(i.name), label, several=several) for i in graph_inputs}
    inferred = _folded(infer_shapes(model, shapes, label), shapes, label)
    check_memory(value_shapes(inferred), inferred, label)
    return model, external, shapes, inferred


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
    model = onnx.load(str(path), load_external_data=False)
    locations = dict.fromkeys(_external_location(t) for t in external_tensors(model))
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
        for tensor in external_tensors(model):
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
        raise InputError(f"'{label}' is not a valid ONNX model: {one_line(exc)}") from None
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
        given = ", ".join(f"'{name}' {shape}" for name, shape in shapes.items()) if len(shapes) > 1 else \
            str(next(iter(shapes.values())))
        raise InputError(
            f"{label}: ONNX shape inference fails for input shape {given}: {one_line(exc)}"
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
            for data_field in TENSOR_DATA_FIELDS:
                stripped.ClearField(data_field)
    return copy, weights


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
    refuse_beyond_memory(estimate, label, f"the largest activation is the output of node '{node[:120]}', "
                         f"of shape {tuple(shape)} per example")


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
    feeds = {i.name: np.asarray(arrays[i.name]).astype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
             for i in graph_inputs}
    return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]
