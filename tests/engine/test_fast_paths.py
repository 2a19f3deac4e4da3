"""The shortcuts that make ``pathcond rescale`` fast on large models keep every guarantee.

- ONNX shape inference runs on a copy without the weights' data: the shapes it infers and
  the tensors the importer then reads are those of the whole model.
- onnx's checker reads the bytes the model was parsed from: invalid models are refused from a
  file and from stdin alike, and text-format models are still read as text.
- onnxruntime evaluates the written file without graph optimisations: it still tells a
  corrupted file from a correct one.
- The written file is read back from disk and compared with the original: a file that goes
  wrong on its way to disk is caught (exit 5) and nothing is left behind.
- The storage check's one-reduction fast path counts exactly what the element-wise count does.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from cli_support import assert_clean_exit, assert_unchanged, invoke, onnx_mlp_model, snapshot, write_onnx_mlp
from onnx import numpy_helper
from onnx_models import export
from torch import nn

import pathcond_cli.io.formats.onnx_format as onnx_format
import pathcond_cli.io.formats.onnx_read as onnx_read
from pathcond_cli.errors import InputError
from pathcond_cli.io.formats import load_model
from pathcond_cli.solve.dtype_limits import StorageCheck, check_storage
from pathcond_cli.verify import independent_check


class _ViewNet(nn.Module):
    """Weights above the stripping threshold and a ``view(x.size(0), -1)`` whose shape is computed."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 48, 3, padding=1)
        self.fc = nn.Linear(48 * 4 * 4, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.size(0), -1))


def _view_net_onnx() -> onnx.ModelProto:
    torch.manual_seed(0)
    data = export(_ViewNet().eval(), torch.randn(2, 3, 4, 4), "torchscript-unfolded")
    model = onnx.load_from_string(data)
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer}
    assert max(sizes.values()) > onnx_read.SHAPE_DATA_MAX_ELEMENTS, "the weights must be stripped"
    assert any(n.op_type == "Shape" for n in model.graph.node), "the reshape target must be computed"
    return model


def test_shape_inference_without_the_weights_is_the_inference_of_the_whole_model():
    model = _view_net_onnx()
    graph_input = model.graph.input[0]
    inferred = onnx_read.infer_shapes(model, {graph_input.name: (3, 4, 4)}, "view.onnx", batch=2)

    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    dims = whole.graph.input[0].type.tensor_type.shape.dim
    del dims[:]
    for d in (2, 3, 4, 4):
        dims.add().dim_value = d
    del whole.graph.value_info[:]
    for output in whole.graph.output:
        output.type.tensor_type.ClearField("shape")
    expected = onnx.shape_inference.infer_shapes(whole, check_type=True, strict_mode=True, data_prop=True)

    assert inferred == expected
    assert list(inferred.graph.initializer) == list(model.graph.initializer), "every weight is put back, bit for bit"
    assert onnx_read.value_shapes(inferred)[model.graph.output[0].name] == (2, 40)


def test_a_model_with_computed_shapes_and_large_weights_loads_exactly(tmp_path):
    model = _view_net_onnx()
    path = tmp_path / "view.onnx"
    onnx.save_model(model, str(path))
    loaded = load_model(path)
    for tensor in model.graph.initializer:
        assert torch.equal(loaded.params[tensor.name], torch.from_numpy(numpy_helper.to_array(tensor).copy()))
    assert torch.equal(
        load_model(path.read_bytes()).params[model.graph.initializer[0].name],
        loaded.params[model.graph.initializer[0].name],
    )


def _unchecked_model() -> onnx.ModelProto:
    """A model onnx's checker refuses (a node reads a value nothing produces) but protobuf parses."""
    model = onnx_mlp_model()
    model.graph.node[1].input[0] = "nowhere"
    return model


def test_the_checker_still_refuses_an_invalid_model_from_a_file_and_from_bytes(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(_unchecked_model().SerializeToString())
    for source in (path, path.read_bytes()):
        with pytest.raises(InputError, match="is not a valid ONNX model"):
            load_model(source)


def test_a_text_format_model_is_read_as_text(tmp_path):
    model = onnx_mlp_model()
    binary, text = tmp_path / "mlp.onnx", tmp_path / "mlp.textproto"
    onnx.save_model(model, str(binary))
    onnx.save_model(model, str(text), format="textproto")
    assert not text.read_bytes().startswith(binary.read_bytes()[:8])
    from_binary, from_text = load_model(binary), load_model(text)
    assert from_text.params.keys() == from_binary.params.keys()
    assert all(torch.equal(from_text.params[k], from_binary.params[k]) for k in from_binary.params)


def _scaled_copy(source, destination, key: str, factor: float) -> None:
    model = onnx.load(str(source))
    tensor = next(t for t in model.graph.initializer if t.name == key)
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), key))
    onnx.save_model(model, str(destination))


def test_onnxruntime_without_graph_optimisations_tells_a_corrupted_file_from_a_correct_one(tmp_path):
    pytest.importorskip("onnxruntime")
    original = write_onnx_mlp(tmp_path / "net.onnx")
    model = load_model(original)
    same, corrupted = tmp_path / "same.onnx", tmp_path / "corrupted.onnx"
    _scaled_copy(original, same, "fc2.weight", 1.0)
    _scaled_copy(original, corrupted, "fc2.weight", 1.001)
    passed = independent_check(model, same, 1e-5)
    assert passed["runtime"] == "onnxruntime" and passed["status"] == "passed", passed
    failed = independent_check(model, corrupted, 1e-5)
    assert failed["runtime"] == "onnxruntime" and failed["status"] == "failed", failed


def test_a_file_that_goes_wrong_on_its_way_to_disk_is_caught_exit_5(tmp_path, monkeypatch):
    """The rescaling in memory is right; the bytes on disk are not (one weight off by 0.1 %)."""
    real_write = onnx_format.write_onnx

    def write_then_corrupt(model, changed, destination, metadata, **options):
        real_write(model, changed, destination, metadata, **options)
        _scaled_copy(destination, destination, "fc2.weight", 1.001)

    monkeypatch.setattr(onnx_format, "write_onnx", write_then_corrupt)
    model = write_onnx_mlp(tmp_path / "net.onnx")
    before = snapshot(tmp_path)
    result = invoke("rescale", model, "-o", tmp_path / "out.onnx")
    assert_clean_exit(result, 5, "differs from the original", "nothing was written")
    assert_unchanged(tmp_path, before)


def _counted(original: torch.Tensor, new: torch.Tensor) -> StorageCheck | None:
    """The element-wise count of overflowed and flushed values, the definition the check implements."""
    tiny = torch.finfo(new.dtype).tiny
    overflowed = int((torch.isfinite(original) & ~torch.isfinite(new)).sum())
    was_normal = original.abs() >= tiny
    flushed = int((was_normal & (new.abs() < tiny)).sum())
    if not (overflowed or flushed):
        return None
    return StorageCheck("t", new.dtype, new.numel(), overflowed, flushed, int(was_normal.sum()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_storage_check_fast_path_counts_what_the_element_wise_count_does(dtype):
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=generator, dtype=torch.float64).to(dtype)
    cases = {
        "all normal": base * 3,
        "zeros kept": torch.where(torch.arange(64) % 5 == 0, 0.0, base.double()).to(dtype),
        "one overflow": base.double().index_fill(0, torch.tensor([3]), float(info.max) * 4).to(dtype),
        "one NaN": base.double().index_fill(0, torch.tensor([7]), math.nan).to(dtype),
        "flushed": (base.double() * float(info.tiny) / 8).to(dtype),
        "one subnormal": base.double().index_fill(0, torch.tensor([9]), float(info.tiny) / 2).to(dtype),
    }
    for name, new in cases.items():
        expected = _counted(base, new)
        assert check_storage({"t": base}, {"t": new}) == ([] if expected is None else [expected]), name
