"""The ``pathcond`` command: parse, call the library, render the report. Nothing else.

torch, onnx and the library are imported inside the commands, never at module level, so that
``pathcond --help``, ``--version`` and shell completion answer at once.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import InputError, PathcondError
from ..io.fileio import INTERRUPTING_SIGNALS, atomic_write, describe, is_character_device, read_within
from ..solve.options import (
    BOUNDED_SOLVERS,
    CRITERIA,
    DEFAULT_CRITERION,
    DEFAULT_MAX_ITER,
    DEFAULT_SOLVER,
    DEFAULT_TOL,
    PRUNING_CRITERIA,
    SOLVERS,
    InvalidOption,
    SolveOptions,
)
from ..version import __version__
from .batch import batch_plan, check_batch_options, run_batch
from .guard import CommandGuard, stream_closed

EXIT_HELP = (
    "Exit codes: 0 success · 2 usage error · 3 unreadable input (file, spec, tensors) · "
    "4 unsupported architecture · 5 verification failed (output removed) · "
    "6 output not writable · 7 NaN/Inf weights · 8 rescaling not storable in the checkpoint's dtypes "
    "(--max-log-scale none or a bound of yours) · 10 compare: the two models are not one architecture · "
    "130 interrupted (Ctrl-C) · 143 terminated (SIGTERM) · "
    "1 internal error (a bug in pathcond: please report it). "
    "Several MODELs: 0 if every file succeeded, else the code their failures share, else 9."
)

app = typer.Typer(
    name="pathcond",
    help=(
        "Rescale ReLU networks with PathCond: same function, better-conditioned path kernel.\n\n"
        "pathcond reads an ONNX model or a safetensors checkpoint (with its architecture spec), "
        "finds the neuron rescaling that best conditions the path kernel, writes the rescaled "
        "checkpoint and verifies that it computes the same function.\n\n" + EXIT_HELP
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"pathcond {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            callback=_print_version,
            is_eager=True,
            help="Print pathcond's version and exit.",
        ),
    ] = False,
) -> None:
    # Options of ``pathcond`` itself; the help text is the Typer's.
    pass


def _console_width() -> int | None:
    """rich's own choice of width, except for COLUMNS=0, which rich takes as a width of zero
    and so prints nothing at all, error messages included."""
    columns = os.environ.get("COLUMNS", "").strip()
    return FALLBACK_COLUMNS if columns.isdigit() and int(columns) == 0 else None


FALLBACK_COLUMNS = 80
# emoji=False: a name such as 'facs:b' is printed as written, not with ':b:' as an emoji.
stderr = Console(stderr=True, width=_console_width(), emoji=False)
guard = CommandGuard(stderr)


class _Command(typer.core.TyperCommand):
    """Typer's command, with arguments shown as the README writes them: ``MODEL``, not Typer's
    ``{MODEL}`` in the usage line and ``MODEL <str>`` in the list of arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument):
                param.display_type_rich = lambda ctx: None

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.replace("{", "").replace("}", "") for piece in super().collect_usage_pieces(ctx)]


DEVICE_CHOICES = ("auto", "cpu", "cuda")
# Choices as enums (what every supported Typer turns into a completing choice type).
SolverChoice = Enum("SolverChoice", {name: name for name in SOLVERS}, type=str)
CriterionChoice = Enum("CriterionChoice", {name: name for name in CRITERIA}, type=str)


def _complete_device(incomplete: str) -> list[str]:
    """auto, cpu, cuda and cuda:N for each CUDA device torch sees (torch is only imported once the
    word can only be ``c…``: ``cpu`` or a CUDA device)."""
    choices = list(DEVICE_CHOICES)
    word = incomplete.lower()
    if word.startswith("c") and ("cuda".startswith(word) or word.startswith("cuda")):
        import torch

        choices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return [choice for choice in choices if choice.startswith(incomplete.lower())]


ModelArg = Annotated[
    list[str],
    typer.Argument(
        metavar="MODEL",
        help="Checkpoint: .onnx, .safetensors, .safetensors.index.json (sharded), or - to read from stdin. "
        "Several MODELs are processed one after another in this process: with --json one JSON document per "
        "file (JSON Lines), a line per file on stderr, and a failed file does not stop the others.",
    ),
]
ArchOpt = Annotated[
    Optional[str],
    typer.Option(
        "--arch",
        metavar="SPEC|MODULE:FACTORY",
        help="Architecture of a safetensors checkpoint: a spec file (.yaml/.json) or a Python factory "
        "'module.path:callable' returning an nn.Module. Default: the spec embedded by pathcond, then a "
        "sidecar <stem>.pathcond.yaml/.json next to the checkpoint.",
    ),
]
ShapeOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--input-shape",
        metavar="[NAME:]SHAPE",
        help="Input shape without the batch dimension, e.g. 3,32,32 (for symbolic "
        "ONNX dims or to override). NAME:SHAPE shapes the input called NAME (repeat the option for each input).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="[auto|cpu|cuda|cuda:N]",
        autocompletion=_complete_device,
        help="auto (CUDA when present), cpu, cuda or cuda:N.",
    ),
]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        min=1,
        metavar="N",
        help="CPU threads torch computes with. Default: the CPUs this process may use "
        "(its affinity), capped by SLURM_CPUS_PER_TASK and OMP_NUM_THREADS when set.",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON report on stdout (schema: docs/json.md).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No tables, summary or progress on stderr.")]
PlotOpt = Annotated[
    Optional[str],
    typer.Option(
        "--plot",
        metavar="FILE",
        help="Also draw log10 diag(G) per layer (rescale: before and after, and F per iteration) to "
        "FILE.png, .svg or .pdf. Needs matplotlib: pip install 'pathcond[plot]'.",
    ),
]
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _check_plot(name: str | None) -> None:
    """--plot's usage errors, before any work is done (its destination is checked with the others)."""
    if name is None:
        return
    path = Path(name)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise typer.BadParameter(
            f"'{path}': the plot is written as {', '.join(PLOT_SUFFIXES)}, chosen by the suffix", param_hint="--plot"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise typer.BadParameter(
            "drawing a plot needs matplotlib, which is not installed: pip install 'pathcond[plot]'", param_hint="--plot"
        )


ReportOpt = Annotated[
    Optional[str], typer.Option("--report", metavar="FILE", help="Also write the JSON report to this file.")
]
InPlaceOpt = Annotated[bool, typer.Option("--in-place", help="Allow the output to replace the input file.")]
PathNormOpt = Annotated[
    Optional[list[float]],
    typer.Option(
        "--path-norm",
        metavar="Q",
        help="Also report the ℓQ path norm ‖Φ(θ)‖_Q (Q ≥ 1; repeat for several). ℓ1 and ℓ2 are always reported.",
    ),
]
AllowUnusedOpt = Annotated[
    bool,
    typer.Option(
        "--allow-unused",
        help="Carry checkpoint tensors the architecture does not read through unchanged (a warning), "
        "instead of refusing the checkpoint (exit 3).",
    ),
]


INT64_MAX = 2**63 - 1


def _parse_shape(texts: list[str] | None) -> tuple[int, ...] | dict[str, tuple[int, ...]] | None:
    """``--input-shape 3,32,32`` (the single input) or ``--input-shape NAME:3,32,32``, repeated
    once per input (as onnxsim, polygraphy and trtexec take them): a tuple or a name → shape dict."""
    if not texts:
        return None
    named: dict[str, tuple[int, ...]] = {}
    for text in texts:
        name, colon, sizes = text.rpartition(":")
        if not colon:
            if len(texts) > 1:
                raise typer.BadParameter(
                    f"'{text}' has no input name; repeated --input-shape options each name their "
                    "input, e.g. --input-shape x:3,32,32",
                    param_hint="--input-shape",
                )
            return _parse_sizes(text)
        if not name:
            raise typer.BadParameter(f"'{text}': the input name before ':' is empty", param_hint="--input-shape")
        if name in named:
            raise typer.BadParameter(f"input '{name}' is given two shapes", param_hint="--input-shape")
        named[name] = _parse_sizes(sizes)
    return named


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        raise typer.BadParameter(
            f"'{text[:200]}' is not a comma-separated list of integers", param_hint="--input-shape"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise typer.BadParameter(f"'{text[:200]}' must list positive sizes, e.g. 3,32,32", param_hint="--input-shape")
    if any(d > INT64_MAX for d in shape):
        raise typer.BadParameter(
            f"'{text[:200]}': a size beyond {INT64_MAX} (int64) is no tensor size", param_hint="--input-shape"
        )
    return shape


def _parse_path_norms(values: list[float] | None) -> tuple[float, ...]:
    """``--path-norm Q``: finite numbers ≥ 1 (below 1, ‖·‖_Q is no norm)."""
    for q in values or ():
        if not (math.isfinite(q) and q >= 1):
            raise typer.BadParameter(f"{q:g} is not a finite Q ≥ 1", param_hint="--path-norm")
    return tuple(values or ())


def _check_json_stdout(as_json: bool) -> None:
    """--json prints on stdout: refused, before any work, when stdout is closed."""
    if as_json and stream_closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but --json writes the report to it", param_hint="--json")


def _parse_device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``; CUDA only when torch sees that device."""
    value = text.strip().lower()
    if value in ("auto", "cpu"):
        return value
    if not re.fullmatch(r"cuda(:\d+)?", value):
        raise typer.BadParameter(f"'{text}' is not one of auto, cpu, cuda, cuda:N", param_hint="--device")
    import torch

    if not torch.cuda.is_available():
        raise typer.BadParameter(
            f"'{text}': CUDA was requested but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto",
            param_hint="--device",
        )
    index = int(value.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise typer.BadParameter(
            f"'{text}': this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0",
            param_hint="--device",
        )
    return value


class _Common(NamedTuple):
    """The options most commands share, parsed."""

    shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None
    device: str
    path_norms: tuple[float, ...]


def _parse_common(input_shape: list[str] | None, device: str, path_norm: list[float] | None) -> _Common:
    """--input-shape, --device and --path-norm, refused in that order before any work."""
    return _Common(_parse_shape(input_shape), _parse_device(device), _parse_path_norms(path_norm))


@contextmanager
def _running(threads: int | None, as_json: bool = False) -> Iterator[None]:
    """A command's work under the guard (``as_json``: a failure's report on stdout), with torch's
    threads sized (``--threads``, by default the CPUs this process may use) once the guard has
    imported torch."""
    from ..threads import set_threads

    with guard.command(as_json):
        set_threads(threads)
        yield


class _Stages:
    """A spinner per stage on stderr, only for people at a terminal."""

    def __init__(self, enabled: bool):
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=stderr,
            transient=True,
            disable=not enabled,
        )
        self.task = None

    def __enter__(self) -> _Stages:
        self.progress.__enter__()
        self.task = self.progress.add_task("starting")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def stage(self, description: str) -> None:
        self.progress.update(self.task, description=description)

    def solver(self, iteration: int, objective: float, residual: float) -> None:
        self.stage(f"solving: iteration {iteration}, F {objective:.10g}, KKT {residual:.2e}")


def _read_source(model: str) -> tuple[Path | bytes, Path | None, str]:
    from ..io.formats import check_readable

    if model == "-":
        if stream_closed(sys.stdin):
            raise typer.BadParameter(
                "'-' reads the model from stdin, but stdin is closed; pipe a file in", param_hint="MODEL"
            )
        if sys.stdin.isatty():
            raise typer.BadParameter(
                "'-' reads the model from stdin, but stdin is a terminal; pipe a file in", param_hint="MODEL"
            )
        limit = _stdin_limit()
        data = read_within(sys.stdin.buffer, limit)
        if data is None:
            raise InputError(
                f"<stdin>: more than {limit} bytes arrived, over a quarter of the memory available; "
                "pass the checkpoint as a file instead."
            )
        return data, None, "<stdin>"
    path = Path(model)
    check_readable(path)
    return path, path, describe(path)


def _stdin_limit() -> int:
    """Most bytes read from stdin: a quarter of the available memory (the model is held in memory)."""
    from ..io.formats import available_memory

    available = available_memory()
    return available // 4 if available is not None else 2**40


def _emit(
    report: dict[str, Any],
    *,
    as_json: bool,
    report_file: Path | None,
    quiet: bool,
    render: Callable[[dict[str, Any], Console], None] | None = None,
) -> None:
    """JSON on stdout (--json) or tables on stderr (``render``, the command's; by default
    rescale's and inspect's); warnings and the summary line close stderr."""
    from ..report.render import render as render_analysis
    from ..report.render import render_warnings, summary_line

    render = render or render_analysis
    text = json.dumps(report, indent=2, allow_nan=False)
    if report_file is not None:
        atomic_write(report_file, lambda tmp: tmp.write_text(text + "\n"))
    if as_json:
        with guard.writing_stdout("the JSON report"):
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
    if quiet:
        return
    if as_json:
        render_warnings(report, stderr)
    else:
        render(report, stderr)
    stderr.print(summary_line(report), highlight=False, markup=False, soft_wrap=True)


def _add_load_and_total(report: dict[str, Any], load_seconds: float, started: float) -> None:
    """The report's ``seconds``, with the load first and the total, since ``started``, last."""
    report["seconds"] = {
        "load": round(load_seconds, 6),
        **report["seconds"],
        "total": round(time.perf_counter() - started, 6),
    }


def _gather_report_facts(seconds: dict[str, float], gather: Callable[[], None]) -> None:
    """What the report states beyond the run's results (the histograms, the zeros' causes),
    computed as the run's ``report_facts`` stage."""
    from ..runtime import Stopwatch

    Stopwatch(seconds)("report_facts", gather)


def _draw(plot: Path | None, report: dict[str, Any], analysis, result=None) -> None:
    """Drawn after the report is out, so a plot that cannot be written costs nothing else."""
    if plot is None:
        return
    from ..report.plot import draw

    atomic_write(plot, lambda tmp: draw(report, analysis, result, tmp, plot.suffix.lower().lstrip(".")))


@app.command(cls=_Command, epilog=EXIT_HELP)
def rescale(
    models: ModelArg,
    output: Annotated[
        Optional[str],
        typer.Option(
            "-o",
            "--output",
            metavar="FILE",
            help="Where to write the rescaled checkpoint (same format), or - for stdout. "
            "Default: <stem>.pathcond<suffix> beside the input. One MODEL only.",
        ),
    ] = None,
    output_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--output-dir",
            metavar="DIR",
            help="Write each rescaled checkpoint into this existing directory as "
            "<stem>.pathcond<suffix> (several MODELs; outputs that would collide are refused before any work).",
        ),
    ] = None,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
    solver_choice: Annotated[
        SolverChoice,
        typer.Option(
            "--solver",
            metavar=f"[{'|'.join(SOLVERS)}]",
            help=f"PathCond minimiser (default {DEFAULT_SOLVER}: Newton's "
            "method, 14-76 gradient-equivalent passes on every network measured, benchmarks/README.md).",
        ),
    ] = SolverChoice(DEFAULT_SOLVER),
    criterion_choice: Annotated[
        CriterionChoice,
        typer.Option(
            "--criterion",
            metavar=f"[{'|'.join(CRITERIA)}]",
            help="pathcond (condition the path kernel) or enorm (equi-normalisation: minimise the sum of "
            "squared weights on the same groups, with its own closed-form solver), to compare criteria.",
        ),
    ] = CriterionChoice(DEFAULT_CRITERION),
    max_iter: Annotated[
        int,
        typer.Option(
            "--max-iter",
            min=0,
            metavar="N",
            help="Safety cap on solver iterations, not a tuning "
            "knob: the solver stops at --tol; a run that hits the cap is reported "
            "as not converged.",
        ),
    ] = DEFAULT_MAX_ITER,
    tol: Annotated[
        float, typer.Option("--tol", min=0.0, metavar="T", help="Relative KKT residual to stop at.")
    ] = DEFAULT_TOL,
    max_log_scale: Annotated[
        str,
        typer.Option(
            "--max-log-scale",
            metavar="[auto|none|U]",
            help="Bound on every |u_h| (neuron scale factors e^±U). auto: "
            "the unbounded optimum, or, when the checkpoint's dtypes cannot store it, the optimum within the largest "
            "bound that keeps every rescaled tensor storable (a warning says what it kept). none: unbounded; a "
            f"rescaling the dtypes cannot hold exits 8. U: the bounded optimum ({', '.join(BOUNDED_SOLVERS)}).",
        ),
    ] = "auto",
    as_json: JsonOpt = False,
    report_file: ReportOpt = None,
    in_place: InPlaceOpt = False,
    plot: PlotOpt = None,
    path_norm: PathNormOpt = None,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Rescale MODEL, write the result, verify it computes the same function, and report.

    Example: pathcond rescale model.safetensors --arch model.yaml -o model.pc.safetensors

    Several: pathcond rescale runs/*.safetensors --arch model.yaml --output-dir rescaled --json > reports.jsonl
    """
    try:
        options = SolveOptions(criterion_choice.value, solver_choice.value, tol, max_iter, max_log_scale)
    except InvalidOption as error:
        raise typer.BadParameter(str(error), param_hint=error.option) from None
    shape, device, orders = _parse_common(input_shape, device, path_norm)
    if len(models) > 1 or output_dir is not None:
        check_batch_options(models, as_json=as_json, output=output, report_file=report_file, plot=plot)
        if in_place and output_dir is not None:
            raise typer.BadParameter(
                "--in-place replaces each input; --output-dir writes elsewhere: choose one", param_hint="--in-place"
            )
        _rescale_batch(
            models, output_dir, arch, shape, in_place, as_json, quiet, allow_unused, options, device, orders, threads
        )
        return
    (model,) = models
    if output == "-" and as_json:
        raise typer.BadParameter(
            "-o - sends the checkpoint to stdout; use --report FILE for the JSON report", param_hint="--json"
        )
    if model == "-" and output is None:
        raise typer.BadParameter("reading from stdin needs -o FILE or -o -", param_hint="-o")
    if (output == "-" or as_json) and stream_closed(sys.stdout):
        raise typer.BadParameter(
            "stdout is closed, but -o - or --json writes to it", param_hint="-o" if output == "-" else "--json"
        )
    if output == "-" and sys.stdout.isatty():
        raise typer.BadParameter(
            "-o - writes the binary checkpoint to stdout, but stdout is a terminal; redirect it to a file or a pipe",
            param_hint="-o",
        )
    with _running(threads, as_json):
        _check_plot(plot)
        read = _report_read(as_json=as_json, quiet=quiet, report_file=report_file, plot=plot)
        report, run = _rescale_one(
            model, output, arch, shape, in_place, report_file, plot, quiet, allow_unused, options, device, orders, read
        )
        if report is not None:
            report_path, plot_path = run.also_written
            _emit(report, as_json=as_json, report_file=report_path, quiet=quiet)
            _draw(plot_path, report, run.analysis, run.result)


def _report_read(*, as_json: bool, quiet: bool, report_file: Path | None = None, plot: Path | None = None) -> bool:
    """Whether anyone reads a run's report: the JSON (stdout or ``report_file``), the plot drawn
    from it, or stderr's tables and summary line (all but ``quiet``)."""
    return as_json or report_file is not None or plot is not None or not quiet


def _rescale_one(
    model,
    output,
    arch,
    shape,
    in_place,
    report_file,
    plot,
    quiet,
    allow_unused,
    options: SolveOptions,
    device: str,
    path_norms=(),
    read: bool = True,
):
    """``pathcond rescale`` of one MODEL into ``output`` (None: beside it, or MODEL itself with
    ``in_place``; ``-``: stdout) through :func:`~pathcond_cli.pipeline.rescale_file`, the report
    so far kept for a failure. Returns the JSON report and the run (its ``also_written``: where
    the report and the plot go); the report's total counts reading MODEL (stdin) too. A report
    nobody ``read``s (:func:`_report_read`; ``quiet`` only silences the spinner here) is None:
    neither it nor the facts only it states (histograms, the zeros' causes) are computed."""
    from ..io.destinations import written
    from ..pipeline import rescale_file

    started = time.perf_counter()
    source, _, name = _read_source(model)
    reading = time.perf_counter() - started
    with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
        run = rescale_file(
            source,
            None if output in (None, "-") else output,
            arch=arch,
            input_shape=shape,
            name=name,
            allow_unused=allow_unused,
            options=options,
            device=device,
            path_norms=path_norms,
            in_place=in_place,
            send=_send_to_stdout if output == "-" else None,
            also_writes=[written("--report", report_file, devices=True), written("--plot", plot)],
            watcher=_RescaleWatcher(stages),
        )
        if not read:
            return None, run
        _gather_report_facts(run.seconds, run.result.gather_report_facts)
    # The total, still last, counts reading MODEL and the report's facts too.
    run.seconds["total"] = run.seconds.pop("total") + reading + run.seconds["report_facts"]
    return _rescale_report(run, "-" if output == "-" else str(run.destination)), run


def _send_to_stdout(path: Path) -> None:
    """``-o -``: the verified checkpoint's bytes, copied to stdout."""
    with open(path, "rb") as handle, guard.writing_stdout("the checkpoint", checkpoint=True):
        shutil.copyfileobj(handle, sys.stdout.buffer)
        sys.stdout.buffer.flush()


def _rescale_report(run, output: str | None) -> dict[str, Any]:
    from ..report.render import analysis_report, loaded_report, rescale_report

    if run.result is not None:
        return rescale_report(run.result, output, run.seconds)
    if run.analysis is not None:
        return {**analysis_report(run.analysis), "command": "rescale"}
    return loaded_report(run.loaded, "rescale")


class _RescaleWatcher:
    """The spinner's stages, and the report a failure prints with what the run knew by then."""

    def __init__(self, stages: _Stages):
        self.stage = stages.stage
        self.solver = stages.solver

    def reached(self, run) -> None:
        guard.report_so_far = lambda: _rescale_report(run, None)


def _rescale_batch(
    models,
    output_dir,
    arch,
    shape,
    in_place,
    as_json,
    quiet,
    allow_unused,
    options: SolveOptions,
    device: str,
    path_norms,
    threads: int | None,
) -> None:
    """Several MODELs, one after another, each exactly as a single run writing to its planned output."""
    with _running(threads):
        planned = batch_plan(models, output_dir, arch, in_place)

        def rescale_one(index: int) -> dict[str, Any] | None:
            report, _ = _rescale_one(
                models[index],
                str(planned[index].destination),
                arch,
                shape,
                in_place,
                None,
                None,
                quiet,
                allow_unused,
                options,
                device,
                path_norms,
                _report_read(as_json=as_json, quiet=quiet),
            )
            return report

        run_batch(guard, "rescale", models, rescale_one, as_json=as_json, quiet=quiet)


@app.command(cls=_Command, epilog=EXIT_HELP)
def inspect(
    models: ModelArg,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    path_norm: PathNormOpt = None,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
    report_file: ReportOpt = None,
) -> None:
    """Summarise MODEL: parameters, hidden units, rescaling groups, path count, path norms, diag(G) spread.

    Writes nothing but the files --report and --plot name. Example: pathcond inspect model.onnx --json
    """
    shape, device, orders = _parse_common(input_shape, device, path_norm)
    if len(models) > 1:
        check_batch_options(models, as_json=as_json, report_file=report_file, plot=plot)
        with _running(threads):

            def inspect_one(index: int) -> dict[str, Any]:
                return _inspect_one(models[index], arch, shape, device, allow_unused, quiet, orders=orders)[0]

            run_batch(guard, "inspect", models, inspect_one, as_json=as_json, quiet=quiet)
        return
    (model,) = models
    _check_json_stdout(as_json)
    with _running(threads, as_json):
        _check_plot(plot)
        report, analysis, plot_path, report_path = _inspect_one(
            model, arch, shape, device, allow_unused, quiet, plot, report_file, orders
        )
        _emit(report, as_json=as_json, report_file=report_path, quiet=quiet)
        _draw(plot_path, report, analysis)


def _inspect_one(model, arch, shape, device, allow_unused, quiet, plot=None, report_file=None, orders=()):
    """Load and analyse one model (``orders``: the path norms asked for beside ℓ1 and ℓ2);
    returns the JSON report, the analysis and where the plot and the report file go."""
    from ..analysis import analyse
    from ..io.destinations import check_destinations, written
    from ..io.formats import files_read, load_model
    from ..report.render import analysis_report, loaded_report

    started = time.perf_counter()
    with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
        source, source_path, name = _read_source(model)
        plot_path, report_path = check_destinations(
            [written("--plot", plot), written("--report", report_file, devices=True)], files_read(source_path, arch)
        )
        stages.stage("loading")
        loaded = load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)
        load_seconds = time.perf_counter() - started
        guard.report_so_far = loaded_report(loaded, "inspect")
        stages.stage("analysing: groups, diag(G), path count, path norms")
        analysis = analyse(loaded, device=device, path_norms=orders)
        _gather_report_facts(analysis.seconds, analysis.gather_report_facts)
        report = analysis_report(analysis)
    _add_load_and_total(report, load_seconds, started)
    return report, analysis, plot_path, report_path


InputBoundOpt = Annotated[
    float,
    typer.Option(
        "--input-bound",
        metavar="R",
        help="The bound is for inputs with ‖x‖∞ ≤ R (default 1): the output changes by at "
        "most max(R, 1) times the ℓ1 path-metric (seed 004, Theorem 4.1). With an ONNX file's pre- or post-processing, "
        "x and the output are the ReLU DAG's, between them.",
    ),
]


def _parse_input_bound(radius: float) -> float:
    if not (math.isfinite(radius) and radius > 0):
        raise typer.BadParameter(f"{radius:g} is not a finite R > 0", param_hint="--input-bound")
    return radius


def _load_one(model: str, arch, shape, allow_unused, *, arch_for_onnx: bool = True):
    """Read MODEL (a file, or - for stdin) as every command does. Without ``arch_for_onnx``
    (``compare``, whose --arch applies to both files) an ONNX model, which carries its graph,
    is read without ``arch``."""
    from ..io.formats import detect_format, load_model

    source, _, name = _read_source(model)
    if arch is not None and not arch_for_onnx:
        try:
            arch = None if detect_format(source) == "onnx" else arch
        except (OSError, PathcondError):
            pass  # load_model reports an unreadable file as every command does
    return load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)


@app.command(cls=_Command, epilog=EXIT_HELP)
def compare(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="The first checkpoint (any format pathcond reads).")],
    other: Annotated[
        str,
        typer.Argument(
            metavar="OTHER",
            help="The second checkpoint, of the same architecture: its quantised, pruned, fine-tuned or rescaled copy.",
        ),
    ],
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    input_bound: InputBoundOpt = 1.0,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
    path_norm: PathNormOpt = None,
    as_json: JsonOpt = False,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compare two checkpoints of one architecture through the ℓ1 path-metric: sign flips, path norms,
    the metric's bounds and the output-change bound for ‖x‖∞ ≤ R beside the change measured.

    Writes nothing. Example: pathcond compare model.onnx model.fp16.onnx --json
    """
    shape, device, orders = _parse_common(input_shape, device, path_norm)
    radius = _parse_input_bound(input_bound)
    if model == "-" and other == "-":
        raise typer.BadParameter("only one of MODEL and OTHER can be read from stdin", param_hint="OTHER")
    _check_json_stdout(as_json)
    with _running(threads, as_json):
        from ..report.render import compare_report, failure_report, render_compare
        from ..toolkit import compare_models

        started = time.perf_counter()
        with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
            stages.stage("loading")
            first = _load_one(model, arch, shape, allow_unused, arch_for_onnx=False)
            second = _load_one(other, arch, shape, allow_unused, arch_for_onnx=False)
            guard.report_so_far = {**failure_report("compare", first.source), "other": second.source}
            load_seconds = time.perf_counter() - started
            stages.stage("path norms, path-metric, output change")
            comparison = compare_models(first, second, input_bound=radius, device=device, path_norms=orders)
        report = compare_report(comparison)
        _add_load_and_total(report, load_seconds, started)
        _emit(report, as_json=as_json, report_file=None, quiet=quiet, render=render_compare)


@app.command(cls=_Command, epilog=EXIT_HELP)
def prune(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="Checkpoint: .onnx, .safetensors, .safetensors.index.json (sharded).")
    ],
    sparsity: Annotated[
        float,
        typer.Option(
            "--sparsity",
            metavar="S",
            help="Share of the Linear/Conv weights to zero, between 0 and 1 (already-zero weights count).",
        ),
    ],
    output: Annotated[
        Optional[str],
        typer.Option(
            "-o",
            "--output",
            metavar="FILE",
            help="Where to write the pruned checkpoint (same format). Default: <stem>.pruned<suffix> beside the input.",
        ),
    ] = None,
    criterion: Annotated[
        str,
        typer.Option(
            "--criterion",
            metavar="[path-magnitude|magnitude]",
            help="path-magnitude (default): the smallest scores "
            "Δ_i = ‖Φ(θ)‖₁ − ‖Φ(θ, θ_i = 0)‖₁, rescaling-invariant (seed 004 §5); "
            "magnitude: the smallest |W| as stored, "
            "classical magnitude pruning, the control.",
        ),
    ] = "path-magnitude",
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="The same share in every layer instead of one global ranking.")
    ] = False,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    input_bound: InputBoundOpt = 1.0,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
    path_norm: PathNormOpt = None,
    as_json: JsonOpt = False,
    report_file: ReportOpt = None,
    in_place: InPlaceOpt = False,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Prune MODEL by path magnitude: zero the weights whose removal changes ‖Φ‖₁ least, write the
    result in MODEL's format, verify it, and report the exact path-metric and the output-change bound.

    Biases, BatchNorm and per-channel scales are kept. Example: pathcond prune model.onnx --sparsity 0.5 -o pruned.onnx
    """
    if criterion not in PRUNING_CRITERIA:
        raise typer.BadParameter(f"'{criterion}' is not one of {', '.join(PRUNING_CRITERIA)}", param_hint="--criterion")
    if not (0 <= sparsity <= 1):
        raise typer.BadParameter(f"{sparsity:g} is not a share between 0 and 1", param_hint="--sparsity")
    if model == "-" or output == "-":
        raise typer.BadParameter(
            "prune reads a file and writes a file; - (stdin/stdout) is not supported",
            param_hint="MODEL" if model == "-" else "-o",
        )
    shape, device, orders = _parse_common(input_shape, device, path_norm)
    radius = _parse_input_bound(input_bound)
    _check_json_stdout(as_json)
    with _running(threads, as_json):
        from ..io.destinations import written
        from ..pipeline import checked_outputs
        from ..report.render import loaded_report, prune_report, render_prune
        from ..toolkit import prune as prune_model
        from ..toolkit import save_pruned

        started = time.perf_counter()
        source, _, _ = _read_source(model)
        destination, report_path = checked_outputs(
            source,
            output,
            arch=arch,
            in_place=in_place,
            tag="pruned",
            also_writes=[written("--report", report_file, devices=True)],
        )
        with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
            stages.stage("loading")
            loaded = _load_one(model, arch, shape, allow_unused)
            guard.report_so_far = loaded_report(loaded, "prune")
            load_seconds = time.perf_counter() - started
            stages.stage("scores, pruning, path-metric")
            result = prune_model(
                loaded,
                sparsity,
                criterion=criterion,
                per_layer=per_layer,
                input_bound=radius,
                device=device,
                path_norms=orders,
            )
            guard.report_so_far = prune_report(result, None)
            stages.stage("writing and verifying the written file")
            save_pruned(result, destination, in_place=in_place, input_shape=shape)
        report = prune_report(result, str(destination))
        _add_load_and_total(report, load_seconds, started)
        _emit(report, as_json=as_json, report_file=report_path, quiet=quiet, render=render_prune)


@app.command("spec", cls=_Command, epilog=EXIT_HELP)
def spec_command(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            help="Checkpoint: .onnx, .safetensors, .safetensors.index.json (sharded), or - to read from stdin.",
        ),
    ],
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    output: Annotated[
        Optional[str],
        typer.Option(
            "-o",
            "--output",
            metavar="FILE",
            help="Write the spec to FILE (.yaml, .yml or .json) instead of stdout.",
        ),
    ] = None,
    allow_unused: AllowUnusedOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Print the architecture spec of MODEL, as a safetensors checkpoint of its tensors needs it.

    Its tensor keys are the names MODEL's tensors have (for an ONNX model, its initializers';
    torch.export keeps the module's state_dict names). Example: pathcond spec model.onnx -o model.yaml
    """
    from ..io.formats.spec import SPEC_SUFFIXES

    if output is not None and Path(output).suffix.lower() not in SPEC_SUFFIXES and not is_character_device(output):
        raise typer.BadParameter(
            f"'{output}': a spec is written as {', '.join(SPEC_SUFFIXES)}, chosen by the suffix", param_hint="-o"
        )
    shape = _parse_shape(input_shape)
    if output is None and stream_closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but the spec is printed there; use -o FILE", param_hint="-o")
    with _running(threads):
        from ..io.destinations import check_destinations, written
        from ..io.formats import files_read, load_model
        from ..io.formats.onnx_format import batchnorm_folded_tensors
        from ..io.formats.spec import spec_from_graph, spec_text, spec_warnings
        from ..report.render import print_warnings, spec_processing_warnings

        source, source_path, name = _read_source(model)
        (destination,) = check_destinations(
            [written("-o", output, devices=True)], files_read(source_path, arch), offers_in_place=False
        )
        loaded = load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)
        text = spec_text(spec_from_graph(loaded.graph), as_json=output is not None and output.lower().endswith(".json"))
        folded = batchnorm_folded_tensors(loaded.payload) if loaded.format == "onnx" else []
        print_warnings(
            [
                *loaded.warnings,
                *spec_processing_warnings(loaded, name),
                *spec_warnings(loaded.graph, loaded.format, name, folded),
            ],
            stderr,
        )
        if destination is None:
            with guard.writing_stdout("the spec"):
                sys.stdout.write(text)
                sys.stdout.flush()
            return
        atomic_write(destination, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        stderr.print(
            f"wrote the spec of {name} ({len(loaded.graph.nodes)} layers) to '{describe(destination)}'",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


@app.command()
def version() -> None:
    """Print pathcond's version."""
    typer.echo(__version__)


def main() -> None:
    """The ``pathcond`` command. Ctrl-C at any moment exits 130, SIGTERM 143, with one line saying
    what is on disk."""
    for signum in INTERRUPTING_SIGNALS:
        signal.signal(signum, guard.on_signal)
    _fill_closed_output_streams()
    try:
        app()
    finally:
        # The command is over and its report printed: an interrupt during the interpreter's
        # shutdown would kill it by signal, which would tell the caller a finished run failed.
        for signum in INTERRUPTING_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        # The shutdown's garbage collections would walk every object torch created at import
        # (0.3 s on every run); what is left is freed with the process anyway.
        gc.freeze()


def _fill_closed_output_streams() -> None:
    """Started with stdout or stderr closed (``>&-``, ``2>&-``): the descriptor, missing or
    taken by a file opened for reading, is pointed at /dev/null, so that no file the run opens
    takes that number. stdout is then closed for the commands (``-o -`` and ``--json`` refuse
    it); messages to a closed stderr are swallowed instead of failing the run (the exit status
    still tells)."""
    import fcntl

    for fd in (1, 2):
        try:
            writable = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        except OSError:
            writable = False
        if writable:
            continue
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if fd == 1:
            sys.stdout = None
        else:
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - lives as long as the process
