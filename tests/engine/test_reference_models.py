"""Checks of the reference architectures in ``tests/reference_models.py``.

Default run (fast): Table-1 parameter and hidden-unit counts of the six large
models (built on CPU, no 224x224 forward pass), forward passes and fx tracing of
the small models, CIFAR-NV and the MLPs. ``-m slow``: 224x224 forward passes of
the ImageNet models, compared with their fx-traced versions.
"""

from __future__ import annotations

import operator
from typing import Dict

import pytest
import torch
import torch.fx as fx
from torch import nn

try:  # tests/ may or may not be a package
    from . import reference_models as rm
except ImportError:  # pragma: no cover - depends on how pytest imports tests/
    import reference_models as rm


LARGE = tuple(rm.TABLE1)
IMAGENET = ("resnet18", "resnet34", "resnet50", "alexnet", "vgg16")

_cache: Dict[str, nn.Module] = {}


def _build(name: str, seed: int = 0) -> nn.Module:
    """Build once per session (VGG-16 takes seconds and ~0.5 GiB)."""
    if name not in _cache:
        torch.manual_seed(seed)
        _cache[name] = rm.REFERENCE_MODELS[name][0]()
    return _cache[name]


def _leaf_calls(gm: fx.GraphModule):
    return [n for n in gm.graph.nodes if n.op == "call_module"]


def _check_trace(model: nn.Module) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    targets = [n.target for n in _leaf_calls(gm)]
    dup = sorted({t for t in targets if targets.count(t) > 1})
    assert not dup, f"module instances called more than once: {dup}"
    return gm


# ---------------------------------------------------------------- Table 1


@pytest.mark.parametrize("name", LARGE)
def test_table1_counts_and_trace(name):
    model = _build(name)
    params, hidden = rm.TABLE1[name]
    _, _, exp_p, exp_h = rm.REFERENCE_MODELS[name]
    assert (exp_p, exp_h) == (params, hidden)
    assert rm.count_parameters(model) == params
    assert sum(p.numel() for p in model.parameters()) == params
    assert rm.hidden_units(model) == hidden
    assert not model.training
    _check_trace(model)


@pytest.mark.parametrize("name", tuple(rm.TORCHVISION_COUNTS))
def test_torchvision_counts_and_trace(name):
    factory, shape, params, hidden = rm.REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = factory()
    assert (params, hidden) == rm.TORCHVISION_COUNTS[name]
    assert rm.count_parameters(model) == params
    assert rm.hidden_units(model) == hidden
    _check_trace(model)


@pytest.mark.parametrize("name", ("small_mnasnet", "small_inception_v3"))
def test_small_torchvision_style_models(name):
    factory, shape, _, _ = rm.REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = factory()
    gm = _check_trace(model)
    x = torch.randn(2, *shape)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
        assert model(x).shape == (2, 10)


def test_table1_values_are_the_papers():
    assert rm.TABLE1 == {
        "resnet18": (11_689_512, 4_800),
        "resnet34": (21_797_672, 8_512),
        "resnet50": (25_557_032, 26_560),
        "alexnet": (61_100_840, 9_344),
        "vgg16": (138_357_544, 12_416),
        "cifar_nv": (2_616_576, 1_792),
    }


def test_resnet_torchvision_layout():
    m18 = _build("resnet18")
    keys = set(m18.state_dict())
    for k in (
        "conv1.weight",
        "bn1.running_mean",
        "layer1.0.conv1.weight",
        "layer1.1.bn2.bias",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.running_var",
        "layer4.1.conv2.weight",
        "fc.weight",
        "fc.bias",
    ):
        assert k in keys, k
    assert "layer1.0.downsample.0.weight" not in keys  # identity skip in stage 1
    assert m18.conv1.kernel_size == (7, 7) and m18.conv1.stride == (2, 2)
    assert m18.conv1.bias is None
    assert isinstance(m18.maxpool, nn.MaxPool2d)
    assert m18.avgpool.output_size == (1, 1)

    m50 = _build("resnet50")
    blk = m50.layer2[0]
    assert isinstance(blk, rm.Bottleneck)
    # torchvision v1.5: the stride sits on the 3x3 conv
    assert blk.conv1.stride == (1, 1) and blk.conv2.stride == (2, 2)
    assert blk.downsample[0].stride == (2, 2)
    assert "layer1.0.downsample.0.weight" in m50.state_dict()  # 64 -> 256
    assert m50.fc.in_features == 2048


def test_vgg16_and_alexnet_layout():
    vgg = _build("vgg16")
    convs = [m for m in vgg.features if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    assert sum(isinstance(m, nn.MaxPool2d) for m in vgg.features) == 5
    assert vgg.avgpool.output_size == (7, 7)
    lin = [m for m in vgg.classifier if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in lin] == [(25088, 4096), (4096, 4096), (4096, 1000)]
    alex = _build("alexnet")
    convs = [m for m in alex.features if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 192, 384, 256, 256]
    assert alex.avgpool.output_size == (6, 6)
    lin = [m for m in alex.classifier if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in lin] == [(9216, 4096), (4096, 4096), (4096, 1000)]


# ---------------------------------------------------------------- CIFAR-NV


def test_cifar_nv_structure():
    m = _build("cifar_nv")
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [128, 128, 128, 256, 256, 256, 320, 320, 10]
    assert all(c.bias is None for c in convs)
    bns = [x for x in m.modules() if isinstance(x, nn.BatchNorm2d)]
    assert [b.num_features for b in bns] == [128, 256]
    conv_weights = sum(c.weight.numel() for c in convs)
    assert conv_weights == 2_615_808
    assert conv_weights + 2 * (128 + 256) == 2_616_576


@pytest.mark.parametrize("side", [32, 28])
def test_cifar_nv_forward(side):
    m = _build("cifar_nv")
    x = torch.randn(3, 3, side, side)
    gm = _check_trace(m)
    with torch.no_grad():
        y = m(x)
        assert y.shape == (3, 10)
        torch.testing.assert_close(gm(x), y)


def test_cifar_nv_final_bn_option():
    torch.manual_seed(0)
    m = rm.cifar_nv(final_bn=True)
    assert rm.count_parameters(m) == 2_616_576 + 20
    assert rm.hidden_units(m) == 1_792
    x = torch.randn(2, 3, 32, 32)
    gm = _check_trace(m)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))


# ---------------------------------------------------------------- MLPs


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_mlp(depth):
    torch.manual_seed(0)
    m = rm.mlp(depth)
    lin = [x for x in m.modules() if isinstance(x, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in lin] == ([(3072, 500)] + [(500, 500)] * (depth - 1) + [(500, 10)])
    assert all(l.bias is not None for l in lin)
    expected = 3073 * 500 + (depth - 1) * 501 * 500 + 501 * 10
    assert rm.count_parameters(m) == expected
    assert rm.hidden_units(m) == 500 * depth
    gm = _check_trace(m)
    with torch.no_grad():
        for x in (torch.randn(4, 3, 32, 32), torch.randn(4, 3072)):
            y = m(x)
            assert y.shape == (4, 10)
            torch.testing.assert_close(gm(x), y)


def test_mlp_default_init_is_pytorch_kaiming_uniform():
    torch.manual_seed(123)
    m = rm.mlp(2)
    torch.manual_seed(123)
    ref = [nn.Linear(3072, 500), nn.Linear(500, 500), nn.Linear(500, 10)]
    lin = [x for x in m.modules() if isinstance(x, nn.Linear)]
    for a, b in zip(lin, ref):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    # default nn.Linear bound: 1/sqrt(fan_in) (kaiming_uniform with a=sqrt(5))
    assert lin[0].weight.abs().max() <= 1 / 3072**0.5


# ---------------------------------------------------------------- small models


@pytest.mark.parametrize("name", rm.SMALL_MODELS)
def test_small_model_forward_and_trace(name):
    factory, shape, _, _ = rm.REFERENCE_MODELS[name]
    torch.manual_seed(0)
    m = factory()
    assert not m.training
    assert 0 < rm.count_parameters(m) < 100_000
    assert rm.hidden_units(m) > 0
    x = torch.randn(4, *shape)
    gm = _check_trace(m)
    with torch.no_grad():
        y = m(x)
        assert y.shape == (4, 10)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(gm(x), y)
    # non-trivial eval-mode BatchNorm state, so BN folding is exercised
    bns = [b for b in m.modules() if isinstance(b, nn.modules.batchnorm._BatchNorm)]
    if bns:
        assert all(not torch.allclose(b.running_var, torch.ones_like(b.running_var)) for b in bns)


@pytest.mark.parametrize("name", rm.SMALL_MODELS + ("cifar_nv", "mlp1"))
def test_deterministic_given_seed(name):
    factory = rm.REFERENCE_MODELS[name][0]
    torch.manual_seed(7)
    a = factory().state_dict()
    torch.manual_seed(7)
    b = factory().state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_small_resnet_has_identity_and_projection_skips():
    torch.manual_seed(0)
    m = rm.small_resnet()
    blocks = [b for b in m.modules() if isinstance(b, rm.BasicBlock)]
    assert len(blocks) == 3
    assert any(b.downsample is None for b in blocks)
    proj = [b for b in blocks if b.downsample is not None]
    assert len(proj) == 1 and proj[0].downsample[0].stride == (2, 2)
    assert isinstance(proj[0].downsample[1], nn.BatchNorm2d)
    gm = fx.symbolic_trace(m)
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]
    assert len(adds) == 3
    # width / in_channels / num_classes knobs
    m2 = rm.small_resnet(in_channels=1, num_classes=3, width=4)
    assert m2(torch.randn(2, 1, 16, 16)).shape == (2, 3)


def test_small_bottleneck_resnet_structure():
    torch.manual_seed(0)
    m = rm.small_bottleneck_resnet()
    blocks = [b for b in m.modules() if isinstance(b, rm.Bottleneck)]
    assert len(blocks) == 2
    assert blocks[0].downsample is not None and blocks[1].downsample is None
    assert blocks[0].conv3.out_channels == 4 * blocks[0].conv1.out_channels


def _call_functions(m: nn.Module):
    return [n for n in fx.symbolic_trace(m).graph.nodes if n.op == "call_function"]


def test_small_densenet_structure():
    torch.manual_seed(0)
    m = rm.small_densenet()
    cats = [n for n in _call_functions(m) if n.target is torch.cat]
    assert len(cats) == 6
    assert any(isinstance(x, nn.AvgPool2d) for x in m.modules())


def test_small_inception_structure():
    torch.manual_seed(0)
    m = rm.small_inception()
    cats = [n for n in _call_functions(m) if n.target is torch.cat]
    assert len(cats) == 2 and all(len(n.args[0]) == 3 for n in cats)


def test_grouped_conv_net_structure():
    torch.manual_seed(0)
    m = rm.grouped_conv_net()
    convs = [c for c in m.modules() if isinstance(c, nn.Conv2d)]
    assert any(c.groups == 2 for c in convs)
    assert any(c.groups == c.in_channels == c.out_channels > 1 for c in convs)
    assert any(isinstance(x, nn.LeakyReLU) for x in m.modules())
    assert not any(isinstance(x, nn.ReLU) for x in m.modules())


def test_conv1d_net_structure():
    torch.manual_seed(0)
    m = rm.conv1d_net()
    kinds = {type(x) for x in m.modules()}
    assert {nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AdaptiveAvgPool1d} <= kinds


def test_hidden_units_helper():
    m = nn.Sequential(
        nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv1d(5, 7, 1), nn.Flatten(), nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 2)
    )
    assert rm.hidden_units(m) == 5 + 7 + 11
    assert rm.hidden_units(nn.Sequential(nn.ReLU())) == 0
    assert rm.hidden_units(nn.Linear(4, 3)) == 0


def test_registry_shapes():
    for name, (factory, shape, params, hidden) in rm.REFERENCE_MODELS.items():
        assert callable(factory)
        if name in IMAGENET or name == "mnasnet0_5":
            assert shape == (3, 224, 224)
        elif name == "inception_v3":
            assert shape == (3, 299, 299)
        elif name == "small_inception_v3":
            assert shape == (3, 75, 75)
        elif name != "conv1d_net":
            assert shape == (3, 32, 32)
        assert (params is None) == (hidden is None)


# ---------------------------------------------------------------- slow


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGENET)
def test_imagenet_forward_224(name):
    m = _build(name)
    x = torch.randn(2, 3, 224, 224)
    gm = fx.symbolic_trace(m)
    with torch.no_grad():
        y = m(x)
        assert y.shape == (2, 1000)
        torch.testing.assert_close(gm(x), y)
