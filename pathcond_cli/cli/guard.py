"""How a command ends: one paragraph on stderr and a distinct exit code for every failure, the
truth about what is on disk after Ctrl-C or SIGTERM, and with ``--json`` one document on stdout
whatever happened. Never a traceback.

A :class:`CommandGuard` holds what a running command has done that its ending must tell (bytes
sent to stdout, the signal received, the report so far); the files renamed into place are
:data:`~pathcond_cli.io.fileio.written_files`. The library's modules are imported inside the
methods, as in :mod:`.app`, so that ``--help`` answers without loading torch.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import rich.markup
import typer
from rich.console import Console

from ..errors import EXIT_CODES, OutputError, PathcondError
from ..io.fileio import NOTHING_WRITTEN, describe, interrupts_deferred, printable, written_files
from ..version import __version__

DEBUG_VARIABLE = "PATHCOND_DEBUG"
# A message quotes at most this many characters of a line (a name read from a file may be a megabyte long):
# a longer line loses its middle, never its end, where a message says what to do.
MESSAGE_LINE_CHARS = 1000
# What every command's work needs, torch first: imported before the command runs, Ctrl-C held back.
LIBRARY_MODULES = ("torch", "pathcond_cli.pipeline", "pathcond_cli.io.formats", "pathcond_cli.report.render")

ReportSoFar = dict[str, Any] | Callable[[], dict[str, Any]] | None


class CommandGuard:
    """Failure and signal handling for the commands of one process, one command at a time.

    ``report_so_far`` is the running command's report once its input is read: with --json a
    failure prints it with an ``error`` object, so that a pipeline always gets one document. A
    report that costs passes over the network is given as the function that builds it, called
    only when a failure prints it. ``stdout_started``: bytes of the checkpoint went to stdout
    (``-o -``), so an interrupt leaves it incomplete. ``signal_received``: the interrupting
    signal, once :meth:`on_signal` has run.
    """

    def __init__(self, console: Console):
        self.console = console
        self.running = False
        self.stdout_started = False
        self.signal_received: int | None = None
        self.report_so_far: ReportSoFar = None

    @contextlib.contextmanager
    def command(self, as_json: bool = False) -> Iterator[None]:
        """Run a command's work: a failure becomes its paragraph and exit code (``as_json``: also
        the report so far with its ``error`` on stdout, and a refused network's paragraph lists
        every problem, consequences included)."""
        with interrupts_deferred():
            for name in LIBRARY_MODULES:
                importlib.import_module(name)
        self.running, self.stdout_started, self.report_so_far, self.signal_received = True, False, None, None
        written_files.clear()
        try:
            try:
                yield
            except (typer.Exit, typer.Abort, typer.TyperException):
                raise  # deliberate exits (typer.Exit is a RuntimeError): never taken for a library's error
            except Exception as exc:
                self.raise_if_interrupted(exc)
                raise
        except KeyboardInterrupt as exc:
            label, code = self.interruption()
            self.say(label, self.what_is_on_disk())
            self.error_document(as_json, exc, code, self.what_is_on_disk())
            raise typer.Exit(code) from None
        except BrokenPipeError:
            # The reader of stdout went away (``pathcond ... -o - | head``): say so once, quietly.
            silence_stdout()
            self.console.print("[bold red]error:[/] stdout was closed before the output was complete.")
            raise typer.Exit(EXIT_CODES["output_not_written"]) from None
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # usage errors and deliberate exits: typer reports them itself
        except Exception as exc:
            code, label, message = self.failure(exc, complete=as_json)
            self.say(label, message)
            self.error_document(as_json, exc, code, message)
            raise typer.Exit(code) from None
        finally:
            self.running = False

    def say(self, label: str, message: str, *, tag: str = "", exit_code: int | None = None) -> None:
        """``label: message`` on stderr, the label in red; in a run over several files, after the
        file's ``tag`` and followed by its ``exit_code``."""
        head = f"{tag} " if tag else ""
        tail = f" (exit {exit_code})" if exit_code is not None else ""
        self.console.print(
            f"{head}[bold red]{label}[/]{tail}: {printable_message(message)}",
            highlight=False,
            markup=True,
            soft_wrap=True,
        )

    def failure(self, exc: Exception, *, complete: bool = False) -> tuple[int, str, str]:
        """The exit code, the label (``error`` or ``internal error``) and the paragraph for a failure;
        ``complete`` (``--json``) lists every problem, those a long list counts and the consequences
        of a refused network included.
        A bug in pathcond, not a problem with the input, is re-raised when PATHCOND_DEBUG is set."""
        from ..io.formats import exception_line
        from ..io.formats.common import address_space_left

        if isinstance(exc, PathcondError):
            return exc.exit_code, "error", true_to_disk(exc.complete if complete else str(exc))
        if out_of_memory(exc):
            # The network's passes need more than the machine has: a property of the input (exit 3).
            # Under ulimit -v the limit, not the machine, is what ran out.
            room = (
                "raise this process's address-space limit (ulimit -v)"
                if address_space_left() is not None
                else "run on a machine with more memory"
            )
            return (
                EXIT_CODES["unreadable_input"],
                "error",
                true_to_disk(
                    f"out of memory: the passes over this network need more memory than is available "
                    f"({exception_line(exc)}); {room}, or, for a network that takes inputs of any size, pass a "
                    f"smaller --input-shape. {NOTHING_WRITTEN}"
                ),
            )
        if isinstance(exc, typer.TyperException):  # a usage error met while processing one of several files
            return exc.exit_code, "error", exc.format_message()
        if os.environ.get(DEBUG_VARIABLE):
            raise exc
        return (
            1,
            "internal error",
            (
                f"{exception_line(exc)}\nThis is a bug in pathcond {__version__}; please report it with the "
                f"command line. Set {DEBUG_VARIABLE}=1 to see the traceback."
            ),
        )

    def error_document(self, as_json: bool, exc: BaseException, exit_code: int, message: str) -> None:
        """With --json, the report so far and its ``error`` on stdout (once the input was read)."""
        report = self.built_report_so_far() if as_json else None
        if report is None:
            return
        from ..report.render import error_document

        with contextlib.suppress(OSError, ValueError):
            document = error_document(report, exc, exit_code, shown_message(message))
            sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
            sys.stdout.flush()

    def built_report_so_far(self) -> dict[str, Any] | None:
        if not callable(self.report_so_far):
            return self.report_so_far
        try:
            return self.report_so_far()
        except Exception:  # noqa: BLE001 - the failure being reported matters more than its report
            return None

    def interruption(self) -> tuple[str, int]:
        """How the interrupt that stopped the command is named, and its exit status (128 + signal)."""
        if self.signal_received == signal.SIGTERM:
            return "terminated (SIGTERM)", EXIT_CODES["terminated"]
        return "interrupted", EXIT_CODES["interrupted"]

    def raise_if_interrupted(self, exc: Exception) -> None:
        """A signal that landed inside a C extension can come back as that library's own error (a
        failed read, a runtime error): once a signal was received, the failure is the interrupt."""
        if self.signal_received is not None:
            raise KeyboardInterrupt from exc

    def what_is_on_disk(self) -> str:
        """The truth about the files after an interrupt: which outputs were completely written."""
        if written_files:
            return (
                "the output was completely written and verified before the interrupt: "
                + ", ".join(f"'{describe(path)}'" for path in written_files)
                + "."
            )
        if self.stdout_started:
            return "the checkpoint sent to stdout is incomplete; no file was written."
        return "nothing was written; the input is unchanged."

    def on_signal(self, signum: int, frame: object) -> None:
        """The handler of Ctrl-C and SIGTERM. Inside a command it unwinds (staging directories are
        removed) and :meth:`command` reports it; outside one (start-up, option parsing) nothing is
        open, and click would report it as 'Aborted!' with exit 1, so it ends the process here."""
        self.signal_received = signum
        if self.running:
            raise KeyboardInterrupt
        label, code = self.interruption()
        os.write(2, f"{label}: {self.what_is_on_disk()}\n".encode("utf-8", "backslashreplace"))
        os._exit(code)

    @contextlib.contextmanager
    def writing_stdout(self, what: str, *, checkpoint: bool = False) -> Iterator[None]:
        """A write to stdout that fails (its reader went away, a full disk) as an exit-6 error;
        ``checkpoint``: its bytes are the checkpoint's, which an interrupt leaves incomplete."""
        self.stdout_started = self.stdout_started or checkpoint
        try:
            yield
        except OSError as exc:
            silence_stdout()
            cause = "it was closed" if isinstance(exc, BrokenPipeError) else exc.strerror or str(exc)
            raise OutputError(
                f"cannot write {what} to stdout: {cause}; what reached stdout is incomplete. {NOTHING_WRITTEN}"
            ) from None


def stream_closed(stream) -> bool:
    """Whether a standard stream is missing (Python sets it to None when started with ``<&-``) or closed."""
    return stream is None or bool(getattr(stream, "closed", False))


def silence_stdout() -> None:
    """Point stdout at /dev/null after it failed: Python flushes it again at exit, which would fail
    again, with a traceback."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or torch's RuntimeError (CPU or CUDA)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def printable_message(text: str) -> str:
    """``text`` as :func:`shown_message`, escaped for rich markup."""
    return rich.markup.escape(shown_message(text))


def shown_message(text: str) -> str:
    """``text`` with undecodable file-name bytes and control characters shown as escapes, and no
    line longer than :data:`MESSAGE_LINE_CHARS`: the paragraph on stderr, and the ``message`` of a
    JSON error document. A longer line keeps its beginning and its end."""
    return "\n".join(map(_within_line_limit, printable(text, keep="\n").split("\n")))


def _within_line_limit(line: str) -> str:
    if len(line) <= MESSAGE_LINE_CHARS:
        return line
    kept = MESSAGE_LINE_CHARS // 2
    return f"{line[:kept]} ... ({len(line) - 2 * kept} characters left out) ... {line[-kept:]}"


def true_to_disk(message: str) -> str:
    """``message``, whose closing 'Nothing was written.' is not the truth once an earlier output
    of this run (the checkpoint, or with --in-place the input) was renamed into place."""
    if not written_files:
        return message
    return (
        message.removesuffix(NOTHING_WRITTEN).rstrip()
        + " Written in full before this error: "
        + ", ".join(f"'{describe(path)}'" for path in written_files)
        + "."
    )
