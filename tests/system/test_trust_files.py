"""Trust, files on disk: a model is never read from outside its folder, never lost,
never overwritten without --in-place, and every message tells the truth about what is on disk.

Each failure is checked for its exit code, its message, that nothing was written and that
every input file is byte-identical.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import safetensors
import safetensors.torch
import torch
import yaml
from cli_support import (
    CLEAN_ENV,
    assert_clean_exit,
    assert_unchanged,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    module_command,
    onnx_mlp_model,
    parse_single_json,
    snapshot,
    write_mlp,
    write_onnx_mlp,
)

import pathcond_cli
import pathcond_cli.cli.app
import pathcond_cli.io.formats
import pathcond_cli.io.formats.safetensors_format as safetensors_format
import pathcond_cli.rescaling
from pathcond_cli.io.fileio import interrupts_deferred
from pathcond_cli.verify import compare

ROOT = Path(__file__).resolve().parents[2]


def _fails_cleanly(directory: Path, code: int, args, *needles: str, input: bytes | None = None) -> str:
    before = snapshot(directory)
    result = invoke(*args, input=input)
    stderr = assert_clean_exit(result, code, *needles)
    assert_unchanged(directory, before)
    return stderr


def _sharded(directory: Path, name: str = "model") -> tuple[Path, Path]:
    tensors = mlp_tensors()
    layout = {
        f"{name}-00001-of-00002.safetensors": ["fc1.weight", "fc1.bias", "fc2.weight"],
        f"{name}-00002-of-00002.safetensors": ["fc2.bias", "fc3.weight", "fc3.bias"],
    }
    for file, keys in layout.items():
        safetensors.torch.save_file({k: tensors[k] for k in keys}, str(directory / file))
    index = directory / f"{name}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in layout.items() for k in keys}}))
    spec = directory / f"{name}.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    return index, spec


def _params(path: Path, **options) -> dict[str, torch.Tensor]:
    return pathcond_cli.load(path, allow_unused=True, **options).params


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- 1. every shard and external data file lies inside the model's folder ----------------------


@pytest.mark.parametrize("entry", ["../outside/x.safetensors", "ABSOLUTE", "sub/../../outside/x.safetensors", "LINK"])
def test_shard_outside_the_index_folder_is_refused_and_not_read(tmp_path, monkeypatch, entry):
    model_dir, outside = tmp_path / "model", tmp_path / "outside"
    model_dir.mkdir()
    outside.mkdir()
    tensors = mlp_tensors()
    safetensors.torch.save_file(
        {k: tensors[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight")}, str(model_dir / "a.safetensors")
    )
    safetensors.torch.save_file(
        {k: tensors[k] for k in ("fc2.bias", "fc3.weight", "fc3.bias")}, str(outside / "x.safetensors")
    )
    if entry == "ABSOLUTE":
        entry = str(outside / "x.safetensors")
    elif entry == "LINK":
        (model_dir / "link.safetensors").symlink_to(outside / "x.safetensors")
        entry = "link.safetensors"
    index = model_dir / "evil.safetensors.index.json"
    index.write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {
                    "fc1.weight": "a.safetensors",
                    "fc1.bias": "a.safetensors",
                    "fc2.weight": "a.safetensors",
                    "fc2.bias": entry,
                    "fc3.weight": entry,
                    "fc3.bias": entry,
                },
            }
        )
    )
    spec = tmp_path / "arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec()))
    opened = []
    real_read = safetensors_format._read_file
    monkeypatch.setattr(
        safetensors_format, "_read_file", lambda path, display: opened.append(path) or real_read(path, display)
    )
    _fails_cleanly(
        tmp_path,
        3,
        ["rescale", index, "--arch", spec, "-o", model_dir / "out.safetensors.index.json"],
        entry[:40],
        "outside the model's folder" if "LINK" not in entry and "link" not in entry else "leaves",
    )
    assert opened == []


def test_shard_naming_a_system_file_never_prints_its_bytes(tmp_path):
    index = tmp_path / "passwd.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"fc1.weight": "/etc/passwd"}}))
    stderr = _fails_cleanly(tmp_path, 3, ["inspect", index, "--arch", tmp_path / "absent.yaml"], "/etc/passwd")
    assert "header length" not in stderr and "root:" not in stderr


def _onnx_with_external_data(directory: Path, name: str = "net", location: str | None = None) -> Path:
    """An MLP whose first weight (8 KiB) is over the 1 KiB threshold, all tensors external."""
    path = directory / f"{name}.onnx"
    onnx.save_model(
        onnx_mlp_model((64, 32, 5, 3)),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location or f"{name}.onnx.data",
        size_threshold=0,
    )
    return path


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "LINK"])
def test_onnx_external_data_outside_the_folder_exit_3(tmp_path, location):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    path = _onnx_with_external_data(model_dir)
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 4096)
    if location == "LINK":
        (model_dir / "link.bin").symlink_to(tmp_path / "secret.bin")
        location = "link.bin"
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(path))
    _fails_cleanly(tmp_path, 3, ["rescale", path, "-o", model_dir / "out.onnx"], location, "Nothing was read")


def test_onnx_external_data_is_written_as_external_data_and_verified(tmp_path):
    path = _onnx_with_external_data(tmp_path)
    inputs = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path / "out.onnx"
    result = invoke("rescale", path, "-o", out, "--json")
    assert_clean_exit(result, 0)
    report = parse_single_json(result.stdout)
    assert report["verification"]["independent"]["status"] == "passed"
    assert (tmp_path / "out.onnx.data").is_file()
    written = onnx.load(str(out), load_external_data=False)
    external = {t.name for t in written.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external == {"fc1.weight"}  # the only float tensor of 1 KiB or more
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in inputs} == inputs
    before, after = pathcond_cli.load(path), pathcond_cli.load(out)
    assert compare(before.graph, before.params, after.params).passed


def test_onnx_external_data_in_place_leaves_no_stale_data_file(tmp_path):
    path = _onnx_with_external_data(tmp_path)
    original = pathcond_cli.load(path)
    for _ in range(3):
        assert_clean_exit(invoke("rescale", path, "--in-place", "-q"), 0)
        files = sorted(p.name for p in tmp_path.iterdir())
        assert len(files) == 2 and "net.onnx" in files, files
        written = onnx.load(str(path), load_external_data=False)
        locations = {e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {next(f for f in files if f != "net.onnx")}
    again = pathcond_cli.load(path)
    assert compare(original.graph, original.params, again.params).passed


# -- 3. no file of the input is written without --in-place --------------------------------------


def test_output_index_whose_shard_names_are_the_inputs_never_touches_them(tmp_path):
    index, spec = _sharded(tmp_path)
    shards = {p.name: p.read_bytes() for p in tmp_path.glob("model-*.safetensors")}
    out = tmp_path / "model.index.json"  # stem 'model': shards would be model-0000N-of-00002
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "-o", out, "-q"), 0)
    assert {name: (tmp_path / name).read_bytes() for name in shards} == shards
    written = json.loads(out.read_text())["weight_map"]
    assert not set(written.values()) & set(shards)
    before, after = pathcond_cli.load(index, arch=str(spec)), pathcond_cli.load(out)
    assert compare(before.graph, before.params, after.params).passed


def test_no_input_file_is_an_output_without_in_place(tmp_path):
    index, spec = _sharded(tmp_path)
    # The spec, a shard (a format mismatch for a sharded input), a hard link to the index.
    _fails_cleanly(tmp_path, 6, ["rescale", index, "--arch", spec, "-o", spec], "--in-place", spec.name)
    _fails_cleanly(tmp_path, 2, ["rescale", index, "--arch", spec, "-o", tmp_path / "model-00001-of-00002.safetensors"])
    link = tmp_path / "hard.json"
    os.link(index, link)
    _fails_cleanly(tmp_path, 6, ["rescale", index, "--arch", spec, "-o", link], "--in-place")
    # A sidecar spec is only found while loading: refused before anything is written all the same.
    checkpoint, _ = write_mlp(tmp_path, "side")
    sidecar = tmp_path / "side.pathcond.yaml"
    sidecar.write_text(yaml.safe_dump(mlp_spec()))
    _fails_cleanly(tmp_path, 6, ["rescale", checkpoint, "-o", sidecar], "--in-place", sidecar.name)


# -- 4. sharded --in-place: the index on disk always names a complete checkpoint ---------------


def _in_place_outcome(tmp_path: Path) -> tuple[Path, Path, dict, dict]:
    """A sharded checkpoint, its original tensors, and the tensors a successful --in-place gives."""
    done = tmp_path / "done"
    done.mkdir()
    index, spec = _sharded(done)
    original = _params(index, arch=str(spec))
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 0)
    rescaled = _params(index, arch=str(spec))
    assert not _same_tensors(original, rescaled)
    work = tmp_path / "work"
    work.mkdir()
    index, spec = _sharded(work)
    return index, spec, original, rescaled


def _replace_calls(index: Path, spec: Path, monkeypatch) -> int:
    calls = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda *a, **k: calls.append(a) or real(*a, **k))
    copy_dir = index.parent.parent / "count"
    copy_dir.mkdir()
    counted_index, counted_spec = _sharded(copy_dir)
    assert_clean_exit(invoke("rescale", counted_index, "--arch", counted_spec, "--in-place", "-q"), 0)
    monkeypatch.undo()
    return len(calls)


def test_sharded_in_place_survives_a_failing_rename_at_every_step(tmp_path, monkeypatch):
    index, spec, original, rescaled = _in_place_outcome(tmp_path)
    total = _replace_calls(index, spec, monkeypatch)
    assert total >= 3  # two shards and the index at least
    real = os.replace
    for k in range(1, total + 1):
        before = snapshot(index.parent)
        calls = []

        def failing(*args, **kwargs):
            calls.append(args)
            if len(calls) == k:
                raise OSError(errno.EIO, "Input/output error")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, "replace", failing)
        result = invoke("rescale", index, "--arch", spec, "--in-place", "-q")
        monkeypatch.undo()
        assert_clean_exit(result, 6, "Input/output error", "Nothing was written")
        assert_unchanged(index.parent, before)
        assert _same_tensors(_params(index, arch=str(spec)), original)
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 0)
    assert _same_tensors(_params(index, arch=str(spec)), rescaled)
    assert leftovers(index.parent) == []


def _run_and_kill(command: list[str], delay: float) -> int:
    process = subprocess.Popen(
        command, env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        return process.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def test_sharded_in_place_killed_at_random_moments_keeps_a_complete_checkpoint(tmp_path):
    import random
    import time

    index, spec, original, rescaled = _in_place_outcome(tmp_path)
    command = module_command("rescale", index, "--arch", spec, "--in-place", "-q")
    probe = tmp_path / "probe"
    probe.mkdir()
    probe_index, probe_spec = _sharded(probe)
    started = time.monotonic()
    subprocess.run(
        module_command("rescale", probe_index, "--arch", probe_spec, "--in-place", "-q"),
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
    )
    duration = time.monotonic() - started
    rng = random.Random(10)
    outcomes = set()
    for _ in range(3):  # each kill costs a start of torch; 3 moments across the run's last 45 %
        code = _run_and_kill(command, duration * rng.uniform(0.6, 1.05))
        current = _params(index, arch=str(spec))
        assert _same_tensors(current, original) or _same_tensors(current, rescaled)
        outcomes.add(code)
        if code == 0:  # finished: start again from the original
            for path in index.parent.iterdir():
                path.unlink() if path.is_file() else None
            _sharded(index.parent)
    # The next run removes what a killed one left behind.
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 0)
    assert leftovers(index.parent) == []


def test_killed_run_without_in_place_leaves_the_input_byte_identical(tmp_path):
    index, spec = _sharded(tmp_path)
    inputs = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for delay in (1.0, 2.5, 4.0):
        _run_and_kill(module_command("rescale", index, "--arch", spec, "-o", tmp_path / "out.json", "-q"), delay)
        assert {name: (tmp_path / name).read_bytes() for name in inputs} == inputs


# -- 7. only regular files are replaced ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory", "link-to-directory", "link-to-device"])
def test_output_that_is_not_a_regular_file_exit_6(tmp_path, kind):
    checkpoint, spec = write_mlp(tmp_path)
    target = tmp_path / "out.safetensors"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "link-to-directory":
        (tmp_path / "d").mkdir()
        target.symlink_to(tmp_path / "d")
    else:
        target.symlink_to("/dev/null")
    before = sorted(os.listdir(tmp_path))
    inputs = {p: p.read_bytes() for p in (checkpoint, spec)}
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", target), 6, "not a regular file")
    assert sorted(os.listdir(tmp_path)) == before  # (a snapshot would block reading the FIFO)
    assert {p: p.read_bytes() for p in inputs} == inputs
    if kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_existing_output_is_replaced_keeping_its_permissions_and_links_are_written_through(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o600)
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", out, "-q"), 0)
    assert out.stat().st_mode & 0o777 == 0o600 and out.read_bytes() != b"old"
    link = tmp_path / "link.safetensors"
    link.symlink_to(out)
    out.write_bytes(b"old")
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", link, "-q"), 0)
    assert link.is_symlink() and out.read_bytes() != b"old"


def test_stdout_to_a_terminal_is_refused_exit_2(tmp_path):
    import pty

    checkpoint, spec = write_mlp(tmp_path)
    controller, terminal = pty.openpty()
    try:
        process = subprocess.run(
            module_command("rescale", checkpoint, "--arch", spec, "-o", "-"),
            stdout=terminal,
            stderr=subprocess.PIPE,
            env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
    finally:
        os.close(terminal)
        os.close(controller)
    assert process.returncode == 2
    assert b"stdout is a terminal" in process.stderr


# -- 8. formats: a mismatch is a usage error, a torch pickle is never unpickled -----------------


def test_output_suffix_of_another_format_is_a_usage_error_before_any_work(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    model = write_onnx_mlp(tmp_path / "net.onnx")

    def never(*args, **kwargs):
        raise AssertionError("the work started")

    monkeypatch.setattr(pathcond_cli.rescaling, "solve", never)
    monkeypatch.setattr(pathcond_cli.io.formats, "load_model", never)
    _fails_cleanly(tmp_path, 2, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "x.onnx"], "safetensors")
    _fails_cleanly(tmp_path, 2, ["rescale", model, "-o", tmp_path / "x.safetensors"], "ONNX")
    _fails_cleanly(tmp_path, 2, ["rescale", model, "-o", tmp_path / "x.pt"], "torch pickle")


class _Trap:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("name", ["model.pt", "model.pth", "model.bin", "model.onnx", "model.safetensors"])
def test_torch_pickle_is_named_with_the_way_to_convert_it_and_never_unpickled(tmp_path, name):
    path = tmp_path / name
    marker = tmp_path / "unpickled"
    if name.endswith((".pt", ".onnx")):
        torch.save({"weight": torch.ones(2), "trap": _Trap(str(marker))}, str(path))  # zip format
    else:
        path.write_bytes(pickle.dumps(_Trap(str(marker)), protocol=4))
    stderr = _fails_cleanly(
        tmp_path,
        3,
        ["rescale", path, "-o", tmp_path / "out.safetensors"],
        "torch pickle",
        "never unpickles",
        "safetensors.torch.save_file",
        "torch.onnx.export",
    )
    assert str(path) in stderr
    _fails_cleanly(tmp_path, 3, ["inspect", "-"], "torch pickle", input=path.read_bytes())
    assert not marker.exists()


# -- 9. environment problems have their documented codes ----------------------------------------


def test_disk_full_reported_by_the_safetensors_writer_exit_6(tmp_path, monkeypatch):
    """The tensor-by-tensor writer meets a real full device (/dev/full fails every write with
    ENOSPC) after a partial file was left behind: reported as a full disk, nothing kept."""
    checkpoint, spec = write_mlp(tmp_path)
    real_writer = safetensors_format.write_tensors

    def full(tensors, path, **options):
        Path(path).write_bytes(b"\x00partial")
        real_writer(tensors, Path("/dev/full"), **options)

    monkeypatch.setattr(safetensors_format, "write_tensors", full)
    _fails_cleanly(
        tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors"], "disk is full"
    )
    _fails_cleanly(tmp_path, 6, ["rescale", checkpoint, "--arch", spec, "--in-place"], "disk is full")


def test_file_names_over_255_bytes(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    long = "a" * 300
    _fails_cleanly(tmp_path, 3, ["rescale", tmp_path / f"{long}.safetensors", "--arch", spec], "too long")
    _fails_cleanly(
        tmp_path,
        6,
        ["rescale", checkpoint, "--arch", spec, "-o", tmp_path / f"{long}.safetensors"],
        "longer than 255 bytes",
    )
    # A name just under the limit: staging names are shortened, the output keeps its name.
    near = tmp_path / ("b" * 240 + ".safetensors")
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", near, "-q"), 0)
    assert near.is_file() and leftovers(tmp_path) == []


def test_non_utf8_file_names(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/mod\xffel.safetensors")
    Path(odd).write_bytes(checkpoint.read_bytes())
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xfe.safetensors")
    process = subprocess.run(
        [os.fsencode(a) for a in module_command("rescale", odd, "--arch", spec, "-o", out, "--json")],
        capture_output=True,
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout)["model"].endswith("mod\\xffel.safetensors")
    assert Path(out).is_file()
    missing = os.fsdecode(os.fsencode(str(tmp_path)) + b"/gh\xffost.safetensors")
    result = invoke("rescale", missing, "--arch", spec)
    assert_clean_exit(result, 3, "no such file", "gh\\xffost")


def test_closed_and_terminal_stdin_have_distinct_messages(tmp_path):
    process = subprocess.run(
        module_command("rescale", "-", "-o", tmp_path / "o.onnx"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert process.returncode == 3  # /dev/null: an empty model
    closed = subprocess.run(
        " ".join(map(str, module_command("rescale", "-", "-o", tmp_path / "o.onnx"))) + " <&-",
        shell=True,
        capture_output=True,
        env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert closed.returncode == 2 and b"stdin is closed" in closed.stderr and b"terminal" not in closed.stderr
    assert leftovers(tmp_path) == []


# -- 12. interrupts and what a killed process leaves ---------------------------------------------


def test_interrupt_after_the_output_was_written_says_so(tmp_path, monkeypatch):
    checkpoint, spec = write_mlp(tmp_path)
    out = tmp_path / "out.safetensors"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pathcond_cli.cli.app, "_emit", interrupted)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", out)
    assert_clean_exit(result, 130, "completely written", str(out))
    assert "nothing was written" not in result.stderr
    assert out.is_file()
    monkeypatch.setattr(pathcond_cli.rescaling, "solve", interrupted)
    result = invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "other.safetensors")
    assert_clean_exit(result, 130, "nothing was written")


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_staging_of_dead_processes_is_removed_by_the_next_run(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    dead, alive = _dead_pid(), os.getpid()
    stale_dir = tmp_path / f".out.safetensors.pid{dead}.abcd1234.pathcond-tmp"
    stale_dir.mkdir()
    (stale_dir / "out.safetensors").write_bytes(b"half")
    stale_file = tmp_path / f".report.json.pid{dead}.x1y2z3w4.pathcond-tmp"
    stale_file.write_bytes(b"half")
    live = tmp_path / f".other.pid{alive}.qwertyui.pathcond-tmp"
    live.mkdir()
    foreign = tmp_path / ".someone-else.pathcond-tmp"
    foreign.write_bytes(b"not ours")
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "-q"), 0)
    assert not stale_dir.exists() and not stale_file.exists()
    assert live.exists() and foreign.exists()


def _python_call() -> None:
    """A call into Python code: where the interpreter runs pending signal handlers."""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_inside_a_deferred_block_is_delivered_when_it_ends(signum):
    """Held back, not lost, even with torch's worker threads running (a signal sent to the
    process may land on any of them): the handler runs once, after the block."""
    torch.ones(1 << 16).sum()  # torch's intra-op threads exist
    calls = []
    previous = signal.signal(signum, lambda received, frame: calls.append(("handler", received)))
    try:
        with interrupts_deferred():
            for _ in range(3):
                os.kill(os.getpid(), signum)
                _python_call()
            calls.append("inside")
        _python_call()
    finally:
        signal.signal(signum, previous)
    assert calls == ["inside", ("handler", signum)]


def test_commands_import_the_libraries_with_sigint_held_back(monkeypatch):
    """torch and the library load before the command's guard with Ctrl-C held back: an interrupt
    raised inside their C++ initialisation aborted the process or was swallowed (exit 0)."""
    handlers = {}
    real_import = pathcond_cli.cli.guard.importlib.import_module

    def recording_import(name, *args):
        handlers[name] = signal.getsignal(signal.SIGINT)
        return real_import(name, *args)

    monkeypatch.setattr(pathcond_cli.cli.guard.importlib, "import_module", recording_import)
    outside = signal.getsignal(signal.SIGINT)
    with pathcond_cli.cli.app.guard.command():
        assert signal.getsignal(signal.SIGINT) is outside
    assert handlers and next(iter(handlers)) == "torch"
    assert all(handler is not outside for handler in handlers.values())


def test_the_package_imports_nothing_before_the_ctrl_c_handler_is_installed():
    """``python -m pathcond_cli`` runs ``pathcond_cli/__init__.py`` before ``__main__`` installs its
    Ctrl-C handler. In a fresh virtual environment (the torch 2.11 CI run) its ``import typing``
    took 20 ms, and Ctrl-C then printed a traceback from pathcond's own code."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); import pathcond_cli; "
        "print(sorted(set(sys.modules) - before - {'pathcond_cli'}))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_in_a_subprocess_exits_128_plus_the_signal_without_traceback(tmp_path, signum, code):
    """At any moment, start-up imports included: exit 130 (Ctrl-C) or 143 (SIGTERM, what
    schedulers send at a time limit), no traceback, no staged file, the truth about the disk."""
    checkpoint, spec = write_mlp(tmp_path)
    command = module_command("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "-q")
    env = {**CLEAN_ENV, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "out.safetensors"
    for delay in (0.05, 0.15, 0.3, 0.5, 2.0, 3.5):
        # Each run starts with no output: one left by a run that finished before its signal is not this run's.
        out.unlink(missing_ok=True)
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:  # the signal at ``delay``, unless the run has ended by then (its pipes hold a few lines)
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
        if process.returncode == 0:
            continue  # finished before the signal
        if process.returncode == -signum and not stderr:
            continue  # the interpreter itself was still starting: no Python code had run yet
        if b"KeyboardInterrupt" in stderr and f'File "{ROOT / "pathcond_cli"}'.encode() not in stderr:
            continue  # Python's own start-up (site, runpy): no frame of pathcond's code had run yet
        assert process.returncode == code, stderr
        assert b"Traceback" not in stderr
        assert stderr.startswith(b"terminated (SIGTERM): " if signum == signal.SIGTERM else b"interrupted: "), stderr
        expected = b"completely written" if out.exists() else b"nothing was written"
        assert expected in stderr, stderr
        assert leftovers(tmp_path) == []
