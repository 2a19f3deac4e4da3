"""Issue 38, review: the path-metric's bounds hold whatever float64 rounding does where a
difference is small beside its terms: a BatchNorm folded in whose shift cancels β against
scale·μ, or whose weight differs by an ulp; two separately balanced copies whose difference
cancels; and the printed numbers, rounded away from what they bound.

Oracles: exact path sums in mpmath at 80 digits (the BatchNorm folded exactly, its √ to 80
digits), exact rationals (``fractions.Fraction``) for bias-carrying MLPs, the printed text
read back as a decimal."""

from __future__ import annotations

import io
import itertools
import re
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch
from rich.console import Console
from torch import nn

from pathcond_cli.module_route import module_model
from pathcond_cli.report.render import compare_report, render_compare, summary_line
from pathcond_cli.toolkit import compare_models, prune

mpmath.mp.dps = 80


def _bn_net(
    fc1: list[list[float]],
    fc1_bias: list[float],
    gamma: list[float],
    beta: list[float],
    mean: list[float],
    var: list[float],
    fc2: list[list[float]],
    eps: float = 1e-5,
) -> nn.Module:
    """Linear → BatchNorm1d (eval) → ReLU → Linear in float64, with these values."""
    linear1, linear2 = nn.Linear(len(fc1[0]), len(fc1)).double(), nn.Linear(len(fc2[0]), len(fc2), bias=False).double()
    bn = nn.BatchNorm1d(len(fc1), eps=eps).double()
    with torch.no_grad():
        for tensor, values in (
            (linear1.weight, fc1),
            (linear1.bias, fc1_bias),
            (bn.weight, gamma),
            (bn.bias, beta),
            (bn.running_mean, mean),
            (bn.running_var, var),
            (linear2.weight, fc2),
        ):
            tensor.copy_(torch.tensor(values, dtype=torch.float64))
    return nn.Sequential(linear1, bn, nn.ReLU(), linear2).eval()


def _bn_paths(net: nn.Module) -> dict[tuple, mpmath.mpf]:
    """Φ of a :func:`_bn_net`, the BatchNorm folded exactly: input and bias paths."""
    linear1, bn, _, linear2 = net
    exact = lambda tensor: [mpmath.mpf(float(v)) for v in tensor.reshape(-1).tolist()]  # noqa: E731
    weight, bias = [exact(row) for row in linear1.weight], exact(linear1.bias)
    gamma, beta, mean, var = (exact(t) for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var))
    readout = [exact(row) for row in linear2.weight]
    scale = [g / mpmath.sqrt(v + mpmath.mpf(bn.eps)) for g, v in zip(gamma, var)]
    paths = {}
    for k, row in enumerate(readout):
        for j, w2 in enumerate(row):
            paths[("bias", j, k)] = ((bias[j] - mean[j]) * scale[j] + beta[j]) * w2
            for i, w1 in enumerate(weight[j]):
                paths[(i, j, k)] = w1 * scale[j] * w2
    return paths


def _bn_metric(net_a: nn.Module, net_b: nn.Module) -> mpmath.mpf:
    paths_a, paths_b = _bn_paths(net_a), _bn_paths(net_b)
    return sum(abs(paths_a[key] - paths_b[key]) for key in paths_a)


def _assert_bounds_hold(comparison, exact_metric) -> None:
    """The output-change bound is at least d; an inexact metric's lower bound at most d (an
    exact one is d within its relative rounding ρ)."""
    metric = comparison.metric
    if metric.exact:
        assert abs(mpmath.mpf(metric.lower) / exact_metric - 1) <= metric.rounding, (metric, exact_metric)
    else:
        assert mpmath.mpf(metric.lower or 0.0) <= exact_metric, (metric, exact_metric)
    assert mpmath.mpf(comparison.output_change_bound) >= exact_metric, (comparison.output_change_bound, exact_metric)


def _next_toward_zero(value: float) -> float:
    return float(np.nextafter(value, 0.0))


def test_a_weight_one_ulp_smaller_before_a_batchnorm_is_exact():
    """0.8.3 subtracted the two folded weights W·s and W'·s, each rounded: 'exact' printed
    1.110e-16 for a change of at least 1.26e-16. The difference is now taken before the fold."""
    rng = np.random.default_rng(0)
    for _ in range(12):
        fc1 = rng.uniform(0.5, 2, (2, 2)).tolist()
        gamma = rng.uniform(0.2, 0.9, 2).tolist()
        common = dict(
            fc1_bias=[0.0, 0.0], gamma=gamma, beta=[0.0, 0.0], mean=[0.0, 0.0], var=[1.0, 2.25], fc2=[[1.0, 1.0]]
        )
        smaller = [row[:] for row in fc1]
        smaller[0][0] = _next_toward_zero(fc1[0][0])
        net_a, net_b = _bn_net(fc1, **common), _bn_net(smaller, **common)
        comparison = compare_models(module_model(net_a, (2,)), module_model(net_b, (2,)), device="cpu")
        assert comparison.metric.exact
        exact_metric = _bn_metric(net_a, net_b)
        _assert_bounds_hold(comparison, exact_metric)


def _cancelling_shift(mean: float, shift: float) -> dict:
    """A BatchNorm whose β cancels scale·μ to ``shift``: its folded shift carries an absolute
    rounding of about u·|scale·μ|, far above a relative one of itself."""
    gamma, var = 1.3, 0.8
    return dict(
        fc1=[[1.0]],
        fc1_bias=[0.0],
        gamma=[gamma],
        beta=[mean * gamma / (var + 1e-5) ** 0.5 + shift],
        mean=[mean],
        var=[var],
        fc2=[[1.0]],
    )


@pytest.mark.parametrize(("mean", "ulps"), [(8e6, 3), (3.44e9, 2), (3.27e11, 1), (8.06e7, 1), (1.53e8, 1)])
def test_a_batchnorm_mean_some_ulps_apart_keeps_the_bound_above_the_change(mean, ulps):
    """0.8.3 printed "path-metric 0 · output change ≤ 0" with exit 0 (or exit 5, a "bug" in
    pathcond) for BatchNorm means a few ulps apart: the folded shifts' difference lost to their
    rounding. Each fold's rounding is now added to the difference."""
    first = _cancelling_shift(mean, 1.0)
    second = dict(first, mean=[mean + ulps * float(np.spacing(mean))])
    net_a, net_b = _bn_net(**first), _bn_net(**second)
    comparison = compare_models(module_model(net_a, (1,)), module_model(net_b, (1,)), device="cpu")
    exact_metric = _bn_metric(net_a, net_b)
    assert exact_metric > 0
    _assert_bounds_hold(comparison, exact_metric)
    assert not comparison.metric.exact


@pytest.mark.parametrize("mean", [5.8e7, 7.7e7, 1.2e9])
def test_the_lower_bound_allows_for_the_folds_rounding(mean):
    """0.8.3's lower bound |‖Φ(θ)‖₁ − ‖Φ(θ')‖₁| came out above d where the two folded shifts'
    rounding exceeded their true difference (a readout bias 1e-20 → 2e-20 breaks dominance)."""
    first = _cancelling_shift(mean, 1.0)
    second = dict(first, mean=[mean + float(np.spacing(mean))])
    net_a, net_b = _bn_net(**first), _bn_net(**second)
    for net, readout_bias in ((net_a, 1e-20), (net_b, 2e-20)):
        net[3].bias = nn.Parameter(torch.tensor([readout_bias], dtype=torch.float64))
    comparison = compare_models(module_model(net_a, (1,)), module_model(net_b, (1,)), device="cpu")
    exact_metric = _bn_metric(net_a, net_b) + mpmath.mpf(1e-20)
    assert mpmath.mpf(comparison.metric.lower or 0.0) <= exact_metric
    assert mpmath.mpf(comparison.metric.upper) >= exact_metric


def test_pruning_a_batchnorm_network_stays_exact():
    """Pruning keeps the statistics: the difference is taken before the fold, exact."""
    net = _bn_net(
        [[1.5, -0.25], [0.75, 2.0]],
        fc1_bias=[0.1, -0.2],
        gamma=[0.7, 1.1],
        beta=[0.3, -0.4],
        mean=[1e6, -3e5],
        var=[0.9, 1.7],
        fc2=[[1.0, -2.0]],
    )
    result = prune(module_model(net, (2,)), 0.5, device="cpu")
    assert result.metric.exact
    pruned = _bn_net(
        *(t.tolist() for t in (result.changed["0.weight"], net[0].bias)),
        **{
            name: getattr(net[1], key).tolist()
            for name, key in (("gamma", "weight"), ("beta", "bias"), ("mean", "running_mean"), ("var", "running_var"))
        },
        fc2=result.changed.get("3.weight", net[3].weight).tolist(),
    )
    exact_metric = _bn_metric(net, pruned)
    assert abs(mpmath.mpf(result.metric.lower) / exact_metric - 1) <= result.metric.rounding


def _mlp_with_biases(weights: list[np.ndarray], biases: list[np.ndarray]) -> nn.Module:
    layers: list[nn.Module] = []
    for index, (weight, bias) in enumerate(zip(weights, biases)):
        linear = nn.Linear(weight.shape[1], weight.shape[0]).double()
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weight))
            linear.bias.copy_(torch.from_numpy(bias))
        layers += [linear, nn.ReLU()] if index < len(weights) - 1 else [linear]
    return nn.Sequential(*layers).eval()


def _exact_paths(weights: list[np.ndarray], biases: list[np.ndarray]) -> dict[tuple, Fraction]:
    """Φ of a two-layer MLP with biases, in exact rationals."""
    first, second = ([[Fraction(float(v)) for v in row] for row in w] for w in weights)
    bias1, bias2 = ([Fraction(float(v)) for v in b] for b in biases)
    paths = {("b2", k): bias2[k] for k in range(len(second))}
    for k, j in itertools.product(range(len(second)), range(len(first))):
        paths[("b1", j, k)] = bias1[j] * second[k][j]
        for i in range(len(first[0])):
            paths[(i, j, k)] = first[j][i] * second[k][j]
    return paths


def test_two_balanced_copies_whose_difference_cancels_keep_the_upper_bound():
    """0.8.3 took |a − b| of two separately balanced copies, each carrying its own rounding: the
    upper bound fell below d in 5 of 12 cases (one printed "output change ≤ 0" for d = 1e-17).
    Each entry now adds the balancing's proven rounding of both copies."""
    rng = np.random.default_rng(5)
    for _ in range(12):
        weights = [
            rng.standard_normal((4, 3)) * 10 ** rng.uniform(-3, 3),
            rng.standard_normal((2, 4)) * 10 ** rng.uniform(-3, 3),
        ]
        biases = [rng.standard_normal(4), rng.standard_normal(2)]
        other = [w.copy() for w in weights]
        other[0][0, 0] = np.nextafter(other[0][0, 0], np.inf * np.sign(other[0][0, 0]))
        other[0][1, 1] = _next_toward_zero(other[0][1, 1])
        comparison = compare_models(
            module_model(_mlp_with_biases(weights, biases), (3,)),
            module_model(_mlp_with_biases(other, biases), (3,)),
            device="cpu",
        )
        assert not comparison.metric.exact
        paths_a, paths_b = _exact_paths(weights, biases), _exact_paths(other, biases)
        exact_metric = sum(abs(paths_a[key] - paths_b[key]) for key in paths_a)
        assert Fraction(comparison.metric.lower or 0.0) <= exact_metric
        assert Fraction(comparison.output_change_bound) >= exact_metric


def _report(comparison) -> dict:
    """The compare report, with the total time the command line adds before its summary line."""
    report = compare_report(comparison)
    report["seconds"]["total"] = sum(report["seconds"].values())
    return report


def _printed_number(pattern: str, text: str) -> Fraction:
    return Fraction(re.search(pattern, text).group(1))


def test_printed_bounds_round_away_from_what_they_bound():
    """0.8.3 printed "output change ≤ 1" (to 4 digits, to nearest) where the output changes by
    1.00004 at x = 1. Upper bounds now print rounded up, lower bounds down."""
    weight = 1.00004
    first = nn.Sequential(nn.Linear(1, 1, bias=False).double(), nn.ReLU(), nn.Linear(1, 1, bias=False).double())
    second = nn.Sequential(nn.Linear(1, 1, bias=False).double(), nn.ReLU(), nn.Linear(1, 1, bias=False).double())
    with torch.no_grad():
        for net, value in ((first, weight), (second, 0.0)):
            net[0].weight.fill_(value)
            net[2].weight.fill_(1.0)
    report = _report(compare_models(module_model(first.eval(), (1,)), module_model(second.eval(), (1,)), device="cpu"))
    change = Fraction(weight)  # at x = 1, exactly
    assert _printed_number(r"output change ≤ ([0-9.e+-]+)", summary_line(report)) >= change
    buffer = io.StringIO()
    render_compare(report, Console(file=buffer, width=200, color_system=None))
    assert _printed_number(r"at most ([0-9.e+-]+)", buffer.getvalue()) >= change


def test_printed_metric_bounds_bracket_the_metric():
    """A non-exact path-metric prints its lower bound rounded down and its upper one up, in the
    table and the summary."""
    rng = np.random.default_rng(7)
    weights = [rng.uniform(0.5, 2, (3, 2)), rng.uniform(0.5, 2, (1, 3))]
    biases = [np.zeros(3), np.zeros(1)]
    other = [w.copy() for w in weights]
    other[0][0, 0] *= 1.3
    other[0][1, 1] *= 0.6
    comparison = compare_models(
        module_model(_mlp_with_biases(weights, biases), (2,)),
        module_model(_mlp_with_biases(other, biases), (2,)),
        device="cpu",
    )
    report = _report(comparison)
    assert not report["path_metric"]["exact"]
    low, high = (Fraction(report["path_metric"][key]) for key in ("lower", "upper"))
    summary = re.search(r"path-metric ([0-9.e+-]+)\.\.([0-9.e+-]+)", summary_line(report))
    assert Fraction(summary.group(1)) <= low and Fraction(summary.group(2)) >= high
    buffer = io.StringIO()
    render_compare(report, Console(file=buffer, width=200, color_system=None))
    table = re.search(r"between ([0-9.e+-]+) and ([0-9.e+-]+)", buffer.getvalue())
    assert Fraction(table.group(1)) <= low and Fraction(table.group(2)) >= high
