"""Small networks written the way timm writes its ReLU CNNs (timm itself is not a test dependency).

Each family reproduces one reason the fx route refused timm models that the ONNX route read
(issue 27.2): a BatchNorm subclass that calls ``F.batch_norm`` on its own tensors then its
activation (``BatchNormAct2d``), ``torch._assert`` on shapes, anti-aliased pooling that
convolves with a registered buffer (``BlurPool2d``), a DLA-like projection whose output
reaches nothing, and a forward that branches on the input's shape; or one reason the ONNX
route refused (issue 27.2's last two): NASNet's crops (negative pads) and MobileOne's constant
added in the stem.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BatchNormAct2d(nn.BatchNorm2d):
    """timm.layers.BatchNormAct2d: the BatchNorm's own parameters through ``F.batch_norm``, then the activation."""

    def __init__(self, num_features: int, act_layer: type[nn.Module] = nn.ReLU):
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = act_layer(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        momentum = 0.0 if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            bn_training,
            momentum,
            self.eps,
        )
        return self.act(self.drop(x))


class StdConv2d(nn.Conv2d):
    """A conv that calls ``F.conv2d`` on its own weight (timm's StdConv2d without the standardisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class BlurPool2d(nn.Module):
    """timm.layers.BlurPool2d: reflect padding, then a depthwise conv with a fixed binomial filter buffer."""

    def __init__(self, channels: int, persistent: bool = False):
        super().__init__()
        self.channels = channels
        coeffs = torch.tensor([0.25, 0.5, 0.25])
        blur = (coeffs[:, None] * coeffs[None, :])[None, None].repeat(channels, 1, 1, 1)
        self.register_buffer("filt", blur, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, [1, 1, 1, 1], "reflect")
        return F.conv2d(x, self.filt, stride=2, groups=self.channels)


class BnActNet(nn.Module):
    """A resnet-like stem and block of BatchNormAct2d, a StdConv2d and a head, with shape asserts."""

    def __init__(self):
        super().__init__()
        self.conv1 = StdConv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = BatchNormAct2d(4, act_layer=nn.Identity)
        self.act = nn.ReLU()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.shape[1] == 3, "three input channels")
        y = self.bn1(self.conv1(x))
        y = self.act(y + self.bn2(self.conv2(y)))
        return self.fc(y.mean((2, 3)))


class BlurNet(nn.Module):
    """resnetblur-like: conv, ReLU, BlurPool2d, conv, ReLU, head."""

    def __init__(self, persistent: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.aa = BlurPool2d(4, persistent=persistent)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.fc = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.aa(F.relu(self.conv1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 1), 1))


class DlaLikeNet(nn.Module):
    """DLA's tree level computes ``project(bottom)`` even where the tree does not use it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.project = nn.Sequential(nn.Conv2d(4, 6, 1, bias=False), nn.BatchNorm2d(6))
        self.level = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bottom = self.pool(F.relu(self.conv(x)))
        residual = self.project(bottom)  # noqa: F841 - unused, as in timm's DlaTree with level_root
        y = F.relu(self.level(bottom)) + bottom
        return self.fc(y.mean((2, 3)))


class NasnetCropNet(nn.Module):
    """NASNet's factorised reduction (timm's ``nasnet.FirstCell.path_2``): ``nn.ZeroPad2d((-1, 1, -1, 1))``
    crops one row and column at the top left and zero-pads one at the bottom right before a
    strided 1×1 average pool; a second branch crops by slicing and a third crops and
    reflect-pads in one ``F.pad``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.path_1 = nn.Sequential(nn.AvgPool2d(1, stride=2, count_include_pad=False), nn.Conv2d(4, 3, 1, bias=False))
        self.path_2 = nn.Sequential(
            nn.ZeroPad2d((-1, 1, -1, 1)),
            nn.AvgPool2d(1, stride=2, count_include_pad=False),
            nn.Conv2d(4, 3, 1, bias=False),
        )
        self.final = nn.Conv2d(4, 2, 3)
        self.fc = nn.Linear(9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        sliced = F.relu(self.final(x[:, :, 1:, :-1]))
        cropped = F.pad(x, [-1, 2, 1, -2], mode="reflect")
        reduced = torch.cat([self.path_1(x), self.path_2(x)], dim=1)
        pooled = [reduced.mean((2, 3)), sliced.mean((2, 3)), F.relu(cropped).mean((2, 3))[:, :1]]
        return self.fc(torch.cat(pooled, dim=1))


class ConvNorm(nn.Module):
    """timm's ConvNormAct without its activation: a bias-free conv and its BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class MobileOneBlock(nn.Module):
    """timm.models.byobnet.MobileOneBlock at train time (not reparameterised): parallel conv-BN
    branches, a 1×1 conv-BN scale branch and a BatchNorm identity branch, summed, then ReLU.
    Where the identity branch is absent (the stem changes the width) it adds the number 0,
    which the TorchScript exporter writes as an ``Add`` of a Constant."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, branches: int = 2):
        super().__init__()
        has_identity = in_channels == out_channels and stride == 1
        self.identity = nn.BatchNorm2d(out_channels) if has_identity else None
        self.conv_kxk = nn.ModuleList([ConvNorm(in_channels, out_channels, 3, stride) for _ in range(branches)])
        self.conv_scale = ConvNorm(in_channels, out_channels, 1, stride)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.identity(x) if self.identity is not None else 0
        out = self.conv_scale(x)
        for conv in self.conv_kxk:
            out += conv(x)
        out += identity
        return self.act(out)


class MobileOneNet(nn.Module):
    """mobileone_s0's stem block (no identity branch), a block with one, and a per-channel
    stored shift added to a sum of branches before a ReLU (no layer's own bias)."""

    def __init__(self):
        super().__init__()
        self.stem = MobileOneBlock(3, 4, stride=2)
        self.block = MobileOneBlock(4, 4)
        self.left = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.right = nn.Conv2d(4, 4, 1, bias=False)
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, 4).reshape(4, 1, 1))
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.stem(x))
        x = F.relu(self.left(x) + self.right(x) + self.shift)
        return self.fc(x.mean((2, 3)))


class ShapeBranchNet(nn.Module):
    """A forward that branches on the input's shape: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        if x.shape[-1] > 8:
            x = F.max_pool2d(x, 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def randomized(module: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine terms, so that reading them is really tested."""
    generator = torch.Generator().manual_seed(0)
    for bn in module.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.copy_(torch.rand(bn.num_features, generator=generator) - 0.5)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.weight.data.copy_(torch.rand(bn.num_features, generator=generator) + 0.5)
            bn.bias.data.copy_(torch.rand(bn.num_features, generator=generator) - 0.5)
    return module.eval()


TIMM_LIKE = {
    "timm_bn_act": lambda: (randomized(BnActNet()), (3, 8, 8)),
    "timm_blur": lambda: (randomized(BlurNet()), (3, 8, 8)),
    "timm_dla_unused": lambda: (randomized(DlaLikeNet()), (3, 8, 8)),
    "timm_shape_branch": lambda: (randomized(ShapeBranchNet()), (3, 16, 16)),
    "timm_nasnet_crop": lambda: (randomized(NasnetCropNet()), (3, 8, 8)),
    "timm_mobileone": lambda: (randomized(MobileOneNet()), (3, 8, 8)),
}
