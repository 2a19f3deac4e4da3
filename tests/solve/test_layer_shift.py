"""Adversarial checks of the Newton solver's layer-shift start and of the coarse correction
assembled from the evaluation's per-tensor sums, against the dense oracle (brute-force log g,
dense B) and scipy: extreme per-layer scales, a 2e37 outlier, float32 checkpoints, dead
neurons, random active masks and the bounded problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import DenseObjective, build_neuron_dag, oracle_objective, to_theta_order
from scipy.optimize import minimize

from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.solve import layer_shift
from pathcond_cli.solve.curvature import CoarseCorrection, LayerAggregates, ScaledHessian
from pathcond_cli.solve.layer_shift import _minimise, layer_shift_start
from pathcond_cli.solve.objective import Objective, degenerate_mask
from pathcond_cli.solve.solvers import solve

OUTLIER = 2e37


def _scaled(params: dict[str, torch.Tensor], scaling: str) -> dict[str, torch.Tensor]:
    """Per-layer scales far outside what a product of float64 weights can hold."""
    layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
    out = {}
    for key, value in params.items():
        layer = key.split(".")[0]
        i = layers.index(layer) if layer in layers else 0
        if scaling == "alternating_1e30":
            value = value * (1e30 if i % 2 == 0 else 1e-30)
        elif scaling == "growing_1e3":
            value = value * 10.0 ** (3 * i)
        elif scaling == "outlier" and i == 0 and key.endswith("weight"):
            value = value.clone()
            value.view(-1)[0] = OUTLIER
        elif scaling == "float32":
            value = (value * (1e4 if i == 0 else 1e-4 if i == len(layers) - 1 else 1.0)).to(torch.float32)
        out[key] = value
    return out


def _layer_basis(groups, aggregates: LayerAggregates, frozen: torch.Tensor) -> np.ndarray:
    """Z: one column per layer aggregate holding a free group, 1 on its free groups."""
    layer = aggregates.of_group[:-1].numpy()
    free = ~frozen.numpy()
    basis = np.zeros((groups.num_free, aggregates.count))
    basis[np.nonzero(free)[0], layer[free]] = 1.0
    return basis[:, basis.any(0)]


_ORACLES: dict = {}


def _log_domain_oracle(graph, params, groups, key):
    """The oracle's F (brute-force log g, dense B) of catalogue network ``key`` = (arch, scaling),
    built once: the start test and the bounded test read the same alternating_1e30 networks."""
    if key not in _ORACLES:
        dag = build_neuron_dag(graph, params)
        _ORACLES[key] = oracle_objective(dag, groups, dag.log_diag_G())
    return _ORACLES[key]


@pytest.mark.parametrize("scaling", ["alternating_1e30", "growing_1e3", "outlier", "float32"])
@pytest.mark.parametrize(
    "arch", ["mlp", "residual", "concat", "self_loop", "grouped_conv", "bottleneck", "shuffle_split"]
)
def test_start_is_the_minimum_over_layer_shifts_at_extreme_scales(nets, arch, scaling):
    """F(start) equals the oracle's own minimum of F(Zc) (L-BFGS-B and Newton polish on the
    dense restricted problem, g by brute-force path enumeration in the log domain), the
    restricted gradient vanishes there, and Newton's first iterate is that start."""
    graph, params = nets.catalogue[arch](0)
    params = _scaled(params, scaling)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    ob = _log_domain_oracle(graph, params, groups, (arch, scaling))
    objective = Objective(groups, diag)
    frozen = degenerate_mask(groups, diag)
    aggregates = LayerAggregates(objective)
    start = layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen).numpy()
    assert np.isfinite(start).all()
    basis = _layer_basis(groups, aggregates, frozen)
    _, restricted_min = DenseObjective(ob.log_g, ob.B @ basis).minimise()
    assert ob.value(start) == pytest.approx(restricted_min, rel=1e-13)
    degree = objective.degree.numpy()
    assert (np.abs(basis.T @ ob.grad(start)) <= 1e-5 * basis.T @ (2 * degree)).all()
    result = solve(groups, diag, tol=1e-10)
    assert result.converged
    assert result.objective[1] == pytest.approx(ob.value(start), rel=1e-13)
    _, f_star = ob.minimise(free=~frozen.numpy())
    assert ob.value(result.u.numpy()) == pytest.approx(f_star, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("arch", ["mlp_bottleneck", "residual", "concat", "self_loop"])
def test_start_with_dead_neurons_keeps_frozen_groups_at_zero(nets, arch, seed):
    """Random zero masks (40% of every weight matrix, layer scales 1e±4) make neurons dead and
    groups degenerate: the start is 0 on frozen groups, and attains the oracle's minimum over
    shifts of the free groups of each layer; the solve ends at the oracle's F* over free groups."""
    graph, params = nets.catalogue[arch](seed)
    rng = torch.Generator().manual_seed(seed)
    layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
    masked = {}
    for key, value in params.items():
        if key.endswith("weight"):
            value = value * (torch.rand(value.shape, generator=rng, dtype=torch.float64) > 0.4)
        scale = 1e4 if key.startswith(layers[0] + ".") else 1e-4 if key.startswith(layers[-1] + ".") else 1.0
        masked[key] = value * scale
    dag = build_neuron_dag(graph, masked)
    groups = build_groups(graph, masked)
    diag = diag_g(groups)
    if not any(bool(torch.isfinite(lg).any()) for lg in diag.log_g):
        pytest.skip("the mask killed every path")
    ob = oracle_objective(dag, groups)
    objective = Objective(groups, diag)
    frozen = degenerate_mask(groups, diag)
    aggregates = LayerAggregates(objective)
    start = layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen).numpy()
    assert np.isfinite(start).all() and (start[frozen.numpy()] == 0).all()
    basis = _layer_basis(groups, aggregates, frozen)
    if basis.shape[1]:
        _, restricted_min = DenseObjective(ob.log_g, ob.B @ basis).minimise()
        assert ob.value(start) == pytest.approx(restricted_min, rel=1e-12, abs=1e-9)
    result = solve(groups, diag, tol=1e-10)
    assert result.converged and (result.u[frozen] == 0).all()
    _, f_star = ob.minimise(free=~frozen.numpy())
    assert ob.value(result.u.numpy()) == pytest.approx(f_star, rel=1e-11, abs=1e-9)


def test_start_on_a_network_whose_groups_are_all_frozen(nets):
    """Every hidden unit dead (no weight out of the hidden layer, output bias alive): nothing to
    solve, no start is tried, u = 0."""
    graph, params = nets.mlp(1, widths=(3, 4, 2))
    params = dict(params)
    params["fc3.weight"] = torch.zeros_like(params["fc3.weight"])
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    frozen = degenerate_mask(groups, diag)
    assert bool(frozen.all())
    result = solve(groups, diag, tol=1e-10)
    assert result.converged and result.iterations == 0 and (result.u == 0).all()
    objective = Objective(groups, diag)
    aggregates = LayerAggregates(objective)
    assert (layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen) == 0).all()


@pytest.mark.parametrize("arch", ["mlp", "concat", "self_loop", "grouped_conv", "conv_bn", "shuffle_split"])
@pytest.mark.parametrize("scaling", ["layer_1e6", "alternating_1e30"])
def test_bounded_solve_with_the_clamped_start_reaches_scipy_box_optimum(nets, arch, scaling):
    graph, params = nets.catalogue[arch](0)
    if scaling == "layer_1e6":
        layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
        params = {k: v * (1e6 if k.startswith(layers[0] + ".") else 1.0) for k, v in params.items()}
    else:
        params = _scaled(params, scaling)
    groups = build_groups(graph, params)
    ob = _log_domain_oracle(graph, params, groups, (arch, scaling))
    bound = 2.0
    H = groups.num_free
    box = minimize(
        ob.value,
        np.zeros(H),
        jac=ob.grad,
        method="L-BFGS-B",
        bounds=[(-bound, bound)] * H,
        options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-12, "maxcor": 50},
    )
    result = solve(groups, diag_g(groups), tol=1e-10, max_log_scale=bound)
    assert result.converged and result.u.abs().max() <= bound
    assert ob.value(result.u.numpy()) <= box.fun + 1e-10 * abs(box.fun)
    assert ob.value(result.u.numpy()) == pytest.approx(box.fun, rel=1e-10)
    assert all(b <= a + 1e-12 * abs(a) for a, b in zip(result.objective, result.objective[1:]))


def _random_masks(count: int, seed: int) -> list[torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    dense = torch.rand(count, generator=rng) < 0.7
    sparse = torch.rand(count, generator=rng) < 0.3
    return [dense, sparse]


@pytest.mark.parametrize(
    "arch",
    [
        "bottleneck",
        "mlp_bottleneck",
        "concat",
        "self_loop",
        "grouped_conv",
        "shuffle_split",
        "gather",
        "conv_residual",
        "residual",
        "conv_transpose",
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_coarse_matrix_with_random_active_masks(nets, arch, seed):
    """E = Zᵀ(M − r̂r̂ᵀ/p)Z (operator, column by column) for random active sets, including
    layer aggregates left wholly inactive, and F's optimum far from 0 (layer scales 1e±8)."""
    graph, params = nets.catalogue[arch](seed)
    layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
    params = {
        k: v * (1e8 if k.startswith(layers[0] + ".") else 1e-8 if k.startswith(layers[-1] + ".") else 1.0)
        for k, v in params.items()
    }
    groups = build_groups(graph, params)
    objective = Objective(groups, diag_g(groups))
    aggregates = LayerAggregates(objective)
    u = torch.tensor(np.random.default_rng(seed).normal(scale=3.0, size=groups.num_free))
    current = objective.evaluate(u)
    whole_layer_off = aggregates.of_group[:-1] != aggregates.of_group[0]
    for active in _random_masks(groups.num_free, seed) + [whole_layer_off]:
        _check_coarse_matrix(objective, aggregates, u, current, active)


def test_coarse_matrix_when_inactive_groups_carry_no_weight(nets):
    """A dead hidden unit (no weight or bias into it: frozen, so inactive) has no weight in the
    tensor it feeds, which then takes the row-sum route with an inactive group on the summed
    side: E stays exact and no product pass is needed. A unit with no weight out of it (frozen
    too) still has weight in its outgoing tensor (g_i does not depend on θ_i), so both sides of
    that tensor hold an inactive group with weight: products, one pass."""
    graph, params = nets.mlp(3, widths=(3, 5, 4, 2))
    params = {k: v.clone() for k, v in params.items()}
    params["fc3.weight"][2, :] = 0
    params["fc3.bias"][2] = 0
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    objective = Objective(groups, diag)
    aggregates = LayerAggregates(objective)
    u = torch.tensor(np.random.default_rng(0).normal(size=groups.num_free))
    for dead_out, product_passes in [(False, 0), (True, 1)]:
        if dead_out:
            params["fc3.weight"][:, 1] = 0
            groups = build_groups(graph, params)
            diag = diag_g(groups)
            objective = Objective(groups, diag)
        frozen = degenerate_mask(groups, diag)
        assert int(frozen.sum()) == 1 + dead_out
        current = objective.evaluate(u, frozen)
        passes = objective.passes
        _check_coarse_matrix(objective, aggregates, u, current, ~frozen)
        # the check's own operator products are one pass per aggregate column
        assert objective.passes == passes + product_passes + aggregates.count


def _check_coarse_matrix(objective, aggregates, u, current, active):
    hessian = ScaledHessian(objective, u, current, active, reach=10.0)
    coarse = CoarseCorrection(hessian, aggregates, current)
    assert coarse.usable
    columns = torch.stack([coarse.basis * (aggregates.of_group[:-1] == j) for j in range(aggregates.count)], dim=1)
    expected = columns.T @ torch.stack([hessian(c) for c in columns.T], dim=1)
    expected += torch.diag((columns.abs().sum(0) == 0).to(torch.float64))
    assert torch.allclose(coarse.factor @ coarse.factor.T, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p", [2, 10, 10**9])
def test_minimiser_of_a_non_coercive_shift_problem_stays_finite(p):
    """A problem with no minimum (all weight flows into one layer from the ground: F = −2p·c)
    and one whose only minimum is at a shift of about ±700: finite shifts, no exception."""
    unbounded = _minimise(
        torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([0]),
        torch.tensor([1]),
        torch.zeros(1, dtype=torch.float64),
        1,
        p,
    )
    assert torch.isfinite(unbounded).all()
    log_s = torch.tensor([700.0, -700.0, 0.0], dtype=torch.float64)
    far = _minimise(log_s, torch.tensor([0, 2, 1]), torch.tensor([2, 1, 0]), torch.zeros(2, dtype=torch.float64), 2, p)
    assert torch.isfinite(far).all()


def _split_stream(builder, seed: int = 0):
    """Two branches concatenated into a stream that a layer reads whole and adds back into:
    that layer's sources and destinations both span two layer aggregates (Inception's concat
    meeting a residual add), and a bias-free layer follows."""
    b = builder((2,), seed)
    left = b.relu(b.linear(2, src="x"))
    right = b.relu(b.linear(3, src="x"))
    stream = b.concat(left, right)
    b.linear(5, src=stream)
    stream = b.relu(b.add(stream, b.cur))
    b.relu(b.linear(4, src=stream, bias=False))
    b.linear(2)
    return b.build()


def _first_layer_scaled(graph, params, factor: float):
    """The oracle's DAG, the groups and diag(G) of the network with its first layer × ``factor``."""
    first = sorted(k.split(".")[0] for k in params if k.endswith("weight"))[0]
    params = {k: v * (factor if k.startswith(first + ".") else 1.0) for k, v in params.items()}
    groups = build_groups(graph, params)
    return build_neuron_dag(graph, params), groups, diag_g(groups)


def test_tensor_spanning_several_aggregates_on_both_sides(nets):
    """The coarse matrix falls back to products for that tensor and is still exact; the start
    attains the oracle's minimum over layer shifts and the solve the oracle's F*."""
    dag, groups, diag = _first_layer_scaled(*_split_stream(nets.builder), 1e5)
    objective = Objective(groups, diag)
    aggregates = LayerAggregates(objective)
    spanning = [not (s or d) for s, d in zip(aggregates.single_source, aggregates.single_destination)]
    assert any(spanning)
    u = torch.tensor(np.random.default_rng(1).normal(size=groups.num_free))
    current = objective.evaluate(u)
    passes = objective.passes
    _check_coarse_matrix(objective, aggregates, u, current, torch.ones(groups.num_free, dtype=torch.bool))
    assert objective.passes == passes + 1 + aggregates.count
    ob = oracle_objective(dag, groups, dag.log_diag_G())
    frozen = degenerate_mask(groups, diag)
    start = layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen).numpy()
    _, restricted_min = DenseObjective(ob.log_g, ob.B @ _layer_basis(groups, aggregates, frozen)).minimise()
    assert ob.value(start) == pytest.approx(restricted_min, rel=1e-13)
    result = solve(groups, diag, tol=1e-10)
    _, f_star = ob.minimise()
    assert result.converged and ob.value(result.u.numpy()) == pytest.approx(f_star, rel=1e-12)


@pytest.mark.parametrize("arch", ["split_stream", "concat", "self_loop", "shuffle_split"])
def test_start_is_the_same_from_the_log_domain_route(nets, arch):
    """Tensors whose ḡ spans more than linear scale can hold are summed per source aggregate in
    the log domain: with every tensor sent that way the start is the same, and it attains the
    oracle's minimum over layer shifts (tensors reading several aggregates included)."""
    network = _split_stream(nets.builder) if arch == "split_stream" else nets.catalogue[arch](0)
    dag, groups, diag = _first_layer_scaled(*network, 1e6)
    frozen = degenerate_mask(groups, diag)
    starts = []
    for log_route in (False, True):
        objective = Objective(groups, diag)
        aggregates = LayerAggregates(objective)
        assert any(len(sources) > 1 for sources in aggregates.sources)
        if log_route:
            objective.gbar.shifts = [None] * len(objective.gbar)
            objective.gbar.kept.clear()
        passes = objective.passes
        starts.append(layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen).numpy())
        assert objective.passes == passes + 1
    assert np.allclose(starts[0], starts[1], rtol=1e-12, atol=1e-12)
    ob = oracle_objective(dag, groups)
    _, restricted_min = DenseObjective(ob.log_g, ob.B @ _layer_basis(groups, aggregates, frozen)).minimise()
    assert np.abs(starts[0]).max() > 1.0
    assert ob.value(starts[0]) == pytest.approx(restricted_min, rel=1e-13)


@pytest.mark.xfail(
    strict=True,
    reason="diag_g loses or misplaces path sums when two concatenated "
    "branches differ in scale by 1e80 or more (not the solver)",
)
def test_diag_g_with_concatenated_branches_scaled_apart(nets):
    """Found while reviewing the layer-shift start: with the two branches of a concatenated
    stream scaled by 1e40 and 1e-40, diag_g disagrees with autograd and with brute-force path
    enumeration by e^0.85 on some of fc3's weights; at 1e100/1e-100 it returns g = 0 for 49 of
    75 parameters whose g is about 1 (so their groups are frozen as degenerate and F is wrong)."""
    graph, params = _split_stream(nets.builder)
    params = {
        k: v * (1e40 if k.startswith("fc1.") else 1e-40 if k.startswith("fc3.") else 1.0) for k, v in params.items()
    }
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    engine = to_theta_order(dag, groups, list(diag_g(groups).log_g), fill=float("-inf")).numpy()
    assert np.allclose(engine, np.log(dag.diag_G().numpy()), rtol=1e-9, atol=1e-9)


# -- the sparse construction equals the dense one, and scales to deep nets ------


def _dense_minimise(log_s, into, out_of, k, count, p):
    """The layer-shift minimiser of 0.2.1: a dense (pairs × count) incidence matrix and a dense
    count × count Hessian per step. The reference the sparse construction must reproduce."""
    incidence = torch.zeros(len(log_s), count + 1, dtype=torch.float64)
    rows = torch.arange(len(log_s))
    incidence[rows, into] += 1.0
    incidence[rows, out_of] -= 1.0
    incidence = incidence[:, :count]
    unused = (incidence != 0).sum(0) == 0
    c = torch.zeros(count, dtype=torch.float64)

    def value(c):
        exponents = log_s - 2 * incidence @ c
        return p * float(torch.logsumexp(exponents, 0)) + 2 * float(k @ c), torch.softmax(exponents, 0)

    current, shares = value(c)
    for _ in range(max(layer_shift.MAX_ITERATIONS, count)):
        flow = incidence.T @ shares
        gradient = 2 * (k - p * flow)
        hessian = 4 * p * ((incidence.T * shares) @ incidence - torch.outer(flow, flow))
        ridge = 1e-12 * float(hessian.diagonal().max().clamp_min(1.0))
        damping = gradient.abs() / layer_shift.REACH + unused.to(torch.float64) + ridge
        step = -torch.linalg.solve(hessian + torch.diag(damping), gradient)
        slope = float(gradient @ step)
        if not slope < 0 or -slope <= 1e-13 * max(1.0, abs(current)):
            break
        moved = layer_shift.armijo_step(value, c, step, current, slope)
        if moved is None:
            break
        c, current, shares = moved
    return c


def _reduced_problem_and_shifts(graph, params, monkeypatch) -> tuple[tuple, torch.Tensor]:
    """The reduced problem the layer-shift start minimises (``_minimise``'s arguments: log_s,
    into, out_of, k, count, p) and the shifts it returns."""
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    objective = Objective(groups, diag)
    aggregates = LayerAggregates(objective)
    calls = []
    minimise = layer_shift._minimise

    def recording(*args):
        calls.append((args, minimise(*args)))
        return calls[-1][1]

    monkeypatch.setattr(layer_shift, "_minimise", recording)
    layer_shift_start(objective, aggregates.of_group, aggregates.count, degenerate_mask(groups, diag))
    ((args, shifts),) = calls
    return args, shifts


def _start_and_dense_reference(graph, params, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The layer-shift start's shifts, the dense construction's on the same reduced problem, and
    the number of layer aggregates."""
    args, shifts = _reduced_problem_and_shifts(graph, params, monkeypatch)
    return shifts, _dense_reference(args), args[4]


_DENSE: dict = {}


def _dense_reference(args) -> torch.Tensor:
    """``_dense_minimise(*args)``, once per reduced problem: the dense and sparse system routes
    reduce the same network to bit-identical arguments (the route only changes how ``_minimise``
    solves them), and the dense construction is deterministic."""
    key = tuple((a.dtype, tuple(a.shape), a.numpy().tobytes()) if isinstance(a, torch.Tensor) else a for a in args)
    if key not in _DENSE:
        _DENSE[key] = _dense_minimise(*args)
    return _DENSE[key]


# Each Newton step's bordered system solved dense (the small systems' route) and by scipy's
# sparse LU (the large ones'), forced by the size limit.
SYSTEM_ROUTES = pytest.mark.parametrize("dense_system_max", [layer_shift.DENSE_SYSTEM_MAX, 0], ids=["dense", "sparse"])


@SYSTEM_ROUTES
@pytest.mark.parametrize("scaling", ["none", "alternating_1e30", "growing_1e3"])
@pytest.mark.parametrize(
    "arch",
    [
        "mlp",
        "residual",
        "concat",
        "self_loop",
        "grouped_conv",
        "bottleneck",
        "conv_bn",
        "shuffle_split",
        "mlp_bottleneck",
    ],
)
def test_layer_shift_equals_the_dense_construction(nets, monkeypatch, arch, scaling, dense_system_max):
    monkeypatch.setattr(layer_shift, "DENSE_SYSTEM_MAX", dense_system_max)
    graph, params = nets.catalogue[arch](0)
    shifts, dense, _ = _start_and_dense_reference(graph, _scaled(params, scaling), monkeypatch)
    assert torch.allclose(shifts, dense, rtol=1e-9, atol=1e-9)


@SYSTEM_ROUTES
def test_deep_thin_chain_start_equals_the_dense_construction(nets, monkeypatch, dense_system_max):
    """100 one-unit layers: the reduced problem is as large as the network (one aggregate per unit)."""
    monkeypatch.setattr(layer_shift, "DENSE_SYSTEM_MAX", dense_system_max)
    graph, params = nets.mlp(0, widths=(1,) * 101)
    shifts, dense, count = _start_and_dense_reference(graph, params, monkeypatch)
    assert count >= 99 and torch.allclose(shifts, dense, rtol=1e-9, atol=1e-9)


def test_deep_thin_chain_start_is_a_stationary_point(nets, monkeypatch):
    """600 one-unit layers (599 aggregates: the sparse route): the shifts grow to about 370 with
    depth and the damped steps travel about REACH / 2 each, so the minimiser needs about 80
    iterations, more than MAX_ITERATIONS (lowered to 40 here: 1,600 layers need 202 against
    the real 200, at 2.5 times the time), and iterates on, up to one per aggregate; where it
    stops, autograd's gradient of the reduced objective must vanish."""
    monkeypatch.setattr(layer_shift, "MAX_ITERATIONS", 40)
    steps = []
    armijo = layer_shift.armijo_step
    monkeypatch.setattr(layer_shift, "armijo_step", lambda *args: steps.append(1) or armijo(*args))
    graph, params = nets.mlp(0, widths=(1,) * 601)
    (log_s, into, out_of, k, count, p), shifts = _reduced_problem_and_shifts(graph, params, monkeypatch)
    c = shifts.clone().requires_grad_()
    grounded = torch.cat([c, c.new_zeros(1)])
    value = p * torch.logsumexp(log_s - 2 * (grounded[into] - grounded[out_of]), 0) + 2 * (k @ c)
    (gradient,) = torch.autograd.grad(value, c)
    assert count == 599 > layer_shift.DENSE_SYSTEM_MAX and float(shifts.abs().max()) > 300
    assert layer_shift.MAX_ITERATIONS < len(steps) < count
    assert float(gradient.abs().max()) <= 1e-6 * p


@pytest.mark.slow
def test_three_thousand_one_unit_layers_are_solved(nets):
    """The case of issue 18: 3,000 one-unit layers (about 4 minutes with the dense construction,
    its 2L × L incidence; 8,000 ran out of a 4 GiB cap). Newton starts at the layer-shift
    minimum, which here is F's minimum, and converges."""
    graph, params = nets.mlp(0, widths=(1,) * 3001)
    groups = build_groups(graph, params)
    result = solve(groups, diag_g(groups))
    assert result.converged and result.iterations <= 3
