"""One device per analysis, checked on the fake CUDA device of :mod:`fake_cuda` (no GPU needed).

These tests run in the default suite on a CPU machine: they enter the fake device themselves.
The whole suite also runs on it with ``PATHCOND_FAKE_CUDA=1`` (see ``.ci/run``).
"""

from __future__ import annotations

import fake_cuda
import pytest
import torch

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.rescaling import rescale
from pathcond_cli.solve import solvers
from pathcond_cli.solve.objective import Objective, degenerate_mask


def _model(nets, arch="mlp", dead=False) -> LoadedModel:
    graph, params = nets.catalogue[arch]()
    if dead:  # a hidden neuron with no incoming weight: its group is degenerate
        params = dict(params)
        first = next(key for key in params if key.endswith(".weight"))
        params[first] = params[first].clone()
        params[first][0] = 0
        params[first.replace("weight", "bias")] = params[first.replace("weight", "bias")].clone()
        params[first.replace("weight", "bias")][0] = 0
    return LoadedModel(graph, params, "safetensors", f"{arch}.safetensors")


def test_fake_device_refuses_mixes_and_counts_transfers():
    before = torch.cuda.is_available
    with fake_cuda.installed() as mode:
        on_device = torch.ones(3, device="cuda")
        assert on_device.device == torch.device("cuda", 0) and on_device.is_cuda and torch.cuda.is_available()
        with pytest.raises(RuntimeError, match="same device"):
            on_device + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(4, device="cuda").index_add_(0, torch.tensor([0, 1, 2]), on_device)
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([on_device, torch.ones(2)])
        with pytest.raises(TypeError, match="numpy"):
            on_device.numpy()
        assert (on_device * torch.tensor(2.0)).device.type == "cuda"  # a CPU scalar may mix, as on CUDA
        assert (on_device[torch.tensor([0, 2])] + on_device[:2]).device.type == "cuda"  # CPU indices too
        host = on_device.cpu()
        assert host.device.type == "cpu" and (host + torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert float(on_device.sum()) == 3.0 and on_device.to("cpu").device.type == "cpu"
        moved = torch.nn.Linear(3, 2).to("cuda")
        assert moved.weight.device.type == "cuda" and moved(on_device).device.type == "cuda"
        assert mode.syncs["cpu"] == 2 and mode.syncs["__float__"] == 1
    assert torch.cuda.is_available is before


def test_fake_device_catches_the_old_degenerate_mask_call(nets, monkeypatch):
    """pathcond 0.2.1 called ``degenerate_mask(groups, diag)`` with the CPU groups and diag(G)
    on the GPU: every run with ``--device auto`` on a GPU machine failed. The fake device fails
    on that line on a CPU machine."""
    model = _model(nets, dead=True)
    cpu_groups = build_groups(model.graph, model.params)
    with fake_cuda.installed():
        analysis = analyse(model, device="cuda")
        with pytest.raises(RuntimeError, match="same device"):
            degenerate_mask(cpu_groups, analysis.diag)

        def old_line(objective):
            return degenerate_mask(cpu_groups, analysis.diag).to(objective.device)

        monkeypatch.setattr(solvers.Objective, "degenerate", old_line)
        with pytest.raises(RuntimeError, match="same device"):
            rescale(model, device="cuda", analysis=analysis)


@pytest.mark.parametrize("criterion", ["pathcond", "enorm"])
@pytest.mark.parametrize("arch", ["mlp", "concat", "self_loop", "conv_bn"])
def test_rescale_on_the_fake_device_matches_the_cpu(nets, arch, criterion):
    model = _model(nets, arch, dead=arch in ("mlp", "concat"))
    on_cpu = rescale(model, device="cpu", criterion=criterion)
    with fake_cuda.installed():
        on_device = rescale(model, device="auto", criterion=criterion)
        assert on_device.analysis.device == "cuda" and on_device.analysis.groups.device.type == "cuda"
        assert all(lg.device.type == "cuda" for lg in on_device.analysis.diag.log_g)
        conditioning = on_device.conditioning_after.value
        degenerate = on_device.solve.degenerate
    assert on_device.solve.u.device.type == "cpu"
    assert degenerate == on_cpu.solve.degenerate
    assert (len(degenerate) > 0) == (arch in ("mlp", "concat"))
    assert torch.allclose(on_device.solve.u, on_cpu.solve.u, atol=1e-9)
    assert conditioning == pytest.approx(on_cpu.conditioning_after.value, rel=1e-9)
    assert on_device.changed.keys() == on_cpu.changed.keys()
    for key, tensor in on_device.changed.items():
        assert not fake_cuda.on_fake(tensor), f"{key}: the rescaled tensor stays where the checkpoint's is"
        assert tensor.dtype == model.params[key].dtype
        assert torch.allclose(tensor, on_cpu.changed[key], rtol=1e-12, atol=0)


@pytest.mark.parametrize("arch", ["mlp", "residual", "concat", "self_loop", "bottleneck"])
def test_objective_degenerate_groups_match_degenerate_mask(nets, arch):
    """The solvers' frozen groups, from ḡ on the objective's device, are those of the
    per-parameter definition (A_h = 0 or C_h = 0)."""
    for dead in (False, True):
        model = _model(nets, arch, dead=dead)
        groups = build_groups(model.graph, model.params)
        diag = diag_g(groups)
        expected = degenerate_mask(groups, diag)
        assert torch.equal(Objective(groups, diag).degenerate(), expected)
        assert bool(expected.any()) == (dead and arch in ("mlp", "concat"))
