"""Parity of the importers: torch.fx, the spec format, and ONNX from both torch exporters.

Each architecture is imported four ways from the same weights; all must give the same
rescaling groups (counts, and the multiset of each group's incoming/outgoing parameter counts), the same diag(G), the same path
count and the same optimal objective F*.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import onnx_models
import ops_models
from pathcond_cli.api import analyse, module_model, rescale
from pathcond_cli.errors import UnsupportedModelError
from pathcond_cli.solve.objective import support
from pathcond_cli.io.formats.onnx_format import load_onnx
from pathcond_cli.io.formats.spec import graph_from_spec, spec_from_graph
from pathcond_cli.engine.model import LoadedModel

sys.path.insert(0, str(Path(__file__).parent))
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
    # by the TorchScript exporter like a BatchNorm2d; BlurPool's persistent filter buffer is a
    # stored conv weight on both routes; the unused projection is dropped on both.
    **timm_like.TIMM_LIKE,
}


# torch.export turns 1-d linear interpolation into index arithmetic instead of a Resize.
KNOWN_GAPS = {
    ("upsample_1d", "onnx-dynamo"): "torch.export decomposes 1-d linear interpolation into GatherND index arithmetic",
}
IMPORTERS = ("spec", "onnx-torchscript", "onnx-dynamo")


def _load(name: str, how: str) -> tuple[LoadedModel, LoadedModel]:
    """The fx import of architecture ``name`` and its import by ``how``, from the same weights."""
    module, shape = ARCHITECTURES[name]()
    module = module.float().eval()
    fx = module_model(module, shape)
    if how == "spec":
        return fx, LoadedModel(graph_from_spec(spec_from_graph(fx.graph), source="spec"), fx.params, "safetensors", "spec")
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
    "name, how", [pytest.param(name, how, marks=_marks(name, how)) for name in sorted(ARCHITECTURES) for how in IMPORTERS]
)
def test_every_importer_gives_the_same_analysis(name, how):
    fx, other = _load(name, how)
    counts, sizes, log_g, paths, optimum = _signature(fx)
    other_counts, other_sizes, other_log_g, other_paths, other_optimum = _signature(other)
    assert other_counts == counts
    assert other_sizes == sizes
    # The TorchScript exporter folds BatchNorm into the conv in float32: g agrees to float32 precision.
    assert torch.allclose(other_log_g, log_g, rtol=0, atol=1e-5)
    assert other_paths == pytest.approx(paths, rel=1e-12)
    assert other_optimum == pytest.approx(optimum, rel=1e-6, abs=1e-6)


def test_a_non_persistent_filter_buffer_is_read_from_onnx_and_refused_by_fx_with_the_onnx_route_named():
    """timm registers BlurPool2d's filter with persistent=False. Its ONNX export stores the filter,
    which the ONNX route rescales like any conv weight; the fx route refuses, since the module's
    state_dict would not carry the rescaled filter, and its message names the ONNX route."""
    module = timm_like.randomized(timm_like.BlurNet(persistent=False))
    example = torch.randn((2, 3, 8, 8), generator=torch.Generator().manual_seed(0))
    onnx_model = load_onnx(onnx_models.export(module, example, "dynamo"), name="blur.onnx")
    assert analyse(onnx_model, device="cpu").groups.num_free > 0
    with pytest.raises(UnsupportedModelError, match="persistent=False.*rescale the module's ONNX export"):
        module_model(module, (3, 8, 8))
