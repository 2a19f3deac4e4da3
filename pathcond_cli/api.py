"""The Python API: analyse and rescale a network given as a checkpoint or an ``nn.Module``.

    import pathcond_cli as pathcond

    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))   # in place, verified
    analysis = pathcond.analyse(pathcond.load("model.onnx"))           # diag(G), paths, groups
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .diag import DiagG, PathCount, diag_g, path_count
from .dtype_limits import ensure_storable
from .errors import PathcondError, VerificationError
from .groups import RescalingGroups, build_groups
from .model import LoadedModel
from .solvers import DEFAULT_MAX_ITER, DEFAULT_SOLVER, DEFAULT_TOL, ProgressCallback, SolveResult, solve
from .verify import Verification, compare

LOG10_E = 1 / math.log(10)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from .errors import PathcondError

        raise PathcondError("--device cuda was requested but torch sees no CUDA device on this machine.")
    return device


@dataclass
class LayerSpread:
    """diag(G) summary for one Linear/Conv layer (BatchNorm folded)."""

    layer: str
    parameters: int
    zeros: int
    log10_min: float | None
    log10_max: float | None


@dataclass
class Analysis:
    """Everything ``inspect`` reports: counts, groups, path count and the diag(G) spread."""

    model: LoadedModel
    groups: RescalingGroups
    diag: DiagG
    paths: PathCount
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def log10_min(self) -> float | None:
        values = [s.log10_min for s in self.per_layer() if s.log10_min is not None]
        return min(values) if values else None

    @property
    def log10_max(self) -> float | None:
        values = [s.log10_max for s in self.per_layer() if s.log10_max is not None]
        return max(values) if values else None

    def per_layer(self) -> list[LayerSpread]:
        spreads: dict[str, LayerSpread] = {}
        for dp, lg in zip(self.groups.dag_params, self.diag.log_g):
            finite = lg[torch.isfinite(lg)]
            entry = spreads.setdefault(dp.layer, LayerSpread(dp.layer, 0, 0, None, None))
            entry.parameters += lg.numel()
            entry.zeros += lg.numel() - finite.numel()
            if finite.numel():
                low, high = float(finite.min()) * LOG10_E, float(finite.max()) * LOG10_E
                entry.log10_min = low if entry.log10_min is None else min(entry.log10_min, low)
                entry.log10_max = high if entry.log10_max is None else max(entry.log10_max, high)
        return list(spreads.values())

    def histogram(self, bins: int = 12) -> list[tuple[float, float, int]]:
        """Counts of log10 g over equal-width bins (g = 0 excluded)."""
        low, high = self.log10_min, self.log10_max
        if low is None or high is None:
            return []
        high = high if high > low else low + 1.0
        counts = torch.zeros(bins, dtype=torch.long)
        for lg in self.diag.log_g:
            finite = lg[torch.isfinite(lg)].to("cpu") * LOG10_E
            counts += torch.histc(finite, bins=bins, min=low, max=high).to(torch.long)
        width = (high - low) / bins
        return [(low + i * width, low + (i + 1) * width, int(counts[i])) for i in range(bins)]


@dataclass
class RescaleResult:
    """A finished rescaling: the solve, the changed tensors and the measured preservation."""

    analysis: Analysis
    solve: SolveResult
    changed: dict[str, torch.Tensor]
    verification: Verification | None
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def rescaled_params(self) -> dict[str, torch.Tensor]:
        """All checkpoint tensors after rescaling (unchanged ones are the original objects)."""
        return {**self.analysis.model.params, **self.changed}


class _Stopwatch:
    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    def __call__(self, stage: str, work: Callable):
        start = time.perf_counter()
        value = work()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        return value


def analyse(model: LoadedModel, *, device: str | torch.device = "auto") -> Analysis:
    """Groups, diag(G) and path count of a loaded model."""
    device = resolve_device(device)
    seconds: dict[str, float] = {}
    timed = _Stopwatch(seconds)
    groups = timed("groups", lambda: build_groups(model.graph, model.params))
    diag = timed("diag_g", lambda: diag_g(groups, device=device))
    paths = timed("path_count", lambda: path_count(groups, device=device))
    return Analysis(model, groups, diag, paths, seconds)


def rescale(
    model: LoadedModel,
    *,
    solver: str = DEFAULT_SOLVER,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    device: str | torch.device = "auto",
    progress: ProgressCallback | None = None,
    analysis: Analysis | None = None,
    verify: bool = True,
    max_log_scale: float | None = None,
) -> RescaleResult:
    """Find the PathCond rescaling of ``model`` and apply it to its tensors (in memory).

    With ``verify`` (the default) the rescaled tensors are run against the original ones and
    :class:`VerificationError` is raised when they differ beyond the dtype's tolerance; the
    CLI instead verifies the file it wrote. ``result.verification`` is None when skipped.
    ``max_iter`` is a safety cap (``result.solve.converged`` says whether the tolerance was
    met); ``max_log_scale`` bounds every |u_h|. A rescaled tensor that would overflow or lose
    its values in its dtype raises :class:`VerificationError`; a few values flushed below the
    smallest normal are listed in ``result.warnings``.
    """
    device = resolve_device(device)
    analysis = analysis or analyse(model, device=device)
    seconds = dict(analysis.seconds)
    timed = _Stopwatch(seconds)
    result = timed("solve", lambda: solve(analysis.groups, analysis.diag, method=solver, tol=tol,
                                          max_iter=max_iter, device=device, progress=progress,
                                          max_log_scale=max_log_scale))
    changed = timed("apply", lambda: analysis.groups.apply(model.params, result.u))
    storage_warnings = ensure_storable(model.source, analysis.groups, model.params, changed, result.u_inf)
    verification = timed("verify", lambda: compare(model.graph, model.params, {**model.params, **changed})) if verify else None
    if verification is not None and not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled network differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    return RescaleResult(analysis, result, changed, verification, seconds, storage_warnings)


def module_model(module: torch.nn.Module, input_shape: tuple[int, ...], *, name: str | None = None) -> LoadedModel:
    """Wrap an ``nn.Module`` (traced with torch.fx) as a :class:`LoadedModel`."""
    from .formats.fx_import import graph_from_module

    source = name or type(module).__name__
    graph, params = graph_from_module(module, tuple(input_shape), source=source)
    return LoadedModel(graph, params, "module", source, payload=module)


def rescale_module(module: torch.nn.Module, input_shape: tuple[int, ...], **options) -> RescaleResult:
    """Rescale ``module``'s parameters in place (function preserved, verified) and return the result.

    ``options`` are those of :func:`rescale` (``solver``, ``tol``, ``max_iter``, ``device``,
    ``max_log_scale``).
    """
    model = module_model(module, input_shape)
    result = rescale(model, **options)
    state = module.state_dict()
    with torch.no_grad():
        for key, tensor in result.changed.items():
            state[key].copy_(tensor)
    return result


def load(
    source: str | Path | bytes,
    *,
    arch: str | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (``arch``: spec file or ``module:factory``)."""
    from .formats import load_model

    return load_model(Path(source) if isinstance(source, str) else source, arch=arch, input_shape=input_shape)


def run_metadata(result: RescaleResult) -> dict[str, str]:
    """Key figures of the run, recorded in the written file's metadata."""
    solve = result.solve
    return {
        "pathcond.version": __version__,
        "pathcond.solver": solve.method,
        "pathcond.iterations": str(solve.iterations),
        "pathcond.converged": str(solve.converged).lower(),
        "pathcond.kkt_residual": f"{solve.kkt_residual:.6g}",
        "pathcond.objective_initial": repr(solve.objective[0]),
        "pathcond.objective_final": repr(solve.objective[-1]),
        "pathcond.u_inf": f"{solve.u_inf:.6g}",
        "pathcond.log10_paths": f"{result.analysis.paths.log10:.6f}",
    }


def save(
    result: RescaleResult,
    destination: str | Path,
    *,
    input_shape: tuple[int, ...] | None = None,
    in_place: bool = False,
    seconds: dict[str, float] | None = None,
) -> Verification:
    """Write the rescaled model in its input format, reload it and verify it.

    The model is written into a hidden staging directory beside ``destination``, reloaded
    from there and verified; only a file that computes the original function (and, for
    ONNX, that onnx's ReferenceEvaluator agrees with) is renamed onto ``destination``.
    Otherwise :class:`VerificationError` is raised and nothing is left behind, so
    ``destination`` — the input itself with ``in_place`` — is untouched by a failed or
    interrupted run. The verification is stored on ``result`` too.
    """
    from .fileio import check_destination, staged_output
    from .formats import write_model

    model = result.analysis.model
    destination = Path(destination)
    source = Path(model.source)
    check_destination(destination, inputs=[source] if source.exists() else [], in_place=in_place)
    not_finite = sorted(k for k, t in result.changed.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if not_finite:
        raise VerificationError(
            f"{model.source}: the rescaling produced NaN or Inf in tensor(s) {', '.join(map(repr, not_finite))} "
            f"(solver '{result.solve.method}', max |u| = {result.solve.u_inf:.3g}); nothing was written."
        )
    timings = seconds if seconds is not None else result.seconds
    timed = _Stopwatch(timings)
    with staged_output(destination) as staged:
        timed("write", lambda: write_model(model, result.changed, staged, run_metadata(result)))
        result.verification = timed(
            "verify_written", lambda: _verify_written(model, staged, input_shape, name=str(destination))
        )
    return result.verification


def _verify_written(model: LoadedModel, target: Path, input_shape, *, name: str | None = None) -> Verification:
    """Reload what was written (its architecture is embedded) and compare it with the original;
    remove it if it differs. ``name`` is how the file is called in messages (default: ``target``)."""
    from .formats import load_model

    name = name or str(target)
    try:
        try:
            written = load_model(target, input_shape=input_shape, name=name)
        except PathcondError as exc:
            raise VerificationError(f"'{name}': the written model does not read back ({exc}); nothing was written.") from None
        verification = compare(model.graph, model.params, written.params)
        if verification.passed and model.format == "onnx":
            _check_onnx_reference(model, target, verification.tolerance, name=name)
        if not verification.passed:
            raise VerificationError(
                f"'{name}': the written model differs from the original by a relative "
                f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
            )
        return verification
    except BaseException:
        remove_written(target)
        raise


def remove_written(target: Path) -> None:
    """Delete a written checkpoint, with its shards when it is a shard index."""
    from .formats import SHARD_INDEX_SUFFIX

    if target.name.endswith(SHARD_INDEX_SUFFIX) and target.is_file():
        try:
            weight_map = json.loads(target.read_text(encoding="utf-8")).get("weight_map", {})
            shards = {shard for shard in weight_map.values() if isinstance(shard, str)}
        except (OSError, ValueError, AttributeError):
            shards = set()
        for shard in shards:
            (target.parent / shard).unlink(missing_ok=True)
    target.unlink(missing_ok=True)


def _check_onnx_reference(model: LoadedModel, target: Path, tolerance: float, *, name: str | None = None) -> None:
    """Cross-check the written ONNX file with onnx's own ReferenceEvaluator."""
    from .evaluate import forward
    from .formats.onnx_format import reference_outputs

    node = model.graph.inputs[0]
    x = torch.randn((1, *node.shape), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = forward(model.graph, model.params, x)[model.graph.outputs[0]].numpy()
    got = reference_outputs(target, x.numpy().astype(np.float32))[0].astype(np.float64)
    relative = float(np.abs(got - expected).max()) / max(float(np.abs(expected).max()), 1e-300)
    tolerance = max(tolerance, 1e-4)
    if relative > tolerance:
        raise VerificationError(
            f"'{name or target}': onnx.reference.ReferenceEvaluator disagrees with the original network by a relative "
            f"{relative:.3g} (tolerance {tolerance:g}); nothing was written."
        )
