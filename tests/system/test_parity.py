"""Parity of the importers: torch.fx, the spec format, and ONNX from both torch exporters.

Each architecture is imported four ways from the same weights; all must give the same
rescaling groups (counts, and the multiset of each group's incoming/outgoing parameter counts),
the same diag(G), the same path
count and the same optimal objective F*. The one difference by design, a filter buffer (a
constant on the fx route, a stored weight in ONNX), has its exact relation stated below.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import onnx_models
import ops_models
import pytest
import torch

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.graph import Conv, FixedFilter
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.spec import graph_from_spec, spec_from_graph
from pathcond_cli.module_route import module_model
from pathcond_cli.rescaling import rescale
from pathcond_cli.solve.objective import support

sys.path.insert(0, str(Path(__file__).parents[1]))
import reference_models  # noqa: E402
import timm_like  # noqa: E402

ARCHITECTURES = {
    **{name: (lambda name=name: ops_models.build(name)) for name in ops_models.OPS_MODELS},
    "small_resnet": lambda: (reference_models.small_resnet(), (3, 16, 16)),
    "small_densenet": lambda: (reference_models.small_densenet(), (3, 16, 16)),
    "small_inception": lambda: (reference_models.small_inception(), (3, 16, 16)),
    "small_mnasnet": lambda: (reference_models.small_mnasnet(), (3, 32, 32)),
    # Written as timm writes them: each reads the same through fx (torch.export for
    # the shape branch) as through both ONNX exporters. BatchNormAct2d's F.batch_norm is folded
    # by the TorchScript exporter like a BatchNorm2d; the unused projection is dropped on both;
    # NASNet's crops are pads of negative width on both. BlurPool's filter buffer differs by
    # design (see FIXED_FILTER_FAMILIES).
    **timm_like.TIMM_LIKE,
}

# A filter buffer is a constant on the fx route (a fixed filter node: a buffer is no parameter)
# and an initializer, a conv weight, in the module's ONNX export. The groups and D differ;
# test_a_filter_buffer_is_a_constant_on_fx_and_a_weight_in_onnx states the exact relation.
FIXED_FILTER_FAMILIES = {"timm_blur": 4}  # family: channels of its fixed filter


# torch.export turns 1-d linear interpolation into index arithmetic instead of a Resize.
KNOWN_GAPS = {
    ("upsample_1d", "onnx-dynamo"): "torch.export decomposes 1-d linear interpolation into GatherND index arithmetic",
}
IMPORTERS = ("spec", "onnx-torchscript", "onnx-dynamo")


@functools.cache
def _built(name: str):
    """Architecture ``name`` (float32, eval mode), its input shape, its fx import and that import's
    signature: made once per architecture for its importers (the weights are drawn once)."""
    module, shape = ARCHITECTURES[name]()
    module = module.float().eval()
    fx = module_model(module, shape)
    return module, shape, fx, _signature(fx)


def _load(name: str, how: str) -> tuple[LoadedModel, LoadedModel]:
    """The fx import of architecture ``name`` and its import by ``how``, from the same weights."""
    module, shape, fx, _ = _built(name)
    if how == "spec":
        return fx, LoadedModel(
            graph_from_spec(spec_from_graph(fx.graph), source="spec"), fx.params, "safetensors", "spec"
        )
    example = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    exporter = how.removeprefix("onnx-")
    return fx, load_onnx(onnx_models.export(module, example, exporter), name=f"{name}.onnx")


def _signature(model: LoadedModel):
    analysis = analyse(model, device="cpu")
    groups = analysis.groups
    # Each free group's (incoming, outgoing) counts of parameters with g > 0: the structure, whatever the names.
    counts = support(groups, analysis.diag.parts)
    sizes = sorted(zip(counts.n_in.tolist(), counts.n_out.tolist()))
    log_g = torch.cat([lg.flatten() for lg in analysis.diag.log_g]).sort().values
    solved = rescale(model, device="cpu", verify=False, analysis=analysis)
    return (groups.num_free, groups.num_fixed, groups.p), sizes, log_g, analysis.paths.log10, solved.solve.objective[-1]


def _marks(name: str, how: str) -> list:
    marks = [pytest.mark.slow] if name.startswith("small_") else []  # reference nets: minutes on 2 cores
    if (name, how) in KNOWN_GAPS:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name, how]))
    return marks


@pytest.mark.parametrize(
    "name, how",
    [
        pytest.param(name, how, marks=_marks(name, how))
        for name in sorted(ARCHITECTURES)
        for how in IMPORTERS
        if how == "spec" or name not in FIXED_FILTER_FAMILIES
    ],
)
def test_every_importer_gives_the_same_analysis(name, how):
    _, other = _load(name, how)
    counts, sizes, log_g, paths, optimum = _built(name)[3]
    other_counts, other_sizes, other_log_g, other_paths, other_optimum = _signature(other)
    assert other_counts == counts
    assert other_sizes == sizes
    # The TorchScript exporter folds BatchNorm into the conv in float32: g agrees to float32 precision.
    assert torch.allclose(other_log_g, log_g, rtol=0, atol=1e-5)
    assert other_paths == pytest.approx(paths, rel=1e-12)
    assert other_optimum == pytest.approx(optimum, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("how", [how for how in IMPORTERS if how != "spec"])
@pytest.mark.parametrize("name", sorted(FIXED_FILTER_FAMILIES))
def test_a_filter_buffer_is_a_constant_on_fx_and_a_weight_in_onnx(name, how):
    """timm's BlurPool2d filter is a buffer: on the fx route a fixed filter, whose taps are
    constants on the paths; in the ONNX export an initializer, which the ONNX route, reading
    every stored tensor as a parameter, rescales as a depthwise conv weight. The paths are the
    same (Φ does not care whether a factor is a parameter or a constant): the same path count
    and path norms, and the same g for every parameter both routes have. The ONNX route has
    the filter's C·k² taps as parameters more and its C output channels as free groups more
    (on fx they are tied to the channels they filter), so its groups, D and F* differ."""
    fx, onnx_model = _load(name, how)
    channels = FIXED_FILTER_FAMILIES[name]
    (fixed,) = [node for node in fx.graph.nodes if isinstance(node, FixedFilter)]
    (filter_conv,) = [node for node in onnx_model.graph.nodes if isinstance(node, Conv) and node.groups == channels]
    taps = len(fixed.coefficients)
    fx_analysis, onnx_analysis = analyse(fx, device="cpu"), analyse(onnx_model, device="cpu")
    assert onnx_analysis.groups.num_free == fx_analysis.groups.num_free + channels
    assert onnx_analysis.groups.num_fixed == fx_analysis.groups.num_fixed
    assert onnx_analysis.groups.p == fx_analysis.groups.p + taps
    assert onnx_analysis.paths.log10 == pytest.approx(fx_analysis.paths.log10, rel=1e-12)
    for key, norm in fx_analysis.path_norms.items():
        assert onnx_analysis.path_norms[key].log10 == pytest.approx(norm.log10, rel=1e-9)
    shared = [
        lg.flatten()
        for dp, lg in zip(onnx_analysis.groups.dag_params, onnx_analysis.diag.log_g)
        if dp.layer != filter_conv.name
    ]
    assert torch.allclose(
        torch.cat(shared).sort().values,
        torch.cat([lg.flatten() for lg in fx_analysis.diag.log_g]).sort().values,
        rtol=0,
        atol=1e-5,
    )
    assert onnx_analysis.conditioning.value != pytest.approx(fx_analysis.conditioning.value, rel=1e-3)
