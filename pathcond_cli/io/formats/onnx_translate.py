"""Translating a shape-inferred ONNX graph into the ReLU DAG: :class:`Translator` and
:data:`HANDLERS`, the translator of each op type. Every unsupported node is collected."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from math import prod

import onnx
import torch
from onnx import numpy_helper

from ...engine.graph import (
    AdaptiveAvgPool,
    Add,
    AvgPool,
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    Concat,
    Conv,
    ConvTranspose,
    Flatten,
    Graph,
    Identity,
    Input,
    LeakyReLU,
    Linear,
    MaxPool,
    Node,
    Pad,
    PReLU,
    ReLU,
    Scale,
    Sub,
    Upsample,
)
from ...engine.model import Carried
from ...errors import UnsupportedModelError
from .movement import UnsupportedMovement, movement_layer
from .offenders import NotHomogeneous, Unsupported, grouped, offender_note
from .onnx_fold import SHAPE_QUERIES
from .onnx_read import (
    DEFAULT_DOMAINS,
    constant_tensor,
    node_label,
    one_line,
    value_shapes,
)
from .spec import node_from_layer

_NOT_HOMOGENEOUS = {
    "Sigmoid", "Tanh", "Gelu", "Erf", "Softmax", "LogSoftmax", "LayerNormalization", "Elu", "Selu",
    "Celu", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "Mish", "Exp", "Log", "Sqrt", "Pow",
    "InstanceNormalization", "GroupNormalization", "LpNormalization", "Clip", "Reciprocal", "Div", "Mul",
    "MatMul", "Einsum", "Attention", "Cos", "Sin", "Tan", "Swish", "ThresholdedRelu", "Shrink",
}


# Ops that carry weights: the first of them on a path ends the pre-processing, and no
# post-processing comes before the last.
_PARAMETER_LAYERS = {
    "Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "PRelu", "InstanceNormalization",
    "LayerNormalization", "GroupNormalization", "Einsum", "LSTM", "GRU", "RNN", "ConvInteger", "MatMulInteger",
    "QLinearConv", "QLinearMatMul",
}


@dataclasses.dataclass
class _Weight:
    """A static tensor read as a parameter: its checkpoint key and whether a Transpose flips it."""

    key: str
    transposed: bool


class Translator:
    """Builds the :class:`Graph` of a shape-inferred model, collecting every unsupported node."""

    def __init__(self, model: onnx.ModelProto, label: str, read_nodes=None, written: onnx.GraphProto | None = None,
                 written_opset: int | None = None):
        """``read_nodes``: the nodes of the model as written back, position by position (``model``'s
        own by default); shape arithmetic folded for translation still reads there what it read.
        ``written``: the graph written back (of ONNX opset ``written_opset``), whose names copies of
        parameters must avoid too, and whose own values and operations the DAG's outputs and the
        report name where ``model`` is its conversion to another opset."""
        self.label = label
        self.written_opset = written_opset
        file_graph = written if written is not None else model.graph
        self.written_nodes = list(file_graph.node)
        # The file's node giving each value: a node of the model as read that gives none of them
        # (or gives it under another operation) is the converter's.
        self.written_producer = {out: n for n in self.written_nodes for out in n.output if out}
        self.written_values = set(self.written_producer) | {v.name for v in file_graph.input} | \
            {t.name for t in file_graph.initializer}
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
        self.shapes = value_shapes(model)
        # Every name the graph (as translated and as written back) already gives a value: a copy
        # of a parameter is named apart from all of them.
        self.taken: set[str] = {v.name for graph in (model.graph, written) if graph is not None
                                for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)}
        self.taken.update(name for n in (*self.onnx_nodes, *self.read_nodes) for name in (*n.input, *n.output))
        self.index_of = {id(n): i for i, n in enumerate(self.onnx_nodes)}
        self.carried = Carried()
        self._start()

    def _start(self) -> None:
        """The state of one reading of the graph (a second reading carries pre- and post-processing)."""
        self.nodes: dict[str, Node] = {}
        self.node_shapes: dict[str, tuple[int | None, ...] | None] = {}
        self.node_of_value: dict[str, str] = {}
        self.activations: set[str] = set()
        # Values computed by pure data movement: (source value with a graph node, index map, the op).
        self.moves: dict[str, tuple[str, torch.Tensor, onnx.NodeProto]] = {}
        self.aliases: dict[str, str] = {}
        self.claimed: set[str] = set()
        self.splits: list[tuple[str, str, int, int]] = []
        # Where parameters are read: (node index, input position), and the values read that way
        # (the stored tensors and the Identity/Transpose outputs between them and their layer).
        self.parameter_reads: set[tuple[int, int]] = set()
        self.parameter_values: set[str] = set()
        self.current: onnx.NodeProto | None = None
        self.notes: list[str] = []
        self.problems: list[str] = []
        self.offenders: list[tuple[str, str]] = []
        # Problems of nodes that read, directly or through other nodes, the output of a node
        # already refused: consequences, reported after the root causes and counted.
        self.follow_on: list[str] = []
        self.after_refusal: set[str] = set()
        self.input_values: list[str] = []
        # Positions of the nodes refused, root causes and consequences alike.
        self.refused: set[int] = set()

    # ---- driver

    def translate(self, shapes: dict[str, tuple[int, ...]]) -> Graph:
        """The DAG, with an input node for each of ``shapes`` (ONNX input name → batch-free shape).

        When the DAG cannot read a node computed from the network's inputs and constants only,
        before any layer with parameters, that whole region is carried as pre-processing; then,
        the nodes after which no layer with parameters comes that the DAG cannot read, and every
        node computed from them, are carried as post-processing. Carried nodes stay in the file
        unchanged, and the DAG runs between the two (:class:`Carried`).
        """
        needed = self._needed_values()
        pre_region, post_region = self._regions(set(shapes), needed)
        pre: set[int] = set()
        post: set[int] = set()
        while True:
            graph = self._read(shapes, needed, pre, post)
            if graph is not None:
                return graph
            # Pre-processing first: a node it refuses makes every later node a consequence.
            if not pre and self.refused & pre_region:
                pre = pre_region
            elif not post and self.refused & post_region:
                post = self._descendants(self.refused & post_region) & post_region
            else:
                problems = grouped(self.offenders) + self.problems
                raise UnsupportedModelError(
                    f"{self.label}: the network is not a ReLU DAG pathcond can rescale exactly; "
                    f"{len(problems)} problem(s):",
                    problems,
                    self.follow_on,
                    note=offender_note(self.offenders),
                )
            self._start()

    def _descendants(self, positions: set[int]) -> set[int]:
        """The nodes at ``positions`` and every node computed from their outputs."""
        found, stack = set(positions), list(positions)
        while stack:
            for out in self.onnx_nodes[stack.pop()].output:
                for reader in self.consumers.get(out, []):
                    index = self.index_of[id(reader)]
                    if index not in found:
                        found.add(index)
                        stack.append(index)
        return found

    def _read(self, shapes: dict[str, tuple[int, ...]], needed: set[str], pre: set[int], post: set[int]) -> Graph | None:
        """One reading of the graph with the ``pre`` and ``post`` nodes (positions) carried: the DAG,
        or None when some node was refused (the reasons are in this translator's lists)."""
        carried = pre | post
        for input_name, input_shape in shapes.items():
            if not carried or self._read_by_dag(input_name, needed, carried):
                self._add_input(input_name, input_shape)
        for index, node in enumerate(self.onnx_nodes):
            if not any(out in needed for out in node.output) or node.op_type in SHAPE_QUERIES:
                continue
            if index in carried:
                for value in node.output if index in pre else ():
                    if value and self._read_by_dag(value, needed, carried):
                        self._add_input(value, self._batch_free_shape_or_problem(value))
                continue
            if not any(value in self.activations for value in node.input):
                continue
            self.activations.update(out for out in node.output if out)
            self._translate_node(node)
        self._separate_other_reads(needed)
        outputs = self._outputs(carried, post)
        if self.offenders or self.problems or self.follow_on:
            return None
        self.carried = Carried(
            pre=self._written_ops(pre),
            post=self._written_ops(post),
            inputs=dict(shapes) if carried else {},
            dag_inputs={self.node_of_value[value]: value for value in self.input_values} if carried else {},
            dag_outputs=tuple(value for value, _ in outputs) if carried else (),
        )
        return Graph(list(self.nodes.values()), tuple(name for _, name in outputs), source=self.label)

    def _add_input(self, value: str, shape: tuple[int, ...] | None) -> None:
        if shape is not None:
            self._emit(self._node(Input.op, self._unique(value), (), shape=shape), value)
            self.activations.add(value)
            self.input_values.append(value)

    def _batch_free_shape_or_problem(self, value: str) -> tuple[int, ...] | None:
        """A pre-processing output's batch-free shape, the DAG's input; None (a problem) when unknown."""
        try:
            return self._batch_free_shape(value)
        except Unsupported as exc:
            self.problems.append(f"'{value}', an output of the pre-processing the network's layers read: {exc}")
            return None

    def _read_by_dag(self, value: str, needed: set[str], carried: set[int]) -> bool:
        """Whether a needed node outside ``carried`` reads ``value`` (not only measures its shape)."""
        return any(self.index_of[id(reader)] not in carried and reader.op_type not in SHAPE_QUERIES
                   and any(out in needed for out in reader.output) for reader in self.consumers.get(value, []))

    def _regions(self, inputs: set[str], needed: set[str]) -> tuple[set[int], set[int]]:
        """The positions of the nodes that can be carried as pre-processing (computed from the
        network's inputs and constants only, before a layer with parameters) and as
        post-processing (no layer with parameters after them: computed from a layer's values, or
        from the inputs alone beside the layers). In a file with no layer at all, no node is
        either: the network is then no more than them."""
        computed, before_layers = set(inputs), set(inputs)
        candidates, pure = [], set()
        for index, node in enumerate(self.onnx_nodes):
            if node.op_type in SHAPE_QUERIES or not any(out in needed for out in node.output):
                continue
            read = [value for value in node.input if value in computed]
            if not read:
                continue
            computed.update(out for out in node.output if out)
            candidates.append(index)
            if not self._is_layer(node, computed) and all(value in before_layers for value in read):
                pure.add(index)
                before_layers.update(out for out in node.output if out)
        reaches_layer: set[int] = set()
        for index in reversed(candidates):
            node = self.onnx_nodes[index]
            if self._is_layer(node, computed) or any(self.index_of[id(reader)] in reaches_layer
                                                       for out in node.output for reader in self.consumers.get(out, [])):
                reaches_layer.add(index)
        after_dag = {index for index in candidates if index not in reaches_layer} if reaches_layer else set()
        return pure & reaches_layer, after_dag

    def _is_layer(self, node: onnx.NodeProto, computed: set[str]) -> bool:
        """A layer with parameters: an op that carries weights, reading a tensor not computed from
        the inputs, or a Mul/Add the DAG reads a parameter of (a per-channel scale, shift or bias)."""
        if node.op_type in _PARAMETER_LAYERS:
            return any(value and value not in computed for value in node.input)
        return self._per_channel_parameter(node, computed) is not None

    def _per_channel_parameter(self, node: onnx.NodeProto, activations: set[str]) -> str | None:
        """The stored tensor of a Mul or Add of one activation and one constant holding a value per
        channel of it, which the DAG reads as a parameter (a ChannelAffine's scale or shift, a
        ChannelBias, a Linear's bias); None for any other node. ``activations``: the values
        computed from the network's inputs."""
        if node.op_type not in ("Mul", "Add") or len(node.input) != 2:
            return None
        static = [value for value in node.input if value and value not in activations]
        if len(static) != 1:
            return None
        x = node.input[1 - list(node.input).index(static[0])]
        if node.op_type == "Add" and self._adds_nothing(node, x, static[0]):
            return None
        return static[0] if self._is_per_channel(static[0], x) else None

    def _translate_node(self, node: onnx.NodeProto) -> None:
        self.current = node
        handler = HANDLERS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        follows_refusal = any(value in self.after_refusal for value in node.input)
        if follows_refusal:
            self.after_refusal.update(node.output)
        try:
            if handler is None:
                if node.domain in DEFAULT_DOMAINS and node.op_type in _NOT_HOMOGENEOUS:
                    raise NotHomogeneous()
                raise Unsupported(_unsupported_reason(node))
            handler(self, node)
        except NotHomogeneous:
            self.offenders.append((self._op_label(node), node_label(node)))
            self.after_refusal.update(node.output)
            self.refused.add(self.index_of[id(node)])
        except Unsupported as exc:
            problem = f"node '{node_label(node)}' ({self._op_label(node)}): {exc}"
            (self.follow_on if follows_refusal else self.problems).append(problem)
            self.after_refusal.update(node.output)
            self.refused.add(self.index_of[id(node)])

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
                reader = f"node '{node_label(node)}' ({self._op_label(node)}) reads it as input {position}"
                if not (self._is_stored(value) or value in self.aliases):
                    self.problems.append(
                        f"'{value}', computed from a parameter for its layer, is also read elsewhere: {reader}; "
                        "rescaling the parameter would change that reader"
                    )
                    continue
                alias, suffix = f"{value}.original_for_{node_label(node)}", 1
                while alias in self.taken or alias in self.claimed:
                    alias, suffix = f"{value}.original_for_{node_label(node)}_{suffix}", suffix + 1
                self.claimed.add(alias)
                self.splits.append((alias, value, index, position))
                self.notes.append(
                    f"tensor '{value}' is a parameter pathcond rescales, and {reader}: that reader keeps the "
                    f"original value, in a copy named '{alias}'"
                )

    def stored_proto(self, key: str) -> onnx.TensorProto:
        """The stored tensor behind parameter ``key`` (an Identity alias stands for its source)."""
        key = self.aliases.get(key, key)
        return self.initializers[key] if key in self.initializers else constant_tensor(self.constants[key])

    def _needed_values(self) -> set[str]:
        """Values the graph outputs depend on (nodes outside this set are dead and ignored).

        A value only measured by Shape is not needed: its node need not be translatable.
        """
        needed = set(self.graph_outputs)
        for node in reversed(self.onnx_nodes):
            if node.op_type not in SHAPE_QUERIES and any(out in needed for out in node.output):
                needed.update(v for v in node.input if v)
        return needed

    def _outputs(self, carried: set[int], post: set[int]) -> list[tuple[str, str]]:
        """The DAG's outputs as (ONNX value, graph node): the graph outputs it computes, then the
        values the post-processing (positions ``post``) reads from it, each the file's own (see
        :meth:`_written_value`); the outputs of ``carried`` nodes are the file's own."""
        carried_values = {out for index in carried for out in self.onnx_nodes[index].output}
        post_reads = [self._written_value(value) for index in sorted(post) for value in self.onnx_nodes[index].input
                      if value in self.activations and value not in carried_values]
        outputs = []
        for value in dict.fromkeys([*self.graph_outputs, *post_reads]):
            if value in carried_values:
                continue
            if value not in self.activations:
                self.problems.append(f"graph output '{value}' does not depend on the network input")
            elif value in self.moves:
                try:
                    outputs.append((value, self._source(self._materialised(value))))
                except Unsupported as exc:
                    self.problems.append(f"graph output '{value}': {exc}")
            elif value in self.node_of_value:
                outputs.append((value, self.node_of_value[value]))
        return outputs

    def _written_value(self, value: str) -> str:
        """The value of the file that activation ``value`` moves: ``value`` itself when the file
        has it, else, through the data movements the converter to opset 13 added (the Flatten in
        front of an opset-11 Softmax), the file's value they copy; ``value`` when there is none.
        A runtime fetches it from the file, original and written alike."""
        found = value
        while found not in self.written_values and found in self.moves:
            movement = self.moves[found][2]
            moved = [read for read in movement.input if read in self.activations]
            if moved != [movement.input[0]]:
                return value
            found = moved[0]
        return found if found in self.written_values else value

    def _written_ops(self, positions: set[int]) -> tuple[str, ...]:
        """The operations of the file, in its order, that give the values of the nodes at
        ``positions``: the converter's own nodes (the Reshape after an opset-11 LogSoftmax)
        are none of them."""
        values = {out for index in positions for out in self.onnx_nodes[index].output if out}
        return tuple(_op_label(node) for node in self.written_nodes if any(out in values for out in node.output))

    def _op_label(self, node: onnx.NodeProto) -> str:
        """``node``'s operation; when the file gives its value by another one (an Upsample of
        opset 9 read as a Resize), the file's, its opset and what it is read as."""
        written = self.written_producer.get(node.output[0]) if node.output else None
        if written is None or (written.op_type, written.domain) == (node.op_type, node.domain):
            return _op_label(node)
        return f"{_op_label(written)} of ONNX opset {self.written_opset}, read as {_op_label(node)}"

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

    def _emit_for(self, onnx_node: onnx.NodeProto, node_type: type[Node], *inputs: str, **attributes) -> Node:
        """Add the graph node of ``node_type`` standing for ``onnx_node`` (named after its weight, or
        after it) reading ``inputs``."""
        name = self._unique(_layer_name(onnx_node, attributes.get("weight")))
        node = self._node(node_type.op, name, [self._source(v) for v in inputs], **attributes)
        return self._emit(self._claim(onnx_node, node), onnx_node.output[0])

    def _node(self, op: str, name: str, inputs: Sequence[str], **attributes) -> Node:
        """The node of type ``op`` built by :func:`~.spec.node_from_layer`, the importers' one node
        constructor: validated, with a spec's defaults for the fields not given (an omitted tensor
        key is ``<name>.<role>``, so a role the op lacks is given as None)."""
        layer = {"name": name, "type": op, **({} if op == Input.op else {"inputs": list(inputs)}), **attributes}
        return node_from_layer(layer, source=self.label)

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
                alias, suffix = f"{key}.{role}_of_{node_label(onnx_node)}", 1
                while alias in self.taken or alias in self.claimed:
                    alias, suffix = f"{key}.{role}_of_{node_label(onnx_node)}_{suffix}", suffix + 1
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
            raise Unsupported(f"input 0 ('{value}') is expected to be computed from the network input")
        return value

    def _activation(self, node: onnx.NodeProto, index: int = 0) -> str:
        value = node.input[index] if index < len(node.input) else ""
        if value not in self.activations:
            raise Unsupported(f"input {index} ('{value}') is expected to be computed from the network input")
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
            raise Unsupported(f"its input '{value}' comes from node '{node_label(op)}' ({op.op_type}), which mixes examples of the batch")
        try:
            layer = movement_layer(tuple(origin_shape), index[:1])
        except UnsupportedMovement as exc:
            raise Unsupported(f"its input '{value}' comes from node '{node_label(op)}' ({op.op_type}): {exc}") from None
        if layer is None:
            self.node_of_value[value] = self._source(source)
        else:
            kind = layer.pop("type")
            self._emit(self._node(kind, self._unique(node_label(op)), [self._source(source)], **layer), value)
        return value

    def _move(self, node: onnx.NodeProto, transform: Callable[[torch.Tensor], torch.Tensor | list[torch.Tensor]]) -> None:
        """Record ``node`` (Reshape, Transpose, Split, Slice, ...) as data movement of its input 0."""
        source, index = self._index_map(self._viewed_activation(node))
        try:
            results = transform(index)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise Unsupported(f"cannot be replayed on its input's index map ({one_line(exc)})") from None
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
            raise Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return value, torch.arange(prod(shape)).reshape(shape)

    def _is_static(self, value: str) -> bool:
        return bool(value) and value not in self.activations

    def _readers(self, value: str) -> int:
        return len(self.consumers.get(value, [])) + (value in self.graph_outputs)

    def _require_unused(self, node: onnx.NodeProto, *indices: int) -> None:
        for i in indices:
            if i < len(node.output) and node.output[i] and self._readers(node.output[i]):
                raise Unsupported(f"its output {i} ('{node.output[i]}') is used; only inference outputs are supported")

    # ---- shapes

    def _known_batch_free_shape(self, value: str) -> tuple[int | None, ...] | None:
        shape = self.shapes.get(value)
        return None if shape is None else tuple(shape[1:])

    def _rank(self, value: str) -> int:
        shape = self.shapes.get(value)
        if shape is None:
            raise Unsupported(f"the rank of '{value}' is unknown after shape inference")
        return len(shape)

    def _batch_free_shape(self, value: str) -> tuple[int, ...]:
        shape = self._known_batch_free_shape(value)
        if shape is None or any(d is None for d in shape):
            raise Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return shape

    # ---- static tensors

    def _is_stored(self, value: str) -> bool:
        constant = self.constants.get(value)
        return value in self.initializers or (constant is not None and constant_tensor(constant) is not None)

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
            raise Unsupported(f"its tensor input '{value}' is neither an initializer nor a Constant")
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
            what = (f"a Constant node '{node_label(producer)}' holding no numeric tensor"
                    if producer.op_type == "Constant" else
                    f"a {producer.op_type} node '{node_label(producer)}', which has no inputs")
            raise Unsupported(
                f"its tensor input '{value}' is computed by {what}; only stored tensors (initializers and "
                "Constant nodes) can be rescaled: store the value as an initializer"
            )
        is_matrix_transpose = producer.op_type == "Transpose" and self._rank(producer.input[0]) == 2 and _ints(producer, "perm", [1, 0]) == [1, 0]
        if producer.op_type == "Transpose" and is_matrix_transpose:
            inner = self._weight(producer.input[0], producer)
            return _Weight(inner.key, not inner.transposed)
        raise Unsupported(
            f"its tensor input '{value}' is computed by a {producer.op_type} node; only stored tensors are supported"
        )

    def _plain_weight(self, value: str, role: str, expected_rank: int) -> str:
        weight = self._weight(value)
        shape = self.shapes.get(value)
        if weight.transposed or shape is None or len(shape) != expected_rank:
            raise Unsupported(f"its {role} '{value}' must be a stored tensor of rank {expected_rank}")
        return weight.key

    def _static_ints(self, value: str) -> list[int] | None:
        """An int tensor stored in the model (axes of ReduceMean, Squeeze, ...), or None."""
        constant = self.constants.get(value)
        if constant is None:
            proto = self.initializers.get(value)
            return None if proto is None else [int(v) for v in numpy_helper.to_array(proto).reshape(-1)]
        tensor = constant_tensor(constant)
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
        proto = self.initializers.get(key) or constant_tensor(self.constants[key])
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
            raise Unsupported("transA=1 is not supported")
        has_bias = len(node.input) > 2 and bool(node.input[2])
        if _float(node, "alpha", 1.0) != 1.0 or (has_bias and _float(node, "beta", 1.0) != 1.0):
            raise Unsupported("alpha and beta other than 1 are not supported")
        self._linear(node, x, node.input[1], stored_in_out=_int(node, "transB", 0) == 0,
                     bias=node.input[2] if has_bias else None)

    def _matmul(self, node: onnx.NodeProto) -> None:
        self._linear(node, self._activation(node), node.input[1], stored_in_out=True, bias=None)

    def _linear(self, node: onnx.NodeProto, x: str, weight_value: str, *, stored_in_out: bool, bias: str | None) -> None:
        """``stored_in_out``: the op reads its weight input as ``[in, out]`` (MatMul, Gemm transB=0)."""
        if not self._is_static(weight_value):
            raise NotHomogeneous()  # a product of two activations, whatever their ranks
        if self._rank(x) != 2:
            raise Unsupported(f"input '{x}' has rank {self._rank(x)}; only (batch, features) inputs are supported")
        if self._rank(weight_value) != 2:
            raise Unsupported(f"weight '{weight_value}' must have rank 2")
        weight = self._weight(weight_value)
        bias_key = self._plain_weight(bias, "bias", 1) if bias is not None else None
        self._emit_for(node, Linear, x, weight=weight.key, bias=bias_key,
                       weight_transposed=stored_in_out != weight.transposed)

    def _conv(self, node: onnx.NodeProto) -> None:
        x = self._activation(node)
        rank = self._rank(node.input[1])
        if rank not in (3, 4, 5):
            raise Unsupported(f"only 1-d, 2-d and 3-d convolutions are supported (kernel rank {rank})")
        weight = self._plain_weight(node.input[1], "kernel", rank)
        bias = self._plain_weight(node.input[2], "bias", 1) if len(node.input) > 2 and node.input[2] else None
        spatial = rank - 2
        begin, end = _pads(node, spatial)
        if begin != end:
            # torch.export folds a ZeroPad before a conv into the conv's (asymmetric) pads.
            pad = self._node(Pad.op, self._unique(f"{node_label(node)}/pad"), [self._source(x)], begin=begin, end=end)
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
            raise Unsupported(f"only 1-d, 2-d and 3-d transposed convolutions are supported (kernel rank {rank})")
        if _has(node, "output_shape"):
            raise Unsupported("an explicit output_shape is not supported; export with output_padding")
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
            raise Unsupported("a slope computed from the network input is not a PReLU")
        weight = self._weight(node.input[1])
        slope_shape = tuple(self.shapes.get(node.input[1]) or ())
        channels = self._batch_free_shape(x)[0]
        # Broadcast against (batch, C, *spatial): one slope, or one per channel on the channel axis.
        per_channel = len(slope_shape) >= len(self.shapes[x]) - 1 and slope_shape[-(len(self.shapes[x]) - 1)] == channels
        if weight.transposed or not (prod(slope_shape) == 1 or (prod(slope_shape) == channels and per_channel)):
            raise Unsupported(f"only one slope per channel or one shared slope is supported (slope shape {slope_shape})")
        self._emit_for(node, PReLU, x, weight=weight.key)

    def _scale(self, node: onnx.NodeProto) -> None:
        """Mul or Div by a stored scalar: a fixed edge of that weight. Mul by a stored per-channel
        tensor: a per-channel scale (its DAG parameters), whose shift an Add may follow."""
        static = [i for i, v in enumerate(node.input) if self._is_static(v)]
        if len(static) != 1:
            raise NotHomogeneous()
        if node.op_type == "Div" and static[0] == 0:
            raise Unsupported("dividing a constant by an activation is not homogeneous")
        x = self._activation(node, 1 - static[0])
        scale = self._per_channel_parameter(node, self.activations)
        if scale is not None:
            # Its shift, when an Add follows, is set by that Add.
            self._emit_for(node, ChannelAffine, x, weight=self._weight(scale).key, bias=None)
            return
        constant = self._static_floats(node.input[static[0]])
        if constant is None or len(constant) != 1:
            raise Unsupported(self._layout_reason(node.input[static[0]], x) or (
                f"only multiplication by a stored scalar or a per-channel tensor, or division by a stored scalar, is "
                f"supported ('{node.input[static[0]]}')"))
        factor = constant[0]
        if node.op_type == "Div":
            if factor == 0:
                raise Unsupported("division by zero")
            factor = 1.0 / factor
        if not math.isfinite(factor):
            raise Unsupported(f"the constant factor {factor} is not finite")
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
            raise Unsupported(f"mode {onnx_mode!r} is not supported (constant, reflect, edge, wrap)")
        if mode == "zeros" and value == [-math.inf]:
            mode = "-inf"
        elif mode == "zeros" and value not in ([0.0], [0]):
            raise Unsupported(f"padding with the constant {value} is not positively homogeneous (a padded neuron "
                               "keeps its value whatever its channel's scale); only 0, and −inf before max pooling, are")
        if pads is None or axes is None:
            raise Unsupported("its pads and axes must be stored tensors")
        begin, end = [0] * rank, [0] * rank
        for axis, before, after in zip(axes, pads[:len(axes)], pads[len(axes):]):
            begin[axis % rank], end[axis % rank] = before, after
        if begin[:2] != [0, 0] or end[:2] != [0, 0]:
            raise Unsupported(f"only padding or cropping (negative pads) of the spatial axes is supported "
                               f"(pads {pads})")
        if mode == "circular":
            shape = self.shapes.get(x) or ()
            for axis in range(2, min(rank, len(shape))):
                size = shape[axis]
                if size is not None and max(begin[axis], end[axis]) > size:
                    raise Unsupported(
                        f"wrap padding of {max(begin[axis], end[axis])} on axis {axis}, of size {size}, wraps around "
                        "more than once; pathcond pads circularly by at most the size of the axis (torch's "
                        "circular padding)"
                    )
        if mode == "reflect":
            shape = self.shapes.get(x) or ()
            for axis in range(2, min(rank, len(shape))):
                # ONNX crops first and reflects within what is left (onnxruntime refuses a wider
                # reflection, which torch's F.pad would compute otherwise).
                left = shape[axis] + min(begin[axis], 0) + min(end[axis], 0) if shape[axis] is not None else None
                if left is not None and max(begin[axis], end[axis]) > left - 1:
                    raise Unsupported(
                        f"reflect padding of {max(begin[axis], end[axis])} on axis {axis}, which keeps {left} of its "
                        f"{shape[axis]} elements after cropping, reflects beyond the axis: ONNX reflects by at most "
                        "the elements kept − 1 (onnxruntime refuses this model)"
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
            raise Unsupported("antialias and keep_aspect_ratio_policy other than stretch are not supported")
        rank = self._rank(x)
        if _has(node, "axes") and sorted(a % rank for a in _ints(node, "axes", [])) != list(range(rank)):
            raise Unsupported("resizing a subset of the axes (axes attribute) is not supported")
        if mode == "nearest" and (transform, nearest) != ("asymmetric", "floor"):
            raise Unsupported(
                f"nearest mode is supported as torch's 'nearest' exports it (coordinate_transformation_mode "
                f"asymmetric, nearest_mode floor), not {transform}/{nearest}"
            )
        if mode == "linear" and transform not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            raise Unsupported(f"linear mode with coordinate_transformation_mode {transform!r} is not supported "
                               "(half_pixel, pytorch_half_pixel, align_corners)")
        if mode not in ("nearest", "linear"):
            raise Unsupported(f"mode {mode!r} is not supported (nearest and linear only)")
        if rank not in (3, 4, 5):
            raise Unsupported(f"only 1-d, 2-d and 3-d feature maps can be resized ('{x}' has rank {rank})")
        has_scales = len(node.input) > 2 and bool(node.input[2])
        if has_scales == (len(node.input) > 3 and bool(node.input[3])):
            raise Unsupported("exactly one of scales and sizes must be given")
        in_shape = self._batch_free_shape(x)
        if has_scales:
            scales = self._concatenated_floats(node.input[2])
            if scales is None or len(scales) != rank or min(scales) <= 0:
                raise Unsupported(f"its scales must be a stored constant of {rank} positive numbers (got {scales})")
            # Shape inference does not follow scales through a Concat: the output size as ONNX defines it.
            out_shape = tuple(math.floor(n * scale) for n, scale in zip(in_shape, scales[1:]))
            self.shapes[node.output[0]] = (self.shapes[x][0], *out_shape)
            resize: dict[str, tuple] = {"scale_factor": tuple(scales[2:])}
        else:
            out_shape = self._batch_free_shape(node.output[0])
            resize = {"size": tuple(out_shape[1:])}
        if in_shape[0] != out_shape[0] or (has_scales and scales[0] != 1):
            raise Unsupported("resizing the batch or channel axis is not supported")
        if transform == "pytorch_half_pixel" and 1 in out_shape[1:]:
            raise Unsupported("pytorch_half_pixel with an output size of 1 does not match torch's interpolation")
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
            raise Unsupported("training_mode=1 (batch statistics) is not an inference graph")
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
            raise Unsupported("training_mode must be absent or a constant false")
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
            raise Unsupported("dilated average pooling is not supported")
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
        """A mean over every spatial axis is global average pooling (torch.export's form of it)."""
        self._global_pooling(node, "mean", lambda name, source, spatial: [
            self._node(AdaptiveAvgPool.op, name, [source], output_size=(1,) * len(spatial))])

    def _reduce_max(self, node: onnx.NodeProto) -> None:
        """A max over every spatial axis is global max pooling: one window, the whole map."""
        self._global_pooling(node, "max", lambda name, source, spatial: [
            self._node(MaxPool.op, name, [source], kernel=tuple(spatial), stride=tuple(spatial),
                       padding=(0,) * len(spatial), dilation=(1,) * len(spatial))])

    def _reduce_sum(self, node: onnx.NodeProto) -> None:
        """A sum over every spatial axis is global sum pooling: the mean times the window's size
        (each pixel's edge to the sum has weight 1/k·k = 1)."""
        self._global_pooling(node, "sum", lambda name, source, spatial: [
            self._node(AdaptiveAvgPool.op, f"{name}/mean", [source], output_size=(1,) * len(spatial)),
            self._node(Scale.op, name, [f"{name}/mean"], factor=float(prod(spatial)))])

    def _global_pooling(self, node: onnx.NodeProto, reduction: str,
                        pooling: Callable[[str, str, tuple[int, ...]], list[Node]]) -> None:
        """A reduction over every spatial axis as the chain of graph nodes ``pooling(name, source,
        spatial size)`` builds, each reading the one before.

        Its input may be a data movement of a graph node (torch.export pools 1-d maps as
        (C, 1, L)): as long as each channel keeps exactly its own elements, the reduction is
        over the same elements.
        """
        x = self._viewed_activation(node)
        rank, axes = self._rank(x), self._axes(node)
        if axes is None or rank < 3 or sorted(a % rank for a in axes) != list(range(2, rank)):
            raise Unsupported(f"only a {reduction} over all spatial axes (global pooling) is supported: a {reduction} "
                              f"over the batch or channel axis combines neurons of different channels "
                              f"(axes {axes} of a rank-{rank} input)")
        if x in self.moves and x not in self.node_of_value:
            with contextlib.suppress(Unsupported):
                self._materialised(x)  # a channel slice or shuffle becomes a node of its own
        if x in self.moves and x not in self.node_of_value:
            source, index, _ = self.moves[x]
            channels, *spatial = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
            per_channel = prod(spatial)
            own = torch.arange(channels * per_channel).reshape(1, channels, per_channel)
            if tuple(index.shape[:2]) != (index.shape[0], channels) or not torch.equal(
                    index[:1].reshape(1, channels, -1).sort(dim=2).values, own):
                raise Unsupported(f"its input '{x}' does not keep the channels of '{source}'")
        else:
            source = self._activation(node)
            channels, *spatial = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
        if len(spatial) not in (1, 2, 3):
            raise Unsupported(f"its input '{x}' is not a 1-d, 2-d or 3-d feature map of the graph")
        pooled_shape = (channels,) + (1,) * len(spatial)
        chain = pooling(self._unique(node_label(node)), self._source(source), tuple(spatial))
        for pool in chain:
            self._add_node(pool, pooled_shape)
        pool = chain[-1]
        if not _int(node, "keepdims", 1):
            self._emit(self._node(Flatten.op, self._unique(f"{pool.name}/flatten"), [pool.name]), node.output[0])
            return
        pooled_value = f"{node.output[0]}/pooled"
        self.node_of_value[pooled_value] = pool.name
        self.activations.add(pooled_value)
        out_shape = self._batch_free_shape(node.output[0])
        batch = self.shapes[x][0]
        self.moves[node.output[0]] = (pooled_value, torch.arange(batch * channels).reshape(batch, *out_shape), node)

    def _abs(self, node: onnx.NodeProto) -> None:
        """|x| is a LeakyReLU of slope −1: positively homogeneous, piecewise linear, not a ReLU."""
        self._emit_for(node, LeakyReLU, self._activation(node), negative_slope=-1.0)

    def _gather(self, node: onnx.NodeProto) -> None:
        """Gather by stored indices: data movement (each output element copies one input element)."""
        x = self._viewed_activation(node)
        indices = self._static_ints(node.input[1])
        if indices is None:
            raise Unsupported(f"its indices '{node.input[1]}' are not a stored tensor")
        rank = self._rank(x)
        axis = _int(node, "axis", 0) % rank
        indices_shape = self.shapes.get(node.input[1])
        if indices_shape is None or None in indices_shape:
            raise Unsupported(f"the shape of its indices '{node.input[1]}' is unknown after shape inference")

        def transform(index: torch.Tensor) -> torch.Tensor:
            picked = torch.tensor(indices, dtype=torch.long) % index.shape[axis]
            gathered = index.index_select(axis, picked)
            return gathered.reshape(*index.shape[:axis], *indices_shape, *index.shape[axis + 1:])

        self._move(node, transform)

    def _reshape(self, node: onnx.NodeProto) -> None:
        """Reshape, Flatten, Squeeze, Unsqueeze: data movement to the inferred output shape."""
        out_shape = self.shapes.get(node.output[0])
        if out_shape is None or any(d is None for d in out_shape):
            raise Unsupported(f"ONNX shape inference cannot determine the shape of '{node.output[0]}'")
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
                raise Unsupported(f"its split sizes '{node.input[1]}' are not a stored tensor")
            sizes = [self.shapes[out][axis] for out in node.output]
        self._move(node, lambda index: list(torch.split(index, sizes, dim=axis)))

    def _slice(self, node: onnx.NodeProto) -> None:
        x = self._viewed_activation(node)
        rank = self._rank(x)
        starts, ends = self._static_ints(node.input[1]), self._static_ints(node.input[2])
        axes = self._static_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else list(range(len(starts or [])))
        steps = self._static_ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1] * len(axes or [])
        if None in (starts, ends, axes, steps):
            raise Unsupported("its starts, ends, axes and steps must be stored tensors")
        if any(step != 1 for step in steps):
            raise Unsupported(f"only slices with step 1 are supported (steps {steps})")

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
            raise Unsupported("only a sum of activations, or a stored constant added to one, is supported")
        x = self._activation(node, 1 - list(node.input).index(static[0]))
        if self._adds_nothing(node, x, static[0]):
            # MobileOne's ``out += identity`` with identity = 0 in its stem: nothing is added.
            self._emit_for(node, Identity, x)
            return
        self._fuse_bias(node, x, static[0])

    def _sub(self, node: onnx.NodeProto) -> None:
        """Sub of two activations: a difference node. A stored constant subtracted is refused (it
        is no bias pathcond could write back: the tensor would have to change sign)."""
        if any(self._is_static(v) for v in node.input):
            raise Unsupported("only a difference of two activations is supported, not a stored constant subtracted")
        self._emit_for(node, Sub, self._activation(node, 0), self._activation(node, 1))

    def _neg(self, node: onnx.NodeProto) -> None:
        """Neg: a fixed edge of weight −1, the scale node of factor −1."""
        self._emit_for(node, Scale, self._activation(node), factor=-1.0)

    def _adds_nothing(self, node: onnx.NodeProto, x: str, constant: str) -> bool:
        """Whether the sum is activation ``x`` itself: ``constant`` is zeros that broadcast into it."""
        added = self._static_floats(constant)
        shape, x_shape = self.shapes.get(node.output[0]), self.shapes.get(x)
        return added is not None and not any(added) and shape is not None and shape == x_shape

    def _layout_reason(self, constant: str, x: str) -> str | None:
        """Why stored ``constant`` is not read as per-channel when it holds one value per channel
        of the feature map that activation ``x`` moves, along another axis of ``x`` than axis 1
        (the last axis of an NHWC view): its layout; None for any other constant."""
        shape, x_shape = self.shapes.get(constant), self.shapes.get(x)
        if x not in self.moves or shape is None or x_shape is None or len(shape) > len(x_shape) or None in shape:
            return None
        aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
        varying = [axis for axis, size in enumerate(aligned) if size != 1]
        if len(varying) != 1 or varying[0] < 2 or aligned[varying[0]] != x_shape[varying[0]]:
            return None
        axis = varying[0]
        source, index, _ = self.moves[x]
        channels, *spatial = self.node_shapes.get(self._source(source)) or self._batch_free_shape(source)
        per_channel = prod(spatial)
        channel = (index[:1] % (channels * per_channel)).div(per_channel, rounding_mode="floor")
        lines = channel.movedim(axis, -1).reshape(-1, channel.shape[axis])
        if channels != channel.shape[axis] or not (bool((lines == lines[:1]).all())
                                                   and torch.equal(lines[0].sort().values, torch.arange(channels))):
            return None
        last = ", its last axis (where an NHWC tensor has its channels)" if axis == len(x_shape) - 1 else ""
        return (f"'{constant}' holds one value per index of axis {axis} of '{x}'{last}: pathcond reads a per-channel "
                "constant along axis 1 (NCHW) only, so this layout is not supported; apply it in NCHW layout (after "
                "the Transpose back), where it is a per-channel scale or shift that rescales with its channel")

    def _fuse_bias(self, node: onnx.NodeProto, x: str, bias_value: str) -> None:
        """``MatMul`` then ``Add`` of a stored vector: that vector is the Linear layer's bias; a
        per-channel scale (Mul) then ``Add`` of a stored per-channel tensor: its shift. Any other
        stored per-channel tensor added is a bias of its own on fixed edges (a ChannelBias)."""
        layer = self.nodes.get(self._source(x))
        if isinstance(layer, ChannelAffine) and layer.bias is None and self._readers(x) == 1 and self._is_per_channel(
                bias_value, x):
            bias = self._weight(bias_value).key
            if self.aliases.get(bias, bias) == self.aliases.get(layer.weight, layer.weight):
                raise Unsupported(
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
            raise Unsupported(self._layout_reason(bias_value, x) or (
                f"adding the constant '{bias_value}' is only supported as the bias of a MatMul, or as a tensor "
                "holding one value per channel (axis 1, broadcast along every other axis), which rescales with "
                "its channel: a constant shared by several channels would have to rescale by two factors at once, "
                "and one varying within a channel would be a bias per neuron, which pathcond does not read"
            ))
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
                raise Unsupported(f"only concatenation along the channel axis, or of pieces of one activation, is "
                                   f"supported (axis={axis}; input {i} is a constant)")
            pieces.append(self._index_map(value))
        if len({source for source, _ in pieces}) != 1:
            raise Unsupported(f"only concatenation along the channel axis, or of pieces of one activation, is "
                               f"supported (axis={axis})")
        self.moves[node.output[0]] = (pieces[0][0], torch.cat([index for _, index in pieces], dim=axis), node)

    def _spatial_rank(self, value: str) -> int:
        rank = self._rank(value)
        if rank not in (3, 4, 5):
            raise Unsupported(f"pooling needs a 1-d, 2-d or 3-d feature map ('{value}' has rank {rank})")
        return rank - 2


# ONNX Pad modes as the graph's (a constant is zeros or -inf by its value).
_PAD_MODES = {"constant": "zeros", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


HANDLERS: dict[str, Callable[[Translator, onnx.NodeProto], None]] = {
    "Gemm": Translator._gemm,
    "MatMul": Translator._matmul,
    "Conv": Translator._conv,
    "ConvTranspose": Translator._conv_transpose,
    "PRelu": Translator._prelu,
    "Mul": Translator._scale,
    "Div": Translator._scale,
    "Pad": Translator._pad,
    "Resize": Translator._resize,
    "Transpose": Translator._transpose,
    "Split": Translator._split,
    "Slice": Translator._slice,
    "Sum": Translator._add,
    "BatchNormalization": Translator._batch_norm,
    "Relu": Translator._relu,
    "LeakyRelu": Translator._leaky_relu,
    "Identity": Translator._identity,
    "Dropout": Translator._dropout,
    "MaxPool": Translator._max_pool,
    "AveragePool": Translator._average_pool,
    "GlobalAveragePool": Translator._global_average_pool,
    "ReduceMean": Translator._reduce_mean,
    "ReduceMax": Translator._reduce_max,
    "ReduceSum": Translator._reduce_sum,
    "Abs": Translator._abs,
    "Gather": Translator._gather,
    "Flatten": Translator._reshape,
    "Reshape": Translator._reshape,
    "Squeeze": Translator._reshape,
    "Unsqueeze": Translator._reshape,
    "Add": Translator._add,
    "Sub": Translator._sub,
    "Neg": Translator._neg,
    "Concat": Translator._concat,
}


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
        raise Unsupported(f"auto_pad={auto_pad} is not supported; export with explicit pads")
    pads = _ints(node, "pads", [0] * (2 * spatial))
    return tuple(pads[:spatial]), tuple(pads[spatial:])


def _symmetric_pads(node: onnx.NodeProto, spatial: int) -> tuple[int, ...]:
    """``pads`` as torch's per-axis padding; torch has no asymmetric padding for these ops."""
    begin, end = _pads(node, spatial)
    if begin != end:
        raise Unsupported(f"asymmetric padding {list(begin + end)} is not supported")
    return begin


def _layer_name(node: onnx.NodeProto, weight_key: str | None) -> str:
    """The layer's name: its weight's, as the exporter kept it from the module (``layer1.0.conv1``
    for ``layer1.0.conv1.weight``, where torch.export names the node ``node_Conv_292``); the
    node's name when the weight has no module name (``onnx::Conv_193`` of a folded export)."""
    suffix = ".weight"
    if weight_key and weight_key.endswith(suffix) and len(weight_key) > len(suffix) and "::" not in weight_key:
        return weight_key[: -len(suffix)]
    return node_label(node)


def _op_label(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"


def _unsupported_reason(node: onnx.NodeProto) -> str:
    if node.domain not in DEFAULT_DOMAINS:
        return f"operators of domain '{node.domain}' are not supported"
    return "this operator is not supported on the activation path"
