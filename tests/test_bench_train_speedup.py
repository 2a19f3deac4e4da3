"""Smoke test of benchmarks/train_speedup.py's helpers (the training run itself is a benchmark)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train_speedup.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_speedup", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("alpha", [0.05, 1.0, 1e4])
def test_dirichlet_widths_spend_the_budget_with_at_least_one_neuron_each(bench, alpha):
    rng = np.random.default_rng(3)
    for _ in range(20):
        widths = bench.dirichlet_widths(rng, alpha)
        assert len(widths) == 8 and sum(widths) == 256 and min(widths) >= 1
    if alpha == 1e4:
        assert max(widths) - min(widths) <= 3


def test_epochs_to_target(bench):
    curve = np.array([3.0, 2.0, 1.0, 0.5, math.nan])
    assert bench.epochs_to_target(curve, 1.0) == 2
    assert bench.epochs_to_target(curve, 0.1) is None


def test_rescaled_copies_start_from_the_same_loss_and_train(bench):
    torch.manual_seed(0)
    images, labels = torch.rand(40, 6), torch.randint(0, 3, (40,))
    initial = bench.kaiming_init(bench.mlp((6, 9, 4, 3)), seed=1)
    before = {k: v.clone() for k, v in initial.state_dict().items()}
    curves, norms = {}, {}
    for method in bench.METHODS:
        model, norms[method] = bench.rescaled_copy(initial, method, 6)
        curves[method] = bench.train(model, "classify", images, labels, lr=0.05, epochs=3, batch=16, seed=0)
    assert norms["baseline"] == 0.0 and norms["pathcond"] > 0 and norms["enorm"] > 0
    assert all(len(c) == 4 for c in curves.values())
    assert max(c[0] for c in curves.values()) - min(c[0] for c in curves.values()) <= 1e-6
    assert curves["enorm"][1:] != curves["baseline"][1:], "rescaling must change the training trajectory"
    assert all(torch.equal(before[k], v) for k, v in initial.state_dict().items()), "the initial model must stay as drawn"


def test_diverging_run_is_cut_and_padded(bench):
    images, labels = torch.rand(20, 4), torch.randint(0, 2, (20,))
    model = bench.kaiming_init(bench.mlp((4, 8, 2)), seed=0)
    curve = bench.train(model, "classify", images, labels, lr=1e6, epochs=5, batch=20, seed=0)
    assert len(curve) == 6 and math.isfinite(curve[0]) and math.isnan(curve[-1])


def test_results_round_trip_and_no_target_when_the_baseline_does_not_learn(bench):
    runs = bench.Runs({("s", 0.1, "baseline"): np.array([[2.0, 1.9], [2.0, 1.95]])}, {("s", "pathcond"): [1.0]})
    again = bench.Runs.from_json(runs.to_json())
    assert np.array_equal(again.curves[("s", 0.1, "baseline")], runs.curves[("s", 0.1, "baseline")])
    assert math.isnan(bench.target_for(again, "s", 0.1, slack=1.1))
    assert bench.target_for(again, "s", 0.1, slack=1.0) == pytest.approx(1.925)
