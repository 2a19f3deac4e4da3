"""The Newton solver's starting point: F minimised over layer shifts (SPEC §4, restricted).

On networks whose optimum lies far from u = 0 (‖u*‖∞ ≈ 90 on MnasNet- and Inception-style
networks) almost all of that distance is a shift that is constant over each layer and varies
with depth. Newton steps damped to a few units per group spend 20–30 iterations travelling
it; the restriction of F to those shifts finds it directly.

With u_h = c_{L(h)} for the layer aggregate L(h) of every free group (frozen groups stay at 0,
like the fixed ground), every parameter's exponent depends only on the pair (L(dst), L(src)):

    F(Zc) = p · ln Σ_{I,J} S_IJ e^{−2(c_I − c_J)} + 2 Σ_I K_I c_I,

with S_IJ the sum of ḡ over the parameters from aggregate J into aggregate I and K_I the sum
of k over I's free groups. That is the same objective on a network of a few hundred pairs:
one pass over ḡ builds it, and a damped Newton method minimises it in milliseconds. Only the
pairs that occur are held, and each Newton system (a weighted graph Laplacian of the pairs, a
rank-one term and a diagonal) is solved by a sparse LU factorisation: memory and time grow
with the number of pairs, not with the square or the cube of the number of layers, so a
3,000-layer chain costs a fraction of a second per step. F(Zc*) is exact, so the solver takes
the point only if it lowers F.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ..engine.log_g import OuterLog
from .objective import Objective, group_logsumexp

#: per-variable damping |∂F/∂c_I| / REACH caps a step near REACH while far from the optimum
REACH = 10.0
# At least this many Newton iterations, and one per layer aggregate: on a deep thin chain the
# shifts grow with depth (~2,000 over 3,000 one-unit layers) and the damped steps travel about
# REACH / 2 per iteration (394 iterations there).
MAX_ITERATIONS = 200
ARMIJO = 1e-4
MIN_STEP = 1e-10
# Unknowns up to which a Newton step's bordered system is solved dense (LU of at most 512²:
# milliseconds) rather than by scipy's sparse LU, which takes 0.25 s to load: most networks'
# layer aggregates number in the tens or hundreds; a deep thin chain's in the thousands.
DENSE_SYSTEM_MAX = 512


def layer_shift_start(
    objective: Objective, layer_of_group: torch.Tensor, count: int, frozen: torch.Tensor
) -> torch.Tensor:
    """u with u_h = c*_{L(h)} (0 on frozen groups): the minimiser of F over layer shifts.

    ``layer_of_group`` maps each of the H + 1 extended groups (the last is the ground) to its
    aggregate in ``range(count)``, the ground to ``count``. Costs one pass over ḡ (counted).
    """
    objective.passes += 1
    flat = objective.flat
    aggregate = layer_of_group.clone()
    aggregate[:-1][frozen] = count
    size = count + 1
    # A tensor whose sources lie in one aggregate adds its rows' sums of ḡ to one block each,
    # taken for every such tensor at once over the flat slots; the others, per source aggregate.
    zeros_rows, zeros_cols = (
        flat.row_group.new_zeros(flat.row_group.shape, dtype=torch.float64),
        flat.col_group.new_zeros(flat.col_group.shape, dtype=torch.float64),
    )
    # log Σ_j ḡ_ij per row slot (the sums of w at u = 0), redone in the log domain when some
    # tensor's range forbids linear scale: that flag is read with the tensors' source aggregates
    log_rows, _, _, _, lost = flat.log_sums(zeros_rows, zeros_cols)
    *source_pairs, redo = torch.cat(
        [torch.unique(flat.col_owner * size + aggregate[flat.col_group]), lost.long().reshape(1)]
    ).tolist()
    if redo:
        log_rows = flat.log_sums(zeros_rows, zeros_cols, exact_everywhere=True)[0]
    source_counts = Counter(key // size for key in source_pairs)
    several = [t for t, sources in source_counts.items() if sources > 1]
    single = torch.ones(len(objective.groups.dag_params), dtype=torch.bool, device=objective.device)
    single[several] = False
    blocks = [aggregate[flat.row_group] * size + aggregate[flat.row_first_source]]
    log_rows = [torch.where(single[flat.row_owner], log_rows, -torch.inf)]
    for t in several:
        dp = objective.groups.dag_params[t]
        sources, local = torch.unique(aggregate[dp.src], return_inverse=True)
        log_rows.append(_log_rows_by_source(objective, t, local, len(sources)).reshape(-1))
        blocks.append((aggregate[dp.dst][:, :, None] * size + sources).reshape(-1))
    pairs, slot = torch.unique(torch.cat(blocks), return_inverse=True)
    log_blocks = group_logsumexp(slot, torch.cat(log_rows), len(pairs))
    shift_k = torch.zeros(size, dtype=torch.float64, device=objective.device).index_add(0, aggregate[:-1], objective.k)[
        :count
    ]
    # one unknown per layer: solved on the CPU whatever the device, without a sync per step;
    # the blocks, their pairs (exact in float64) and the layers' k in one transfer
    on_host = torch.cat([log_blocks, pairs.to(torch.float64), shift_k]).cpu()
    log_blocks, pairs, shift_k = (
        on_host[: len(pairs)],
        on_host[len(pairs) : 2 * len(pairs)].long(),
        on_host[2 * len(pairs) :],
    )
    present = torch.isfinite(log_blocks)
    pairs = pairs[present]
    shifts = _minimise(log_blocks[present], pairs // size, pairs % size, shift_k, count, objective.p)
    return torch.cat([shifts, shifts.new_zeros(1)]).to(objective.device)[aggregate[:-1]]


def _log_rows_by_source(objective: Objective, t: int, local: torch.Tensor, count: int) -> torch.Tensor:
    """log Σ_j ḡ_ij over the columns j of tensor ``t`` whose source lies in each of its ``count``
    source aggregates (``local`` numbers them per column): ``[G, O/G, count]``. One batched
    product with the columns' one-hot aggregate matrix, in linear scale wherever the objective
    keeps ḡ there (its range cannot underflow a positive term); by logsumexp per aggregate
    otherwise."""
    log_gbar = objective.log_gbar[t]
    if isinstance(log_gbar, OuterLog):
        # Σ_j ḡ_ij over an aggregate's columns is rows_i times that aggregate's column total.
        cols = group_logsumexp(local.reshape(-1), log_gbar.cols, count)
        return log_gbar.rows.reshape(*local.shape[:1], -1, 1) + cols
    gbar = objective.gbar[t]
    if gbar is not None:
        one_hot = torch.nn.functional.one_hot(local, count).to(torch.float64)
        return torch.log(torch.bmm(gbar, one_hot)) + objective.gbar_shift[t]
    return torch.stack(
        [torch.logsumexp(torch.where((local == j)[:, None, :], log_gbar, -torch.inf), dim=2) for j in range(count)],
        dim=2,
    )


def _minimise(
    log_s: torch.Tensor, into: torch.Tensor, out_of: torch.Tensor, k: torch.Tensor, count: int, p: int
) -> torch.Tensor:
    """Damped Newton with an Armijo line search on p·ln Σ s e^{−2(c_into − c_out_of)} + 2k·c
    (index ``count`` is the ground, c = 0 there)."""
    moving = into != out_of  # a pair within one aggregate has an exponent no shift changes
    used = torch.zeros(count + 1, dtype=torch.bool)
    used[into[moving]] = True
    used[out_of[moving]] = True
    unused = ~used[:count]
    c = torch.zeros(count, dtype=torch.float64)

    def value(c: torch.Tensor) -> tuple[float, torch.Tensor]:
        grounded = torch.cat([c, c.new_zeros(1)])
        exponents = log_s - 2 * (grounded[into] - grounded[out_of])
        return p * float(torch.logsumexp(exponents, 0)) + 2 * float(k @ c), torch.softmax(exponents, 0)

    current, shares = value(c)
    for _ in range(max(MAX_ITERATIONS, count)):
        flow = torch.zeros(count + 1, dtype=torch.float64).index_add_(0, into, shares).index_add_(0, out_of, -shares)
        flow = flow[:count]
        gradient = 2 * (k - p * flow)
        step = -_newton_step(shares[moving], into[moving], out_of[moving], flow, gradient, unused, count, p)
        slope = float(gradient @ step)
        if not slope < 0 or -slope <= 1e-13 * max(1.0, abs(current)):
            break
        moved = armijo_step(value, c, step, current, slope)
        if moved is None:
            break
        c, current, shares = moved
    return c


def armijo_step(
    value, c: torch.Tensor, step: torch.Tensor, current: float, slope: float
) -> tuple[torch.Tensor, float, torch.Tensor] | None:
    """Backtrack from a step capped at 2·REACH along ``step`` until F falls enough (Armijo):
    the new point, F there and its shares; None when no step of at least MIN_STEP does."""
    t = min(1.0, 2 * REACH / float(step.abs().max()))
    while t >= MIN_STEP:
        trial, trial_shares = value(c + t * step)
        if trial <= current + ARMIJO * t * slope:
            return c + t * step, trial, trial_shares
        t *= 0.5
    return None


def _newton_step(
    shares: torch.Tensor,
    into: torch.Tensor,
    out_of: torch.Tensor,
    flow: torch.Tensor,
    gradient: torch.Tensor,
    unused: torch.Tensor,
    count: int,
    p: int,
) -> torch.Tensor:
    """(H + D)⁻¹ g for the Hessian H = 4p (L − f fᵀ) of the objective, L = Σ_pairs w (e_I − e_J)(e_I − e_J)ᵀ
    (the ground's row and column dropped), f the flow, and the damping D = diag(|g| / REACH +
    [unused] + ridge). Solved as the bordered sparse system [[4pL + D, 2√p f], [2√p fᵀ, 1]],
    whose first block row is (4pL + D − 4p f fᵀ) x = g: no dense count × count matrix beyond
    ``DENSE_SYSTEM_MAX`` unknowns."""
    weight = 4 * p * shares.numpy()
    rows = np.concatenate([into.numpy(), out_of.numpy(), into.numpy(), out_of.numpy()])
    cols = np.concatenate([into.numpy(), out_of.numpy(), out_of.numpy(), into.numpy()])
    values = np.concatenate([weight, weight, -weight, -weight])
    inside = (rows < count) & (cols < count)
    laplacian_diagonal = np.bincount(rows[inside & (rows == cols)], values[inside & (rows == cols)], minlength=count)
    hessian_diagonal = laplacian_diagonal - 4 * p * flow.numpy() ** 2
    ridge = 1e-12 * max(float(hessian_diagonal.max()), 1.0)
    damping = (gradient.abs() / REACH).numpy() + unused.numpy() + ridge
    border = 2 * np.sqrt(p) * flow.numpy()
    index = np.arange(count)
    entries = np.concatenate([values[inside], damping, border, border, [1.0]])
    at = (
        np.concatenate([rows[inside], index, index, np.full(count, count), [count]]),
        np.concatenate([cols[inside], index, np.full(count, count), index, [count]]),
    )
    right_side = np.concatenate([gradient.numpy(), [0.0]])
    if count + 1 <= DENSE_SYSTEM_MAX:
        matrix = np.zeros((count + 1, count + 1))
        np.add.at(matrix, at, entries)
        return torch.from_numpy(np.linalg.solve(matrix, right_side)[:count])
    import scipy.sparse
    import scipy.sparse.linalg

    matrix = scipy.sparse.coo_matrix((entries, at), shape=(count + 1, count + 1)).tocsc()
    return torch.from_numpy(scipy.sparse.linalg.splu(matrix).solve(right_side)[:count])
