"""The PathCond objective (SPEC §4) and the per-group quantities the solvers share (SPEC §5).

    F(u) = p · ln Σ_i g_i exp(−2 (Bu)_i) + 2 Σ_i (Bu)_i,   Σ_i (Bu)_i = k·u

Every sum runs over the support g_i > 0 (:class:`Support`): p counts it and k_h its
parameters entering minus leaving group h. A parameter with g = 0 plays no part in G, and
counting its (Bu)_i too would let F fall while D, over the same support, rises.

Everything is evaluated from log g in the log domain with a running shift, so neither g nor
the weights w_i = g_i e^{−2(Bu)_i} ever overflow. One evaluation is one pass over the DAG
parameters.

Newton's method needs two more things, built here on the same per-tensor factorisation:
products with the coupling matrices ``ḡ_ij e^{x_i + y_j}`` (:class:`Coupling`: the Hessian's
Laplacian part) and F(u + δ) − F(u) accurate to the rounding of the change itself
(:meth:`Objective.change`), without which a line search cannot tell steps apart once the
change drops below the rounding of F.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..engine.groups import RescalingGroups
from ..engine.log_g import DiagG, GradientLog, LogG, OuterLog, dense, kernel_summed
from .flat import SAFE_RANGE, Bucket, FlatG, finite_extreme, group_logsumexp

LOG2 = math.log(2.0)
LOG4 = math.log(4.0)
# ḡ in linear scale is kept for tensors up to this many bytes in all (the bound's constant
# share), recomputed per pass beyond: a Newton solve recomputes it at every CG product.
GBAR_CACHE_BYTES = 2**30


@dataclass(frozen=True)
class Support:
    """The parameters with g > 0, over which every sum of F runs (SPEC §4): ``size`` is p, and
    ``n_in``/``n_out`` count, per free group, those entering and leaving it (its +1 and −1
    entries of B; a parameter within one group has neither). Depends only on which g_i are
    zero, so it holds for every u: g e^{−2(Bu)} is zero exactly where g is."""

    size: int
    n_in: torch.Tensor
    n_out: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        """k_h = n_in,h − n_out,h: Σ_i (Bu)_i = k·u over the support."""
        return self.n_in - self.n_out

    @property
    def degenerate(self) -> torch.Tensor:
        """Free groups with A_h = 0 or C_h = 0 (no g > 0 enters or leaves): F is not coercive
        in them, and a group with no support at all is one of them."""
        return (self.n_in == 0) | (self.n_out == 0)


def support(groups: RescalingGroups, log_g: Iterable[LogG]) -> Support:
    """The :class:`Support` of log g (−inf where g = 0), read one tensor at a time (a generator
    holds one): an outer product by its factors (a row × column is in the support iff both
    are finite), never expanded, a :class:`~pathcond_cli.engine.log_g.GradientLog` by its counts
    of g > 0 per kernel, never recomputed, and never a float64 copy of the network. p is
    counted on the device and read once."""
    counts = []

    def indicators():
        for lg in log_g:
            if isinstance(lg, OuterLog):
                finite = torch.isfinite(lg.rows), torch.isfinite(lg.cols)
                counts.append(finite[0].sum() * finite[1].sum())
            elif isinstance(lg, GradientLog):
                finite = lg.positive_taps_per_entry()
                counts.append(finite.sum())
            else:
                finite = torch.isfinite(lg)
                counts.append(finite.sum())
            yield finite

    n_in, n_out = groups.incidence_sums(indicators())
    return Support(int(torch.stack(counts).sum()) if counts else 0, n_in, n_out)


@dataclass
class Evaluation:
    """F(u) and, per free group, the shares a_h = p·A_h/S and c_h = p·C_h/S, kept as logs
    (``log_a``, ``log_c``) because they can lie far outside float64's range. The logs of the
    row sums and column sums of w (self-loops included) they came from, over ``flat``'s slots
    (``log_rows``, ``log_cols``); per tensor, ``[G, O/G]`` and ``[G, I/G]``, as views."""

    value: float
    log_a: torch.Tensor
    log_c: torch.Tensor
    gradient: torch.Tensor
    kkt_residual: float
    log_total: torch.Tensor
    flat: FlatG
    log_rows: torch.Tensor
    log_cols: torch.Tensor
    # the caller's values read with F's (``evaluate``'s ``also``), on the host
    also: list[float] = field(default_factory=list)

    @property
    def a(self) -> torch.Tensor:
        return torch.exp(self.log_a)

    @property
    def c(self) -> torch.Tensor:
        return torch.exp(self.log_c)

    @property
    def tensor_log_rows(self) -> list[torch.Tensor]:
        return [self.log_rows[rows].reshape(shape) for rows, shape in zip(self.flat.row_slices, self.flat.dst_shapes)]

    @property
    def tensor_log_cols(self) -> list[torch.Tensor]:
        return [self.log_cols[cols].reshape(shape) for cols, shape in zip(self.flat.col_slices, self.flat.src_shapes)]


class Objective:
    """F for one network, on one device. Counts its passes over the parameters.

    Because w_i = g_i · e^{−2u_dst} · e^{2u_src} factorises, g is summed over kernel positions
    once (ḡ, shape ``[G, O/G, I/G]``) and a pass is the row and column sums of every tensor's
    ḡ against the two factors, taken over flat buffers of all tensors at once
    (:class:`~pathcond_cli.solve.flat.FlatG`): batched mat-vecs in linear scale where a tensor's
    dynamic range guarantees that no positive term underflows, the log domain otherwise. Sums
    across tensors and groups are log-sum-exp, so nothing overflows or underflows.
    """

    def __init__(
        self, groups: RescalingGroups, diag: DiagG, *, device: torch.device | str = "cpu", bound: float | None = None
    ):
        self.groups = groups.to(device)
        self.bound = bound
        self.device = torch.device(device)
        self.support = support(self.groups, (lg.to(self.device) for lg in diag.parts))
        if not self.support.size:
            raise ValueError("diag(G) is zero everywhere: the network computes the zero function")
        self.p = self.support.size
        self.log_p = math.log(self.p)
        self.k = self.support.k
        # The KKT residual's normaliser: the group's support parameters, as k counts them.
        self.degree = (self.support.n_in + self.support.n_out).clamp_min(1)
        self_loop_log = torch.full((groups.num_free + 1,), -torch.inf, dtype=torch.float64, device=self.device)
        parts: list[LogG] = []
        for lg, dp in zip(diag.parts, self.groups.dag_params):
            log_gbar = _kernel_summed(lg.to(self.device), dp)
            if dp.self_loops is not None:
                self_loop_log = torch.logaddexp(self_loop_log, _self_loop_logs(dp, log_gbar, groups.num_free + 1))
            parts.append(log_gbar)
        self.self_loop_log = self_loop_log[:-1]
        self.flat = FlatG(self.groups, parts, cache_bytes=GBAR_CACHE_BYTES)
        self.log_gbar: list[LogG] = self.flat.parts
        self.gbar = LinearG.of_flat(self.flat)
        self.gbar_shift = self.gbar.shifts
        self.passes = 0

    def degenerate(self) -> torch.Tensor:
        """:attr:`Support.degenerate`, on this objective's device."""
        return self.support.degenerate

    def log_weights(self, u: torch.Tensor) -> list[torch.Tensor]:
        """log w = log ḡ − 2(Bu) per tensor, shaped ``[G, O/G, I/G, 1]`` (kernel summed): dense,
        outer-product tensors included, for the sequential solver, which updates them in place."""
        u_ext = self.groups.extend(u)
        return [
            dense(lg).reshape(dp.view[:3])[..., None] - 2 * dp.exponent(u_ext)
            for lg, dp in zip(self.log_gbar, self.groups.dag_params)
        ]

    def evaluate(
        self,
        u: torch.Tensor,
        frozen: torch.Tensor | None = None,
        *,
        also: Callable[[Evaluation], torch.Tensor] | None = None,
    ) -> Evaluation:
        """F(u), log shares, ∂F/∂u and the relative KKT residual (frozen groups excluded).

        The host reads F's parts and the residual in one transfer, with whether some tensor's
        range needed the log domain; only then (extreme scales) is the pass redone exactly.
        ``also`` makes the caller's 1-d float64 values on the device from the evaluation's
        device tensors (its ``value`` and ``kkt_residual`` not yet read), and they are read in
        the same transfer (:attr:`Evaluation.also`)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        x, y = (-2 * u_ext)[self.flat.row_group], (2 * u_ext)[self.flat.col_group]
        exact_everywhere = False
        while True:
            log_rows, log_cols, between_rows, between_cols, lost = self.flat.log_sums(
                x, y, exact_everywhere=exact_everywhere
            )
            log_total = torch.logsumexp(log_rows, dim=0)
            sides = torch.cat([between_rows, between_cols])
            log_in, log_out = group_logsumexp(self.flat.side_group, sides, 2 * (H + 1)).reshape(2, H + 1)[:, :H]
            log_a, log_c = log_in + self.log_p - log_total, log_out + self.log_p - log_total
            gradient = 2 * (self.k - torch.exp(log_a) + torch.exp(log_c))
            if frozen is not None:
                gradient = torch.where(frozen, torch.zeros_like(gradient), gradient)
            residual = (
                (self.feasible_gradient(u, gradient).abs() / (2 * self.degree)).max() if H else log_total.new_zeros(())
            )
            evaluation = Evaluation(
                math.nan, log_a, log_c, gradient, math.nan, log_total, self.flat, log_rows, log_cols
            )
            values = [log_total, self.k @ u, residual, lost.to(log_total.dtype)]
            total, shift, kkt, redo, *evaluation.also = torch.cat(
                [torch.stack(values), log_total.new_zeros(0) if also is None else also(evaluation)]
            ).tolist()
            if not redo:
                break
            exact_everywhere = True
        evaluation.value, evaluation.kkt_residual = self.p * total + 2 * shift, kkt
        return evaluation

    def feasible_gradient(self, u: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        """The gradient with the components that push a group out of the box at its bound set
        to zero (the box KKT conditions); the gradient itself when there is no bound."""
        if self.bound is None:
            return gradient
        pushed_out = ((u >= self.bound) & (gradient < 0)) | ((u <= -self.bound) & (gradient > 0))
        return torch.where(pushed_out, torch.zeros_like(gradient), gradient)

    def change(self, u: torch.Tensor, current: Evaluation, step: torch.Tensor) -> float:
        """F(u + step) − F(u), accurate to the rounding of the change rather than of F.

        With down = e^{−2δ} − 1 on destinations and up = e^{2δ} − 1 on sources,
        S'/S − 1 = Σ_h down_h A_h/S + Σ_h up_h C_h/S + Σ_i down_dst(i) (w_i/S) up_src(i) (parameters
        within one group excluded), and every term is computed with expm1 and log1p.
        """
        self.passes += 1
        step_ext = self.groups.extend(step)
        down, up = torch.expm1(-2 * step_ext), torch.expm1(2 * step_ext)
        u_ext = self.groups.extend(u)
        coupling = Coupling(self, -2 * u_ext - current.log_total, 2 * u_ext)
        first = (down[:-1] * torch.exp(current.log_a - self.log_p)).sum() + (
            up[:-1] * torch.exp(current.log_c - self.log_p)
        ).sum()
        within = (torch.exp(self.self_loop_log - current.log_total) * down[:-1] * up[:-1]).sum()
        ratio, shift = torch.stack([first + coupling.bilinear(down, up) - within, self.k @ step]).tolist()
        return self.p * math.log1p(ratio) + 2 * shift


class LinearG:
    """ḡ per tensor in linear scale, e^{log ḡ − shift} (None where its range forbids linear scale):
    views into :class:`~pathcond_cli.solve.flat.FlatG`'s stacks where it keeps them (up to its cache
    budget), recomputed from log ḡ when asked for otherwise."""

    def __init__(self, log_gbar: list[LogG], shifts: list[float | None], kept: dict[int, torch.Tensor]):
        self.log_gbar = log_gbar
        self.shifts = shifts
        self.kept = kept

    @classmethod
    def of_flat(cls, flat: FlatG) -> LinearG:
        shifts: list[float | None] = [None] * len(flat.parts)
        # one host transfer for every tensor's scale
        for t, (shift, usable) in zip(
            flat.dense_tensors,
            zip(*torch.stack([flat.shift, flat.linear_usable.to(flat.shift.dtype)]).tolist())
            if flat.dense_tensors
            else [],
        ):
            shifts[t] = shift if usable else None
        kept = {
            t: bucket.linear[batch]
            for bucket in flat.buckets
            if bucket.linear is not None
            for t, batch in zip(bucket.tensors, bucket.batches)
            if shifts[t] is not None
        }
        return cls(flat.parts, shifts, kept)

    def __getitem__(self, t: int) -> torch.Tensor | None:
        if t in self.kept:
            return self.kept[t]
        shift = self.shifts[t]
        return None if shift is None else torch.sub(self.log_gbar[t], shift).exp_()

    def __len__(self) -> int:
        return len(self.shifts)

    def usable(self, t: int) -> bool:
        """Whether tensor ``t``'s range allows linear scale at all (without building it)."""
        return self.shifts[t] is not None


class Coupling:
    """The matrices W_t = ḡ_ij · e^{x_i + y_j} of every tensor, x on destination groups and y on
    source groups (``[H + 1]`` each, −inf to leave a group out), for repeated products.

    Held over :class:`~pathcond_cli.solve.flat.FlatG`'s slots as W = diag(e_rows) · M · diag(e_cols):
    M is a bucket's stacked linear ḡ when every tensor in it has the dynamic range for
    linear-scale products, otherwise the bucket's W materialised once as exp of its logs (e = 1
    on its slots); an outer-product ḡ has M all ones, its factors in the two vectors.

    Used where every entry of W is at most about 1 (w/S, or the Jacobi-scaled Hessian). Terms
    that underflow are below 1e-280 of the unit scale and do not matter. Parameters within one
    group are included: callers subtract them (their row of B is zero).
    """

    def __init__(self, objective: Objective, log_dst: torch.Tensor, log_src: torch.Tensor):
        self.objective = objective
        flat = self.flat = objective.flat
        x, y = log_dst[flat.row_group], log_src[flat.col_group]
        ranges = flat.ranges(x, y)
        present = torch.isfinite(ranges[0]) & torch.isfinite(ranges[2])
        top_x = torch.where(torch.isfinite(ranges[0]), ranges[0], 0.0)
        top_y = torch.where(torch.isfinite(ranges[2]), ranges[2], 0.0)
        scale = flat.shift + top_x + top_y
        factorised = flat.linear_safe(ranges) & (scale.abs() < SAFE_RANGE)
        e_dst = torch.exp(x[: flat.dense_rows] - top_x[flat.row_tensor] + scale[flat.row_tensor])
        e_dst = torch.where(present[flat.row_tensor], e_dst, 0.0)
        e_src = torch.exp(y[: flat.dense_cols] - top_y[flat.col_tensor])
        needs_dense = (present & ~factorised).to(torch.float64)
        #: per bucket, 1.0 where it must be materialised: read on the host by :meth:`settle`
        self.pending = needs_dense.new_zeros(len(flat.buckets)).scatter_reduce(
            0, flat.bucket_of_dense, needs_dense, "amax"
        )
        self.matrices: list[torch.Tensor | Bucket] | None = None
        self._logs = x, y
        # An outer product: the first factor scaled to peak at 1 per tensor; with no finite row
        # its peak is float64's lowest, and both factors are then exactly 0.
        outer_rows = flat.outer_row_log + x[flat.dense_rows :]
        outer_cols = flat.outer_col_log + y[flat.dense_cols :]
        peak = finite_extreme(outer_rows, flat.outer_row_tensor, len(flat.outer_tensors), "amax").clamp_min(
            torch.finfo(torch.float64).min
        )
        self.e_rows = torch.cat([e_dst, torch.exp(outer_rows - peak[flat.outer_row_tensor])])
        self.e_cols = torch.cat([e_src, torch.exp(outer_cols + peak[flat.outer_col_tensor])])

    def settle(self, materialise: list[float] | None = None) -> None:
        """Materialise the buckets that need it: ``materialise`` is :attr:`pending` read on the
        host, by a caller that reads it with its own values in one transfer; read here otherwise."""
        if self.matrices is not None:
            return
        flat, (x, y) = self.flat, self._logs
        materialise = self.pending.tolist() if materialise is None else materialise
        self.matrices = []
        for bucket, dense_bucket in zip(flat.buckets, materialise):
            if dense_bucket:
                batches = bucket.batch_count
                self.matrices.append(
                    torch.exp(
                        bucket.log_gbar
                        + x[bucket.rows].reshape(batches, -1, 1)
                        + y[bucket.cols].reshape(batches, 1, -1)
                    )
                )
                self.e_rows[bucket.rows] = 1.0
                self.e_cols[bucket.cols] = 1.0
            else:
                self.matrices.append(bucket)
        self.objective.passes += any(materialise)  # exp over the materialised tensors: about one pass

    def _matrix(self, b: int) -> torch.Tensor:
        self.settle()
        matrix = self.matrices[b]
        return matrix.linear_gbar(matrix.shift_per_batch) if isinstance(matrix, Bucket) else matrix

    def _matrices(self) -> Iterator[torch.Tensor]:
        """Each bucket's matrix when it is read: one recomputed at a time where ḡ is not kept."""
        return (self._matrix(b) for b in range(len(self.flat.buckets)))

    def row_products(self, v: torch.Tensor) -> torch.Tensor:
        """W v per row slot, ``v`` given per column slot."""
        self.settle()
        flat = self.flat
        torch.mul(self.e_cols, v, out=flat.cols_in.flat)
        flat.multiply_rows(self._matrices())
        outer = _segment_sum(flat.cols_in.outer, flat.outer_col_tensor, len(flat.outer_tensors))
        torch.index_select(outer, 0, flat.outer_row_tensor, out=flat.row_sums.outer)
        return self.e_rows * flat.row_sums.flat

    def col_products(self, v: torch.Tensor) -> torch.Tensor:
        """Wᵀ v per column slot, ``v`` given per row slot."""
        self.settle()
        flat = self.flat
        torch.mul(self.e_rows, v, out=flat.rows_in.flat)
        flat.multiply_cols(self._matrices())
        outer = _segment_sum(flat.rows_in.outer, flat.outer_row_tensor, len(flat.outer_tensors))
        torch.index_select(outer, 0, flat.outer_col_tensor, out=flat.col_sums.outer)
        return self.e_cols * flat.col_sums.flat

    def tensor_rows(self, t: int, x_src: torch.Tensor) -> torch.Tensor:
        """W_t x_src for tensor ``t`` alone (``x_src`` shaped like its sources), shaped like its destinations."""
        self.settle()
        flat, dp = self.flat, self.objective.groups.dag_params[t]
        rows, cols = flat.row_slices[t], flat.col_slices[t]
        scaled = (self.e_cols[cols] * x_src.reshape(-1)).reshape(dp.src.shape)
        if flat.dense_index[t] < 0:
            return self.e_rows[rows].reshape(dp.dst.shape) * scaled.sum()
        b = next(i for i, bucket in enumerate(flat.buckets) if t in bucket.tensors)
        bucket = flat.buckets[b]
        matrix = self._matrix(b)[bucket.batches[bucket.tensors.index(t)]]
        return self.e_rows[rows].reshape(dp.dst.shape) * torch.bmm(matrix, scaled[:, :, None])[:, :, 0]

    def bilinear(self, x_dst: torch.Tensor, x_src: torch.Tensor) -> torch.Tensor:
        """Σ_t x_dstᵀ W_t x_src (``[H + 1]`` vectors indexed by group), a 0-d tensor."""
        return x_dst[self.flat.row_group] @ self.row_products(x_src[self.flat.col_group])

    def symmetric_product(self, x: torch.Tensor) -> torch.Tensor:
        """Per group h: Σ_t (W_t x_src at h as a destination + W_tᵀ x_dst at h as a source)."""
        flat = self.flat
        out = torch.zeros_like(x).index_add_(0, flat.row_group, self.row_products(x[flat.col_group]))
        return out.index_add_(0, flat.col_group, self.col_products(x[flat.row_group]))


def _segment_sum(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    return values.new_zeros(count).index_add_(0, index, values)


def _kernel_summed(lg: LogG, dp) -> LogG:
    """A tensor's log ḡ (g summed over kernel positions), ``[G, O/G, I/G]``, or an :class:`OuterLog`
    where it is one: a Linear layer fed one vector, or a tensor with one column (a bias: its
    column factor is log 1)."""
    if isinstance(lg, OuterLog):
        return lg
    log_gbar = lg.log_gbar if isinstance(lg, GradientLog) else kernel_summed(lg.reshape(dp.view))
    if dp.view[0] == 1 and dp.view[2] == 1:
        return OuterLog(log_gbar.reshape(-1), log_gbar.new_zeros(1))
    return log_gbar


def _self_loop_logs(dp, log_gbar: LogG, size: int) -> torch.Tensor:
    """Per group (``size`` = H + 1 slots): log Σ ḡ over this tensor's parameters whose two ends
    lie in that free group (the within-group terms that ``change`` and the Hessian take out)."""
    if isinstance(log_gbar, OuterLog):
        # Σ over o, i in group h of e^{rows_o + cols_i} = (Σ_{o in h} e^{rows_o})(Σ_{i in h} e^{cols_i}).
        within = group_logsumexp(dp.dst.reshape(-1), log_gbar.rows, size) + group_logsumexp(
            dp.src.reshape(-1), log_gbar.cols, size
        )
        return torch.where(torch.arange(size, device=within.device) < size - 1, within, -torch.inf)
    masked = torch.where(dp.self_loops[..., 0], log_gbar, torch.full_like(log_gbar, -torch.inf))
    return group_logsumexp(dp.dst.reshape(-1), torch.logsumexp(masked, dim=2).reshape(-1), size)


def degenerate_mask(groups: RescalingGroups, diag: DiagG) -> torch.Tensor:
    """Free groups with A_h = 0 or C_h = 0 (no path weight in or out): F is not coercive in them.

    Depends only on which g_i are zero, so it holds for every u.
    """
    return support(groups, diag.parts).degenerate


def log_positive_root(
    log_quadratic: torch.Tensor, linear: torch.Tensor, log_linear_abs: torch.Tensor, log_constant: torch.Tensor
) -> torch.Tensor:
    """ln z for the positive root of q z² + b z − c = 0 (q, c > 0, given as logs; b signed with
    ``log_linear_abs`` = ln|b|), without cancellation and without leaving the log domain."""
    log_root = 0.5 * torch.logaddexp(2 * log_linear_abs, LOG4 + log_quadratic + log_constant)
    return torch.where(
        linear >= 0,
        LOG2 + log_constant - torch.logaddexp(log_linear_abs, log_root),
        torch.logaddexp(log_linear_abs, log_root) - LOG2 - log_quadratic,
    )


def block_step(log_a: torch.Tensor, log_c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """δ_h minimising F over u_h at fixed λ = p/S (SPEC §5): z = e^{2δ} solves c z² + k z − a = 0."""
    return 0.5 * log_positive_root(log_c, k, torch.log(k.abs()), log_a)


def paper_step(log_A, log_C, log_E, k: float, p: int) -> float:
    """The paper's exact coordinate update (Lemma 4.1): z = e^{2δ} solves
    (p + k) C z² + k E z + (k − p) A = 0, with A, C, E given as logs (floats or 0-d tensors)."""
    log_A, log_C, log_E = (torch.as_tensor(v, dtype=torch.float64) for v in (log_A, log_C, log_E))
    k_tensor = torch.tensor(float(k), dtype=torch.float64)
    log_quadratic = math.log(p + k) + log_C
    log_linear_abs = torch.log(k_tensor.abs()) + log_E
    return 0.5 * float(log_positive_root(log_quadratic, k_tensor, log_linear_abs, math.log(p - k) + log_A))
