"""Many checkpoints in one process (``rescale A B C --output-dir DIR``, ``inspect A B C``) and the
cluster recipes of docs/clusters.md, run for real.

The oracle for every written file is the network itself: the tiny MLP evaluated with plain torch
from the input's tensors and from the output's, and the tensors a single run writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import fake_cuda
import pytest
import safetensors.torch
import torch
import yaml
from cli_support import (
    CLEAN_ENV,
    ROOT,
    SAMPLES,
    assert_clean_exit,
    assert_unchanged,
    check_report,
    invoke,
    leftovers,
    mlp_spec,
    mlp_tensors,
    module_command,
    snapshot,
    write_mlp,
)

import pathcond_cli.cli.app
import pathcond_cli.io.formats

DIMS = (6, 8, 5, 3)
CLUSTERS_DOC = ROOT / "docs" / "clusters.md"
ERROR_KEYS = {"exit_code", "type", "message"}


def _mlp_outputs(path: Path, x: torch.Tensor) -> torch.Tensor:
    """The tiny MLP of ``write_mlp`` evaluated from the tensors of ``path``, in float64."""
    tensors = safetensors.torch.load_file(str(path))
    layers = len(DIMS) - 1
    for i in range(1, layers + 1):
        x = x @ tensors[f"fc{i}.weight"].double().T + tensors[f"fc{i}.bias"].double()
        if i < layers:
            x = torch.relu(x)
    return x


def _assert_same_function(original: Path, rescaled: Path) -> None:
    x = torch.randn(64, DIMS[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    before, after = _mlp_outputs(original, x), _mlp_outputs(rescaled, x)
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-6 * before.abs().max().item())
    assert not torch.equal(
        safetensors.torch.load_file(str(original))["fc1.weight"],
        safetensors.torch.load_file(str(rescaled))["fc1.weight"],
    ), "nothing was rescaled"


def _models(directory: Path, count: int) -> tuple[list[Path], Path]:
    """``count`` different tiny MLPs m0..m{count-1}.safetensors sharing one spec."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"m{index}.safetensors" for index in range(count)]
    for index, path in enumerate(paths):
        safetensors.torch.save_file(mlp_tensors(DIMS, seed=index), str(path))
    spec = directory / "net.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec(DIMS)))
    return paths, spec


def _json_lines(text: str) -> list[dict]:
    lines = text.splitlines()
    assert text.endswith("\n") and all(lines), "one document per line, nothing else"
    return [json.loads(line) for line in lines]


def test_json_lines_one_document_per_file_in_order_each_as_a_single_run(tmp_path):
    paths, spec = _models(tmp_path / "in", 3)
    out = tmp_path / "out"
    out.mkdir()
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", out, "--json")
    stderr = assert_clean_exit(result, 0)
    documents = _json_lines(result.stdout)
    assert [d["model"] for d in documents] == [str(p) for p in paths]
    for index, (path, document) in enumerate(zip(paths, documents), start=1):
        check_report(document, rescale=True)
        written = out / f"m{index - 1}.pathcond.safetensors"
        assert document["output"] == str(written)
        _assert_same_function(path, written)
        single = tmp_path / f"single{index}.safetensors"
        assert_clean_exit(invoke("rescale", path, "--arch", spec, "-o", single, "-q"), 0)
        assert safetensors.torch.load_file(str(single)).keys() == safetensors.torch.load_file(str(written)).keys()
        for key, tensor in safetensors.torch.load_file(str(single)).items():
            assert torch.equal(safetensors.torch.load_file(str(written))[key], tensor), key
        assert f"[{index}/3] pathcond rescale: {path} → {written} · verified" in stderr
    assert stderr.rstrip().splitlines()[-1] == "pathcond rescale: 3 of 3 written and verified."
    assert leftovers(tmp_path) == []


def test_several_models_without_output_dir_are_written_beside_each_input(tmp_path):
    paths, spec = _models(tmp_path, 2)
    assert_clean_exit(invoke("rescale", *paths, "--arch", spec, "-q"), 0)
    for path in paths:
        _assert_same_function(path, path.with_name(f"{path.stem}.pathcond.safetensors"))


def test_output_dir_with_one_model_is_a_run_over_several_files(tmp_path):
    """``xargs -n`` may hand the last process a single file: its output is still one JSON line."""
    paths, spec = _models(tmp_path, 1)
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", tmp_path, "--json")
    assert_clean_exit(result, 0)
    assert len(result.stdout.splitlines()) == 1
    check_report(json.loads(result.stdout), rescale=True)


def _corrupt(path: Path) -> Path:
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    return path


def _with_nan(directory: Path) -> Path:
    tensors = mlp_tensors(DIMS, seed=9)
    tensors["fc2.weight"][0, 0] = float("nan")
    path, own_spec = write_mlp(directory, "nan", tensors=tensors)
    own_spec.unlink()
    return path


def test_a_failed_file_is_reported_with_its_exit_code_and_the_rest_processed(tmp_path):
    paths, spec = _models(tmp_path / "in", 2)
    bad = _corrupt(tmp_path / "in" / "bad.safetensors")
    nan = _with_nan(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    inputs = snapshot(tmp_path / "in")
    result = invoke("rescale", paths[0], bad, nan, paths[1], "--arch", spec, "--output-dir", out, "--json")
    assert result.exit_code == 9, result.stderr  # failures with different codes
    assert "Traceback" not in result.stderr
    documents = _json_lines(result.stdout)
    assert [d["model"] for d in documents] == [str(p) for p in (paths[0], bad, nan, paths[1])]
    for document, code in ((documents[1], 3), (documents[2], 7)):
        assert set(document["error"]) == ERROR_KEYS
        assert document["error"]["exit_code"] == code
        assert document["error"]["type"] == ("InputError" if code == 3 else "InvalidWeightsError")
        assert document["model"] in document["error"]["message"]
        assert f"(exit {code}): " in result.stderr
    for document in (documents[0], documents[3]):
        check_report(document, rescale=True)
    assert sorted(p.name for p in out.iterdir()) == ["m0.pathcond.safetensors", "m1.pathcond.safetensors"]
    for path in paths:
        _assert_same_function(path, out / f"{path.stem}.pathcond.safetensors")
    assert "[2/4] error (exit 3)" in result.stderr and "[3/4] error (exit 7)" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (
        "pathcond rescale: 2 of 4 written and verified; failed: 1 with exit 3, 1 with exit 7; exit status 9."
    )
    assert_unchanged(tmp_path / "in", inputs)
    assert leftovers(tmp_path) == []

    other_bad = _corrupt(tmp_path / "in" / "other.safetensors")
    agreeing = invoke("rescale", bad, paths[0], other_bad, "--arch", spec, "--output-dir", out, "-q")
    assert agreeing.exit_code == 3, agreeing.stderr  # every failure has the same code: that code
    assert agreeing.stderr.count("error (exit 3)") == 2 and agreeing.stdout == ""


def test_colliding_outputs_are_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, spec = write_mlp(tmp_path / "a", "x")
    second, _ = write_mlp(tmp_path / "b", "x", tensors=mlp_tensors(DIMS, seed=1))
    earlier = first.with_name("x.pathcond.safetensors")  # an earlier run's output, given as an input
    earlier.write_bytes(first.read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    loads = []
    monkeypatch.setattr(pathcond_cli.io.formats, "load_model", lambda *args, **kwargs: loads.append(args))
    before = snapshot(tmp_path)
    for arguments in (
        [first, second, "--output-dir", out],  # one stem in two folders
        [first, first, "--output-dir", out],  # one input twice
        [first, earlier],  # first's output, beside it, is the other input
        [earlier, second, "--output-dir", tmp_path / "a"],  # second's output is the other input
        [first, tmp_path / "a" / ".." / "a" / "x.safetensors", "--in-place"],  # one input twice, by another name
    ):
        result = invoke("rescale", *arguments, "--arch", spec, "--json")
        assert_clean_exit(result, 6, "refusing", "nothing was written")
        assert_unchanged(tmp_path, before)
    assert loads == [], "a model was loaded before the refusal"


def _sharded(directory: Path, shard_names: tuple[str, str]) -> Path:
    """A two-shard checkpoint of the tiny MLP: ``model.safetensors.index.json`` and ``shard_names``."""
    tensors = mlp_tensors(DIMS, seed=5)
    layout = {
        shard_names[0]: ["fc1.weight", "fc1.bias", "fc2.weight"],
        shard_names[1]: ["fc2.bias", "fc3.weight", "fc3.bias"],
    }
    for file, keys in layout.items():
        safetensors.torch.save_file({k: tensors[k] for k in keys}, str(directory / file), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in layout.items() for k in keys}})
    )
    return index


def _merged(index: Path) -> Path:
    """The tensors of a sharded checkpoint in one file, for the function check."""
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(safetensors.torch.load_file(str(index.parent / shard)))
    merged = index.parent / f"merged-{index.name}.safetensors"
    safetensors.torch.save_file(tensors, str(merged))
    return merged


def test_a_sharded_checkpoint_among_several_is_written_whole_into_the_output_dir(tmp_path):
    (tmp_path / "in").mkdir()
    paths, spec = _models(tmp_path / "in", 1)
    index = _sharded(tmp_path / "in", ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    assert_clean_exit(invoke("rescale", index, paths[0], "--arch", spec, "--output-dir", out, "-q"), 0)
    written = out / "model.pathcond.safetensors.index.json"
    assert sorted(p.name for p in out.iterdir()) == [
        "m0.pathcond.safetensors",
        "model.pathcond-00001-of-00002.safetensors",
        "model.pathcond-00002-of-00002.safetensors",
        written.name,
    ]
    _assert_same_function(_merged(index), _merged(written))


def test_an_output_that_is_a_shard_of_another_input_is_refused(tmp_path, monkeypatch):
    plain, spec = write_mlp(tmp_path, "a")
    index = _sharded(tmp_path, ("a.pathcond.safetensors", "rest.safetensors"))  # a's output is index's shard
    loads = []
    monkeypatch.setattr(pathcond_cli.io.formats, "load_model", lambda *args, **kwargs: loads.append(args))
    before = snapshot(tmp_path)
    result = invoke("rescale", index, plain, "--arch", spec)
    assert_clean_exit(result, 6, "refusing to overwrite", "a.pathcond.safetensors", "nothing was written")
    assert_unchanged(tmp_path, before)
    assert loads == []


def test_usage_errors_of_several_models(tmp_path):
    paths, spec = _models(tmp_path, 2)
    before = snapshot(tmp_path)
    for arguments, hint in (
        ([*paths, "-o", tmp_path / "o.safetensors"], "-o"),
        ([paths[0], "--output-dir", tmp_path, "-o", tmp_path / "o.safetensors"], "-o"),
        ([*paths, "--report", tmp_path / "r.json"], "--report"),
        ([*paths, "--plot", tmp_path / "p.png"], "--plot"),
        ([*paths, "--output-dir", tmp_path, "--in-place"], "--in-place"),
        ([paths[0], "-"], "MODEL"),
    ):
        result = invoke("rescale", *arguments, "--arch", spec)
        assert_clean_exit(result, 2, hint)
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", tmp_path / "missing")
    assert_clean_exit(result, 6, "does not exist", "nothing was written")
    assert_unchanged(tmp_path, before)


def test_inputs_are_never_overwritten_and_in_place_replaces_each_input_deliberately(tmp_path):
    paths, spec = _models(tmp_path, 3)
    originals = {path: path.read_bytes() for path in paths}
    stale = tmp_path / "m1.pathcond.safetensors"
    stale.write_bytes(b"an older output, replaced like a single run replaces it")
    assert_clean_exit(invoke("rescale", *paths, "--arch", spec, "--output-dir", tmp_path, "-q"), 0)
    assert all(path.read_bytes() == data for path, data in originals.items())
    _assert_same_function(paths[1], stale)

    kept = tmp_path / "kept"
    kept.mkdir()
    for path in paths:
        shutil.copyfile(path, kept / path.name)
    assert_clean_exit(invoke("rescale", *paths, "--arch", spec, "--in-place", "-q"), 0)
    for path in paths:
        assert path.read_bytes() != originals[path]
        _assert_same_function(kept / path.name, path)
    assert leftovers(tmp_path) == []


def test_inspect_several_files_writes_nothing(tmp_path):
    paths, spec = _models(tmp_path, 3)
    bad = _corrupt(tmp_path / "bad.safetensors")
    before = snapshot(tmp_path)
    result = invoke("inspect", paths[0], bad, paths[1], paths[2], "--arch", spec, "--json")
    assert result.exit_code == 3, result.stderr
    documents = _json_lines(result.stdout)
    assert [d["model"] for d in documents] == [str(p) for p in (paths[0], bad, paths[1], paths[2])]
    assert documents[1]["error"]["exit_code"] == 3 and set(documents[1]["error"]) == ERROR_KEYS
    for document in (documents[0], documents[2], documents[3]):
        check_report(document, rescale=False)
    assert "pathcond inspect: 3 of 4 inspected; failed: 1 with exit 3; exit status 3." in result.stderr
    assert_unchanged(tmp_path, before)


@pytest.mark.parametrize(
    ("signum", "code", "label"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, r"terminated \(SIGTERM\)")],
    ids=["SIGINT", "SIGTERM"],
)
def test_an_interrupt_between_files_keeps_every_finished_file(tmp_path, signum, code, label):
    """Ctrl-C, or the SIGTERM a scheduler sends at a time limit, while the third file is being
    processed: every finished output complete and verified, no partial file, the message counts
    what is on disk, exit 128 + the signal."""
    count = 40
    paths, spec = _models(tmp_path / "in", count)
    out = tmp_path / "out"
    out.mkdir()
    command = module_command("rescale", *paths, "--arch", spec, "--output-dir", out, "--json")
    process = subprocess.Popen(
        command, env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(f"[2/{count}]"):
            process.send_signal(signum)
            break
    stdout, rest = process.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr
    written = sorted(out.iterdir())
    assert 2 <= len(written) < count, "the interrupt should land while files remain"
    match = re.search(label + r": (\d+) of 40 outputs were completely written and verified", stderr)
    assert match and int(match.group(1)) == len(written), stderr
    documents = _json_lines(stdout)
    assert len(documents) == len(written)  # every finished file has its line
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert (
        re.match(label + r": \d+ of 40 outputs", lines[-1]) and sum(label.split(" ")[0] in line for line in lines) == 1
    )
    for document in documents:
        check_report(document, rescale=True)
    for path in written:
        _assert_same_function(tmp_path / "in" / path.name.replace(".pathcond", ""), path)
    assert leftovers(tmp_path) == []


def _interrupt_in_the_file(monkeypatch, path: Path, signum: int, error: BaseException) -> None:
    """The single-file run of ``path`` fails with ``error`` after the handler has recorded ``signum``."""
    real_rescale_one = pathcond_cli.cli.app._rescale_one

    def interrupted(model, *args):
        if Path(model) == path:
            pathcond_cli.cli.app.guard.signal_received = signum
            raise error
        return real_rescale_one(model, *args)

    monkeypatch.setattr(pathcond_cli.cli.app, "_rescale_one", interrupted)


def test_a_library_error_raised_by_an_interrupt_is_reported_as_the_interrupt(tmp_path, monkeypatch):
    """A signal that lands inside a C extension can come back as that library's own error (the
    test suite once saw a file of an interrupted batch reported as unreadable, exit 3): once the
    handler has run, the failure is the interrupt, and no later file is processed."""
    paths, spec = _models(tmp_path / "in", 3)
    out = tmp_path / "out"
    out.mkdir()
    _interrupt_in_the_file(
        monkeypatch, paths[1], signal.SIGTERM, RuntimeError("read interrupted inside the C extension")
    )
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", out, "-q")
    stderr = assert_clean_exit(result, 143, "terminated (SIGTERM): 1 of 3 outputs were completely written")
    assert "unreadable" not in stderr
    assert [path.name for path in out.iterdir()] == [paths[0].name.replace(".safetensors", ".pathcond.safetensors")]


# -- an interrupted batch ends with one line, the batch's, and reports every finished file


def _interrupted_batch(result) -> str:
    """Exit 130 through the CLI's own handling, no traceback; stderr."""
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, f"exception escaped the CLI: {escaped!r}\nstderr: {result.stderr}"
    assert result.exit_code == 130, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return result.stderr


def test_an_interrupted_batch_ends_with_the_batch_line_alone(tmp_path, monkeypatch):
    """The batch's exit (typer.Exit, a RuntimeError) was taken for a library error raised by the
    interrupt, and the single run's line followed the batch's."""
    paths, spec = _models(tmp_path / "in", 3)
    out = tmp_path / "out"
    out.mkdir()
    _interrupt_in_the_file(monkeypatch, paths[1], signal.SIGINT, KeyboardInterrupt())
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", out, "--json")
    stderr = _interrupted_batch(result)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("interrupted: 1 of 3 outputs were completely written and verified"), stderr
    assert sum(line.startswith("interrupted") for line in lines) == 1, stderr
    assert len(_json_lines(result.stdout)) == 1


def test_a_file_written_before_the_interrupt_has_its_json_line(tmp_path, monkeypatch):
    """SIGINT lands once the second output is in place, before its report is printed: the
    output is complete, so its JSON line is printed, then the run stops."""
    paths, spec = _models(tmp_path / "in", 3)
    out = tmp_path / "out"
    out.mkdir()
    real_rescale_one = pathcond_cli.cli.app._rescale_one

    def interrupted_once_written(model, *args):
        report = real_rescale_one(model, *args)
        if Path(model) == paths[1]:
            signal.raise_signal(signal.SIGINT)
        return report

    monkeypatch.setattr(pathcond_cli.cli.app, "_rescale_one", interrupted_once_written)
    monkeypatch.setattr(pathcond_cli.cli.app.guard, "signal_received", None)
    result = invoke("rescale", *paths, "--arch", spec, "--output-dir", out, "--json")
    stderr = _interrupted_batch(result)
    assert "2 of 3 outputs were completely written and verified" in stderr
    assert "before the last one's report was printed" not in stderr
    written = sorted(path.name for path in out.iterdir())
    documents = _json_lines(result.stdout)
    assert len(written) == 2 and sorted(Path(d["output"]).name for d in documents) == written
    for document in documents:
        check_report(document, rescale=True)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("interrupted: 2 of 3"), stderr


# -- docs/clusters.md: the recipes, run as written -----------------------------------------------


def _recipe(marker: str) -> str:
    """The fenced block that follows ``<!-- recipe: marker -->`` in docs/clusters.md."""
    match = re.search(rf"<!-- recipe: {marker} -->\s*```(?:sh|bash)\n(.*?)```", CLUSTERS_DOC.read_text(), re.DOTALL)
    assert match, f"no recipe '{marker}' in {CLUSTERS_DOC}"
    return match.group(1)


def _cluster_folder(tmp_path: Path, count: int) -> tuple[Path, dict]:
    """A folder as the recipes expect it: checkpoints/*.safetensors, model.yaml, and a
    ``pathcond`` on PATH that is this checkout's."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for index in range(count):
        shutil.copyfile(SAMPLES / "mlp.safetensors", checkpoints / f"run{index}.safetensors")
    shutil.copyfile(SAMPLES / "mlp.yaml", tmp_path / "model.yaml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "pathcond"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pathcond_cli "$@"\n')
    launcher.chmod(0o755)
    env = {
        **CLEAN_ENV,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    return checkpoints, env


def test_the_conv_allocator_recipe_of_docs_clusters_runs(tmp_path):
    """glibc reads the variables at start-up; the rescaled file is written and verified as without them."""
    _, env = _cluster_folder(tmp_path, 0)
    shutil.copyfile(SAMPLES / "resnet_small.onnx", tmp_path / "model.onnx")
    completed = subprocess.run(
        ["bash", "-c", _recipe("conv-allocator")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert "verified" in completed.stderr and (tmp_path / "model.rescaled.onnx").is_file()


@pytest.mark.skipif(shutil.which("xargs") is None, reason="needs xargs")
def test_the_xargs_recipe_of_docs_clusters_runs(tmp_path):
    checkpoints, env = _cluster_folder(tmp_path, 5)
    before = snapshot(checkpoints)
    completed = subprocess.run(
        ["bash", "-c", _recipe("xargs")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr
    documents = _json_lines((tmp_path / "reports.jsonl").read_text())
    assert sorted(d["model"] for d in documents) == sorted(f"checkpoints/run{i}.safetensors" for i in range(5))
    for document in documents:
        check_report(document, rescale=True)
        assert Path(tmp_path / document["output"]).is_file()
    assert sorted(p.name for p in (tmp_path / "rescaled").iterdir()) == sorted(
        f"run{i}.pathcond.safetensors" for i in range(5)
    )
    assert_unchanged(checkpoints, before)
    assert leftovers(tmp_path) == []


def test_the_slurm_array_recipes_of_docs_clusters_run_their_lines(tmp_path):
    """The job scripts' bodies, as array tasks run them (sbatch only adds the environment)."""
    checkpoints, env = _cluster_folder(tmp_path, 3)
    subprocess.run(["bash", "-c", _recipe("slurm-list")], cwd=tmp_path, env=env, check=True, timeout=60)
    assert (tmp_path / "files.txt").read_text().split() == [f"checkpoints/run{i}.safetensors" for i in range(3)]
    (tmp_path / "job.sh").write_text(_recipe("slurm-job"))
    completed = subprocess.run(
        ["bash", "job.sh"],
        cwd=tmp_path,
        env={**env, "SLURM_ARRAY_TASK_ID": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr
    assert [p.name for p in (tmp_path / "rescaled").iterdir()] == ["run1.pathcond.safetensors"]
    check_report(json.loads((tmp_path / "reports" / "2.json").read_text()), rescale=True)

    block = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + _recipe("slurm-block")],
        cwd=tmp_path,
        env={**env, "SLURM_ARRAY_TASK_ID": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert block.returncode == 0, block.stderr
    documents = _json_lines((tmp_path / "reports" / "0.jsonl").read_text())
    assert [d["model"] for d in documents] == [f"checkpoints/run{i}.safetensors" for i in range(3)]
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_the_torchrun_recipe_of_docs_clusters_runs_one_process_per_device(tmp_path):
    """Two processes; without a GPU here, on the CPU (the recipe's only two GPU words replaced)."""
    checkpoints, env = _cluster_folder(tmp_path, 5)
    subprocess.run(["bash", "-c", _recipe("slurm-list")], cwd=tmp_path, env=env, check=True, timeout=60)
    rank = _recipe("rank")
    launch = _recipe("torchrun")
    # torchrun's processes see the machine's devices, not the fake one this process may run on
    if not torch.cuda.is_available() or fake_cuda.requested():
        assert "--device cuda" in rank and "--nproc-per-node=gpu" in launch
        rank, launch = rank.replace("--device cuda", "--device cpu"), launch.replace("=gpu", "=2")
    (tmp_path / "rank.sh").write_text(rank)
    completed = subprocess.run(
        ["bash", "-c", launch], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr
    ranks = [_json_lines((tmp_path / "reports" / f"rank{r}.jsonl").read_text()) for r in (0, 1)]
    assert [d["model"] for d in ranks[0]] == [f"checkpoints/run{i}.safetensors" for i in (0, 2, 4)]
    assert [d["model"] for d in ranks[1]] == [f"checkpoints/run{i}.safetensors" for i in (1, 3)]
    assert sorted(p.name for p in (tmp_path / "rescaled").iterdir()) == sorted(
        f"run{i}.pathcond.safetensors" for i in range(5)
    )
    assert leftovers(tmp_path) == []
