"""Small ReLU networks and their ONNX exports, shared by the ONNX format tests."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from collections.abc import Callable, Iterator

import fake_cuda
import pytest
import torch
from dynamo_registry import composite_ops_listed_once, torchlib_registry_built_once
from export_cache import shared_export
from torch import nn

EXPORTERS = ("torchscript", "torchscript-unfolded", "dynamo")


def _randomize_batchnorm(module: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine terms, so folding them is really tested."""
    for bn in module.modules():
        if isinstance(bn, (nn.BatchNorm1d, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.5, 0.5)
    return module


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResidualNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block = ResidualBlock(4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.block(self.stem(x))), 1))


class ConcatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.narrow = nn.Conv2d(3, 2, 1)
        self.wide = nn.Conv2d(3, 3, 3, padding=1)
        self.fc = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.cat([self.narrow(x), self.wide(x)], dim=1))
        return self.fc(x.mean((2, 3)))


class MatMulNet(nn.Module):
    """Explicit ``x @ Wᵀ + b`` and a bias-free Linear: exporters emit MatMul (+ Add) for these."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 7, bias=False)
        self.second = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        return x @ self.second.weight.t() + self.second.bias


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 5),
    )


def avgpool() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False, ceil_mode=True),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def conv1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 4, 5, stride=2, padding=2),
        nn.BatchNorm1d(4),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, padding=2, dilation=2, groups=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def leaky() -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.BatchNorm1d(6),
        nn.LeakyReLU(0.1),
        nn.Linear(6, 6),
        nn.LeakyReLU(0.3),
        nn.Linear(6, 2),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (6,)),
    "cnn": (cnn, (3, 8, 8)),
    "residual": (ResidualNet, (3, 6, 6)),
    "concat": (ConcatNet, (3, 5, 5)),
    "avgpool": (avgpool, (3, 8, 8)),
    "conv1d": (conv1d, (2, 16)),
    "leaky": (leaky, (5,)),
    "matmul": (MatMulNet, (6,)),
}


def build(name: str, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The named network, seeded and in eval mode."""
    factory, _ = MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        module = _randomize_batchnorm(factory())
    return module.to(dtype).eval()


def example_input(name: str, batch: int = 3, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(batch, *MODELS[name][1], generator=generator).to(dtype)


@functools.lru_cache(maxsize=None)
def exported(name: str, exporter: str, dtype: torch.dtype = torch.float32) -> bytes:
    """The network exported by ``exporter``, batch dimension symbolic (cached: exports are slow)."""
    return export(build(name, dtype=dtype), example_input(name, dtype=dtype), exporter)


def export(module: nn.Module, example: torch.Tensor, exporter: str) -> bytes:
    """ONNX bytes of ``module``; the torch.export exporter is skipped where the environment lacks it.
    Made once per run for the same network and input (:mod:`export_cache`)."""
    if exporter not in EXPORTERS:
        raise ValueError(f"no exporter {exporter!r}: one of {EXPORTERS}")
    return shared_export(module, example, exporter, lambda: _export(module, example, exporter))


def _export(module: nn.Module, example: torch.Tensor, exporter: str) -> bytes:
    if exporter == "dynamo":
        return _export_dynamo(module, example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buffer = io.BytesIO()
        with fake_cuda.suspended():  # nor can the TorchScript tracer
            torch.onnx.export(
                module,
                (example,),
                buffer,
                dynamo=False,
                input_names=["x"],
                output_names=["y"],
                dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
                do_constant_folding=exporter == "torchscript",
            )
        return buffer.getvalue()


def _export_dynamo(module: nn.Module, example: torch.Tensor) -> bytes:
    with dynamo_exporting():
        program = torch.onnx.export(
            module, (example,), dynamo=True, verbose=False, dynamic_shapes=({0: torch.export.Dim("batch")},)
        )
    return program.model_proto.SerializeToString()


@contextlib.contextmanager
def dynamo_exporting() -> Iterator[None]:
    """Around a ``torch.onnx.export(dynamo=True)``: quiet, off the fake CUDA device (torch.export
    cannot trace under a torch function mode), with torchlib's registry and torch.export's list
    of composite ops made once per process (:mod:`dynamo_registry`). An exporter that fails is
    the environment's, not pathcond's: the test is skipped."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), fake_cuda.suspended():
            warnings.simplefilter("ignore")
            with torchlib_registry_built_once(), composite_ops_listed_once():
                yield
    except Exception as exc:  # noqa: BLE001 - any failure here is the environment's, not pathcond's
        pytest.skip(f"torch.onnx.export(dynamo=True) is unavailable here: {type(exc).__name__}: {exc}")
    finally:
        logging.disable(previous)
