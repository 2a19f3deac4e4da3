"""How diag(G) is kept: log g per DAG parameter, as a tensor or in a factored form.

Memory: a Linear layer that sees one input vector has g_oi = δ_o x_i (δ its cotangent, x its
input in the squared network), an outer product; its log g is kept as the two factors
(:class:`OuterLog`), O + I numbers instead of O·I, so that an MLP's diag(G) and everything the
solvers keep from it are the size of its neurons, not of its weights. In a network whose log g
would take more than ``diag.DENSE_LOG_G_BYTES``, a weight whose layer's input and output cotangent
are smaller than it (a wide convolution on a small feature map) is kept as those two
(:class:`GradientLog`), its log g recomputed when a report reads it: the solver reads only the
kernel-summed ḡ, kept beside them.

The squared-network passes that compute these live in :mod:`.diag`; the solvers and the plot
read only this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .graph import Node
from .rules import rule_for


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


# The reductions of one tensor's statistics, left on the device so that those of every tensor
# are read at once (one wait for the device per network, not one per tensor): the number of
# zeros, the finite minimum, the maximum, ln Σ g as a shift and a sum (ln Σ g = shift + ln sum),
# and the sum of the finite entries.
_SUMMARY_FIELDS = 6


def _dense_summary(lg: torch.Tensor) -> torch.Tensor:
    # log g is never NaN or +inf (diag_g guarantees it), and is −inf exactly where g = 0.
    zeros = torch.isneginf(lg)
    high = lg.amax()
    # ln Σ g around the known maximum (the sum is ≥ 1); torch.logsumexp over a whole tensor
    # takes about five times as long on the CPU.
    exp_sum = torch.sub(lg, high).exp_().sum()
    return torch.stack(
        [
            zeros.sum().to(torch.float64),
            lg.masked_fill(zeros, math.inf).amin(),
            high,
            high,
            exp_sum,
            lg.masked_fill(zeros, 0.0).sum(),
        ]
    )


def _outer_summary(lg: OuterLog) -> torch.Tensor:
    """The same reductions from the factors (ln g_oi = rows_o + cols_i): O(O + I), exact up to
    rounding, since the finite entries are the finite rows crossed with the finite columns."""
    finite_rows, finite_cols = torch.isfinite(lg.rows), torch.isfinite(lg.cols)
    count_rows, count_cols = finite_rows.sum().to(torch.float64), finite_cols.sum().to(torch.float64)
    rows, cols = lg.rows.masked_fill(~finite_rows, -math.inf), lg.cols.masked_fill(~finite_cols, -math.inf)
    return torch.stack(
        [
            lg.numel() - count_rows * count_cols,
            rows.masked_fill(~finite_rows, math.inf).amin() + cols.masked_fill(~finite_cols, math.inf).amin(),
            rows.amax() + cols.amax(),
            torch.logsumexp(rows, 0) + torch.logsumexp(cols, 0),
            torch.ones_like(count_rows),
            count_cols * lg.rows.masked_fill(~finite_rows, 0.0).sum()
            + count_rows * lg.cols.masked_fill(~finite_cols, 0.0).sum(),
        ]
    )


def _summary(log_g: LogG) -> torch.Tensor:
    if isinstance(log_g, OuterLog):
        return _outer_summary(log_g)
    if isinstance(log_g, GradientLog):
        stats = log_g.stats
        return torch.tensor(
            [stats.zeros, stats.low, stats.high, stats.log_sum_exp, 1.0, stats.log_total],
            dtype=torch.float64,
            device=log_g.device,
        )
    return _dense_summary(log_g)


def _stats_of(summary: Sequence[float], numel: int) -> TensorStats:
    zeros, low, high, shift, exp_sum, total = summary
    if zeros == numel:
        return TensorStats(numel, math.inf, -math.inf, -math.inf, 0.0)
    return TensorStats(int(zeros), low, high, shift + math.log(exp_sum), total)


def _read_stats(summaries: Sequence[torch.Tensor], numels: Sequence[int]) -> list[TensorStats]:
    read = torch.stack(summaries).tolist() if summaries else []
    return [_stats_of(summary, numel) for summary, numel in zip(read, numels)]


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
    log_scale: float | torch.Tensor
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
    def all_of(
        cls,
        pending: Sequence[tuple[LayerGradient, tuple[int, int, int, int], torch.Tensor, torch.Tensor]],
    ) -> list[GradientLog]:
        """Those of several weights, each given as (gradient, view, log_dst, log_src): their
        statistics read from the device at once, for all of them."""
        made, summaries = [], []
        for gradient, view, log_dst, log_src in pending:
            lg4 = mapped_back(gradient.log().reshape(view), log_dst, log_src)
            summaries.append(_dense_summary(lg4.reshape(gradient.shape)))
            taps = torch.isfinite(lg4).sum(3, dtype=torch.uint8 if view[3] < 256 else torch.int32)
            made.append((gradient, view, log_dst, log_src, kernel_summed(lg4), taps))
            del lg4
        stats = _read_stats(summaries, [math.prod(view) for _, view, _, _ in pending])
        return [
            cls(gradient, view, log_dst, log_src, log_gbar, taps if counted.zeros else None, counted)
            for (gradient, view, log_dst, log_src, log_gbar, taps), counted in zip(made, stats)
        ]

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
            self,
            gradient=self.gradient.to(device),
            log_dst=self.log_dst.to(device),
            log_src=self.log_src.to(device),
            log_gbar=self.log_gbar.to(device),
            positive_taps=None if self.positive_taps is None else self.positive_taps.to(device),
        )


LogG = torch.Tensor | OuterLog | GradientLog


def dense(log_g: LogG) -> torch.Tensor:
    """A tensor's log g as a tensor, whichever way it is kept."""
    return log_g if isinstance(log_g, torch.Tensor) else log_g.dense()


def tensor_stats(log_g: LogG) -> TensorStats:
    """:class:`TensorStats` of a tensor's log g, whichever way it is kept."""
    return all_tensor_stats([log_g])[0]


def all_tensor_stats(log_g: Sequence[LogG]) -> list[TensorStats]:
    """:func:`tensor_stats` of each tensor, read from the device at once."""
    if all(isinstance(lg, GradientLog) for lg in log_g):
        return [lg.stats for lg in log_g]
    return _read_stats([_summary(lg) for lg in log_g], [lg.numel() for lg in log_g])


def _zeros_on_device(log_g: LogG) -> torch.Tensor:
    if isinstance(log_g, OuterLog):
        return log_g.numel() - torch.isfinite(log_g.rows).sum() * torch.isfinite(log_g.cols).sum()
    if isinstance(log_g, GradientLog):
        return torch.tensor(log_g.stats.zeros, device=log_g.device)
    return torch.isneginf(log_g).sum()


def zero_count(log_g: LogG) -> int:
    """How many g = 0 in this tensor."""
    return zero_counts([log_g])[0]


def zero_counts(log_g: Sequence[LogG]) -> list[int]:
    """:func:`zero_count` of each tensor, read from the device at once."""
    return torch.stack([_zeros_on_device(lg) for lg in log_g]).tolist() if log_g else []


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
        """Whether some g > 0: one read of the device for every tensor."""
        return any(zeros < lg.numel() for zeros, lg in zip(zero_counts(self.parts), self.parts))


class _Expanded(Sequence[torch.Tensor]):
    def __init__(self, parts: Sequence[LogG]):
        self._parts = parts

    def __getitem__(self, t):
        if isinstance(t, slice):
            return [dense(lg) for lg in self._parts[t]]
        return dense(self._parts[t])

    def __len__(self) -> int:
        return len(self._parts)
