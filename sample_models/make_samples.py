"""Rebuild the sample models deterministically: python sample_models/make_samples.py

- mlp.safetensors + mlp.yaml: an MLP 784 → 256 → 128 → 10 with a sidecar architecture spec.
- cifar_nv_small.safetensors + cifar_nv_small.yaml: a CIFAR-NV-like CNN (narrower) with
  BatchNorm, max pooling and a global average pool.
- resnet_small.onnx: a small CIFAR ResNet (identity and projection shortcuts, BatchNorm
  kept as BatchNormalization nodes), exported with torch.onnx (TorchScript exporter).

BatchNorm statistics are set to non-trivial values so that folding matters.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from pathcond_cli.io.formats.fx_import import graph_from_module
from pathcond_cli.io.formats.spec import spec_from_graph

HERE = Path(__file__).resolve().parent


def _randomise_batchnorm(module: nn.Module, generator: torch.Generator) -> nn.Module:
    for bn in module.modules():
        if isinstance(bn, nn.BatchNorm2d):
            c = bn.num_features
            bn.running_mean.copy_(0.1 * torch.randn(c, generator=generator))
            bn.running_var.copy_(0.5 + torch.rand(c, generator=generator))
            bn.weight.data.copy_(0.5 + torch.rand(c, generator=generator))
            bn.bias.data.copy_(0.1 * torch.randn(c, generator=generator))
    return module.eval()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def cifar_nv_small(width: tuple[int, int, int] = (32, 64, 80)) -> nn.Module:
    a, b, c = width
    return nn.Sequential(
        nn.Conv2d(3, a, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(a, a, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(a, a, 3, padding=1, bias=False),
        nn.BatchNorm2d(a),
        nn.ReLU(),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(a, b, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(b, b, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(b, b, 3, padding=1, bias=False),
        nn.BatchNorm2d(b),
        nn.ReLU(),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(b, c, 3, bias=False),
        nn.ReLU(),
        nn.Conv2d(c, c, 1, bias=False),
        nn.ReLU(),
        nn.Conv2d(c, 10, 1, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + self.shortcut(x))


def resnet_small(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        BasicBlock(width, width, 1),
        BasicBlock(width, width, 1),
        BasicBlock(width, 2 * width, 2),
        BasicBlock(2 * width, 2 * width, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def save_with_spec(module: nn.Module, input_shape: tuple[int, ...], name: str) -> None:
    graph, params = graph_from_module(module, input_shape, source=name)
    spec = spec_from_graph(graph)
    (HERE / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    save_file({k: v.detach().contiguous() for k, v in params.items()}, str(HERE / f"{name}.safetensors"))


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    save_with_spec(mlp().eval(), (784,), "mlp")
    save_with_spec(_randomise_batchnorm(cifar_nv_small(), generator), (3, 32, 32), "cifar_nv_small")
    resnet = _randomise_batchnorm(resnet_small(), generator)
    torch.onnx.export(
        resnet,
        (torch.randn(1, 3, 32, 32),),
        str(HERE / "resnet_small.onnx"),
        dynamo=False,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}},
        opset_version=17,
        do_constant_folding=False,
    )
    for path in sorted(HERE.glob("*.*")):
        if path.suffix in (".safetensors", ".onnx", ".yaml"):
            print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
