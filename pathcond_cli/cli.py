"""The ``pathcond`` command: parse, call the library, render the report. Nothing else.

torch, onnx and the library are imported inside the commands, never at module level, so that
``pathcond --help``, ``--version`` and shell completion answer at once.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from enum import Enum
from typing import Annotated, Any, Optional

import rich.markup
import typer
import typer.core
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from . import __version__
from .defaults import (
    BOUNDED_SOLVERS, CRITERIA, DEFAULT_CRITERION, DEFAULT_MAX_ITER, DEFAULT_SOLVER, DEFAULT_TOL, SOLVERS,
)
from .errors import EXIT_CODES, InputError, OutputError, PathcondError, UnsupportedModelError
from .fileio import atomic_write, check_destination, describe, resolve_destination, sigint_deferred, written_files

EXIT_HELP = (
    "Exit codes: 0 success · 2 usage error · 3 unreadable input (file, spec, tensors) · "
    "4 unsupported architecture · 5 verification failed (output removed) · "
    "6 output not writable · 7 NaN/Inf weights · 130 interrupted · 1 internal error (a bug in pathcond: please "
    "report it)."
)

DEBUG_VARIABLE = "PATHCOND_DEBUG"

# Whether bytes of the checkpoint went to stdout (``-o -``): an interrupt then leaves it incomplete.
_stdout_started = False
# Whether a command is running inside ``_errors_to_exit_codes`` (see ``_interrupted``).
_guarded = False

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
    version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_print_version, is_eager=True, help="Print pathcond's version and exit.",
    )] = False,
) -> None:
    # Options of ``pathcond`` itself; the help text is the Typer's.
    pass

stderr = Console(stderr=True)


class _Command(typer.core.TyperCommand):
    """Typer's command, with arguments shown as the README writes them: ``MODEL``, not Typer's
    ``{MODEL}`` in the usage line and ``MODEL <str>`` in the list of arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument):
                param.display_type_rich = lambda ctx: None

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]


DEVICE_CHOICES = ("auto", "cpu", "cuda")
# Choices as enums (what every supported Typer turns into a completing choice type).
SolverChoice = Enum("SolverChoice", {name: name for name in SOLVERS}, type=str)
CriterionChoice = Enum("CriterionChoice", {name: name for name in CRITERIA}, type=str)


def _complete_device(incomplete: str) -> list[str]:
    """auto, cpu, cuda and cuda:N for each CUDA device torch sees (torch is only imported for ``cuda:``)."""
    choices = list(DEVICE_CHOICES)
    if incomplete.startswith("cuda"):
        import torch

        choices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return [choice for choice in choices if choice.startswith(incomplete.lower())]

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL",
    help="Checkpoint: .onnx, .safetensors, .safetensors.index.json (sharded), or - to read from stdin.",
)]
ArchOpt = Annotated[Optional[str], typer.Option(
    "--arch", metavar="SPEC|MODULE:FACTORY",
    help="Architecture of a safetensors checkpoint: a spec file (.yaml/.json) or a Python factory "
    "'module.path:callable' returning an nn.Module. Default: the spec embedded by pathcond, then a "
    "sidecar <stem>.pathcond.yaml/.json next to the checkpoint.",
)]
ShapeOpt = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", metavar="[NAME:]SHAPE", help="Input shape without the batch dimension, e.g. 3,32,32 (for symbolic "
    "ONNX dims or to override). NAME:SHAPE shapes the input called NAME (repeat the option for each input).",
)]
DeviceOpt = Annotated[str, typer.Option(
    "--device", metavar="[auto|cpu|cuda|cuda:N]", autocompletion=_complete_device,
    help="auto (CUDA when present), cpu, cuda or cuda:N.",
)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON report on stdout (schema in the README).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No tables, summary or progress on stderr.")]
PlotOpt = Annotated[Optional[Path], typer.Option(
    "--plot", metavar="FILE", help="Also draw log10 diag(G) per layer (before and after) and F per iteration to FILE.png, .svg "
    "or .pdf. Needs matplotlib: pip install 'pathcond[plot]'.",
)]
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _check_plot(path: Path | None) -> None:
    """--plot's usage errors and an unwritable destination, before any work is done."""
    if path is None:
        return
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise typer.BadParameter(f"'{path}': the plot is written as {', '.join(PLOT_SUFFIXES)}, chosen by the suffix",
                                 param_hint="--plot")
    if importlib.util.find_spec("matplotlib") is None:
        raise typer.BadParameter("drawing a plot needs matplotlib, which is not installed: "
                                 "pip install 'pathcond[plot]'", param_hint="--plot")
    check_destination(path)
AllowUnusedOpt = Annotated[bool, typer.Option(
    "--allow-unused", help="Carry checkpoint tensors the architecture does not read through unchanged (a warning), "
    "instead of refusing the checkpoint (exit 3).",
)]


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
                raise typer.BadParameter(f"'{text}' has no input name; repeated --input-shape options each name their "
                                         "input, e.g. --input-shape x:3,32,32", param_hint="--input-shape")
            return _parse_sizes(text)
        if not name:
            raise typer.BadParameter(f"'{text}': the input name before ':' is empty", param_hint="--input-shape")
        if name in named:
            raise typer.BadParameter(f"input '{name}' is given two shapes", param_hint="--input-shape")
        named[name] = _parse_sizes(sizes)
    return named


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"'{text}' is not a comma-separated list of integers", param_hint="--input-shape") from None
    if not shape or any(d <= 0 for d in shape):
        raise typer.BadParameter(f"'{text}' must list positive sizes, e.g. 3,32,32", param_hint="--input-shape")
    return shape


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
            f"'{text}': this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0", param_hint="--device"
        )
    return value


def _import_library() -> None:
    """Import what every command's work needs (torch first) with Ctrl-C held back until it is
    loaded: delivered then, at most a second late, before any command code has run."""
    with sigint_deferred():
        for name in ("torch", "pathcond_cli.api", "pathcond_cli.formats", "pathcond_cli.report"):
            importlib.import_module(name)


@contextlib.contextmanager
def _errors_to_exit_codes(complete: bool = False) -> Iterator[None]:
    """One paragraph on stderr and a distinct exit code; never a traceback. ``complete``
    (``--json``) lists every problem of a refused network, consequences included."""
    global _guarded, _stdout_started
    _import_library()
    _guarded, _stdout_started = True, False
    written_files.clear()
    try:
        yield
    except PathcondError as exc:
        text = exc.complete if complete and isinstance(exc, UnsupportedModelError) else str(exc)
        stderr.print(f"[bold red]error:[/] {_printable(text)}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        stderr.print(f"[bold red]interrupted:[/] {_what_is_on_disk()}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(EXIT_CODES["interrupted"]) from None
    except BrokenPipeError:
        # The reader of stdout went away (``pathcond ... -o - | head``): say so once, quietly.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        stderr.print("[bold red]error:[/] stdout was closed before the output was complete.")
        raise typer.Exit(EXIT_CODES["output_not_written"]) from None
    except MemoryError:
        stderr.print("[bold red]error:[/] out of memory; try --device cuda or a machine with more memory.")
        raise typer.Exit(1) from None
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise  # usage errors and deliberate exits: typer reports them itself
    except Exception as exc:
        # A bug in pathcond, not a problem with the input: one paragraph, unless asked for more.
        if os.environ.get(DEBUG_VARIABLE):
            raise
        stderr.print(
            f"[bold red]internal error:[/] {type(exc).__name__}: {_printable(str(exc))}\n"
            f"This is a bug in pathcond {__version__}; please report it with the command line. "
            f"Set {DEBUG_VARIABLE}=1 to see the traceback.",
            highlight=False, markup=True, soft_wrap=True,
        )
        raise typer.Exit(1) from None
    finally:
        _guarded = False


def _printable(text: str) -> str:
    """``text`` without rich markup and with undecodable file-name bytes shown as escapes."""
    return rich.markup.escape(describe(text))


def _what_is_on_disk() -> str:
    """The truth about the files after an interrupt: which outputs were completely written."""
    if written_files:
        return ("the output was completely written and verified before the interrupt: "
                + ", ".join(f"'{describe(path)}'" for path in written_files) + ".")
    if _stdout_started:
        return "the checkpoint sent to stdout is incomplete; no file was written."
    return "nothing was written; the input is unchanged."


class _Stages:
    """A spinner per stage on stderr, only for people at a terminal."""

    def __init__(self, enabled: bool):
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
            console=stderr, transient=True, disable=not enabled,
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
    from .formats import check_readable

    if model == "-":
        if _closed(sys.stdin):
            raise typer.BadParameter("'-' reads the model from stdin, but stdin is closed; pipe a file in", param_hint="MODEL")
        if sys.stdin.isatty():
            raise typer.BadParameter("'-' reads the model from stdin, but stdin is a terminal; pipe a file in", param_hint="MODEL")
        limit = _stdin_limit()
        data = sys.stdin.buffer.read(limit + 1)
        if len(data) > limit:
            raise InputError(f"<stdin>: more than {limit} bytes arrived, over a quarter of the memory available; "
                             "pass the checkpoint as a file instead.")
        return data, None, "<stdin>"
    path = Path(model)
    check_readable(path)
    return path, path, describe(path)


def _stdin_limit() -> int:
    """Most bytes read from stdin: a quarter of the available memory (the model is held in memory)."""
    from .formats import available_memory

    available = available_memory()
    return available // 4 if available is not None else 2**40


def _closed(stream) -> bool:
    """Whether a standard stream is missing (Python sets it to None when started with ``<&-``) or closed."""
    return stream is None or bool(getattr(stream, "closed", False))


@contextlib.contextmanager
def _scratch_directory() -> Iterator[Path]:
    """A private temporary directory for output headed to stdout (``-o -``)."""
    try:
        scratch = tempfile.TemporaryDirectory(prefix="pathcond-")
    except OSError as exc:
        raise OutputError(
            f"cannot write the output for stdout: no temporary directory in '{tempfile.gettempdir()}' "
            f"({exc.strerror or exc}); set TMPDIR to a writable directory."
        ) from None
    with scratch as name:
        yield Path(name)


def _input_files(source_path: Path | None, arch: str | None) -> list[Path]:
    """Every file the run reads that is known before loading: checkpoint, shards, external data, spec."""
    from .formats import checkpoint_files

    files = checkpoint_files(source_path) if source_path is not None else []
    if arch is not None and arch.lower().endswith((".yaml", ".yml", ".json")):
        files.append(Path(arch))
    return files


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _default_output(path: Path) -> Path:
    from .formats import SHARD_INDEX_SUFFIX

    if path.name.endswith(SHARD_INDEX_SUFFIX):
        return path.with_name(path.name[: -len(SHARD_INDEX_SUFFIX)] + ".pathcond" + SHARD_INDEX_SUFFIX)
    return path.with_name(f"{path.stem}.pathcond{path.suffix}")


def _emit(report: dict[str, Any], *, as_json: bool, report_file: Path | None, quiet: bool) -> None:
    """JSON on stdout (--json) or tables on stderr; warnings and the summary line close stderr."""
    from .report import render, render_warnings, summary_line

    text = json.dumps(report, indent=2, allow_nan=False)
    if report_file is not None:
        atomic_write(report_file, lambda tmp: tmp.write_text(text + "\n"))
    if as_json:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    if quiet:
        return
    if as_json:
        render_warnings(report, stderr)
    else:
        render(report, stderr)
    stderr.print(summary_line(report), highlight=False, markup=False, soft_wrap=True)


def _draw(plot: Path | None, report: dict[str, Any], analysis, result=None) -> None:
    """Drawn after the report is out, so a plot that cannot be written costs nothing else."""
    if plot is None:
        return
    from .plot import draw

    try:
        atomic_write(plot, lambda tmp: draw(report, analysis, result, tmp, plot.suffix.lower().lstrip(".")))
    except OutputError as exc:
        done = (f"the rescaled checkpoint '{report['output']}' was written and verified" if "output" in report
                else "the report is complete")
        raise OutputError(f"{exc} Only the plot is missing: {done}.") from None


@app.command(cls=_Command, epilog=EXIT_HELP)
def rescale(
    model: ModelArg,
    output: Annotated[Optional[str], typer.Option(
        "-o", "--output", metavar="FILE", help="Where to write the rescaled checkpoint (same format), or - for stdout. "
        "Default: <stem>.pathcond<suffix> beside the input.",
    )] = None,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    device: DeviceOpt = "auto",
    solver_choice: Annotated[SolverChoice, typer.Option(
        "--solver", metavar=f"[{'|'.join(SOLVERS)}]", help=f"PathCond minimiser (default {DEFAULT_SOLVER}: Newton's "
        "method, 14-76 gradient-equivalent passes on every network measured, benchmarks/README.md).",
    )] = SolverChoice(DEFAULT_SOLVER),
    criterion_choice: Annotated[CriterionChoice, typer.Option(
        "--criterion", metavar=f"[{'|'.join(CRITERIA)}]", help="pathcond (condition the path kernel) or enorm (equi-normalisation: minimise the sum of "
        "squared weights on the same groups, with its own closed-form solver), to compare criteria.",
    )] = CriterionChoice(DEFAULT_CRITERION),
    max_iter: Annotated[int, typer.Option("--max-iter", min=0, metavar="N", help="Safety cap on solver iterations, not a tuning "
                                          "knob: the solver stops at --tol; a run that hits the cap is reported "
                                          "as not converged.")] = DEFAULT_MAX_ITER,
    tol: Annotated[float, typer.Option("--tol", min=0.0, metavar="T", help="Relative KKT residual to stop at.")] = DEFAULT_TOL,
    max_log_scale: Annotated[Optional[float], typer.Option(
        "--max-log-scale", min=0.0, help="Bound every neuron scale factor to e^±U (|u_h| ≤ U): the bounded "
        f"optimum, for checkpoints whose dtype cannot hold the unbounded one ({', '.join(BOUNDED_SOLVERS)}).",
    )] = None,
    as_json: JsonOpt = False,
    report_file: Annotated[Optional[Path], typer.Option("--report", metavar="FILE", help="Also write the JSON report to this file.")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="Allow the output to replace the input file.")] = False,
    plot: PlotOpt = None,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Rescale MODEL, write the result, verify it computes the same function, and report.

    Example: pathcond rescale model.safetensors --arch model.yaml -o model.pc.safetensors
    """
    solver, criterion = solver_choice.value, criterion_choice.value
    if criterion == "enorm" and solver != DEFAULT_SOLVER:
        raise typer.BadParameter("--solver chooses a PathCond minimiser; --criterion enorm has its own closed-form "
                                 "solver", param_hint="--solver")
    if not math.isfinite(tol):
        raise typer.BadParameter(f"{tol} is not a finite tolerance", param_hint="--tol")
    if max_log_scale is not None and not math.isfinite(max_log_scale):
        raise typer.BadParameter(f"{max_log_scale} is not a finite bound", param_hint="--max-log-scale")
    if max_log_scale is not None and criterion == "enorm":
        raise typer.BadParameter("--max-log-scale bounds PathCond's solvers; --criterion enorm takes no bound",
                                 param_hint="--max-log-scale")
    if max_log_scale is not None and solver not in BOUNDED_SOLVERS:
        raise typer.BadParameter(f"solver '{solver}' is unconstrained; with --max-log-scale use one of "
                                 f"{', '.join(BOUNDED_SOLVERS)}", param_hint="--solver")
    if output == "-" and as_json:
        raise typer.BadParameter("-o - sends the checkpoint to stdout; use --report FILE for the JSON report", param_hint="--json")
    if model == "-" and output is None:
        raise typer.BadParameter("reading from stdin needs -o FILE or -o -", param_hint="-o")
    if (output == "-" or as_json) and _closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but -o - or --json writes to it", param_hint="-o" if output == "-" else "--json")
    if output == "-" and sys.stdout.isatty():
        raise typer.BadParameter("-o - writes the binary checkpoint to stdout, but stdout is a terminal; "
                                 "redirect it to a file or a pipe", param_hint="-o")
    if report_file is not None and output is not None and output != "-" and _same_path(report_file, Path(output)):
        raise typer.BadParameter("the report would overwrite the rescaled checkpoint; choose another file", param_hint="--report")
    shape = _parse_shape(input_shape)
    device = _parse_device(device)
    if report_file is not None:
        report_file = resolve_destination(report_file)
    with _errors_to_exit_codes(complete=as_json):
        _check_plot(plot)
        solve_options = {"solver": solver, "tol": tol, "max_iter": max_iter, "device": device, "criterion": criterion,
                         "max_log_scale": max_log_scale}
        report, result = _rescale_to(model, output, arch, shape, in_place, report_file, quiet, allow_unused,
                                     solve_options)
        _emit(report, as_json=as_json, report_file=report_file, quiet=quiet)
        _draw(plot, report, result.analysis, result)


def _rescale_to(model, output, arch, shape, in_place, report_file, quiet, allow_unused, solve_options):
    """Load, rescale (``solve_options`` are :func:`pathcond_cli.api.rescale`'s), write and verify;
    returns the JSON report and the result."""
    from .api import rescale as rescale_model, save
    from .formats import load_model, output_format_mismatch
    from .report import rescale_report

    global _stdout_started
    started = time.perf_counter()
    with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
        source, source_path, name = _read_source(model)
        if output not in (None, "-"):
            mismatch = output_format_mismatch(source, Path(output))
            if mismatch:
                raise typer.BadParameter(mismatch, param_hint="-o")
        inputs = _input_files(source_path, arch)
        if output == "-":
            destination = None
        elif output is not None:
            destination = Path(output)
        elif in_place and source_path is not None:
            destination = source_path
        elif source_path is None:
            raise typer.BadParameter("reading from stdin needs -o FILE or -o -", param_hint="-o")
        else:
            destination = _default_output(source_path)
        if destination is not None:
            destination = resolve_destination(destination)
            check_destination(destination, inputs=inputs, in_place=in_place)
        if report_file is not None:
            check_destination(report_file, inputs=inputs)
            if destination is not None and _same_path(report_file, destination):
                raise typer.BadParameter("the report would overwrite the rescaled checkpoint; choose another file",
                                         param_hint="--report")

        stages.stage("loading")
        load_start = time.perf_counter()
        loaded = load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)
        load_seconds = time.perf_counter() - load_start
        stages.stage("analysing: groups, diag(G), path count")
        result = rescale_model(loaded, progress=stages.solver, verify=False, **solve_options)
        seconds = {"load": load_seconds, **result.seconds}

        stages.stage("writing and verifying the written file")
        if destination is not None:
            save(result, destination, input_shape=shape, in_place=in_place, seconds=seconds)
            seconds["total"] = time.perf_counter() - started
            report = rescale_report(result, str(destination), seconds)
        else:
            with _scratch_directory() as scratch:
                target = scratch / f"out.{loaded.format}"
                save(result, target, input_shape=shape, seconds=seconds)
                seconds["total"] = time.perf_counter() - started
                report = rescale_report(result, "-", seconds)
                _stdout_started = True
                with open(target, "rb") as handle:
                    shutil.copyfileobj(handle, sys.stdout.buffer)
                sys.stdout.buffer.flush()
    return report, result


@app.command(cls=_Command, epilog=EXIT_HELP)
def inspect(
    model: ModelArg,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    allow_unused: AllowUnusedOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarise MODEL: parameters, hidden units, rescaling groups, path count, diag(G) spread.

    Writes nothing. Example: pathcond inspect model.onnx --json
    """
    shape = _parse_shape(input_shape)
    device = _parse_device(device)
    if as_json and _closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but --json writes the report to it", param_hint="--json")
    with _errors_to_exit_codes(complete=as_json):
        _check_plot(plot)
        from .api import analyse
        from .formats import load_model
        from .report import analysis_report

        started = time.perf_counter()
        with _Stages(enabled=stderr.is_terminal and not quiet) as stages:
            source, _, name = _read_source(model)
            stages.stage("loading")
            loaded = load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)
            load_seconds = time.perf_counter() - started
            stages.stage("analysing: groups, diag(G), path count")
            analysis = analyse(loaded, device=device)
            report = analysis_report(analysis)
        report["seconds"] = {"load": round(load_seconds, 6), **report["seconds"],
                             "total": round(time.perf_counter() - started, 6)}
        _emit(report, as_json=as_json, report_file=None, quiet=quiet)
        _draw(plot, report, analysis)


SPEC_SUFFIXES = (".yaml", ".yml", ".json")


@app.command("spec", cls=_Command, epilog=EXIT_HELP)
def spec_command(
    model: ModelArg,
    arch: ArchOpt = None,
    input_shape: ShapeOpt = None,
    output: Annotated[Optional[Path], typer.Option(
        "-o", "--output", metavar="FILE", help="Write the spec to FILE (.yaml, .yml or .json) instead of stdout.",
    )] = None,
    allow_unused: AllowUnusedOpt = False,
) -> None:
    """Print the architecture spec of MODEL, as a safetensors checkpoint of its tensors needs it.

    Its tensor keys are the names MODEL's tensors have (for an ONNX model, its initializers';
    torch.export keeps the module's state_dict names). Example: pathcond spec model.onnx -o model.yaml
    """
    if output is not None and output.suffix.lower() not in SPEC_SUFFIXES:
        raise typer.BadParameter(f"'{output}': a spec is written as {', '.join(SPEC_SUFFIXES)}, chosen by the suffix",
                                 param_hint="-o")
    shape = _parse_shape(input_shape)
    if output is None and _closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but the spec is printed there; use -o FILE", param_hint="-o")
    with _errors_to_exit_codes():
        from .formats import load_model
        from .formats.spec import spec_from_graph, spec_text

        source, source_path, name = _read_source(model)
        if output is not None:
            output = resolve_destination(output)
            check_destination(output, inputs=_input_files(source_path, arch))
        loaded = load_model(source, arch=arch, input_shape=shape, name=name, allow_unused=allow_unused)
        text = spec_text(spec_from_graph(loaded.graph), as_json=output is not None and output.suffix.lower() == ".json")
        if output is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        atomic_write(output, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        stderr.print(f"wrote the spec of {name} ({len(loaded.graph.nodes)} layers) to '{describe(output)}'",
                     highlight=False, markup=False, soft_wrap=True)


@app.command()
def version() -> None:
    """Print pathcond's version."""
    typer.echo(__version__)


def main() -> None:
    """The ``pathcond`` command. Ctrl-C at any moment exits 130 with one line saying what is on disk."""
    signal.signal(signal.SIGINT, _interrupted)
    try:
        app()
    finally:
        # The command is over and its report printed: an interrupt during the interpreter's
        # shutdown would kill it by signal, which would tell the caller a finished run failed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The shutdown's garbage collections would walk every object torch created at import
        # (0.3 s on every run); what is left is freed with the process anyway.
        gc.freeze()


def _interrupted(signum, frame) -> None:
    """Inside a command, Ctrl-C unwinds (staging directories are removed) and is reported by
    ``_errors_to_exit_codes``; outside one (start-up, option parsing) nothing is open, and click
    would report it as 'Aborted!' with exit 1, so it ends the process here."""
    if _guarded:
        raise KeyboardInterrupt
    os.write(2, f"interrupted: {_what_is_on_disk()}\n".encode("utf-8", "backslashreplace"))
    os._exit(EXIT_CODES["interrupted"])

