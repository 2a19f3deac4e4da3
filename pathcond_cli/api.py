"""The Python API: analyse and rescale a network given as a checkpoint or an ``nn.Module``.

    import pathcond_cli as pathcond

    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))   # in place, verified
    analysis = pathcond.analyse(pathcond.load("model.onnx"))           # diag(G), paths, groups
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__
from .diag import DiagG, PathCount, diag_g, path_count
from .errors import InputError, PathcondError, UnsupportedModelError, VerificationError
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
) -> RescaleResult:
    """Find the PathCond rescaling of ``model`` and apply it to its tensors (in memory).

    With ``verify`` (the default) the rescaled tensors are run against the original ones and
    :class:`VerificationError` is raised when they differ beyond the dtype's tolerance; the
    CLI instead verifies the file it wrote. ``result.verification`` is None when skipped.
    """
    device = resolve_device(device)
    analysis = analysis or analyse(model, device=device)
    seconds = dict(analysis.seconds)
    timed = _Stopwatch(seconds)
    if not any(bool(torch.isfinite(lg).any()) for lg in analysis.diag.log_g):
        result = timed("solve", lambda: _nothing_to_rescale(model, analysis, solver))
    else:
        result = timed("solve", lambda: solve(analysis.groups, analysis.diag, method=solver, tol=tol,
                                              max_iter=max_iter, device=device, progress=progress))
    changed = timed("apply", lambda: analysis.groups.apply(model.params, result.u))
    verification = timed("verify", lambda: compare(model.graph, model.params, {**model.params, **changed})) if verify else None
    if verification is not None and not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled network differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    return RescaleResult(analysis, result, changed, verification, seconds)


ZERO_FUNCTION_NOTE = (
    "diag(G) is zero everywhere: no path of the network carries a nonzero product of weights (it computes "
    "the zero function, or a constant). Nothing to rescale: u = 0 and the file is written unchanged; "
    "the objective is undefined and reported as 0."
)


def _nothing_to_rescale(model: LoadedModel, analysis: Analysis, solver: str) -> SolveResult:
    """The trivial solve of a network whose path kernel is zero: every group stays at u = 0."""
    if ZERO_FUNCTION_NOTE not in model.warnings:
        model.warnings.append(ZERO_FUNCTION_NOTE)
    u = torch.zeros(analysis.groups.num_free, dtype=torch.float64)
    return SolveResult(solver, u, [0.0], 0.0, True, 0, 0)


def module_model(module: torch.nn.Module, input_shape: tuple[int, ...], *, name: str | None = None) -> LoadedModel:
    """Wrap an ``nn.Module`` (traced with torch.fx) as a :class:`LoadedModel`."""
    from .formats.fx_import import graph_from_module

    source = name or type(module).__name__
    graph, params = graph_from_module(module, tuple(input_shape), source=source)
    return LoadedModel(graph, params, "module", source, payload=module)


def rescale_module(module: torch.nn.Module, input_shape: tuple[int, ...], **options) -> RescaleResult:
    """Rescale ``module``'s parameters in place (function preserved, verified) and return the result.

    ``options`` are those of :func:`rescale` (``solver``, ``tol``, ``max_iter``, ``device``).
    The rescaling is verified on the module itself: a copy holding the rescaled tensors is run
    against a copy of the original, in eval mode and, with BatchNorm, in train mode (the
    module's own running statistics are never touched). Only then are its tensors changed;
    on :class:`VerificationError` the module is left as it was. A module whose parameters are
    shared between layers (tied weights) is refused with :class:`UnsupportedModelError`.
    """
    from .verify import compare_modules

    _check_module(module)
    options.pop("verify", None)
    model = module_model(module, input_shape)
    result = rescale(model, verify=False, **options)
    verification = compare_modules(module, result.changed, tuple(input_shape))
    if not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled module differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); the module was not changed."
        )
    state = module.state_dict()
    with torch.no_grad():
        for key, tensor in result.changed.items():
            state[key].copy_(tensor)
    result.verification = verification
    return result


def _check_module(module: torch.nn.Module) -> None:
    """Refuse what ``rescale_module`` cannot rescale exactly: meta tensors and tied parameters."""
    name = type(module).__name__
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    on_meta = [key for key, tensor in tensors if tensor.is_meta]
    if on_meta:
        raise InputError(
            f"{name}: tensor(s) {', '.join(on_meta[:10])} are on the meta device and hold no values; "
            "load the weights (e.g. module.to_empty(device='cpu') then load_state_dict) before rescaling."
        )
    owners: dict[tuple[int, int], list[str]] = {}
    for key, tensor in tensors:
        if tensor.numel():
            owners.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(key)
    tied = [keys for keys in owners.values() if len(keys) > 1]
    if tied:
        raise UnsupportedModelError(
            f"{name}: parameters are shared between layers (tied weights); one rescaling per layer would change "
            "the function, so pathcond does not rescale such a module:",
            [" = ".join(keys) for keys in tied],
        )


def load(
    source: str | Path | bytes,
    *,
    arch: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    allow_unused: bool = False,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (``arch``: spec file or ``module:factory``).

    Checkpoint tensors the architecture does not read raise :class:`InputError` unless
    ``allow_unused`` (then they are carried through and named in ``warnings``).
    """
    from .formats import load_model

    return load_model(Path(source) if isinstance(source, str) else source, arch=arch, input_shape=input_shape,
                      allow_unused=allow_unused)


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
    from there and verified (for ONNX also by an independent runtime, onnxruntime or
    onnx.reference, when one can evaluate it); only a file that computes the original function
    is renamed onto ``destination``. Otherwise :class:`VerificationError` is raised and
    nothing is left behind, so ``destination`` — the input itself with ``in_place`` — is
    untouched by a failed or interrupted run. No file of the input (shards, external data,
    spec) is written without ``in_place``; companion files are written under fresh names and
    those of the replaced checkpoint are deleted after the swap. The verification is stored
    on ``result`` too.
    """
    from .fileio import check_destination, resolve_destination, staged_output
    from .formats import checkpoint_files, write_model

    model = result.analysis.model
    destination = resolve_destination(Path(destination))
    check_destination(destination, inputs=model.files, in_place=in_place)
    not_finite = sorted(k for k, t in result.changed.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if not_finite:
        raise VerificationError(
            f"{model.source}: the rescaling produced NaN or Inf in tensor(s) {', '.join(map(repr, not_finite))} "
            f"(solver '{result.solve.method}', max |u| = {result.solve.u_inf:.3g}); nothing was written."
        )
    replaced = checkpoint_files(destination)[1:] if destination.is_file() else []
    timings = seconds if seconds is not None else result.seconds
    timed = _Stopwatch(timings)
    with staged_output(destination) as stage:
        timed("write", lambda: write_model(model, result.changed, stage.path, run_metadata(result),
                                           companion_name=stage.companion_name))
        result.verification = timed(
            "verify_written", lambda: _verify_written(model, stage.path, input_shape, name=str(destination))
        )
        stage.obsolete = replaced
        if not in_place:
            stage.keep = list(model.files)
    return result.verification


def _verify_written(model: LoadedModel, target: Path, input_shape, *, name: str | None = None) -> Verification:
    """Reload what was written (its architecture is embedded) and compare it with the original.
    ``name`` is how the file is called in messages (default: ``target``)."""
    from .formats import load_model
    from .verify import independent_check

    name = name or str(target)
    try:
        written = load_model(target, input_shape=input_shape, name=name, allow_unused=True)
    except PathcondError as exc:
        raise VerificationError(f"'{name}': the written model does not read back ({exc}); nothing was written.") from None
    verification = compare(model.graph, model.params, written.params)
    if not verification.passed:
        raise VerificationError(
            f"'{name}': the written model differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    verification.independent = independent_check(model, target, verification.tolerance)
    if verification.independent["status"] == "failed":
        raise VerificationError(
            f"'{name}': {verification.independent['runtime']} disagrees with the original model: "
            f"{verification.independent['detail']}; nothing was written."
        )
    return verification
