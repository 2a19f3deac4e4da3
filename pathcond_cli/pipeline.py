"""One checkpoint file through the whole pipeline, as ``pathcond rescale`` runs it: read →
analyse → rescale → staged write → verify the written file. The CLI and library users share
:func:`rescale_file`; the CLI adds its options, its report and stdout.

    import pathcond_cli.pipeline as pipeline
    run = pipeline.rescale_file("model.onnx", "model.pc.onnx")
    run.result.verification, run.seconds
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Modules, not their functions: a stage replaced in its module (a test's fault) is the one run here.
from . import analysis, model_files, rescaling
from .analysis import Analysis
from .engine.model import LoadedModel
from .errors import OutputError, UsageError
from .io import formats
from .io.destinations import Written, check_destinations, default_output, written
from .io.fileio import TMP_SUFFIX
from .io.formats import InputShape
from .rescaling import RescaleResult
from .runtime import Stopwatch
from .solve.options import SolveOptions


@dataclass
class FileRescale:
    """A run of :func:`rescale_file` as far as it got: the model read, its analysis, the result
    (verified once written), where it was written (None: sent), the paths checked beside it
    (``also_writes``, in order), and the seconds of each stage, ``total`` once verified."""

    loaded: LoadedModel | None = None
    analysis: Analysis | None = None
    result: RescaleResult | None = None
    destination: Path | None = None
    also_written: list[Path | None] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


class Watcher:
    """What a caller sees of a run while it goes: each stage as it starts, each solver iteration,
    and the run after each step (the CLI keeps it, to report a failure with what was known).
    This one watches nothing; any object with these three methods will do."""

    def stage(self, description: str) -> None:
        """A stage starts."""

    def solver(self, iteration: int, objective: float, residual: float) -> None:
        """The solver finished ``iteration``: F and the relative KKT residual."""

    def reached(self, run: FileRescale) -> None:
        """``run`` has its model, then its analysis, then its result."""


def rescale_file(
    source: str | os.PathLike | bytes,
    destination: str | os.PathLike | None = None,
    *,
    arch: str | None = None,
    input_shape: InputShape | None = None,
    name: str | None = None,
    allow_unused: bool = False,
    options: SolveOptions | None = None,
    device: str | torch.device = "auto",
    path_norms: Iterable[float] = (),
    in_place: bool = False,
    send: Callable[[Path], None] | None = None,
    also_writes: Sequence[Written | None] = (),
    watcher: Watcher | None = None,
) -> FileRescale:
    """Rescale the checkpoint ``source`` (a path, or the checkpoint's own bytes, never a path as
    bytes) into ``destination``, verified.

    ``destination`` defaults to ``<stem>.pathcond<suffix>`` beside ``source`` (``source``
    itself with ``in_place``); it is in
    ``source``'s format, never a file the run reads, and never ``source`` itself unless
    ``in_place``. The file is written into a staging directory, reloaded and verified there
    (:func:`pathcond_cli.model_files.save`), and renamed onto ``destination`` only if it computes the
    original function. With ``send`` no file is kept: the model is written self-contained into a
    private scratch directory, verified there, and ``send(path)`` is called with the verified
    file before the directory is removed (the CLI's ``-o -`` copies it to stdout); ``send``
    excludes ``destination`` and ``in_place``.
    ``also_writes`` are the caller's other outputs (a report, a plot), checked with
    ``destination`` before any work (:func:`~pathcond_cli.io.destinations.check_destinations`,
    whose messages name the CLI's options); their paths come back in ``also_written``.
    ``options``, ``device`` and ``path_norms`` are :func:`~pathcond_cli.rescaling.rescale`'s and
    :func:`~pathcond_cli.analysis.analyse`'s; ``name`` is how messages call ``source``.
    """
    started = time.perf_counter()
    watcher = watcher or Watcher()
    run = FileRescale()
    source = Path(source) if isinstance(source, (str, os.PathLike)) else source
    run.destination, *run.also_written = checked_outputs(
        source, destination, arch=arch, in_place=in_place, sent=send is not None, also_writes=also_writes
    )

    watcher.stage("loading")
    run.loaded = Stopwatch(run.seconds)(
        "load",
        lambda: formats.load_model(source, arch=arch, input_shape=input_shape, name=name, allow_unused=allow_unused),
    )
    if send is not None:
        formats.check_streamable(run.loaded)
    watcher.reached(run)

    watcher.stage("analysing: groups, diag(G), path count, path norms")
    run.analysis = analysis.analyse(run.loaded, device=device, path_norms=path_norms)
    watcher.reached(run)
    # The storage check shares the write's computation of each rescaled tensor.
    run.result = rescaling.rescale(
        run.loaded,
        options,
        progress=watcher.solver,
        verify=False,
        analysis=run.analysis,
        check_storage_when_written=True,
        device=device,
    )
    run.seconds.update(run.result.seconds)
    watcher.reached(run)

    watcher.stage("writing and verifying the written file")
    if send is None:
        model_files.save(run.result, run.destination, input_shape=input_shape, in_place=in_place, seconds=run.seconds)
        run.seconds["total"] = time.perf_counter() - started
        return run
    with _scratch_directory() as scratch:
        target = scratch / f"out.{run.loaded.format}"
        model_files.save(run.result, target, input_shape=input_shape, seconds=run.seconds, self_contained=True)
        run.seconds["total"] = time.perf_counter() - started
        send(target)
    return run


def checked_outputs(
    source: Path | bytes,
    destination: str | os.PathLike | None,
    *,
    arch: str | None = None,
    in_place: bool = False,
    tag: str = "pathcond",
    sent: bool = False,
    also_writes: Sequence[Written | None] = (),
) -> list[Path | None]:
    """Where a run on ``source`` writes, refused before any work where it breaks
    :mod:`~pathcond_cli.io.destinations`' rule or does not fit ``source``'s format
    (:class:`UsageError`): ``destination`` (by default ``<stem>.<tag><suffix>`` beside
    ``source``, ``source`` itself with ``in_place``; None when the model is ``sent``, not kept),
    then each of ``also_writes``."""
    source_path = source if isinstance(source, Path) else None
    kind = formats.detect_format(source)
    if sent:
        if destination is not None or in_place:
            raise UsageError("a model that is sent is not kept: give send, or a destination (or in_place), not both.")
    else:
        if destination is None and source_path is None:
            raise UsageError("a model given as its bytes needs a destination (or send) to write to.")
        if destination is None:
            destination = source_path if in_place else default_output(source_path, tag)
        mismatch = formats.format_mismatch(kind, Path(destination))
        if mismatch:
            raise UsageError(f"{mismatch}.")
    # Checked as given: Path() would drop the slash that names a directory.
    return check_destinations(
        [written("-o", destination, kind), *also_writes], formats.files_read(source_path, arch), in_place=in_place
    )


@contextmanager
def _scratch_directory() -> Iterator[Path]:
    """A private temporary directory for a model that is sent, not kept."""
    try:
        # Named like pathcond's staging directories: what is written there is not an output.
        scratch = tempfile.TemporaryDirectory(prefix="pathcond-", suffix=TMP_SUFFIX)
    except OSError as exc:
        raise OutputError(
            f"cannot write the output for stdout: no temporary directory in '{tempfile.gettempdir()}' "
            f"({exc.strerror or exc}); set TMPDIR to a writable directory."
        ) from None
    with scratch as name:
        yield Path(name)
