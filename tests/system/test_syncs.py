"""Issue 39: a whole rescale reads device values on the host a bounded number of times, whatever
the network's depth (fake CUDA device; the counts are deterministic).

Counted: reads of values (``.item()``, ``.tolist()``, ``float()``, ``bool()``, ...), each a wait
for the device on a GPU. The copies of the rescaled tensors to the host, where the checkpoint
lives, are counted apart (``cpu``): they are the data a write or a verification needs.
"""

from __future__ import annotations

import fake_cuda
import torch

import pathcond_cli as pathcond

# Newton's solve reads about two values per pass (its step and its stopping test); the rest of
# the run a handful per stage.
READS_BUDGET = 60


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
    return sum(count for kind, count in mode.syncs.items() if kind != "cpu")


def test_a_whole_rescale_reads_the_device_a_bounded_number_of_times_whatever_the_depth():
    shallow, deep = _reads_of_a_rescale(2), _reads_of_a_rescale(8)
    assert shallow <= READS_BUDGET and deep <= READS_BUDGET, (shallow, deep)
    assert deep <= 1.2 * shallow, (shallow, deep)
