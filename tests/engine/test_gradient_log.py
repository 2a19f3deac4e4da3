"""diag(G) of a large network keeps a wide convolution's log g as what it is computed from
(GradientLog: the layer's input and cotangent in the squared network, the kernel-summed ḡ, the
counts of g > 0 and the statistics), and recomputes log g when a report reads it.

Every quantity is compared with the same quantity from the log g tensors themselves (diag(G)
below its memory budget, as small networks have it), and must be identical: the recomputation
runs the same operations on the same numbers. The budget is set to 0 here, so that these small
networks (feature maps of 1–2 pixels, so that each layer's input and cotangent are smaller than
its weight) take the large networks' route.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from conftest import NetBuilder

import pathcond_cli.engine.diag as diag_module
from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.graph import Graph
from pathcond_cli.engine.groups import RescalingGroups, build_groups
from pathcond_cli.engine.log_g import DiagG, GradientLog, dense, has_nonzero, zero_count
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.report.plot import _layer_boxes
from pathcond_cli.report.render import rescale_report
from pathcond_cli.rescaling import rescale, rescaled_diag
from pathcond_cli.solve.objective import Objective, support
from pathcond_cli.solve.solvers import solve
from pathcond_cli.statistics import histogram, summarise

EXTREME = (1e150, 1e-30, 1e180, 1e-200)


def _scaled(graph: Graph, params: dict[str, torch.Tensor], scales) -> dict[str, torch.Tensor]:
    layers = [n.name for n in graph.nodes if n.op in ("linear", "conv", "conv_transpose")]
    factor = dict(zip(layers, scales))
    return {k: v * factor.get(k.split(".")[0], 1.0) for k, v in params.items()}


def _small_maps(seed: int, scales=(1.0,) * 4):
    """3×3 convolutions (one grouped) on 2×2 maps, a max-pool, then a Linear layer."""
    b = NetBuilder((8, 2, 2), seed)
    b.conv(16, 3, padding=1)
    b.relu()
    b.conv(16, 3, padding=1, groups=4)
    b.relu()
    b.conv(12, 3, padding=1)
    b.relu()
    b.maxpool(2)
    b.flatten()
    b.linear(3)
    graph, params = b.build()
    return graph, _scaled(graph, params, scales)


def _padding_taps(seed: int):
    """3×3 convolutions on a 1×1 map: eight taps of each kernel see only padding (g = 0)."""
    b = NetBuilder((8, 1, 1), seed)
    b.conv(16, 3, padding=1)
    b.relu()
    b.conv(12, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def _residual(seed: int):
    """A convolution that reads a stream and writes back into it: its weights within one group are self-loops."""
    b = NetBuilder((8, 2, 2), seed)
    stream = b.relu(b.conv(8, 3, padding=1))
    back = b.conv(8, 3, padding=1, src=stream)
    b.relu(b.add(stream, back))
    b.conv(10, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def _transposed_and_1d(seed: int):
    b = NetBuilder((8, 2), seed)
    b.conv(16, 3, padding=1)
    b.relu()
    b.conv_transpose(12, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


CASES = {
    "small_maps": lambda: _small_maps(0),
    "small_maps_extreme": lambda: _small_maps(1, EXTREME),
    "padding_taps": lambda: _padding_taps(2),
    "residual": lambda: _residual(3),
    "transposed_and_1d": lambda: _transposed_and_1d(4),
}
ALL = pytest.mark.parametrize("name", list(CASES))


@dataclass
class Case:
    graph: Graph
    params: dict[str, torch.Tensor]
    groups: RescalingGroups
    kept: DiagG  # with GradientLog parts
    tensors: DiagG  # the same diag(G) as tensors (below the budget)


@functools.lru_cache(maxsize=None)
def _case(name: str) -> Case:
    graph, params = CASES[name]()
    groups = build_groups(graph, params)
    tensors = diag_g(groups)
    original = diag_module.DENSE_LOG_G_BYTES
    diag_module.DENSE_LOG_G_BYTES = 0
    try:
        kept = diag_g(groups)
    finally:
        diag_module.DENSE_LOG_G_BYTES = original
    return Case(graph, params, groups, kept, tensors)


@ALL
def test_wide_convolutions_and_only_they_are_kept_as_their_gradient_and_recompute_the_same_bits(name):
    case = _case(name)
    assert not any(isinstance(part, GradientLog) for part in case.tensors.parts)
    kept = [part for part in case.kept.parts if isinstance(part, GradientLog)]
    assert kept
    for dp, part, reference in zip(case.groups.dag_params, case.kept.parts, case.tensors.parts):
        if isinstance(part, GradientLog):
            assert part.shape == tuple(dp.value.shape) and part.numel() == dp.numel
            assert torch.equal(part.dense(), reference) and torch.equal(part.dense(), reference)
            # nothing it holds is the size of the weight
            held = [part.gradient.x, part.gradient.cotangent, part.log_gbar, part.positive_taps]
            assert sum(t.numel() for t in held if t is not None) < dp.numel
        else:
            assert type(part) is type(reference)
            assert torch.equal(dense(part), dense(reference))
        assert zero_count(part) == zero_count(reference) and has_nonzero(part) == has_nonzero(reference)
    assert case.kept.any_nonzero() == case.tensors.any_nonzero()


def test_the_cases_reach_the_branches_they_are_for():
    """g = 0 on taps that see only padding (counted per kernel), ranges beyond float64, self-loops."""
    padded = [p for p in _case("padding_taps").kept.parts if isinstance(p, GradientLog)]
    assert all(p.positive_taps is not None and int(p.positive_taps.max()) == 1 for p in padded)
    assert all(p.positive_taps is None for p in _case("small_maps").kept.parts if isinstance(p, GradientLog))
    extreme = summarise(_case("small_maps_extreme").groups, _case("small_maps_extreme").kept.parts)
    assert extreme.ln_high - extreme.ln_low > 2 * math.log(torch.finfo(torch.float64).max)
    residual = _case("residual")
    assert any(
        dp.self_loops is not None and isinstance(part, GradientLog)
        for dp, part in zip(residual.groups.dag_params, residual.kept.parts)
    )


@ALL
def test_summary_histogram_and_plot_samples_are_identical(name):
    case = _case(name)
    got, want = summarise(case.groups, case.kept.parts), summarise(case.groups, case.tensors.parts)
    assert got == want
    assert histogram(case.kept.parts, got.ln_low, got.ln_high, bins=9) == histogram(
        case.tensors.parts, want.ln_low, want.ln_high, bins=9
    )
    boxes, reference = (
        _layer_boxes(case.groups, case.kept.parts, got),
        _layer_boxes(case.groups, case.tensors.parts, want),
    )
    assert list(boxes) == list(reference)
    for layer in boxes:
        assert str(boxes[layer]) == str(reference[layer]), layer  # NaN equal to NaN


@ALL
def test_rescaled_diag_summary_and_histogram_are_identical(name):
    case = _case(name)
    u = torch.randn(case.groups.num_free, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    got, want = rescaled_diag(case.groups, case.kept, u), rescaled_diag(case.groups, case.tensors, u)
    for part, reference in zip(got.parts, want.parts):
        assert torch.equal(dense(part), dense(reference))
    after, reference = summarise(case.groups, got.parts), summarise(case.groups, want.parts)
    assert after == reference
    assert histogram(got.parts, after.ln_low, after.ln_high) == histogram(want.parts, after.ln_low, after.ln_high)


@ALL
def test_support_objective_and_solution_are_identical(name):
    case = _case(name)
    got, want = support(case.groups, case.kept.parts), support(case.groups, case.tensors.parts)
    assert got.size == want.size
    assert torch.equal(got.n_in, want.n_in) and torch.equal(got.n_out, want.n_out)
    kept, tensors = Objective(case.groups, case.kept), Objective(case.groups, case.tensors)
    assert torch.equal(kept.self_loop_log, tensors.self_loop_log)
    u = torch.randn(case.groups.num_free, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    a, b = kept.evaluate(u), tensors.evaluate(u)
    assert a.value == b.value and a.kkt_residual == b.kkt_residual
    assert torch.equal(a.gradient, b.gradient) and torch.equal(a.log_a, b.log_a) and torch.equal(a.log_c, b.log_c)
    # Equal bits after every step: 100 of them show it as well as block's default cap of 1,000,
    # which the extreme case reaches unconverged (2 s a run); Newton converges within 10.
    for solver in ("newton", "block"):
        x, y = (solve(case.groups, diag, solver=solver, max_iter=100) for diag in (case.kept, case.tensors))
        assert torch.equal(x.u, y.u) and x.objective == y.objective, solver


@pytest.mark.parametrize("name", ["small_maps", "padding_taps"])
def test_rescale_reports_are_identical(name, monkeypatch):
    """The whole ``rescale`` report, through the API, with diag(G) kept each way."""
    case = _case(name)

    def report() -> dict:
        model = LoadedModel(case.graph, dict(case.params), "safetensors", "net.safetensors")
        result = rescale(model, device="cpu")
        document = rescale_report(result, None, {})
        parts = result.analysis.diag.parts
        return document, parts

    want, tensors = report()
    monkeypatch.setattr(diag_module, "DENSE_LOG_G_BYTES", 0)
    got, kept = report()
    assert any(isinstance(part, GradientLog) for part in kept)
    assert not any(isinstance(part, GradientLog) for part in tensors)
    for document in (got, want):
        document.pop("seconds", None)
        document.pop("timings", None)
    assert got == want
