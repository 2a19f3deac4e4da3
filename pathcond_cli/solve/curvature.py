"""F's Hessian as an operator, and the Newton step it gives (SPEC §4–§5).

    ∇²F(u) = (4p/S) · Bᵀ diag(w) B − (4p/S²) · (Bᵀw)(Bᵀw)ᵀ = 4 (L − r rᵀ / p)

with L = (p/S) Bᵀ diag(w) B, a weighted graph Laplacian over the groups (each weight couples
its destination and source groups, a bias couples its group to the fixed ground), and
r = a − c the per-group shares. L's diagonal is d = a + c; its off-diagonal part is, per
tensor, the coupling block (p/S) ḡ_ij e^{−2u_dst(i)} e^{2u_src(j)}, so a product with it is
two batched mat-vecs per tensor: the cost of one gradient pass.

The Newton system is solved in Jacobi-scaled form, (M − r̂ r̂ᵀ/p) y = −ĝ/4 with
M = D^{−1/2} L D^{−1/2} (D = diag(d) plus damping; unit diagonal, every entry in [−1, 1]), r̂ = D^{−1/2} r,
ĝ = D^{−1/2} ∇F and δ = D^{−1/2} y: the scaled entries stay in range whatever the spread of w
over hundreds of decades, and conjugate gradients on it is diagonally preconditioned CG on
the Hessian. Diagonal scaling alone leaves the slow modes of a deep network's Laplacian
(smooth in depth, about constant over a layer): on MnasNet-style networks CG then needs 20–40
products per Newton step. A coarse correction over layer aggregates
(:class:`CoarseCorrection`) removes them: 1–7 products per step, 317 → 115 passes in all.
"""

from __future__ import annotations

import torch

from .objective import Coupling, Evaluation, Objective, group_logsumexp


class ScaledHessian:
    """(M − r̂ r̂ᵀ / p) restricted to the ``active`` groups at one point u, Levenberg-damped.

    Far from u*, F is nearly linear in groups whose weights are in the exponential tail (d_h
    tiny, gradient ≈ 2k_h): a pure Newton step would move them by millions and the line search
    would then shrink every other group's step with them. Each group's curvature is raised by
    |∂F/∂u_h| / ``reach`` (÷4: the Hessian is 4L), which caps its move near ``reach`` while the
    gradient is large and vanishes as it goes to zero (quadratic convergence is kept, as in
    Levenberg–Marquardt with damping proportional to the gradient).
    """

    def __init__(self, objective: Objective, u: torch.Tensor, current: Evaluation, active: torch.Tensor, reach: float):
        self.objective = objective
        self.active = active
        log_damping = torch.log(current.gradient.abs() / (4 * reach))
        log_d = torch.logaddexp(torch.logaddexp(current.log_a, current.log_c), log_damping)
        log_d = torch.where(active, log_d, torch.zeros_like(log_d))
        self.inverse_sqrt_d = torch.exp(-0.5 * log_d) * active
        self.shares_difference = (current.a - current.c) * self.inverse_sqrt_d
        half_share = 0.5 * (objective.log_p - current.log_total)
        excluded = torch.full((1,), -torch.inf, dtype=u.dtype, device=u.device)
        scaled_log_d = torch.where(active, -0.5 * log_d + half_share, torch.full_like(log_d, -torch.inf))
        self.coupling = Coupling(
            objective, torch.cat([-2 * u + scaled_log_d, excluded]), torch.cat([2 * u + scaled_log_d, excluded])
        )
        self.within = torch.exp(objective.self_loop_log + objective.log_p - current.log_total - log_d) * active
        self.log_d = torch.where(active, log_d, torch.full_like(log_d, -torch.inf))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.objective.passes += 1
        off_diagonal = self.coupling.symmetric_product(self.objective.groups.extend(x))[:-1]
        rank_one = self.shares_difference * (self.shares_difference @ x) / self.objective.p
        return (x - off_diagonal + 2 * self.within * x - rank_one) * self.active


class LayerAggregates:
    """A partition of the free groups by the layer that names them (a residual stream's
    channels share the name of its first layer), and, per tensor, which side of it lies in a
    single aggregate. Built once per solve, from the flat slots in one host transfer."""

    def __init__(self, objective: Objective):
        groups, flat = objective.groups, objective.flat
        names = [label.rsplit(":", 1)[0] for label in groups.labels]
        index = {name: i for i, name in enumerate(dict.fromkeys(names))}
        self.count = len(index)
        self.of_group = torch.tensor(
            [index[n] for n in names] + [self.count], dtype=torch.long, device=objective.device
        )
        tensors, size = len(groups.dag_params), self.count + 1
        source_pairs = torch.unique(flat.col_owner * size + self.of_group[flat.col_group])
        destination_pairs = torch.unique(flat.row_owner * size + self.of_group[flat.row_group])
        source_sets: list[set[int]] = [set() for _ in range(tensors)]
        destination_counts = [0] * tensors
        for key in torch.cat([source_pairs, destination_pairs + tensors * size]).tolist():
            if key < tensors * size:
                source_sets[key // size].add(key % size)
            else:
                destination_counts[key // size - tensors] += 1
        self.sources = [sorted(aggregates - {self.count}) for aggregates in source_sets]
        self.single_source = [len(aggregates) == 1 for aggregates in source_sets]
        self.single_destination = [count == 1 for count in destination_counts]
        self.has_sources, self.single_source_mask, self.single_destination_mask = (
            torch.tensor(flags, dtype=torch.bool, device=objective.device)
            for flags in ([bool(sources) for sources in self.sources], self.single_source, self.single_destination)
        )


class CoarseCorrection:
    """Two-level preconditioner for the scaled system: P⁻¹ = I + Z E⁻¹ Zᵀ, E = Zᵀ(M − r̂r̂ᵀ/p)Z.

    Z holds one column per layer aggregate, ∝ sqrt(d_h) on its groups and of unit norm (a
    constant shift of u over the layer): the slowly varying modes across depth that make CG on
    a deep network's Laplacian slow. With n_I² = Σ_{h∈I} d_h, E's coupling between aggregates I
    and J is Σ_{i∈I, j∈J} (p/S) w_ij / (n_I n_J): a block sum of w, which the evaluation at the
    same point already holds as per-tensor row sums (a tensor whose sources lie in one
    aggregate) or column sums (destinations in one aggregate), summed into E for every tensor
    at once over the flat slots. Only a tensor with neither, or whose inactive groups carry
    weight on the summed side, needs products with its coupling matrix (about one pass,
    counted). E is factorised once; if rounding leaves it indefinite, no correction is used.

    Built in two steps, so that a caller can read :attr:`flags` (which tensors need products,
    which coupling buckets are materialised) with its own values in one host transfer: the
    constructor's device work, then :meth:`settle` with the flags read (read there otherwise).
    """

    def __init__(self, hessian: ScaledHessian, aggregates: LayerAggregates, current: Evaluation):
        objective = hessian.objective
        flat = objective.flat
        self.aggregates = aggregates
        n = aggregates.count
        agg = aggregates.of_group[:-1]
        log_norm = group_logsumexp(agg, hessian.log_d, n)
        self.basis = torch.where(hessian.active, torch.exp(0.5 * (hessian.log_d - log_norm[agg])), 0.0)
        # (p/S)^{1/2} / n_I per group, so that a block sum times the two sides' factors is E's entry
        half_scale = torch.where(
            torch.isfinite(log_norm), 0.5 * (objective.log_p - current.log_total - log_norm), -torch.inf
        )
        half_ext = torch.cat([half_scale, half_scale.new_full((1,), -torch.inf)])[aggregates.of_group]
        active_ext = objective.groups.extend(hessian.active.to(torch.float64)) > 0
        of_group = aggregates.of_group
        # Per tensor: whether its inactive source groups carry no weight (so its row sums hold
        # only active columns), the same for destinations, and whether any group on each side is active.
        row_active, col_active = active_ext[flat.row_group], active_ext[flat.col_group]
        tensors = len(objective.groups.dag_params)
        silent_sources = _all_per_tensor(col_active | torch.isneginf(current.log_cols), flat.col_owner, tensors)
        silent_destinations = _all_per_tensor(row_active | torch.isneginf(current.log_rows), flat.row_owner, tensors)
        present = ~_all_per_tensor(~row_active, flat.row_owner, tensors) & ~_all_per_tensor(
            ~col_active, flat.col_owner, tensors
        )
        by_rows = aggregates.single_source_mask & silent_sources
        by_cols = ~by_rows & aggregates.single_destination_mask & silent_destinations
        row_blocks = torch.where(
            by_rows[flat.row_owner],
            torch.exp(current.log_rows + half_ext[flat.row_group] + half_ext[flat.row_first_source]) * row_active,
            0.0,
        )
        col_blocks = torch.where(
            by_cols[flat.col_owner],
            torch.exp(current.log_cols + half_ext[flat.col_group] + half_ext[flat.col_first_destination]) * col_active,
            0.0,
        )
        coarse = torch.zeros((n + 1) * (n + 1), dtype=torch.float64, device=objective.device).index_add_(
            0,
            torch.cat(
                [
                    of_group[flat.row_group] * (n + 1) + of_group[flat.row_first_source],
                    of_group[flat.col_first_destination] * (n + 1) + of_group[flat.col_group],
                ]
            ),
            -torch.cat([row_blocks, col_blocks]),
        )
        #: which tensors need products, and which coupling buckets are materialised, unread
        self.flags = torch.cat(
            [(aggregates.has_sources & present & ~by_rows & ~by_cols).to(torch.float64), hessian.coupling.pending]
        )
        self._hessian, self._coarse, self._log_norm = hessian, coarse, log_norm
        self._settled = False

    def settle(self, flags: list[float] | None = None) -> None:
        """Finish E with :attr:`flags` as read on the host (read here when not given) and factorise it."""
        if self._settled:
            return
        self._settled = True
        hessian, coarse, log_norm = self._hessian, self._coarse, self._log_norm
        objective, aggregates = hessian.objective, self.aggregates
        n, agg, of_group = aggregates.count, aggregates.of_group[:-1], aggregates.of_group
        basis_ext = objective.groups.extend(self.basis)
        tensors = len(objective.groups.dag_params)
        flags = self.flags.tolist() if flags is None else flags
        hessian.coupling.settle(flags[tensors:])
        by_products = [t for t, flag in enumerate(flags[:tensors]) if flag]
        for t in by_products:
            dp = objective.groups.dag_params[t]
            dst_agg = of_group[dp.dst]
            for j in aggregates.sources[t]:
                rows = hessian.coupling.tensor_rows(t, (basis_ext * (of_group == j))[dp.src]) * basis_ext[dp.dst]
                coarse.index_add_(0, (dst_agg * (n + 1) + j).reshape(-1), -rows.reshape(-1))
        objective.passes += bool(by_products)
        coarse = coarse.reshape(n + 1, n + 1)[:-1, :-1]
        coarse = coarse + coarse.T
        diagonal = torch.zeros(n, dtype=torch.float64, device=objective.device)
        diagonal.index_add_(0, agg, self.basis**2 * (1 + 2 * hessian.within))
        empty = ~torch.isfinite(log_norm)
        coarse += torch.diag(torch.where(empty, torch.ones_like(diagonal), diagonal))
        shares = torch.zeros(n, dtype=torch.float64, device=objective.device).index_add(
            0, agg, self.basis * hessian.shares_difference
        )
        coarse -= torch.outer(shares, shares) / objective.p
        self.factor, info = torch.linalg.cholesky_ex(coarse)
        # decided on the device: reading it would cost a host synchronisation per Newton step
        self.factorised = (info == 0) & torch.isfinite(self.factor).all()
        del self._hessian, self._coarse, self._log_norm

    @property
    def usable(self) -> bool:
        self.settle()
        return bool(self.factorised)

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        self.settle()
        agg = self.aggregates.of_group[:-1]
        projected = torch.zeros(self.aggregates.count, dtype=residual.dtype, device=residual.device)
        projected.index_add_(0, agg, self.basis * residual)
        solved = torch.cholesky_solve(projected[:, None], self.factor)[:, 0]
        return torch.where(self.factorised, residual + self.basis * solved[agg], residual)


def _all_per_tensor(flags: torch.Tensor, owner: torch.Tensor, tensors: int) -> torch.Tensor:
    """Per tensor: whether ``flags`` holds on every one of its slots."""
    # as bytes: CUDA has no scatter reductions of booleans
    as_bytes = flags.to(torch.uint8)
    return as_bytes.new_ones(tensors).scatter_reduce(0, owner, as_bytes, "amin").bool()


def newton_direction(
    hessian: ScaledHessian, gradient: torch.Tensor, forcing: float, max_steps: int, preconditioner=None
) -> torch.Tensor:
    """An inexact Newton step δ ≈ −∇²F⁻¹ ∇F on the active groups (zero elsewhere).

    Truncated (preconditioned) conjugate gradients from 0 on the scaled system, stopped when the residual falls
    below ``forcing`` times its start, after ``max_steps`` products, or on non-positive
    curvature (rounding only: F is convex). The result is always a descent direction.
    """
    precondition = preconditioner or (lambda r: r)
    rhs = -0.25 * gradient * hessian.inverse_sqrt_d
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    preconditioned = precondition(residual)
    direction = preconditioned.clone()
    residual_dot = residual @ preconditioned
    start_norm2 = residual @ residual
    for _ in range(max_steps):
        product = hessian(direction)
        curvature = direction @ product
        step = residual_dot / curvature
        next_residual = residual - step * product
        # the curvature, the new residual's norm and the first one in one host transfer
        curvature_value, residual_norm2, start_value = torch.stack(
            [curvature, next_residual @ next_residual, start_norm2]
        ).tolist()
        if curvature_value <= 0:
            break
        solution += step * direction
        residual = next_residual
        if residual_norm2 <= forcing**2 * start_value:
            break
        preconditioned = precondition(residual)
        new_dot = residual @ preconditioned
        direction = preconditioned + (new_dot / residual_dot) * direction
        residual_dot = new_dot
    solution = torch.where(solution.abs().max() > 0, solution, rhs)
    return solution * hessian.inverse_sqrt_d
