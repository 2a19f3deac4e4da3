"""A safetensors tensor's bytes are read only by a pass that needs its values (issue 28, point 1).

Shapes, dtypes and key membership come from the file's header. 0.5.0 answered them by reading
the tensors: 290 reads of 8 tensors for one `rescale` of a 200 MB MLP. The values the loader's
finiteness check reads are held for the analysis (within a budget: ``engine.layouts.HeldValues``),
so that the analysis's passes share that read. Every read of a checkpoint tensor goes through
``MappedTensors.__getitem__`` (one ``pread``); it is counted here per file and tensor.
``benchmarks/bench_reads.py`` prints the same counts and their sites.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch
from cli_support import assert_clean_exit, invoke, mlp_tensors, write_mlp, write_sharded_mlp

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.evaluate import infer_shapes
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.layouts import release_held, stand_ins
from pathcond_cli.io.formats import check_weight_types
from pathcond_cli.io.formats.safetensors_format import MappedTensors, write_safetensors
from pathcond_cli.model_files import load

DIMS = (256, 512, 512, 256, 10)  # 2 MB of float32, 8 tensors

# The passes of a run that need each tensor's values: loading, the finiteness check, whose read
# is held for the analysis: laying out the groups (the biases), the balancing, diag(G)'s
# forward and backward sweeps (whose forward gives ℓ2) and the ℓ1 sweep read nothing more.
INSPECT_READS = 1
# rescale adds, on the input: the write (which computes each rescaled tensor once and checks it
# there) and the verifier's forward pass, which also answers the calibration check (2); on the
# written file, read back: the finiteness check, the verifier's forward pass, the groups
# (biases) and one sweep for its ℓ1 and ℓ2 path norms, on the analysis's balancing less u (its
# values are not held: held during the verification, they would raise the run's peak memory,
# test_memory_bound).
RESCALE_INPUT_READS = 3
RESCALE_WRITTEN_READS = 4


@pytest.fixture
def reads(monkeypatch) -> collections.Counter[tuple[str, str]]:
    counted: collections.Counter[tuple[str, str]] = collections.Counter()
    read = MappedTensors.__getitem__

    def counting(self, key):
        tensor = read(self, key)  # a missing key is a KeyError, no read
        counted[Path(self._path).name, key] += 1
        return tensor

    monkeypatch.setattr(MappedTensors, "__getitem__", counting)
    return counted


@pytest.fixture
def mlp(tmp_path) -> tuple[Path, Path]:
    return write_mlp(tmp_path, "mlp", dims=DIMS)


def per_file(reads: collections.Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    files: dict[str, dict[str, int]] = {}
    for (file, key), count in reads.items():
        files.setdefault(file, {})[key] = count
    return files


def test_loading_reads_each_tensor_once_for_its_finiteness(mlp, reads):
    checkpoint, spec = mlp
    load(checkpoint, arch=str(spec))
    assert dict(reads) == {("mlp.safetensors", key): 1 for key in mlp_tensors(DIMS)}


def test_shape_dtype_and_key_questions_read_nothing(mlp, reads, tmp_path):
    checkpoint, spec = mlp
    model = load(checkpoint, arch=str(spec))
    reads.clear()
    check_weight_types(model.graph, model.params, "mlp")
    model.graph.check_parameters(model.params, values=False)
    shapes = infer_shapes(model.graph, model.params)
    assert model.parameter_count == sum(t.numel() for t in mlp_tensors(DIMS).values())
    assert model.hidden_units == sum(DIMS[1:-1])
    assert "fc1.weight" in model.params and "fc9.weight" not in model.params
    assert model.params.get("fc9.weight") is None
    assert shapes["fc1"] == (DIMS[1],)
    assert not reads


def test_loading_holds_the_values_it_read_until_released(mlp, reads):
    checkpoint, spec = mlp
    model = load(checkpoint, arch=str(spec))
    reads.clear()
    analyse(model, device="cpu")
    assert not reads
    model.params["fc1.weight"]
    assert dict(reads) == {("mlp.safetensors", "fc1.weight"): 1}


def test_laying_out_the_groups_reads_the_biases_only(mlp, reads):
    checkpoint, spec = mlp
    model = load(checkpoint, arch=str(spec))
    release_held(model.params)
    reads.clear()
    build_groups(model.graph, model.params)
    assert {key for _, key in reads} == {f"fc{i}.bias" for i in range(1, len(DIMS))}


def test_written_header_comes_from_the_input_header(mlp, reads, tmp_path):
    checkpoint, spec = mlp
    model = load(checkpoint, arch=str(spec))
    release_held(model.params)
    reads.clear()
    write_safetensors(model, {}, tmp_path / "copy.safetensors", {})
    assert all(count == 1 for count in reads.values()) and len(reads) == len(mlp_tensors(DIMS))


def test_sharded_checkpoint_answers_from_its_shards_headers(tmp_path, reads):
    index, spec = write_sharded_mlp(tmp_path)
    model = load(index, arch=str(spec))
    reads.clear()
    layouts = stand_ins(model.params)
    assert tuple(layouts["fc2.weight"].shape) == (5, 8) and layouts["fc3.bias"].dtype == torch.float32
    assert "fc2.bias" in model.params and "nope" not in model.params
    assert not reads


def test_inspect_reads_each_tensor_once_per_pass(mlp, reads):
    checkpoint, spec = mlp
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec, "--quiet", "--device", "cpu"), 0)
    counts = per_file(reads)
    assert list(counts) == ["mlp.safetensors"]
    assert max(counts["mlp.safetensors"].values()) <= INSPECT_READS, counts


def test_rescale_reads_each_tensor_once_per_pass(mlp, reads, tmp_path):
    checkpoint, spec = mlp
    result = invoke(
        "rescale", checkpoint, "--arch", spec, "-o", tmp_path / "out.safetensors", "--quiet", "--device", "cpu"
    )
    assert_clean_exit(result, 0)
    counts = per_file(reads)
    assert max(counts["mlp.safetensors"].values()) <= RESCALE_INPUT_READS, counts
    assert max(counts["out.safetensors"].values()) <= RESCALE_WRITTEN_READS, counts
    # 0.5.0 read each tensor of each file about 36 times: most of those were shape questions.
    assert math.fsum(reads.values()) <= len(mlp_tensors(DIMS)) * (RESCALE_INPUT_READS + RESCALE_WRITTEN_READS)
