"""Issue 39: a whole rescale reads device values on the host a bounded number of times, whatever
the network's depth (fake CUDA device; the counts are deterministic).

Counted: reads of values (``.item()``, ``.tolist()``, ``float()``, ``bool()``, ...) and copies to
the host (``.cpu()``), each a wait for the device on a GPU. The rescaled tensors are computed
where the checkpoint lives, from ``u`` read once, not copied back one by one.
"""

from __future__ import annotations

import fake_cuda
import torch

import pathcond_cli as pathcond
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.io.formats.fx_import import graph_from_module

# Newton's solve reads about three values per pass (its F, the coarse correction's flags and
# each CG step's stopping test); the rest of the run one or two per stage.
READS_BUDGET = 40  # issue 39


def _conv_net(depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    module = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.BatchNorm2d):
                layer.running_mean.uniform_(-1, 1)
                layer.running_var.uniform_(0.5, 2)
                layer.weight.uniform_(0.5, 2)
    return module.eval()


def _reads_of_a_rescale(depth: int) -> int:
    with fake_cuda.installed() as mode:
        pathcond.rescale_module(_conv_net(depth), (3, 8, 8), device="cuda")
    return sum(mode.syncs.values())


def test_a_whole_rescale_reads_the_device_a_bounded_number_of_times_whatever_the_depth():
    shallow, deep = _reads_of_a_rescale(2), _reads_of_a_rescale(8)
    assert shallow <= READS_BUDGET and deep <= READS_BUDGET, (shallow, deep)
    assert deep <= 1.2 * shallow, (shallow, deep)


def test_rescaled_checkpoint_tensors_are_computed_on_the_host_from_one_copy_of_u():
    graph, params = graph_from_module(_conv_net(4), (3, 8, 8), source="conv net")
    on_cpu = build_groups(graph, params)
    u = torch.randn(on_cpu.num_free, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = dict(on_cpu.apply(params, u))
    with fake_cuda.installed() as mode:
        on_device = on_cpu.to("cuda")
        rescaled = on_device.apply(params, u.to("cuda"))
        before = dict(mode.syncs)
        computed = dict(rescaled)
        copies = {kind: count - before.get(kind, 0) for kind, count in mode.syncs.items()}
    assert len(computed) == len(expected) > 4
    assert sum(copies.values()) == 1, copies  # u, once, not a copy per tensor
    for key, tensor in computed.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, expected[key]), key


def test_newton_off_the_cpu_takes_the_same_steps_as_on_the_cpu():
    """Off the CPU, Newton sets up its next step at each trial point before reading F there (the
    coarse correction's flags travel with F); the steps, F and the passes are those of the CPU's."""
    from pathcond_cli.engine.diag import diag_g
    from pathcond_cli.solve.solvers import solve

    graph, params = graph_from_module(_conv_net(4), (3, 8, 8), source="conv net")
    groups = build_groups(graph, params)
    diag = diag_g(groups)
    on_cpu = solve(groups, diag, device="cpu")
    with fake_cuda.installed():
        off_cpu = solve(groups, diag, device="cuda")
    assert on_cpu.iterations >= 2 and off_cpu.iterations == on_cpu.iterations
    assert off_cpu.objective == on_cpu.objective and off_cpu.passes == on_cpu.passes
    assert torch.equal(off_cpu.u, on_cpu.u)
