"""A cluster user's faults: inputs that change while they are read, the streaming writer against
safetensors' own, staging directories of other processes and machines, a file given twice."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from collections import ChainMap
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from cli_support import CLEAN_ENV, assert_clean_exit, invoke, mlp_tensors, write_mlp, write_sharded_mlp

import pathcond_cli.io.fileio as fileio
import pathcond_cli.io.formats.safetensors_format as formats
from pathcond_cli.io.formats.safetensors_format import MappedTensors, write_tensors

# Runs the CLI with the input truncated by "another process" just before the output is written,
# after the solver has read every tensor once: the writer and the verification read them again.
_TRUNCATE_THEN_RUN = textwrap.dedent("""
    import os, sys
    import pathcond_cli.__main__
    import pathcond_cli.io.formats.safetensors_format as formats
    victim, *argv = sys.argv[1:]
    write = formats.write_tensors

    def truncating(*args, **kwargs):
        os.truncate(victim, 64)
        return write(*args, **kwargs)

    formats.write_tensors = truncating
    sys.argv = ["pathcond", *argv]
    from pathcond_cli.cli.app import main
    main()
""")


def _run_truncating(victim: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _TRUNCATE_THEN_RUN, str(victim), *map(str, args)],
        capture_output=True,
        text=True,
        env=CLEAN_ENV,
        timeout=300,
    )


def test_an_input_rewritten_at_the_same_size_while_read_is_an_input_error(tmp_path, monkeypatch):
    """A training job rewriting the checkpoint in place (same size, other values) between the
    solve and the write: the writer would rescale bytes the solver never saw, and the
    verification (reading the new bytes too) would pass. Exit 3, nothing written."""
    checkpoint, spec = write_mlp(tmp_path, "m")
    rewritten = tmp_path / "rewritten.safetensors"
    safetensors.torch.save_file(mlp_tensors(seed=1), str(rewritten))
    assert rewritten.stat().st_size == checkpoint.stat().st_size
    write = formats.write_tensors

    def rewriting(*args, **kwargs):
        with open(checkpoint, "r+b") as handle:
            handle.write(rewritten.read_bytes())
        stamp = checkpoint.stat().st_mtime_ns + 10**9
        os.utime(checkpoint, ns=(stamp, stamp))  # a coarse clock could leave the time as it was
        return write(*args, **kwargs)

    monkeypatch.setattr(formats, "write_tensors", rewriting)
    out = tmp_path / "out.safetensors"
    assert_clean_exit(
        invoke("rescale", checkpoint, "--arch", spec, "-o", out, "-q"),
        3,
        "m.safetensors",
        "written in place while pathcond read it",
    )
    assert not out.exists()


def test_an_input_truncated_while_read_is_an_input_error_not_a_bus_error(tmp_path):
    """A mapped file cut short under the reader kills it with SIGBUS (no message, a core dump
    where cores are on); read with pread it is exit 3 naming the file, and nothing is written."""
    big = {
        "fc1.weight": torch.randn(512, 6),
        "fc1.bias": torch.randn(512),
        "fc2.weight": torch.randn(5, 512),
        "fc2.bias": torch.randn(5),
        "fc3.weight": torch.randn(3, 5),
        "fc3.bias": torch.randn(3),
    }
    checkpoint, spec = write_mlp(tmp_path, "m", dims=(6, 512, 5, 3), tensors=big)
    out = tmp_path / "out.safetensors"
    result = _run_truncating(checkpoint, "rescale", checkpoint, "--arch", spec, "-o", out, "-q")
    assert result.returncode == 3, f"exit {result.returncode}\n{result.stderr}"
    assert "m.safetensors" in result.stderr and "truncated or written in place" in result.stderr
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


def _every_dtype() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(7, generator=generator, dtype=torch.float64)
    counts = torch.arange(3)
    tensors = {
        name: floats.to(dtype)
        for name, dtype in [
            ("f64", torch.float64),
            ("f32", torch.float32),
            ("f16", torch.float16),
            ("bf16", torch.bfloat16),
            ("f8", torch.float8_e4m3fn),
            ("f8b", torch.float8_e5m2),
        ]
    }
    tensors |= {
        name: counts.to(dtype)
        for name, dtype in [
            ("i64", torch.int64),
            ("i32", torch.int32),
            ("i16", torch.int16),
            ("i8", torch.int8),
            ("u8", torch.uint8),
            ("u16", torch.uint16),
            ("u32", torch.uint32),
            ("u64", torch.uint64),
        ]
    }
    tensors |= {
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "c64": torch.randn(2, generator=generator, dtype=torch.complex64),
    }
    return tensors


def test_the_streaming_writer_writes_what_save_file_writes(tmp_path):
    """Every dtype safetensors stores, an empty and a 0-d tensor, and metadata: the bytes of
    ``write_tensors`` are those of ``safetensors.torch.save_file`` (its layout order included),
    and both of safetensors' readers give the tensors back."""
    tensors = _every_dtype()
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file(tensors, str(reference), metadata={"format": "pt"})
    mine = tmp_path / "mine.safetensors"
    write_tensors(MappedTensors(reference), mine, originals=MappedTensors(reference), metadata={"format": "pt"})
    assert mine.read_bytes() == reference.read_bytes()
    loaded = safetensors.torch.load_file(str(mine))
    with safetensors.safe_open(str(mine), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        opened = {key: handle.get_tensor(key) for key in handle.keys()}
    for key, tensor in tensors.items():
        for read in (loaded[key], opened[key]):
            assert read.dtype == tensor.dtype and read.shape == tensor.shape
            assert torch.equal(read.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_the_streaming_writer_takes_views_of_shared_and_strided_storage(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    source = tmp_path / "in.safetensors"
    safetensors.torch.save_file({"a": torch.zeros(6, 4), "b": torch.zeros(4), "c": torch.zeros(6)}, str(source))
    originals = MappedTensors(source)
    out = tmp_path / "out.safetensors"
    write_tensors(
        ChainMap({"a": base.T, "b": base[:, 1], "c": base[1]}, originals), out, originals=originals, metadata={}
    )
    loaded = safetensors.torch.load_file(str(out))
    assert (
        torch.equal(loaded["a"], base.T) and torch.equal(loaded["b"], base[:, 1]) and torch.equal(loaded["c"], base[1])
    )


def test_a_file_given_twice_is_named_as_such_before_any_work(tmp_path):
    """Overlapping globs (``ckpt/*.safetensors ckpt/step-*``) name a file twice: the refusal says
    so, rather than advising to rename one of two files that are one."""
    checkpoint, spec = write_mlp(tmp_path, "m")
    out = tmp_path / "out"
    out.mkdir()
    twice = tmp_path / "." / "m.safetensors"
    for extra in ([], ["--in-place"]):
        stderr = assert_clean_exit(
            invoke("rescale", checkpoint, twice, "--arch", spec, *(extra or ["--output-dir", out])),
            6,
            "is given twice",
            "give each file once",
        )
        assert "rename one of them" not in stderr
    assert list(out.iterdir()) == []


def test_a_run_on_another_machine_leaves_this_runs_staging_alone(tmp_path, monkeypatch):
    """The Slurm array of docs/clusters.md: tasks on several nodes write into one shared
    folder, and each run clears the staging of processes that no longer run. A process id
    means nothing on another node: there, this run's pid is not alive, yet its staging must
    survive the other node's clean-up, or this run fails (its staging deleted mid-write)."""
    checkpoint, spec = write_mlp(tmp_path, "m")
    shared = tmp_path / "rescaled"
    shared.mkdir()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    write = formats.write_tensors

    def another_node_starts_a_run(*args, **kwargs):
        mine = os.getpid()
        with monkeypatch.context() as node_b:
            node_b.setattr(socket, "gethostname", lambda: "node-b")
            node_b.setattr(os, "getpid", lambda: mine + 1)
            node_b.setattr(fileio, "_process_alive", lambda pid: pid == mine + 1)
            fileio.remove_stale_staging(shared)
        return write(*args, **kwargs)

    monkeypatch.setattr(formats, "write_tensors", another_node_starts_a_run)
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "--output-dir", shared, "-q"), 0)
    assert sorted(p.name for p in shared.iterdir()) == ["m.pathcond.safetensors"]
    safetensors.torch.load_file(str(shared / "m.pathcond.safetensors"))


def test_staging_of_a_dead_process_on_this_machine_is_still_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with fileio.atomic_path(tmp_path / "out.json") as staged:
        ours = staged.name
    here = tmp_path / re.sub(r"\.pid\d+", f".pid{dead}", ours)
    elsewhere = tmp_path / re.sub(r"\.pid\d+h[0-9a-f]{8}", f".pid{dead}h{'f' * 8}", ours)
    assert here != elsewhere, ours
    for path in (here, elsewhere):
        path.write_bytes(b"half")
    fileio.remove_stale_staging(tmp_path)
    assert not here.exists() and elsewhere.exists()


def test_in_place_never_replaces_an_input_another_process_replaced_meanwhile(tmp_path, monkeypatch):
    """A training job saves a newer checkpoint over the one an in-place run is rescaling (write
    to a temporary file, rename: the run keeps reading the file it opened). Renaming the
    rescaled old weights onto the name would silently lose the newer checkpoint: exit 6, the
    newer file left as it is, no staging left."""
    checkpoint, spec = write_mlp(tmp_path, "m")
    newer = tmp_path / "newer.safetensors"
    safetensors.torch.save_file(mlp_tensors(seed=7), str(newer))
    saved = newer.read_bytes()
    write = formats.write_tensors

    def training_job_saves_meanwhile(*args, **kwargs):
        if newer.exists():
            os.replace(newer, checkpoint)
        return write(*args, **kwargs)

    monkeypatch.setattr(formats, "write_tensors", training_job_saves_meanwhile)
    assert_clean_exit(
        invoke("rescale", checkpoint, "--arch", spec, "--in-place", "-q"),
        6,
        "m.safetensors",
        "another process wrote or replaced it",
    )
    assert checkpoint.read_bytes() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.arch.yaml", "m.safetensors"]


def test_in_place_of_a_sharded_checkpoint_whose_shard_was_replaced_meanwhile_is_refused(tmp_path, monkeypatch):
    """The replaced shard is one the run would delete once the new index is in place."""
    index, spec = write_sharded_mlp(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    newer = {key: 2 * tensor for key, tensor in safetensors.torch.load_file(str(shard)).items()}
    write = formats.write_tensors
    replaced = []

    def replacing(*args, **kwargs):
        if not replaced:
            safetensors.torch.save_file(newer, str(tmp_path / "saving.tmp"), metadata={"format": "pt"})
            os.replace(tmp_path / "saving.tmp", shard)
            replaced.append({p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()})
        return write(*args, **kwargs)

    monkeypatch.setattr(formats, "write_tensors", replacing)
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 6, "another process")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == replaced[0]  # and no staging left
