"""Smoke test of benchmarks/train_speedup.py's helpers (the training run itself is a benchmark)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_speedup.py"


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
    assert all(torch.equal(before[k], v) for k, v in initial.state_dict().items()), (
        "the initial model must stay as drawn"
    )


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


def test_placebo_is_the_per_layer_mean_of_u_star_and_preserves_the_function(bench):
    u = torch.tensor([1.0, 3.0, -2.0, 0.0, 5.0], dtype=torch.float64)
    assert bench.per_layer_mean(u, ["0:0", "0:1", "2:0", "2:1", "b.c:0"]).tolist() == [2.0, 2.0, -1.0, -1.0, 5.0]
    initial = bench.kaiming_init(bench.mlp((6, 9, 4, 3)), seed=1)
    placebo, placebo_norm = bench.rescaled_copy(initial, "placebo", 6)
    pathcond_copy, _ = bench.rescaled_copy(initial, "pathcond", 6)
    x = torch.rand(16, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(placebo(x), initial(x), rtol=1e-5, atol=1e-6)
    # one scale per layer: the rescaled weights are the original ones times a per-layer factor pair
    ratio = placebo[2].weight / initial[2].weight
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-5)
    assert 0 < placebo_norm and not torch.allclose(placebo[2].weight, pathcond_copy[2].weight)


def test_seed_table_counts_stalled_seeds_apart(bench):
    curves = {
        "baseline": np.array([[2.0, 1.0, 0.5], [2.0, 1.9, 1.9], [2.0, 1.0, 0.4]]),  # seed 1 stalls
        "pathcond": np.array([[2.0, 0.5, 0.25], [2.0, 0.5, 0.3], [2.0, 1.0, 0.4]]),
        "placebo": np.array([[2.0, 1.0, 0.5], [2.0, 1.0, 0.35], [2.0, 1.0, math.nan]]),  # seed 2 diverges
        "enorm": np.array([[2.0, 1.0, 0.5], [2.0, 0.9, 0.3], [2.0, 1.0, 0.4]]),
    }
    runs = bench.Runs({("s", 0.1, m): c for m, c in curves.items()}, {})
    assert {m: v.tolist() for m, v in bench.stalled(runs, "s", 0.1).items()} == {
        "baseline": [False, True, False],
        "pathcond": [False, False, False],
        "placebo": [False, False, True],
        "enorm": [False, False, False],
    }
    [row] = bench.seed_table(runs, [bench.Setting("s", (1, 1), "classify")], [0.1], slack=1.1)
    assert row["stalled"] == {"baseline": 1, "pathcond": 0, "placebo": 1, "enorm": 0}
    assert row["clean_pathcond"] == 2 and row["ratio_pathcond"] == pytest.approx(np.median([0.5, 1.0]))
    assert row["speedup_pathcond"] == pytest.approx(np.median([2 / 1, 1.0]))
    assert row["clean_placebo"] == 1 and row["ratio_placebo"] == 1.0
    flat = bench.Runs({("f", 0.1, m): np.array([[2.0, 2.0, 2.0]]) for m in bench.METHODS}, {})
    [row] = bench.seed_table(flat, [bench.Setting("f", (1, 1), "classify")], [0.1], slack=1.1)
    assert row["ratio_pathcond"] == 1.0 and row["speedup_pathcond"] is None, (
        "no target where the baseline did not learn"
    )
