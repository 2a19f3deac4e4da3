"""Issue 20's guarantees under a cluster user's faults (review20): inputs that change while
they are read, the streaming writer against safetensors' own, many files in one process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from cli_support import CLEAN_ENV, mlp_tensors, write_mlp, write_sharded_mlp

# Runs the CLI with the input truncated by "another process" just before the output is written,
# after the solver has read every tensor once: the writer and the verification read them again.
_TRUNCATE_THEN_RUN = textwrap.dedent("""
    import os, sys
    import pathcond_cli.__main__
    import pathcond_cli.formats.safetensors_format as formats
    victim, *argv = sys.argv[1:]
    write = formats.write_tensors

    def truncating(*args, **kwargs):
        os.truncate(victim, 64)
        return write(*args, **kwargs)

    formats.write_tensors = truncating
    sys.argv = ["pathcond", *argv]
    from pathcond_cli.cli import main
    main()
""")


def _run_truncating(victim: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TRUNCATE_THEN_RUN, str(victim), *map(str, args)],
                          capture_output=True, text=True, env=CLEAN_ENV, timeout=300)


def test_an_input_truncated_while_read_is_an_input_error_not_a_bus_error(tmp_path):
    """A mapped file cut short under the reader kills it with SIGBUS (no message, a core dump
    where cores are on); read with pread it is exit 3 naming the file, and nothing is written."""
    big = {"fc1.weight": torch.randn(512, 6), "fc1.bias": torch.randn(512), "fc2.weight": torch.randn(5, 512),
           "fc2.bias": torch.randn(5), "fc3.weight": torch.randn(3, 5), "fc3.bias": torch.randn(3)}
    checkpoint, spec = write_mlp(tmp_path, "m", dims=(6, 512, 5, 3), tensors=big)
    out = tmp_path / "out.safetensors"
    result = _run_truncating(checkpoint, "rescale", checkpoint, "--arch", spec, "-o", out, "-q")
    assert result.returncode == 3, f"exit {result.returncode}\n{result.stderr}"
    assert "m.safetensors" in result.stderr and "truncated or replaced" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.arch.yaml", "m.safetensors"]


def test_a_shard_truncated_during_an_in_place_run_leaves_the_index_and_shards_as_they_were(tmp_path):
    index, spec = write_sharded_mlp(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p != shard}
    result = _run_truncating(shard, "rescale", index, "--arch", spec, "--in-place", "-q")
    assert result.returncode == 3, f"exit {result.returncode}\n{result.stderr}"
    assert "model-00002-of-00002.safetensors" in result.stderr and "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p != shard} == before
