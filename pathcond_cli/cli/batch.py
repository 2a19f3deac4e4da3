"""Several MODELs in one process: their usage errors and outputs checked before any work, then
each file in turn, a failed file reported with its exit code and the next one processed.

The library's modules are imported inside the functions, as in :mod:`.app`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from ..errors import PathcondError, batch_exit_code
from ..io.fileio import (
    PlannedOutput,
    check_batch_destinations,
    check_output_directory,
    describe,
    interrupts_deferred,
    interrupts_held_once_written,
    resolve_destination,
    written_files,
)
from .guard import CommandGuard, shown_message, stream_closed


def check_batch_options(
    models: list[str],
    *,
    as_json: bool,
    output: str | None = None,
    report_file: str | None = None,
    plot: str | None = None,
) -> None:
    """The usage errors of a run over several MODELs (or with --output-dir), before any work."""
    if "-" in models:
        raise typer.BadParameter(
            "'-' reads one model from stdin; it cannot be one of several MODELs or go to --output-dir",
            param_hint="MODEL",
        )
    if output is not None:
        raise typer.BadParameter(
            "-o names the output of one MODEL; with several (or --output-dir), use --output-dir DIR", param_hint="-o"
        )
    if report_file is not None:
        raise typer.BadParameter(
            "--report FILE holds one report; with several MODELs, --json prints one per line: --json > FILE",
            param_hint="--report",
        )
    if plot is not None:
        raise typer.BadParameter(
            "--plot draws one model; with several MODELs, plot them one at a time", param_hint="--plot"
        )
    if as_json and stream_closed(sys.stdout):
        raise typer.BadParameter("stdout is closed, but --json writes the reports to it", param_hint="--json")


def batch_plan(models: list[str], output_dir: Path | None, arch: str | None, in_place: bool) -> list[PlannedOutput]:
    """Where each of several MODELs is written: ``<stem>.pathcond<suffix>`` in ``output_dir``,
    beside the input without it, the input itself with ``in_place``. Refuses, before any work, a
    missing ``output_dir`` and outputs that collide with each other or with an input."""
    from ..io.destinations import default_output
    from ..io.formats import files_read

    if output_dir is not None:
        check_output_directory(output_dir)
    planned = []
    for model in models:
        source = Path(model)
        try:
            inputs = files_read(source, arch)
        except (PathcondError, OSError):
            inputs = [source]  # unreadable: reported, with its exit code, when its turn comes
        if in_place:
            destination = source
        elif output_dir is not None:
            destination = output_dir / default_output(source).name
        else:
            destination = default_output(source)
        planned.append(PlannedOutput(source, inputs, resolve_destination(destination)))
    check_batch_destinations(planned, in_place=in_place)
    return planned


def run_batch(
    guard: CommandGuard,
    command: str,
    models: list[str],
    process: Callable[[int], dict[str, Any] | None],
    *,
    as_json: bool,
    quiet: bool,
) -> None:
    """Process each MODEL in turn (``process(i)`` returns the report of ``models[i]``, None when
    neither --json nor stderr's lines read it, under -q): with --json
    one JSON line per file, in order; on stderr a line per file; a failure is reported with its
    exit code and the next file processed; the exit status is :func:`batch_exit_code`'s."""
    from ..report.render import error_document, failure_report, render_warnings, summary_line

    console = guard.console
    total, failures, position, reported = len(models), [], 0, 0
    try:
        for position, model in enumerate(models, start=1):
            tag = f"[{position}/{total}]"
            guard.report_so_far = None
            # Once this file's output is in place, an interrupt waits for its lines (stderr, JSON).
            with interrupts_held_once_written():
                try:
                    report = process(position - 1)
                except BrokenPipeError:
                    raise
                except Exception as exc:
                    guard.raise_if_interrupted(exc)
                    code, label, message = guard.failure(exc, complete=as_json)
                    failures.append(code)
                    guard.say(label, message, tag=tag, exit_code=code)
                    so_far = guard.built_report_so_far() or failure_report(command, describe(Path(model)))
                    report = error_document(so_far, exc, code, shown_message(message))
                else:
                    if not quiet:
                        render_warnings(report, console)
                        console.print(f"{tag} {summary_line(report)}", highlight=False, markup=False, soft_wrap=True)
                if as_json:
                    # Whole or absent, and in one write: lines of parallel runs sharing a file never interleave.
                    with interrupts_deferred():
                        sys.stdout.flush()
                        sys.stdout.buffer.write((json.dumps(report, allow_nan=False) + "\n").encode())
                        sys.stdout.buffer.flush()
                reported = len(written_files)
        if not quiet:
            console.print(_batch_summary(command, total, failures), highlight=False, markup=False, soft_wrap=True)
    except KeyboardInterrupt:
        label, code = guard.interruption()
        guard.say(label, _batch_on_disk(command, position, total, reported))
        raise typer.Exit(code) from None
    code = batch_exit_code(failures)
    if code:
        raise typer.Exit(code)


def _batch_summary(command: str, total: int, failures: list[int]) -> str:
    """The last line of a run over several files: how many succeeded, how many failed with which code."""
    done = "written and verified" if command == "rescale" else "inspected"
    text = f"pathcond {command}: {total - len(failures)} of {total} {done}"
    if failures:
        counts = sorted(Counter(failures).items())
        text += (
            "; failed: "
            + ", ".join(f"{count} with exit {code}" for code, count in counts)
            + f"; exit status {batch_exit_code(failures)}"
        )
    return text + "."


def _batch_on_disk(command: str, position: int, total: int, reported: int) -> str:
    """The truth about the files after an interrupt in a run over several files."""
    if command == "inspect":
        return f"{max(position - 1, 0)} of {total} models were inspected before the interrupt; nothing was written."
    if not written_files:
        return "nothing was written; the inputs are unchanged."
    text = (
        f"{len(written_files)} of {total} outputs were completely written and verified before the interrupt "
        f"(the last: '{describe(written_files[-1])}'); nothing else was written."
    )
    if len(written_files) > reported:
        text += " The interrupt came before the last one's report was printed."
    return text
