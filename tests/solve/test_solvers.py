"""The three solvers (SPEC §5) against scipy on the oracle's own F (own g, own dense B)."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch
from oracle import DenseObjective, build_neuron_dag, oracle_objective, to_theta_order

from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.log_g import DiagG
from pathcond_cli.solve.objective import block_step, paper_step, support
from pathcond_cli.solve.solvers import solve

METHODS = ["newton", "block", "lbfgs", "sequential"]
ARCHS = [
    "mlp",
    "conv_maxpool",
    "residual",
    "conv_residual",
    "conv_bn",
    "bottleneck",
    "mlp_bottleneck",
    "concat",
    "self_loop",
]
TOL = 1e-10
MAX_ITER = 20000

_CACHE: dict = {}


def setup(nets, arch, seed=0):
    key = (arch, seed)
    if key not in _CACHE:
        graph, params = nets.catalogue[arch](seed)
        dag = build_neuron_dag(graph, params)
        groups = build_groups(graph, params)
        ob = oracle_objective(dag, groups)
        u_star, f_star = ob.minimise()
        _CACHE[key] = (graph, params, dag, groups, diag_g(groups), ob, u_star, f_star)
    return _CACHE[key]


def solved(groups, diag, arch, method):
    """``solve`` at TOL on a ``setup`` network, run once per (arch, method): the optimum test and
    the block/sequential agreement test check the same deterministic runs."""
    key = ("solve", arch, method)
    if key not in _CACHE:
        _CACHE[key] = solve(groups, diag, solver=method, tol=TOL, max_iter=MAX_ITER)
    return _CACHE[key]


def own_kkt(ob: DenseObjective, u) -> float:
    """SPEC §5 relative KKT residual, from the oracle's own A, C, S, k, n_in, n_out."""
    A, C, S = ob.incidence(u)
    n_in, n_out = (ob.B > 0).sum(0), (ob.B < 0).sum(0)
    k = n_in - n_out
    return float(np.max(np.abs(ob.p * (A - C) / S - k) / np.maximum(n_in + n_out, 1)))


def _non_increasing(values, rel=1e-12):
    return all(b <= a + rel * max(1.0, abs(a)) for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_solver_reaches_scipy_optimum(nets, arch, method):
    graph, params, dag, groups, diag, ob, u_star, f_star = setup(nets, arch)
    assert support(groups, diag.parts).size == ob.p  # the support g > 0 (SPEC §4)
    res = solved(groups, diag, arch, method)
    u = res.u.numpy()
    assert np.isfinite(u).all()
    assert res.converged, f"{method}: KKT residual {res.kkt_residual:.3e} after {res.iterations} iterations"
    assert res.degenerate == []
    # F at the engine's u, evaluated by the oracle, equals scipy's optimum
    f_engine = ob.value(u)
    assert f_engine == pytest.approx(f_star, rel=1e-9, abs=1e-9)
    assert f_engine >= f_star - 1e-9 * abs(f_star) - 1e-9
    # the engine's own reports are right: F(0) first, F(u*) last, KKT residual as defined
    assert res.objective[0] == pytest.approx(ob.value(np.zeros(groups.num_free)), rel=1e-12, abs=1e-12)
    assert res.objective[-1] == pytest.approx(f_engine, rel=1e-9, abs=1e-9)
    assert own_kkt(ob, u) <= 10 * TOL
    assert res.kkt_residual == pytest.approx(own_kkt(ob, u), abs=1e-9)
    assert all(math.isfinite(v) for v in res.objective)
    # same minimiser (unique: every g_i > 0)
    assert np.abs(u - u_star).max() <= 1e-5
    assert _non_increasing(res.objective), res.objective[:10]


@pytest.mark.parametrize("arch", ["mlp", "conv_residual", "bottleneck", "mlp_bottleneck"])
def test_paper_and_block_updates_agree(nets, arch):
    *_, groups, diag, ob, u_star, f_star = setup(nets, arch)
    block = solved(groups, diag, arch, "block")
    seq = solved(groups, diag, arch, "sequential")
    assert np.abs(block.u.numpy() - seq.u.numpy()).max() <= 1e-6
    assert block.objective[-1] == pytest.approx(seq.objective[-1], rel=1e-10)


def _quadratic_root(qa: float, qb: float, qc: float) -> float:
    """Positive root of qa z² + qb z + qc (qa ≥ 0, qc ≤ 0), in 80-digit decimal arithmetic."""
    getcontext().prec = 80
    a, b, c = Decimal(qa), Decimal(qb), Decimal(qc)
    if a == 0:
        return float(-c / b)
    root = (b * b - 4 * a * c).sqrt()
    return float(-2 * c / (b + root)) if b >= 0 else float((root - b) / (2 * a))


@pytest.mark.parametrize("arch", ["mlp", "residual", "conv_bn", "bottleneck"])
def test_paper_step_is_exact_coordinate_minimiser(nets, arch):
    """δ = paper_step(ln A, ln C, ln E, k, p) zeroes ∂F/∂u_h of the oracle's F at u + δ e_h (Lemma 4.1)."""
    *_, groups, diag, ob, u_star, f_star = setup(nets, arch)
    rng = np.random.default_rng(0)
    u = rng.normal(scale=0.7, size=groups.num_free)
    n_in, n_out = (ob.B > 0).sum(0), (ob.B < 0).sum(0)
    for h in range(groups.num_free):
        A, C, S = ob.incidence(u)
        k = int(n_in[h] - n_out[h])
        E = S - A[h] - C[h]
        delta = paper_step(math.log(A[h]), math.log(C[h]), math.log(E), k, ob.p)
        z_exact = _quadratic_root((ob.p + k) * C[h], k * E, (k - ob.p) * A[h])
        assert delta == pytest.approx(0.5 * math.log(z_exact), abs=1e-12)
        moved = u.copy()
        moved[h] += delta
        grad = ob.grad(moved)[h]
        assert abs(grad) <= 1e-9 * (n_in[h] + n_out[h]), (h, grad)
        assert ob.value(moved) <= ob.value(u) + 1e-12 * abs(ob.value(u))


@pytest.mark.parametrize("arch", ["mlp", "conv_residual", "bottleneck"])
def test_block_step_minimises_at_fixed_lambda(nets, arch):
    """δ_h = block_step(ln a, ln c, k) solves λ(A e^{−2δ} − C e^{2δ}) = k at λ = p/S, per group."""
    *_, groups, diag, ob, u_star, f_star = setup(nets, arch)
    rng = np.random.default_rng(1)
    u = rng.normal(scale=0.7, size=groups.num_free)
    A, C, S = ob.incidence(u)
    k = (ob.B > 0).sum(0) - (ob.B < 0).sum(0)
    lam = ob.p / S
    step = block_step(
        torch.log(torch.tensor(lam * A)), torch.log(torch.tensor(lam * C)), torch.tensor(k, dtype=torch.float64)
    ).numpy()
    z = np.exp(2 * step)
    assert np.allclose(lam * (A / z - C * z), k, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize(
    "A,C,E,k,p",
    [
        (1.0, 1e-300, 5.0, 3, 10),
        (1e-300, 1.0, 5.0, -3, 10),
        (2.0, 3.0, 0.0, 0, 7),
        (1.0, 1.0, 1e-12, 4, 6),
        (1e-8, 1e8, 1.0, 2, 1000),
        (1e8, 1e-8, 1.0, -2, 1000),
    ],
)
def test_paper_step_cancellation_free(A, C, E, k, p):
    delta = paper_step(*(math.log(x) if x > 0 else -math.inf for x in (A, C, E)), k, p)
    assert math.isfinite(delta)
    z = _quadratic_root((p + k) * C, k * E, (k - p) * A)
    assert delta == pytest.approx(0.5 * math.log(z), rel=1e-12, abs=1e-13)


# ----------------------------------------------------------------------------------------------
# Constant g ⇒ u* = 0 (Prop. J.1)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_constant_g_network_gives_zero(nets, method):
    """Widths (3, 4, 3, 4), weights ±1, no bias: g_i = Π_{j ∉ ends of i} n_j = 12 for every i."""
    graph, params = nets.mlp(5, widths=(3, 4, 3, 4), bias=False)
    params = {k: torch.sign(v) for k, v in params.items()}
    dag = build_neuron_dag(graph, params)
    g = dag.diag_G()
    assert torch.allclose(g, g[0].expand_as(g), rtol=1e-14)
    groups = build_groups(graph, params)
    ob = oracle_objective(dag, groups)
    assert np.abs(ob.grad(np.zeros(groups.num_free))).max() <= 1e-12
    res = solve(groups, diag_g(groups), solver=method, tol=TOL)
    assert res.converged
    assert res.u.abs().max() <= 1e-12
    assert res.kkt_residual <= 1e-12


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "residual", "bottleneck", "concat", "grouped_conv"])
def test_constant_diag_gives_zero(nets, arch, method):
    """With g ≡ const the gradient −2p Bᵀw/S + 2Bᵀ1 vanishes at u = 0 for every B."""
    graph, params = nets.catalogue[arch](0)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    B = dag.dense_B(groups)
    ob = DenseObjective(np.full(dag.p, 0.3), B)
    assert np.abs(ob.grad(np.zeros(groups.num_free))).max() <= 1e-12
    assert own_kkt(ob, np.zeros(groups.num_free)) <= 1e-13
    constant = DiagG([torch.full(dp.value.shape, 0.3, dtype=torch.float64) for dp in groups.dag_params])
    res = solve(groups, constant, solver=method, tol=TOL)
    assert res.converged and res.u.abs().max() <= 1e-12
    assert res.objective[0] == pytest.approx(ob.value(np.zeros(groups.num_free)), rel=1e-12)


# ----------------------------------------------------------------------------------------------
# Degenerate groups
# ----------------------------------------------------------------------------------------------


def _dead_network(nets, case):
    graph, params = nets.mlp(7, widths=(3, 4, 3, 2))
    params = dict(params)
    if case == "dead_out":  # hidden neuron 1 of layer 1: every outgoing weight zero
        params["fc3.weight"] = params["fc3.weight"].clone()
        params["fc3.weight"][:, 1] = 0
        neuron = ("n", "fc1", 1)
    elif case == "dead_in":  # hidden neuron 2 of layer 2: every incoming weight and its bias zero
        params["fc3.weight"] = params["fc3.weight"].clone()
        params["fc3.bias"] = params["fc3.bias"].clone()
        params["fc3.weight"][2, :] = 0
        params["fc3.bias"][2] = 0
        neuron = ("n", "fc3", 2)
    else:
        raise ValueError(case)
    return graph, params, neuron


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", ["dead_out", "dead_in"])
def test_degenerate_groups_frozen(nets, case, method):
    graph, params, neuron = _dead_network(nets, case)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    ob = oracle_objective(dag, groups)
    h_dead = dag.group_columns(groups)[neuron]
    # the oracle's own notion of degeneracy: no positive g among +1 (or among −1) entries of B
    g_pos = np.isfinite(ob.log_g)
    A_zero = ~((ob.B > 0) & g_pos[:, None]).any(0)
    C_zero = ~((ob.B < 0) & g_pos[:, None]).any(0)
    expected = set(np.nonzero(A_zero | C_zero)[0].tolist())
    assert h_dead in expected
    diag = diag_g(groups)
    for lg in diag.log_g:
        assert not torch.isnan(lg).any()
    res = solve(groups, diag, solver=method, tol=TOL, max_iter=MAX_ITER)
    assert set(res.degenerate) == expected
    assert torch.isfinite(res.u).all()
    assert all(math.isfinite(v) for v in res.objective)
    assert math.isfinite(res.kkt_residual)
    for h in expected:
        assert float(res.u[h]) == 0.0
    assert res.converged
    # the other groups reach the minimum of F with the degenerate ones held at 0
    free = np.ones(groups.num_free, bool)
    free[list(expected)] = False
    u_star, f_star = ob.minimise(free=free)
    assert ob.value(res.u.numpy()) == pytest.approx(f_star, rel=1e-9)
    assert np.abs(res.u.numpy() - u_star).max() <= 1e-5
    # rescaling with it keeps the function and writes nothing non-finite
    changed = groups.apply(params, res.u)
    for t in changed.values():
        assert torch.isfinite(t).all()


# ----------------------------------------------------------------------------------------------
# Colouring
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,colours",
    [
        ("mlp", 2),
        ("residual", 2),
        ("conv_bn", 2),
        ("concat", None),
        ("conv_residual", 2),
        ("bottleneck", 3),
        ("mlp_bottleneck", 3),
        ("grouped_conv", 2),
        ("conv1d", 2),
        ("self_loop", None),
    ],
)
def test_colouring_is_proper(nets, arch, colours):
    graph, params = nets.catalogue[arch](0)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    B = dag.dense_B(groups)
    col = groups.colours.numpy()
    assert col.shape == (groups.num_free,)
    for i, row in enumerate(B):
        touched = np.nonzero(row)[0]
        assert len(set(col[touched].tolist())) == len(touched), (
            f"parameter {i} joins groups {touched} of colours {col[touched]}"
        )
    # engine counts agree with the oracle's B on the support (n_in = #(+1), n_out = #(−1) per
    # column, rows with g > 0: all of them on these networks)
    counts = support(groups, diag_g(groups).parts)
    assert (dag.diag_G() > 0).all()
    assert np.array_equal(counts.n_in.numpy(), (B > 0).sum(0))
    assert np.array_equal(counts.n_out.numpy(), (B < 0).sum(0))
    if colours is not None:
        assert groups.num_colours == colours
        if colours == 3:  # B really contains a triangle, so 3 is the minimum
            adj = (np.abs(B).T @ np.abs(B)) > 0
            np.fill_diagonal(adj, False)
            a = adj.astype(int)
            assert np.trace(a @ a @ a) > 0


# ----------------------------------------------------------------------------------------------
# Extreme dynamic range of g (SPEC §3/§5: never NaN/Inf, same F*)
# ----------------------------------------------------------------------------------------------


def _scaled_mlp(nets, factors, bias):
    graph, params = nets.mlp(1, widths=(2, 3, 3, 2), bias=bias)
    layers = [n.name for n in graph.nodes if n.op == "linear"]
    params = {k: v * factors[layers.index(k.split(".")[0])] for k, v in params.items()}
    return graph, params


def _extreme_cases() -> list:
    """(factors, bias, method). The first-order solvers start at u = 0 and cross the bias-free
    1e±300 network's ‖u*‖∞ ≈ 691 in about 2,000 iterations (4-6 s each): those three run under
    ``-m slow``; with biases, at 1e±100 and at 1e200 they run by default, as Newton does at every
    range."""
    ranges = {
        "1e30": (1e30, 1e-30, 1.0),
        "1e100": (1e100, 1e-100, 1.0),
        "1e150_1e150_1e-300": (1e150, 1e150, 1e-300),
        "all_1e200": (1e200,) * 3,
    }
    cases = []
    for range_id, factors in ranges.items():
        for bias, bias_id in ((False, "nobias"), (True, "bias")):
            for method in METHODS:
                slow = range_id == "1e150_1e150_1e-300" and not bias and method != "newton"
                marks = [pytest.mark.slow] if slow else []
                cases.append(pytest.param(factors, bias, method, marks=marks, id=f"{range_id}-{bias_id}-{method}"))
    return cases


@pytest.mark.parametrize(("factors", "bias", "method"), _extreme_cases())
def test_solvers_with_extreme_dynamic_range(nets, factors, bias, method):
    """Layer scales 1e±100 make g span ~1e400: the optimum u* has |u_h| ≈ 230–690 but is finite,
    F is coercive (every g_i > 0, nothing is degenerate) and scipy finds it on the oracle's
    log-domain F. Every solver must reach it without NaN, exceptions or spurious freezing."""
    graph, params = _scaled_mlp(nets, factors, bias)
    groups = build_groups(graph, params)
    key = ("extreme", factors, bias)
    if key not in _CACHE:  # the oracle's F and scipy's optimum, once for the four solvers
        dag = build_neuron_dag(graph, params)
        ob = oracle_objective(dag, groups, dag.log_diag_G())
        _CACHE[key] = (ob, *ob.minimise())
    ob, u_star, f_star = _CACHE[key]
    res = solve(groups, diag_g(groups), solver=method, tol=1e-8, max_iter=MAX_ITER)
    assert res.degenerate == []
    assert torch.isfinite(res.u).all(), f"{method}: u = {res.u}"
    assert all(math.isfinite(v) for v in res.objective)
    assert res.converged, f"{method}: KKT residual {res.kkt_residual}"
    assert ob.value(res.u.numpy()) == pytest.approx(f_star, rel=1e-9, abs=1e-9)
    assert np.abs(res.u.numpy() - u_star).max() <= 1e-4 * max(1.0, np.abs(u_star).max())


@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "residual", "concat", "grouped_conv", "self_loop", "conv1d"])
def test_engine_group_maps_equal_dense_B(nets, arch):
    """Each DagParam's exponent(u) (what every solver pass uses) equals the oracle's (Bu) rows."""
    graph, params = nets.catalogue[arch](0)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    B = dag.dense_B(groups)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    u_ext = groups.extend(u)
    parts = []
    for dp in groups.dag_params:
        e = dp.exponent(u_ext).expand(dp.view).reshape(dp.value.shape)
        if dp.self_loops is not None:  # masked entries are zero rows of B
            e = torch.where(dp.self_loops.expand(dp.view).reshape(dp.value.shape), torch.zeros_like(e), e)
        parts.append(e)
    assert np.allclose(to_theta_order(dag, groups, parts).numpy(), B @ u.numpy(), rtol=0, atol=1e-12)
