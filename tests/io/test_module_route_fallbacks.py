"""The module route checks the graph it read against the module itself, and falls back to
torch.export where torch.fx reads another function or refuses a call form (issue 37.7 review).

torch.fx takes ``isinstance`` tests on its proxies the wrong way and may trace a graph that
runs but skips a layer; the module's own forward, run on a random input, is the oracle that
catches it. Every operation the fx path reads is read on the torch.export path too (its ATen
form), checked against the module's forward in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import fake_cuda
import pytest
import safetensors.torch
import timm_like
import torch
import torch.nn as nn
import torch.nn.functional as F
from cli_support import assert_clean_exit, invoke

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import LeakyReLU, PReLU, Upsample
from pathcond_cli.errors import InputError, UnsupportedModelError, UsageError
from pathcond_cli.module_route import module_model, rescale_module


def _randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every floating-point tensor of the state drawn at random (seeded; variances positive), float64, eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                values = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
                tensor.copy_(values + 0.5 if name.endswith("running_var") else values * 2 - 0.8)
    return module.double().eval()


def _module_outputs_and_graph_outputs(module: nn.Module, shape: tuple[int, ...]):
    model = module_model(module, shape)
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (output,) = forward(model.graph, model.params, x).values()
    with torch.no_grad():
        expected = module(x)
    return model, output, expected


def _assert_reads_the_module(module: nn.Module, shape: tuple[int, ...]):
    model, output, expected = _module_outputs_and_graph_outputs(module, shape)
    assert torch.allclose(output, expected, rtol=1e-10, atol=1e-12), float((output - expected).abs().max())
    return model


# -- 1. a graph fx traced the wrong way is caught by the module's own forward ---------------------


class IsInstanceBranch(nn.Module):
    """``isinstance(y, torch.Tensor)`` is true when the module runs and false on an fx proxy:
    the graph fx traces runs, and skips ``c2``."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        if isinstance(y, torch.Tensor):
            y = torch.relu(self.c2(y))
        return self.c3(y)


def isinstance_branch() -> nn.Module:
    torch.manual_seed(0)
    return IsInstanceBranch()


def test_fx_skips_the_isinstance_branch_where_the_module_takes_it():
    """The premise: fx's graph runs and computes another function (else the tests below prove nothing)."""
    module = _randomized(IsInstanceBranch())
    traced = torch.fx.symbolic_trace(module)
    assert "c2" not in {node.target for node in traced.graph.nodes}
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(traced(x), module(x))


def test_a_graph_fx_traced_the_wrong_way_falls_back_to_torch_export():
    module = _randomized(IsInstanceBranch())
    model = _assert_reads_the_module(module, (3, 6, 6))
    assert {"c1.weight", "c2.weight", "c3.weight"} <= set(model.params)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        before = module(x)
    assert rescale_module(module, (3, 6, 6)).verification.passed
    with torch.no_grad():
        after = module(x)
    assert torch.allclose(after, before, rtol=1e-10, atol=1e-12)
    assert not torch.equal(module.c2.weight, _randomized(IsInstanceBranch()).c2.weight)  # c2 was rescaled too


def test_a_factory_fx_traces_the_wrong_way_writes_a_checkpoint_computing_the_module(tmp_path):
    """The user's module with the written checkpoint loaded is the oracle (the CLI said 'verified'
    for a checkpoint that changed the module's outputs by 11.6%)."""
    checkpoint, out = tmp_path / "ck.safetensors", tmp_path / "out.safetensors"
    safetensors.torch.save_file(isinstance_branch().state_dict(), str(checkpoint))
    assert_clean_exit(
        invoke(
            "rescale",
            checkpoint,
            "--arch",
            "test_module_route_fallbacks:isinstance_branch",
            "--input-shape",
            "3,6,6",
            "-o",
            out,
        ),
        0,
    )
    original, rescaled = isinstance_branch().double().eval(), isinstance_branch().double().eval()
    rescaled.load_state_dict({key: value.double() for key, value in safetensors.torch.load_file(str(out)).items()})
    assert not torch.equal(rescaled.c2.weight, original.c2.weight)
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        want, got = original(x), rescaled(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


class Draws(nn.Module):
    """Scales by a fresh random draw on every call: no trace records what the module computes."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        return self.c1(x) * (1.0 + torch.rand(1, dtype=x.dtype, device=x.device))


# The fake CUDA device is a torch function mode: it reads the device a factory is given, which
# under torch.fx is a proxy, and it moves a module's tensors with ``.to`` itself, meta included.
OUTSIDE_THE_FAKE_DEVICE = pytest.mark.skipif(
    fake_cuda.requested(), reason="the fake CUDA mode sees fx's proxies and moves meta tensors itself"
)


@OUTSIDE_THE_FAKE_DEVICE
def test_a_forward_neither_trace_reproduces_is_refused_saying_so():
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(_randomized(Draws()), (3, 4, 4))
    message = str(raised.value)
    assert raised.value.exit_code == 4
    assert "torch.fx traced computes another function" in message
    assert "torch.export recorded computes another function" in message and "neither trace sees" in message


class TrainingOnlyDropout(nn.Module):
    """Left in train mode by its user: the check runs the module in eval mode, as it is read."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)
        self.drop = nn.Dropout(0.5)
        self.c2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.c2(self.drop(torch.relu(self.c1(x))))


def test_a_module_in_train_mode_with_dropout_is_read_and_left_in_train_mode():
    module = _randomized(TrainingOnlyDropout()).train()
    model = module_model(module, (3, 4, 4))
    assert module.training
    module.eval()
    _assert_reads_the_module(module, (3, 4, 4))
    assert [node.op for node in model.graph.nodes if node.name == "drop"] == ["identity"]


# -- 3. a module that computes across the batch is no shape problem --------------------------------


class BatchStatistics(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6, track_running_stats=False)
        self.l2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


def test_a_batchnorm1d_without_running_statistics_is_refused_by_name_not_blamed_on_the_shape():
    module = BatchStatistics().double().eval()
    with torch.no_grad():
        assert module(torch.randn(5, 4, dtype=torch.float64)).shape == (5, 2)
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(module, (4,))
    message = str(raised.value)
    assert raised.value.exit_code == 4
    assert "'bn' (BatchNorm1d)" in message and "track_running_stats=False" in message
    assert "batch-free" not in message


def test_a_shape_the_module_raises_on_at_any_batch_is_still_blamed_on_the_shape():
    with pytest.raises(UsageError) as raised:
        module_model(BatchStatistics(), (5,))
    assert "batch-free" in str(raised.value)


# -- 2. every operation the fx path reads, read on the torch.export path too -----------------------


class Net(nn.Module):
    """``body(self, x)`` on the given layers; ``through_export`` adds a branch on the input's
    shape, which torch.fx cannot trace, so that the module is read through torch.export."""

    def __init__(self, body: Callable[[Net, torch.Tensor], torch.Tensor], through_export: bool, **layers):
        super().__init__()
        self.body, self.through_export = body, through_export
        for name, layer in layers.items():
            self.register_module(name, layer) if isinstance(layer, nn.Module) else self.register_parameter(name, layer)

    def forward(self, x):
        if self.through_export and x.shape[-1] < 0:
            return x
        return self.body(self, x)


def _conv(in_channels: int = 3, out_channels: int = 4, rank: int = 2, **kwargs) -> nn.Module:
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1](in_channels, out_channels, 1, **kwargs)


def _between(op: Callable[[torch.Tensor], torch.Tensor], rank: int = 2, **layers) -> dict:
    """``op`` between two convolutions, with extra layers."""
    return {
        "body": lambda m, x: m.head(op(m, m.stem(x))),
        "stem": _conv(rank=rank),
        "head": _conv(4, 2, rank),
        **layers,
    }


def _shape(rank: int) -> tuple[int, ...]:
    return (3, *[4] * rank)


def _mean_spatial(m, y):
    return y.mean([2, 3], keepdim=True)


OPERATIONS: dict[str, tuple[Callable[[], dict], tuple[int, ...]]] = {
    "linear": (
        lambda: {
            "body": lambda m, x: m.b(torch.relu(m.a(torch.flatten(x, 1)))),
            "a": nn.Linear(12, 5),
            "b": nn.Linear(5, 2),
        },
        (3, 2, 2),
    ),
    **{
        f"conv{rank}d": (lambda rank=rank: _between(lambda m, y: torch.relu(y), rank), _shape(rank))
        for rank in (1, 2, 3)
    },
    **{
        f"conv_transpose{rank}d": (
            lambda rank=rank: _between(
                lambda m, y: m.t(y),
                rank,
                t=(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[rank - 1](4, 4, 2, stride=2),
            ),
            _shape(rank),
        )
        for rank in (1, 2, 3)
    },
    **{
        f"batchnorm{rank}d": (
            lambda rank=rank: _between(
                lambda m, y: torch.relu(m.bn(y)), rank, bn=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[rank - 1](4)
            ),
            _shape(rank),
        )
        for rank in (1, 2, 3)
    },
    "leaky_relu": (lambda: _between(lambda m, y: F.leaky_relu(y, 0.2)), _shape(2)),
    "leaky_relu_module": (lambda: _between(lambda m, y: m.act(y), act=nn.LeakyReLU(0.3)), _shape(2)),
    "prelu": (lambda: _between(lambda m, y: m.act(y), act=nn.PReLU(4)), _shape(2)),
    "prelu_shared": (lambda: _between(lambda m, y: m.act(y), act=nn.PReLU()), _shape(2)),
    "prelu_function": (
        lambda: _between(lambda m, y: F.prelu(y, m.slope), slope=nn.Parameter(torch.rand(4))),
        _shape(2),
    ),
    "abs": (lambda: _between(lambda m, y: torch.abs(y)), _shape(2)),
    "abs_method": (lambda: _between(lambda m, y: y.abs()), _shape(2)),
    "relu_method": (lambda: _between(lambda m, y: y.relu()), _shape(2)),
    "identity_dropout": (
        lambda: _between(lambda m, y: m.drop(m.same(y)), same=nn.Identity(), drop=nn.Dropout(0.3)),
        _shape(2),
    ),
    **{
        f"maxpool{rank}d": (
            lambda rank=rank: _between(
                lambda m, y: torch.relu(m.pool(y)), rank, pool=(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[rank - 1](2)
            ),
            _shape(rank),
        )
        for rank in (1, 2, 3)
    },
    **{
        f"avgpool{rank}d": (
            lambda rank=rank: _between(
                lambda m, y: m.pool(y), rank, pool=(nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[rank - 1](2)
            ),
            _shape(rank),
        )
        for rank in (1, 2, 3)
    },
    **{
        f"adaptive_avgpool{rank}d": (
            lambda rank=rank: _between(
                lambda m, y: m.pool(y),
                rank,
                pool=(nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[rank - 1](2),
            ),
            _shape(rank),
        )
        for rank in (1, 2, 3)
    },
    "mean": (lambda: _between(_mean_spatial), _shape(2)),
    **{
        f"pad_{mode}": (lambda mode=mode: _between(lambda m, y: F.pad(y, (1, 0, 2, 1), mode=mode)), _shape(2))
        for mode in ("constant", "reflect", "replicate", "circular")
    },
    "pad_modules": (
        lambda: _between(
            lambda m, y: m.reflect(m.zero(y)), zero=nn.ZeroPad2d(1), reflect=nn.ReflectionPad2d((1, 0, 0, 1))
        ),
        _shape(2),
    ),
    "crop": (lambda: _between(lambda m, y: F.pad(y, (-1, 0, 0, -1))), _shape(2)),
    "pad_inf_max_pool": (
        lambda: _between(lambda m, y: F.max_pool2d(F.pad(y, (1, 1, 1, 1), value=-math.inf), 2)),
        _shape(2),
    ),
    "scale_divide_negate": (lambda: _between(lambda m, y: -(torch.relu(y * 2.0) / 3.0)), _shape(2)),
    "channel_affine": (
        lambda: _between(
            lambda m, y: torch.relu(y * m.scale + m.shift),
            scale=nn.Parameter(torch.rand(1, 4, 1, 1)),
            shift=nn.Parameter(torch.rand(1, 4, 1, 1)),
        ),
        _shape(2),
    ),
    "fixed_filter": (lambda: {"body": lambda m, x: m.net(x), "net": timm_like.BlurNet()}, (3, 4, 4)),
    "upsample_nearest": (lambda: _between(lambda m, y: m.up(y), up=nn.Upsample(scale_factor=2)), _shape(2)),
    "interpolate_bilinear": (lambda: _between(lambda m, y: F.interpolate(y, size=(7, 5), mode="bilinear")), _shape(2)),
    "interpolate_trilinear": (
        lambda: _between(lambda m, y: F.interpolate(y, scale_factor=2, mode="trilinear", align_corners=True), 3),
        _shape(3),
    ),
    "interpolate_nearest_exact_integer": (
        lambda: _between(lambda m, y: F.interpolate(y, scale_factor=(2, 3), mode="nearest-exact")),
        _shape(2),
    ),
    "flatten": (
        lambda: {
            "body": lambda m, x: m.fc(m.flat(torch.relu(m.stem(x)))),
            "stem": _conv(),
            "flat": nn.Flatten(),
            "fc": nn.Linear(64, 2),
        },
        _shape(2),
    ),
    "channel_split_chunk_slice": (
        lambda: _between(
            lambda m, y: (
                torch.cat([*torch.chunk(y, 2, 1)[::-1]], 1)
                + torch.cat(list(torch.split(y, [1, 3], 1)), 1)
                + torch.cat([y[:, 2:], y[:, :2]], 1)
            )
        ),
        _shape(2),
    ),
    "channel_shuffle": (lambda: _between(lambda m, y: m.shuffle(y), shuffle=nn.ChannelShuffle(2)), _shape(2)),
    "residual_sub_cat": (
        lambda: {
            "body": lambda m, x: m.head(torch.cat([m.a(x) + m.b(x), m.a2(x) - m.b2(x)], 1)),
            "a": _conv(),
            "b": _conv(),
            "a2": _conv(),
            "b2": _conv(),
            "head": _conv(8, 2),
        },
        _shape(2),
    ),
}


@pytest.mark.parametrize("through_export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_every_supported_operation_is_read_on_both_module_paths(name, through_export):
    make, shape = OPERATIONS[name]
    module = _randomized(Net(through_export=through_export, **make()))
    if through_export:
        with pytest.raises(Exception):  # noqa: B017 - the premise: fx cannot trace it, torch.export reads it
            torch.fx.symbolic_trace(module)
    _assert_reads_the_module(module, shape)


@pytest.mark.parametrize("through_export", [False, True], ids=["fx", "export"])
def test_abs_and_prelu_are_read_as_the_onnx_route_reads_them(through_export):
    make = lambda: _between(lambda m, y: m.head2(torch.abs(m.act(y))), act=nn.PReLU(4), head2=_conv(4, 4))  # noqa: E731
    layers = make()
    layers["body"] = lambda m, x: m.head(m.head2(torch.abs(m.act(m.stem(x)))))
    module = _randomized(Net(through_export=through_export, **layers))
    model = _assert_reads_the_module(module, (3, 4, 4))
    (absolute,) = [node for node in model.graph.nodes if isinstance(node, LeakyReLU)]
    assert absolute.negative_slope == -1.0
    assert len([node for node in model.graph.nodes if isinstance(node, PReLU)]) == 1
    assert rescale_module(module, (3, 4, 4)).verification.passed


# -- 8. a call form fx's path refuses falls back to torch.export ------------------------------------


class TransposedToSize(nn.Module):
    """``convT(x, output_size=...)`` (smp's Linknet): fx records a module call of two arguments."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.t = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.c2(torch.relu(self.t(y, output_size=[2 * y.shape[-2], 2 * y.shape[-1]])))


def test_a_transposed_convolution_to_an_output_size_is_read_through_torch_export():
    module = _randomized(TransposedToSize())
    assert "t" in {node.target for node in torch.fx.symbolic_trace(module).graph.nodes}  # fx traces it
    _assert_reads_the_module(module, (3, 5, 5))
    assert rescale_module(module, (3, 5, 5)).verification.passed


@pytest.mark.parametrize(
    "op, named",
    [
        (lambda m, y: F.gelu(y), "torch.nn.functional.gelu"),
        (lambda m, y: torch.cat([y, y], 2), "torch.cat"),
    ],
    ids=["not_homogeneous", "read_by_neither"],
)
def test_what_neither_path_reads_is_refused_by_the_module_s_own_call(op, named):
    """The fallback keeps fx's problems where torch.export's graph does not read either: they name
    the forward's own calls, not their ATen forms."""
    module = _randomized(Net(through_export=False, **_between(op)))
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(module, (3, 4, 4))
    assert named in str(raised.value) and "torch.ops.aten" not in str(raised.value)


# -- 7. nearest-exact: read where it copies what nearest copies, refused with its own reason otherwise -


@pytest.mark.parametrize("through_export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize(
    "resize",
    [
        lambda y: F.interpolate(y, scale_factor=2, mode="nearest-exact"),
        lambda y: F.interpolate(y, size=(8, 12), mode="nearest-exact"),
        nn.Upsample(size=(8, 12), mode="nearest-exact"),
        nn.Upsample(scale_factor=(2, 3), mode="nearest-exact"),
    ],
    ids=["scale", "size", "module_size", "module_scale"],
)
def test_nearest_exact_at_an_integer_factor_is_read_as_nearest(resize, through_export):
    layers = (
        _between(lambda m, y: m.up(y), up=resize) if isinstance(resize, nn.Module) else _between(lambda m, y: resize(y))
    )
    module = _randomized(Net(through_export=through_export, **layers))
    model = _assert_reads_the_module(module, (3, 4, 4))
    (upsample,) = [node for node in model.graph.nodes if isinstance(node, Upsample)]
    assert upsample.mode == "nearest"


@pytest.mark.parametrize("through_export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("arguments", [{"scale_factor": 1.5}, {"size": (6, 6)}, {"scale_factor": 0.5}])
def test_nearest_exact_at_another_factor_is_refused_with_its_own_reason(arguments, through_export):
    module = _randomized(
        Net(through_export=through_export, **_between(lambda m, y: F.interpolate(y, mode="nearest-exact", **arguments)))
    )
    with torch.no_grad():
        exact = F.interpolate(torch.arange(16.0).reshape(1, 1, 4, 4), mode="nearest-exact", **arguments)
        nearest = F.interpolate(torch.arange(16.0).reshape(1, 1, 4, 4), mode="nearest", **arguments)
    assert not torch.equal(exact, nearest)  # the premise: nearest would compute another function
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(module, (3, 4, 4))
    message = str(raised.value)
    assert "nearest-exact" in message and "integer upscaling factor" in message
    assert "bicubic" not in message


@OUTSIDE_THE_FAKE_DEVICE
def test_a_module_on_the_meta_device_is_unreadable_input_for_module_model_too():
    module = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)).to("meta")
    with pytest.raises(InputError) as raised:
        module_model(module, (2,))
    assert "0.weight, 0.bias, 2.weight, 2.bias are on the meta device" in str(raised.value)
