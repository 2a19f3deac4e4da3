"""Newton solver pieces against independent oracles: F's Hessian (finite differences of the
oracle's gradient and the dense formula), accurate changes of F, the bounded (box) problem
against scipy's L-BFGS-B, the dtype storage check, and the CUDA path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from oracle import build_neuron_dag, oracle_objective
from scipy.optimize import minimize

from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.errors import StorageError
from pathcond_cli.rescaling import rescale
from pathcond_cli.solve.curvature import CoarseCorrection, LayerAggregates, ScaledHessian, newton_direction
from pathcond_cli.solve.dtype_limits import check_storage, ensure_storable, safe_log_scale
from pathcond_cli.solve.layer_shift import layer_shift_start
from pathcond_cli.solve.objective import Objective, degenerate_mask
from pathcond_cli.solve.options import BOUNDED_SOLVERS
from pathcond_cli.solve.solvers import solve

ARCHS = ["mlp", "conv_bn", "residual", "bottleneck", "concat", "self_loop", "grouped_conv"]


def _setup(nets, arch, seed=0):
    graph, params = nets.catalogue[arch](seed)
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    return graph, params, groups, oracle_objective(dag, groups)


def _hessian_matrix(objective: Objective, u: torch.Tensor) -> np.ndarray:
    """∇²F from the engine's operator, undamped: H = 4 D^{1/2} (M − r̂r̂ᵀ/p) D^{1/2}."""
    current = objective.evaluate(u)
    active = torch.ones_like(u, dtype=torch.bool)
    hessian = ScaledHessian(objective, u, current, active, reach=math.inf)
    sqrt_d = 1 / hessian.inverse_sqrt_d
    columns = [4 * sqrt_d * hessian(sqrt_d * e) for e in torch.eye(len(u), dtype=torch.float64)]
    return torch.stack(columns, dim=1).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_hessian_matches_finite_differences_and_formula(nets, arch):
    *_, groups, ob = _setup(nets, arch)
    rng = np.random.default_rng(5)
    u = rng.normal(scale=0.5, size=groups.num_free)
    engine = _hessian_matrix(Objective(groups, diag_g(groups)), torch.tensor(u))
    # central differences of the oracle's own gradient (its own g and dense B)
    eps = 1e-5
    fd = np.stack([(ob.grad(u + eps * e) - ob.grad(u - eps * e)) / (2 * eps) for e in np.eye(len(u))], axis=1)
    scale = np.abs(fd).max()
    assert np.abs(engine - fd).max() <= 1e-6 * scale
    # the closed form (4p/S) Bᵀ diag(w) B − (4p/S²)(Bᵀw)(Bᵀw)ᵀ
    w = np.exp(ob.log_g - 2 * ob.B @ u)
    S = w.sum()
    formula = 4 * ob.p / S * (ob.B.T * w) @ ob.B - 4 * ob.p / S**2 * np.outer(ob.B.T @ w, ob.B.T @ w)
    assert np.allclose(engine, formula, rtol=1e-10, atol=1e-10 * np.abs(formula).max())
    assert np.allclose(engine, engine.T, rtol=0, atol=1e-12 * scale)
    assert np.linalg.eigvalsh(formula).min() >= -1e-9 * scale


@pytest.mark.parametrize("arch", ["mlp", "self_loop", "bottleneck"])
def test_newton_direction_solves_the_newton_system(nets, arch):
    """Undamped, with a tight forcing term, CG returns H⁻¹∇F (dense solve of the oracle's H)."""
    *_, groups, ob = _setup(nets, arch)
    u = np.random.default_rng(2).normal(scale=0.3, size=groups.num_free)
    objective = Objective(groups, diag_g(groups))
    ut = torch.tensor(u)
    current = objective.evaluate(ut)
    hessian = ScaledHessian(objective, ut, current, torch.ones_like(ut, dtype=torch.bool), reach=math.inf)
    direction = newton_direction(hessian, current.gradient, forcing=1e-13, max_steps=10 * len(u)).numpy()
    w = np.exp(ob.log_g - 2 * ob.B @ u)
    S = w.sum()
    H = 4 * ob.p / S * (ob.B.T * w) @ ob.B - 4 * ob.p / S**2 * np.outer(ob.B.T @ w, ob.B.T @ w)
    expected = -np.linalg.solve(H, ob.grad(u))
    assert np.allclose(direction, expected, rtol=1e-7, atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("arch", ["bottleneck", "concat", "self_loop", "conv_bn", "grouped_conv", "residual"])
@pytest.mark.parametrize("inactive", [False, True])
def test_coarse_matrix_is_the_hessian_on_layer_aggregates(nets, arch, inactive):
    """E (as factorised) equals Zᵀ(M − r̂r̂ᵀ/p)Z computed column by column with the operator.

    With every group active E comes from the evaluation's row and column sums alone (no pass
    counted); with every other group left out (as if pinned at a bound) some tensor has an
    inactive group carrying weight on both sides and falls back to products with its coupling
    matrix."""
    *_, groups, ob = _setup(nets, arch)
    u = torch.tensor(np.random.default_rng(4).normal(scale=0.5, size=groups.num_free))
    active = (torch.arange(groups.num_free) % 2 == 1) if inactive else torch.ones_like(u, dtype=torch.bool)
    objective = Objective(groups, diag_g(groups))
    current = objective.evaluate(u)
    hessian = ScaledHessian(objective, u, current, active, reach=10.0)
    aggregates = LayerAggregates(objective)
    passes = objective.passes
    coarse = CoarseCorrection(hessian, aggregates, current)
    coarse.settle()  # the products, if any, are made when E is finished
    assert objective.passes - passes == (1 if inactive else 0)
    assert coarse.usable and aggregates.count >= 2
    columns = torch.stack([coarse.basis * (aggregates.of_group[:-1] == j) for j in range(aggregates.count)], dim=1)
    expected = columns.T @ torch.stack([hessian(c) for c in columns.T], dim=1)
    empty = columns.abs().sum(0) == 0
    expected += torch.diag(empty.to(torch.float64))
    assert torch.allclose(coarse.factor @ coarse.factor.T, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["mlp", "self_loop", "conv_bn", "concat"])
@pytest.mark.parametrize("size", [1e-1, 1e-5, 1e-10])
def test_change_of_f_is_accurate(nets, arch, size):
    """F(u+δ) − F(u) against a dense elementwise expm1/log1p evaluation of the same change."""
    *_, groups, ob = _setup(nets, arch)
    rng = np.random.default_rng(3)
    u, step = rng.normal(scale=0.5, size=groups.num_free), size * rng.normal(size=groups.num_free)
    objective = Objective(groups, diag_g(groups))
    current = objective.evaluate(torch.tensor(u))
    change = objective.change(torch.tensor(u), current, torch.tensor(step))
    lw = ob.log_g - 2 * ob.B @ u
    shares = np.exp(lw - lw.max())
    shares /= shares.sum()
    Bs = ob.B @ step
    expected = ob.p * math.log1p(float(np.sum(shares * np.expm1(-2 * Bs)))) + 2 * float(Bs.sum())
    assert change == pytest.approx(expected, rel=1e-8, abs=1e-14 * ob.p)
    if size == 1e-1:
        assert change == pytest.approx(ob.value(u + step) - ob.value(u), rel=1e-8)


def _box_optimum(ob, bound):
    H = ob.B.shape[1]
    res = minimize(
        ob.value,
        np.zeros(H),
        jac=ob.grad,
        method="L-BFGS-B",
        bounds=[(-bound, bound)] * H,
        options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-12, "maxcor": 50},
    )
    return res.x, res.fun


@pytest.mark.parametrize("arch", ["mlp", "residual", "bottleneck"])
def test_bounded_solvers_reach_scipy_box_optimum(nets, arch):
    """Layer scales 1e±6 put the unbounded optimum at |u| ≈ 7; with |u_h| ≤ 2 some groups sit on
    the bound, and every bounded solver reaches scipy's box-constrained minimum."""
    graph, params = nets.catalogue[arch](0)
    layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
    params = {k: v * (1e6 if k.startswith(layers[0] + ".") else 1.0) for k, v in params.items()}
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    ob = oracle_objective(dag, groups, dag.log_diag_G())
    bound = 2.0
    unbounded = solve(groups, diag_g(groups), tol=1e-10)
    assert unbounded.u_inf > bound
    u_box, f_box = _box_optimum(ob, bound)
    for method in BOUNDED_SOLVERS:
        res = solve(groups, diag_g(groups), solver=method, tol=1e-9, max_iter=20000, max_log_scale=bound)
        assert res.converged, (method, res.kkt_residual)
        assert res.u.abs().max() <= bound
        assert res.groups_at_bound >= 1
        assert res.groups_at_bound == int((np.abs(u_box) >= bound - 1e-9).sum())
        assert ob.value(res.u.numpy()) == pytest.approx(f_box, rel=1e-9)
        assert ob.value(res.u.numpy()) <= f_box + 1e-9 * abs(f_box)
        assert all(b <= a + 1e-12 * abs(a) for a, b in zip(res.objective, res.objective[1:]))


def test_bound_is_inactive_when_loose(nets):
    *_, groups, ob = _setup(nets, "conv_bn")
    free = solve(groups, diag_g(groups), tol=1e-10)
    boxed = solve(groups, diag_g(groups), tol=1e-10, max_log_scale=free.u_inf + 1)
    assert boxed.groups_at_bound == 0
    assert torch.allclose(free.u, boxed.u, atol=1e-7)


def test_lbfgs_refuses_a_bound(nets):
    *_, groups, ob = _setup(nets, "mlp")
    with pytest.raises(ValueError, match="unconstrained"):
        solve(groups, diag_g(groups), solver="lbfgs", max_log_scale=1.0)
    with pytest.raises(ValueError, match="≥ 0"):
        solve(groups, diag_g(groups), max_log_scale=float("nan"))


def test_max_iter_is_a_safety_cap(nets):
    *_, groups, ob = _setup(nets, "bottleneck")
    capped = solve(groups, diag_g(groups), tol=1e-14, max_iter=1)
    assert not capped.converged and capped.stopped_by_max_iter and capped.iterations == 1
    assert capped.kkt_residual > 1e-14 and capped.max_iter == 1 and capped.tol == 1e-14


def test_passes_count_hessian_products(nets):
    *_, groups, ob = _setup(nets, "bottleneck")
    res = solve(groups, diag_g(groups), tol=1e-10)
    # one evaluation per iteration plus at least one Hessian product per Newton step
    assert res.passes >= 2 * res.iterations + 1


def test_newton_freezes_degenerate_groups(nets):
    graph, params = nets.mlp(7, widths=(3, 4, 3, 2))
    params = dict(params)
    params["fc3.weight"] = params["fc3.weight"].clone()
    params["fc3.weight"][:, 1] = 0
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    res = solve(groups, diag, tol=1e-10)
    frozen = degenerate_mask(groups, diag)
    assert res.converged and set(res.degenerate) == set(torch.nonzero(frozen).flatten().tolist())
    assert all(float(res.u[h]) == 0.0 for h in res.degenerate)


# ----------------------------------------------------------------------------------------------
# Storage in the checkpoint's dtype
# ----------------------------------------------------------------------------------------------


def _half_mlp(nets):
    graph, params = nets.mlp(3, widths=(4, 6, 5, 3))
    return graph, {k: v.to(torch.float16) for k, v in params.items()}


def test_overflowing_tensor_is_refused_with_a_suggested_bound(nets):
    graph, params = _half_mlp(nets)
    groups = build_groups(graph, params)
    u = torch.zeros(groups.num_free, dtype=torch.float64)
    u[0] = 14.0  # e^14 ≈ 1.2e6 > float16's 65504
    changed = groups.apply(params, u)
    problems = check_storage(params, changed)
    assert problems and any(p.overflowed for p in problems) and all(p.lost for p in problems if p.overflowed)
    with pytest.raises(StorageError) as caught:
        ensure_storable("net.safetensors", groups, params, changed, 14.0)
    assert caught.value.exit_code == 8
    message = str(caught.value)
    overflowing = [p.key for p in problems if p.overflowed]
    assert all(f"'{key}'" in message for key in overflowing)
    assert "--max-log-scale auto" in message and "float16" in message and "Nothing was written" in message
    suggested = float(message.split("U = ")[1].split(",")[0])
    assert suggested == pytest.approx(safe_log_scale(groups, params), rel=1e-3)
    # the suggested bound really keeps every tensor in range, whatever u within the box
    for sign in (1.0, -1.0):
        bounded = groups.apply(params, torch.full_like(u, sign * suggested))
        assert check_storage(params, bounded) == []


def test_few_flushed_values_warn_many_refuse(nets):
    graph, params = _half_mlp(nets)
    groups = build_groups(graph, params)
    tiny = torch.finfo(torch.float16).tiny
    original = {**params, "big": torch.full((1000,), 2 * tiny, dtype=torch.float16)}
    changed = {"big": original["big"].clone()}
    changed["big"][:3] = tiny / 4  # subnormal
    changed["big"][3] = 0.0
    warnings = ensure_storable("net.safetensors", groups, original, changed, 1.0)
    assert len(warnings) == 1 and "'big'" in warnings[0] and "4 of its 1,000 normal values" in warnings[0]
    changed["big"][:20] = 0.0
    with pytest.raises(StorageError, match="'big'"):
        ensure_storable("net.safetensors", groups, original, changed, 1.0)


def test_a_flush_warning_never_names_the_auto_bound(nets):
    """auto bounds only a rescaling that loses values (which the other rules refuse): where a
    rescaling only flushes a few, auto writes the same values, so advising it, within the
    bound or beyond it, would send the user to a rerun that changes nothing."""
    graph, params = _half_mlp(nets)
    groups = build_groups(graph, params)
    bound = safe_log_scale(groups, params)
    tiny = torch.finfo(torch.float16).tiny
    original = {**params, "big": torch.full((1000,), 2 * tiny, dtype=torch.float16)}
    changed = {"big": original["big"].clone()}
    changed["big"][:3] = 0.0
    for u_inf in (bound / 2, bound * 2):
        warnings = ensure_storable("net.safetensors", groups, original, changed, u_inf)
        assert len(warnings) == 1 and "'big'" in warnings[0]
        assert "--max-log-scale" not in warnings[0] and "U = " not in warnings[0]


def test_none_beyond_the_auto_bound_warns_of_flushed_values_and_auto_writes_the_same():
    """The sample CNN in float16: its optimum (‖u‖∞ 1.14) is beyond the auto bound (1.02) and
    flushes 48 values, too few to lose a tensor; auto keeps that optimum, so the warning under
    none must not say that auto would bound it."""
    from pathlib import Path

    from safetensors.torch import load_file

    from pathcond_cli.model_files import load

    samples = Path(__file__).resolve().parents[2] / "sample_models"
    tensors = {k: v.to(torch.float16) for k, v in load_file(samples / "cifar_nv_small.safetensors").items()}
    graph = load(samples / "cifar_nv_small.safetensors", arch=str(samples / "cifar_nv_small.yaml")).graph
    model = LoadedModel(graph, tensors, "safetensors", "cifar_fp16.safetensors")
    unbounded = rescale(model, device="cpu", max_log_scale="none")
    auto = rescale(model, device="cpu", max_log_scale="auto")
    assert unbounded.solve.u_inf > safe_log_scale(unbounded.analysis.groups, tensors)
    assert not auto.bound.applied and auto.solve.u_inf == unbounded.solve.u_inf
    assert all(torch.equal(auto.changed[k], unbounded.changed[k]) for k in unbounded.changed)
    assert unbounded.warnings == auto.warnings
    assert len(unbounded.warnings) == 1 and "fall below their dtype's smallest normal" in unbounded.warnings[0]
    assert "--max-log-scale" not in unbounded.warnings[0] and "U = " not in unbounded.warnings[0]


def test_api_rescale_applies_bound_and_checks_dtypes(nets):
    graph, params = _half_mlp(nets)
    model = LoadedModel(graph, params, "safetensors", "net.safetensors")
    result = rescale(model, device="cpu", max_log_scale=0.05)
    assert result.solve.max_log_scale == 0.05 and result.solve.u_inf <= 0.05
    assert result.warnings == [] and result.verification.passed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["bottleneck", "concat", "self_loop"])
def test_cuda_solve_matches_cpu(nets, arch):
    *_, groups, ob = _setup(nets, arch)
    diag = diag_g(groups)
    cpu = solve(groups, diag, tol=1e-10)
    gpu = solve(groups, diag, tol=1e-10, device="cuda")
    assert gpu.converged and gpu.u.device.type == "cpu"
    assert gpu.objective[-1] == pytest.approx(cpu.objective[-1], rel=1e-11)
    assert torch.allclose(gpu.u, cpu.u, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def test_cli_max_log_scale_reports_the_bound(tmp_path):
    from cli_support import assert_clean_exit, invoke, parse_single_json, write_mlp

    checkpoint, spec = write_mlp(tmp_path)
    result = invoke(
        "rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--json", "--max-log-scale", "0.01"
    )
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["solver"]["name"] == "newton" and report["solver"]["max_log_scale"] == 0.01
    assert report["u_inf"] <= 0.01 and report["solver"]["groups_at_bound"] >= 1 and report["solver"]["converged"]
    refused = invoke(
        "rescale",
        checkpoint,
        "--arch",
        spec,
        "-o",
        tmp_path / "b.safetensors",
        "--solver",
        "lbfgs",
        "--max-log-scale",
        "1",
    )
    assert_clean_exit(refused, 2, "unconstrained")


def test_cli_refuses_a_rescaling_the_dtype_cannot_hold(tmp_path, monkeypatch):
    """Any u preserves the function in exact arithmetic; u = 14 on every group overflows
    float16, so with --max-log-scale none the write is refused with exit 8 (not 5: nothing
    failed to verify), the tensor named, the auto bound suggested, and --json still prints
    the report so far with its error."""
    from cli_support import assert_clean_exit, invoke, mlp_tensors, parse_single_json, write_mlp

    import pathcond_cli.rescaling as rescaling

    real_solve = rescaling.solve

    def far_out(*args, **kwargs):
        result = real_solve(*args, **kwargs)
        result.u = torch.full_like(result.u, 14.0)
        return result

    monkeypatch.setattr(rescaling, "solve", far_out)
    tensors = mlp_tensors((6, 8, 5, 3), dtype=torch.float16)
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors)
    target = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", target, "--max-log-scale", "none", "--json")
    stderr = assert_clean_exit(result, 8, "float16", "--max-log-scale auto", "nothing was written")
    assert "'" in stderr and not target.exists()
    document = parse_single_json(result.stdout)
    error = document["error"]
    assert error["exit_code"] == 8 and error["type"] == "StorageError" and "float16" in error["message"]
    assert " ".join(error["message"].split()) in " ".join(stderr.split())
    assert document["command"] == "rescale" and document["groups"]["free"] > 0 and document["output"] is None


LAYER_SHIFT_ARCHS = ["mlp", "residual", "bottleneck", "concat", "conv_bn", "self_loop", "grouped_conv"]


def _layer_shift_case(nets, arch, dead: bool):
    graph, params = nets.catalogue[arch](0)
    params = dict(params)
    layers = sorted({k.split(".")[0] for k in params if k.endswith("weight")})
    # layer scales 1e±4 put F's optimum far from 0 along layer shifts
    params = {
        k: v * (1e4 if k.startswith(layers[0] + ".") else 1e-4 if k.startswith(layers[-1] + ".") else 1.0)
        for k, v in params.items()
    }
    if dead:  # every weight out of one hidden unit of the first layer is zero: a frozen group
        second = next(k for k in params if k.startswith(layers[1] + ".") and k.endswith("weight"))
        params[second] = params[second].clone()
        params[second][:, 0] = 0
    dag = build_neuron_dag(graph, params)
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    return groups, diag, oracle_objective(dag, groups)


@pytest.mark.parametrize("arch, dead", [(arch, False) for arch in LAYER_SHIFT_ARCHS] + [("mlp", True)])
def test_layer_shift_start_minimises_f_over_layer_shifts(nets, arch, dead):
    """The start is constant over each layer aggregate, 0 on frozen groups, and attains the
    minimum of the oracle's F over that subspace (scipy on the dense F(Zc))."""
    groups, diag, ob = _layer_shift_case(nets, arch, dead)
    objective = Objective(groups, diag)
    frozen = degenerate_mask(groups, diag)
    assert bool(frozen.any()) == dead
    aggregates = LayerAggregates(objective)
    passes = objective.passes
    start = layer_shift_start(objective, aggregates.of_group, aggregates.count, frozen).numpy()
    assert objective.passes == passes + 1
    layer = aggregates.of_group[:-1].numpy()
    free = ~frozen.numpy()
    assert (start[~free] == 0).all()
    basis = np.zeros((groups.num_free, aggregates.count))
    basis[np.nonzero(free)[0], layer[free]] = 1.0
    used = basis.any(0)
    basis = basis[:, used]
    assert np.allclose(basis @ np.linalg.lstsq(basis, start, rcond=None)[0], start, rtol=0, atol=1e-12)
    res = minimize(
        lambda c: ob.value(basis @ c),
        np.zeros(basis.shape[1]),
        jac=lambda c: basis.T @ ob.grad(basis @ c),
        method="L-BFGS-B",
        options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-12},
    )
    assert ob.value(start) <= ob.value(np.zeros(groups.num_free))
    assert ob.value(start) == pytest.approx(res.fun, rel=1e-9, abs=1e-9)
    assert np.abs(start).max() > 1.0  # the scales really put the optimum away from 0


@pytest.mark.parametrize("arch", ["mlp", "bottleneck", "concat"])
def test_newton_takes_the_layer_shift_start_and_reaches_the_optimum(nets, arch):
    """Newton's first iterate is the layer-shift start (F drops at least as far as the oracle's
    minimum over layer shifts allows), and the solve still ends at the oracle's F*."""
    groups, diag, ob = _layer_shift_case(nets, arch, dead=False)
    res = solve(groups, diag, tol=1e-10)
    objective = Objective(groups, diag)
    aggregates = LayerAggregates(objective)
    start = layer_shift_start(objective, aggregates.of_group, aggregates.count, degenerate_mask(groups, diag))
    assert res.objective[1] == pytest.approx(ob.value(start.numpy()), rel=1e-12)
    _, f_star = ob.minimise()
    assert res.converged and res.objective[-1] == pytest.approx(f_star, rel=1e-10)
