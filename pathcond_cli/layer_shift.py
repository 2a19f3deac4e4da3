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
one pass over ḡ builds it, and a dense damped Newton method minimises it in milliseconds.
F(Zc*) is exact, so the solver takes the point only if it lowers F.
"""

from __future__ import annotations

import torch

from .objective import Objective, group_logsumexp

#: per-variable damping |∂F/∂c_I| / REACH caps a step near REACH while far from the optimum
REACH = 10.0
MAX_ITERATIONS = 200
ARMIJO = 1e-4
MIN_STEP = 1e-10


def layer_shift_start(objective: Objective, layer_of_group: torch.Tensor, count: int,
                      frozen: torch.Tensor) -> torch.Tensor:
    """u with u_h = c*_{L(h)} (0 on frozen groups): the minimiser of F over layer shifts.

    ``layer_of_group`` maps each of the H + 1 extended groups (the last is the ground) to its
    aggregate in ``range(count)``, the ground to ``count``. Costs one pass over ḡ (counted).
    """
    objective.passes += 1
    aggregate = layer_of_group.clone()
    aggregate[:-1][frozen] = count
    size = count + 1
    blocks, log_rows = [], []
    for t, dp in enumerate(objective.groups.dag_params):
        sources, local = torch.unique(aggregate[dp.src], return_inverse=True)
        log_rows.append(_log_rows_by_source(objective, t, local, len(sources)).reshape(-1))
        blocks.append((aggregate[dp.dst][:, :, None] * size + sources).reshape(-1))
    log_blocks = group_logsumexp(torch.cat(blocks), torch.cat(log_rows), size * size)
    shift_k = torch.zeros(size, dtype=torch.float64, device=objective.device).index_add(
        0, aggregate[:-1], objective.k)[:count]
    # a few hundred unknowns: solved on the CPU whatever the device, without a sync per step
    log_blocks = log_blocks.cpu()
    pairs = torch.nonzero(torch.isfinite(log_blocks)).flatten()
    shifts = _minimise(log_blocks[pairs], pairs // size, pairs % size, shift_k.cpu(), count, objective.p)
    return torch.cat([shifts, shifts.new_zeros(1)]).to(objective.device)[aggregate[:-1]]


def _log_rows_by_source(objective: Objective, t: int, local: torch.Tensor, count: int) -> torch.Tensor:
    """log Σ_j ḡ_ij over the columns j of tensor ``t`` whose source lies in each of its ``count``
    source aggregates (``local`` numbers them per column): ``[G, O/G, count]``. One batched
    product with the columns' one-hot aggregate matrix, in linear scale wherever the objective
    keeps ḡ there (its range cannot underflow a positive term); by logsumexp per aggregate
    otherwise."""
    log_gbar = objective.log_gbar[t]
    gbar = objective.gbar[t]
    if gbar is not None:
        one_hot = torch.nn.functional.one_hot(local, count).to(torch.float64)
        return torch.log(torch.bmm(gbar, one_hot)) + objective.gbar_shift[t]
    return torch.stack([torch.logsumexp(torch.where((local == j)[:, None, :], log_gbar, -torch.inf), dim=2)
                        for j in range(count)], dim=2)


def _minimise(log_s: torch.Tensor, into: torch.Tensor, out_of: torch.Tensor, k: torch.Tensor, count: int,
              p: int) -> torch.Tensor:
    """Damped Newton with an Armijo line search on p·ln Σ s e^{−2(c_into − c_out_of)} + 2k·c
    (index ``count`` is the ground, c = 0 there)."""
    incidence = torch.zeros(len(log_s), count + 1, dtype=torch.float64, device=log_s.device)
    rows = torch.arange(len(log_s), device=log_s.device)
    incidence[rows, into] += 1.0
    incidence[rows, out_of] -= 1.0
    incidence = incidence[:, :count]
    unused = (incidence != 0).sum(0) == 0
    c = torch.zeros(count, dtype=torch.float64, device=log_s.device)

    def value(c: torch.Tensor) -> tuple[float, torch.Tensor]:
        exponents = log_s - 2 * incidence @ c
        return p * float(torch.logsumexp(exponents, 0)) + 2 * float(k @ c), torch.softmax(exponents, 0)

    current, shares = value(c)
    for _ in range(MAX_ITERATIONS):
        flow = incidence.T @ shares
        gradient = 2 * (k - p * flow)
        hessian = 4 * p * ((incidence.T * shares) @ incidence - torch.outer(flow, flow))
        ridge = 1e-12 * float(hessian.diagonal().max().clamp_min(1.0))
        damping = gradient.abs() / REACH + unused.to(torch.float64) + ridge
        step = -torch.linalg.solve(hessian + torch.diag(damping), gradient)
        slope = float(gradient @ step)
        if not slope < 0 or -slope <= 1e-13 * max(1.0, abs(current)):
            break
        t = min(1.0, 2 * REACH / float(step.abs().max()))
        while t >= MIN_STEP:
            trial, trial_shares = value(c + t * step)
            if trial <= current + ARMIJO * t * slope:
                break
            t *= 0.5
        else:
            break
        c, current, shares = c + t * step, trial, trial_shares
    return c
