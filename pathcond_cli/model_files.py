"""A model's files: load one, and write a rescaled one as :func:`save` does: into a staging
directory, read back, verified, and only then renamed onto its destination.

    import pathcond_cli as pathcond
    result = pathcond.rescale(pathcond.load("model.onnx"))
    pathcond.save(result, "model.pc.onnx")                               # staged, reloaded, verified
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from .analysis import check_path_norms
from .engine.calibration import constant_output_warnings
from .engine.graph import all_finite
from .engine.layouts import release_held
from .engine.model import LoadedModel
from .errors import PathcondError, VerificationError

# The module, not its functions: a loader replaced in it (a test's fault) is the one called here.
from .io import formats
from .io.fileio import check_destination, check_unchanged, describe, resolve_destination, staged_output
from .io.formats import replaced_companions, write_model
from .rescaling import RescaleResult
from .runtime import Stopwatch
from .solve.bounds import within_dtype
from .solve.dtype_limits import StorageCheck, ensure_storable, storage_problem
from .solve.options import AUTO
from .verify import Verification, compare, independent_check
from .version import __version__

VerifiedT = TypeVar("VerifiedT")


class _BoundedByTheWrite(Exception):
    """The tensors just written lose values and the auto rule bounded the solve: write again."""


def load(
    source: str | Path | bytes,
    *,
    arch: str | None = None,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    allow_unused: bool = False,
) -> LoadedModel:
    """Load an ONNX model or a safetensors checkpoint (``arch``: spec file or ``module:factory``).

    Checkpoint tensors the architecture does not read raise :class:`InputError` unless
    ``allow_unused`` (then they are carried through and named in ``warnings``).
    """
    return formats.load_model(
        Path(source) if isinstance(source, str) else source,
        arch=arch,
        input_shape=input_shape,
        allow_unused=allow_unused,
    )


def run_metadata(result: RescaleResult) -> dict[str, str]:
    """Key figures of the run, recorded in the written file's metadata."""
    solve = result.solve
    return {
        "pathcond.version": __version__,
        "pathcond.criterion": result.criterion,
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
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    in_place: bool = False,
    seconds: dict[str, float] | None = None,
    self_contained: bool = False,
) -> Verification:
    """Write the rescaled model in its input format, reload it and verify it.

    The model is written into a hidden staging directory beside ``destination``, reloaded
    from there and verified, running the graph read back from it (for ONNX also by an
    independent runtime, onnxruntime or onnx.reference, when one can evaluate the original: the
    written file must then load and agree); only a file that computes the original function is
    renamed onto ``destination``. Otherwise :class:`VerificationError` is raised and
    nothing is left behind, so ``destination`` — the input itself with ``in_place`` — is
    untouched by a failed or interrupted run. No file of the input (shards, external data,
    spec) is written without ``in_place``; companion files are written under fresh names and,
    after the swap, those provably the replaced checkpoint's own are deleted (the others it
    named are left, each named in ``result.warnings``). The verification is stored
    on ``result`` too. With ``self_contained`` an ONNX model read with external data is written
    as one file, its data inline (:class:`OutputError` beyond protobuf's 2 GiB). Each rescaled
    tensor is computed once here, as it is written, and checked then: its values finite and, for
    a ``result`` whose storage check was left to the write (``rescale(check_storage_when_written=
    True)``), storable in its dtype, with :func:`rescale`'s refusal, bound and warnings (a bound
    found here writes the bounded tensors again).
    """
    model = result.analysis.model
    if input_shape is None and model.format == "onnx":
        # The written file is read back with the shapes the analysis used, which the model may leave open.
        input_shape = model.carried.inputs or {node.name: tuple(node.shape) for node in model.graph.inputs}
    timings = seconds if seconds is not None else result.seconds
    timed = Stopwatch(timings)

    while True:
        changed = CheckedWhenRead(
            result.changed,
            model.params,
            f"{model.source}: the rescaling (solver '{result.solve.method}', max |u| = {result.solve.u_inf:.3g})",
            storage=result.pending_storage_check is not None,
        )

        def verify(target: Path, name: str, checked: CheckedWhenRead = changed) -> Verification:
            if result.pending_storage_check is not None:
                _settle_storage(result, checked.storage_problems(), timed)
            verification, written = _verify_written(
                model,
                target,
                input_shape,
                name=name,
                compared=lambda verification: _add_calibration(result, verification),
            )
            result.path_norms_after = check_path_norms(
                result.analysis, written.graph, written.params, name, rescaled_by=result.solve.u
            )
            return verification

        try:
            result.verification = write_staged(
                model,
                changed,
                destination,
                run_metadata(result),
                verify,
                in_place=in_place,
                self_contained=self_contained,
                warnings=result.warnings,
                timed=timed,
            )
        except _BoundedByTheWrite:
            continue
        return result.verification


def _add_calibration(result: RescaleResult, verification: Verification) -> None:
    """The calibration warning :func:`rescale` left to :func:`save`, from the verification's run
    of the original (added even when the verification then fails: it may say why)."""
    if result.calibration_pending:
        result.warnings += constant_output_warnings(result.analysis.model, verification.original_ignores_input)
        result.calibration_pending = False


def _settle_storage(result: RescaleResult, problems: list[StorageCheck], timed: Stopwatch) -> None:
    """What :func:`rescale` does with the storage ``problems`` of ``result.changed``, found by the
    write: under the auto rule a first loss bounds the solve (:class:`_BoundedByTheWrite`, the
    tensors are written again and checked then); otherwise a loss is :class:`StorageError`, and
    a few flushed values are warnings."""
    model, groups = result.analysis.model, result.analysis.groups
    if result.bound.rule == AUTO and not result.bound.applied:
        solved, changed, choice = timed(
            "solve",
            lambda: within_dtype(
                groups, model.params, result.solve, result.changed, result.pending_storage_check.resolve, problems
            ),
        )
        if choice.applied:
            result.solve, result.changed, result.bound = solved, changed, choice
            raise _BoundedByTheWrite
    result.warnings[:0] = ensure_storable(
        model.source, groups, model.params, result.changed, result.solve.u_inf, problems=problems
    ) + result.bound.warnings(model.source, result.solve)
    result.pending_storage_check = None


class CheckedWhenRead(Mapping[str, torch.Tensor]):
    """``tensors`` checked as the writer reads each one, so that the checks share the writer's
    computation of a rescaled tensor instead of making their own: with ``storage``, what storing
    it in its dtype loses (:meth:`storage_problems`, against ``original``); and its values
    finite, else :class:`VerificationError` before the staged file can be kept (``what`` names
    what produced the tensors). A tensor that overflows is a storage problem, left to the
    storage check's refusal or bound."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], original: Mapping[str, torch.Tensor], what: str, *, storage: bool
    ):
        self._tensors, self._original, self._what = tensors, original, what
        self._problems: dict[str, StorageCheck] | None = {} if storage else None

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._tensors[key]
        if self._problems is not None and (problem := storage_problem(key, self._original, tensor)) is not None:
            self._problems[key] = problem
        elif tensor.is_floating_point() and not all_finite(tensor):
            raise VerificationError(f"{self._what} produced NaN or Inf in tensor {key!r}; nothing was written.")
        return tensor

    def storage_problems(self) -> list[StorageCheck]:
        """The problems found so far, in the order of ``tensors`` (as :func:`check_storage` lists them)."""
        return [self._problems[key] for key in self._tensors if key in self._problems]

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def write_staged(
    model: LoadedModel,
    changed: Mapping[str, torch.Tensor],
    destination: str | Path,
    metadata: dict[str, str],
    verify: Callable[[Path, str], VerifiedT],
    *,
    in_place: bool = False,
    self_contained: bool = False,
    warnings: list[str] | None = None,
    timed: Callable | None = None,
) -> VerifiedT:
    """Write ``model`` with ``changed`` tensors in its own format into a staging directory beside
    ``destination``, run ``verify(staged_path, shown_name)`` on what was written, and only if it
    returns rename the file onto ``destination`` (the rules of :func:`save`): a failed check
    raises and leaves nothing behind. Returns what ``verify`` returned."""
    timed = timed or Stopwatch({})
    destination = resolve_destination(Path(destination))
    check_destination(destination, inputs=model.files, in_place=in_place)
    replaced, left = replaced_companions(destination) if destination.is_file() else ([], [])
    with staged_output(destination) as stage:
        timed(
            "write",
            lambda: write_model(
                model, changed, stage.path, metadata, companion_name=stage.companion_name, self_contained=self_contained
            ),
        )
        verified = timed("verify_written", lambda: verify(stage.path, str(destination)))
        stage.obsolete = replaced
        if in_place:
            check_unchanged(model.file_states)
        else:
            stage.keep = list(model.files)
    if warnings is not None:
        warnings += [
            f"'{describe(file)}', named as data by the replaced '{describe(destination)}', was left in "
            "place: pathcond deletes only data files provably that model's own"
            for file in left
        ]
    return verified


def _verify_written(
    model: LoadedModel,
    target: Path,
    input_shape,
    *,
    name: str | None = None,
    compared: Callable[[Verification], None] | None = None,
) -> tuple[Verification, LoadedModel]:
    """Reload what was written (its architecture is embedded) and compare it with the original;
    returns the verification and the model read back. ``name`` is how the file is called in
    messages (default: ``target``); ``compared`` sees the comparison before it is judged."""
    name = name or str(target)
    try:
        written = formats.load_model(target, input_shape=input_shape, name=name, allow_unused=True)
    except PathcondError as exc:
        raise VerificationError(
            f"'{name}': the written model does not read back ({exc}); nothing was written."
        ) from None
    # Held any longer, the written values would add to the run's peak: the loader's check read them.
    release_held(written.params)
    # Nor is its format state (an ONNX model's whole ModelProto, as large as its tensors) used
    # again: the comparison reads its graph and tensors, the independent runtime its file.
    written.payload = None
    verification = compare(model.graph, model.params, written.params, rescaled_graph=written.graph)
    if compared is not None:
        compared(verification)
    if not verification.passed:
        raise VerificationError(
            f"'{name}': the written model differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); nothing was written."
        )
    verification.independent = independent_check(model, target, verification.tolerance)
    if verification.independent["status"] == "failed":
        raise VerificationError(
            f"'{name}': the check by {verification.independent['runtime']} failed: "
            f"{verification.independent['detail']}; nothing was written."
        )
    return verification, written
