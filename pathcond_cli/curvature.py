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
the Hessian.
"""

from __future__ import annotations

import torch

from .objective import Coupling, Evaluation, Objective


class ScaledHessian:
    """(M − r̂ r̂ᵀ / p) restricted to the ``active`` groups at one point u, Levenberg-damped.

    Far from u*, F is nearly linear in groups whose weights are in the exponential tail (d_h
    tiny, gradient ≈ 2k_h): a pure Newton step would move them by millions and the line search
    would then shrink every other group's step with them. Each group's curvature is raised by
    |∂F/∂u_h| / ``reach`` (÷4: the Hessian is 4L), which caps its move near ``reach`` while the
    gradient is large and vanishes as it goes to zero (quadratic convergence is kept, as in
    Levenberg–Marquardt with damping proportional to the gradient).
    """

    def __init__(self, objective: Objective, u: torch.Tensor, current: Evaluation, active: torch.Tensor,
                 reach: float):
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
        self.coupling = Coupling(objective, torch.cat([-2 * u + scaled_log_d, excluded]),
                                 torch.cat([2 * u + scaled_log_d, excluded]))
        self.within = torch.exp(objective.self_loop_log + objective.log_p - current.log_total - log_d) * active

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.objective.passes += 1
        off_diagonal = self.coupling.symmetric_product(self.objective.groups.extend(x))[:-1]
        rank_one = self.shares_difference * (self.shares_difference @ x) / self.objective.p
        return (x - off_diagonal + 2 * self.within * x - rank_one) * self.active


def newton_direction(hessian: ScaledHessian, gradient: torch.Tensor, forcing: float, max_steps: int) -> torch.Tensor:
    """An inexact Newton step δ ≈ −∇²F⁻¹ ∇F on the active groups (zero elsewhere).

    Truncated conjugate gradients from 0 on the scaled system, stopped when the residual falls
    below ``forcing`` times its start, after ``max_steps`` products, or on non-positive
    curvature (rounding only: F is convex). The result is always a descent direction.
    """
    rhs = -0.25 * gradient * hessian.inverse_sqrt_d
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    direction = residual.clone()
    residual_norm2 = residual @ residual
    stop2 = forcing**2 * float(residual_norm2)
    for _ in range(max_steps):
        product = hessian(direction)
        curvature = direction @ product
        if float(curvature) <= 0:
            break
        step = residual_norm2 / curvature
        solution += step * direction
        residual -= step * product
        new_norm2 = residual @ residual
        if float(new_norm2) <= stop2:
            break
        direction = residual + (new_norm2 / residual_norm2) * direction
        residual_norm2 = new_norm2
    if not bool(solution.abs().max() > 0):
        solution = rhs
    return solution * hessian.inverse_sqrt_d
