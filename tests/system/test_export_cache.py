"""The suite's shared exports (tests/export_cache.py) hand a test the bytes its own export would make."""

from __future__ import annotations

import copy

import export_cache
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
    elif how == "hook":
        module[2].register_forward_hook(lambda m, i, o: o)
    return module


@pytest.mark.parametrize("how", ["weight", "running statistics", "mode", "attribute", "tensor attribute", "hook"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_any_difference_the_export_reads_changes_the_key(how, exporter):
    example = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    same = export_cache._key(_network(), example, exporter)
    assert export_cache._key(copy.deepcopy(_network()), example.clone(), exporter) == same
    assert export_cache._key(_changed(how), example, exporter) != same


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
