"""Data movement between layers (issue 37, point 4; review findings 3 and 4).

* An activation applied in NHWC between two Transposes is element-wise: it ties nothing. The
  engine holds the ids of such tensors per element and ties a channel into one scale only where
  a reader needs it (a Conv, a pooling): the groups are exactly the neuron-level freedom found by
  brute-force (tests/oracle.py), a random rescaling within them keeps the function, and an NHWC
  network gets the groups and D of its NCHW twin.
* A rearrange is a strided view (a few numbers) whenever the movement is one, so an NHWC network
  at 128×128 has a spec of a few hundred bytes that pathcond reads back; the view is checked
  against the torch operations it stands for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from cli_support import assert_clean_exit, invoke
from onnx import TensorProto, helper, numpy_helper
from oracle import build_neuron_dag, torch_forward
from safetensors.torch import save_file

from pathcond_cli.engine.graph import Add, Conv, Flatten, Graph, Input, Linear, Rearrange, ReLU
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.io.formats.movement import movement_layer
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.spec import graph_from_spec, node_from_layer, parse_spec_text, spec_from_graph, spec_text

RNG = np.random.default_rng(3)


def _rearrange(name: str, source: str, layer: dict) -> Rearrange:
    assert layer["type"] == "rearrange", layer
    return Rearrange(name, (source,), **{k: v for k, v in layer.items() if k != "type"})


def _moved(shape: tuple[int, ...], move) -> tuple[dict, torch.Tensor]:
    """The layer ``movement_layer`` reads off ``move`` applied to a batch-free ``shape``, and the
    index torch's own ``move`` gives (the oracle)."""
    index = move(torch.arange(int(np.prod(shape))).reshape(1, *shape))
    return movement_layer(shape, index), index[0]


# --------------------------------------------------------------------------- groups: brute force


def _nhwc_graph(*, residual: bool) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Conv → NHWC → ReLU (→ + the NHWC input, broadcast-free) → NCHW → Conv → ReLU → NHWC flatten → Linear."""
    to_nhwc = movement_layer((2, 3, 3), torch.arange(18).reshape(1, 2, 3, 3).permute(0, 2, 3, 1))
    to_nchw = movement_layer((3, 3, 2), torch.arange(18).reshape(1, 3, 3, 2).permute(0, 3, 1, 2))
    flat_nhwc = movement_layer((3, 3, 3), torch.arange(27).reshape(1, 3, 3, 3).permute(0, 2, 3, 1).reshape(1, -1))
    nodes = [
        Input("x", shape=(2, 3, 3)),
        Conv("c1", ("x",), weight="c1.w", bias="c1.b", stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
        _rearrange("t1", "c1", to_nhwc),
        ReLU("r1", ("t1",)),
    ]
    last = "r1"
    if residual:
        nodes += [_rearrange("xt", "x", to_nhwc), Add("sum", ("r1", "xt")), ReLU("r1b", ("sum",))]
        last = "r1b"
    nodes += [
        _rearrange("t2", last, to_nchw),
        Conv("c2", ("t2",), weight="c2.w", bias="c2.b", stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
        ReLU("r2", ("c2",)),
        _rearrange("flat", "r2", flat_nhwc),
        Linear("fc", ("flat",), weight="fc.w", bias="fc.b"),
    ]
    generator = torch.Generator().manual_seed(11)
    shapes = {"c1.w": (2, 2, 3, 3), "c1.b": (2,), "c2.w": (3, 2, 3, 3), "c2.b": (3,), "fc.w": (2, 27), "fc.b": (2,)}
    params = {key: torch.randn(shape, generator=generator, dtype=torch.float64) for key, shape in shapes.items()}
    return Graph(nodes, ("fc",)), params


@pytest.mark.parametrize("residual", [False, True], ids=["relu", "relu-and-sum"])
def test_an_nhwc_activation_ties_nothing_and_groups_are_the_neurons_own(residual):
    graph, params = _nhwc_graph(residual=residual)
    dag = build_neuron_dag(graph, params)
    assert dag.forward_check(params) < 1e-12
    groups = build_groups(graph, params)
    dag.group_columns(groups)  # the engine's partition into groups is the brute-force one, neuron by neuron
    # Every channel of c1 and c2 is its own group, unless the sum with the input fixes c1's.
    assert groups.num_free == (3 if residual else 2 + 3)


@pytest.mark.parametrize("residual", [False, True], ids=["relu", "relu-and-sum"])
def test_a_random_rescaling_within_the_groups_keeps_the_function(residual):
    graph, params = _nhwc_graph(residual=residual)
    groups = build_groups(graph, params)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    changed = groups.apply(params, u)
    assert len(changed) > 0
    rescaled = {**params, **changed}
    x = torch.randn(5, 2, 3, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    before, after = torch_forward(graph, params, x)["fc"], torch_forward(graph, rescaled, x)["fc"]
    assert float((after - before).abs().max()) <= 1e-10 * float(before.abs().max())


def _random_chain_graph(seed: int) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Conv → a random chain of transposes, reshapes, gathers and ReLUs (each movement read by
    movement_layer, as the importers read it) → reshape to channels → Conv → ReLU → flatten → Linear."""
    rnd = np.random.default_rng(seed)
    nodes: list = [
        Input("x", shape=(2, 2, 3)),
        Conv("c1", ("x",), weight="c1.w", bias="c1.b", stride=(1, 1), padding=(0, 0), dilation=(1, 1)),
    ]
    shape, current = (4, 2, 3), "c1"

    def move(name: str, moved: torch.Tensor) -> None:
        nonlocal shape, current
        layer = movement_layer(shape, moved)
        if layer is not None:
            nodes.append(node_from_layer({"name": name, "inputs": [current], **layer}, source="chain"))
            current = name
        shape = tuple(moved.shape[1:])

    for step in range(4):
        index = torch.arange(int(np.prod(shape))).reshape(1, *shape)
        kind = rnd.choice(["transpose", "reshape", "gather", "relu"])
        if kind == "transpose":
            move(f"m{step}", index.permute(0, *(1 + rnd.permutation(len(shape)))))
        elif kind == "reshape":
            size = int(np.prod(shape))
            first = int(rnd.choice([d for d in range(1, size + 1) if size % d == 0]))
            move(f"m{step}", index.reshape(1, first, size // first))
        elif kind == "gather":
            axis = int(rnd.integers(len(shape)))
            move(f"m{step}", index.index_select(1 + axis, torch.as_tensor(rnd.integers(shape[axis], size=shape[axis]))))
        else:
            nodes.append(ReLU(f"m{step}", (current,)))
            current = f"m{step}"
    size = int(np.prod(shape))
    move("to_channels", torch.arange(size).reshape(1, *shape).reshape(1, 3, size // 3))
    nodes += [
        Conv("c2", (current,), weight="c2.w", bias="c2.b", stride=(1,), padding=(0,), dilation=(1,)),
        ReLU("r2", ("c2",)),
        Flatten("flat", ("r2",)),
        Linear("fc", ("flat",), weight="fc.w", bias="fc.b"),
    ]
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "c1.w": (4, 2, 1, 1),
        "c1.b": (4,),
        "c2.w": (2, 3, 1),
        "c2.b": (2,),
        "fc.w": (2, 2 * size // 3),
        "fc.b": (2,),
    }
    params = {key: torch.randn(shape, generator=generator, dtype=torch.float64) for key, shape in shapes.items()}
    return Graph(nodes, ("fc",)), params


@pytest.mark.parametrize("seed", range(8))
def test_random_movement_chains_have_the_brute_force_groups_and_keep_the_function(seed):
    graph, params = _random_chain_graph(seed)
    dag = build_neuron_dag(graph, params)
    assert dag.forward_check(params) < 1e-12
    groups = build_groups(graph, params)
    dag.group_columns(groups)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rescaled = {**params, **groups.apply(params, u)}
    x = torch.randn(4, 2, 2, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    before, after = torch_forward(graph, params, x)["fc"], torch_forward(graph, rescaled, x)["fc"]
    assert float((after - before).abs().max()) <= 1e-10 * float(before.abs().max())


# --------------------------------------------------------------------------- NHWC and NCHW twins in ONNX


def _twin(path: Path, nhwc: bool, size: int = 5) -> Path:
    """One CNN, written NCHW or as tf2onnx writes it unoptimised (every Conv wrapped in Transposes,
    the ReLU in NHWC, the flatten in H, W, C order): the same function, the MatMul's rows permuted."""
    rng = np.random.default_rng(8)
    channels = [3, 4, 5]
    initializer = []
    nodes = []
    current = "x"
    if nhwc:
        nodes.append(helper.make_node("Transpose", [current], ["x_nchw"], perm=[0, 3, 1, 2]))
        current = "x_nchw"
    for i in range(2):
        initializer += [
            numpy_helper.from_array(rng.normal(size=(channels[i + 1], channels[i], 3, 3)).astype(np.float32), f"k{i}"),
            numpy_helper.from_array(rng.normal(size=channels[i + 1]).astype(np.float32), f"b{i}"),
        ]
        nodes.append(helper.make_node("Conv", [current, f"k{i}", f"b{i}"], [f"conv{i}"], pads=[1, 1, 1, 1]))
        current = f"conv{i}"
        if nhwc:
            nodes.append(helper.make_node("Transpose", [current], [f"conv{i}_nhwc"], perm=[0, 2, 3, 1]))
            current = f"conv{i}_nhwc"
        nodes.append(helper.make_node("Relu", [current], [f"relu{i}"]))
        current = f"relu{i}"
        if nhwc and i == 0:
            nodes.append(helper.make_node("Transpose", [current], ["relu0_nchw"], perm=[0, 3, 1, 2]))
            current = "relu0_nchw"
    features = channels[-1] * size * size
    weight = rng.normal(size=(features, 2)).astype(np.float32)
    if nhwc:  # row (h, w, c) of the NHWC flatten is row (c, h, w) of the NCHW one
        weight = weight.reshape(channels[-1], size, size, 2).transpose(1, 2, 0, 3).reshape(features, 2)
    initializer += [
        numpy_helper.from_array(np.asarray([-1, features], dtype=np.int64), "flat_shape"),
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(rng.normal(size=2).astype(np.float32), "wb"),
    ]
    nodes += [
        helper.make_node("Reshape", [current, "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "wb"], ["y"]),
    ]
    shape = ["N", size, size, 3] if nhwc else ["N", 3, size, size]
    graph = helper.make_graph(
        nodes,
        "twin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        initializer,
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_an_nhwc_network_gets_the_groups_and_d_of_its_nchw_twin(tmp_path):
    nchw, nhwc = _twin(tmp_path / "nchw.onnx", False), _twin(tmp_path / "nhwc.onnx", True)
    x = RNG.normal(size=(4, 3, 5, 5)).astype(np.float32)
    x_nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    np.testing.assert_allclose(_run(nhwc, x_nhwc), _run(nchw, x), rtol=1e-5, atol=1e-5)  # twins indeed

    groups = {
        name: build_groups(load_onnx(str(path)).graph, load_onnx(str(path)).params)
        for name, path in (("nchw", nchw), ("nhwc", nhwc))
    }
    assert groups["nhwc"].num_free == groups["nchw"].num_free == 4 + 5
    reports = {}
    for name, path, feed in (("nchw", nchw, x), ("nhwc", nhwc, x_nhwc)):
        out = tmp_path / f"{name}.rescaled.onnx"
        result = invoke("rescale", path, "-o", out, "--json")
        assert_clean_exit(result, 0)
        reports[name] = json.loads(result.stdout)
        assert reports[name]["verification"]["passed"]
        before, after = _run(path, feed), _run(out, feed)
        assert float(np.abs(after - before).max()) <= 1e-4 * float(np.abs(before).max())
    for phase in ("before", "after"):
        d_nchw, d_nhwc = (reports[name]["conditioning"][phase]["D"] for name in ("nchw", "nhwc"))
        assert d_nhwc == pytest.approx(d_nchw, rel=1e-6)
    assert reports["nhwc"]["conditioning"]["after"]["D"] <= reports["nhwc"]["conditioning"]["before"]["D"]


# --------------------------------------------------------------------------- representation


@pytest.mark.parametrize(
    "shape, move",
    [
        ((4, 6, 5), lambda t: t.permute(0, 2, 3, 1)),  # NCHW → NHWC
        ((4, 6, 5), lambda t: t.permute(0, 2, 3, 1).reshape(len(t), -1)),  # NHWC flatten
        ((60,), lambda t: t.reshape(len(t), 3, 4, 5).permute(0, 1, 3, 2)),  # unflatten, then a transpose
        ((4, 6, 5), lambda t: t.permute(0, 3, 2, 1)[:, ::2, 1:].flip(3).reshape(len(t), 3, -1)),  # steps and a flip
        ((2, 4, 4), lambda t: torch.cat([t] * 3, dim=2).permute(0, 2, 1, 3)),  # a repeat (stride 0)
    ],
    ids=["nhwc", "nhwc-flatten", "unflatten-transpose", "stepped-slices", "repeat"],
)
def test_a_chain_of_views_is_a_strided_rearrange_that_copies_what_torch_does(shape, move):
    layer, expected = _moved(shape, move)
    assert not layer.get("elements") and len(layer["sizes"]) <= 4
    node = _rearrange("r", "x", layer)
    assert torch.equal(node.index, expected)
    x = torch.randn(3, *shape, dtype=torch.float64)
    graph = Graph([Input("x", shape=shape), node], ("r",))
    assert torch.equal(torch_forward(graph, {}, x)["r"], move(x))  # the oracle's reading of the fields


def test_a_gather_is_listed_element_by_element():
    picked = torch.tensor([3, 0, 0, 2])
    layer, expected = _moved((2, 3, 4), lambda t: t.permute(0, 2, 3, 1)[:, :, picked])
    assert layer["elements"] and "sizes" not in layer
    assert torch.equal(_rearrange("r", "x", layer).index, expected)


def test_an_nhwc_network_at_128_pixels_has_a_small_spec_that_reads_back():
    to_nhwc = movement_layer((32, 128, 128), torch.arange(32 * 128 * 128).reshape(1, 32, 128, 128).permute(0, 2, 3, 1))
    graph = Graph([Input("x", shape=(32, 128, 128)), _rearrange("t", "x", to_nhwc), ReLU("r", ("t",))], ("r",))
    text = spec_text(spec_from_graph(graph))
    assert len(text) < 1000
    assert graph_from_spec(parse_spec_text(text, source="nhwc.yaml"), source="nhwc.yaml") == graph


@pytest.mark.parametrize(
    "fields, phrase",
    [
        ("shape: [2, 3], sizes: [3, 2], strides: [1], offset: 0", "one stride per size"),
        ("shape: [2, 3], sizes: [6], strides: [1], elements: [0, 1, 2, 3, 4, 5]", "two forms"),
        ("shape: [2, 3], elements: [0, 1, 2]", "not one per element"),
        ("shape: [2, 3], sizes: [6], strides: [2], offset: 0", "not all among the input's 6"),
    ],
    ids=["strides", "two-forms", "elements", "out-of-range"],
)
def test_a_rearrange_that_is_not_one_copy_per_element_is_refused_naming_it(tmp_path, fields, phrase):
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "format_version: 1\nlayers:\n  - {name: x, type: input, shape: [6]}\n"
        f"  - {{name: moved, type: rearrange, {fields}}}\n  - {{name: r, type: relu}}\n"
        "  - {name: f, type: flatten}\n  - {name: fc, type: linear}\n"
    )
    checkpoint = tmp_path / "bad.safetensors"
    save_file({"fc.weight": torch.ones(2, 6), "fc.bias": torch.zeros(2)}, str(checkpoint))
    result = invoke("inspect", checkpoint, "--arch", spec)
    assert result.exit_code not in (0, 1), result.stdout
    assert "moved" in result.stderr and phrase in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
