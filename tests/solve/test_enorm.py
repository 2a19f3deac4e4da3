"""ENorm (SPEC §7) against scipy on Σθ²e^{2Bu} built from the oracle's own θ and dense B;
function preservation, canonical representative, degenerate groups, API and CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import safetensors
import torch
from cli_support import SAMPLES, assert_clean_exit, check_report, invoke, parse_single_json, write_mlp
from oracle import build_neuron_dag
from scipy.optimize import minimize
from scipy.special import logsumexp
from test_invariance import assert_same_tensors, max_output_error, random_u

import pathcond_cli
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.solve.enorm import enorm
from pathcond_cli.verify import compare

ARCHS = [
    "mlp",
    "mlp_nobias_transposed",
    "conv_maxpool",
    "residual",
    "conv_residual",
    "conv_bn",
    "bottleneck",
    "mlp_bottleneck",
    "concat",
    "self_loop",
    "grouped_conv",
    "conv1d",
]
TOL = 1e-11
MAX_ITER = 20000


class DenseEnorm:
    """ln E(u) = ln Σ_i θ_i² e^{2(Bu)_i} with the oracle's θ and explicit B (p × H)."""

    def __init__(self, theta: np.ndarray, B: np.ndarray):
        with np.errstate(divide="ignore"):
            self.log_sq = 2 * np.log(np.abs(theta))
        self.B = B

    def value(self, u) -> float:
        return float(logsumexp(self.log_sq + 2 * self.B @ u))

    def grad(self, u) -> np.ndarray:
        z = self.log_sq + 2 * self.B @ u
        return 2 * self.B.T @ np.exp(z - logsumexp(z))

    def minimise(self, free: np.ndarray | None = None):
        """scipy L-BFGS-B, then Newton polish on the exact Hessian (tiny H)."""
        H = self.B.shape[1]
        mask = np.ones(H, bool) if free is None else free

        def full(v):
            u = np.zeros(H)
            u[mask] = v
            return u

        res = minimize(
            lambda v: self.value(full(v)),
            np.zeros(int(mask.sum())),
            jac=lambda v: self.grad(full(v))[mask],
            method="L-BFGS-B",
            options={"maxiter": 20000, "ftol": 1e-16, "gtol": 1e-13},
        )
        v = res.x
        Bm = self.B[:, mask]
        for _ in range(20):
            z = self.log_sq + 2 * self.B @ full(v)
            w = np.exp(z - logsumexp(z))
            mean = Bm.T @ w
            hess = 4 * ((Bm * w[:, None]).T @ Bm - np.outer(mean, mean))
            v = v - np.linalg.solve(hess + 1e-14 * np.eye(len(v)), 2 * mean)
        return full(v), self.value(full(v))


_CACHE: dict = {}


def setup(nets, arch):
    if arch not in _CACHE:
        graph, params = nets.catalogue[arch](0)
        dag = build_neuron_dag(graph, params)
        groups = build_groups(graph, params)
        dense = DenseEnorm(dag.theta.numpy(), dag.dense_B(groups))
        _CACHE[arch] = (graph, params, groups, dense, *dense.minimise())
    return _CACHE[arch]


def enorm_params(graph, params):
    groups = build_groups(graph, params)
    result = enorm(groups, tol=TOL, max_iter=MAX_ITER)
    assert result.converged, result.kkt_residual
    return {**params, **groups.apply(params, result.u)}, result


@pytest.mark.parametrize("arch", ARCHS)
def test_enorm_reaches_scipy_optimum(nets, arch):
    graph, params, groups, dense, u_star, log_e_star = setup(nets, arch)
    result = enorm(groups, tol=TOL, max_iter=MAX_ITER)
    u = result.u.numpy()
    assert result.converged and result.method == "enorm" and result.degenerate == []
    assert result.objective[0] == pytest.approx(dense.value(np.zeros(groups.num_free)), rel=1e-13, abs=1e-13)
    assert result.objective[-1] == pytest.approx(dense.value(u), rel=1e-12, abs=1e-12)
    assert dense.value(u) == pytest.approx(log_e_star, rel=1e-12, abs=1e-12)
    assert np.abs(u - u_star).max() <= 1e-7
    # the reported residual is max_h |A'_h − C'_h| / (A'_h + C'_h), from the oracle's B
    w = np.exp(dense.log_sq + 2 * dense.B @ u)
    incoming, outgoing = (dense.B > 0).T @ w, (dense.B < 0).T @ w
    assert result.kkt_residual == pytest.approx(np.max(np.abs(incoming - outgoing) / (incoming + outgoing)), abs=1e-13)
    # exact block minimisations: ln E never increases
    assert all(b <= a + 1e-14 for a, b in zip(result.objective, result.objective[1:]))
    assert result.u_inf == pytest.approx(np.abs(u).max())


def test_single_hidden_neuron_balances_the_two_weights(nets):
    """1 → 1 → 1 without bias: E = a²e^{2u} + b²e^{−2u} is minimal at e^{4u} = b²/a², both weights √|ab|."""
    builder = nets.builder((1,), seed=0)
    builder.linear(1, bias=False)
    builder.relu()
    builder.linear(1, bias=False)
    graph, params = builder.build()
    a, b = 1e-3, 40.0
    weights = [k for k in params if k.endswith("weight")]
    params = {
        weights[0]: torch.tensor([[a]], dtype=torch.float64),
        weights[1]: torch.tensor([[-b]], dtype=torch.float64),
    }
    rescaled, result = enorm_params(graph, params)
    assert float(result.u[0]) == pytest.approx(0.25 * math.log(b**2 / a**2), rel=1e-12)
    assert float(rescaled[weights[0]]) == pytest.approx(math.sqrt(a * b), rel=1e-12)
    assert float(rescaled[weights[1]]) == pytest.approx(-math.sqrt(a * b), rel=1e-12)
    assert result.iterations == 1


@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "residual", "bottleneck", "concat", "self_loop"])
def test_enorm_preserves_the_function(nets, arch):
    graph, params = nets.catalogue[arch](0)
    rescaled, result = enorm_params(graph, params)
    assert result.u_inf > 1e-3, "ENorm changed nothing: the test would not notice a broken write-back"
    assert max_output_error(graph, params, rescaled) <= 1e-12
    if arch == "conv_bn":
        assert max_output_error(graph, params, rescaled, train=True) <= 1e-12


@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "residual", "bottleneck", "self_loop"])
def test_enorm_is_a_canonical_representative(nets, arch):
    """ENorm(Dθ) = ENorm(θ) as parameter vectors for any admissible rescaling D."""
    graph, params = nets.catalogue[arch](0)
    reference, _ = enorm_params(graph, params)
    for seed in (1, 2):
        moved = {**params, **build_groups(graph, params).apply(params, random_u(build_groups(graph, params), seed))}
        assert max_output_error(graph, params, moved) <= 1e-12
        again, _ = enorm_params(graph, moved)
        assert_same_tensors(reference, again, rtol=1e-8)


@pytest.mark.parametrize(
    "factors",
    [(1e100, 1e-100, 1.0), (1e150, 1e150, 1e-300), (1e200,) * 3],
    ids=["1e100", "1e150_1e150_1e-300", "all_1e200"],
)
def test_extreme_weights_stay_finite(nets, factors):
    """Σθ² is outside float64's range; the log-domain updates still reach the scipy optimum."""
    graph, params = nets.mlp(1, widths=(2, 3, 3, 2), bias=True)
    layers = [n.name for n in graph.nodes if n.op == "linear"]
    params = {k: v * factors[layers.index(k.split(".")[0])] for k, v in params.items()}
    groups = build_groups(graph, params)
    dag = build_neuron_dag(graph, params)
    dense = DenseEnorm(dag.theta.numpy(), dag.dense_B(groups))
    u_star, log_e_star = dense.minimise()
    result = enorm(groups, tol=1e-10, max_iter=MAX_ITER)
    assert result.converged and torch.isfinite(result.u).all()
    assert all(math.isfinite(v) for v in result.objective)
    assert result.objective[-1] == pytest.approx(log_e_star, rel=1e-12)
    assert np.abs(result.u.numpy() - u_star).max() <= 1e-6 * max(1.0, np.abs(u_star).max())
    for tensor in groups.apply(params, result.u).values():
        assert torch.isfinite(tensor).all()


@pytest.mark.parametrize("case", ["dead_out", "dead_in"])
def test_degenerate_groups_frozen_and_reported(nets, case):
    graph, params = nets.mlp(7, widths=(3, 4, 3, 2))
    params = {k: v.clone() for k, v in params.items()}
    if case == "dead_out":
        params["fc3.weight"][:, 1] = 0
    else:
        params["fc3.weight"][2, :] = 0
        params["fc3.bias"][2] = 0
    groups = build_groups(graph, params)
    dag = build_neuron_dag(graph, params)
    dense = DenseEnorm(dag.theta.numpy(), dag.dense_B(groups))
    nonzero = np.isfinite(dense.log_sq)[:, None]
    expected = np.nonzero(~((dense.B > 0) & nonzero).any(0) | ~((dense.B < 0) & nonzero).any(0))[0].tolist()
    assert len(expected) == 1
    result = enorm(groups, tol=TOL, max_iter=MAX_ITER)
    assert result.degenerate == expected and float(result.u[expected[0]]) == 0.0
    assert result.converged
    free = np.ones(groups.num_free, bool)
    free[expected] = False
    u_star, _ = dense.minimise(free)
    assert np.abs(result.u.numpy() - u_star).max() <= 1e-7
    assert max_output_error(graph, params, {**params, **groups.apply(params, result.u)}) <= 1e-12


def test_max_iter_zero_reports_the_start(nets):
    graph, params, groups, dense, *_ = setup(nets, "mlp")
    result = enorm(groups, max_iter=0)
    assert result.iterations == 0 and not result.converged and result.u.abs().max() == 0
    assert result.objective == [pytest.approx(dense.value(np.zeros(groups.num_free)), rel=1e-13)]


# -- Python API ---------------------------------------------------------------------------------


def test_rescale_module_with_enorm_criterion():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)
    ).double()
    x = torch.randn(11, 5, dtype=torch.float64)
    before = model(x).detach()
    norms = sum(float((p.detach() ** 2).sum()) for p in model.parameters())
    result = pathcond_cli.rescale_module(model, input_shape=(5,), criterion="enorm")
    assert result.criterion == "enorm" and result.solve.method == "enorm" and result.solve.converged
    assert torch.allclose(model(x), before, rtol=1e-12, atol=1e-12)
    assert math.log(norms) == pytest.approx(result.solve.objective[0], rel=1e-12)
    assert sum(float((p.detach() ** 2).sum()) for p in model.parameters()) == pytest.approx(
        math.exp(result.solve.objective[-1]), rel=1e-12
    )
    assert result.solve.objective[-1] < result.solve.objective[0]


def test_api_rejects_unknown_criterion_and_a_pathcond_solver_with_enorm():
    loaded = pathcond_cli.load(SAMPLES / "mlp.safetensors", arch=str(SAMPLES / "mlp.yaml"))
    with pytest.raises(ValueError, match="criterion"):
        pathcond_cli.rescale(loaded, criterion="l1")
    with pytest.raises(ValueError, match="ENorm"):
        pathcond_cli.rescale(loaded, criterion="enorm", solver="sequential")


# -- command line -------------------------------------------------------------------------------


def test_cli_criterion_enorm_end_to_end(tmp_path):
    out = tmp_path / "mlp.enorm.safetensors"
    result = invoke(
        "rescale",
        SAMPLES / "mlp.safetensors",
        "--arch",
        SAMPLES / "mlp.yaml",
        "-o",
        out,
        "--criterion",
        "enorm",
        "--json",
    )
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    check_report(report, rescale=True)
    assert report["criterion"] == "enorm"
    assert report["solver"]["name"] == "enorm" and report["solver"]["converged"] is True
    assert report["solver"]["objective_final"] < report["solver"]["objective_initial"]
    assert report["u_inf"] > 0.1
    assert report["verification"]["passed"] is True
    with safetensors.safe_open(str(out), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["pathcond.criterion"] == "enorm" and metadata["pathcond.solver"] == "enorm"
    # the written file, reloaded on its own (embedded spec), computes the original function
    original = pathcond_cli.load(SAMPLES / "mlp.safetensors", arch=str(SAMPLES / "mlp.yaml"))
    written = pathcond_cli.load(out)
    assert compare(original.graph, original.params, written.params).passed
    # and it is ENorm's fixed point: rescaling it again with ENorm barely moves it
    again = invoke("rescale", out, "-o", tmp_path / "again.safetensors", "--criterion", "enorm", "--json")
    assert_clean_exit(again, 0)
    assert parse_single_json(again.stdout)["u_inf"] < 1e-5


def test_cli_default_criterion_is_pathcond_and_recorded(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "out.safetensors"
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", out, "--json", "--report", tmp_path / "r.json")
    assert_clean_exit(result, 0)
    assert parse_single_json(result.stdout)["criterion"] == "pathcond"
    assert json.loads((tmp_path / "r.json").read_text())["criterion"] == "pathcond"
    with safetensors.safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["pathcond.criterion"] == "pathcond"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--criterion", "l1"], "--criterion"),
        (["--criterion", "enorm", "--solver", "block"], "--solver"),
    ],
)
def test_cli_criterion_usage_errors(tmp_path, args, needle):
    result = invoke(
        "rescale",
        SAMPLES / "mlp.safetensors",
        "--arch",
        SAMPLES / "mlp.yaml",
        "-o",
        tmp_path / "out.safetensors",
        *args,
    )
    assert result.exit_code == 2 and needle in result.stderr
    assert not (tmp_path / "out.safetensors").exists()
