"""How each node type behaves: one rule per type, looked up by node class.

A node type's static schema (arity, tensor roles and ranks, per-axis fields, accepted
spatial ranks, whether it creates channels or broadcasts its inputs) lives on its class in
:mod:`.graph`. A rule holds its behaviour, everything the engine computes with it:

* ``forward``: the real network in torch (verification, shape inference);
* ``squared``: the parameter-free node in the squared network of SPEC §3 (fixed constants
  ``c`` become ``c**power``, homogeneous activations the identity, max-pooling a window sum);
  layers with DAG parameters give ``weighted`` (their parameterised part, on ψ) instead;
* ``ties``: the channel ties of SPEC §2 (which output channel is which input channel, which
  channels are new, which are fixed), per element through element-wise copies (:class:`Ties`);
* for layers with DAG parameters ``affine``: their canonical layout ``[O, I/groups, *kernel]``
  and how a rescaling is written back to the stored tensors.

The interpreters (:mod:`.evaluate`, :mod:`.diag`, :mod:`.groups`) walk the graph and ask
each node's rule. :func:`rule_for` refuses a node type without a rule, so a new node class
can never pass through silently (a wrong diag(G) would not be caught by verification).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import ClassVar, TypeVar

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from .graph import (
    COPYING_PAD_MODES,
    AdaptiveAvgPool,
    Add,
    AvgPool,
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    ChannelCopy,
    ChannelGather,
    ChannelShuffle,
    ChannelSlice,
    Concat,
    Conv,
    ConvTranspose,
    FixedFilter,
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
    Rearrange,
    ReLU,
    Scale,
    Sub,
    Upsample,
)

# A Linear weight with more stored elements than this, evaluated in another dtype, is converted
# a block of output rows at a time (4 Mi elements: 32 MiB in float64), not whole.
LINEAR_BLOCK_ELEMENTS = 2**22


class Parameters:
    """The checkpoint's tensors as a forward pass reads them: ``param(key)`` is ``params[key]``
    in ``dtype`` (None for no key), a copy when the dtypes differ; :meth:`stored` the tensor as
    stored, for a rule that converts it in parts (a large classifier's float64 copy would add
    to a verification's peak as much as twice its checkpoint tensor)."""

    def __init__(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._params, self.dtype = params, dtype

    def __call__(self, key: str | None) -> torch.Tensor | None:
        return None if key is None else self._params[key].to(self.dtype)

    def stored(self, key: str) -> torch.Tensor:
        return self._params[key]


def vjp(function, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Vector–Jacobian product of a (multi)linear op at ``inputs``: local autograd, one node.

    The product is taken as the gradient of the scalar ⟨output, cotangent⟩ (the same numbers):
    an explicit ``grad_outputs`` tensor makes torch import sympy on first use, 0.3–0.8 s.
    """
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        output = function(*leaves)
        return torch.autograd.grad((output * cotangent).sum(), leaves, allow_unused=True)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE_AVG_POOL = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def spatial_rank(x: torch.Tensor) -> int:
    """Number of spatial axes of a batched ``(N, C, *spatial)`` tensor."""
    return x.dim() - 2


def per_channel(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``vector`` shaped to broadcast over the channel axis of batched ``like``."""
    return vector.reshape(1, -1, *([1] * (like.dim() - 2)))


# --------------------------------------------------------------------------- channel ties


class Ties:
    """What a rule may do to the channel union-find while groups are built (SPEC §2).

    A node's ids are held per channel (1-d), or per element (its batch-free shape) when only
    readers that map each element to one element took it (element-wise activations, sums,
    rearranges): an NHWC activation between two Transposes then keeps every conv channel its
    own scale. A reader of whole channels (a Conv, a pooling, a per-channel bias) ties each
    channel's elements into one scale first (:meth:`record`).
    """

    def __init__(self, graph: Graph, shapes: Mapping[str, tuple[int, ...]]):
        self.graph = graph
        self.shapes = shapes
        self.parent: list[int] = []
        self.labels: dict[int, str] = {}
        self.fixed: list[torch.Tensor] = []
        self.channel_ids: dict[str, torch.Tensor] = {}

    def record(self, node: Node) -> None:
        """Record ``node``'s ties and hold the ids of its output."""
        rule = rule_for(node)
        if not rule.reads_elements:
            for name in node.inputs:
                self.ids(name)
        self.channel_ids[node.name] = rule.ties(node, self)

    def held(self, name: str) -> torch.Tensor:
        """The ids of node ``name``'s output as held: per channel, or per element."""
        return self.channel_ids[name]

    def ids(self, name: str) -> torch.Tensor:
        """Channel element ids of node ``name``'s output (one per channel, flattened features for
        vectors); ids held per element are tied into one per channel first, and held so."""
        ids = self.channel_ids[name]
        if ids.dim() > 1:
            rows = ids.reshape(len(ids), -1)
            self.union(rows[:, :1].expand_as(rows).reshape(-1), rows.reshape(-1))
            ids = self.channel_ids[name] = rows[:, 0].clone()
        return ids

    def elements(self, name: str) -> torch.Tensor:
        """The ids of every element of node ``name``'s output, shaped like it (batch-free)."""
        ids, shape = self.channel_ids[name], tuple(self.shapes[name])
        if ids.dim() == len(shape):
            return ids
        return ids.reshape(-1, *[1] * (len(shape) - 1)).expand(shape)

    def new(self, node: Node, count: int, *, fixed: bool = False) -> torch.Tensor:
        """``count`` new channels created by ``node`` (labelled ``node:channel`` for reports)."""
        start = len(self.parent)
        self.parent.extend(range(start, start + count))
        ids = torch.arange(start, start + count)
        if fixed:
            self.fix(ids)
        else:
            for c in range(count):
                self.labels[start + c] = f"{node.name}:{c}"
        return ids

    def fix(self, ids: torch.Tensor) -> None:
        self.fixed.append(ids)

    def union(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Tie channel ``a[i]`` to ``b[i]`` for every i (a fixed edge forces one scale)."""
        a, b = a.reshape(-1), b.reshape(-1)
        if len(a) != len(b):
            raise ValueError(f"cannot tie {len(a)} channels to {len(b)}")
        apart = a != b
        count = len(self.parent)
        # Each distinct pair once: the elements of one channel repeat its id thousands of times.
        pairs = torch.unique(a[apart] * count + b[apart])
        for x, y in zip((pairs // count).tolist(), (pairs % count).tolist()):
            rx, ry = self._find(x), self._find(y)
            if rx != ry:
                self.parent[max(rx, ry)] = min(rx, ry)

    def _find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def roots(self) -> torch.Tensor:
        return torch.tensor([self._find(e) for e in range(len(self.parent))], dtype=torch.long)


# --------------------------------------------------------------------------- DAG parameters


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor a layer's rescaling changes.

    ``layout`` tells how its axes relate to the canonical ``[O, I/groups, *kernel]`` weight:
    ``weight`` (the same), ``weight_t`` (a Linear stored ``[in, out]``), ``conv_transpose``
    (``[I, O/groups, *kernel]``) or ``vector`` (one entry per output channel, in any shape
    holding that many values; with an input side, input channel c is output channel c's). ``output_side``
    / ``input_side``: whether ``exp(u_dst)`` / ``exp(−u_src)`` apply to it.
    """

    key: str
    layout: str
    output_side: bool
    input_side: bool


@dataclass
class Affine:
    """A layer's DAG parameters in canonical layout, and the tensors they come from.

    Without a folded BatchNorm ``weight`` and ``bias`` are the stored tensors themselves, in
    their own dtype (no float64 copy of the checkpoint is held: each pass casts one tensor
    at a time); a folded layer's are computed in float64.

    ``weight`` is ``[O, I/groups, *kernel]``, ``bias`` ``[O]``; either may be None (a layer
    without bias, a bias alone on fixed edges). ``output`` is the node whose channels are the
    weight's destinations (a folded BatchNorm's).
    """

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    groups: int
    weight_label: str | None
    bias_label: str | None
    output: str
    stored: list[Stored]
    weight_fold: Fold | None = None
    bias_fold: Fold | None = None


# Roundings between a folded entry and its exact value, relative to it: the folded BatchNorm's
# scale γ/√(σ² + ε) (the sum, the root, the quotient), the product by it, and the difference of
# two stored entries taken before the fold (:meth:`Fold.difference`).
FOLD_ROUNDINGS = 5
# Roundings of a folded shift β − scale·μ (+ scale·b) measured against |β| + |scale·μ| + |scale·b|,
# with room for the float64 evaluation of that bound itself.
SHIFT_ROUNDINGS = 8


@dataclass(frozen=True)
class Fold:
    """How a tensor with a BatchNorm folded in was computed (float64), for differences rounding
    cannot shrink: ``value`` = ``base`` · ``scale`` per output channel (dim 0), plus, for a
    bias, the shift β − scale·μ (``shift_inputs`` = (β, μ); None for a weight). ``scale_inputs``
    (γ, σ²) and ``eps`` are what the scale comes from; ``error`` bounds |value − the exact fold|
    per entry. The shift is not within a relative rounding of itself (β and scale·μ may cancel
    to a few ulps of either), so neither is ``error``.
    """

    value: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    scale_inputs: tuple[torch.Tensor, torch.Tensor]
    eps: float
    shift_inputs: tuple[torch.Tensor, torch.Tensor] | None
    shift_error: torch.Tensor | None = None

    @cached_property
    def error(self) -> torch.Tensor:
        """A weight's is computed when a bound asks for it, from the fold's own product: a fold
        is made at every read of its layer's weight, and the passes read weights far more often
        than bounds read errors. A bias's (O numbers) is made with the fold, from the inputs as
        they were then (β and μ may be the module's own tensors, which a rescale changes)."""
        if self.shift_error is not None:
            return self.shift_error
        return _gamma(FOLD_ROUNDINGS) * self.value.abs()

    def difference(self, other: Fold) -> tuple[torch.Tensor, torch.Tensor | None]:
        """|value − other's value| per entry, taken as below, and an allowance for its rounding:
        the exact difference lies within allowance of it (None: within a relative
        γ_FOLD_ROUNDINGS everywhere, nothing to allow for).

        In a channel of one scale (and, for a bias, one mean) the two differ by
        |Δbase · scale + Δβ|, taken before the fold: relative where one of the two terms is 0 (a
        pruned or shrunk weight, a moved β), and otherwise allowing for the rounding each term
        can carry. In a channel of other statistics, by their folded values' difference,
        allowing for both folds' errors."""
        device = self.value.device
        folded_gap = (self.value - other.value.to(device)).abs_()
        folds_error = self.error + other.error.to(device)
        # The channels whose scale (and a bias's mean) are computed from the same numbers.
        same = torch.full_like(self.scale, self.eps == other.eps, dtype=torch.bool)
        means = (self.shift_inputs[1],) if self.shift_inputs else ()
        other_means = (other.shift_inputs[1],) if other.shift_inputs else ()
        for mine, theirs in zip(self.scale_inputs + means, other.scale_inputs + other_means):
            same &= mine == theirs.to(device)
        same = _channels(same, self.value)
        scaled = (self.base - other.base.to(device)) * _channels(self.scale, self.base)
        if self.shift_inputs is None:
            gap, rounding = scaled.abs_(), torch.zeros_like(scaled)
        else:
            moved = self.shift_inputs[0] - other.shift_inputs[0].to(device)
            both = (scaled != 0) & (moved != 0)
            gap, rounding = (scaled + moved).abs(), _gamma(FOLD_ROUNDINGS) * (scaled.abs() + moved.abs()) * both
        allowance = torch.where(same, rounding, folds_error)
        return torch.where(same, gap, folded_gap), allowance if bool(allowance.any()) else None


def _channels(per_channel_values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-output-channel vector shaped to broadcast over ``like``'s dim 0."""
    return per_channel_values.reshape(-1, *([1] * (like.dim() - 1)))


def _gamma(roundings: int) -> float:
    """γ_n = n·u / (1 − n·u), u = 2^−53: n roundings' relative error (Higham, Lemma 3.1)."""
    count = roundings * 2.0**-53
    return count / (1 - count)


def fold_batchnorm(
    bn: BatchNorm, params: Mapping[str, torch.Tensor], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[Fold, Fold]:
    """Eval-mode BatchNorm folded into the layer before it (``weight`` ``[O, ...]`` and ``bias``
    ``[O]``, either None for a standalone BatchNorm: a diagonal weight of ones, a bias of
    zeros), in float64: ``scale`` · weight, ``scale`` · bias + β − ``scale`` · μ."""
    gamma, variance, beta, mean = (
        params[key].to(torch.float64) for key in (bn.weight, bn.running_var, bn.bias, bn.running_mean)
    )
    scale = gamma / torch.sqrt(variance + bn.eps)
    weight = torch.ones_like(scale).reshape(-1, 1) if weight is None else weight.to(torch.float64)
    bias = torch.zeros_like(scale) if bias is None else bias.to(torch.float64)
    folded_weight = weight * _channels(scale, weight)
    folded_bias = beta - scale * mean + scale * bias
    shift_error = _gamma(SHIFT_ROUNDINGS) * (beta.abs() + (scale * mean).abs() + (scale * bias).abs())
    return (
        Fold(folded_weight, weight, scale, (gamma, variance), bn.eps, None),
        Fold(folded_bias, bias, scale, (gamma, variance), bn.eps, (beta, mean), shift_error),
    )


# --------------------------------------------------------------------------- rules


class Rule:
    """Base of every rule; see the module docstring for what each member means."""

    # Whether ties reads its inputs' ids element by element (Ties.held, Ties.elements): each
    # output element copies, or is a sum of, input elements at their own scales. Otherwise
    # each input channel is tied into one scale before ties runs.
    reads_elements: ClassVar[bool] = False

    def forward(self, node: Node, xs: list[torch.Tensor], param: Parameters, train: bool) -> torch.Tensor:
        raise self._missing("forward", node)

    def squared(self, node: Node, xs: list[torch.Tensor], power: int) -> torch.Tensor:
        """The node in the squared network (parameter-free nodes only)."""
        raise self._missing("squared", node)

    def ties(self, node: Node, ties: Ties) -> torch.Tensor:
        """Channel ids of the node's output, after recording its ties."""
        raise self._missing("ties", node)

    def affine(self, node: Node, graph: Graph, params: Mapping[str, torch.Tensor]) -> Affine | None:
        """The node's DAG parameters, or None when it has none (or they are folded elsewhere)."""
        return None

    def weighted(self, node: Node, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The parameterised part (no bias) with a canonical-layout ``weight``."""
        raise self._missing("weighted", node)

    def weighted_vjp(
        self,
        node: Node,
        x: torch.Tensor,
        weight: torch.Tensor,
        cotangent: torch.Tensor,
        *,
        weight_grad: bool = True,
        input_grad: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The vector–Jacobian product of :meth:`weighted` at (x, weight): with ``input_grad``,
        ∂⟨y, cotangent⟩/∂x, and with ``weight_grad``, /∂weight (None for each not asked for).
        Without ``input_grad`` only the weight's shape is read: the product is linear in it.
        Generic: local autograd."""
        if not weight_grad:
            return vjp(lambda a: self.weighted(node, a, weight), [x], cotangent)[0], None
        if not input_grad:
            return None, vjp(lambda w: self.weighted(node, x, w), [weight], cotangent)[0]
        grad_x, grad_w = vjp(lambda a, w: self.weighted(node, a, w), [x, weight], cotangent)
        return grad_x, grad_w

    def _missing(self, member: str, node: Node) -> NotImplementedError:
        """A rule asked for what its kind of node does not have (Input has no forward, a layer
        with DAG parameters no squared form): a bug in pathcond, named, never a silent result."""
        return NotImplementedError(f"{type(self).__name__} has no '{member}' (node '{node.name}', {node.op})")


# The rule of each node type, registered by :func:`rule_of` where the rule is written.
RULES: dict[type[Node], Rule] = {}
RuleClass = TypeVar("RuleClass", bound=type[Rule])


def rule_of(*node_types: type[Node]) -> Callable[[RuleClass], RuleClass]:
    """Register one instance of the decorated rule class as the rule of each of ``node_types``,
    none of which may have a rule yet."""

    def register(rule_class: RuleClass) -> RuleClass:
        rule = rule_class()
        for node_type in node_types:
            if node_type in RULES:
                raise ValueError(
                    f"{node_type.__name__} has two rules, {type(RULES[node_type]).__name__} and {rule_class.__name__}"
                )
            RULES[node_type] = rule
        return rule_class

    return register


class PassThrough(Rule):
    """A node whose output channel c is input channel c (spatial-only, or element-wise)."""

    def ties(self, node: Node, ties: Ties) -> torch.Tensor:
        return ties.ids(node.inputs[0])


class ElementWise(PassThrough):
    """Output element i is a function of input element i alone: any scale of each element
    passes through, so the ids pass as held (per channel or per element)."""

    reads_elements = True

    def ties(self, node: Node, ties: Ties) -> torch.Tensor:
        return ties.held(node.inputs[0])


class HomogeneousActivation(ElementWise):
    """Positively homogeneous of degree 1 element-wise: the identity in the squared network."""

    def squared(self, node: Node, xs: list[torch.Tensor], power: int) -> torch.Tensor:
        return xs[0]


@rule_of(Input)
class InputRule(Rule):
    def ties(self, node: Input, ties: Ties) -> torch.Tensor:
        return ties.new(node, node.shape[0], fixed=True)


class AffineLayer(Rule):
    """Linear, Conv: weight and optional bias, a BatchNorm that follows folded in (SPEC §1)."""

    def canonical_weight(self, node: Node, stored: torch.Tensor) -> torch.Tensor:
        """The stored weight as ``[O, I/groups, *kernel]``."""
        return stored

    def weight_layout(self, node: Node) -> str:
        return "weight"

    def groups(self, node: Node) -> int:
        return 1

    def forward(self, node, xs, param, train):
        y = self.weighted_stored(node, xs[0], param)
        return y if node.bias is None else y + per_channel(param(node.bias), y)

    def weighted_stored(self, node: Node, x: torch.Tensor, param: Parameters) -> torch.Tensor:
        """:meth:`weighted` with the node's weight as ``param`` reads it."""
        return self.weighted(node, x, self.canonical_weight(node, param(node.weight)))

    def ties(self, node: Node, ties: Ties) -> torch.Tensor:
        return ties.new(node, ties.shapes[node.name][0])

    def out_channels(self, node: Node, params: Mapping[str, torch.Tensor]) -> int:
        return self.canonical_weight(node, params[node.weight]).shape[0]

    def affine(self, node, graph, params):
        weight = self.canonical_weight(node, params[node.weight])
        bias = params[node.bias] if node.bias is not None else None
        bn = graph.batchnorm_after(node.name)
        if bn is None:
            stored = [Stored(node.weight, self.weight_layout(node), True, True)]
            if node.bias is not None:
                stored.append(Stored(node.bias, "vector", True, False))
            return Affine(weight, bias, self.groups(node), node.weight, node.bias, node.name, stored)
        # The output-side factor goes to γ and β, never to the pre-BatchNorm weight (SPEC §2).
        weight_fold, bias_fold = fold_batchnorm(bn, params, weight, bias)
        suffix = f" (BatchNorm '{bn.name}' folded)"
        bias_label = (node.bias if node.bias is not None else bn.bias) + suffix
        stored = [
            Stored(node.weight, self.weight_layout(node), False, True),
            Stored(bn.weight, "vector", True, False),
            Stored(bn.bias, "vector", True, False),
        ]
        return Affine(
            weight_fold.value,
            bias_fold.value,
            self.groups(node),
            node.weight + suffix,
            bias_label,
            bn.name,
            stored,
            weight_fold,
            bias_fold,
        )


@rule_of(Linear)
class LinearRule(AffineLayer):
    def weighted_stored(self, node, x, param):
        stored = param.stored(node.weight)  # read once: a lazy checkpoint reads it per access
        weight = self.canonical_weight(node, stored)
        # a weight that does not fit the input goes whole, for F.linear's message about its shape
        if stored.dtype == param.dtype or stored.numel() <= LINEAR_BLOCK_ELEMENTS or x.shape[-1] != weight.shape[1]:
            return self.weighted(node, x, weight.to(param.dtype))
        y = x.new_empty(*x.shape[:-1], weight.shape[0])
        step = max(1, LINEAR_BLOCK_ELEMENTS // weight.shape[1])  # a weight this large has columns
        for start in range(0, weight.shape[0], step):
            y[..., start : start + step] = F.linear(x, weight[start : start + step].to(param.dtype))
        return y

    def canonical_weight(self, node: Linear, stored: torch.Tensor) -> torch.Tensor:
        return stored.t() if node.weight_transposed else stored

    def weight_layout(self, node: Linear) -> str:
        return "weight_t" if node.weight_transposed else "weight"

    def weighted(self, node, x, weight):
        return F.linear(x, weight)

    def weighted_vjp(self, node, x, weight, cotangent, *, weight_grad=True, input_grad=True):
        return cotangent @ weight if input_grad else None, cotangent.t() @ x if weight_grad else None


@rule_of(Conv)
class ConvRule(AffineLayer):
    def groups(self, node: Conv) -> int:
        return node.groups

    def weighted(self, node: Conv, x, weight):
        return _CONV[weight.dim() - 2](x, weight, None, node.stride, node.padding, node.dilation, node.groups)

    def weighted_vjp(self, node: Conv, x, weight, cotangent, *, weight_grad=True, input_grad=True):
        # Both products from one convolution_backward, what autograd would call, without
        # recomputing the forward convolution that autograd needs to record it.
        rank = weight.dim() - 2
        grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
            cotangent,
            x,
            weight,
            None,
            _expand(node.stride, rank),
            _expand(node.padding, rank),
            _expand(node.dilation, rank),
            False,
            [0] * rank,
            node.groups,
            [input_grad, weight_grad, False],
        )
        return grad_x, grad_w


@rule_of(ConvTranspose)
class ConvTransposeRule(AffineLayer):
    """Transposed convolution: its stored ``[I, O/groups, *k]`` weight, per group transposed,
    is the canonical ``[O, I/groups, *k]`` (output channel o of group g reads that group's inputs)."""

    def groups(self, node: ConvTranspose) -> int:
        return node.groups

    def weight_layout(self, node: ConvTranspose) -> str:
        return "conv_transpose"

    def canonical_weight(self, node: ConvTranspose, stored: torch.Tensor) -> torch.Tensor:
        return swap_group_axes(stored, node.groups)

    def weighted(self, node: ConvTranspose, x, weight):
        stored = swap_group_axes(weight, node.groups)
        return _CONV_TRANSPOSE[weight.dim() - 2](
            x, stored, None, node.stride, node.padding, node.output_padding, node.groups, node.dilation
        )

    def weighted_vjp(self, node: ConvTranspose, x, weight, cotangent, *, weight_grad=True, input_grad=True):
        rank = weight.dim() - 2
        grad_x, grad_stored, _ = torch.ops.aten.convolution_backward(
            cotangent,
            x,
            swap_group_axes(weight, node.groups),
            None,
            _expand(node.stride, rank),
            _expand(node.padding, rank),
            _expand(node.dilation, rank),
            True,
            _expand(node.output_padding, rank),
            node.groups,
            [input_grad, weight_grad, False],
        )
        # The swap of group axes is its own inverse: the stored layout's gradient, read canonically.
        return grad_x, swap_group_axes(grad_stored, node.groups) if weight_grad else None


def swap_group_axes(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``[A, B, *k]`` with ``A = groups·A'`` as ``[groups·B, A', *k]``: each group's two axes swapped.

    Maps a transposed convolution's stored weight to the canonical layout and back.
    """
    a, b, kernel = weight.shape[0] // groups, weight.shape[1], weight.shape[2:]
    return weight.reshape(groups, a, b, *kernel).transpose(1, 2).reshape(groups * b, a, *kernel)


@rule_of(BatchNorm)
class BatchNormRule(Rule):
    """BatchNorm: folded into the Linear/Conv before it, or a layer of its own.

    Standalone (after a Concat, in pre-activation blocks) its scale is a diagonal weight
    (a depthwise 1×1 layer, groups = channels) and its input channels are fixed: batch
    statistics would undo a rescaling of them in train mode.
    """

    def forward(self, node: BatchNorm, xs, param, train):
        return F.batch_norm(
            xs[0],
            param(node.running_mean).clone(),
            param(node.running_var).clone(),
            param(node.weight),
            param(node.bias),
            training=train,
            momentum=node.momentum,
            eps=node.eps,
        )

    def squared(self, node, xs, power):
        # Only reached when folded: its scale and shift live in the producer's ψ.
        return xs[0]

    def ties(self, node: BatchNorm, ties: Ties) -> torch.Tensor:
        if ties.graph.folded_into(node) is not None:
            return ties.ids(node.inputs[0])
        ties.fix(ties.ids(node.inputs[0]))
        return ties.new(node, ties.shapes[node.name][0])

    def affine(self, node: BatchNorm, graph, params):
        if graph.folded_into(node) is not None:
            return None
        weight_fold, bias_fold = fold_batchnorm(node, params, None, None)
        stored = [Stored(node.weight, "vector", True, False), Stored(node.bias, "vector", True, False)]
        return Affine(
            weight_fold.value,
            bias_fold.value,
            len(bias_fold.value),
            f"{node.weight} (BatchNorm scale γ/σ)",
            f"{node.bias} (BatchNorm shift β − γμ/σ)",
            node.name,
            stored,
            weight_fold,
            bias_fold,
        )

    def weighted(self, node, x, weight):
        return x * per_channel(weight.reshape(-1), x)


def channel_values(tensor: torch.Tensor, channels: int) -> torch.Tensor:
    """A tensor holding one value per channel (``[C]``, ``[C, 1, 1]``, ``[1, C, 1, 1]``, ...) as a vector."""
    if tensor.numel() != channels or sum(size != 1 for size in tensor.shape) > 1:
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} does not hold one value per channel of {channels}")
    return tensor.reshape(-1)


@rule_of(ChannelAffine)
class ChannelAffineRule(Rule):
    """Per-channel scale and shift: a depthwise 1×1 layer (groups = channels) whose scale is
    the weight on the edge from input channel c to new channel c and whose shift is the new
    neuron's bias. Unlike a standalone BatchNorm its input channels stay free: no statistics."""

    def forward(self, node: ChannelAffine, xs, param, train):
        x = xs[0]
        y = x * per_channel(channel_values(param(node.weight), x.shape[1]), x)
        return y if node.bias is None else y + per_channel(channel_values(param(node.bias), x.shape[1]), x)

    def ties(self, node: ChannelAffine, ties: Ties) -> torch.Tensor:
        return ties.new(node, ties.shapes[node.name][0])

    def affine(self, node: ChannelAffine, graph, params):
        weight = params[node.weight].to(torch.float64).reshape(-1, 1)
        bias = None if node.bias is None else params[node.bias].to(torch.float64).reshape(-1)
        stored = [Stored(node.weight, "vector", True, True)]
        if node.bias is not None:
            stored.append(Stored(node.bias, "vector", True, False))
        return Affine(weight, bias, len(weight), node.weight, node.bias, node.name, stored)

    def weighted(self, node, x, weight):
        return x * per_channel(weight.reshape(-1), x)


@rule_of(ChannelBias)
class ChannelBiasRule(PassThrough):
    """A per-channel constant added on fixed edges of weight 1: the layer's only DAG parameter is
    its bias, whose neuron keeps its input channel's scale (the squared network adds ψ_bias)."""

    def forward(self, node: ChannelBias, xs, param, train):
        x = xs[0]
        return x + per_channel(channel_values(param(node.bias), x.shape[1]), x)

    def affine(self, node: ChannelBias, graph, params):
        bias = params[node.bias].to(torch.float64).reshape(-1)
        return Affine(None, bias, len(bias), None, node.bias, node.name, [Stored(node.bias, "vector", True, False)])


@rule_of(ReLU)
class ReLURule(HomogeneousActivation):
    def forward(self, node, xs, param, train):
        return F.relu(xs[0])


@rule_of(LeakyReLU)
class LeakyReLURule(HomogeneousActivation):
    def forward(self, node: LeakyReLU, xs, param, train):
        return F.leaky_relu(xs[0], node.negative_slope)


@rule_of(Identity)
class IdentityRule(HomogeneousActivation):
    def forward(self, node, xs, param, train):
        return xs[0]


@rule_of(PReLU)
class PReLURule(HomogeneousActivation):
    """The slope tensor may carry singleton axes (ONNX stores it as ``[C, 1, 1]``)."""

    def forward(self, node: PReLU, xs, param, train):
        return F.prelu(xs[0], param(node.weight).reshape(-1))


@rule_of(Scale)
class ScaleRule(ElementWise):
    """A fixed edge of constant weight c: c**power in the squared network (c² for diag(G))."""

    def forward(self, node: Scale, xs, param, train):
        return xs[0] * node.factor

    def squared(self, node: Scale, xs, power):
        return xs[0] * node.factor**power


@rule_of(Pad)
class PadRule(PassThrough):
    """Zero and −inf padding: padded positions are neurons without incoming edges (0 in the
    squared network). Reflect, replicate, circular: each padded position copies one input
    position of its channel through a fixed edge of weight 1 (the same copy in the squared network).
    Negative widths crop, in every mode: F.pad crops before it pads, as ONNX runtimes do, and a
    cropped-away position has no outgoing edge."""

    @staticmethod
    def _pads(node: Pad) -> list[int]:
        return [v for begin, end in reversed(list(zip(node.begin, node.end))) for v in (begin, end)]

    def forward(self, node: Pad, xs, param, train):
        if node.mode in COPYING_PAD_MODES:
            return F.pad(xs[0], self._pads(node), mode=node.mode)
        return F.pad(xs[0], self._pads(node), value=-math.inf if node.mode == "-inf" else 0.0)

    def squared(self, node: Pad, xs, power):
        if node.mode in COPYING_PAD_MODES:
            return F.pad(xs[0], self._pads(node), mode=node.mode)
        return F.pad(xs[0], self._pads(node))


@rule_of(FixedFilter)
class FixedFilterRule(PassThrough):
    """A depthwise convolution by constant coefficients: one fixed edge per tap, of weight the
    coefficient; in the squared network of power q each becomes |c|^q (for q = 0 the 0/1
    pattern of the non-zero coefficients: one edge per non-zero tap)."""

    @staticmethod
    def filters(node: FixedFilter, x: torch.Tensor) -> torch.Tensor:
        """The ``[C, 1, *kernel]`` filters for batched ``x``, in its dtype and on its device."""
        kernel = _expand(node.kernel, spatial_rank(x))
        channels = x.shape[1]
        if len(node.coefficients) != channels * prod(kernel):
            raise ValueError(
                f"{len(node.coefficients)} coefficients are not one {kernel} filter for each of {channels} channels"
            )
        return torch.tensor(node.coefficients, dtype=x.dtype, device=x.device).reshape(channels, 1, *kernel)

    def _convolve(self, node: FixedFilter, x: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
        return _CONV[spatial_rank(x)](x, filters, None, node.stride, node.padding, node.dilation, x.shape[1])

    def forward(self, node: FixedFilter, xs, param, train):
        return self._convolve(node, xs[0], self.filters(node, xs[0]))

    def squared(self, node: FixedFilter, xs, power):
        filters = self.filters(node, xs[0])
        return self._convolve(node, xs[0], filters.abs() ** power if power else (filters != 0).to(filters.dtype))


@rule_of(ChannelShuffle, ChannelSlice, ChannelGather)
class ChannelCopyRule(Rule):
    """Output channel c copies input channel s(c) whole (s: the node's ``source_channels``): fixed
    edges of weight 1 (the same copy in the squared network), each output channel tied to its source;
    an input channel no output copies is not read."""

    reads_elements = True

    def forward(self, node: ChannelCopy, xs, param, train):
        x = xs[0]
        return x[:, node.source_channels(x.shape[1]).to(x.device)]

    def squared(self, node, xs, power):
        return self.forward(node, xs, None, False)

    def ties(self, node: ChannelCopy, ties):
        ids = ties.held(node.inputs[0])
        return ids[node.source_channels(len(ids))]


@rule_of(Rearrange)
class RearrangeRule(Rule):
    """Each output element copies one input element: fixed edges of weight 1 (1**power in the
    squared network, so the same copy there). Each output element keeps its source element's id,
    so the ids are held per element; a reader of whole channels ties them (Ties.record)."""

    reads_elements = True

    def forward(self, node: Rearrange, xs, param, train):
        x = xs[0]
        flat = x.reshape(x.shape[0], -1)
        low, high = node.index_bounds
        if low < 0 or high >= flat.shape[1]:
            raise ValueError(f"it copies input elements {low} to {high}, not all among the input's {flat.shape[1]}")
        if node.sizes and min(node.strides) >= 0:
            # A view of the input on its own device: no index tensor to build or copy there.
            flat = flat.contiguous()
            view = flat.as_strided(
                (flat.shape[0], *node.sizes), (flat.shape[1], *node.strides), flat.storage_offset() + node.offset
            )
            return view.reshape(x.shape[0], *node.shape)
        return flat[:, node.index.to(x.device).reshape(-1)].reshape(x.shape[0], *node.shape)

    def squared(self, node, xs, power):
        return self.forward(node, xs, None, False)

    def ties(self, node: Rearrange, ties):
        return ties.elements(node.inputs[0]).reshape(-1)[node.index]


@rule_of(Upsample)
class UpsampleRule(PassThrough):
    """Nearest or (bi/tri)linear resize: fixed edges, output channel c from input channel c.

    Each spatial axis is resized independently (torch and ONNX interpolate separably), so the
    op is ``x ↦ x ×_axis M_axis`` with one ``[out, in]`` coefficient matrix per axis, read off
    1-d interpolation of an identity basis. The squared network applies ``M_axis**power``
    (for power 0 the 0/1 pattern of the non-zero coefficients: one edge per non-zero entry).
    """

    _LINEAR_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}

    @staticmethod
    def resize_arguments(node: Upsample, rank: int) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
        """``(size, scale_factor)`` for ``F.interpolate`` on ``rank`` spatial axes (one of them None)."""
        if node.mode not in ("nearest", "linear"):
            raise ValueError(f"mode {node.mode!r} is not supported (nearest or linear)")
        if bool(node.size) == bool(node.scale_factor):
            raise ValueError("exactly one of 'size' and 'scale_factor' must be given")
        values = node.size or node.scale_factor
        if len(values) not in (1, rank):
            raise ValueError(f"{len(values)} resize values for {rank} spatial axes")
        values = tuple(values) * (rank // len(values))
        return (values, None) if node.size else (None, values)

    def _interpolate(self, node: Upsample, x: torch.Tensor, size, scale_factor) -> torch.Tensor:
        linear = node.mode == "linear"
        return F.interpolate(
            x,
            size=size,
            scale_factor=scale_factor,
            mode=self._LINEAR_MODES[spatial_rank(x)] if linear else "nearest",
            align_corners=node.align_corners if linear else None,
        )

    def forward(self, node: Upsample, xs, param, train):
        return self._interpolate(node, xs[0], *self.resize_arguments(node, spatial_rank(xs[0])))

    def axis_matrices(self, node: Upsample, x: torch.Tensor) -> list[torch.Tensor]:
        """Per spatial axis, the ``[out, in]`` coefficients (1-d interpolation of each unit impulse)."""
        size, scale_factor = self.resize_arguments(node, spatial_rank(x))
        matrices = []
        for axis, n in enumerate(x.shape[2:]):
            basis = torch.eye(n, dtype=torch.float64, device=x.device).unsqueeze(0)
            resized = self._interpolate(node, basis, size and (size[axis],), scale_factor and (scale_factor[axis],))
            matrices.append(resized[0].t().to(x.dtype))
        return matrices

    def squared(self, node: Upsample, xs, power):
        y = xs[0]
        for axis, matrix in enumerate(self.axis_matrices(node, y)):
            coefficients = matrix**power if power else (matrix != 0).to(matrix.dtype)
            y = (y.movedim(2 + axis, -1) @ coefficients.t()).movedim(-1, 2 + axis)
        return y


# --------------------------------------------------------------------------- pooling


def _expand(values: Sequence[int], rank: int) -> tuple[int, ...]:
    values = tuple(values)
    return values if len(values) == rank else values * rank


def pool_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """torch's pooling output length, ceil mode included (the last window starts inside the
    input or the left padding)."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def window_sum(x: torch.Tensor, kernel, stride, padding, dilation, ceil_mode: bool) -> torch.Tensor:
    """Sum of each pooling window with zero padding: a max-pool neuron's incoming fixed edges.

    A depthwise all-ones convolution; ceil mode pads the right end so the last (partial)
    window exists, and the result is cut to torch's output size.
    """
    rank = spatial_rank(x)
    kernel, stride, padding, dilation = (_expand(v, rank) for v in (kernel, stride, padding, dilation))
    sizes = x.shape[2:]
    outs = [
        pool_output_size(n, k, s, p, d, ceil_mode) for n, k, s, p, d in zip(sizes, kernel, stride, padding, dilation)
    ]
    pads = []
    for n, k, s, p, d, o in zip(sizes, kernel, stride, padding, dilation, outs):
        right = max(p, (o - 1) * s + d * (k - 1) + 1 - n - p)
        pads.append((p, right))
    padded = F.pad(x, [v for pair in reversed(pads) for v in pair])
    channels = x.shape[1]
    ones = x.new_ones(channels, 1, *kernel)
    y = _CONV[rank](padded, ones, None, stride, 0, dilation, channels)
    return y[(..., *(slice(0, o) for o in outs))]


@rule_of(MaxPool)
class MaxPoolRule(PassThrough):
    def forward(self, node: MaxPool, xs, param, train):
        x = xs[0]
        return _MAX_POOL[spatial_rank(x)](
            x, node.kernel, node.stride, node.padding, node.dilation, ceil_mode=node.ceil_mode
        )

    def squared(self, node: MaxPool, xs, power):
        return window_sum(xs[0], node.kernel, node.stride, node.padding, node.dilation, node.ceil_mode)


@rule_of(AvgPool)
class AvgPoolRule(PassThrough):
    def forward(self, node: AvgPool, xs, param, train):
        x = xs[0]
        return _AVG_POOL[spatial_rank(x)](
            x, node.kernel, node.stride, node.padding, node.ceil_mode, node.count_include_pad
        )

    def squared(self, node: AvgPool, xs, power):
        """Window sum over divisor**power, the divisor exactly as torch computes it."""
        x = xs[0]
        ones = torch.ones_like(x[:1, :1])
        unit = (1,) * spatial_rank(x)
        counted = window_sum(ones, node.kernel, node.stride, node.padding, unit, node.ceil_mode)
        mean = self.forward(node, [ones], None, False)
        divisor = torch.where(mean > 0, counted / mean.clamp_min(1e-300), torch.zeros_like(mean))
        summed = window_sum(x, node.kernel, node.stride, node.padding, unit, node.ceil_mode)
        return summed / divisor**power if power else summed


@rule_of(AdaptiveAvgPool)
class AdaptiveAvgPoolRule(PassThrough):
    def forward(self, node: AdaptiveAvgPool, xs, param, train):
        return _ADAPTIVE_AVG_POOL[spatial_rank(xs[0])](xs[0], node.output_size)

    def squared(self, node: AdaptiveAvgPool, xs, power):
        x = xs[0]
        sizes = torch.ones((), dtype=x.dtype, device=x.device)
        for axis, (n, m) in enumerate(zip(x.shape[2:], node.output_size)):
            i = torch.arange(m, device=x.device)
            window = (((i + 1) * n + m - 1) // m - (i * n) // m).to(x.dtype)
            sizes = sizes.unsqueeze(-1) * window.reshape((1,) * axis + (m,)) if axis else window
        return self.forward(node, xs, None, False) * sizes ** (1 - power)


# --------------------------------------------------------------------------- shape and wiring


@rule_of(Flatten)
class FlattenRule(Rule):
    """Channel-major flatten: every feature of channel c is a copy of channel c's neuron group."""

    reads_elements = True

    def forward(self, node, xs, param, train):
        return xs[0].flatten(1)

    def squared(self, node, xs, power):
        return xs[0].flatten(1)

    def ties(self, node, ties):
        return ties.elements(node.inputs[0]).reshape(-1)


@rule_of(Add)
class AddRule(Rule):
    """Element-wise sum: identity skips tie the summed channels together; a broadcast channel
    (an input with one channel) feeds every output channel, so it ties all of them."""

    reads_elements = True

    def forward(self, node, xs, param, train):
        total = xs[0]
        for other in xs[1:]:
            total = total + other
        return total

    def squared(self, node, xs, power):
        return self.forward(node, xs, None, False)

    def ties(self, node, ties):
        shape = tuple(ties.shapes[node.name])
        if all(ties.held(i).dim() == 1 for i in node.inputs):
            ids = [ties.held(i) for i in node.inputs]
            ids = [i.repeat(shape[0]) if len(i) == 1 else i for i in ids]
        else:
            # A broadcast axis of size 1 feeds every position of that axis: expanded, it ties them.
            ids = [ties.elements(i).expand(shape) for i in node.inputs]
        for other in ids[1:]:
            ties.union(ids[0], other)
        return ids[0]


@rule_of(Sub)
class SubRule(Rule):
    """``a − b``: fixed edges of weight +1 from ``a`` and −1 from ``b``. In the squared network of
    any power q each becomes |±1|^q = 1, so it is the sum ``a + b`` there (diag(G), path norms,
    path counts, the path-metric's streams); the channels are tied as a sum's (AddRule.ties)."""

    reads_elements = True

    def forward(self, node, xs, param, train):
        return xs[0] - xs[1]

    def squared(self, node, xs, power):
        return xs[0] + xs[1]

    def ties(self, node, ties):
        return AddRule.ties(self, node, ties)


@rule_of(Concat)
class ConcatRule(Rule):
    reads_elements = True

    def forward(self, node, xs, param, train):
        return torch.cat(xs, dim=1)

    def squared(self, node, xs, power):
        return torch.cat(xs, dim=1)

    def ties(self, node, ties):
        if all(ties.held(i).dim() == 1 for i in node.inputs):
            return torch.cat([ties.held(i) for i in node.inputs])
        return torch.cat([ties.elements(i) for i in node.inputs])


def rule_for(node: Node) -> Rule:
    """The rule of ``node``'s exact type; a type without one is refused, never passed through."""
    rule = RULES.get(type(node))
    if rule is None:
        raise UnsupportedModelError(
            f"node '{node.name}' has type {type(node).__name__}, for which pathcond has no rule (forward, "
            "squared network, channel ties): it cannot be evaluated or rescaled"
        )
    return rule
