"""``inspect --report FILE``: like rescale's, the JSON report written to FILE, atomically,
refused with several MODELs (exit 2) or onto a file the run reads (exit 6); a failed inspect leaves no file."""

from __future__ import annotations

import json

from cli_support import assert_clean_exit, assert_unchanged, invoke, parse_single_json, snapshot, write_mlp


def _without_seconds(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "seconds"}


def test_inspect_writes_its_report_to_a_file(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    target = tmp_path / "report.json"
    result = invoke("inspect", checkpoint, "--arch", spec, "--report", target, "--json")
    assert_clean_exit(result, 0)
    assert _without_seconds(json.loads(target.read_text())) == _without_seconds(parse_single_json(result.stdout))


def test_inspect_report_refusals(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    before = snapshot(tmp_path)
    assert_clean_exit(
        invoke("inspect", checkpoint, checkpoint, "--arch", spec, "--report", tmp_path / "r.json"), 2, "--report"
    )
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--report", spec), 6, "--report")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    before = snapshot(tmp_path)
    assert_clean_exit(invoke("inspect", broken, "--arch", spec, "--report", tmp_path / "r.json"), 3)
    assert_unchanged(tmp_path, before)
