"""Every example in README.md and docs/ runs, and prints what the page says it prints.

Conventions of the pages: a `console` block is a session, `$ COMMAND` lines run in order (a
trailing `# exit N` expects that status), each followed by lines of its output; a `python`
block is run as a script, and a `text` block right after it is its output; `sh`/`bash` blocks
need a cluster (Slurm, GPUs) and are checked for shell syntax only (the cluster recipes run in
tests/cli/test_many.py); `yaml` blocks are specs. Output is compared line by line, in order, with
every number replaced (timings and last digits move) and `...` standing for any lines.

A `$ pathcond ...` or `$ python3 -c "..."` line that needs no shell (no pipe, redirection,
expansion) runs in this process, as the command-line tests run the CLI, with the workspace as
the current directory: each `import torch` of a subprocess costs seconds. The other lines run
in bash, with this checkout's `pathcond` and `python3` first on PATH. The python blocks run in
this process too, each as a script: with fresh globals, its stdout and stderr captured, torch's
thread count and random state put back after it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from cli_support import CLEAN_ENV
from docs_support import FENCE, PAGES, ROOT, Block, all_blocks
from typer.testing import CliRunner

from pathcond_cli.cli.app import app
from pathcond_cli.io.formats.spec import graph_from_spec, parse_spec_text

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?")
_EXPECTED_EXIT = re.compile(r"\s+# exit (\d+)$")
LANGUAGES = {"console", "python", "text", "sh", "bash", "yaml"}


def _shape(line: str) -> str:
    return " ".join(_NUMBER.sub("#", line).split())


def assert_prints(expected: str, actual: str, where: str) -> None:
    """The lines of ``expected`` appear in ``actual`` in order, numbers aside; ``...`` skips any."""
    remaining = [_shape(line) for line in actual.splitlines()]
    position = 0
    for line in expected.splitlines():
        if line.strip() in ("", "..."):
            continue
        wanted = _shape(line)
        try:
            position = remaining.index(wanted, position) + 1
        except ValueError:
            raise AssertionError(
                f"{where}: the page shows\n  {line}\nbut the output has no such line after the previous one:\n{actual}"
            ) from None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding the sample models, with `pathcond` and `python3` on PATH as this checkout's."""
    folder = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "sample_models", folder / "sample_models")
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    # wrappers, not links: a link to a virtual environment's python finds no pyvenv.cfg beside it
    # and starts the base interpreter, without the environment's packages
    for name, arguments in (("pathcond", "-m pathcond_cli "), ("python3", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {arguments}"$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**CLEAN_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    return folder, env


def _run(command: str, folder: Path, env: dict) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one `$ ` line, run in this process where it needs no shell."""
    argv = _without_shell(command)
    if argv is None:
        done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout, done.stderr
    with contextlib.chdir(folder):
        if argv[0] == "pathcond":
            # the variables CLEAN_ENV leaves out unset, and the width the subprocesses get
            unset = {name: None for name in os.environ if name not in CLEAN_ENV}
            result = CliRunner(env={**unset, "COLUMNS": env["COLUMNS"]}).invoke(app, argv[1:])
            escaped = result.exception if not isinstance(result.exception, SystemExit) else None
            assert escaped is None, "".join(traceback.format_exception(escaped))
            return result.exit_code, result.stdout, result.stderr
        return _exec_script(argv[2])


# Outside quotes, what only a shell understands; inside double quotes, what it expands.
_SHELL_SYNTAX = re.compile(r"[|&;<>()$`*?~\[\]{}\\!#]")
_QUOTED = re.compile(r"'[^']*'|\"[^\"$`\\]*\"")


def _without_shell(command: str) -> list[str] | None:
    """The argv of a `pathcond ...` or `python3 -c CODE` line that a shell would only split, else None."""
    if _SHELL_SYNTAX.search(_QUOTED.sub("''", command)):
        return None
    argv = shlex.split(command)
    if argv[0] == "pathcond" or (len(argv) == 3 and argv[:2] == ["python3", "-c"]):
        return argv
    return None


def _exec_script(code: str) -> tuple[int, str, str]:
    """``code`` run as a script (``python3 -c``) runs, in this process, with fresh globals:
    (exit status, stdout, stderr). What a script may change for the whole process (torch's
    thread count, its random generator) is put back."""
    stdout, stderr = io.StringIO(), io.StringIO()
    status = 0
    threads, generator = torch.get_num_threads(), torch.random.get_rng_state()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(generator)
    return status, stdout.getvalue(), stderr.getvalue()


def _sessions(block: Block) -> list[tuple[str, int, str]]:
    """The (command, expected exit status, shown output) steps of a console block."""
    steps: list[tuple[str, int, str]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            command = line[2:]
            expected = _EXPECTED_EXIT.search(command)
            steps.append((_EXPECTED_EXIT.sub("", command), int(expected.group(1)) if expected else 0, ""))
        else:
            assert steps, f"{block}: output before the first `$ ` command"
            command, status, shown = steps[-1]
            steps[-1] = (command, status, shown + line + "\n")
    return steps


_RUNNABLE = [block for block in all_blocks() if block.language in ("console", "python")]


def test_every_block_is_fenced_with_a_known_language():
    for block in all_blocks():
        assert block.language in LANGUAGES, (
            f"{block}: fence language {block.language!r}, not one of {sorted(LANGUAGES)}"
        )
    for page in PAGES:
        prose = FENCE.sub(lambda fence: "\n" * fence.group(0).count("\n"), page.read_text(encoding="utf-8"))
        for number, line in enumerate(prose.splitlines(), start=1):
            assert not re.match(r" {4,}(\$ |pathcond |python3? )", line), (
                f"{page.relative_to(ROOT)}:{number}: an example in an indented block, which no test runs"
            )


@pytest.mark.parametrize("block", _RUNNABLE, ids=str)
def test_example_runs_and_prints_what_the_page_shows(block, workspace):
    folder, env = workspace
    if block.language == "python":
        with contextlib.chdir(folder):
            status, stdout, stderr = _exec_script(block.text)
        assert status == 0, f"{block}:\n{stderr}"
        if block.followed_by is not None and block.followed_by.language == "text":
            assert_prints(block.followed_by.text, stdout, str(block))
        return
    for command, expected, shown in _sessions(block):
        status, stdout, stderr = _run(command, folder, env)
        assert status == expected, f"{block}: `{command}` exited {status}:\n{stderr}"
        assert_prints(shown, stdout + stderr, f"{block}: `{command}`")


@pytest.mark.parametrize("block", [block for block in all_blocks() if block.language in ("sh", "bash")], ids=str)
def test_cluster_recipe_is_valid_shell(block):
    result = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert result.returncode == 0, f"{block}: {result.stderr}"


@pytest.mark.parametrize("block", [block for block in all_blocks() if block.language == "yaml"], ids=str)
def test_spec_example_is_a_valid_spec(block):
    graph_from_spec(parse_spec_text(block.text, source=str(block)), source=str(block))


def test_only_lines_a_shell_would_merely_split_run_in_this_process():
    assert _without_shell("pathcond rescale a.safetensors -o 'b c.safetensors'") == [
        "pathcond",
        "rescale",
        "a.safetensors",
        "-o",
        "b c.safetensors",
    ]
    assert _without_shell('python3 -c "print(1); print({2: 3})"') == ["python3", "-c", "print(1); print({2: 3})"]
    for command in (
        "cat a | pathcond rescale - -o -",
        "pathcond rescale a -o - > b",
        "pathcond rescale $MODEL",
        'pathcond rescale "$MODEL"',
        "pathcond inspect *.onnx",
        "pathcond inspect a; rm a",
        "ls",
        "python3 script.py",
    ):
        assert _without_shell(command) is None, command


def test_the_comparison_ignores_numbers_only():
    assert_prints("a 1.5 · b\n...\nc 2e-05", "x\na 9.25 · b\ny\nc 3e+07\n", "self")
    with pytest.raises(AssertionError, match="no such line"):
        assert_prints("a 1 · b\nc", "c\na 1 · b\n", "self")
