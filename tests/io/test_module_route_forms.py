"""The module route (rescale_module, --arch module:factory) reads what the ONNX route reads
(issue 37.7, issue 38.H).

segmentation_models_pytorch, timm and MONAI are not test dependencies: each module below
reproduces one of their patterns. A decoder (Linknet, PSPNet, UnetPlusPlus, DeepLabV3Plus)
with transposed convolutions and nearest/bilinear resizes, reached through torch.export; a
Res2Net block that splits its channels (torch.split, torch.chunk, Tensor.split with sizes) and
iterates the pieces; a BasicUNet whose skip connection hides behind ``torch.jit.isinstance``,
which torch.fx traces the wrong way, and whose InstanceNorm is refused by name. The oracles
are the module's own forward (against pathcond's evaluation of the graph read), the module's
ONNX export (the same groups, diag(G), path norms and optimum), brute-force path enumeration,
and the module itself with the checkpoint loaded (a factory's filter buffer).
"""

from __future__ import annotations

import functools
import math

import onnx_models
import pytest
import safetensors.torch
import timm_like
import torch
import torch.nn as nn
import torch.nn.functional as F
from cli_support import assert_clean_exit, invoke
from oracle import build_neuron_dag
from test_parity import _signature

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import ConvTranspose, FixedFilter, Upsample
from pathcond_cli.errors import UnsupportedModelError, UsageError, VerificationError
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.model_files import load
from pathcond_cli.module_route import module_model, rescale_module
from pathcond_cli.rescaling import rescale


def _randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter and BatchNorm statistic drawn at random (seeded), in float64, eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                values = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
                tensor.copy_(values + 0.5 if name.endswith("running_var") else values - 0.3)
    return module.double().eval()


def _assert_reads_the_module(module: nn.Module, shape: tuple[int, ...]):
    """The graph the module route reads computes the module's function; returns the model."""
    model = module_model(module, shape)
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (output,) = forward(model.graph, model.params, x).values()
    with torch.no_grad():
        expected = module(x)
    assert torch.allclose(output, expected, rtol=1e-10, atol=1e-12)
    return model


def _fx_cannot_trace(module: nn.Module) -> bool:
    try:
        torch.fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001 - fx raises many types for untraceable code
        return True
    return False


class Decoder(nn.Module):
    """An smp-like decoder: a shape branch (fx cannot trace it: torch.export reads it), transposed
    convolutions (Linknet), nearest and bilinear resizes in the scale_factor and size forms,
    with align_corners False and True (UnetPlusPlus, PSPNet, DeepLabV3Plus)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 3, 2, stride=2)
        self.up_padded = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1, bias=False)
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        if x.shape[-1] % 2:  # as smp's encoders check the input size
            x = F.pad(x, (0, 1, 0, 1))
        y = F.relu(self.encoder(x))
        z = F.relu(self.up(y) + self.up_padded(y))
        size = z.shape[-2:]
        pyramid = (
            F.interpolate(F.avg_pool2d(z, 2), scale_factor=2, mode="nearest")
            + F.interpolate(F.avg_pool2d(z, 2), size=size, mode="nearest")
            + F.interpolate(F.avg_pool2d(z, 4), size=size, mode="bilinear", align_corners=False)
            + F.interpolate(F.avg_pool2d(z, 4), scale_factor=4.0, mode="bilinear", align_corners=True)
        )
        return self.head(F.relu(pyramid))


def test_a_decoder_read_through_torch_export_keeps_its_transposed_convs_and_resizes():
    module = _randomized(Decoder())
    assert _fx_cannot_trace(module)
    model = _assert_reads_the_module(module, (2, 8, 8))
    transposed = [node for node in model.graph.nodes if isinstance(node, ConvTranspose)]
    assert [(node.weight, node.bias, node.output_padding) for node in transposed] == [
        ("up.weight", "up.bias", (0, 0)),
        ("up_padded.weight", None, (1, 1)),
    ]
    resizes = sorted(
        (node.mode, node.align_corners, node.size, node.scale_factor)
        for node in model.graph.nodes
        if isinstance(node, Upsample)
    )
    assert resizes == [
        ("linear", False, (8, 8), ()),
        ("linear", True, (), (4.0, 4.0)),
        ("nearest", False, (), (2.0, 2.0)),
        ("nearest", False, (8, 8), ()),
    ]
    before = {key: tensor.clone() for key, tensor in module.state_dict().items()}
    result = rescale_module(module, (2, 8, 8))
    assert result.verification.passed
    assert any(not torch.equal(before[key], tensor) for key, tensor in module.state_dict().items())


@pytest.mark.parametrize(
    "mode, scale, reason",
    [
        ("bicubic", 2, "bicubic weights are negative"),
        ("nearest-exact", 1.5, "mode='nearest-exact' with scale_factor=[1.5, 1.5] of an input of spatial size (4, 4)"),
    ],
)
def test_a_resize_torch_export_records_in_an_unsupported_mode_is_refused_with_the_reason(mode, scale, reason):
    class Resized(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 1)

        def forward(self, x):
            if x.shape[-1] > 2:
                x = x * 2
            return F.interpolate(self.conv(x), scale_factor=scale, mode=mode)

    with pytest.raises(UnsupportedModelError) as raised:
        module_model(Resized(), (1, 4, 4))
    assert reason in str(raised.value) and "batch-free" not in str(raised.value)


class Res2NetBlock(nn.Module):
    """timm's Bottle2neck: the channels split in ``scale`` pieces of ``width``, each piece (plus
    the previous one's output, except in the first block) convolved; the last piece pooled
    (first block) or passed on. ``sp = spx[0]`` is read by nothing when ``is_first``, as in timm.
    With ``iterate``, the pieces are iterated, which fx cannot trace (torch.export reads it), and
    cut by torch.chunk, Tensor.split with a list of sizes and slicing."""

    def __init__(self, *, is_first: bool, iterate: bool, width: int = 2, scale: int = 4):
        super().__init__()
        self.width, self.scale, self.is_first, self.iterate = width, scale, is_first, iterate
        self.conv1 = nn.Conv2d(3, width * scale, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width * scale)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, bias=False) for _ in range(scale - 1))
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(scale - 1))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1) if is_first else None
        self.conv3 = nn.Conv2d(width * scale, 3, 1)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        spx = torch.split(out, self.width, 1)
        if self.iterate:
            halves = torch.chunk(out, 2, 1)
            pieces = [*halves[0].split([2, 2], dim=1), halves[1][:, :2], halves[1][:, 2:]]
            spx = [piece + piece for piece in pieces]
            spx[1] = spx[1] + out[:, 2:4] + out[:, self.width : 2 * self.width]
        spo = []
        sp = spx[0]
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            sp = spx[i] if i == 0 or self.is_first else sp + spx[i]
            sp = F.relu(bn(conv(sp)))
            spo.append(sp)
        spo.append(self.pool(spx[-1]) if self.pool is not None else spx[-1])
        return F.relu(self.conv3(torch.cat(spo, 1)) + x)


RES2NET_BLOCKS = {
    f"{'iterated' if iterate else 'indexed'}, is_first={is_first}": (is_first, iterate)
    for iterate in (False, True)
    for is_first in (True, False)
}


@pytest.mark.parametrize("name", RES2NET_BLOCKS)
def test_a_res2net_block_reads_every_form_of_split(name):
    is_first, iterate = RES2NET_BLOCKS[name]
    module = _randomized(Res2NetBlock(is_first=is_first, iterate=iterate))
    assert _fx_cannot_trace(module) == iterate
    model = _assert_reads_the_module(module, (3, 6, 6))
    assert model.warnings == []  # the piece nothing reads is no operation dropped
    assert rescale_module(module, (3, 6, 6)).verification.passed


class Unbound(nn.Module):
    """The other ways to cut channels, read through torch.export (the shape branch): torch.tensor_split,
    Tensor.unbind, a select, a slice of everything (recorded as an alias) and a strided slice. (The
    TorchScript exporter writes tensor_split as a SplitToSequence, which the ONNX route does not read.)"""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        if x.shape[-1] > 1:
            x = x * 2
        y = F.relu(self.conv(x))
        first, second = torch.tensor_split(y, 2, 1)
        channels = y.unbind(1)
        mixed = torch.cat([second, first], 1) + y[:, :] + torch.cat([c.unsqueeze(1) for c in channels[::-1]], 1)
        return self.head(mixed + torch.cat([y[:, ::2], y.select(1, 1).unsqueeze(1), y[:, 3:]], 1))


def test_every_other_channel_cut_is_read_through_torch_export():
    module = _randomized(Unbound())
    assert _fx_cannot_trace(module)
    _assert_reads_the_module(module, (2, 3, 3))
    assert rescale_module(module, (2, 3, 3)).verification.passed


class UpCat(nn.Module):
    """MONAI's UpCat: the skip connection is concatenated when ``torch.jit.isinstance(x_e,
    torch.Tensor)``, which is False for fx's proxy: fx traces the branch without it."""

    def __init__(self, in_channels: int, cat_channels: int, out_channels: int, norm: bool):
        super().__init__()
        self.upsample = nn.ConvTranspose2d(in_channels, in_channels, 2, stride=2)
        self.conv = nn.Conv2d(in_channels + cat_channels, out_channels, 3, padding=1)
        self.norm = nn.InstanceNorm2d(out_channels, affine=True) if norm else nn.Identity()

    def forward(self, x, x_e=None):
        x_0 = self.upsample(x)
        if x_e is not None and torch.jit.isinstance(x_e, torch.Tensor):
            x = self.conv(torch.cat([x_e, x_0], dim=1))
        else:
            x = self.conv(x_0)
        return F.leaky_relu(self.norm(x), 0.1)


class BasicUNet(nn.Module):
    def __init__(self, norm: bool = True):
        super().__init__()
        self.conv_0 = nn.Conv2d(1, 4, 3, padding=1)
        self.down_1 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU())
        self.upcat_1 = UpCat(8, 4, 4, norm)
        self.final_conv = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        x0 = F.relu(self.conv_0(x))
        return self.final_conv(self.upcat_1(self.down_1(x0), x0))


def basic_unet() -> nn.Module:
    return BasicUNet()


def test_a_unet_with_instance_norm_is_refused_naming_it_not_blaming_the_shape():
    module = BasicUNet()
    assert module(torch.zeros(1, 1, 16, 16)).shape == (1, 2, 16, 16)
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(module, (1, 16, 16))
    message = str(raised.value)
    assert raised.value.exit_code == 4
    assert "InstanceNorm2d" in message and "instance_norm" in message
    assert "batch-free" not in message and "raises when run" not in message


def test_a_unet_factory_with_instance_norm_exits_4_naming_it(tmp_path):
    checkpoint = tmp_path / "unet.safetensors"
    safetensors.torch.save_file(basic_unet().state_dict(), str(checkpoint))
    stderr = assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", "test_module_route_forms:basic_unet", "--input-shape", "1,16,16"),
        4,
        "InstanceNorm2d",
    )
    assert "batch-free" not in stderr


def test_a_skip_connection_fx_traces_the_wrong_way_is_read_through_torch_export():
    module = _randomized(BasicUNet(norm=False))
    traced = torch.fx.symbolic_trace(module)
    assert not any(node.target is torch.cat for node in traced.graph.nodes)  # fx took the other branch
    model = _assert_reads_the_module(module, (1, 8, 8))
    assert [node.op for node in model.graph.nodes].count("concat") == 1
    assert rescale_module(module, (1, 8, 8)).verification.passed


class Undecidable(nn.Module):
    """Runs on any input, but branches on its values: fx cannot trace it, nor torch.export export it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)

    def forward(self, x):
        y = self.conv(x)
        return F.relu(y) if y.sum() > 0 else -y


def test_a_module_that_runs_but_cannot_be_traced_is_refused_without_blaming_the_shape():
    module = Undecidable()
    module(torch.zeros(1, 1, 4, 4))
    with pytest.raises(UnsupportedModelError) as raised:
        module_model(module, (1, 4, 4))
    message = str(raised.value)
    assert "torch.fx cannot trace" in message and "torch.export" in message
    assert "batch-free" not in message and "raises when run" not in message


def test_a_shape_the_module_itself_raises_on_is_still_blamed_on_the_shape():
    """The other side: torch.export reads the decoder, and a shape it raises on is the user's."""
    with pytest.raises(UsageError) as raised:
        module_model(Decoder(), (3, 8, 8))
    assert "batch-free" in str(raised.value) and "(3, 8, 8)" in str(raised.value)


# -- parity with the ONNX route -------------------------------------------------------------------------


PARITY_MODULES = {
    "decoder": (lambda: Decoder(), (2, 8, 8)),
    "res2net": (lambda: Res2NetBlock(is_first=False, iterate=False), (3, 6, 6)),
    "res2net iterated": (lambda: Res2NetBlock(is_first=True, iterate=True), (3, 6, 6)),
    "unet": (lambda: BasicUNet(norm=False), (1, 8, 8)),
}


@functools.cache
def _module_route_read(name: str):
    """Parity module ``name`` (seeded weights, float32), its shape, and its module-route read's
    signature and path norms: made once for both exporters."""
    build, shape = PARITY_MODULES[name]
    module = _randomized(build()).float()
    fx = module_model(module, shape)
    return module, shape, _signature(fx), analyse(fx, device="cpu").path_norms


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", PARITY_MODULES)
def test_the_module_route_and_the_onnx_export_give_the_same_analysis(name, exporter):
    module, shape, (counts, sizes, log_g, paths, optimum), fx_norms = _module_route_read(name)
    example = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    exported = load_onnx(onnx_models.export(module, example, exporter), name=f"{name}.onnx")
    other_counts, other_sizes, other_log_g, other_paths, other_optimum = _signature(exported)
    assert other_counts == counts
    assert other_sizes == sizes
    assert torch.allclose(other_log_g, log_g, rtol=0, atol=1e-5)
    assert other_paths == pytest.approx(paths, rel=1e-12)
    assert other_optimum == pytest.approx(optimum, rel=1e-6, abs=1e-6)
    onnx_norms = analyse(exported, device="cpu").path_norms
    assert {key: norm.log10 for key, norm in onnx_norms.items()} == pytest.approx(
        {key: norm.log10 for key, norm in fx_norms.items()}, rel=1e-6
    )


# -- stored tensors the forward reads otherwise than as stored --------------------------------------------


class CastFilter(nn.Module):
    """A half filter buffer cast to float32 in forward: runs in float32 only."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)
        self.register_buffer("filt", torch.full((2, 1, 3, 3), 1 / 9).half())
        self.head = nn.Conv2d(2, 1, 1)

    def forward(self, x):
        return self.head(F.relu(F.conv2d(F.relu(self.conv(x)), self.filt.float(), padding=1, groups=2)))


def test_a_forward_casting_a_half_buffer_is_a_clear_verification_error():
    module = CastFilter()
    before = {key: tensor.clone() for key, tensor in module.state_dict().items()}
    with pytest.raises(VerificationError) as raised:
        rescale_module(module, (1, 4, 4))
    assert raised.value.exit_code == 5
    assert "float64" in str(raised.value) and "RuntimeError" in str(raised.value)
    assert all(torch.equal(before[key], tensor) for key, tensor in module.state_dict().items())


class ScaledByBuffer(nn.Module):
    def __init__(self, persistent: bool):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 1)
        self.register_buffer("s", torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1), persistent=persistent)
        self.head = nn.Conv2d(3, 1, 1)

    def forward(self, x):
        return self.head(F.relu(self.conv(x) * self.s))


def test_a_scale_by_a_non_persistent_buffer_is_refused_for_the_module_not_a_checkpoint():
    with pytest.raises(UnsupportedModelError) as raised:
        rescale_module(ScaledByBuffer(persistent=False), (1, 4, 4))
    message = str(raised.value)
    assert "'s' is not in the module's state_dict" in message and "persistent=False" in message
    assert "checkpoint" not in message
    assert rescale_module(ScaledByBuffer(persistent=True), (1, 4, 4)).verification.passed


# -- a factory's filter buffer comes from the checkpoint (issue 38.H) -------------------------------------


def _blur_checkpoint(tmp_path, **changes: torch.Tensor):
    """The state_dict of timm_like.BlurNet (persistent filter) with a filter that is not the
    factory's binomial one, saved as safetensors; also returns the state."""
    state = timm_like.randomized(timm_like.BlurNet()).state_dict()
    state["aa.filt"] = torch.rand(state["aa.filt"].shape, generator=torch.Generator().manual_seed(3)) * 2 - 0.5
    state.update(changes)
    path = tmp_path / "blur.safetensors"
    safetensors.torch.save_file(state, str(path))
    return path, state


def test_a_factory_reads_its_filter_buffer_from_the_checkpoint(tmp_path):
    path, state = _blur_checkpoint(tmp_path)
    model = load(path, arch="timm_like:BlurNet", input_shape=(3, 2, 2))
    assert model.warnings == []  # nothing unused: the filter is read
    (fixed,) = [node for node in model.graph.nodes if isinstance(node, FixedFilter)]
    assert torch.equal(torch.tensor(fixed.coefficients, dtype=torch.float32).reshape(4, 1, 3, 3), state["aa.filt"])
    # The oracle: the module with the checkpoint loaded into it, read on the module route.
    module = timm_like.BlurNet()
    module.load_state_dict(state)
    loaded = module_model(module, (3, 2, 2))
    default = module_model(timm_like.BlurNet(), (3, 2, 2))
    default.params.update({key: state[key] for key in default.params if key != "aa.filt"})
    analysis, expected, factory_default = (analyse(m, device="cpu") for m in (model, loaded, default))
    dag = build_neuron_dag(model.graph, model.params)
    phi = dag.phi(dag.theta)
    for q in (1, 2):
        norm = analysis.path_norms[f"l{q}"].log10
        assert norm == pytest.approx(math.log10(float(phi.abs().pow(q).sum()) ** (1 / q)), rel=1e-9)
        assert norm == pytest.approx(expected.path_norms[f"l{q}"].log10, rel=1e-12)
        assert norm != pytest.approx(factory_default.path_norms[f"l{q}"].log10, rel=1e-3)
    u, u_loaded, u_default = (rescale(m, device="cpu", verify=False).solve.u for m in (model, loaded, default))
    assert torch.allclose(u, u_loaded, rtol=0, atol=1e-9)
    assert not torch.allclose(u, u_default, rtol=0, atol=1e-3)


def test_a_factory_rescale_reads_the_checkpoint_filter_and_writes_it_unchanged(tmp_path):
    path, state = _blur_checkpoint(tmp_path)
    out = tmp_path / "out.safetensors"
    assert_clean_exit(invoke("rescale", path, "--arch", "timm_like:BlurNet", "--input-shape", "3,4,4", "-o", out), 0)
    written = safetensors.torch.load_file(str(out))
    assert torch.equal(written["aa.filt"], state["aa.filt"])
    assert not torch.equal(written["conv1.weight"], state["conv1.weight"])


@pytest.mark.parametrize(
    "filt, code, needle",
    [
        (torch.ones(4, 1, 2, 2), 3, "expected the factory's filter buffer's shape (4, 1, 3, 3)"),
        (torch.full((4, 1, 3, 3), math.nan), 7, "'aa.filt'"),
    ],
)
def test_a_checkpoint_filter_that_cannot_be_the_factory_s_is_refused(tmp_path, filt, code, needle):
    path, _ = _blur_checkpoint(tmp_path, **{"aa.filt": filt})
    assert_clean_exit(invoke("inspect", path, "--arch", "timm_like:BlurNet", "--input-shape", "3,4,4"), code, needle)


def test_a_checkpoint_without_the_factory_s_filter_buffer_says_it_lacks_it(tmp_path):
    state = timm_like.randomized(timm_like.BlurNet()).state_dict()
    del state["aa.filt"]
    path = tmp_path / "blur.safetensors"
    safetensors.torch.save_file(state, str(path))
    assert_clean_exit(
        invoke("inspect", path, "--arch", "timm_like:BlurNet", "--input-shape", "3,4,4"),
        3,
        "needs tensor 'aa.filt'",
        "which the checkpoint lacks",
    )
