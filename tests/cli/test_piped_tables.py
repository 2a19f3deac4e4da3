"""Tables printed off a terminal stay readable: the summary, ~170 columns as a
table, is stacked as one ``name  value`` line per row, values wrapped to COLUMNS (100 when unknown)."""

from __future__ import annotations

import re

from cli_support import assert_clean_exit, invoke, write_mlp


def _summary_lines(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("format"))
    end = next(i for i, line in enumerate(lines) if line.startswith("log10 diag(G) per layer"))
    return lines[start:end]


def test_the_summary_off_a_terminal_is_stacked_within_100_columns(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    checkpoint, spec = write_mlp(tmp_path)
    stderr = assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"), 0)
    lines = _summary_lines(stderr)
    names = [line.split("  ")[0] for line in lines if not line.startswith(" ")]
    for name in ("format", "verification", "output", "seconds", "solver"):
        assert name in names, stderr
    # a longer line is one unbreakable word (a path), kept whole, alone or after its row's name
    assert all(len(line) <= 100 or re.fullmatch(r"\s*\S+|\S+( \S+)*\s{2,}\S+", line) for line in lines), stderr
    assert not any(line.startswith(("┌", "│", "└")) for line in lines), stderr


def test_columns_sets_the_width_of_the_stacked_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    checkpoint, spec = write_mlp(tmp_path)
    stderr = assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec), 0)
    lines = _summary_lines(stderr)
    # a longer line is one unbreakable word (a path), kept whole
    assert all(len(line) <= 60 or " " not in line.strip() for line in lines), stderr
