"""Constant folding of the shape arithmetic an ONNX export computes at run time.

TorchScript exports without constant folding compute Reshape targets, Split sizes, Slice
bounds, Pad widths and Resize sizes from ``Shape`` nodes. Once the input shape is fixed,
those values are constants: this module evaluates them once and stores them as ``Constant``
nodes, so that the importer reads them as it reads stored tensors. It rewrites a copy used
for translation only; the model written back keeps its original graph.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

SHAPE_QUERIES = ("Shape", "Size")
# (op type, input index) where a value is read as a shape, a size or a bound: a value that
# depends on the batch size stays right there for the concrete batch the importer replays.
SHAPE_INPUTS = {
    ("Reshape", 1),
    ("Expand", 1),
    ("Split", 1),
    ("Slice", 1),
    ("Slice", 2),
    ("Slice", 3),
    ("Slice", 4),
    ("Pad", 1),
    ("Pad", 3),
    ("Resize", 1),
    ("Resize", 2),
    ("Resize", 3),
    ("ConstantOfShape", 0),
    ("Tile", 1),
}


def fold_shape_arithmetic(
    model: onnx.ModelProto, other_batch: Callable[[onnx.ModelProto], onnx.ModelProto | None] | None = None
) -> onnx.ModelProto:
    """A copy of shape-inferred ``model`` whose run-time shape arithmetic is replaced by constants.

    A node is folded when every input is stored, folded, or the ``Shape``/``Size`` of a value
    whose inferred shape is fully known; a node computed from stored float tensors alone is
    folded only where it is read as a shape (:data:`SHAPE_INPUTS`), since those tensors may
    be parameters. Each folded node becomes, in place, a ``Constant`` of the same name and
    output, so node positions and value names are kept; ``model`` itself is returned when
    nothing folds. ``other_batch`` infers a model's shapes for another batch size (None if it
    cannot): a value that differs between the two batches is folded only where each reader
    is itself folded or reads it as a shape; without ``other_batch`` every value is treated
    as depending on the batch.
    """
    values, from_floats, from_shapes = _evaluate(model)
    folded_outputs = {
        n.output[0] for n in model.graph.node if n.output and n.output[0] in values and n.op_type != "Constant"
    }
    if not folded_outputs:
        return model
    if other_batch is None:
        variant_values: dict[str, np.ndarray] = {}
    elif folded_outputs & from_shapes:
        variant = other_batch(model)
        variant_values = _evaluate(variant)[0] if variant is not None else {}
    else:
        variant_values = values  # only a Shape or Size can bring in the batch: none is read
    nodes = model.graph.node
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in nodes:
        for position, value in enumerate(node.input):
            readers.setdefault(value, []).append((node, position))
    # Readers come after their producers: deciding from the last node back, whether a value's
    # folded readers become constants themselves is known when the value is decided.
    replaced: set[str] = set()
    for node in reversed(nodes):
        output = node.output[0] if len(node.output) == 1 else None
        if output not in folded_outputs:
            continue
        # Stored float tensors may be parameters (a PReLU slope behind an Unsqueeze): what is
        # computed from them alone is folded only where it is read as a shape (Resize scales).
        parameter_free = output not in from_floats
        batch_free = parameter_free and output in variant_values and _equal(values[output], variant_values[output])
        read_as_shape = all(
            (parameter_free and reader.output and reader.output[0] in replaced)
            or (reader.op_type, position) in SHAPE_INPUTS
            for reader, position in readers.get(output, [])
        )
        if batch_free or read_as_shape:
            replaced.add(output)
    if not replaced:
        return model  # e.g. Identity nodes that share stored weights: evaluated, but no shape reads them
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    nodes = folded.graph.node
    for index, node in enumerate(nodes):
        if len(node.output) == 1 and node.output[0] in replaced:
            nodes[index].CopyFrom(
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [node.output[0]],
                    name=node.name,
                    value=numpy_helper.from_array(values[node.output[0]], node.output[0]),
                )
            )
    return folded


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def _evaluate(model: onnx.ModelProto) -> tuple[dict[str, np.ndarray], set[str], set[str]]:
    """The value of every single-output node computable from stored tensors and known shapes,
    by output name; those computed from stored float tensors alone; those that read a shape."""
    shapes = _known_shapes(model)
    opsets = {o.domain or "": o.version for o in model.opset_import}
    stored: dict[str, onnx.TensorProto | onnx.NodeProto] = {t.name: t for t in model.graph.initializer}
    stored.update((n.output[0], n) for n in model.graph.node if n.op_type == "Constant" and len(n.output) == 1)
    static: dict[str, np.ndarray | None] = {}

    def stored_value(name: str) -> np.ndarray | None:
        # Read on demand: weights are not copied, and a malformed tensor stays for the importer.
        if name not in static:
            proto = stored[name]
            static[name] = _run(proto, opsets, {}) if isinstance(proto, onnx.NodeProto) else _array(proto)
        return static[name]

    derived: dict[str, np.ndarray] = {}
    from_floats: set[str] = set()
    from_shapes: set[str] = set()
    for node in model.graph.node:
        if len(node.output) != 1 or node.domain not in ("", "ai.onnx") or node.op_type == "Constant":
            continue
        if node.op_type in SHAPE_QUERIES:
            shape = shapes.get(node.input[0])
            if shape is not None:
                derived[node.output[0]] = _query(node, shape)
                from_shapes.add(node.output[0])
            continue
        inputs = [v for v in node.input if v]
        if not inputs or not all(v in derived or (v in stored and stored_value(v) is not None) for v in inputs):
            continue
        if not any(v in derived for v in inputs) and not all(static[v].dtype.kind in "iub" for v in inputs):
            from_floats.add(node.output[0])
        value = _run(node, opsets, {v: derived[v] if v in derived else static[v] for v in inputs})
        if value is not None:
            derived[node.output[0]] = value
            if any(v in from_shapes for v in inputs):
                from_shapes.add(node.output[0])
    return derived, from_floats, from_shapes


def _run(node: onnx.NodeProto, opsets: dict[str, int], feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """``node``'s output on ``feeds``, or None where it cannot be evaluated (an op the reference
    evaluator lacks, a malformed tensor): the node then stays for the importer to judge."""
    try:
        (value,) = ReferenceEvaluator(node, opsets=opsets).run(None, feeds)
    except Exception:  # noqa: BLE001 - the evaluator raises many types on bad input
        return None
    return np.asarray(value)


def _array(proto: onnx.TensorProto) -> np.ndarray | None:
    try:
        return numpy_helper.to_array(proto)
    except (ValueError, TypeError):
        return None


def _known_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for info in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in tensor_type.shape.dim):
            shapes[info.name] = tuple(d.dim_value for d in tensor_type.shape.dim)
    return shapes


def _query(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    attributes = {a.name: a.i for a in node.attribute}
    start, end = attributes.get("start", 0), attributes.get("end", len(shape))
    return np.array(shape[slice(start, end)], dtype=np.int64)
