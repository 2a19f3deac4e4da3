"""Non-homogeneous networks are refused with exit 4 and every offender, grouped by operation,
by all three importers (fx, ONNX from the TorchScript and the torch.export exporter)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx_models import export

from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.io.formats.fx_import import graph_from_module
from pathcond_cli.io.formats.onnx_format import load_onnx


class ViTBlock(nn.Module):
    """Patch embedding, pre-norm attention and GELU MLP with residuals, mean pooling, head."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        b, n, c = tokens.shape
        q, k, v = self.qkv(self.norm1(tokens)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(dim=-1)
        tokens = tokens + self.proj((attention @ v).transpose(1, 2).reshape(b, n, c))
        tokens = tokens + self.mlp(self.norm2(tokens))
        return self.head(tokens.mean(1))


class MobileV3Block(nn.Module):
    """Hardswish, ReLU6, SiLU and a squeeze-excitation sigmoid gate."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish())
        self.expand = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU6())
        self.squeeze = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 4, 1), nn.SiLU(), nn.Conv2d(4, 16, 1), nn.Sigmoid()
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        y = self.expand(self.stem(x))
        y = y * self.squeeze(y)
        return self.head(y.mean((2, 3)))


CASES = {
    "vit": (
        ViTBlock,
        (3, 8, 8),
        {"fx": ["LayerNorm ×2", "GELU ×1", "softmax"], "onnx": ["LayerNormalization ×2", "Softmax ×1", "MatMul"]},
    ),
    "mobilenet_v3": (
        MobileV3Block,
        (3, 6, 6),
        {"fx": ["Hardswish ×1", "ReLU6 ×1", "SiLU ×1", "Sigmoid ×1", "mul ×1"], "onnx": ["Sigmoid", "Mul"]},
    ),
}


def _check(error: UnsupportedModelError, expected: list[str]) -> None:
    assert error.exit_code == 4
    message = str(error)
    for fragment in expected:
        assert fragment in message, fragment
    assert "not positively homogeneous" in message


@pytest.mark.parametrize("name", sorted(CASES))
def test_fx_refuses_with_every_offender_grouped(name):
    factory, shape, expected = CASES[name]
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(factory().eval(), shape, source=name)
    _check(info.value, expected["fx"])


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_refuses_with_every_offender_grouped(name, exporter):
    factory, shape, expected = CASES[name]
    data = export(factory().eval(), torch.randn(2, *shape), exporter)
    with pytest.raises(UnsupportedModelError) as info:
        load_onnx(data, name=f"{name}.onnx")
    _check(info.value, expected["onnx"])


# -- a refusal of many non-homogeneous nodes fits a screen and says why once --------


def _clipped_chain(count: int) -> onnx.ModelProto:
    """A MobileNetV2-like chain: ``count`` 1×1 convolutions, each followed by Clip(0, 6) (ReLU6)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, tensors, value = [], [], "x"
    low = numpy_helper.from_array(np.array(0, np.float32), "low")
    high = numpy_helper.from_array(np.array(6, np.float32), "high")
    for i in range(count):
        tensors.append(numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", [value, f"w{i}"], [f"c{i}"], name=f"features.{i}.conv"))
        nodes.append(helper.make_node("Clip", [f"c{i}", "low", "high"], [f"r{i}"], name=f"features.{i}.relu6"))
        value = f"r{i}"
    # A layer after the last Clip: after the last layer it would be post-processing.
    tensors.append(numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "head"))
    nodes.append(helper.make_node("Conv", [value, "head"], ["y"], name="head"))
    graph = helper.make_graph(
        nodes,
        "clipped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 3, 3])],
        [low, high, *tensors],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_thirty_five_relu6_are_refused_within_a_screen_with_the_reason_once(tmp_path):
    from cli_support import assert_clean_exit, assert_unchanged, invoke, snapshot

    path = tmp_path / "mobilenet_like.onnx"
    onnx.save_model(_clipped_chain(35), str(path))
    before = snapshot(tmp_path)
    stderr = assert_clean_exit(
        invoke("rescale", path, "-o", tmp_path / "out.onnx"),
        4,
        "Clip ×35",
        "node 'features.0.relu6'",
        "and 31 more",
        "upper bound",
        "replace each listed operation by ReLU",
    )
    assert_unchanged(tmp_path, before)
    assert stderr.lower().count("not positively homogeneous") == 1, stderr
    assert "features.34.relu6" not in stderr
    # within a screen: 25 lines of an 80-column terminal
    assert sum(max(1, -(-len(line) // 80)) for line in stderr.strip().splitlines()) <= 25, stderr
