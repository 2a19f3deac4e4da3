"""Translating a shape-inferred ONNX graph into the ReLU DAG: :class:`Translator`, which keeps
the books (regions, parameters, graph nodes, shapes) and hands each node to the handler of its
op type in :mod:`.onnx_ops`. Every unsupported node is collected."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from math import prod

import onnx
import torch
from onnx import numpy_helper

from ...engine.graph import Graph, Input, Node
from ...engine.model import Carried
from ...errors import UnsupportedModelError
from .movement import UnsupportedMovement, movement_layer
from .offenders import NotHomogeneous, Unsupported, grouped, offender_note
from .onnx_fold import SHAPE_QUERIES
from .onnx_read import (
    DEFAULT_DOMAINS,
    constant_tensor,
    has_attribute,
    int_attribute,
    ints_attribute,
    node_label,
    one_line,
    value_shapes,
)
from .spec import node_from_layer


@dataclasses.dataclass
class _Weight:
    """A static tensor read as a parameter: its checkpoint key and whether a Transpose flips it."""

    key: str
    transposed: bool


Handler = Callable[["Translator", onnx.NodeProto], None]


@dataclasses.dataclass(frozen=True)
class OpTable:
    """What the translator knows of the op types of the default domains (:data:`.onnx_ops.OPS`):
    the handler of each it reads, those it refuses as not positively homogeneous where no handler
    reads them, and those whose stored inputs make a layer's parameters."""

    handlers: Mapping[str, Handler]
    not_homogeneous: frozenset[str]
    parameter_layers: frozenset[str]


class Translator:
    """Builds the :class:`Graph` of a shape-inferred model, collecting every unsupported node.

    Its methods without a leading underscore are what the op handlers of :mod:`.onnx_ops` build
    the graph with; ``ops`` is their table, handed in, so that this module does not import the
    handlers that import it."""

    def __init__(
        self,
        model: onnx.ModelProto,
        label: str,
        ops: OpTable,
        read_nodes=None,
        written: onnx.GraphProto | None = None,
        written_opset: int | None = None,
    ):
        """``read_nodes``: the nodes of the model as written back, position by position (``model``'s
        own by default); shape arithmetic folded for translation still reads there what it read.
        ``written``: the graph written back (of ONNX opset ``written_opset``), whose names copies of
        parameters must avoid too, and whose own values and operations the DAG's outputs and the
        report name where ``model`` is its conversion to another opset."""
        self.label = label
        self.ops = ops
        self.written_opset = written_opset
        file_graph = written if written is not None else model.graph
        self.written_nodes = list(file_graph.node)
        # The file's node giving each value: a node of the model as read that gives none of them
        # (or gives it under another operation) is the converter's.
        self.written_producer = {out: n for n in self.written_nodes for out in n.output if out}
        self.written_values = (
            set(self.written_producer) | {v.name for v in file_graph.input} | {t.name for t in file_graph.initializer}
        )
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
        self.taken: set[str] = {
            v.name
            for graph in (model.graph, written)
            if graph is not None
            for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)
        }
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

    def _read(
        self, shapes: dict[str, tuple[int, ...]], needed: set[str], pre: set[int], post: set[int]
    ) -> Graph | None:
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
            self.emit(self.graph_node(Input.op, self.unique_name(value), (), shape=shape), value)
            self.activations.add(value)
            self.input_values.append(value)

    def _batch_free_shape_or_problem(self, value: str) -> tuple[int, ...] | None:
        """A pre-processing output's batch-free shape, the DAG's input; None (a problem) when unknown."""
        try:
            return self.batch_free_shape(value)
        except Unsupported as exc:
            self.problems.append(f"'{value}', an output of the pre-processing the network's layers read: {exc}")
            return None

    def _read_by_dag(self, value: str, needed: set[str], carried: set[int]) -> bool:
        """Whether a needed node outside ``carried`` reads ``value`` (not only measures its shape)."""
        return any(
            self.index_of[id(reader)] not in carried
            and reader.op_type not in SHAPE_QUERIES
            and any(out in needed for out in reader.output)
            for reader in self.consumers.get(value, [])
        )

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
            if self._is_layer(node, computed) or any(
                self.index_of[id(reader)] in reaches_layer
                for out in node.output
                for reader in self.consumers.get(out, [])
            ):
                reaches_layer.add(index)
        after_dag = {index for index in candidates if index not in reaches_layer} if reaches_layer else set()
        return pure & reaches_layer, after_dag

    def _is_layer(self, node: onnx.NodeProto, computed: set[str]) -> bool:
        """A layer with parameters: an op that carries weights, reading a tensor not computed from
        the inputs, or a Mul/Add the DAG reads a parameter of (a per-channel scale, shift or bias)."""
        if node.op_type in self.ops.parameter_layers:
            return any(value and value not in computed for value in node.input)
        return self.per_channel_parameter(node, computed) is not None

    def per_channel_parameter(self, node: onnx.NodeProto, activations: set[str]) -> str | None:
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
        if node.op_type == "Add" and self.adds_nothing(node, x, static[0]):
            return None
        return static[0] if self.is_per_channel(static[0], x) else None

    def is_per_channel(self, value: str, x: str) -> bool:
        """Whether stored ``value`` holds one value per channel of activation ``x`` (broadcast
        along every other axis, e.g. ``[C, 1, 1]`` against ``(N, C, H, W)``)."""
        shape, x_shape = self.shapes.get(value), self.shapes.get(x)
        if shape is None or x_shape is None or len(shape) > len(x_shape) or None in shape or x_shape[1] in (None, 1):
            return False
        aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
        return aligned[1] == x_shape[1] and all(size == 1 for axis, size in enumerate(aligned) if axis != 1)

    def adds_nothing(self, node: onnx.NodeProto, x: str, constant: str) -> bool:
        """Whether the sum is activation ``x`` itself: ``constant`` is zeros that broadcast into it."""
        added = self.static_floats(constant)
        shape, x_shape = self.shapes.get(node.output[0]), self.shapes.get(x)
        return added is not None and not any(added) and shape is not None and shape == x_shape

    def _translate_node(self, node: onnx.NodeProto) -> None:
        self.current = node
        handler = self.ops.handlers.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        follows_refusal = any(value in self.after_refusal for value in node.input)
        if follows_refusal:
            self.after_refusal.update(node.output)
        try:
            if handler is None:
                if node.domain in DEFAULT_DOMAINS and node.op_type in self.ops.not_homogeneous:
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
        post_reads = [
            self._written_value(value)
            for index in sorted(post)
            for value in self.onnx_nodes[index].input
            if value in self.activations and value not in carried_values
        ]
        outputs = []
        for value in dict.fromkeys([*self.graph_outputs, *post_reads]):
            if value in carried_values:
                continue
            if value not in self.activations:
                self.problems.append(f"graph output '{value}' does not depend on the network input")
            elif value in self.moves:
                try:
                    outputs.append((value, self.source_node(self.materialised(value))))
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

    def unique_name(self, preferred: str) -> str:
        name, suffix = preferred, 1
        while name in self.nodes:
            name, suffix = f"{preferred}_{suffix}", suffix + 1
        return name

    def add_node(self, node: Node, shape: tuple[int | None, ...] | None) -> Node:
        """Add ``node``, whose output has batch-free ``shape`` in the graph."""
        self.nodes[node.name] = node
        self.node_shapes[node.name] = shape
        return node

    def emit(self, node: Node, value: str) -> Node:
        """Add ``node`` as the producer of ONNX ``value``."""
        self.node_of_value[value] = node.name
        return self.add_node(node, self._known_batch_free_shape(value))

    def emit_for(self, onnx_node: onnx.NodeProto, node_type: type[Node], *inputs: str, **attributes) -> Node:
        """Add the graph node of ``node_type`` standing for ``onnx_node`` (named after its weight, or
        after it) reading ``inputs``."""
        name = self.unique_name(_layer_name(onnx_node, attributes.get("weight")))
        node = self.graph_node(node_type.op, name, [self.source_node(v) for v in inputs], **attributes)
        return self.emit(self._claim(onnx_node, node), onnx_node.output[0])

    def graph_node(self, op: str, name: str, inputs: Sequence[str], **attributes) -> Node:
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

    def source_node(self, value: str) -> str:
        """The graph node producing activation ``value`` (its ONNX name while a problem hides it)."""
        return self.node_of_value.get(value, value)

    def viewed_activation(self, node: onnx.NodeProto) -> str:
        """Input 0, an activation that may be a pending data movement of the graph node behind it."""
        value = node.input[0]
        if value not in self.activations:
            raise Unsupported(f"input 0 ('{value}') is expected to be computed from the network input")
        return value

    def activation(self, node: onnx.NodeProto, index: int = 0) -> str:
        value = node.input[index] if index < len(node.input) else ""
        if value not in self.activations:
            raise Unsupported(f"input {index} ('{value}') is expected to be computed from the network input")
        return self.materialised(value) if value in self.moves else value

    def materialised(self, value: str) -> str:
        """A pending data movement turned into the graph node it amounts to (once per value)."""
        if value in self.node_of_value:
            return value
        source, index, op = self.moves[value]
        batch = index.shape[0]
        per_example = index.numel() // batch if batch else 0
        origin_shape = self.node_shape(source)
        examples = index.reshape(batch, -1) // max(prod(origin_shape), 1)
        if per_example and not bool((examples == torch.arange(batch)[:, None]).all()):
            raise Unsupported(
                f"its input '{value}' comes from node '{node_label(op)}' ({op.op_type}), "
                "which mixes examples of the batch"
            )
        try:
            layer = movement_layer(tuple(origin_shape), index[:1])
        except UnsupportedMovement as exc:
            raise Unsupported(f"its input '{value}' comes from node '{node_label(op)}' ({op.op_type}): {exc}") from None
        if layer is None:
            self.node_of_value[value] = self.source_node(source)
        else:
            kind = layer.pop("type")
            name = self.unique_name(node_label(op))
            self.emit(self.graph_node(kind, name, [self.source_node(source)], **layer), value)
        return value

    def move(
        self, node: onnx.NodeProto, transform: Callable[[torch.Tensor], torch.Tensor | list[torch.Tensor]]
    ) -> None:
        """Record ``node`` (Reshape, Transpose, Split, Slice, ...) as data movement of its input 0."""
        source, index = self.index_map(self.viewed_activation(node))
        try:
            results = transform(index)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise Unsupported(f"cannot be replayed on its input's index map ({one_line(exc)})") from None
        results = results if isinstance(results, list) else [results]
        for value, result in zip(node.output, results):
            if value:
                self.moves[value] = (source, result, node)

    def index_map(self, value: str) -> tuple[str, torch.Tensor]:
        """Activation ``value`` as (the activation it moves, index map): its pending data
        movement, or itself and the identity."""
        if value in self.moves:
            source, index, _ = self.moves[value]
            return source, index
        shape = self.shapes.get(value)
        if shape is None or any(d is None for d in shape):
            raise Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return value, torch.arange(prod(shape)).reshape(shape)

    def is_static(self, value: str) -> bool:
        return bool(value) and value not in self.activations

    def readers(self, value: str) -> int:
        return len(self.consumers.get(value, [])) + (value in self.graph_outputs)

    def require_unused(self, node: onnx.NodeProto, *indices: int) -> None:
        for i in indices:
            if i < len(node.output) and node.output[i] and self.readers(node.output[i]):
                raise Unsupported(f"its output {i} ('{node.output[i]}') is used; only inference outputs are supported")

    # ---- shapes

    def _known_batch_free_shape(self, value: str) -> tuple[int | None, ...] | None:
        shape = self.shapes.get(value)
        return None if shape is None else tuple(shape[1:])

    def rank(self, value: str) -> int:
        shape = self.shapes.get(value)
        if shape is None:
            raise Unsupported(f"the rank of '{value}' is unknown after shape inference")
        return len(shape)

    def batch_free_shape(self, value: str) -> tuple[int, ...]:
        shape = self._known_batch_free_shape(value)
        if shape is None or any(d is None for d in shape):
            raise Unsupported(f"ONNX shape inference cannot determine the shape of '{value}'")
        return shape

    def node_shape(self, value: str) -> tuple[int | None, ...]:
        """The batch-free shape of the graph node producing activation ``value``, or, where the
        graph does not know it, the shape inference's of ``value``."""
        return self.node_shapes.get(self.source_node(value)) or self.batch_free_shape(value)

    # ---- static tensors

    def _is_stored(self, value: str) -> bool:
        constant = self.constants.get(value)
        return value in self.initializers or (constant is not None and constant_tensor(constant) is not None)

    def _record_read(self, reader: onnx.NodeProto, value: str) -> None:
        self.parameter_values.add(value)
        index = self.index_of[id(reader)]
        self.parameter_reads.update((index, position) for position, v in enumerate(reader.input) if v == value)

    def weight(self, value: str, reader: onnx.NodeProto | None = None) -> _Weight:
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
            if self._is_stored(source) and self.readers(source) > 1:
                # One stored tensor behind several Identity nodes (TorchScript deduplicates
                # equal tensors this way): each reader becomes its own parameter.
                self.aliases[value] = source
                self._record_read(producer, source)
                return _Weight(value, False)
            return self.weight(source, producer)
        if not producer.input:
            what = (
                f"a Constant node '{node_label(producer)}' holding no numeric tensor"
                if producer.op_type == "Constant"
                else f"a {producer.op_type} node '{node_label(producer)}', which has no inputs"
            )
            raise Unsupported(
                f"its tensor input '{value}' is computed by {what}; only stored tensors (initializers and "
                "Constant nodes) can be rescaled: store the value as an initializer"
            )
        is_matrix_transpose = (
            producer.op_type == "Transpose"
            and self.rank(producer.input[0]) == 2
            and ints_attribute(producer, "perm", [1, 0]) == [1, 0]
        )
        if producer.op_type == "Transpose" and is_matrix_transpose:
            inner = self.weight(producer.input[0], producer)
            return _Weight(inner.key, not inner.transposed)
        raise Unsupported(
            f"its tensor input '{value}' is computed by a {producer.op_type} node; only stored tensors are supported"
        )

    def plain_weight(self, value: str, role: str, expected_rank: int) -> str:
        weight = self.weight(value)
        shape = self.shapes.get(value)
        if weight.transposed or shape is None or len(shape) != expected_rank:
            raise Unsupported(f"its {role} '{value}' must be a stored tensor of rank {expected_rank}")
        return weight.key

    def static_ints(self, value: str) -> list[int] | None:
        """An int tensor stored in the model (axes of ReduceMean, Squeeze, ...), or None."""
        constant = self.constants.get(value)
        if constant is None:
            proto = self.initializers.get(value)
            return None if proto is None else [int(v) for v in numpy_helper.to_array(proto).reshape(-1)]
        tensor = constant_tensor(constant)
        if tensor is not None:
            return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
        if has_attribute(constant, "value_ints"):
            return ints_attribute(constant, "value_ints", [])
        if has_attribute(constant, "value_int"):
            return [int_attribute(constant, "value_int", 0)]
        return None

    def static_floats(self, value: str) -> list[float] | None:
        """A small float tensor stored in the model (Mul/Div constants, Pad's value), or None."""
        key = value
        while key not in self.initializers and key not in self.constants:
            producer = self.producer.get(key)
            if producer is None or producer.op_type not in ("Identity", "Cast"):
                return None
            key = producer.input[0]
        proto = self.initializers.get(key) or constant_tensor(self.constants[key])
        return None if proto is None else [float(v) for v in numpy_helper.to_array(proto).reshape(-1)]


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
