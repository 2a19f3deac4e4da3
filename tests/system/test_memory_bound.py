"""Peak host memory of a real `pathcond rescale` process, measured against the checkpoint's size.

The child's own peak resident set (ru_maxrss from wait4, file pages it mapped included) less
that of a process that only imports torch must stay within ``SLOPE`` times the checkpoint's
bytes plus ``SLACK``: the issue's slope, 1.5, with a constant small enough for a 46 MB model to
show a regression (the issue's 1 GiB would hide any). With ``--max-iter 3`` and a fixed mmap
threshold (below), 0.3.0 used 11.9 times the checkpoint above that floor on this model (0.51
GiB), 0.4.0 6.5 times (0.28 GiB), this version 2.0 times (0.088 GiB on torch 2.13, 0.064 GiB on
torch 2.11; the bound is 0.125 GiB, which the same code holding the DAG's values, 0.131 GiB,
exceeds).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from cli_support import (
    assert_clean_exit,
    invoke,
    mlp_spec,
    mlp_tensors,
    write_mlp,
    write_onnx_mlp,
    write_sharded_mlp,
)

import pathcond_cli.io.formats.safetensors_format as safetensors_format
import pathcond_cli.model_files
from pathcond_cli.engine.layouts import HeldValues, release_held

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_memory import build_mlp, checkpoint_bytes, child_peak, torch_floor  # noqa: E402

GIB = 2**30
SLOPE = 1.5
SLACK = 0.06 * GIB
LARGE_BLOCK = 128 * 2**10  # glibc's default mmap threshold, fixed


@pytest.fixture(scope="module")
def sharded_mlp(tmp_path_factory) -> Path:
    """11 hidden layers of 1024 units: 11.6 M fp32 parameters, 46 MB in two shards."""
    return build_mlp(tmp_path_factory.mktemp("mlp"), inputs=1024, width=1024, depth=11, outputs=10, shards=2)


def test_peak_memory_of_a_rescale_stays_within_its_bound_shape(sharded_mlp, tmp_path, monkeypatch):
    """glibc's malloc raises its mmap threshold as large blocks are freed, then serves later
    ones from a heap it does not give back: by default the same command peaked anywhere from
    0.30 to 0.46 GiB above the floor here. A fixed threshold keeps every large block mapped and
    unmapped when freed, so the peak is the run's live memory, the same on every run (0.088 GiB;
    0.4.0: 0.28 GiB; 0.3.0: 0.51 GiB, 11.9 x)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(LARGE_BLOCK))
    size = checkpoint_bytes(sharded_mlp)
    floor = torch_floor(tmp_path / "torch.log")
    out = tmp_path / "out" / "mlp.safetensors.index.json"
    out.parent.mkdir()
    peak, _, status = child_peak(
        [
            sys.executable,
            "-m",
            "pathcond_cli",
            "rescale",
            str(sharded_mlp),
            "-o",
            str(out),
            "--device",
            "cpu",
            "--max-iter",
            "3",
            "-q",
            # A report read (here, a file): its facts are computed too, as in every run but -q's alone.
            "--report",
            str(tmp_path / "report.json"),
        ],
        tmp_path / "rescale.log",
    )
    assert status == 0, (tmp_path / "rescale.log").read_text()[-2000:]
    assert out.is_file() and "report_facts" in json.loads((tmp_path / "report.json").read_text())["seconds"]
    above = peak - floor
    assert above <= SLOPE * size + SLACK, (
        f"peak RSS {above / GIB:.2f} GiB ({above / size:.1f} x the {size / 2**20:.0f} MiB checkpoint) above "
        f"`import torch` ({floor / GIB:.2f} GiB); bound {SLOPE:g} x + {SLACK / GIB:g} GiB"
    )


def _files_held(directory: Path) -> set[str]:
    """Files under ``directory`` this process has mapped or open (a deleted one keeps its name)."""
    names = {
        line.split(maxsplit=5)[5].removesuffix(" (deleted)")
        for line in Path("/proc/self/maps").read_text().splitlines()
        if len(line.split(maxsplit=5)) == 6
    }
    for fd in Path("/proc/self/fd").iterdir():
        try:
            names.add(os.readlink(fd))
        except OSError:
            continue
    return {name for name in names if name.startswith(str(directory))}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_run_over_many_files_holds_one_files_mapping_at_a_time(tmp_path, monkeypatch):
    """Inputs are memory-mapped: in a run over many checkpoints each file (and its written copy,
    mapped again to verify it) must be unmapped and closed before the next file is opened, or a
    sweep of hundreds of checkpoints would hold them all."""
    count = 12
    inputs = tmp_path / "in"
    inputs.mkdir()
    for index in range(count):
        safetensors.torch.save_file(mlp_tensors((6, 8, 5, 3), seed=index), str(inputs / f"m{index}.safetensors"))
    spec = inputs / "net.arch.yaml"
    spec.write_text(yaml.safe_dump(mlp_spec((6, 8, 5, 3))))
    out = tmp_path / "out"
    out.mkdir()
    seen: list[tuple[str, set[str], set[str]]] = []
    mapped = safetensors_format.MappedTensors.__init__

    def probing(self, path):
        before = _files_held(tmp_path)
        mapped(self, path)
        seen.append((Path(path).name.split(".")[0], before, _files_held(tmp_path)))

    monkeypatch.setattr(safetensors_format.MappedTensors, "__init__", probing)
    result = invoke("rescale", *sorted(inputs.glob("*.safetensors")), "--arch", spec, "--output-dir", out, "-q")
    assert_clean_exit(result, 0)
    assert {stem for stem, _, _ in seen} == {f"m{index}" for index in range(count)}
    for stem, before, after in seen:
        assert any(Path(name).name.split(".")[0] == stem for name in after), "the probe sees no mapping"
        others = {name for name in before if Path(name).name.split(".")[0] != stem}
        assert not others, f"opening {stem}: still held from earlier files: {sorted(others)}"


def _sharded_tensors(index: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads(index.read_text())["weight_map"]
    return {key: safetensors.torch.load_file(str(index.parent / file))[key] for key, file in weight_map.items()}


def test_a_sharded_in_place_run_reads_the_mapped_originals_not_the_replaced_files(tmp_path):
    """An in-place run replaces shards that are still mapped (their names are deleted or
    renamed over): every later read (the next shard's tensors, the verification's originals)
    must see the original bytes, so the in-place files hold exactly what a run to another
    folder writes."""
    index, spec = write_sharded_mlp(tmp_path)
    originals = _sharded_tensors(index)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "-o", elsewhere / index.name, "-q"), 0)
    assert_clean_exit(invoke("rescale", index, "--arch", spec, "--in-place", "-q"), 0)
    in_place, expected = _sharded_tensors(index), _sharded_tensors(elsewhere / index.name)
    assert in_place.keys() == expected.keys() == originals.keys()
    assert all(torch.equal(in_place[key], expected[key]) for key in expected)
    assert not torch.equal(in_place["fc1.weight"], originals["fc1.weight"]), "nothing was rescaled"


def test_safetensors_tensors_are_mapped_and_onnx_parameters_stay_a_dict(tmp_path):
    """A safetensors checkpoint is read tensor by tensor when used (writing to a tensor never
    reaches the file), the values the loader's check read held for the analysis until it lets
    them go; an ONNX model's parameters stay a dict (the loader adds copies of shared
    initializers to it)."""
    checkpoint, spec = write_mlp(tmp_path)
    model = pathcond_cli.model_files.load(checkpoint, arch=str(spec))
    assert isinstance(model.params, HeldValues)
    release_held(model.params)
    weight = model.params["fc1.weight"]
    weight.mul_(2)
    assert torch.equal(safetensors.torch.load_file(str(checkpoint))["fc1.weight"], mlp_tensors()["fc1.weight"])
    onnx_model = pathcond_cli.model_files.load(write_onnx_mlp(tmp_path / "net.onnx"))
    assert type(onnx_model.params) is dict
