"""``cli.guard.CommandGuard``: how a command ends, held by an object per process, not by module
flags: each failure its paragraph and exit code, an interrupt the truth about the disk, and with
``--json`` the report so far on stdout."""

from __future__ import annotations

import io
import json
import signal

import pytest
import typer
from rich.console import Console

from pathcond_cli.cli.guard import CommandGuard
from pathcond_cli.errors import EXIT_CODES, InputError


def guarded(work, *, as_json: bool = False, guard: CommandGuard | None = None):
    """(exit code, stderr) of ``work(guard)`` run as a command."""
    console = Console(file=io.StringIO(), width=200)
    guard = guard or CommandGuard(console)
    guard.console = console
    with pytest.raises(typer.Exit) as ended, guard.command(as_json):
        work(guard)
        raise typer.Exit(0)
    return ended.value.exit_code, console.file.getvalue()


def test_an_input_error_is_its_paragraph_and_exit_code():
    def work(guard):
        raise InputError("'m.onnx': not a model. Nothing was written.")

    code, stderr = guarded(work)
    assert code == EXIT_CODES["unreadable_input"]
    assert stderr.startswith("error: 'm.onnx': not a model. Nothing was written.")


def test_a_bug_is_an_internal_error_without_traceback(monkeypatch):
    monkeypatch.delenv("PATHCOND_DEBUG", raising=False)

    def work(guard):
        raise ZeroDivisionError("oops")

    code, stderr = guarded(work)
    assert code == 1 and stderr.startswith("internal error:") and "Traceback" not in stderr


def test_an_out_of_memory_error_is_a_property_of_the_input():
    def work(guard):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

    code, stderr = guarded(work)
    assert code == EXIT_CODES["unreadable_input"] and "out of memory" in stderr


def test_an_interrupt_says_what_is_on_disk():
    def work(guard):
        raise KeyboardInterrupt

    code, stderr = guarded(work)
    assert code == EXIT_CODES["interrupted"]
    assert stderr.startswith("interrupted: nothing was written; the input is unchanged.")


def test_a_library_error_after_sigterm_is_the_termination():
    def work(guard):
        guard.signal_received = signal.SIGTERM
        raise OSError("read interrupted")

    code, stderr = guarded(work)
    assert code == EXIT_CODES["terminated"] and stderr.startswith("terminated (SIGTERM):")


def test_a_checkpoint_half_sent_to_stdout_is_called_incomplete(monkeypatch):
    def work(guard):
        with guard.writing_stdout("the checkpoint", checkpoint=True):
            raise KeyboardInterrupt

    code, stderr = guarded(work)
    assert code == EXIT_CODES["interrupted"] and "sent to stdout is incomplete" in stderr


def test_the_signal_handler_unwinds_a_running_command():
    def work(guard):
        guard.on_signal(signal.SIGINT, None)

    code, _ = guarded(work)
    assert code == EXIT_CODES["interrupted"]


def test_with_json_a_failure_prints_the_report_so_far(capsys):
    def work(guard):
        guard.report_so_far = lambda: {"command": "inspect", "source": "m.onnx"}
        raise InputError("bad tensor. Nothing was written.")

    code, _ = guarded(work, as_json=True)
    document = json.loads(capsys.readouterr().out)
    assert code == EXIT_CODES["unreadable_input"]
    assert document["source"] == "m.onnx" and document["error"]["exit_code"] == code


def test_each_command_starts_clean_and_guards_do_not_share_state(capsys):
    first = CommandGuard(Console(file=io.StringIO()))

    def fails_after_reading(guard):
        guard.report_so_far = {"command": "rescale", "source": "a.onnx"}
        guard.signal_received = signal.SIGTERM
        raise KeyboardInterrupt

    assert guarded(fails_after_reading, guard=first)[0] == EXIT_CODES["terminated"]
    second = CommandGuard(Console(file=io.StringIO()))
    assert second.report_so_far is None and second.signal_received is None

    def fails_before_reading(guard):
        raise InputError("unreadable. Nothing was written.")

    code, _ = guarded(fails_before_reading, as_json=True, guard=first)
    assert code == EXIT_CODES["unreadable_input"] and capsys.readouterr().out == ""
    assert not first.running
