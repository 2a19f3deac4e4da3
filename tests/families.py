"""The model families pathcond must rescale exactly, as plain ``torch.nn``.

No torchvision: every architecture is written here, or imported from
:mod:`reference_models` where that file already has it (ResNet, VGG, AlexNet, MnasNet,
Inception-v3 and their building blocks). Each family has a **small** factory (a few
thousand to a few tens of thousands of parameters, small inputs: the default test run) and a
**full-size** factory (the published architecture: ``slow`` tests). Factories draw from
torch's global RNG, so ``torch.manual_seed(s); factory()`` is deterministic, and return the
module in eval mode; small factories give every BatchNorm non-trivial running statistics
and affine terms (``reference_models.randomize_batchnorm``).

Full-size layouts follow torchvision's module structure (same attribute names where the
family exists there), so their parameter counts can be compared with torchvision's
published ones; the docstrings say which counts are torchvision's and which are only what
the code here builds. Deviations kept on purpose, all function-preserving or outside the
architecture proper:

- no module instance is applied twice in one forward pass (torchvision's ResNet blocks
  reuse one ``relu``; here each use has its own, which is the same function);
- DenseNet's memory-efficient checkpointing and GoogLeNet's auxiliary heads and
  ``transform_input`` are left out (the counts quoted are torchvision's without them);
- U-Net's size-matching ``F.pad`` is left out: inputs are multiples of 16, where it is a no-op;
- M5 ends with global average pooling and logits (no log-softmax, which is not homogeneous).

``FAMILIES`` maps a family name to its :class:`Family` record (factories, input shapes and
the full-size parameter count where torchvision publishes one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from reference_models import (
    VGG,
    AlexNet,
    Bottleneck,
    ResNet,
    _BasicConv2d,
    _conv1x1,
    _conv3x3,
    _finish,
    _vgg_features,
    alexnet,
    inception_v3,
    mnasnet,
    resnet50,
    small_inception_v3,
    small_mnasnet,
    small_resnet,
)
from torch import Tensor, nn

_Width = Callable[[int], int]


def _scaled(width: float) -> _Width:
    """Channel count scaled by ``width`` (at least 1): one rule for every scaled family."""
    return lambda channels: max(1, round(channels * width))


# --------------------------------------------------------------------------
# VGG with BatchNorm, AlexNet (full size from reference_models)
# --------------------------------------------------------------------------

VGG11_CFG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
VGG16_CFG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg11_bn(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``vgg11_bn``: 132,868,840 parameters (VGG-11's 132,863,336 + 2·2,752 BN)."""
    return _finish(VGG(_vgg_features(VGG11_CFG, batch_norm=True), num_classes), random_bn)


def vgg16_bn(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``vgg16_bn``: 138,365,992 parameters (VGG-16's 138,357,544 + 2·4,224 BN)."""
    return _finish(VGG(_vgg_features(VGG16_CFG, batch_norm=True), num_classes), random_bn)


class SmallVGG(nn.Module):
    """VGG's features (conv3x3-BN-ReLU, 2x2 max pools) with a narrow classifier of the same
    shape as torchvision's (adaptive pool, Linear-ReLU-Dropout twice, Linear)."""

    def __init__(self, cfg: Sequence[int | str], pooled: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.features = _vgg_features(cfg, batch_norm=True)
        channels = [c for c in cfg if c != "M"][-1]
        self.avgpool = nn.AdaptiveAvgPool2d((pooled, pooled))
        self.classifier = nn.Sequential(
            nn.Linear(int(channels) * pooled * pooled, hidden),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _small_vgg_bn(cfg: Sequence[int | str], divisor: int, cap: int, num_classes: int, random_bn: bool) -> nn.Module:
    narrow = [v if v == "M" else min(cap, int(v) // divisor) for v in cfg]
    return _finish(SmallVGG(narrow, pooled=1, hidden=32, num_classes=num_classes), random_bn)


def small_vgg11_bn(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """VGG-11-BN at 1/8 width (capped at 32) with a 32-wide classifier, for 32x32 inputs."""
    return _small_vgg_bn(VGG11_CFG, 8, 32, num_classes, random_bn)


def small_vgg16_bn(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """VGG-16-BN at 1/16 width (capped at 16) with a 32-wide classifier, for 32x32 inputs."""
    return _small_vgg_bn(VGG16_CFG, 16, 16, num_classes, random_bn)


class ScaledAlexNet(nn.Module):
    """torchvision's AlexNet with every convolution width multiplied by ``width`` and a
    ``hidden``-wide classifier (``ScaledAlexNet(1, 4096)`` has ``reference_models.alexnet``'s
    layout; the full-size family member is that one)."""

    forward = AlexNet.forward

    def __init__(self, width: float, hidden: int, num_classes: int) -> None:
        super().__init__()
        w = _scaled(width)
        self.features = nn.Sequential(
            nn.Conv2d(3, w(64), kernel_size=11, stride=4, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(w(64), w(192), kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(w(192), w(384), kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w(384), w(256), kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w(256), w(256), kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(w(256) * 6 * 6, hidden),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


def small_alexnet(num_classes: int = 10) -> nn.Module:
    """AlexNet at 1/16 width and a 16-wide classifier, for 224x224 inputs (AlexNet's own)."""
    return _finish(ScaledAlexNet(1 / 16, 16, num_classes))


# --------------------------------------------------------------------------
# ResNeXt and Wide-ResNet (reference ResNet with grouped/widened bottlenecks)
# --------------------------------------------------------------------------


def grouped_bottleneck(groups: int, width_per_group: int) -> type[Bottleneck]:
    """torchvision's Bottleneck with ``groups`` and ``base_width``: inner width
    ``int(planes · width_per_group / 64) · groups``, the 3x3 conv grouped. ResNeXt-50 32x4d is
    (32, 4); Wide-ResNet-50-2 is (1, 128)."""

    class GroupedBottleneck(Bottleneck):
        def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
            super().__init__(inplanes, planes, stride, downsample)
            width = int(planes * width_per_group / 64) * groups
            self.conv1 = _conv1x1(inplanes, width)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = _conv3x3(width, width, stride, groups)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = _conv1x1(width, planes * self.expansion)

    GroupedBottleneck.__name__ = GroupedBottleneck.__qualname__ = f"Bottleneck{groups}x{width_per_group}d"
    return GroupedBottleneck


def resnext50_32x4d(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``resnext50_32x4d``: 25,028,904 parameters."""
    return _finish(ResNet(grouped_bottleneck(32, 4), [3, 4, 6, 3], num_classes), random_bn)


def wide_resnet50_2(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``wide_resnet50_2``: 68,883,240 parameters."""
    return _finish(ResNet(grouped_bottleneck(1, 128), [3, 4, 6, 3], num_classes), random_bn)


def _small_bottleneck_net(block: type[Bottleneck], num_classes: int, random_bn: bool) -> nn.Module:
    model = ResNet(
        block, [1, 1], num_classes, widths=(8, 16), stem_kernel=3, stem_stride=1, stem_pool=True, stem_width=16
    )
    return _finish(model, random_bn)


def small_resnext(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Two ResNeXt stages (cardinality 4, 4 channels per group at the first stage), 32x32 inputs."""
    return _small_bottleneck_net(grouped_bottleneck(4, 16), num_classes, random_bn)


def small_wide_resnet(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Two Wide-ResNet stages (bottleneck width x2, as WRN-50-2), 32x32 inputs."""
    return _small_bottleneck_net(grouped_bottleneck(1, 128), num_classes, random_bn)


# --------------------------------------------------------------------------
# Pre-activation ResNet (He et al., "Identity mappings in deep residual networks")
# --------------------------------------------------------------------------


class PreActBlock(nn.Module):
    """BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus the shortcut; a projection shortcut (1x1 conv,
    no BN) reads the block's pre-activated input, as in the paper's CIFAR code."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.relu1 = nn.ReLU()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv2 = _conv3x3(planes, planes)
        self.shortcut = _conv1x1(in_planes, planes, stride) if stride != 1 or in_planes != planes else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv2(self.relu2(self.bn2(self.conv1(out))))
        return out + shortcut


class PreActResNet(nn.Module):
    """CIFAR pre-activation ResNet: conv3x3 stem, stages of :class:`PreActBlock` (strides
    1-2-2-2), final BN-ReLU, global average pool, fc."""

    def __init__(self, blocks: Sequence[int], widths: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(3, widths[0])
        layers: list[nn.Module] = []
        c = widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            for j in range(n):
                layers.append(PreActBlock(c, w, 2 if i > 0 and j == 0 else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn(self.layers(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def preact_resnet18(num_classes: int = 10, random_bn: bool = False) -> nn.Module:
    """Pre-activation ResNet-18 for CIFAR (32x32): 11,172,170 parameters as built here."""
    return _finish(PreActResNet([2, 2, 2, 2], [64, 128, 256, 512], num_classes), random_bn)


def small_preact_resnet(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Two pre-activation stages (8 and 16 channels, two blocks each), 32x32 inputs."""
    return _finish(PreActResNet([2, 2], [8, 16], num_classes), random_bn)


# --------------------------------------------------------------------------
# DenseNet (torchvision layout: DenseNet-BC bottleneck layers)
# --------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1 (bn_size·growth) - BN-ReLU-conv3x3 (growth) on the concatenation of
    every earlier feature map of the block (torchvision re-concatenates them per layer)."""

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        bottleneck = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_channels + i * growth_rate, growth_rate, bn_size)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)


class DenseNet(nn.Module):
    """torchvision's DenseNet: conv7x7/2-BN-ReLU-maxpool stem, dense blocks with halving
    transitions, final BN, ReLU, global average pool, classifier."""

    def __init__(
        self,
        growth_rate: int,
        block_config: Sequence[int],
        num_init_features: int,
        bn_size: int = 4,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, 7, stride=2, padding=3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU())
        self.features.add_module("pool0", nn.MaxPool2d(3, stride=2, padding=1))
        c = num_init_features
        for i, n in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(n, c, growth_rate, bn_size))
            c += n * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(c, c // 2))
                c //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(c))
        self.classifier = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.features(x))
        out = F.adaptive_avg_pool2d(out, (1, 1))
        return self.classifier(torch.flatten(out, 1))


def densenet121(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``densenet121``: 7,978,856 parameters."""
    return _finish(DenseNet(32, (6, 12, 24, 16), 64, 4, num_classes), random_bn)


def small_densenet_bc(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """DenseNet-BC with growth 4, blocks (2, 2), 8 stem channels, bottleneck x2; 32x32 inputs."""
    return _finish(DenseNet(4, (2, 2), 8, 2, num_classes), random_bn)


# --------------------------------------------------------------------------
# SqueezeNet 1.0 / 1.1 (torchvision layout)
# --------------------------------------------------------------------------


class Fire(nn.Module):
    def __init__(self, in_channels: int, squeeze: int, expand1x1: int, expand3x3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze, 1)
        self.squeeze_activation = nn.ReLU()
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, 1)
        self.expand1x1_activation = nn.ReLU()
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, 3, padding=1)
        self.expand3x3_activation = nn.ReLU()
        self.out_channels = expand1x1 + expand3x3

    def forward(self, x: Tensor) -> Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat(
            [self.expand1x1_activation(self.expand1x1(x)), self.expand3x3_activation(self.expand3x3(x))], 1
        )


class SqueezeNet(nn.Module):
    """torchvision's SqueezeNet ``version`` "1_0" or "1_1" (ceil-mode 3x3/2 max pools, fire
    modules, dropout + 1x1 conv classifier + ReLU + global average pool), every channel count
    scaled by ``width``. No BatchNorm (as published)."""

    _FIRES = {
        "1_0": [(16, 64), (16, 64), (32, 128), "M", (32, 128), (48, 192), (48, 192), (64, 256), "M", (64, 256)],
        "1_1": [(16, 64), (16, 64), "M", (32, 128), (32, 128), "M", (48, 192), (48, 192), (64, 256), (64, 256)],
    }

    def __init__(self, version: str = "1_0", num_classes: int = 1000, width: float = 1.0) -> None:
        super().__init__()
        w = _scaled(width)
        stem = nn.Conv2d(3, w(96), 7, stride=2) if version == "1_0" else nn.Conv2d(3, w(64), 3, stride=2)
        layers: list[nn.Module] = [stem, nn.ReLU(), nn.MaxPool2d(3, stride=2, ceil_mode=True)]
        c = stem.out_channels
        for entry in self._FIRES[version]:
            if entry == "M":
                layers.append(nn.MaxPool2d(3, stride=2, ceil_mode=True))
                continue
            squeeze, expand = entry
            layers.append(Fire(c, w(squeeze), w(expand), w(expand)))
            c = 2 * w(expand)
        self.features = nn.Sequential(*layers)
        final_conv = nn.Conv2d(c, num_classes, 1)
        self.classifier = nn.Sequential(nn.Dropout(p=0.5), final_conv, nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


def squeezenet1_0(num_classes: int = 1000) -> nn.Module:
    """torchvision ``squeezenet1_0``: 1,248,424 parameters."""
    return _finish(SqueezeNet("1_0", num_classes))


def squeezenet1_1(num_classes: int = 1000) -> nn.Module:
    """torchvision ``squeezenet1_1``: 1,235,496 parameters."""
    return _finish(SqueezeNet("1_1", num_classes))


def small_squeezenet1_0(num_classes: int = 10) -> nn.Module:
    """SqueezeNet 1.0 at 1/8 width; at 32x32 every ceil-mode pool keeps a partial window."""
    return _finish(SqueezeNet("1_0", num_classes, width=1 / 8))


def small_squeezenet1_1(num_classes: int = 10) -> nn.Module:
    """SqueezeNet 1.1 at 1/8 width; at 36x36 its ceil-mode pools keep partial windows."""
    return _finish(SqueezeNet("1_1", num_classes, width=1 / 8))


# --------------------------------------------------------------------------
# ShuffleNetV2 (torchvision layout)
# --------------------------------------------------------------------------


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    """torchvision's channel shuffle: view as (groups, C/groups), transpose, flatten back."""
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, -1, height, width)


def _depthwise(channels: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, 3, stride=stride, padding=1, groups=channels, bias=False)


class ShuffleUnit(nn.Module):
    """torchvision's ShuffleNetV2 InvertedResidual: stride 1 splits the channels in two
    (``chunk``) and transforms one half; stride 2 transforms both copies; then concat and
    channel shuffle."""

    def __init__(self, inp: int, oup: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        branch = oup // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                _depthwise(inp, stride),
                nn.BatchNorm2d(inp),
                nn.Conv2d(inp, branch, 1, bias=False),
                nn.BatchNorm2d(branch),
                nn.ReLU(inplace=True),
            )
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if stride > 1 else branch, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True),
            _depthwise(branch, stride),
            nn.BatchNorm2d(branch),
            nn.Conv2d(branch, branch, 1, bias=False),
            nn.BatchNorm2d(branch),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(
        self, stages_repeats: Sequence[int], stages_out_channels: Sequence[int], num_classes: int = 1000
    ) -> None:
        super().__init__()
        c = stages_out_channels[0]
        self.conv1 = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for i, (repeats, out) in enumerate(zip(stages_repeats, stages_out_channels[1:])):
            units = [ShuffleUnit(c, out, 2)] + [ShuffleUnit(out, out, 1) for _ in range(repeats - 1)]
            setattr(self, f"stage{i + 2}", nn.Sequential(*units))
            c = out
        last = stages_out_channels[-1]
        self.conv5 = nn.Sequential(nn.Conv2d(c, last, 1, 1, 0, bias=False), nn.BatchNorm2d(last), nn.ReLU(inplace=True))
        self.fc = nn.Linear(last, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.conv1(x))
        x = self.stage4(self.stage3(self.stage2(x)))
        x = self.conv5(x)
        return self.fc(x.mean([2, 3]))


def shufflenet_v2_x1_0(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``shufflenet_v2_x1_0``: 2,278,604 parameters."""
    return _finish(ShuffleNetV2([4, 8, 4], [24, 116, 232, 464, 1024], num_classes), random_bn)


def small_shufflenet_v2(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """ShuffleNetV2 with repeats (1, 2, 1) and widths 8-16-32-32-64, for 32x32 inputs."""
    return _finish(ShuffleNetV2([1, 2, 1], [8, 16, 32, 32, 64], num_classes), random_bn)


# --------------------------------------------------------------------------
# GoogLeNet (torchvision layout, no auxiliary heads)
# --------------------------------------------------------------------------


class GoogLeNetInception(nn.Module):
    """torchvision's GoogLeNet Inception block: 1x1 / 1x1-3x3 / 1x1-3x3 (torchvision's
    "5x5" branch is a 3x3) / ceil-mode 3x3 max pool-1x1, concatenated."""

    def __init__(
        self, in_channels: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int, pool_proj: int
    ) -> None:
        super().__init__()
        self.branch1 = _BasicConv2d(in_channels, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(
            _BasicConv2d(in_channels, ch3x3red, kernel_size=1), _BasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1)
        )
        self.branch3 = nn.Sequential(
            _BasicConv2d(in_channels, ch5x5red, kernel_size=1), _BasicConv2d(ch5x5red, ch5x5, kernel_size=3, padding=1)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), _BasicConv2d(in_channels, pool_proj, kernel_size=1)
        )
        self.out_channels = ch1x1 + ch3x3 + ch5x5 + pool_proj

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    """torchvision's GoogLeNet without auxiliary heads, every channel count scaled by ``width``."""

    _BLOCKS = {
        "inception3a": (64, 96, 128, 16, 32, 32),
        "inception3b": (128, 128, 192, 32, 96, 64),
        "inception4a": (192, 96, 208, 16, 48, 64),
        "inception4b": (160, 112, 224, 24, 64, 64),
        "inception4c": (128, 128, 256, 24, 64, 64),
        "inception4d": (112, 144, 288, 32, 64, 64),
        "inception4e": (256, 160, 320, 32, 128, 128),
        "inception5a": (256, 160, 320, 32, 128, 128),
        "inception5b": (384, 192, 384, 48, 128, 128),
    }

    def __init__(self, num_classes: int = 1000, width: float = 1.0) -> None:
        super().__init__()
        w = _scaled(width)
        self.conv1 = _BasicConv2d(3, w(64), kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = _BasicConv2d(w(64), w(64), kernel_size=1)
        self.conv3 = _BasicConv2d(w(64), w(192), kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        c = w(192)
        for name, channels in self._BLOCKS.items():
            block = GoogLeNetInception(c, *map(w, channels))
            setattr(self, name, block)
            c = block.out_channels
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=0.2)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=0.01, a=-2, b=2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4c(self.inception4b(self.inception4a(x)))
        x = self.maxpool4(self.inception4e(self.inception4d(x)))
        x = self.inception5b(self.inception5a(x))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


def googlenet(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``googlenet`` without its auxiliary heads: 6,624,904 parameters."""
    return _finish(GoogLeNet(num_classes), random_bn)


def small_googlenet(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """GoogLeNet at 1/16 width; at 32x32 and 64x64 inputs its ceil-mode pools keep partial
    windows (32x32: 16 -> 8 -> 4 -> 2 -> 1 where floor mode gives 16 -> 7 -> 3 -> 1)."""
    return _finish(GoogLeNet(num_classes, width=1 / 16), random_bn)


# --------------------------------------------------------------------------
# RegNetX (torchvision layout: grouped bottlenecks, no squeeze-excitation)
# --------------------------------------------------------------------------


def _make_divisible(value: float, divisor: int) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded if rounded >= 0.9 * value else rounded + divisor


def regnet_stages(depth: int, w_0: int, w_a: float, w_m: float, group_width: int) -> list[tuple[int, int, int]]:
    """(width, depth, group width) per stage from RegNet's quantised linear width rule
    (Radosavovic et al. 2020, torchvision's ``BlockParams.from_init_params`` with bottleneck
    multiplier 1)."""
    widths_cont = torch.arange(depth, dtype=torch.float64, device="cpu") * w_a + w_0
    capacity = torch.round(torch.log(widths_cont / w_0) / math.log(w_m))
    block_widths = (torch.round(w_0 * torch.pow(w_m, capacity) / 8) * 8).int().tolist()
    stages: list[tuple[int, int, int]] = []
    for width in block_widths:
        if stages and stages[-1][0] == width:
            stages[-1] = (width, stages[-1][1] + 1, 0)
        else:
            stages.append((width, 1, 0))
    adjusted = []
    for width, count, _ in stages:
        group = min(group_width, width)
        adjusted.append((_make_divisible(width, group), count, group))
    return adjusted


class RegNetBlock(nn.Module):
    """ResBottleneckBlock: 1x1-BN-ReLU, grouped 3x3 (stride)-BN-ReLU, 1x1-BN, projection
    shortcut (1x1 conv + BN) when the shape changes, ReLU after the sum."""

    def __init__(self, width_in: int, width_out: int, stride: int, group_width: int) -> None:
        super().__init__()
        self.proj = (
            nn.Sequential(nn.Conv2d(width_in, width_out, 1, stride=stride, bias=False), nn.BatchNorm2d(width_out))
            if width_in != width_out or stride != 1
            else None
        )
        self.f = nn.Sequential(
            nn.Conv2d(width_in, width_out, 1, bias=False),
            nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(width_out, width_out, 3, stride=stride, padding=1, groups=width_out // group_width, bias=False),
            nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(width_out, width_out, 1, bias=False),
            nn.BatchNorm2d(width_out),
        )
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.proj is None else self.proj(x)
        return self.activation(shortcut + self.f(x))


class RegNet(nn.Module):
    """torchvision's RegNet (X variant): conv3x3/2-BN-ReLU stem, stride-2 stages of
    :class:`RegNetBlock`, global average pool, fc."""

    def __init__(self, stages: Sequence[tuple[int, int, int]], stem_width: int = 32, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem_width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(stem_width),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        c = stem_width
        for width, count, group in stages:
            stage = [RegNetBlock(c if i == 0 else width, width, 2 if i == 0 else 1, group) for i in range(count)]
            blocks.append(nn.Sequential(*stage))
            c = width
        self.trunk_output = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(
                    m.weight, mean=0.0, std=math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels))
                )
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.trunk_output(self.stem(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def regnet_x_200mf(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``regnet_x_200mf`` (depth 13, w0 24, wa 36.44, wm 2.49, group width 8):
    2,684,792 parameters."""
    return _finish(RegNet(regnet_stages(13, 24, 36.44, 2.49, 8), num_classes=num_classes), random_bn)


def regnet_x_400mf(num_classes: int = 1000, random_bn: bool = False) -> nn.Module:
    """torchvision ``regnet_x_400mf`` (depth 22, w0 24, wa 24.48, wm 2.54, group width 16):
    5,495,976 parameters."""
    return _finish(RegNet(regnet_stages(22, 24, 24.48, 2.54, 16), num_classes=num_classes), random_bn)


def small_regnet_x(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """RegNetX from the same width rule (depth 4, w0 8, wa 8, wm 2, group width 4: stages
    8x1, 16x1, 32x2) with an 8-wide stem, for 32x32 inputs."""
    return _finish(RegNet(regnet_stages(4, 8, 8.0, 2.0, 4), stem_width=8, num_classes=num_classes), random_bn)


# --------------------------------------------------------------------------
# U-Net (Ronneberger et al. 2015 with "same" padding and BatchNorm)
# --------------------------------------------------------------------------


class DoubleConv(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int, mid_channels: Optional[int] = None) -> None:
        mid = mid_channels or out_channels
        super().__init__(
            nn.Conv2d(in_channels, mid, 3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Down(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))


class Up(nn.Module):
    """Up-sample (ConvTranspose2d 2x2/2 halving the channels, or bilinear ``nn.Upsample``),
    concatenate the skip connection, DoubleConv."""

    def __init__(self, in_channels: int, out_channels: int, bilinear: bool) -> None:
        super().__init__()
        if bilinear:
            self.up: nn.Module = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """U-Net with ``depth`` down/up levels starting at ``base`` channels (the published
    network: depth 4, base 64); bilinear up-sampling halves the bottom width, as in the
    widely used PyTorch implementation (milesial/Pytorch-UNet). Input sides must be
    multiples of 2**depth."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 2, base: int = 64, depth: int = 4, bilinear: bool = False
    ) -> None:
        super().__init__()
        factor = 2 if bilinear else 1
        widths = [base * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, base)
        self.downs = nn.ModuleList(
            Down(widths[i], widths[i + 1] // (factor if i == depth - 1 else 1)) for i in range(depth)
        )
        self.ups = nn.ModuleList(
            Up(widths[i + 1], widths[i] // (factor if i > 0 else 1), bilinear) for i in reversed(range(depth))
        )
        self.outc = nn.Conv2d(base, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


def unet(bilinear: bool = False, random_bn: bool = False) -> nn.Module:
    """The published U-Net widths (64 ... 1024) with "same" padding and BatchNorm:
    31,037,698 parameters with ConvTranspose2d, 17,263,042 with bilinear up-sampling (as built here)."""
    return _finish(UNet(3, 2, 64, 4, bilinear), random_bn)


def small_unet(bilinear: bool = False, random_bn: bool = True) -> nn.Module:
    """U-Net with base width 4 and three levels, for 3x32x32 inputs."""
    return _finish(UNet(3, 2, 4, 3, bilinear), random_bn)


# --------------------------------------------------------------------------
# M5: 1-D CNN on raw audio (Dai et al. 2017, "Very deep CNNs for raw waveforms")
# --------------------------------------------------------------------------


class M5(nn.Module):
    """Conv1d(80, stride)-BN-ReLU-MaxPool1d(4), then three conv3-BN-ReLU-MaxPool1d(4), global
    average pool over time, Linear."""

    def __init__(
        self, widths: Sequence[int] = (128, 128, 256, 512), stride: int = 4, num_classes: int = 10, in_channels: int = 1
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for i, width in enumerate(widths):
            conv = nn.Conv1d(c, width, 80, stride=stride) if i == 0 else nn.Conv1d(c, width, 3)
            layers += [conv, nn.BatchNorm1d(width), nn.ReLU(), nn.MaxPool1d(4)]
            c = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def m5(num_classes: int = 10, random_bn: bool = False) -> nn.Module:
    """The published M5 (widths 128-128-256-512, first stride 4), for 1x32000 inputs
    (4 s at 8 kHz): 559,114 parameters as built here."""
    return _finish(M5(num_classes=num_classes), random_bn)


def small_m5(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """M5 with widths 4-4-8-8, for 1x4000 inputs."""
    return _finish(M5((4, 4, 8, 8), num_classes=num_classes), random_bn)


# --------------------------------------------------------------------------
# C3D: 3-D CNN on video clips (Tran et al. 2015), with BatchNorm3d
# --------------------------------------------------------------------------


class C3D(nn.Module):
    """conv3d 3x3x3 (+BatchNorm3d) + ReLU stages 1a | 2a | 3a 3b | 4a 4b | 5a 5b, max pools
    (1,2,2) after stage 1 and 2x2x2 after the others (the last padded (0,1,1)), then
    fc6-fc7-fc8 with dropout. ``average_last_pool`` makes pool5 an AvgPool3d."""

    def __init__(
        self,
        widths: Sequence[int] = (64, 128, 256, 512, 512),
        hidden: int = 4096,
        num_classes: int = 487,
        clip: Sequence[int] = (16, 112, 112),
        average_last_pool: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for stage, width in enumerate(widths):
            for _ in range(1 if stage < 2 else 2):
                layers += [nn.Conv3d(c, width, 3, padding=1), nn.BatchNorm3d(width), nn.ReLU()]
                c = width
            if stage == 0:
                layers.append(nn.MaxPool3d((1, 2, 2), stride=(1, 2, 2)))
            elif stage < len(widths) - 1:
                layers.append(nn.MaxPool3d(2, stride=2))
            else:
                pool5 = nn.AvgPool3d if average_last_pool else nn.MaxPool3d
                layers.append(pool5(2, stride=2, padding=(0, 1, 1)))
        self.features = nn.Sequential(*layers)
        with torch.no_grad():
            flat = self.features(torch.zeros(1, 3, *clip)).numel()
        self.classifier = nn.Sequential(
            nn.Linear(flat, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def c3d(num_classes: int = 487, random_bn: bool = False) -> nn.Module:
    """C3D (Sports-1M head) with BatchNorm3d, for 3x16x112x112 clips: 79,996,519 parameters
    as built here."""
    return _finish(C3D(num_classes=num_classes), random_bn)


def small_c3d(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """C3D layout at widths 4-8-8-8-8 with a 16-wide head and an average-pooled stage 5, for
    3x16x32x32 clips."""
    return _finish(C3D((4, 8, 8, 8, 8), 16, num_classes, clip=(16, 32, 32), average_last_pool=True), random_bn)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One family: its small and full-size factories, their input shapes (without the batch
    dimension), and torchvision's parameter count of the full-size network where it has one."""

    small: Callable[[], nn.Module]
    small_shape: tuple[int, ...]
    full: Callable[[], nn.Module]
    full_shape: tuple[int, ...]
    torchvision_parameters: Optional[int] = None


_IMAGENET = (3, 224, 224)
_CIFAR = (3, 32, 32)

FAMILIES: dict[str, Family] = {
    "vgg11_bn": Family(small_vgg11_bn, _CIFAR, vgg11_bn, _IMAGENET, 132_868_840),
    "vgg16_bn": Family(small_vgg16_bn, _CIFAR, vgg16_bn, _IMAGENET, 138_365_992),
    "alexnet": Family(small_alexnet, _IMAGENET, alexnet, _IMAGENET, 61_100_840),
    "resnet": Family(small_resnet, _CIFAR, resnet50, _IMAGENET, 25_557_032),
    "resnext": Family(small_resnext, _CIFAR, resnext50_32x4d, _IMAGENET, 25_028_904),
    "wide_resnet": Family(small_wide_resnet, _CIFAR, wide_resnet50_2, _IMAGENET, 68_883_240),
    "preact_resnet": Family(small_preact_resnet, _CIFAR, preact_resnet18, _CIFAR),
    "densenet": Family(small_densenet_bc, _CIFAR, densenet121, _IMAGENET, 7_978_856),
    "squeezenet1_0": Family(small_squeezenet1_0, _CIFAR, squeezenet1_0, _IMAGENET, 1_248_424),
    "squeezenet1_1": Family(small_squeezenet1_1, (3, 36, 36), squeezenet1_1, _IMAGENET, 1_235_496),
    "shufflenet_v2": Family(small_shufflenet_v2, _CIFAR, shufflenet_v2_x1_0, _IMAGENET, 2_278_604),
    "mnasnet": Family(small_mnasnet, _CIFAR, mnasnet, _IMAGENET, 2_218_512),
    "googlenet_32": Family(small_googlenet, _CIFAR, googlenet, _IMAGENET, 6_624_904),
    "googlenet_64": Family(small_googlenet, (3, 64, 64), googlenet, _IMAGENET, 6_624_904),
    "inception_v3": Family(small_inception_v3, (3, 75, 75), inception_v3, (3, 299, 299), 23_834_568),
    "regnet_x": Family(small_regnet_x, _CIFAR, regnet_x_400mf, _IMAGENET, 5_495_976),
    "unet": Family(small_unet, _CIFAR, unet, (3, 64, 64)),
    "unet_bilinear": Family(lambda: small_unet(bilinear=True), _CIFAR, lambda: unet(bilinear=True), (3, 64, 64)),
    "audio_m5": Family(small_m5, (1, 4000), m5, (1, 32000)),
    "c3d": Family(small_c3d, (3, 16, 32, 32), c3d, (3, 16, 112, 112)),
}
