"""The suite's shared exports (tests/export_cache.py) hand a test the bytes its own export would make."""

from __future__ import annotations

import copy

import export_cache
import numpy as np
import onnx_models
import pytest
import torch
from torch import nn


def _network() -> nn.Module:
    torch.manual_seed(3)
    return onnx_models._randomize_batchnorm(
        nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    ).eval()


def test_a_dynamo_export_does_not_depend_on_the_examples_batch_size():
    """What lets the key leave the batch size out."""
    module = _network()
    small, large = (onnx_models._export(module, torch.randn(batch, 2, 6, 6), "dynamo") for batch in (2, 5))
    assert small == large


class _Tied(nn.Module):
    """Two linear layers, their weights one tensor or two equal ones."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(4)
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)
        with torch.no_grad():
            self.second.weight.copy_(self.first.weight)
        if tied:
            self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class _Held(nn.Module):
    """A tensor held as a parameter or as a buffer, kept in the state dict or not."""

    def __init__(self, how: str):
        super().__init__()
        value = torch.ones(3)
        if how == "parameter":
            self.scale = nn.Parameter(value)
        else:
            self.register_buffer("scale", value, persistent=how == "buffer")

    def forward(self, x):
        return x * self.scale


def _changed(how: str) -> nn.Module:
    module = _network()
    if how == "weight":
        with torch.no_grad():
            module[0].weight[0, 0, 0, 0] += 1e-6
    elif how == "running statistics":
        module[1].running_var[0] += 1e-3
    elif how == "mode":
        module[1].train()
    elif how == "attribute":
        module[1].eps = 1e-3
    elif how == "tensor attribute":
        module[4].offset = torch.zeros(2)
    elif how == "tensor in a list":
        module[4].offsets = [torch.zeros(2)]
    return module


@pytest.mark.parametrize(
    "how", ["weight", "running statistics", "mode", "attribute", "tensor attribute", "tensor in a list"]
)
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_any_difference_in_what_the_export_may_read_changes_the_key(how, exporter):
    example = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    same = export_cache._key(_network(), example, exporter)
    assert export_cache._key(copy.deepcopy(_network()), example.clone(), exporter) == same
    assert export_cache._key(_changed(how), example, exporter) != same


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tying_and_how_a_tensor_is_held_change_the_key(exporter):
    example = torch.randn(2, 3)
    assert export_cache._key(_Tied(True), example, exporter) != export_cache._key(_Tied(False), example, exporter)
    held = {export_cache._key(_Held(how), example, exporter) for how in ("parameter", "buffer", "non-persistent")}
    assert len(held) == 3


def test_a_network_its_key_cannot_read_is_not_keyed():
    """A hook, an array, a function as attribute, a class defined in a function: exported every time."""
    hooked, holding_an_array, holding_a_function = _network(), _network(), _network()
    hooked[2].register_forward_hook(lambda m, i, o: o)
    holding_an_array[4].table = np.zeros(2)
    holding_a_function[2].activation = torch.relu

    class Local(nn.Module):
        def forward(self, x):
            return x

    for module in (hooked, holding_an_array, holding_a_function, Local()):
        with pytest.raises(export_cache._Unkeyable):
            export_cache._key(module, torch.randn(2, 2, 6, 6), "dynamo")


def test_a_torchscript_key_reads_the_examples_values():
    module, example = _network(), torch.randn(2, 2, 6, 6)
    assert export_cache._key(module, example, "torchscript") != export_cache._key(module, example + 1, "torchscript")


def test_the_shared_bytes_are_the_first_exports(tmp_path, monkeypatch):
    monkeypatch.setenv(export_cache.FOLDER_VARIABLE, str(tmp_path))
    module, example = _network(), torch.randn(2, 2, 6, 6)
    calls = []

    def export() -> bytes:
        calls.append(1)
        return onnx_models._export(module, example, "torchscript")

    first = export_cache.shared_export(module, example, "torchscript", export)
    again = export_cache.shared_export(copy.deepcopy(module), example.clone(), "torchscript", export)
    assert first == again and len(calls) == 1
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".onnx"]
