"""The path-lifting toolkit's API (SPEC §8, seeds 002 and 004): compare two checkpoints of one
architecture through the ℓ1 path-metric, and prune a checkpoint by path magnitude.

    import pathcond_cli as pathcond

    comparison = pathcond.compare_models(pathcond.load("a.onnx"), pathcond.load("a.fp16.onnx"))
    pruned = pathcond.prune(pathcond.load("a.onnx"), sparsity=0.5)
    pathcond.save_pruned(pruned, "a.pruned.onnx")        # staged, reloaded, verified
"""

from __future__ import annotations

import math
import sys
from collections import ChainMap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .analysis import DEFAULT_PATH_NORMS, path_norm_orders, path_norms_of
from .engine.diag import (
    LayerValues,
    PathNorm,
    balanced_power,
    balancing_exponents,
    largest,
    path_magnitude_scores,
    squared_network,
)
from .engine.evaluate import forward
from .engine.graph import Graph, Input
from .engine.groups import RescalingGroups, build_groups
from .engine.model import LoadedModel
from .engine.pathlift import (
    PathMetric,
    SignComparison,
    compare_signs,
    exp_or_none,
    magnitude_keys,
    non_relu_activations,
    path_metric,
    prunable,
    rounding_bound,
    select_pruned,
    stored_weight_mask,
)
from .engine.transfer import to_host
from .errors import MismatchError, PathcondError, UsageError, VerificationError
from .io.formats import load_model
from .model_files import write_staged
from .runtime import Stopwatch, resolve_device
from .solve.options import PRUNING_CRITERIA, InvalidOption
from .statistics import LOG10_E
from .verify import independent_agreement
from .version import __version__

# Inputs drawn in the box ‖x‖∞ ≤ R to measure an output change: half uniform, half corners (±R).
SAMPLED_INPUTS = 16
LARGE_INPUT = 16384
SAMPLED_LARGE_INPUTS = 4
LN_FLOAT64_MAX = math.log(sys.float_info.max)


def check_same_architecture(a: LoadedModel, b: LoadedModel) -> None:
    """Refuse two models whose DAGs differ: in their number of nodes, their inputs (names,
    order, shapes) and outputs (names, order), then node by node (type, hyper-parameters, wiring
    by position), then in the tensors the graphs read (names and shapes); the outputs' shapes
    follow from these. :class:`MismatchError` names the first difference."""
    nodes_a, nodes_b = a.graph.nodes, b.graph.nodes
    if len(nodes_a) != len(nodes_b):
        raise MismatchError(
            f"'{a.source}' has {len(nodes_a)} nodes and '{b.source}' {len(nodes_b)}: not one "
            "architecture. Nothing was compared."
        )
    _check_same_ends(
        "input",
        [(node.name, tuple(node.shape)) for node in a.graph.inputs],
        [(node.name, tuple(node.shape)) for node in b.graph.inputs],
        a.source,
        b.source,
    )
    _check_same_ends(
        "output",
        [(name, None) for name in a.graph.outputs],
        [(name, None) for name in b.graph.outputs],
        a.source,
        b.source,
    )
    position_a = {node.name: i for i, node in enumerate(nodes_a)}
    position_b = {node.name: i for i, node in enumerate(nodes_b)}
    for index, (node_a, node_b) in enumerate(zip(nodes_a, nodes_b)):
        difference = _node_difference(node_a, node_b, position_a, position_b)
        if difference:
            raise MismatchError(
                f"'{a.source}' and '{b.source}' differ at node {index + 1} of {len(nodes_a)} ('{node_a.name}' / "
                f"'{node_b.name}'): {difference}. compare needs one architecture. Nothing was compared."
            )
    keys_a, keys_b = a.graph.parameter_keys(), b.graph.parameter_keys()
    for key_a, key_b in zip(keys_a, keys_b):
        if key_a != key_b:
            raise MismatchError(
                f"'{a.source}' reads tensor '{key_a}' where '{b.source}' reads '{key_b}': the "
                "tensor names differ. Nothing was compared."
            )
        shape_a, shape_b = tuple(a.params[key_a].shape), tuple(b.params[key_b].shape)
        if shape_a != shape_b:
            raise MismatchError(
                f"tensor '{key_a}' has shape {list(shape_a)} in '{a.source}' and {list(shape_b)} in "
                f"'{b.source}'. Nothing was compared."
            )


def _check_same_ends(
    what: str,
    ends_a: list[tuple[str, tuple | None]],
    ends_b: list[tuple[str, tuple | None]],
    source_a: str,
    source_b: str,
) -> None:
    """Refuse two graphs whose inputs (or outputs) differ in number, name, order or shape: the
    outputs are compared position by position, and the inputs are fed so."""
    names_a, names_b = [name for name, _ in ends_a], [name for name, _ in ends_b]
    if names_a != names_b:
        raise MismatchError(
            f"'{source_a}' has {what}s {names_a} and '{source_b}' {names_b}: compare needs the same "
            f"{what}s in the same order. Nothing was compared."
        )
    for name, ((_, shape_a), (_, shape_b)) in zip(names_a, zip(ends_a, ends_b)):
        if shape_a != shape_b:
            raise MismatchError(
                f"{what} '{name}' has shape {list(shape_a)} in '{source_a}' and {list(shape_b)} in "
                f"'{source_b}'. Nothing was compared."
            )


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


def measured_output_change(
    graph_a: Graph,
    params_a: Mapping[str, torch.Tensor],
    graph_b: Graph,
    params_b: Mapping[str, torch.Tensor],
    input_bound: float,
    *,
    names: tuple[str, str],
    outcome: str,
    seed: int = 0,
) -> float:
    """The largest ℓ1 change of the outputs (all concatenated) between two networks, over inputs
    in the box ‖x‖∞ ≤ R (:func:`sampled_output_changes`): the DAGs' own inputs and outputs, after
    and before an ONNX file's pre- and post-processing (:func:`bound_scope`)."""
    changes, _ = sampled_output_changes(
        graph_a, params_a, graph_b, params_b, input_bound, names=names, outcome=outcome, seed=seed
    )
    return float(changes.max())


def sampled_output_changes(
    graph_a: Graph,
    params_a: Mapping[str, torch.Tensor],
    graph_b: Graph,
    params_b: Mapping[str, torch.Tensor],
    input_bound: float,
    *,
    names: tuple[str, str],
    outcome: str,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ℓ1 change of the outputs (all concatenated) between two networks at each of a few
    inputs in the box ‖x‖∞ ≤ R, half drawn uniformly, half at random corners (±R), and those
    inputs (by ``graph_a``'s input names). The inputs are the graphs' Input nodes, the values an
    ONNX file's pre-processing computes, as the bound's are. float64 throughout, so every input
    lies in the box.
    Outputs that are not finite are refused (:class:`VerificationError`, naming the network by
    ``names`` and ending with ``outcome``)."""
    inputs_a = [node for node in graph_a.nodes if isinstance(node, Input)]
    largest = max(math.prod(node.shape) for node in inputs_a)
    batch = SAMPLED_LARGE_INPUTS if largest > LARGE_INPUT else SAMPLED_INPUTS
    generator = torch.Generator().manual_seed(seed)
    feeds_a, feeds_b = {}, {}
    for node_a, node_b in zip(inputs_a, [node for node in graph_b.nodes if isinstance(node, Input)]):
        shape = (batch, *node_a.shape)
        # 2t − 1 is exact and in [−1, 1], so its product with R rounds to at most R.
        uniform = (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * input_bound
        signs = torch.rand(shape, generator=generator, dtype=torch.float64) < 0.5
        corners = torch.full(shape, input_bound, dtype=torch.float64).masked_fill_(signs, -input_bound)
        feeds_a[node_a.name] = feeds_b[node_b.name] = torch.cat([uniform[: batch // 2], corners[batch // 2 :]])
    flats = []
    with torch.no_grad():
        for graph, params, feeds, name in (
            (graph_a, params_a, feeds_a, names[0]),
            (graph_b, params_b, feeds_b, names[1]),
        ):
            outputs = forward(graph, params, feeds)
            flat = torch.cat([outputs[output].reshape(batch, -1) for output in graph.outputs], dim=1)
            if not bool(torch.isfinite(flat).all()):
                raise VerificationError(
                    f"'{name}': the network's outputs are not finite on inputs with ‖x‖∞ ≤ {input_bound:g}: "
                    "it overflows "
                    "float64 by itself (a constant factor or weights too large?), so no output change can be measured "
                    f"against its bound. {outcome}"
                )
            flats.append(flat)
    return (flats[0] - flats[1]).abs().sum(dim=1), feeds_a


def _ln_evaluation_errors(
    groups: RescalingGroups, u_ext: torch.Tensor, feeds: Mapping[str, torch.Tensor], device
) -> torch.Tensor:
    """ln of what float64 evaluation can have added to a network's outputs (their ℓ1 norm) at
    each input of ``feeds``: every output is a sum of path terms, each rounding of which moves
    it by at most a relative u of the terms' magnitudes (Higham §3.1), so the error is at most
    γ_K (:func:`~.engine.pathlift.rounding_bound`, K the roundings of a forward) times the
    outputs of the |θ| network on |x|, Σ_P |Φ_P| |x_P|, computed on the balanced copy."""
    layers = LayerValues(groups, lambda dp: balanced_power(dp, u_ext, device, 1))
    magnitudes = {name: feed.abs() for name, feed in feeds.items()}
    sweep = squared_network(groups.graph, layers, power=1, device=device, totals_only=True, inputs=magnitudes)
    final = largest([sweep.offsets[output] for output in groups.graph.outputs])
    batch = next(iter(feeds.values())).shape[0]
    mass = sum(
        sweep.values[output].reshape(batch, -1).sum(dim=1) * torch.exp(sweep.offsets[output] - final)
        for output in groups.graph.outputs
    )
    return (torch.log(mass) + final).cpu() + math.log(rounding_bound(groups, 0.0))


def _measure_within_bound(
    a: tuple[Graph, Mapping[str, torch.Tensor], RescalingGroups, torch.Tensor],
    b: tuple[Graph, Mapping[str, torch.Tensor], RescalingGroups, torch.Tensor],
    input_bound: float,
    ln_bound: float | None,
    names: tuple[str, str],
    outcome: str,
    device,
) -> float:
    """The largest output change measured on inputs of the box between network ``a`` and ``b``
    (each its graph, tensors, groups and balancing), checked against the bound (natural log,
    rounded up already; None where none applies): a change above it is a bug (of pathcond or of
    the theorem's conditions), never a result to print, :class:`VerificationError`. At each
    input the measured change may exceed the true one by what float64 evaluation of the two
    networks adds there (:func:`_ln_evaluation_errors`), and by nothing else."""
    graph_a, params_a, groups_a, u_a = a
    graph_b, params_b, groups_b, u_b = b
    changes, feeds = sampled_output_changes(
        graph_a, params_a, graph_b, params_b, input_bound, names=names, outcome=outcome
    )
    if ln_bound is not None:
        feeds_b = dict(zip((node.name for node in graph_b.inputs), feeds.values()))
        ln_errors = torch.logaddexp(
            _ln_evaluation_errors(groups_a, u_a, feeds, device), _ln_evaluation_errors(groups_b, u_b, feeds_b, device)
        )
        allowed = torch.logaddexp(ln_errors, torch.tensor(ln_bound, dtype=torch.float64))
        over = changes.log() > allowed
        if bool(over.any()):
            worst = int(over.nonzero()[0])
            raise VerificationError(
                f"'{names[0]}' against '{names[1]}': the measured output change, {float(changes[worst]):.6g}, "
                f"exceeds its bound {exp_or_none(ln_bound) or 0.0:.6g} (seed 004's Theorem 4.1) by more than "
                f"float64 evaluation can account for there ({math.exp(float(ln_errors[worst])):.3g}); "
                "this is a bug in pathcond: please report "
                f"it. {outcome}"
            )
    return float(changes.max())


def _check_in_range(norms: Mapping[str, PathNorm], input_bound: float, name: str, outcome: str) -> None:
    """Refuse a network whose ℓ1 path norm is beyond float64 (:class:`VerificationError`, as
    ``rescale`` refuses outputs that overflow: the network overflows float64 by itself), and an
    R that takes max(R, 1) · ‖Φ‖₁, which bounds every output on the box, beyond it
    (:class:`UsageError`: a smaller R works)."""
    ln_l1 = norms["l1"].log10 / LOG10_E
    if ln_l1 > LN_FLOAT64_MAX:
        raise VerificationError(
            f"'{name}': its ℓ1 path norm is 10^{norms['l1'].log10:.6g}, beyond float64 "
            "(weights or a constant factor too "
            "large?): its outputs can overflow float64 by themselves, and no bound of Theorem 4.1 can be printed. "
            f"{outcome}"
        )
    if ln_l1 + math.log(max(input_bound, 1.0)) > LN_FLOAT64_MAX:
        largest = math.exp(LN_FLOAT64_MAX - ln_l1)
        raise UsageError(
            f"--input-bound {input_bound:g}: max(R, 1) · ‖Φ‖₁ of '{name}' "
            f"(‖Φ‖₁ = 10^{norms['l1'].log10:.6g}) is beyond "
            f"float64, so the outputs on that box can overflow and no bound can be printed; choose R ≤ {largest:.6g}. "
            f"{outcome}"
        )


@dataclass
class Comparison:
    """Two checkpoints of one architecture through the ℓ1 path-metric (seed 004, SPEC §8).

    ``output_change_bound`` = max(R, 1) · ``metric.upper`` · (1 + ρ), the bound of Theorem 4.1
    on ‖R_θ(x) − R_θ'(x)‖₁ for every ‖x‖∞ ≤ R, rounded up by ρ (``metric.rounding``, what float64
    can have taken off the metric); None when the theorem does not apply (``bound_note`` says
    why: a sign flip, or an activation other than ReLU). ``measured_output_change`` is the
    largest change found on a few inputs in the box: never above the bound. Both are of the DAGs:
    with an ONNX file's pre- or post-processing, x is the DAG's input and the outputs are the
    DAG's (``bound_scope`` says so).
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
        return _ln_bound(self.metric.ln_bound, self.input_bound, self.bound_note)

    @property
    def output_change_bound(self) -> float | None:
        ln = self.ln_output_change_bound
        return None if ln is None else exp_or_none(ln)

    @property
    def bound_scope(self) -> str | None:
        return bound_scope(self.a) or bound_scope(self.b)


def bound_scope(model: LoadedModel) -> str | None:
    """What the output-change bound and the measured change are of when ``model`` is an ONNX
    file with pre- or post-processing: the ReLU DAG between them, not the file end to end (the
    pre-processing can stretch the file's box of inputs by any factor, and the post-processing
    maps the outputs on); None when the DAG is the whole file."""
    carried = model.carried
    if not carried:
        return None
    inputs = (
        "for DAG inputs z with ‖z‖∞ ≤ R, the values after the file's pre-processing, not the file's own inputs"
        if carried.pre
        else "for inputs with ‖x‖∞ ≤ R (the file's own, which the DAG reads)"
    )
    outputs = (
        "on the DAG's outputs, before the file's post-processing"
        if carried.post
        else "on the file's outputs (the DAG's)"
    )
    return f"the bound and the measured change are of the ReLU DAG alone: {inputs}, {outputs}"


def _ln_bound(ln_metric: float, input_bound: float, note: str | None) -> float | None:
    """ln(max(R, 1) · metric): Theorem 4.1's bound, or None where ``note`` says it does not apply."""
    return None if note is not None else ln_metric + math.log(max(input_bound, 1.0))


def bound_note(graph: Graph, signs: SignComparison | None) -> str | None:
    """Why seed 004's Theorem 4.1 (and its corollary, eq. 13) gives no bound for these two
    vectors, or None when it does: it is proved for ReLU DAGs (identity and max-pooling
    included) without a sign change."""
    other = non_relu_activations(graph)
    if other:
        return (
            f"the network has activations other than ReLU ({', '.join(other[:3])}"
            f"{' ...' if len(other) > 3 else ''}); Theorem 4.1 is proved for ReLU networks with max-pooling only"
        )
    if signs is not None and signs.flips:
        return (
            f"{signs.flips:,} parameter(s) change sign; Theorem 4.1 needs none, and no bound of its form holds "
            "with a sign change (seed 004 §4.1)"
        )
    return None


def compare_models(
    a: LoadedModel,
    b: LoadedModel,
    *,
    input_bound: float = 1.0,
    device: str | torch.device = "auto",
    path_norms: Iterable[float] = DEFAULT_PATH_NORMS,
) -> Comparison:
    """Compare two checkpoints of one architecture (any formats pathcond reads).

    Reports each one's path norms, the sign flips between them (per layer, BatchNorm folded),
    the ℓ1 path-metric's lower and upper bounds (equal, and exact, when one dominates the
    other), and for inputs with ‖x‖∞ ≤ ``input_bound`` the output-change bound of Theorem 4.1
    beside the largest change measured. Refuses two architectures with :class:`MismatchError`,
    a network whose ℓ1 path norm or outputs overflow float64 with :class:`VerificationError`.
    """
    _check_input_bound(input_bound)
    check_same_architecture(a, b)
    device = resolve_device(device)
    orders = path_norm_orders(path_norms)
    outcome = "Nothing was compared."
    seconds: dict[str, float] = {}
    timed = Stopwatch(seconds)
    with timed.stage("groups"):
        groups_a = build_groups(a.graph, a.params).to(device)
        groups_b = build_groups(b.graph, b.params).to(device)
    with timed.stage("path_norms"):
        # One balancing per model serves its path norms and the metric's upper bound.
        u_a, u_b = (groups.extend(balancing_exponents(groups)) for groups in (groups_a, groups_b))
        norms_a = path_norms_of(groups_a, orders, device=device, u_ext=u_a)
        norms_b = path_norms_of(groups_b, orders, device=device, u_ext=u_b)
        for model, norms in ((a, norms_a), (b, norms_b)):
            _check_in_range(norms, input_bound, model.source, outcome)
    with timed.stage("path_metric"):
        signs = compare_signs(groups_a, groups_b)
        metric = path_metric(groups_a, groups_b, norms_a["l1"], norms_b["l1"], signs, device=device, u_a=u_a, u_b=u_b)
    note = bound_note(a.graph, signs)
    with timed.stage("measured_output_change"):
        measured = _measure_within_bound(
            (a.graph, a.params, groups_a, u_a),
            (b.graph, b.params, groups_b, u_b),
            input_bound,
            _ln_bound(metric.ln_bound, input_bound, note),
            (a.source, b.source),
            outcome,
            device,
        )
    return Comparison(a, b, norms_a, norms_b, signs, metric, input_bound, measured, note, seconds, str(device))


def _check_input_bound(input_bound: float) -> None:
    if not (math.isfinite(input_bound) and input_bound > 0):
        raise InvalidOption("--input-bound", f"the input bound R must be a finite number > 0, not {input_bound}")


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
    pruned one +0). ``ln_score_sum`` is ln Σ_{i∈S} Δ_i(θ) over the pruned set S; ``metric`` is
    the exact path-metric d between the input and the pruned network (pruning is dominated:
    lower = upper = d, from the telescoped sum, where nothing cancels). For ‖x‖∞ ≤ R,
    ``output_change_bound`` = max(R, 1) · d · (1 + ρ), Theorem 4.1 rounded up, and
    ``score_bound`` = max(R, 1) · Σ Δ_i · (1 + ρ), the a-priori bound of seed 004 (eq. 13),
    never below it (d ≤ Σ Δ_i in exact arithmetic; where rounding would say otherwise the
    score bound takes d's). Both are None where the theorem does not apply (``bound_note``:
    LeakyReLU, PReLU). ``measured_output_change`` never exceeds the bound. Both are of the DAG
    (``bound_scope``: an ONNX file's pre- and post-processing are outside it).
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
    bound_note: str | None
    balanced: tuple[RescalingGroups, torch.Tensor] = field(repr=False)
    seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    written: dict[str, str] | None = None

    @property
    def bound_applies(self) -> bool:
        return self.bound_note is None

    @property
    def achieved_sparsity(self) -> float:
        total = sum(layer.parameters for layer in self.layers)
        return sum(layer.zeros_after for layer in self.layers) / total if total else 0.0

    @property
    def ln_output_change_bound(self) -> float | None:
        return _ln_bound(self.metric.ln_bound, self.input_bound, self.bound_note)

    @property
    def score_bound(self) -> float | None:
        ln_scores = self.ln_score_sum + math.log1p(self.metric.rounding)
        ln = _ln_bound(max(ln_scores, self.metric.ln_bound), self.input_bound, self.bound_note)
        return None if ln is None else exp_or_none(ln)

    @property
    def output_change_bound(self) -> float | None:
        ln = self.ln_output_change_bound
        return None if ln is None else exp_or_none(ln)

    @property
    def bound_scope(self) -> str | None:
        return bound_scope(self.model)


def prune(
    model: LoadedModel,
    sparsity: float,
    *,
    criterion: str = "path-magnitude",
    per_layer: bool = False,
    input_bound: float = 1.0,
    device: str | torch.device = "auto",
    path_norms: Iterable[float] = DEFAULT_PATH_NORMS,
) -> PruneResult:
    """Zero Linear/Conv weights until the ``sparsity`` share of them is zero (those already zero
    count, and come first), choosing the smallest path-magnitude scores Δ_i(θ) (seed 004 §5; one
    backward pass for all), over the whole network or with ``per_layer`` the same share in each
    layer. ``criterion="magnitude"`` ranks by |W| as stored instead (classical magnitude
    pruning, the control: not rescaling-invariant). Biases, BatchNorm and per-channel affine
    layers are kept. Nothing is written (:func:`save_pruned`).
    """
    if criterion not in PRUNING_CRITERIA:
        raise ValueError(f"unknown pruning criterion '{criterion}'; choose one of {', '.join(PRUNING_CRITERIA)}")
    _check_input_bound(input_bound)
    if not 0 <= sparsity <= 1:
        raise ValueError(f"sparsity must be a share between 0 and 1, not {sparsity}")
    device = resolve_device(device)
    orders = path_norm_orders(path_norms)
    outcome = "Nothing was written."
    seconds: dict[str, float] = {}
    timed = Stopwatch(seconds)
    with timed.stage("groups"):
        groups = build_groups(model.graph, model.params).to(device)
    with timed.stage("scores"):
        # One balancing serves the scores, the path norms and the metric.
        u_ext = groups.extend(balancing_exponents(groups))
        norms_before = path_norms_of(groups, orders, device=device, u_ext=u_ext)
        _check_in_range(norms_before, input_bound, model.source, outcome)
        scores = path_magnitude_scores(groups, device=device, u_ext=u_ext)
    with timed.stage("select"):
        candidates = prunable(model.graph, groups)
        stored = [magnitude_keys(model.graph, model.params, dp.layer).to(device) for _, dp in candidates]
        keys = [
            scores[index] if criterion == "path-magnitude" else magnitude
            for (index, _), magnitude in zip(candidates, stored)
        ]
        masks = select_pruned(keys, [magnitude == 0 for magnitude in stored], sparsity, per_layer=per_layer)
        chosen = [scores[index][mask] for (index, _), mask in zip(candidates, masks)]
        ln_score_sum = (
            float(torch.logsumexp(torch.cat(chosen), 0)) if chosen and sum(c.numel() for c in chosen) else -math.inf
        )
        changed: dict[str, torch.Tensor] = {}
        layers = []
        stored_masks = [stored_weight_mask(model.graph, dp.layer, mask) for (_, dp), mask in zip(candidates, masks)]
        # the checkpoint's tensors live on the CPU: every layer's mask goes there in one transfer
        host_masks = to_host([mask for _, mask in stored_masks])
        for (_, dp), (key, _), stored_mask in zip(candidates, stored_masks, host_masks):
            original = model.params[key]
            pruned = original.masked_fill(stored_mask.to(original.device), 0)
            changed[key] = pruned
            layers.append(
                PrunedLayer(dp.layer, key, original.numel(), int((original == 0).sum()), int((pruned == 0).sum()))
            )
    with timed.stage("path_metric"):
        pruned_params = ChainMap(changed, model.params)
        norms_after, metric, pruned = _pruned_metric(
            groups, u_ext, norms_before["l1"], model.graph, pruned_params, orders, device, model.source
        )
        note = bound_note(model.graph, None)
        _check_scores(metric, ln_score_sum, model.source, outcome)
        measured = _measure_within_bound(
            (model.graph, model.params, groups, u_ext),
            (model.graph, pruned_params, *pruned),
            input_bound,
            _ln_bound(metric.ln_bound, input_bound, note),
            (model.source, f"{model.source} pruned"),
            outcome,
            device,
        )
    return PruneResult(
        model,
        changed,
        criterion,
        sparsity,
        per_layer,
        layers,
        input_bound,
        norms_before,
        ln_score_sum,
        norms_after,
        metric,
        measured,
        note,
        (groups, u_ext),
        seconds,
        str(device),
    )


def _pruned_metric(
    groups: RescalingGroups,
    u_ext: torch.Tensor,
    l1_before: PathNorm,
    graph: Graph,
    params: Mapping[str, torch.Tensor],
    orders: list[float],
    device,
    name: str,
) -> tuple[dict[str, PathNorm], PathMetric, tuple[RescalingGroups, torch.Tensor]]:
    """The pruned network's path norms, its exact ℓ1 path-metric to the original (``groups``,
    balanced by ``u_ext``, of ℓ1 path norm ``l1_before``), and its groups and balancing: θ ⊙ m is
    dominated by θ, so d is the telescoped sum on θ's balancing
    (:func:`~.engine.pathlift.path_metric`)."""
    pruned = build_groups(graph, params).to(device)
    u_pruned = pruned.extend(balancing_exponents(pruned))
    norms_after = path_norms_of(pruned, orders, device=device, u_ext=u_pruned)
    signs = compare_signs(groups, pruned)
    if not signs.a_dominates:
        raise VerificationError(
            f"'{name}': the pruned network is not θ ⊙ m (some parameter grew or changed sign); "
            "this is a bug in pathcond: please report it. Nothing was written."
        )
    metric = path_metric(groups, pruned, l1_before, norms_after["l1"], signs, device=device, u_a=u_ext)
    return norms_after, metric, (pruned, u_pruned)


def _check_scores(metric: PathMetric, ln_score_sum: float, name: str, outcome: str) -> None:
    """d ≤ Σ_{i∈S} Δ_i (004 eq. 13), each computed within a relative ρ of the truth."""
    ln_d, rounding = metric.ln_upper, metric.rounding
    if rounding < 1 and ln_d + math.log1p(-rounding) > ln_score_sum + math.log1p(rounding):
        raise VerificationError(
            f"{name}: the pruned network's path-metric {exp_or_none(ln_d) or math.inf:.6g} exceeds the "
            f"sum of the pruned weights' scores {exp_or_none(ln_score_sum) or 0.0:.6g} (seed 004 eq. "
            f"13); this is a bug in pathcond: please report it. {outcome}"
        )


def save_pruned(
    result: PruneResult,
    destination: str | Path,
    *,
    in_place: bool = False,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
) -> dict[str, str]:
    """Write the pruned checkpoint in its input's format under ``save``'s rules (staged, renamed
    only once verified; the input never written without ``in_place``), and verify what was
    written: it reloads; its every tensor is the input's, bit for bit, except the pruned weights,
    which are exactly θ ⊙ m; its path-metric to the input is the one reported; its measured
    output change stays within max(R, 1) · d; an ONNX file runs in an independent runtime
    (onnxruntime) and agrees with pathcond's evaluation of it. Returns and stores on ``result``
    a summary of the checks (``written``)."""
    model = result.model
    if input_shape is None and model.format == "onnx":
        input_shape = model.carried.inputs or {node.name: tuple(node.shape) for node in model.graph.inputs}
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

    result.written = write_staged(
        model, result.changed, destination, metadata, verify, in_place=in_place, timed=Stopwatch(result.seconds)
    )
    return result.written


def _verify_pruned(result: PruneResult, target: Path, input_shape, name: str) -> dict[str, str]:
    model = result.model
    try:
        written = load_model(target, input_shape=input_shape, name=name, allow_unused=True)
    except PathcondError as exc:
        raise VerificationError(
            f"'{name}': the written model does not read back ({exc}); nothing was written."
        ) from None
    for key in model.graph.parameter_keys():
        expected = result.changed.get(key, model.params[key])
        if key not in written.params or not torch.equal(written.params[key].to(expected.device), expected):
            what = "the pruned weight θ ⊙ m" if key in result.changed else "the input's tensor"
            raise VerificationError(
                f"'{name}': tensor '{key}' as written is not {what}, bit for bit; nothing was written."
            )
    device = torch.device(result.device)
    orders = [norm.q for norm in result.path_norms_before.values()]
    groups, u_ext = result.balanced
    _, metric, pruned = _pruned_metric(
        groups, u_ext, result.path_norms_before["l1"], written.graph, written.params, orders, device, name
    )
    if not math.isclose(metric.ln_upper, result.metric.ln_upper, rel_tol=1e-9, abs_tol=1e-9):
        raise VerificationError(
            f"'{name}': the written model's path-metric to the input, {metric.upper:.9g}, is not "
            f"the one computed before writing, {result.metric.upper:.9g}; nothing was written."
        )
    measured = _measure_within_bound(
        (model.graph, model.params, groups, u_ext),
        (written.graph, written.params, *pruned),
        result.input_bound,
        result.ln_output_change_bound,
        (model.source, name),
        "Nothing was written.",
        device,
    )
    result.measured_output_change = max(result.measured_output_change, measured)
    independent = independent_agreement(written, target)
    if independent["status"] == "failed":
        raise VerificationError(
            f"'{name}': the check by {independent['runtime']} failed: {independent['detail']}; nothing was written."
        )
    return {
        "reloaded": "exact",
        "independent": independent["status"],
        "runtime": independent["runtime"] or "",
        "detail": independent["detail"],
    }
