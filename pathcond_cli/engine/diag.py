"""diag(G), the path count and the ℓq path norms (SPEC §3, §8), each from passes of the "squared network".

The squared network of power q replaces every parameter θ by ψ = |θ|^q, every fixed edge
constant c by |c|^q, every ReLU by the identity and every max-pool by a sum over its window,
and feeds ones. Its summed output is ‖Φ(θ)‖_q^q; for q = 2 that is L, and ∂L/∂ψ = diag(G);
with ψ = 1 and q = 0 it counts paths.

Overflow: deep networks with extreme weights overflow a naive float64 pass, so diag(G) is
computed on a balanced copy Dθ (each layer's incoming squared norm set to 1, an admissible
rescaling) and mapped back in the log domain: log g(θ) = log g(Dθ) + 2(B u_D). The path
count renormalises activations as it goes and keeps the scale in a log offset.

Memory: a Linear layer that sees one input vector has g_oi = δ_o x_i (δ its cotangent, x its
input in the squared network), an outer product; its log g is kept as the two factors
(:class:`OuterLog`), O + I numbers instead of O·I, so that an MLP's diag(G) and everything the
solvers keep from it are the size of its neurons, not of its weights. In a network whose log g
would take more than ``DENSE_LOG_G_BYTES``, a weight whose layer's input and output cotangent
are smaller than it (a wide convolution on a small feature map) is kept as those two
(:class:`GradientLog`), its log g recomputed when a report reads it: the solver reads only the
kernel-summed ḡ, kept beside them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .graph import Graph, Input, Node, Scale
from .groups import DagParam, RescalingGroups, blocks
from .rules import LinearRule, per_channel, rule_for, vjp

EXACT_LIMIT = 2**53
# diag(G) keeps log g as a float64 tensor for every parameter while that takes at most this many
# bytes, a share of the memory bound's constant; beyond, each weight whose LayerGradient is
# smaller than its log g is kept as that, and its log g recomputed when a report reads it.
DENSE_LOG_G_BYTES = 2**28


@dataclass(frozen=True)
class OuterLog:
    """log g of a weight whose g is an outer product: ln g_oi = rows_o + cols_i (float64,
    −inf for g = 0), standing for the ``[O, I]`` tensor ``rows[:, None] + cols[None, :]``."""

    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.numel(), self.cols.numel())

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def numel(self) -> int:
        return self.rows.numel() * self.cols.numel()

    def dense(self) -> torch.Tensor:
        """The ``[O, I]`` tensor itself (O·I float64 values: for small tensors and tests)."""
        return self.rows[:, None] + self.cols[None, :]

    def histc(self, bins: int, low: float, high: float) -> torch.Tensor:
        """``torch.histc`` of the finite entries of the dense tensor (int64 counts, on the
        device), without the dense tensor.

        An entry x goes to bin ⌊(x − low)·bins / (high − low)⌋, the last bin also holding x =
        high, as in histc's kernels; that index, computed as they compute it, is monotone in
        x, hence in cols_i for each row. So for each row and each k, a binary search among the
        row's sums with the sorted finite columns finds how many entries fall below bin k:
        O·bins·log I work for O·I entries. ``low`` ≤ every finite entry ≤ ``high``, low < high."""
        rows = self.rows[torch.isfinite(self.rows)]
        cols = torch.sort(self.cols[torch.isfinite(self.cols)]).values
        first = torch.zeros((rows.numel(), bins - 1), dtype=torch.long, device=rows.device)
        if rows.numel() and cols.numel():
            bounds = torch.arange(1, bins, dtype=torch.float64, device=rows.device)
            span = high - low
            # first[o, k − 1]: the first column whose entry with row o is in bin k or above
            last = torch.full_like(first, cols.numel())
            for _ in range(cols.numel().bit_length()):
                middle = (first + last) // 2
                entries = rows[:, None] + cols[middle.clamp(max=cols.numel() - 1)]
                below = ((entries - low) * bins / span < bounds) & (middle < last)
                first = torch.where(below, middle + 1, first)
                last = torch.where(below, last, middle)
        # entries below bins 1 … bins − 1, differenced into bins; the last one holds the rest
        under = first.sum(0)
        total = under.new_full((1,), rows.numel() * cols.numel())
        return torch.diff(under, prepend=under.new_zeros(1), append=total)

    def flat_entries(self, index: torch.Tensor) -> torch.Tensor:
        """Entries of the flattened dense tensor at ``index``."""
        width = self.cols.numel()
        return self.rows[torch.div(index, width, rounding_mode="floor")] + self.cols[index % width]

    def shifted(self, log_dst: torch.Tensor, log_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two factors of ln g_oi + log_dst_o + log_src_i, shaped like ``log_dst`` and ``log_src``."""
        return self.rows.reshape(log_dst.shape) + log_dst, self.cols.reshape(log_src.shape) + log_src

    def finite_counts(self) -> tuple[int, int]:
        """How many rows and how many columns have a finite log (g > 0 exactly on their product)."""
        return int(torch.isfinite(self.rows).sum()), int(torch.isfinite(self.cols).sum())

    def zeros(self) -> int:
        finite_rows, finite_cols = self.finite_counts()
        return self.numel() - finite_rows * finite_cols

    def to(self, device: torch.device | str) -> OuterLog:
        return OuterLog(self.rows.to(device), self.cols.to(device))


@dataclass
class TensorStats:
    """One pass of reductions over one log g tensor (natural log; g = 0 is −inf)."""

    zeros: int
    low: float
    high: float
    log_sum_exp: float
    log_total: float


def _dense_stats(lg: torch.Tensor) -> TensorStats:
    # log g is never NaN or +inf (diag_g guarantees it), and its minimum is −inf exactly when
    # some g = 0: tensors without zeros, the usual case, need no mask at all.
    low, high = float(lg.min()), float(lg.max())
    if high == -math.inf:
        return TensorStats(lg.numel(), math.inf, -math.inf, -math.inf, 0.0)
    # ln Σ g around the known maximum (the sum is ≥ 1); torch.logsumexp over a whole tensor
    # takes about five times as long on the CPU.
    log_sum_exp = high + math.log(float(torch.sub(lg, high).exp_().sum()))
    if low > -math.inf:
        return TensorStats(0, low, high, log_sum_exp, float(lg.sum()))
    zeros = torch.isneginf(lg)
    return TensorStats(int(zeros.sum()), float(lg.masked_fill(zeros, math.inf).min()), high, log_sum_exp,
                       float(lg.masked_fill(zeros, 0.0).sum()))


def _outer_stats(lg: OuterLog) -> TensorStats:
    """The same reductions from the factors (ln g_oi = rows_o + cols_i): O(O + I), exact up to
    rounding, since the finite entries are the finite rows crossed with the finite columns."""
    finite_rows, finite_cols = lg.rows[torch.isfinite(lg.rows)], lg.cols[torch.isfinite(lg.cols)]
    if not (finite_rows.numel() and finite_cols.numel()):
        return TensorStats(lg.numel(), math.inf, -math.inf, -math.inf, 0.0)
    return TensorStats(
        lg.zeros(), float(finite_rows.min() + finite_cols.min()), float(finite_rows.max() + finite_cols.max()),
        float(torch.logsumexp(finite_rows, 0) + torch.logsumexp(finite_cols, 0)),
        float(finite_cols.numel() * finite_rows.sum() + finite_rows.numel() * finite_cols.sum()))


def kernel_summed(lg4: torch.Tensor) -> torch.Tensor:
    """log ḡ, log g summed over the kernel, from log g shaped ``[G, O/G, I/G, K]``."""
    # A kernel of one needs no sum (logsumexp of one term is that term, bit for bit): ḡ is then
    # a view of log g, not a second parameter-sized copy.
    return lg4[..., 0] if lg4.shape[3] == 1 else torch.logsumexp(lg4, dim=3)


def mapped_back(lg4: torch.Tensor, log_dst: torch.Tensor, log_src: torch.Tensor) -> torch.Tensor:
    """log g(θ) from log g(Dθ), in place, shaped ``[G, O/G, I/G, K]``: + 2u_D at each destination
    (``log_dst``, ``[G, O/G]``) and − 2u_D at each source (``log_src``, ``[G, I/G]``), since
    g(Dθ) = g(θ) / d²."""
    return lg4.add_(log_dst[:, :, None, None]).sub_(log_src[:, None, :, None])


@dataclass(frozen=True)
class LayerGradient:
    """What a layer's weight gradient ∂S/∂ψ in the squared network is computed from: the layer's
    input ``x`` and its output ``cotangent`` (each normalised; ``log_scale`` the sum of their log
    offsets) and the weight's ``shape``. :meth:`log` computes log ∂S/∂ψ, the same bits each time."""

    node: Node
    x: torch.Tensor
    cotangent: torch.Tensor
    log_scale: float
    shape: tuple[int, ...]

    def log(self) -> torch.Tensor:
        stand_in = self.x.new_zeros(()).expand(self.shape)  # only its shape is read
        _, gradient = rule_for(self.node).weighted_vjp(self.node, self.x, stand_in, self.cotangent, input_grad=False)
        return torch.log_(gradient).add_(self.log_scale)

    def is_smaller_than_its_log(self) -> bool:
        """Whether this, kept with the kernel-summed log ḡ, takes fewer numbers than log g itself."""
        numel = math.prod(self.shape)
        return self.x.numel() + self.cotangent.numel() + numel // math.prod(self.shape[2:]) < numel

    def to(self, device: torch.device | str) -> LayerGradient:
        return dataclasses.replace(self, x=self.x.to(device), cotangent=self.cotangent.to(device))


@dataclass(frozen=True)
class GradientLog:
    """log g of a weight kept as the :class:`LayerGradient` it is computed from, mapped back from
    the balanced copy by ``log_dst`` and ``log_src`` (:func:`mapped_back`), where that is smaller
    than log g (a wide convolution on a small feature map: a float64 log g per parameter is twice
    a float32 checkpoint). :meth:`dense` recomputes log g, the same bits each time; what the
    solver and the reports read of every tensor is kept: ``log_gbar`` (:func:`kernel_summed`),
    ``positive_taps``, per kernel-summed entry how many of its g are > 0 (None when all are),
    and ``stats`` (:func:`tensor_stats`)."""

    gradient: LayerGradient
    view: tuple[int, int, int, int]
    log_dst: torch.Tensor
    log_src: torch.Tensor
    log_gbar: torch.Tensor
    positive_taps: torch.Tensor | None
    stats: TensorStats

    @classmethod
    def of(cls, gradient: LayerGradient, view: tuple[int, int, int, int], log_dst: torch.Tensor,
           log_src: torch.Tensor) -> GradientLog:
        lg4 = mapped_back(gradient.log().reshape(view), log_dst, log_src)
        stats = _dense_stats(lg4.reshape(gradient.shape))
        positive_taps = None
        if stats.zeros:
            positive_taps = torch.isfinite(lg4).sum(3, dtype=torch.uint8 if view[3] < 256 else torch.int32)
        return cls(gradient, view, log_dst, log_src, kernel_summed(lg4), positive_taps, stats)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.gradient.shape

    @property
    def device(self) -> torch.device:
        return self.log_gbar.device

    def numel(self) -> int:
        return math.prod(self.view)

    def dense(self) -> torch.Tensor:
        """log g as a tensor, recomputed (a float64 value per parameter: one tensor at a time)."""
        return mapped_back(self.gradient.log().reshape(self.view), self.log_dst, self.log_src).reshape(self.shape)

    def positive_taps_per_entry(self) -> torch.Tensor:
        """``positive_taps`` as a tensor shaped like ``log_gbar``, also when every g is > 0."""
        if self.positive_taps is None:
            return torch.full(self.view[:3], self.view[3], dtype=torch.int32, device=self.device)
        return self.positive_taps

    def to(self, device: torch.device | str) -> GradientLog:
        return dataclasses.replace(
            self, gradient=self.gradient.to(device), log_dst=self.log_dst.to(device), log_src=self.log_src.to(device),
            log_gbar=self.log_gbar.to(device),
            positive_taps=None if self.positive_taps is None else self.positive_taps.to(device))


LogG = torch.Tensor | OuterLog | GradientLog


def dense(log_g: LogG) -> torch.Tensor:
    """A tensor's log g as a tensor, whichever way it is kept."""
    return log_g if isinstance(log_g, torch.Tensor) else log_g.dense()


def tensor_stats(log_g: LogG) -> TensorStats:
    """:class:`TensorStats` of a tensor's log g, whichever way it is kept."""
    if isinstance(log_g, OuterLog):
        return _outer_stats(log_g)
    return log_g.stats if isinstance(log_g, GradientLog) else _dense_stats(log_g)


def zero_count(log_g: LogG) -> int:
    """How many g = 0 in this tensor."""
    if isinstance(log_g, OuterLog):
        return log_g.zeros()
    return log_g.stats.zeros if isinstance(log_g, GradientLog) else int(torch.isneginf(log_g).sum())


def has_nonzero(log_g: LogG) -> bool:
    """Whether some g > 0 in this tensor."""
    if isinstance(log_g, OuterLog):
        return min(log_g.finite_counts()) > 0
    if isinstance(log_g, GradientLog):
        return log_g.stats.zeros < log_g.numel()
    return bool(torch.isfinite(log_g).any())


@dataclass
class DiagG:
    """log diag(G) per DAG parameter (−inf where g = 0), in float64, in the original θ's scale.

    ``parts`` keeps each as a tensor shaped like the parameter, or as an :class:`OuterLog` for
    a Linear layer's weight whose g is an outer product; pathcond's own passes read them so.
    ``log_g`` gives every one as a tensor, an outer product expanded when read.
    """

    parts: Sequence[LogG]

    @property
    def log_g(self) -> Sequence[torch.Tensor]:
        return _Expanded(self.parts)

    def any_nonzero(self) -> bool:
        return any(has_nonzero(lg) for lg in self.parts)


@dataclass
class PathCount:
    log10: float
    exact: int | None


@dataclass(frozen=True)
class PathNorm:
    """‖Φ(θ)‖_q as log10 (always finite for a network with a non-zero path; −inf when Φ = 0)
    and as a float when it fits in float64 (None otherwise)."""

    q: float
    log10: float

    @property
    def value(self) -> float | None:
        try:
            value = 10.0**self.log10
        except OverflowError:
            return None
        return value if math.isfinite(value) and (value > 0 or self.log10 == -math.inf) else None

    @property
    def key(self) -> str:
        """The report's key: ``l`` and q's shortest decimal that reads back as the same float64
        (``l1``, ``l2``, ``l4``, ``l1.5``, ``l1.0000001``, ``l1e+308``), so distinct q never share one."""
        return "l" + norm_order_text(self.q)


def norm_order_text(q: float) -> str:
    """q as its shortest round-tripping decimal, without a trailing ``.0``: ``1``, ``1.5``, ``1e+308``."""
    text = repr(float(q))
    return text[:-2] if text.endswith(".0") else text


@dataclass
class ScaledTensor:
    """A non-negative tensor stored as ``value · exp(log_scale)`` so that any magnitude fits."""

    value: torch.Tensor
    log_scale: float = 0.0


# A layer's (weight, bias) in the squared network; either may be absent (a bias alone has no weight).
LayerPsi = tuple[ScaledTensor | None, ScaledTensor | None]


@dataclass
class SquaredPass:
    """The squared network's activations: true value of node n is ``exp(offsets[n]) · values[n]``."""

    values: dict[str, torch.Tensor]
    offsets: dict[str, float]

    def total(self, graph: Graph) -> tuple[float, float]:
        """L = Σ outputs, as (mantissa, log offset)."""
        final = max(self.offsets[o] for o in graph.outputs)
        mantissa = sum(float(self.values[o].sum()) * math.exp(self.offsets[o] - final) for o in graph.outputs)
        return mantissa, final


def renormalise(y: torch.Tensor, offset: float) -> tuple[torch.Tensor, float]:
    """Divide by the peak when it leaves [1e-100, 1e100], moving the factor into the log offset.

    Squared-network activations and cotangents are never negative, so the peak is the max.
    """
    peak = float(y.max()) if y.numel() else 0.0
    if peak > 0 and not 1e-100 < peak < 1e100:
        return y / peak, offset + math.log(peak)
    return y, offset


def rescaled_by(tensor: torch.Tensor, log_factor: float) -> torch.Tensor:
    return tensor if log_factor == 0.0 else tensor * math.exp(log_factor)


def squared_network(
    graph: Graph,
    layers: Mapping[str, LayerPsi],
    *,
    power: float,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    totals_only: bool = False,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> SquaredPass:
    """Forward pass of the squared network on all-ones inputs, with a log offset per node.

    ``layers`` maps each Linear/Conv (and standalone BatchNorm) node to its ψ weight and bias
    in torch's layout, each with its own log scale; so neither a huge global scale nor a huge
    path count overflows. A layer without weight (a bias alone) passes its input on through
    fixed edges of weight 1. ``totals_only``, ``inputs``: as :func:`squared_networks`.
    """
    return squared_networks(graph, _OnePower(layers), powers=(power,), dtype=dtype, device=device,
                            totals_only=totals_only, inputs=inputs)[0]


def squared_networks(
    graph: Graph,
    layers: Mapping[str, Iterable[LayerPsi]],
    *,
    powers: Sequence[float],
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    totals_only: bool = False,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> list[SquaredPass]:
    """:func:`squared_network` for each of ``powers`` in one sweep: ``layers`` gives each layer's
    ψ weight and bias for each power in turn (:class:`PowerLayerValues` builds them from one read
    of the layer's values). With ``totals_only`` each activation another node reads is let go
    after its last read: a pass keeps the outputs (all :meth:`SquaredPass.total` reads), and
    the values of inputs nothing reads. ``inputs``: a batch of non-negative values per input
    instead of one all-ones example (with power 1, the |θ| network on |x|)."""
    passes = [SquaredPass({}, {}) for _ in powers]
    with torch.no_grad():
        for node in graph.sweep(*(sweep.values for sweep in passes if totals_only)):
            rule = rule_for(node)
            per_power = iter(layers[node.name]) if node.name in layers else None
            for power, sweep in zip(powers, passes):
                values, offsets = sweep.values, sweep.offsets
                if isinstance(node, Input):
                    y = (torch.ones((1, *node.shape), dtype=dtype, device=device) if inputs is None
                         else inputs[node.name].to(device, dtype))
                    offset = 0.0
                elif per_power is not None:
                    weight, bias = next(per_power)
                    x = values[node.inputs[0]]
                    weighted_scale = offsets[node.inputs[0]] + (0.0 if weight is None else weight.log_scale)
                    offset = weighted_scale if bias is None else max(weighted_scale, bias.log_scale)
                    y = (x if weight is None else rule.weighted(node, x, weight.value)) * math.exp(weighted_scale - offset)
                    if bias is not None:
                        y = y + per_channel(bias.value, y) * math.exp(bias.log_scale - offset)
                    # ψ is layer-sized: released before the next is built, not when it is assigned.
                    del weight, bias
                else:
                    y, offset = parameter_free_step(node, values, offsets, power)
                values[node.name], offsets[node.name] = renormalise(y, offset)
            del per_power
    return passes


class _OnePower(Mapping[str, tuple[LayerPsi]]):
    """Layers of one squared network as :func:`squared_networks` takes them."""

    def __init__(self, layers: Mapping[str, LayerPsi]):
        self._layers = layers

    def __getitem__(self, layer: str) -> tuple[LayerPsi]:
        return (self._layers[layer],)

    def __contains__(self, layer: object) -> bool:
        return layer in self._layers

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


def parameter_free_step(node: Node, values: Mapping[str, torch.Tensor], offsets: Mapping[str, float],
                        power: float) -> tuple[torch.Tensor, float]:
    """A node without DAG parameters in the squared network of ``power``, on its inputs'
    ``values`` with their log ``offsets``: its output and the output's offset."""
    unit, log_gain = unit_gain(node)
    offset = max(offsets[i] for i in node.inputs)
    y = rule_for(node).squared(unit, [rescaled_by(values[i], offsets[i] - offset) for i in node.inputs], power)
    return y, offset + power * log_gain


def unit_gain(node: Node) -> tuple[Node, float]:
    """``node`` with a constant factor c ≠ 0 replaced by 1, and ln|c|: the factor enters as |c|^q
    (a path's weight in every norm is the absolute product), and its power is carried in the log
    offset, where c = 1e200 does not overflow as c² does."""
    if isinstance(node, Scale) and node.factor != 0:
        return dataclasses.replace(node, factor=1.0), math.log(abs(node.factor))
    return node, 0.0


def log_gradients(
    graph: Graph, layers: Mapping[str, LayerPsi], forward: SquaredPass, *,
    power: float = 2, times_value: bool = False, keep_small_gradients: bool = False
) -> dict[str, tuple[LogG | LayerGradient, torch.Tensor | None]]:
    """log ∂L/∂ψ for every layer's weight and bias, by a backward sweep with its own log offsets;
    with ``times_value``, log ψ·∂L/∂ψ instead (each parameter's share of L: for power 1, its
    path-magnitude score), from the ψ the sweep builds anyway, as a tensor. With
    ``keep_small_gradients``, a weight whose :class:`LayerGradient` is smaller than its log is
    given as that, its gradient not computed.

    Each node's vector–Jacobian product is taken locally on normalised values, and the scale
    of the cotangent is carried as a log offset, so gradients far below (or above) the rest
    of the network stay representable: no chain of tiny factors ever multiplies out.

    The sweep consumes ``forward``: each activation is let go once it has been read for the
    last time, so that afterwards ``forward`` holds the outputs (all its total reads) and the
    values of inputs nothing reads.
    """
    cotangents: dict[str, list[tuple[torch.Tensor, float]]] = {
        o: [(torch.ones_like(forward.values[o]), 0.0)] for o in graph.outputs
    }
    result: dict[str, tuple[LogG | LayerGradient | None, torch.Tensor | None]] = {}
    for node in graph.sweep(forward.values, backward=True):
        if isinstance(node, Input) or node.name not in cotangents:
            continue
        incoming = cotangents.pop(node.name)
        sigma = max(offset for _, offset in incoming)
        cotangent = rescaled_by(incoming[0][0], incoming[0][1] - sigma)
        for tensor, offset in incoming[1:]:
            cotangent = cotangent + rescaled_by(tensor, offset - sigma)
        cotangent, sigma = renormalise(cotangent, sigma)

        def send(name: str, tensor: torch.Tensor, offset: float) -> None:
            cotangents.setdefault(name, []).append(renormalise(tensor, offset))

        rule = rule_for(node)
        if node.name in layers:
            weight, bias = layers[node.name]
            source = node.inputs[0]
            x = forward.values[source]
            log_weight: LogG | LayerGradient | None = None
            if weight is None:
                grad_x = cotangent
            elif isinstance(rule, LinearRule) and x.numel() == weight.value.shape[1]:
                # One input vector: ∂L/∂ψ = δ xᵀ, kept as its two factors, never built.
                grad_x, _ = rule.weighted_vjp(node, x, weight.value, cotangent, weight_grad=False)
                log_weight = OuterLog(torch.log(cotangent.reshape(-1)) + sigma,
                                      torch.log(x.reshape(-1)) + forward.offsets[source])
            elif keep_small_gradients and (gradient := LayerGradient(
                    node, x, cotangent, sigma + forward.offsets[source], tuple(weight.value.shape))).is_smaller_than_its_log():
                grad_x, _ = rule.weighted_vjp(node, x, weight.value, cotangent, weight_grad=False)
                log_weight = gradient
            else:
                grad_x, grad_w = rule.weighted_vjp(node, x, weight.value, cotangent)
                log_weight = torch.log_(grad_w).add_(sigma + forward.offsets[source])
            send(source, grad_x, sigma + (0.0 if weight is None else weight.log_scale))
            log_bias = None
            if bias is not None:
                log_bias = torch.log(cotangent.sum(dim=[0, *range(2, cotangent.dim())]).clamp_min(0)) + sigma
            if times_value:
                log_weight = None if weight is None else _times(dense(log_weight).reshape(weight.value.shape), weight)
                log_bias = None if bias is None else _times(log_bias, bias)
            result[node.name] = (log_weight, log_bias)
            del weight, bias
        else:
            # Parameter-free nodes are linear in each input, so the point of the VJP is immaterial.
            unit, log_gain = unit_gain(node)
            grads = vjp(lambda *xs: rule.squared(unit, list(xs), power), [forward.values[i] for i in node.inputs], cotangent)
            for source, grad in zip(node.inputs, grads):
                send(source, grad, sigma + power * log_gain)
    return result


def _times(log_gradient: torch.Tensor, value: ScaledTensor) -> torch.Tensor:
    """log(ψ · ∂L/∂ψ) from log ∂L/∂ψ and ψ (non-negative, as ``mantissa · e^scale``)."""
    return log_gradient.add_(torch.log(value.value.reshape(log_gradient.shape))).add_(value.log_scale)


class _Expanded(Sequence[torch.Tensor]):
    def __init__(self, parts: Sequence[LogG]):
        self._parts = parts

    def __getitem__(self, t):
        if isinstance(t, slice):
            return [dense(lg) for lg in self._parts[t]]
        return dense(self._parts[t])

    def __len__(self) -> int:
        return len(self._parts)


def _layer_tensors(groups: RescalingGroups, tensors: list) -> dict[str, list]:
    by_layer: dict[str, list] = {}
    for dp, t in zip(groups.dag_params, tensors):
        by_layer.setdefault(dp.layer, []).append(t)
    return by_layer


class LayerValues(Mapping[str, LayerPsi]):
    """Each layer's (weight, bias) for the squared network, built from its DAG parameters on
    every access and never kept: the passes hold one layer's ψ at a time, not a float64 copy
    of the whole network (the forward and backward sweeps build the same numbers twice).
    With ``keep``, each is built once and kept, for a caller that holds a float64 value per
    parameter anyway (the pruning scores)."""

    def __init__(self, groups: RescalingGroups, make: Callable[[DagParam], ScaledTensor], *, keep: bool = False):
        self._tensors = _layer_tensors(groups, groups.dag_params)
        self._make = make
        self._kept: dict[str, LayerPsi] | None = {} if keep else None

    def __getitem__(self, layer: str) -> LayerPsi:
        if self._kept is not None and layer in self._kept:
            return self._kept[layer]
        weights = [self._make(dp) for dp in self._tensors[layer] if not dp.is_bias] or [None]
        biases = [self._make(dp) for dp in self._tensors[layer] if dp.is_bias] or [None]
        values = weights[0], biases[0]
        if self._kept is not None:
            self._kept[layer] = values
        return values

    def __contains__(self, layer: object) -> bool:
        # Mapping's default would build the layer's values to answer.
        return layer in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class PowerLayerValues(Mapping[str, Iterator[LayerPsi]]):
    """Each layer's (weight, bias) for the squared networks of several ``powers``, in turn
    (:func:`squared_networks`): ψ = |Dθ|^q for each q from one balanced copy Dθ (one read of
    the layer's values, ``u_ext`` the balancing), each ψ built when its pass reaches it. ψ for
    q = 1 and the last ψ are built in the copy's own memory (|Dθ| raised to q has the bits of Dθ
    raised to q), so ℓ1 and ℓ2 together hold one float64 copy of a layer, as one power does,
    and more powers at most two."""

    def __init__(self, groups: RescalingGroups, u_ext: torch.Tensor, device, powers: Sequence[float]):
        self._signed = LayerValues(groups, lambda dp: balanced_value(dp, u_ext, device))
        self._powers = powers

    def __getitem__(self, layer: str) -> Iterator[LayerPsi]:
        weight, bias = self._signed[layer]
        for number, power in enumerate(self._powers):
            in_place = power == 1 or number == len(self._powers) - 1
            yield tuple(None if signed is None else psi_of(signed, power, in_place=in_place)
                        for signed in (weight, bias))

    def __contains__(self, layer: object) -> bool:
        return layer in self._signed

    def __iter__(self):
        return iter(self._signed)

    def __len__(self) -> int:
        return len(self._signed)


def unit_values(dp: DagParam, device) -> ScaledTensor:
    return ScaledTensor(torch.ones(dp.shape, dtype=torch.float64, device=device))


def balancing_exponents(groups: RescalingGroups, order: float = 2.0) -> torch.Tensor:
    """An admissible rescaling u_D that gives each free group's incoming parameters unit ℓ_order
    norm (squared norm by default; a path norm of order q ≫ 2 runs on its own, so that the largest
    entry of each row is near 1 and its q-th power does not underflow).

    Computed layer by layer in topological order; each output row is divided by its largest
    entry before the power and the scales are kept as logarithms, so it is finite for any
    finite weights. A group fed by several layers (a residual stream) takes the first whose
    row is not zero.

    Only parameters on a path count: a weight that leaves a dead group (no non-zero weight
    from a live group and no bias reaches it, e.g. after a BatchNorm with γ = 0 and β = 0) and
    an all-zero row are left out, and a dead group keeps u = 0. So u_D(D_v θ) = u_D(θ) − v on
    every live group for any rescaling v, dead groups included: the balanced copy is the same
    for a network and any rescaling of it wherever a path runs, and dead groups carry no path.
    """
    H = groups.num_free
    u = torch.zeros(H + 1, dtype=torch.float64, device=groups.device)
    assigned = torch.zeros(H + 1, dtype=torch.bool, device=groups.device)
    assigned[H] = True
    live = assigned.clone()
    for dps in _layer_tensors(groups, groups.dag_params).values():
        weight_dp, *bias_dps = dps
        if weight_dp.is_bias:
            continue  # a bias alone: its channels are its input's, balanced where they were made
        source = (-order * u[weight_dp.src]).masked_fill_(~live[weight_dp.src], -math.inf)
        stored = weight_dp.value.reshape(weight_dp.view)
        conv_groups, rows_per_group, in_per_group, kernel = weight_dp.view
        per_out = torch.cat([_log_row_norms(stored[:, rows], source, order)
                             for rows in blocks(rows_per_group, conv_groups * in_per_group * kernel)], dim=1)
        per_out = per_out.reshape(-1)
        for bias_dp in bias_dps:
            per_out = torch.logaddexp(per_out, order * torch.log(bias_dp.value.to(torch.float64).abs()))
        dst = weight_dp.dst.reshape(-1)
        row_live = torch.isfinite(per_out)
        live[dst[row_live]] = True
        target = torch.where(row_live, -per_out / order, torch.zeros_like(per_out))
        fresh = ~assigned[dst] & row_live
        if bool(fresh.any()):
            u.scatter_reduce_(0, dst[fresh], target[fresh], reduce="amin", include_self=False)
            assigned[dst[fresh]] = True
    return u[:H]


def _log_row_norms(w4: torch.Tensor, source: torch.Tensor, order: float) -> torch.Tensor:
    """ln Σ_{i,k} |w_oik|^order e^{s_i} per row o of a ``[G, rows, I/G, K]`` block (``source``:
    s, ``[G, I/G]``, −inf for a source left out). Order 2: each row divided by its largest entry
    before squaring, one matrix product; other orders: a log-sum-exp per row, where |w|^q for a
    large q, even divided by the row's largest, would underflow."""
    w4 = w4.to(torch.float64).abs()
    if order != 2:
        return torch.logsumexp(w4.log_().mul_(order).add_(source[:, None, :, None]).flatten(2), dim=2)
    source_max = source.amax(dim=1, keepdim=True).nan_to_num_(neginf=0.0)
    source_scale = torch.exp(source - source_max)[:, :, None]
    row_max = w4.amax(dim=(2, 3), keepdim=True)
    squares = w4.div_(row_max.clamp_min(torch.finfo(torch.float64).tiny)).square_().sum(3)
    return torch.log(torch.bmm(squares, source_scale).squeeze(2)) + 2 * torch.log(row_max[:, :, 0, 0]) + source_max


def balanced_value(dp: DagParam, u_ext: torch.Tensor, device) -> ScaledTensor:
    """Dθ for one tensor (D the rescaling ``u_ext``), signed, with its scale as a logarithm.

    (Dθ)_{oi} = θ_{oi} · e^{a_o} · e^{b_i} with a = u_dst, b = −u_src: each factor is divided
    by its maximum, so the mantissa is at most 1 in magnitude and no intermediate overflows.
    """
    # A copy even of a float64 value (it may be a view of the mapped checkpoint), scaled in place.
    value = dp.value.to(device, torch.float64, copy=True).reshape(dp.view)
    a, b = u_ext[dp.dst], -u_ext[dp.src]
    a_max, b_max = float(a.max()), float(b.max())
    low, high = value.aminmax() if value.numel() else (value.new_zeros(()), value.new_zeros(()))
    peak = max(-float(low), float(high))
    if peak == 0.0:
        return ScaledTensor(torch.zeros(dp.shape, dtype=torch.float64, device=device))
    value.mul_((torch.exp(a - a_max) / peak)[:, :, None, None]).mul_(torch.exp(b - b_max)[:, None, :, None])
    return ScaledTensor(value.reshape(dp.shape), math.log(peak) + a_max + b_max)


def balanced_power(dp: DagParam, u_ext: torch.Tensor, device, power: float) -> ScaledTensor:
    """ψ = |Dθ|^power for one tensor, its scale as a logarithm (mantissa at most 1)."""
    return psi_of(balanced_value(dp, u_ext, device), power, in_place=True)


def psi_of(signed: ScaledTensor, power: float, *, in_place: bool = False) -> ScaledTensor:
    """ψ = |v|^power of a signed value, its scale as a logarithm; in ``signed``'s memory with ``in_place``.

    For a power other than 1, |v| is divided by its largest entry first, so that the largest ψ
    is 1 whatever the power: a largest entry below 1 raised to q = 1000 would underflow the whole
    tensor to 0. (ψ for power 1 is |v| itself, and may share ``signed``'s memory while other
    powers are still to be built from it.)
    """
    value = signed.value if in_place else signed.value.clone()
    magnitude = value.abs_()
    log_scale = signed.log_scale
    peak = float(magnitude.max()) if power != 1 and magnitude.numel() else 0.0
    if peak > 0:
        magnitude.div_(peak)
        log_scale += math.log(peak)
    psi = magnitude.square_() if power == 2 else magnitude.pow_(power)
    return ScaledTensor(psi, power * log_scale)


def diag_g(groups: RescalingGroups, *, device: torch.device | str = "cpu", u_ext: torch.Tensor | None = None) -> DiagG:
    """log diag(G) for every DAG parameter: one forward and one backward pass (SPEC §3).

    ψ = (Dθ)² is built per tensor with a log scale (D an admissible balancing: ``u_ext``,
    computed here when not given), and log g(θ) = log ∂L/∂Ψ(Dθ) + 2(B u_D) since g(Dθ) = g(θ) / d².
    """
    return diag_g_and_l2_norm(groups, device=device, u_ext=u_ext)[0]


def diag_g_and_l2_norm(groups: RescalingGroups, *, device: torch.device | str = "cpu",
                       u_ext: torch.Tensor | None = None) -> tuple[DiagG, PathNorm]:
    """:func:`diag_g` and ‖Φ(θ)‖₂: diag(G)'s forward pass is the squared network of power 2 on
    ψ = (Dθ)², whose total is ‖Φ‖₂² (SPEC §8), so one pass serves both."""
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    log_g: list[LogG] = []
    gradients, total = _balanced_log_gradients(groups, u_ext, 2, device,
                                               keep_small_gradients=8 * groups.p > DENSE_LOG_G_BYTES)
    for dp, lg in gradients:
        log_dst, log_src = 2 * u_ext[dp.dst], 2 * u_ext[dp.src]
        if isinstance(lg, OuterLog):
            lg = OuterLog(*lg.shifted(log_dst.reshape(-1), -log_src.reshape(-1)))
            peaks = [float(t.max()) for t in (lg.rows, lg.cols) if t.numel()]
        elif isinstance(lg, LayerGradient):
            lg = GradientLog.of(lg, dp.view, log_dst, log_src)
            peaks = [lg.stats.high]
        else:
            lg = mapped_back(lg.reshape(dp.view), log_dst, log_src).reshape(dp.shape)
            peaks = [float(lg.max())] if lg.numel() else []
        # NaN and +inf both fail this comparison: one reduction checks both.
        if any(not peak < math.inf for peak in peaks):
            raise ArithmeticError("diag(G) could not be represented even in the log domain")
        log_g.append(lg)
    return DiagG(log_g), _norm_of_total(2.0, 2.0, *total)


def _balanced_log_gradients(groups: RescalingGroups, u_ext: torch.Tensor, power: float, device, *,
                            times_value: bool = False, keep_small_gradients: bool = False,
                            ) -> tuple[list[tuple[DagParam, LogG | LayerGradient]], tuple[float, float]]:
    """(dp, log ∂S/∂ψ) per DAG parameter, S = Σ_P Π ψ the squared network of ``power`` on the
    balanced ψ = |Dθ|^power, and S as (mantissa, ln offset): one forward and one backward pass
    (log ψ·∂S/∂ψ with ``times_value``; ``keep_small_gradients`` as :func:`log_gradients`)."""
    # The scores (times_value) are a float64 value per parameter: keeping ψ for the backward
    # sweep at most doubles that, and saves building every layer's ψ twice.
    layers = LayerValues(groups, lambda dp: balanced_power(dp, u_ext, device, power), keep=times_value)
    forward = squared_network(groups.graph, layers, power=power, device=device)
    gradients = log_gradients(groups.graph, layers, forward, power=power, times_value=times_value,
                              keep_small_gradients=keep_small_gradients)
    per_parameter = []
    for dp in groups.dag_params:
        weight_log, bias_log = gradients[dp.layer]
        per_parameter.append((dp, bias_log if dp.is_bias else weight_log))
    return per_parameter, forward.total(groups.graph)


def path_magnitude_scores(groups: RescalingGroups, *, device: torch.device | str = "cpu",
                          u_ext: torch.Tensor | None = None) -> list[torch.Tensor]:
    """ln Δ_i per DAG parameter (shaped like it; −inf where Δ_i = 0): seed 004's path-magnitude
    score Δ_i = ‖Φ(θ)‖₁ − ‖Φ(θ with θ_i = 0)‖₁ (SPEC §8).

    ‖Φ‖₁ is linear in each |θ_i| (a parameter appears at most once on a path), so
    Δ_i = |θ_i| · ∂‖Φ‖₁/∂|θ_i|: every score from one backward pass of the ℓ1 network. Δ is
    rescaling-invariant, so the pass runs on the balanced copy Dθ (``u_ext``: the balancing,
    computed here when not given) and needs no mapping back.
    """
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    return [lg.reshape(dp.shape) for dp, lg in _balanced_log_gradients(groups, u_ext, 1, device, times_value=True)[0]]


def path_sum(groups: RescalingGroups, power: float, make: Callable[[DagParam], ScaledTensor], *,
             device: torch.device | str = "cpu") -> tuple[float, float]:
    """Σ_P Π_{e∈P} ψ_e·|c_e|^power of the squared network of ``power`` whose layers are
    ``make(dp)``, as (mantissa, ln offset): ‖Φ‖_q^q with ψ = |θ|^q and power q; the path count
    with ψ = 1 and power 0 (then an exact integer mantissa while the offset is 0)."""
    return squared_network(groups.graph, LayerValues(groups, make), power=power, device=device,
                           totals_only=True).total(groups.graph)


def path_count(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> PathCount:
    """Number of paths (input or bias to output) as log10, and exactly when below 2**53."""
    groups = groups.to(device)
    mantissa, offset = path_sum(groups, 0, lambda dp: unit_values(dp, device), device=device)
    log10 = (math.log(mantissa) + offset) / math.log(10)
    exact = int(round(mantissa)) if offset == 0.0 and mantissa < EXACT_LIMIT else None
    return PathCount(log10, exact)


def path_norm(groups: RescalingGroups, q: float, *, device: torch.device | str = "cpu",
              u_ext: torch.Tensor | None = None) -> PathNorm:
    """‖Φ(θ)‖_q (SPEC §8): one forward pass of the squared network of power q on ψ = |Dθ|^q."""
    return path_norms(groups, [q], device=device, u_ext=u_ext)[0]


def path_norms(groups: RescalingGroups, orders: Sequence[float], *, device: torch.device | str = "cpu",
               u_ext: torch.Tensor | None = None) -> list[PathNorm]:
    """‖Φ(θ)‖_q for each q of ``orders`` (SPEC §8): the forward passes of the squared networks of
    power q on ψ = |Dθ|^q, in one sweep that reads each tensor once for all of them.

    Φ is rescaling-invariant, so the passes run on the balanced copy Dθ (``u_ext``: the
    balancing, computed here when not given), whose values stay in range on deep networks.
    """
    for q in orders:
        if not q >= 1 or not math.isfinite(q):
            raise ValueError(f"a path norm needs a finite q ≥ 1, not {q}")
    groups = groups.to(device)
    if u_ext is None:
        u_ext = groups.extend(balancing_exponents(groups))
    powers = {q: min(q, LARGEST_COMPUTED_ORDER) for q in orders}
    shared = [q for q in orders if q <= 2]
    norms = {}
    if shared:
        passes = squared_networks(groups.graph, PowerLayerValues(groups, u_ext, device, shared), powers=shared,
                                  device=device, totals_only=True)
        norms |= {q: _norm_of_total(q, q, *sweep.total(groups.graph)) for q, sweep in zip(shared, passes)}
    for q in orders:
        if q not in norms:
            # The ℓ2 balancing leaves rows whose largest entry is n^(−1/2) of their norm: to a power q ≫ 2
            # that underflows. The balancing of order q keeps each row's largest entry within n^(−1/q) of 1.
            power = powers[q]
            balanced = groups.extend(balancing_exponents(groups, power))
            sweep, = squared_networks(groups.graph, PowerLayerValues(groups, balanced, device, [power]), powers=[power],
                                      device=device, totals_only=True)
            norms[q] = _norm_of_total(q, power, *sweep.total(groups.graph))
    return [norms[q] for q in orders]


# The largest order a pass runs at. ψ = |v|^q turns a relative rounding δ of a balanced value
# (δ ≈ (|u| + 4)·2^−53) into a factor e^{qδ}: harmless up to q = 10^12, while beyond some 10^16
# the entries that should be near 1 underflow. For q beyond it, ‖Φ‖_∞ ≤ ‖Φ‖_q ≤ ‖Φ‖_p ≤
# N^{1/p} ‖Φ‖_∞ (p = 10^12, N the path count): ‖Φ‖_p is within a relative ln(N)/10^12 of
# ‖Φ‖_q, below 1e-9 for any network of fewer than 10^400 paths.
LARGEST_COMPUTED_ORDER = 1e12


def _norm_of_total(q: float, power: float, mantissa: float, offset: float) -> PathNorm:
    """‖Φ‖_q from ‖Φ‖_p^p as (mantissa, ln offset), p = ``power`` (q, or the order that has q's norm)."""
    ln_total = math.log(mantissa) + offset if mantissa > 0 else -math.inf
    return PathNorm(float(q), ln_total / power / math.log(10))


def zeros_per_layer(groups: RescalingGroups, psi: Callable[[DagParam], torch.Tensor], *,
                    device: torch.device | str = "cpu") -> dict[str, int]:
    """DAG parameters on no path whose other entries of ``psi`` are all non-zero, per layer
    (layers without any left out): one pass of the power-0 squared network on ``psi`` (one
    tensor per DAG parameter, ≥ 0, shaped like it), whose ∂N/∂ψ counts those paths.

    g_i is a sum of non-negative terms, one per path through i, so it is zero exactly when
    no path through i has every other weight non-zero: with ``psi`` = 1[θ ≠ 0] this counts
    diag(G)'s zeros, and with some entries set to 1, those that remain without them.
    """
    layers = LayerValues(groups, lambda dp: ScaledTensor(psi(dp)))
    counts = log_gradients(groups.graph, layers, squared_network(groups.graph, layers, power=0, device=device), power=0)
    zeros: dict[str, int] = {}
    for layer, (weight_log, bias_log) in counts.items():
        missing = sum(zero_count(log_g) for log_g in (weight_log, bias_log) if log_g is not None)
        if missing:
            zeros[layer] = missing
    return zeros


def unused_parameters(groups: RescalingGroups, *, device: torch.device | str = "cpu") -> dict[str, int]:
    """DAG parameters on no input-or-bias-to-output path at the graph's input shape, per layer.

    The number of paths through each parameter is ∂N/∂ψ of the path-count network; it is 0
    for conv taps that only ever see padding (or whose windows fall outside a small input).
    Such parameters have g = 0 whatever the weights, so diag(G) and the rescaling know nothing
    of them: the input shape should be the one the network is trained at.
    """
    return zeros_per_layer(groups, lambda dp: unit_values(dp, device).value, device=device)
