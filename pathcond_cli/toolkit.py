"""The path-lifting toolkit's API (SPEC §8, seeds 002 and 004): compare two checkpoints of one
architecture through the ℓ1 path-metric, and prune a checkpoint by path magnitude.

    import pathcond_cli as pathcond

    comparison = pathcond.compare_models(pathcond.load("a.onnx"), pathcond.load("a.fp16.onnx"))
    pruned = pathcond.prune(pathcond.load("a.onnx"), sparsity=0.5)
    pathcond.save_pruned(pruned, "a.pruned.onnx")        # staged, reloaded, verified
"""

from __future__ import annotations

import math
import time
from collections import ChainMap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .api import DEFAULT_PATH_NORMS, LOG10_E, Stopwatch, path_norm_orders, path_norms_of, resolve_device, write_staged
from .engine.diag import PathNorm, balancing_exponents, path_magnitude_scores
from .engine.evaluate import forward
from .engine.graph import Graph, Input
from .engine.groups import build_groups
from .engine.model import LoadedModel
from .engine.pathlift import (
    PRUNING_CRITERIA, PathMetric, SignComparison, compare_signs, exp_or_none, ln_difference, magnitude_keys, non_relu_activations,
    path_metric, prunable, select_pruned, stored_weight_mask,
)
from .errors import MismatchError, PathcondError, VerificationError
from .io.formats import load_model
from .verify import independent_agreement

# Inputs drawn in the box ‖x‖∞ ≤ R to measure an output change: half uniform, half corners (±R).
SAMPLED_INPUTS = 16
LARGE_INPUT = 16384
SAMPLED_LARGE_INPUTS = 4
# What float64 evaluation of both networks may add to a measured output change, relative to
# the outputs' size, before it counts against a bound.
EVALUATION_SLACK = 1e-9


def check_same_architecture(a: LoadedModel, b: LoadedModel) -> None:
    """Refuse two models whose DAGs differ: node by node (type, hyper-parameters, wiring by
    position), then the tensors the graphs read (names and shapes). :class:`MismatchError`
    names the first difference."""
    nodes_a, nodes_b = a.graph.nodes, b.graph.nodes
    if len(nodes_a) != len(nodes_b):
        raise MismatchError(f"'{a.source}' has {len(nodes_a)} nodes and '{b.source}' {len(nodes_b)}: not one "
                            "architecture. Nothing was compared.")
    position_a = {node.name: i for i, node in enumerate(nodes_a)}
    position_b = {node.name: i for i, node in enumerate(nodes_b)}
    for index, (node_a, node_b) in enumerate(zip(nodes_a, nodes_b)):
        difference = _node_difference(node_a, node_b, position_a, position_b)
        if difference:
            raise MismatchError(
                f"'{a.source}' and '{b.source}' differ at node {index + 1} of {len(nodes_a)} ('{node_a.name}' / "
                f"'{node_b.name}'): {difference}. compare needs one architecture. Nothing was compared.")
    keys_a, keys_b = a.graph.parameter_keys(), b.graph.parameter_keys()
    for key_a, key_b in zip(keys_a, keys_b):
        if key_a != key_b:
            raise MismatchError(f"'{a.source}' reads tensor '{key_a}' where '{b.source}' reads '{key_b}': the "
                                "tensor names differ. Nothing was compared.")
        shape_a, shape_b = tuple(a.params[key_a].shape), tuple(b.params[key_b].shape)
        if shape_a != shape_b:
            raise MismatchError(f"tensor '{key_a}' has shape {list(shape_a)} in '{a.source}' and {list(shape_b)} in "
                                f"'{b.source}'. Nothing was compared.")


def _node_difference(node_a, node_b, position_a: dict[str, int], position_b: dict[str, int]) -> str | None:
    if type(node_a) is not type(node_b):
        return f"{node_a.op} against {node_b.op}"
    wired_a = [position_a[i] for i in node_a.inputs]
    wired_b = [position_b[i] for i in node_b.inputs]
    if wired_a != wired_b:
        return "they read different nodes"
    for item in fields(node_a):
        if item.name in ("name", "inputs"):
            continue
        value_a, value_b = getattr(node_a, item.name), getattr(node_b, item.name)
        if value_a != value_b:
            return f"{item.name} {value_a!r} against {value_b!r}"
    return None


def measured_output_change(graph_a: Graph, params_a: Mapping[str, torch.Tensor], graph_b: Graph,
                           params_b: Mapping[str, torch.Tensor], input_bound: float, *, seed: int = 0) -> float:
    """The largest ℓ1 change of the outputs (all concatenated) between two networks, over inputs
    in the box ‖x‖∞ ≤ R: half drawn uniformly, half at random corners (±R). float64 throughout."""
    inputs_a = [node for node in graph_a.nodes if isinstance(node, Input)]
    largest = max(math.prod(node.shape) for node in inputs_a)
    batch = SAMPLED_LARGE_INPUTS if largest > LARGE_INPUT else SAMPLED_INPUTS
    generator = torch.Generator().manual_seed(seed)
    feeds_a, feeds_b = {}, {}
    for node_a, node_b in zip(inputs_a, [node for node in graph_b.nodes if isinstance(node, Input)]):
        shape = (batch, *node_a.shape)
        uniform = (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * input_bound
        corners = torch.where(torch.rand(shape, generator=generator) < 0.5, -input_bound, input_bound).to(torch.float64)
        feeds_a[node_a.name] = feeds_b[node_b.name] = torch.cat([uniform[: batch // 2], corners[batch // 2:]])
    with torch.no_grad():
        out_a = forward(graph_a, params_a, feeds_a)
        out_b = forward(graph_b, params_b, feeds_b)
    flat_a = torch.cat([out_a[name].reshape(batch, -1) for name in graph_a.outputs], dim=1)
    flat_b = torch.cat([out_b[name].reshape(batch, -1) for name in graph_b.outputs], dim=1)
    return float((flat_a - flat_b).abs().sum(dim=1).max())


@dataclass
class Comparison:
    """Two checkpoints of one architecture through the ℓ1 path-metric (seed 004, SPEC §8).

    ``output_change_bound`` = max(R, 1) · ``metric.upper``, the bound of Theorem 4.1 on
    ‖R_θ(x) − R_θ'(x)‖₁ for every ‖x‖∞ ≤ R; None when the theorem does not apply (``bound_note``
    says why: a sign flip, or an activation other than ReLU). ``measured_output_change`` is
    the largest change found on a few inputs in the box: never above the bound.
    """

    a: LoadedModel
    b: LoadedModel
    path_norms_a: dict[str, PathNorm]
    path_norms_b: dict[str, PathNorm]
    signs: SignComparison
    metric: PathMetric
    input_bound: float
    measured_output_change: float
    bound_note: str | None
    seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"

    @property
    def bound_applies(self) -> bool:
        return self.bound_note is None

    @property
    def ln_output_change_bound(self) -> float | None:
        if not self.bound_applies:
            return None
        return self.metric.ln_upper + math.log(max(self.input_bound, 1.0))

    @property
    def output_change_bound(self) -> float | None:
        ln = self.ln_output_change_bound
        return None if ln is None else exp_or_none(ln)


def _bound_note(graph: Graph, signs: SignComparison | None) -> str | None:
    """Why seed 004's Theorem 4.1 gives no bound for these two vectors, or None when it does."""
    other = non_relu_activations(graph)
    if other:
        return (f"the network has activations other than ReLU ({', '.join(other[:3])}"
                f"{' ...' if len(other) > 3 else ''}); Theorem 4.1 is proved for ReLU networks with max-pooling only")
    if signs is not None and signs.flips:
        return (f"{signs.flips:,} parameter(s) change sign; Theorem 4.1 needs none, and no bound of its form holds "
                "with a sign change (seed 004 §4.1)")
    return None


def compare_models(a: LoadedModel, b: LoadedModel, *, input_bound: float = 1.0, device: str | torch.device = "auto",
                   path_norms: Iterable[float] = DEFAULT_PATH_NORMS) -> Comparison:
    """Compare two checkpoints of one architecture (any formats pathcond reads).

    Reports each one's path norms, the sign flips between them (per layer, BatchNorm folded),
    the ℓ1 path-metric's lower and upper bounds (equal, and exact, when one dominates the
    other), and for inputs with ‖x‖∞ ≤ ``input_bound`` the output-change bound of Theorem 4.1
    beside the largest change measured. Refuses two architectures with :class:`MismatchError`.
    """
    if not (math.isfinite(input_bound) and input_bound > 0):
        raise ValueError(f"input_bound must be a finite number > 0, not {input_bound}")
    check_same_architecture(a, b)
    device = resolve_device(device)
    orders = path_norm_orders(path_norms)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    groups_a = build_groups(a.graph, a.params).to(device)
    groups_b = build_groups(b.graph, b.params).to(device)
    seconds["groups"] = time.perf_counter() - start
    start = time.perf_counter()
    # One balancing per model serves its path norms and the metric's upper bound.
    u_a, u_b = (groups.extend(balancing_exponents(groups)) for groups in (groups_a, groups_b))
    norms_a = path_norms_of(groups_a, orders, device=device, u_ext=u_a)
    norms_b = path_norms_of(groups_b, orders, device=device, u_ext=u_b)
    seconds["path_norms"] = time.perf_counter() - start
    start = time.perf_counter()
    signs = compare_signs(groups_a, groups_b)
    metric = path_metric(groups_a, groups_b, norms_a["l1"], norms_b["l1"], signs, device=device, u_a=u_a, u_b=u_b)
    seconds["path_metric"] = time.perf_counter() - start
    start = time.perf_counter()
    measured = measured_output_change(a.graph, a.params, b.graph, b.params, input_bound)
    seconds["measured_output_change"] = time.perf_counter() - start
    comparison = Comparison(a, b, norms_a, norms_b, signs, metric, input_bound, measured, _bound_note(a.graph, signs),
                            seconds, str(device))
    _check_bound(comparison.ln_output_change_bound, measured, _ln_output_scale(input_bound, norms_a["l1"], norms_b["l1"]),
                 f"'{a.source}' against '{b.source}'")
    return comparison


def _check_bound(ln_bound: float | None, measured: float, ln_scale: float, name: str) -> None:
    """A measured output change above its bound is a bug (of pathcond or of the theorem's
    conditions), never a result to print: :class:`VerificationError`. The bound is met up to
    float64's evaluation of both networks: ``EVALUATION_SLACK`` relative to it and to
    ``ln_scale``, the natural log of max(R, 1) · ‖Φ‖₁ (which bounds every output)."""
    if ln_bound is None:
        return
    allowed = float(np.logaddexp(ln_bound + math.log1p(EVALUATION_SLACK), ln_scale + math.log(EVALUATION_SLACK)))
    if measured > 0 and math.log(measured) > allowed:
        raise VerificationError(f"{name}: the measured output change, {measured:.6g}, exceeds its bound "
                                f"{exp_or_none(ln_bound) or 0.0:.6g} (seed 004's Theorem 4.1); this is a bug in pathcond: "
                                "please report it. Nothing was written.")


def _ln_output_scale(input_bound: float, *norms: PathNorm) -> float:
    """ln(max(R, 1) · the largest ‖Φ‖₁): every output of either network is at most that."""
    return math.log(max(input_bound, 1.0)) + max(norm.log10 for norm in norms) / LOG10_E


@dataclass(frozen=True)
class PrunedLayer:
    """One pruned layer: its checkpoint weight, how many entries it has, and how many are zero
    before and after pruning."""

    layer: str
    weight: str
    parameters: int
    zeros_before: int
    zeros_after: int


@dataclass
class PruneResult:
    """A pruned checkpoint (in memory until :func:`save_pruned`).

    ``changed`` holds the pruned weights as stored (θ ⊙ m: every kept entry bit-identical, every
    pruned one +0). ``ln_score_sum`` is ln Σ_{i∈S} Δ_i(θ) over the pruned set S, so that
    ``score_bound`` = max(R, 1) · Σ Δ_i is the a-priori bound of seed 004 (eq. 13) on the output
    change for ‖x‖∞ ≤ R; ``metric`` is the exact path-metric between the input and the pruned
    network (pruning is dominated: lower = upper) and ``output_change_bound`` = max(R, 1) · d,
    the tighter bound of Theorem 4.1; ``measured_output_change`` never exceeds it.
    """

    model: LoadedModel
    changed: dict[str, torch.Tensor]
    criterion: str
    sparsity: float
    per_layer: bool
    layers: list[PrunedLayer]
    input_bound: float
    path_norms_before: dict[str, PathNorm]
    ln_score_sum: float
    path_norms_after: dict[str, PathNorm]
    metric: PathMetric
    measured_output_change: float
    seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    written: dict[str, str] | None = None

    @property
    def achieved_sparsity(self) -> float:
        total = sum(layer.parameters for layer in self.layers)
        return sum(layer.zeros_after for layer in self.layers) / total if total else 0.0

    @property
    def score_bound(self) -> float | None:
        return exp_or_none(self.ln_score_sum + math.log(max(self.input_bound, 1.0)))

    @property
    def output_change_bound(self) -> float | None:
        return exp_or_none(self.metric.ln_upper + math.log(max(self.input_bound, 1.0)))


def prune(model: LoadedModel, sparsity: float, *, criterion: str = "path-magnitude", per_layer: bool = False,
          input_bound: float = 1.0, device: str | torch.device = "auto",
          path_norms: Iterable[float] = DEFAULT_PATH_NORMS) -> PruneResult:
    """Zero the ``sparsity`` share of the Linear/Conv weights with the smallest path-magnitude
    scores Δ_i(θ) (seed 004 §5; one backward pass for all), over the whole network or with
    ``per_layer`` the same share in each layer. ``criterion="magnitude"`` ranks by |W| as stored
    instead (classical magnitude pruning, the control: not rescaling-invariant). Biases,
    BatchNorm and per-channel affine layers are kept. Nothing is written (:func:`save_pruned`).
    """
    if criterion not in PRUNING_CRITERIA:
        raise ValueError(f"unknown pruning criterion '{criterion}'; choose one of {', '.join(PRUNING_CRITERIA)}")
    if not (math.isfinite(input_bound) and input_bound > 0):
        raise ValueError(f"input_bound must be a finite number > 0, not {input_bound}")
    if not 0 <= sparsity <= 1:
        raise ValueError(f"sparsity must be a share between 0 and 1, not {sparsity}")
    device = resolve_device(device)
    orders = path_norm_orders(path_norms)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    groups = build_groups(model.graph, model.params).to(device)
    seconds["groups"] = time.perf_counter() - start
    start = time.perf_counter()
    # One balancing serves the scores and the path norms.
    u_ext = groups.extend(balancing_exponents(groups))
    scores = path_magnitude_scores(groups, device=device, u_ext=u_ext)
    seconds["scores"] = time.perf_counter() - start
    candidates = prunable(model.graph, groups)
    keys = [scores[index] if criterion == "path-magnitude" else
            magnitude_keys(model.graph, model.params, dp.layer).to(device) for index, dp in candidates]
    masks = select_pruned(keys, sparsity, per_layer=per_layer)
    chosen = [scores[index][mask] for (index, _), mask in zip(candidates, masks)]
    ln_score_sum = float(torch.logsumexp(torch.cat(chosen), 0)) if chosen and sum(c.numel() for c in chosen) else -math.inf
    changed: dict[str, torch.Tensor] = {}
    layers = []
    for (_, dp), mask in zip(candidates, masks):
        key, stored_mask = stored_weight_mask(model.graph, dp.layer, mask)
        original = model.params[key]
        pruned = original.masked_fill(stored_mask.to(original.device), 0)
        changed[key] = pruned
        layers.append(PrunedLayer(dp.layer, key, original.numel(), int((original == 0).sum()), int((pruned == 0).sum())))
    seconds["select"] = time.perf_counter() - start - seconds["scores"]
    start = time.perf_counter()
    norms_before = path_norms_of(groups, orders, device=device, u_ext=u_ext)
    pruned_params = ChainMap(changed, model.params)
    norms_after, metric = _pruned_metric(model.graph, pruned_params, norms_before, orders, device)
    measured = measured_output_change(model.graph, model.params, model.graph, pruned_params, input_bound)
    seconds["path_metric"] = time.perf_counter() - start
    result = PruneResult(model, changed, criterion, sparsity, per_layer, layers, input_bound, norms_before,
                         ln_score_sum, norms_after, metric, measured, seconds, str(device))
    _check_pruned(result, model.source)
    return result


def _pruned_metric(graph: Graph, params: Mapping[str, torch.Tensor], norms_before: dict[str, PathNorm],
                   orders: list[float], device) -> tuple[dict[str, PathNorm], PathMetric]:
    """The pruned network's path norms, and its exact ℓ1 path-metric to the original: θ ⊙ m is
    dominated by θ, so d = ‖Φ(θ)‖₁ − ‖Φ(θ ⊙ m)‖₁ (004 Lemma 4.2)."""
    norms_after = path_norms_of(build_groups(graph, params).to(device), orders, device=device)
    ln_d = ln_difference(norms_before["l1"].log10 / LOG10_E, norms_after["l1"].log10 / LOG10_E)
    return norms_after, PathMetric(ln_d, ln_d, True)


def _check_pruned(result: PruneResult, name: str) -> None:
    """The guarantees a pruned network must meet: d ≤ Σ_{i∈S} Δ_i (004 eq. 13) and a measured
    output change within max(R, 1) · d, each up to float64 rounding of ‖Φ‖₁'s passes."""
    ln_l1 = result.path_norms_before["l1"].log10 / LOG10_E
    ln_d, ln_sum = result.metric.ln_upper, result.ln_score_sum
    allowed = float(np.logaddexp(ln_sum + math.log1p(EVALUATION_SLACK), ln_l1 + math.log(EVALUATION_SLACK)))
    if ln_d > allowed:
        raise VerificationError(f"{name}: the pruned network's path-metric {exp_or_none(ln_d) or math.inf:.6g} exceeds the "
                                f"sum of the pruned weights' scores {exp_or_none(ln_sum) or 0.0:.6g} (seed 004 eq. 13); this "
                                "is a bug in pathcond: please report it. Nothing was written.")
    _check_bound(ln_d + math.log(max(result.input_bound, 1.0)), result.measured_output_change,
                 _ln_output_scale(result.input_bound, result.path_norms_before["l1"]), name)


def save_pruned(result: PruneResult, destination: str | Path, *, in_place: bool = False,
                input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None) -> dict[str, str]:
    """Write the pruned checkpoint in its input's format under ``save``'s rules (staged, renamed
    only once verified; the input never written without ``in_place``), and verify what was
    written: it reloads; its every tensor is the input's, bit for bit, except the pruned weights,
    which are exactly θ ⊙ m; its path-metric to the input is the one reported; its measured
    output change stays within max(R, 1) · d; an ONNX file runs in an independent runtime
    (onnxruntime) and agrees with pathcond's evaluation of it. Returns and stores on ``result``
    a summary of the checks (``written``)."""
    model = result.model
    if input_shape is None and model.format == "onnx":
        input_shape = {node.name: tuple(node.shape) for node in model.graph.inputs}
    metadata = {
        "pathcond.version": __version__,
        "pathcond.command": "prune",
        "pathcond.criterion": result.criterion,
        "pathcond.sparsity": f"{result.sparsity:g}",
        "pathcond.per_layer": str(result.per_layer).lower(),
        "pathcond.achieved_sparsity": f"{result.achieved_sparsity:.6g}",
    }

    def verify(target: Path, name: str) -> dict[str, str]:
        return _verify_pruned(result, target, input_shape, name)

    result.written = write_staged(model, result.changed, destination, metadata, verify, in_place=in_place,
                                  timed=Stopwatch(result.seconds))
    return result.written


def _verify_pruned(result: PruneResult, target: Path, input_shape, name: str) -> dict[str, str]:
    model = result.model
    try:
        written = load_model(target, input_shape=input_shape, name=name, allow_unused=True)
    except PathcondError as exc:
        raise VerificationError(f"'{name}': the written model does not read back ({exc}); nothing was written.") from None
    for key in model.graph.parameter_keys():
        expected = result.changed.get(key, model.params[key])
        if key not in written.params or not torch.equal(written.params[key].to(expected.device), expected):
            what = "the pruned weight θ ⊙ m" if key in result.changed else "the input's tensor"
            raise VerificationError(f"'{name}': tensor '{key}' as written is not {what}, bit for bit; nothing was "
                                    "written.")
    device = torch.device(result.device)
    orders = [norm.q for norm in result.path_norms_before.values()]
    norms, metric = _pruned_metric(written.graph, written.params, result.path_norms_before, orders, device)
    if not math.isclose(metric.ln_upper, result.metric.ln_upper, rel_tol=1e-9, abs_tol=1e-9):
        raise VerificationError(f"'{name}': the written model's path-metric to the input, {metric.upper:.9g}, is not "
                                f"the one computed before writing, {result.metric.upper:.9g}; nothing was written.")
    measured = measured_output_change(model.graph, model.params, written.graph, written.params, result.input_bound)
    result.measured_output_change = max(result.measured_output_change, measured)
    _check_pruned(result, f"'{name}'")
    independent = independent_agreement(written, target)
    if independent["status"] == "failed":
        raise VerificationError(f"'{name}': the check by {independent['runtime']} failed: {independent['detail']}; "
                                "nothing was written.")
    return {"reloaded": "exact", "independent": independent["status"], "runtime": independent["runtime"] or "",
            "detail": independent["detail"]}
