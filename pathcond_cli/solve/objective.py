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
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch

from ..engine.diag import DiagG, LogG, OuterLog, dense, zero_count
from ..engine.groups import RescalingGroups

LOG2 = math.log(2.0)
LOG4 = math.log(4.0)
SAFE_RANGE = 650.0
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
    are finite), never expanded, and never a float64 copy of the network."""
    size = 0

    def indicators():
        nonlocal size
        for lg in log_g:
            size += lg.numel() - zero_count(lg)
            yield (torch.isfinite(lg.rows), torch.isfinite(lg.cols)) if isinstance(lg, OuterLog) else torch.isfinite(lg)

    n_in, n_out = groups.incidence_sums(indicators())
    return Support(size, n_in, n_out)


@dataclass
class Evaluation:
    """F(u) and, per free group, the shares a_h = p·A_h/S and c_h = p·C_h/S, kept as logs
    (``log_a``, ``log_c``) because they can lie far outside float64's range. Per tensor, the
    logs of the row sums ``[G, O/G]`` and column sums ``[G, I/G]`` of w (self-loops included)
    they came from, which the Newton solver's coarse correction aggregates by layer."""

    value: float
    log_a: torch.Tensor
    log_c: torch.Tensor
    gradient: torch.Tensor
    kkt_residual: float
    log_total: torch.Tensor
    tensor_log_rows: list[torch.Tensor]
    tensor_log_cols: list[torch.Tensor]

    @property
    def a(self) -> torch.Tensor:
        return torch.exp(self.log_a)

    @property
    def c(self) -> torch.Tensor:
        return torch.exp(self.log_c)


class Objective:
    """F for one network, on one device. Counts its passes over the parameters.

    Because w_i = g_i · e^{−2u_dst} · e^{2u_src} factorises, g is summed over kernel positions
    once (ḡ, shape ``[G, O/G, I/G]``) and a pass is two batched matrix–vector products per
    tensor: row sums give A, column sums give C, their total gives S. The products run in
    linear scale only when the tensor's dynamic range (of ḡ and of e^{2u}) guarantees that no
    positive term underflows; otherwise that tensor is reduced exactly with logsumexp. Sums
    across tensors and groups are log-sum-exp, so nothing overflows or underflows.
    """

    def __init__(self, groups: RescalingGroups, diag: DiagG, *, device: torch.device | str = "cpu",
                 bound: float | None = None):
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
        self.log_gbar: list[LogG] = []
        self.gbar = LinearG(self.log_gbar, cache_bytes=GBAR_CACHE_BYTES)
        self.gbar_shift: list[float | None] = []
        self.gbar_range: list[float | None] = []
        self_loop_log = torch.full((groups.num_free + 1,), -torch.inf, dtype=torch.float64, device=self.device)
        for lg, dp in zip(diag.parts, self.groups.dag_params):
            if isinstance(lg, OuterLog):
                # A kernel of one: ḡ is g, kept as its factors; every product with it is exact in
                # the log domain at O(O + I), so it has no linear-scale form (and no shift or range).
                log_gbar = lg.to(self.device)
                shift = spread = None
                self.log_gbar.append(log_gbar)
                self.gbar.add(None)
            else:
                lg = lg.to(self.device).reshape(dp.view)
                # A kernel of one needs no sum (logsumexp of one term is that term, bit for bit):
                # ḡ is then a view of log g, not a second parameter-sized copy.
                log_gbar = lg[..., 0] if dp.view[3] == 1 else torch.logsumexp(lg, dim=3)
                finite = log_gbar[torch.isfinite(log_gbar)]
                shift = float(finite.max()) if finite.numel() else 0.0
                spread = shift - float(finite.min()) if finite.numel() else 0.0
                self.log_gbar.append(log_gbar)
                self.gbar.add(shift if spread < SAFE_RANGE else None)
            self.gbar_shift.append(shift)
            self.gbar_range.append(spread)
            if dp.self_loops is not None:
                self_loop_log = torch.logaddexp(self_loop_log, _self_loop_logs(dp, log_gbar, groups.num_free + 1))
        self.self_loop_log = self_loop_log[:-1]
        self.passes = 0

    def degenerate(self) -> torch.Tensor:
        """:attr:`Support.degenerate`, on this objective's device."""
        return self.support.degenerate

    def log_weights(self, u: torch.Tensor) -> list[torch.Tensor]:
        """log w = log ḡ − 2(Bu) per tensor, shaped ``[G, O/G, I/G, 1]`` (kernel summed): dense,
        outer-product tensors included, for the sequential solver, which updates them in place."""
        u_ext = self.groups.extend(u)
        return [dense(lg).reshape(dp.view[:3])[..., None] - 2 * dp.exponent(u_ext)
                for lg, dp in zip(self.log_gbar, self.groups.dag_params)]

    def tensor_ranges(self, log_dst: torch.Tensor, log_src: torch.Tensor) -> list[list[float]]:
        """Per tensor: largest and smallest finite ``log_dst`` over its destination groups and
        ``log_src`` over its sources (±inf when none is finite), fetched in one transfer so that
        a pass costs a single host–device synchronisation."""
        bounds = []
        for dp in self.groups.dag_params:
            dst, src = log_dst[dp.dst], log_src[dp.src]
            bounds.append(torch.stack([_finite_max(dst), _finite_min(dst), _finite_max(src), _finite_min(src)]))
        return torch.stack(bounds).tolist() if bounds else []

    def linear_scale(self, t: int, ranges: list[float]) -> float | None:
        """The log scale for tensor ``t``'s linear-scale products, or None when its dynamic range
        (of ḡ and of the two factors) could make a positive term underflow."""
        top_dst, low_dst, top_src, low_src = ranges
        if not self.gbar.usable(t) or self.gbar_range[t] + max(top_dst - low_dst, top_src - low_src) >= SAFE_RANGE:
            return None
        return self.gbar_shift[t] + top_dst + top_src

    def _tensor_sums(self, t: int, log_dst: torch.Tensor, log_src: torch.Tensor,
                     ranges: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """log of the row sums ``[G, O/G]`` and column sums ``[G, I/G]`` of w for tensor ``t``."""
        log_gbar = self.log_gbar[t]
        if isinstance(log_gbar, OuterLog):
            # w = (ḡ_rows e^{dst}) ⊗ (ḡ_cols e^{src}): each sum is one factor times the other's total.
            log_rows, log_cols = log_gbar.shifted(log_dst, log_src)
            return (log_rows + torch.logsumexp(log_cols, dim=1, keepdim=True),
                    log_cols + torch.logsumexp(log_rows, dim=1, keepdim=True))
        scale = self.linear_scale(t, ranges)
        if scale is not None:
            e_dst, e_src = torch.exp(log_dst - ranges[0]), torch.exp(log_src - ranges[2])
            gbar = self.gbar[t]
            rows = e_dst * torch.bmm(gbar, e_src[:, :, None])[:, :, 0]
            cols = e_src * torch.bmm(e_dst[:, None, :], gbar)[:, 0, :]
            return torch.log(rows) + scale, torch.log(cols) + scale
        log_w = log_gbar + log_dst[:, :, None] + log_src[:, None, :]
        return torch.logsumexp(log_w, dim=2), torch.logsumexp(log_w, dim=1)

    def _sums_between_groups(self, t: int, log_dst: torch.Tensor,
                             log_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_tensor_sums` without the parameters whose two ends lie in one free group, summed
        without them rather than subtracted: a group's self-loops may outweigh the rest of its
        weight by more than float64 resolves, and a difference would then be rounding."""
        dp, log_gbar = self.groups.dag_params[t], self.log_gbar[t]
        if isinstance(log_gbar, OuterLog):
            log_rows, log_cols = log_gbar.shifted(log_dst, log_src)
            size = self.groups.num_free + 1
            return (log_rows + _other_groups(group_logsumexp(dp.src.reshape(-1), log_cols.reshape(-1), size), dp.dst),
                    log_cols + _other_groups(group_logsumexp(dp.dst.reshape(-1), log_rows.reshape(-1), size), dp.src))
        log_w = (log_gbar + log_dst[:, :, None] + log_src[:, None, :]).masked_fill(dp.self_loops[..., 0], -torch.inf)
        return torch.logsumexp(log_w, dim=2), torch.logsumexp(log_w, dim=1)

    def evaluate(self, u: torch.Tensor, frozen: torch.Tensor | None = None) -> Evaluation:
        """F(u), log shares, ∂F/∂u and the relative KKT residual (frozen groups excluded)."""
        self.passes += 1
        H = self.groups.num_free
        u_ext = self.groups.extend(u)
        row_logs, col_logs, between_rows, between_cols, dst_index, src_index = [], [], [], [], [], []
        ranges = self.tensor_ranges(-2 * u_ext, 2 * u_ext)
        for t, dp in enumerate(self.groups.dag_params):
            log_dst, log_src = -2 * u_ext[dp.dst], 2 * u_ext[dp.src]
            rows, cols = self._tensor_sums(t, log_dst, log_src, ranges[t])
            row_logs.append(rows)
            col_logs.append(cols)
            if dp.self_loops is not None:
                rows, cols = self._sums_between_groups(t, log_dst, log_src)
            between_rows.append(rows.reshape(-1))
            between_cols.append(cols.reshape(-1))
            dst_index.append(dp.dst.reshape(-1))
            src_index.append(dp.src.reshape(-1))
        log_total = torch.logsumexp(torch.cat([r.reshape(-1) for r in row_logs]), dim=0)
        log_in = group_logsumexp(torch.cat(dst_index), torch.cat(between_rows), H + 1)[:H]
        log_out = group_logsumexp(torch.cat(src_index), torch.cat(between_cols), H + 1)[:H]
        log_a, log_c = log_in + self.log_p - log_total, log_out + self.log_p - log_total
        value = self.p * float(log_total) + 2 * float(self.k @ u)
        gradient = 2 * (self.k - torch.exp(log_a) + torch.exp(log_c))
        if frozen is not None:
            gradient = torch.where(frozen, torch.zeros_like(gradient), gradient)
        residual = float((self.feasible_gradient(u, gradient).abs() / (2 * self.degree)).max()) if H else 0.0
        return Evaluation(value, log_a, log_c, gradient, residual, log_total, row_logs, col_logs)

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
        first = (down[:-1] * torch.exp(current.log_a - self.log_p)).sum() + (up[:-1] * torch.exp(current.log_c - self.log_p)).sum()
        within = (torch.exp(self.self_loop_log - current.log_total) * down[:-1] * up[:-1]).sum()
        ratio = first + coupling.bilinear(down, up) - within
        return self.p * math.log1p(float(ratio)) + 2 * float(self.k @ step)


class LinearG:
    """ḡ per tensor in linear scale, e^{log ḡ − shift} (None where its range forbids linear scale).

    Kept in memory while the kept tensors total at most ``cache_bytes``; past that, each
    is recomputed from log ḡ when asked for (the same numbers, one tensor at a time), so a
    network too large for a second float64 copy of its parameters still solves, at the
    cost of one exp per element per pass.
    """

    def __init__(self, log_gbar: list[torch.Tensor], *, cache_bytes: int):
        self.log_gbar = log_gbar
        self.shifts: list[float | None] = []
        self.kept: dict[int, torch.Tensor] = {}
        self.room = cache_bytes

    def add(self, shift: float | None) -> None:
        """Register the tensor just appended to ``log_gbar`` (``shift`` None: log scale only)."""
        t = len(self.shifts)
        self.shifts.append(shift)
        if shift is None:
            return
        size = self.log_gbar[t].numel() * self.log_gbar[t].element_size()
        if size <= self.room:
            self.kept[t] = self[t]
            self.room -= size

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
    Each is kept as ``(e_dst, e_src, matrix)``, W = diag(e_dst) · matrix() · diag(e_src), where
    ``matrix`` None stands for all ones (an outer-product ḡ: its factors are in the two vectors).

    Used where every entry of W is at most about 1 (w/S, or the Jacobi-scaled Hessian): a tensor
    is kept factorised (ḡ and two vectors) when its dynamic range allows linear-scale products,
    otherwise materialised once as exp of its logs. Terms that underflow are below 1e-280 of the
    unit scale and do not matter. Parameters within one group are included: callers subtract
    them (their row of B is zero).
    """

    def __init__(self, objective: Objective, log_dst: torch.Tensor, log_src: torch.Tensor):
        self.objective = objective
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        materialised = False
        for t, (dp, ranges) in enumerate(zip(objective.groups.dag_params, objective.tensor_ranges(log_dst, log_src))):
            if not (math.isfinite(ranges[0]) and math.isfinite(ranges[2])):
                self.parts.append(None)
                continue
            dst, src = log_dst[dp.dst], log_src[dp.src]
            log_gbar = objective.log_gbar[t]
            if isinstance(log_gbar, OuterLog):
                # W = e^{rows + dst} ⊗ e^{cols + src}, the first factor scaled to peak at 1. The peak
                # stays on the device (no sync per tensor); with no finite row it is float64's
                # lowest, and both factors are then exactly 0.
                log_rows, log_cols = log_gbar.shifted(dst, src)
                peak = _finite_max(log_rows).clamp_min(torch.finfo(torch.float64).min)
                self.parts.append((torch.exp(log_rows - peak), torch.exp(log_cols + peak), None))
                continue
            scale = objective.linear_scale(t, ranges)
            if scale is not None and abs(scale) < SAFE_RANGE:
                e_dst = torch.exp(dst - ranges[0]) * math.exp(scale)
                self.parts.append((e_dst, torch.exp(src - ranges[2]), partial(objective.gbar.__getitem__, t)))
            else:
                dense = torch.exp(objective.log_gbar[t] + dst[:, :, None] + src[:, None, :])
                materialised = True
                ones_dst, ones_src = torch.ones_like(dst), torch.ones_like(src)
                self.parts.append((ones_dst, ones_src, partial(_itself, dense)))
        objective.passes += materialised  # exp over the materialised tensors: about one pass

    def rows(self, part, x_src: torch.Tensor) -> torch.Tensor:
        e_dst, e_src, matrix = part
        return e_dst * _times(matrix, e_src * x_src)

    def bilinear(self, x_dst: torch.Tensor, x_src: torch.Tensor) -> torch.Tensor:
        """Σ_t x_dstᵀ W_t x_src (``[H + 1]`` vectors indexed by group), a 0-d tensor."""
        total = x_dst.new_zeros(())
        for dp, part in zip(self.objective.groups.dag_params, self.parts):
            if part is not None:
                total = total + (x_dst[dp.dst] * self.rows(part, x_src[dp.src])).sum()
        return total

    def symmetric_product(self, x: torch.Tensor) -> torch.Tensor:
        """Per group h: Σ_t (W_t x_src at h as a destination + W_tᵀ x_dst at h as a source)."""
        out = torch.zeros_like(x)
        for dp, part in zip(self.objective.groups.dag_params, self.parts):
            if part is None:
                continue
            e_dst, e_src, matrix = part
            out.index_add_(0, dp.dst.reshape(-1), self.rows(part, x[dp.src]).reshape(-1))
            cols = e_src * _times_transposed(matrix, e_dst * x[dp.dst])
            out.index_add_(0, dp.src.reshape(-1), cols.reshape(-1))
        return out


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _times(matrix, x: torch.Tensor) -> torch.Tensor:
    """matrix() · x per conv group (``[G, O/G, I/G]`` by ``[G, I/G]``); None is all ones."""
    return x.sum(1, keepdim=True) if matrix is None else torch.bmm(matrix(), x[:, :, None])[:, :, 0]


def _times_transposed(matrix, x: torch.Tensor) -> torch.Tensor:
    """matrix()ᵀ · x per conv group (``[G, O/G]`` in, ``[G, I/G]`` out); None is all ones."""
    return x.sum(1, keepdim=True) if matrix is None else torch.bmm(x[:, None, :], matrix())[:, 0, :]


def _self_loop_logs(dp, log_gbar: LogG, size: int) -> torch.Tensor:
    """Per group (``size`` = H + 1 slots): log Σ ḡ over this tensor's parameters whose two ends
    lie in that free group (the within-group terms that ``change`` and the Hessian take out)."""
    if isinstance(log_gbar, OuterLog):
        # Σ over o, i in group h of e^{rows_o + cols_i} = (Σ_{o in h} e^{rows_o})(Σ_{i in h} e^{cols_i}).
        within = (group_logsumexp(dp.dst.reshape(-1), log_gbar.rows, size)
                  + group_logsumexp(dp.src.reshape(-1), log_gbar.cols, size))
        return torch.where(torch.arange(size, device=within.device) < size - 1, within, -torch.inf)
    masked = torch.where(dp.self_loops[..., 0], log_gbar, torch.full_like(log_gbar, -torch.inf))
    return group_logsumexp(dp.dst.reshape(-1), torch.logsumexp(masked, dim=2).reshape(-1), size)


def _finite_max(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, -torch.inf)).amax()


def _finite_min(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, torch.inf)).amin()


def _other_groups(log_by_group: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per entry of ``groups`` (indices into ``log_by_group``, ``[H + 1]``, the last the fixed slot):
    log Σ over every other slot of exp(log_by_group), or over all of them for the fixed slot,
    which has no self-loops. Prefix and suffix log-sums, so nothing is subtracted."""
    none = log_by_group.new_full((1,), -torch.inf)
    before = torch.cat([none, torch.logcumsumexp(log_by_group, 0)[:-1]])
    after = torch.cat([torch.logcumsumexp(log_by_group.flip(0), 0).flip(0)[1:], none])
    others = torch.logaddexp(before, after)
    others[-1] = torch.logsumexp(log_by_group, 0)
    return others[groups]


def group_logsumexp(index: torch.Tensor, log_values: torch.Tensor, size: int) -> torch.Tensor:
    """log Σ exp(values) per group index (``size`` groups), −inf for groups with no entry."""
    peak = torch.full((size,), -torch.inf, dtype=log_values.dtype, device=log_values.device)
    peak = peak.scatter_reduce(0, index, log_values, "amax")
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    summed = torch.zeros_like(peak).index_add(0, index, torch.exp(log_values - safe_peak[index]))
    return torch.log(summed) + safe_peak


def degenerate_mask(groups: RescalingGroups, diag: DiagG) -> torch.Tensor:
    """Free groups with A_h = 0 or C_h = 0 (no path weight in or out): F is not coercive in them.

    Depends only on which g_i are zero, so it holds for every u.
    """
    return support(groups, diag.parts).degenerate


def log_positive_root(log_quadratic: torch.Tensor, linear: torch.Tensor, log_linear_abs: torch.Tensor,
                      log_constant: torch.Tensor) -> torch.Tensor:
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
