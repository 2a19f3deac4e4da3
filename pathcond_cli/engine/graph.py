"""The network as a typed DAG of tensor operations (SPEC §1).

Every loader (ONNX, safetensors + spec, torch.fx) produces a :class:`Graph` that names the
checkpoint's tensors by key; the engine never looks at the file format again. Tensors keep
their batch-free shapes: ``(C, H, W)`` for images, ``(C, L)`` for 1-d signals, ``(F,)`` for
feature vectors. Axis 0 of every shape is the channel axis that rescaling groups live on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from math import prod
from typing import Any, ClassVar, TypeVar

import torch

from ..errors import InputError, InvalidWeightsError, UnsupportedModelError
from .layouts import stand_ins
from .schema import (
    REQUIRED,
    boolean,
    choice,
    finite_floats,
    hyper,
    integer,
    ints,
    number,
    optional_ints,
    optional_sizes,
    positive_floats,
)

SPATIAL_RANKS = (1, 2, 3)


@dataclass(frozen=True)
class Node:
    """One tensor-valued operation. ``inputs`` name the nodes whose outputs it consumes.

    The class variables are the node type's static schema, read by the graph checks, the
    spec format (whose layer table is derived from the node classes) and the engine; its
    behaviour (forward, squared network, ties, DAG parameters) is its rule in :mod:`.rules`.
    Hyper-parameter fields are declared with :func:`.schema.hyper` and their validator.
    """

    name: str
    inputs: tuple[str, ...]

    op: ClassVar[str] = "node"
    # Fewest and most inputs (None: no limit).
    arity: ClassVar[tuple[int, int | None]] = (1, 1)
    # Checkpoint tensors read, by role (the field holding the key), with their accepted ranks
    # (empty: any rank); ``optional_roles`` may be None (a layer without bias).
    roles: ClassVar[dict[str, tuple[int, ...]]] = {}
    optional_roles: ClassVar[tuple[str, ...]] = ()
    # Fields given per spatial axis (a spec may give one value for all).
    per_axis_fields: ClassVar[tuple[str, ...]] = ()
    # Spatial ranks of the input the node accepts (None: any).
    input_spatial_ranks: ClassVar[tuple[int, ...] | None] = None
    # A layer that creates channels from DAG weights: BatchNorm right after it is folded in,
    # and it counts in the paper's hidden units.
    creates_channels: ClassVar[bool] = False
    # Inputs combined element-wise: of one rank, each axis equal or 1 (broadcast).
    broadcasts_inputs: ClassVar[bool] = False

    def parameter_keys(self) -> dict[str, str]:
        """Checkpoint tensor keys this node reads, by role (``weight``, ``bias``, ...)."""
        keys = {role: getattr(self, role) for role in self.roles}
        return {role: key for role, key in keys.items() if key is not None}

    def output_spatial_rank(self, input_rank: int) -> int:
        return input_rank


# Every node type by its op, in definition order: what graphs may hold, the spec's layer types,
# and the types that must each have a rule (a Node subclass defined elsewhere, a test's, is none).
NODE_TYPES: dict[str, type[Node]] = {}
NodeClass = TypeVar("NodeClass", bound=type[Node])


def node_type(cls: NodeClass) -> NodeClass:
    """Register node class ``cls`` in :data:`NODE_TYPES` under its ``op``, which must be new."""
    if cls.op in NODE_TYPES:
        raise ValueError(f"node types {NODE_TYPES[cls.op].__name__} and {cls.__name__} have one op, '{cls.op}'")
    NODE_TYPES[cls.op] = cls
    return cls


@node_type
@dataclass(frozen=True)
class Input(Node):
    """A network input; ``shape`` excludes the batch dimension."""

    shape: tuple[int, ...] = hyper((), ints(1), spec_default=None)
    inputs: tuple[str, ...] = ()
    op: ClassVar[str] = "input"
    arity = (0, 0)

    def output_spatial_rank(self, input_rank: int) -> int:
        return len(self.shape) - 1


@dataclass(frozen=True)
class WeightedNode(Node):
    """A layer with a weight tensor and an optional bias."""

    weight: str = ""
    bias: str | None = None
    optional_roles = ("bias",)
    creates_channels = True


@node_type
@dataclass(frozen=True)
class Linear(WeightedNode):
    """``y = W x + b`` on a feature vector. ``weight_transposed``: stored as ``[in, out]``."""

    weight_transposed: bool = hyper(False, boolean)
    op: ClassVar[str] = "linear"
    roles = {"weight": (2,), "bias": (1,)}
    input_spatial_ranks = (0,)

    def output_spatial_rank(self, input_rank: int) -> int:
        return 0


@node_type
@dataclass(frozen=True)
class Conv(WeightedNode):
    """1-d, 2-d or 3-d convolution (the kernel's rank decides). Weight ``[O, I/groups, *k]``."""

    stride: tuple[int, ...] = hyper((1,), ints(1))
    padding: tuple[int, ...] = hyper((0,), ints(0))
    dilation: tuple[int, ...] = hyper((1,), ints(1))
    groups: int = hyper(1, integer(1))
    op: ClassVar[str] = "conv"
    roles = {"weight": (3, 4, 5), "bias": (1,)}
    per_axis_fields = ("stride", "padding", "dilation")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class ConvTranspose(WeightedNode):
    """1-d, 2-d or 3-d transposed convolution. Weight ``[I, O/groups, *k]`` as torch stores it."""

    stride: tuple[int, ...] = hyper((1,), ints(1))
    padding: tuple[int, ...] = hyper((0,), ints(0))
    output_padding: tuple[int, ...] = hyper((0,), ints(0))
    dilation: tuple[int, ...] = hyper((1,), ints(1))
    groups: int = hyper(1, integer(1))
    op: ClassVar[str] = "conv_transpose"
    roles = {"weight": (3, 4, 5), "bias": (1,)}
    per_axis_fields = ("stride", "padding", "output_padding", "dilation")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class BatchNorm(Node):
    """Per-channel ``γ (x − μ) / √(σ² + eps) + β``.

    Directly after a Linear/Conv that feeds nothing else it is folded into that layer;
    anywhere else (pre-activation blocks, after a Concat) it is a layer of its own whose
    input channels can never be rescaled (batch statistics would undo the scale).
    """

    weight: str = ""
    bias: str = ""
    running_mean: str = ""
    running_var: str = ""
    # eps = 0 is a BatchNorm too: running_var + eps > 0 is checked per channel (batchnorm_variance_problems).
    eps: float = hyper(1e-5, number("a number >= 0", lambda x: x >= 0))
    momentum: float = hyper(0.1, number("a number in [0, 1]", lambda x: 0 <= x <= 1))
    op: ClassVar[str] = "batchnorm"
    roles = {"weight": (1,), "bias": (1,), "running_mean": (1,), "running_var": (1,)}


@node_type
@dataclass(frozen=True)
class ReLU(Node):
    op: ClassVar[str] = "relu"


@node_type
@dataclass(frozen=True)
class LeakyReLU(Node):
    negative_slope: float = hyper(0.01, number("a finite number"))
    op: ClassVar[str] = "leaky_relu"


@node_type
@dataclass(frozen=True)
class PReLU(Node):
    """LeakyReLU whose slope (one per channel, or one shared) is a checkpoint tensor.

    Positively homogeneous whatever the slope, so the slope is read but never rescaled: it
    counts among the checkpoint's parameters, not among the DAG parameters.
    """

    weight: str = ""
    op: ClassVar[str] = "prelu"
    # Any rank: ONNX stores the slope as [C, 1, 1].
    roles = {"weight": ()}


@node_type
@dataclass(frozen=True)
class Scale(Node):
    """Multiplication by a constant: a fixed edge of weight ``factor`` (Mul/Div by a constant)."""

    factor: float = hyper(1.0, number("a finite number"), spec_default=REQUIRED)
    op: ClassVar[str] = "scale"


PAD_MODES = ("zeros", "reflect", "replicate", "circular", "-inf")
COPYING_PAD_MODES = ("reflect", "replicate", "circular")


@node_type
@dataclass(frozen=True)
class Pad(Node):
    """Padding of the spatial axes: ``begin``/``end`` elements per axis.

    A negative ``begin``/``end`` crops that many elements instead, as ONNX Pad and torch's
    F.pad read negative pads: the crop comes first and the mode pads the cropped tensor (a
    crop is a selection: each output pixel copies one input pixel of its channel). ``mode``:
    ``zeros`` (a padded neuron has no incoming edge: always 0); ``reflect``,
    ``replicate`` or ``circular`` as torch's F.pad (each padded pixel copies one input pixel of
    its channel: a fixed edge of weight 1, like upsample); ``-inf`` (no incoming edge, value
    −inf: positively homogeneous, and read only by a max-pool, whose window it extends exactly
    as max-pooling's own padding does). A constant c ∉ {0, −inf} has no mode: its padded
    neurons output c whatever the scale of their channel, which is not homogeneous.
    """

    begin: tuple[int, ...] = hyper((0,), ints(None))
    end: tuple[int, ...] = hyper((0,), ints(None))
    mode: str = hyper("zeros", choice(*PAD_MODES))
    op: ClassVar[str] = "pad"
    per_axis_fields = ("begin", "end")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class ChannelAffine(Node):
    """Per-channel ``y_c = weight_c · x_c + bias_c`` that follows no Linear/Conv: BatchNorm on an
    identity or residual branch exported as Mul and Add of constants (RepVGG/MobileOne training
    blocks, pre-activation networks).

    A depthwise 1×1 layer of the DAG (SPEC §1): ``weight_c`` is the parameter on the edge from
    input channel c to the new channel c, ``bias_c`` the new neuron's bias; the input channels
    stay free (no batch statistics). Each tensor holds one value per channel, stored in any
    shape with at most one axis longer than 1 (``[C]``, ``[C, 1, 1]``, ``[1, C, 1, 1]``).
    """

    weight: str = ""
    bias: str | None = None
    op: ClassVar[str] = "channel_affine"
    roles = {"weight": (), "bias": ()}
    optional_roles = ("bias",)


@node_type
@dataclass(frozen=True)
class ChannelBias(Node):
    """A stored per-channel constant added to a tensor, ``y_c = x_c + bias_c``, where no layer
    takes it as its own bias (a constant added to a sum of branches, ``x + self.shift``).

    ``bias_c`` is the bias of neuron c, and the edge from x_c to y_c is a fixed edge of weight
    1: y_c keeps x_c's scale, and the bias rescales with it (a parameter with one +1 in B).
    The tensor holds one value per channel, stored in any shape with at most one axis longer
    than 1 (``[C]``, ``[C, 1, 1]``, ``[1, C, 1, 1]``).
    """

    bias: str = ""
    op: ClassVar[str] = "channel_bias"
    roles = {"bias": ()}


@node_type
@dataclass(frozen=True)
class FixedFilter(Node):
    """A depthwise convolution by constant coefficients: output channel c is input channel c
    convolved with its own filter, which is no parameter (a module's buffer, as timm's
    BlurPool2d holds its binomial filter).

    Each tap is a fixed edge whose weight is its coefficient, like an average pool with
    non-uniform weights: it commutes with a positive scale of its channel (output channel c is
    tied to input channel c), and enters the path products, diag(G) and the path norms as a
    constant (|c|^q). ``coefficients`` are the filters ``[C, 1, *kernel]`` flattened.
    """

    kernel: tuple[int, ...] = hyper((1,), ints(1), spec_default=REQUIRED)
    coefficients: tuple[float, ...] = hyper((1.0,), finite_floats, spec_default=REQUIRED)
    stride: tuple[int, ...] = hyper((1,), ints(1))
    padding: tuple[int, ...] = hyper((0,), ints(0))
    dilation: tuple[int, ...] = hyper((1,), ints(1))
    op: ClassVar[str] = "fixed_filter"
    per_axis_fields = ("kernel", "stride", "padding", "dilation")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class Upsample(Node):
    """Nearest or (bi/tri)linear resize (nn.Upsample, F.interpolate, ONNX Resize).

    ``mode`` is ``nearest`` (torch's 'nearest', ONNX asymmetric/floor) or ``linear`` (linear,
    bilinear or trilinear by the input's spatial rank). Exactly one of ``size`` (output
    spatial size) and ``scale_factor`` is given; a single value applies to every spatial axis.
    Output channel c is input channel c times fixed non-negative coefficients.
    """

    mode: str = hyper("nearest", choice("nearest", "linear"))
    size: tuple[int, ...] = hyper((), optional_sizes)
    scale_factor: tuple[float, ...] = hyper((), positive_floats)
    align_corners: bool = hyper(False, boolean)
    op: ClassVar[str] = "upsample"
    input_spatial_ranks = SPATIAL_RANKS


@dataclass(frozen=True)
class ChannelCopy(Node, ABC):
    """Output channel c is a copy of input channel s(c), whole: a fixed edge of weight 1 per
    element, so output channel c keeps channel s(c)'s scale and is the same copy in the squared
    network. Each subclass gives its map s (:meth:`source_channels`); one rule serves them all."""

    @abstractmethod
    def source_channels(self, count: int) -> torch.Tensor:
        """s: the input channel each output channel copies, for an input of ``count`` channels;
        ValueError when the node does not fit such an input."""


@node_type
@dataclass(frozen=True)
class ChannelShuffle(ChannelCopy):
    """ShuffleNet's channel shuffle: view ``(groups, C/groups)``, transpose, flatten back."""

    groups: int = hyper(1, integer(1), spec_default=REQUIRED)
    op: ClassVar[str] = "channel_shuffle"

    def source_channels(self, count: int) -> torch.Tensor:
        """Output channel j·groups + i copies input channel i·(C/groups) + j."""
        if count % self.groups:
            raise ValueError(f"{count} channels cannot be shuffled in {self.groups} groups")
        return torch.arange(count).reshape(self.groups, count // self.groups).t().reshape(-1)


@node_type
@dataclass(frozen=True)
class ChannelSlice(ChannelCopy):
    """Channels ``start:stop`` of its input (torch.split/chunk/slicing, ONNX Split/Slice)."""

    start: int = hyper(0, integer(0))
    stop: int = hyper(1, integer(1), spec_default=REQUIRED)
    op: ClassVar[str] = "channel_slice"

    def source_channels(self, count: int) -> torch.Tensor:
        if not 0 <= self.start < self.stop <= count:
            raise ValueError(f"channels {self.start}:{self.stop} are not a non-empty range of {count}")
        return torch.arange(self.start, self.stop)


@node_type
@dataclass(frozen=True)
class ChannelGather(ChannelCopy):
    """Output channel j is input channel ``channels[j]``: any other reordering or selection of
    whole channels (e.g. a channel shuffle followed by a chunk, as ShuffleNetV2 does)."""

    channels: tuple[int, ...] = hyper((0,), ints(0), spec_default=REQUIRED)
    op: ClassVar[str] = "channel_gather"

    def source_channels(self, count: int) -> torch.Tensor:
        if not all(0 <= c < count for c in self.channels):
            raise ValueError(f"channels {list(self.channels)} are not all among the input's {count}")
        return torch.tensor(self.channels)


@node_type
@dataclass(frozen=True)
class Rearrange(Node):
    """Any other data movement: each output element copies one input element (a Transpose of an
    NHWC layout, a Reshape from features to ``(C, H, W)``, any chain of Transpose, Reshape,
    Flatten, Squeeze, Unsqueeze, Slice and Gather that no simpler node expresses).

    ``shape`` is the output's batch-free shape. The output element at row-major position j copies
    the input element at flat batch-free index ``index[j]``, given in one of two forms:

    * a strided view of the flattened input, as every chain of Transpose, Reshape, Flatten,
      Squeeze, Unsqueeze and stepped Slice is: ``index`` is ``offset + Σ_k i_k·strides[k]`` over
      the row-major multi-indices ``i`` of ``sizes`` (a few numbers for any tensor size);
    * ``elements``, the indices one by one (a Gather), with ``sizes`` and ``strides`` empty.

    Each copy is a fixed edge of weight 1, so each output element keeps the scale of the input
    element it copies (ties are made only where a reader needs one scale per channel).
    """

    shape: tuple[int, ...] = hyper((1,), ints(1), spec_default=REQUIRED)
    sizes: tuple[int, ...] = hyper((), optional_ints(1))
    strides: tuple[int, ...] = hyper((), optional_ints(None))
    offset: int = hyper(0, integer(0))
    elements: tuple[int, ...] = hyper((), optional_ints(0))
    op: ClassVar[str] = "rearrange"

    def output_spatial_rank(self, input_rank: int) -> int:
        return len(self.shape) - 1

    @cached_property
    def index(self) -> torch.Tensor:
        """The flat input index of every output element, shaped like the output (batch-free),
        built once; ValueError when the fields do not describe one index per output element."""
        count = prod(self.shape)
        if self.elements:
            if self.sizes or self.strides or self.offset:
                raise ValueError(
                    "'elements' and a strided view ('sizes', 'strides', 'offset') are two forms of "
                    "one map: give one of them"
                )
            if len(self.elements) != count:
                raise ValueError(f"{len(self.elements)} element indices are not one per element of {self.shape}")
            return torch.tensor(self.elements, dtype=torch.long).reshape(self.shape)
        if len(self.sizes) != len(self.strides) or prod(self.sizes) != count:
            raise ValueError(
                f"a view of sizes {list(self.sizes)} and strides {list(self.strides)} does not give one "
                f"index per element of {self.shape} (one stride per size, as many elements)"
            )
        index = torch.full((), self.offset, dtype=torch.long)
        for size, stride in zip(self.sizes, self.strides):
            index = index.unsqueeze(-1) + torch.arange(size) * stride
        return index.reshape(self.shape)

    @cached_property
    def index_bounds(self) -> tuple[int, int]:
        """The smallest and largest input index copied."""
        return (int(self.index.min()), int(self.index.max())) if self.index.numel() else (0, -1)


@node_type
@dataclass(frozen=True)
class Identity(Node):
    """Pass-through (Identity, Dropout in inference)."""

    op: ClassVar[str] = "identity"


@node_type
@dataclass(frozen=True)
class MaxPool(Node):
    kernel: tuple[int, ...] = hyper((2, 2), ints(1), spec_default=REQUIRED)
    # A spec's default stride (None) is the kernel, as in torch.
    stride: tuple[int, ...] = hyper((2, 2), ints(1), spec_default=None)
    padding: tuple[int, ...] = hyper((0, 0), ints(0), spec_default=(0,))
    dilation: tuple[int, ...] = hyper((1, 1), ints(1), spec_default=(1,))
    ceil_mode: bool = hyper(False, boolean)
    op: ClassVar[str] = "maxpool"
    per_axis_fields = ("kernel", "stride", "padding", "dilation")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class AvgPool(Node):
    kernel: tuple[int, ...] = hyper((2, 2), ints(1), spec_default=REQUIRED)
    stride: tuple[int, ...] = hyper((2, 2), ints(1), spec_default=None)
    padding: tuple[int, ...] = hyper((0, 0), ints(0), spec_default=(0,))
    ceil_mode: bool = hyper(False, boolean)
    count_include_pad: bool = hyper(True, boolean)
    op: ClassVar[str] = "avgpool"
    per_axis_fields = ("kernel", "stride", "padding")
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class AdaptiveAvgPool(Node):
    """Adaptive average pooling to a fixed output size (global pooling: all ones)."""

    output_size: tuple[int, ...] = hyper((1, 1), ints(1), spec_default=REQUIRED)
    op: ClassVar[str] = "adaptive_avgpool"
    per_axis_fields = ("output_size",)
    input_spatial_ranks = SPATIAL_RANKS


@node_type
@dataclass(frozen=True)
class Flatten(Node):
    """Flatten ``(C, *spatial)`` into ``(C·prod(spatial),)``, channel-major as torch does."""

    op: ClassVar[str] = "flatten"

    def output_spatial_rank(self, input_rank: int) -> int:
        return 0


@node_type
@dataclass(frozen=True)
class Add(Node):
    """Element-wise sum of two or more tensors of one rank (residual connections); an axis of
    size 1 is broadcast, as torch and ONNX do."""

    op: ClassVar[str] = "add"
    arity = (2, None)
    broadcasts_inputs = True


@node_type
@dataclass(frozen=True)
class Sub(Node):
    """Element-wise difference of two tensors, ``inputs[0] − inputs[1]``, of one rank (an axis of
    size 1 is broadcast, as for :class:`Add`): a fixed edge of weight +1 from the first input and
    one of weight −1 from the second. Positively homogeneous; the path norms and diag(G) take
    |−1|^q = 1, and the two inputs' channels are tied as a sum's are."""

    op: ClassVar[str] = "sub"
    arity = (2, 2)
    broadcasts_inputs = True


@node_type
@dataclass(frozen=True)
class Concat(Node):
    """Concatenation along the channel axis."""

    op: ClassVar[str] = "concat"
    arity = (1, None)


def broadcast_problem(node: Node, shapes: Sequence[tuple[int, ...]]) -> str | None:
    """Why ``node`` cannot combine element-wise tensors of batch-free ``shapes``, or None:
    they need one rank and, on each axis, one size or size 1 (broadcast)."""
    out = tuple(max(sizes) for sizes in zip(*shapes))
    if len({len(shape) for shape in shapes}) == 1 and all(n in (1, m) for shape in shapes for n, m in zip(shape, out)):
        return None
    shown = ", ".join(str(tuple(shape)) for shape in shapes)
    return (
        f"node '{node.name}' ({node.op}) combines tensors of shapes {shown}: they must have one rank and, "
        "on each axis, one size or size 1 (broadcast)"
    )


def node_attributes(node: Node) -> dict[str, object]:
    """The node's fields other than name and inputs, for reports and serialisation."""
    return {f.name: getattr(node, f.name) for f in fields(node) if f.name not in ("name", "inputs")}


@dataclass
class Graph:
    """A validated ReLU DAG: nodes in topological order, named outputs, checkpoint keys.

    Construction validates the structure (unknown inputs, cycles, duplicate names, a tensor
    read by two nodes, BatchNorm that does not follow a Linear/Conv) and reports every
    problem at once.
    """

    nodes: list[Node]
    outputs: tuple[str, ...]
    source: str = field(default="<graph>", compare=False)
    _by_name: dict[str, Node] = field(init=False, repr=False, compare=False)
    _consumers: dict[str, list[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.outputs = tuple(self.outputs)
        self.nodes = _topological_order(self.nodes, self.outputs, self.source)
        self._by_name = {n.name: n for n in self.nodes}
        self._consumers = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                self._consumers[i].append(n.name)
        _check_structure(self)

    def __getitem__(self, name: str) -> Node:
        return self._by_name[name]

    def consumers(self, name: str) -> list[str]:
        return self._consumers[name]

    def sweep(self, *held: dict[str, Any], backward: bool = False) -> Iterator[Node]:
        """The nodes in topological order (reversed with ``backward``); after the loop's body
        has handled a node, each ``held`` mapping of values by node name loses the values that
        node read and no later step reads (never the outputs'; a value nothing reads stays). A
        node's inputs are read when it is handled, so a forward sweep holds a few activations
        instead of all, and a backward one lets go of the forward activations it has used.
        """
        order = self.nodes[::-1] if backward else self.nodes
        last: dict[str, int] = {}
        for position, node in enumerate(order):
            for name in node.inputs:
                last[name] = position
        done: list[list[str]] = [[] for _ in order]
        for name, position in last.items():
            if name not in self.outputs:
                done[position].append(name)
        for node, done_with in zip(order, done):
            yield node
            for values in held:
                for name in done_with:
                    del values[name]  # a value missing here was never computed: a broken sweep

    @property
    def inputs(self) -> list[Input]:
        return [n for n in self.nodes if isinstance(n, Input)]

    def parameter_keys(self) -> list[str]:
        return [key for n in self.nodes for key in n.parameter_keys().values()]

    def folded_into(self, bn: BatchNorm) -> Linear | Conv | None:
        """The Linear/Conv that ``bn`` is folded into, or None for a standalone BatchNorm."""
        producer = self._by_name[bn.inputs[0]]
        if producer.creates_channels and self.batchnorm_after(producer.name) is bn:
            return producer
        return None

    def batchnorm_after(self, name: str) -> BatchNorm | None:
        """The BatchNorm folded into Linear/Conv ``name``, if its only consumer is one."""
        consumers = self._consumers[name]
        if len(consumers) == 1 and name not in self.outputs:
            follower = self._by_name[consumers[0]]
            if isinstance(follower, BatchNorm):
                return follower
        return None

    def check_parameters(self, params: Mapping[str, torch.Tensor], *, values: bool = True) -> None:
        """Check that every tensor the graph reads exists with a plausible shape and dtype and, with
        ``values`` (which reads each of them), finite values.

        All problems are collected before raising, so a spec with three typos shows three lines;
        a checkpoint that holds none of the tensors the graph reads is said to be another model's first.
        With ``values``, BatchNorm statistics whose ``running_var + eps`` is not > 0 are refused too.
        """
        problems: list[str] = []
        not_finite: list[str] = []
        invalid_statistics: list[str] = []
        layouts = stand_ins(params)
        _refuse_unrelated_checkpoint(self, layouts)
        for node in self.nodes:
            for role, key in node.parameter_keys().items():
                if key not in layouts:
                    problems.append(
                        f"node '{node.name}' ({node.op}) needs tensor '{key}' ({role}), which the checkpoint lacks"
                    )
                    continue
                tensor = layouts[key]
                expected_rank = node.roles.get(role)
                if expected_rank and tensor.dim() not in expected_rank:
                    problems.append(
                        f"node '{node.name}' ({node.op}): tensor '{key}' ({role}) has shape {tuple(tensor.shape)}, "
                        f"expected rank {' or '.join(map(str, expected_rank))}"
                    )
                elif not tensor.is_floating_point():
                    problems.append(
                        f"node '{node.name}' ({node.op}): tensor '{key}' has dtype {tensor.dtype}, "
                        "expected floating point"
                    )
                elif values:
                    value = params[key]
                    if not all_finite(value):
                        not_finite.append(f"'{key}' ({role} of node '{node.name}')")
                    elif isinstance(node, BatchNorm) and role == "running_var":
                        invalid_statistics += batchnorm_variance_problems(node, value)
        if problems:
            wanted = set(self.parameter_keys())
            lacking = len(wanted - set(layouts))
            raise InputError(
                f"{self.source}: the checkpoint does not match the architecture ({len(problems)} "
                f"problem(s); it lacks {lacking} of the {len(wanted)} tensors the architecture reads):",
                problems,
            )
        if not_finite:
            raise InvalidWeightsError(
                f"{self.source}: {len(not_finite)} tensor(s) contain NaN or Inf:",
                not_finite,
                "The network's function is not finite, so pathcond can neither analyse, rescale, compare nor prune it.",
            )
        _refuse_invalid_statistics(self.source, invalid_statistics)


def check_batchnorm_statistics(graph: Graph, params: Mapping[str, torch.Tensor]) -> None:
    """Refuse (InputError) BatchNorm statistics whose ``running_var + eps`` is not > 0 (see
    :func:`batchnorm_variance_problems`); :meth:`Graph.check_parameters` checks them with the
    values it reads, this is for a loader that reads no values."""
    _refuse_invalid_statistics(
        graph.source,
        [
            problem
            for node in graph.nodes
            if isinstance(node, BatchNorm) and node.running_var in params
            for problem in batchnorm_variance_problems(node, params[node.running_var])
        ],
    )


def _refuse_invalid_statistics(source: str, problems: list[str]) -> None:
    if problems:
        raise InputError(
            f"{source}: {len(problems)} BatchNorm layer(s) have a running_var + eps that is not > 0:",
            problems,
            "A BatchNorm divides by the square root of running_var + eps; a variance is never negative, so the "
            "checkpoint is damaged or these tensors are not BatchNorm statistics. The network's output is NaN or "
            "Inf in these channels: nothing was computed from it.",
        )


def batchnorm_variance_problems(node: BatchNorm, running_var: torch.Tensor) -> list[str]:
    """The problem of BatchNorm ``node`` whose ``running_var`` + eps is not > 0 in some channel
    (empty when none), reckoned in the precision a BatchNorm of that dtype computes in, as torch and
    onnxruntime do: float64 for float64 statistics, float32 otherwise, where a variance of -1e-5
    and an eps of 1e-5 add to 0 although their float64 sum is not."""
    precision = torch.float64 if running_var.dtype == torch.float64 else torch.float32
    total = running_var.detach().to(precision) + torch.tensor(node.eps, dtype=precision, device=running_var.device)
    channels = (~(total > 0)).nonzero().flatten().tolist()
    if not channels:
        return []
    listed = ", ".join(
        f"{c} (running_var {running_var[c].item():.9g}, sum {total[c].item():.9g})" for c in channels[:5]
    )
    more = f" and {len(channels) - 5} more" if len(channels) > 5 else ""
    return [
        f"tensor '{node.running_var}' (running_var of BatchNorm '{node.name}', eps {node.eps:g}): "
        f"running_var + eps is not > 0 in {str(precision).removeprefix('torch.')} in {len(channels)} of "
        f"{running_var.numel()} channel(s): channel {listed}{more}"
    ]


def _refuse_unrelated_checkpoint(graph: Graph, layouts: Mapping[str, torch.Tensor]) -> None:
    """An InputError, before any tensor is listed as missing, when the checkpoint holds tensors but
    not one that the graph reads: it is another model's (or names its tensors otherwise)."""
    wanted = list(dict.fromkeys(graph.parameter_keys()))
    if not wanted or not layouts or any(key in layouts for key in wanted):
        return
    held = list(layouts)
    raise InputError(
        f"{graph.source}: not one tensor name of the architecture is in the checkpoint: the architecture reads "
        f"{len(wanted)} tensor(s) ({first_names(wanted)}), the checkpoint holds {len(held)} named otherwise "
        f"({first_names(held)}).",
        note="The architecture is another model's, or names its tensors differently (a prefix such as 'model.' or "
        "'module.'): give the architecture this checkpoint was saved from.",
    )


def first_names(keys: Sequence[str], count: int = 5) -> str:
    """The first ``count`` of ``keys`` quoted for a message (each cut to 120 characters), and how many more."""
    named = ", ".join(f"'{key[:120]}'" for key in keys[:count])
    return named + (f" and {len(keys) - count} more" if len(keys) > count else "")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf, in one reduction (NaN propagates through min and max)."""
    if not tensor.numel():
        return True
    low, high = tensor.aminmax()
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _topological_order(nodes: list[Node], outputs: tuple[str, ...], source: str) -> list[Node]:
    problems: list[str] = []
    by_name: dict[str, Node] = {}
    for n in nodes:
        if n.name in by_name:
            problems.append(f"two nodes are named '{n.name}'")
        by_name[n.name] = n
    for n in nodes:
        for i in n.inputs:
            if i not in by_name:
                problems.append(f"node '{n.name}' ({n.op}) reads '{i}', which no node produces")
    for o in outputs:
        if o not in by_name:
            problems.append(f"output '{o}' names no node")
    if not outputs:
        problems.append("the graph declares no output")
    if problems:
        raise InputError(f"{source}: the network description is inconsistent:", problems)

    order: list[Node] = []
    state: dict[str, int] = {}
    for start in by_name:
        if state.get(start):
            continue
        stack: list[tuple[str, int]] = [(start, 0)]
        state[start] = 1
        while stack:
            name, next_input = stack.pop()
            node = by_name[name]
            if next_input < len(node.inputs):
                stack.append((name, next_input + 1))
                child = node.inputs[next_input]
                if state.get(child) == 1:
                    raise InputError(f"{source}: the network has a cycle through node '{child}' and node '{name}'")
                if not state.get(child):
                    state[child] = 1
                    stack.append((child, 0))
            else:
                state[name] = 2
                order.append(node)
    return order


def _check_structure(graph: Graph) -> None:
    problems: list[str] = []
    readers: dict[str, str] = {}
    known = set(NODE_TYPES.values())
    for node in graph.nodes:
        if type(node) not in known:
            problems.append(
                f"node '{node.name}' has type {type(node).__name__}, which is not among pathcond's node types "
                "(no schema, no rule): it cannot be evaluated or rescaled"
            )
            continue
        low, high = node.arity
        if len(node.inputs) < low or (high is not None and len(node.inputs) > high):
            problems.append(f"node '{node.name}' ({node.op}) has {len(node.inputs)} inputs")
        if isinstance(node, Pad) and node.mode == "-inf":
            readers_of_pad = [graph[c] for c in graph.consumers(node.name)]
            if node.name in graph.outputs or not all(isinstance(c, MaxPool) for c in readers_of_pad):
                problems.append(
                    f"node '{node.name}' (pad, mode -inf) must be read by max-pooling only: anything else "
                    "(an output, a conv, a sum) would compute with −inf"
                )
        for role, key in node.parameter_keys().items():
            if key in readers and readers[key][0] == node.name:
                problems.append(
                    f"tensor '{key}' is both the {readers[key][1]} and the {role} of node '{node.name}' ({node.op}): "
                    "one tensor in two roles of a layer cannot be rescaled (each role changes by another factor); "
                    "give each role a tensor of its own"
                )
            elif key in readers:
                problems.append(
                    f"tensor '{key}' is used by node '{readers[key][0]}' and node '{node.name}': a parameter "
                    "shared by two layers is not a ReLU DAG pathcond can rescale"
                )
            readers[key] = (node.name, role)
    if not graph.inputs:
        problems.append("the graph has no input")
    reachable = set(graph.outputs)
    for node in reversed(graph.nodes):
        if node.name in reachable:
            reachable.update(node.inputs)
    for node in graph.nodes:
        if node.name not in reachable and not isinstance(node, Input):
            problems.append(f"node '{node.name}' ({node.op}) does not reach any output")
    if problems:
        raise UnsupportedModelError(f"{graph.source}: the network is not a supported ReLU DAG:", problems)
