"""Small torch modules that use the operations beyond Linear/Conv/pool/add/concat.

Shared by the import tests (fx, ONNX with both exporters, spec round trip) and the parity
test. Each entry: name -> (factory, batch-free input shape).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _randomise(module: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=generator) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=generator) * 0.3)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=generator) * 0.3)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=generator) + 0.5)
            elif isinstance(m, nn.PReLU):
                m.weight.copy_(torch.rand(m.weight.shape, generator=generator) * 0.5)
    return module.eval()


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """torchvision's ShuffleNetV2 channel shuffle, size plumbing included."""
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, -1, height, width)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2: stride-1 unit (chunk, branch, cat, shuffle) and a stride-2 unit."""

    def __init__(self, channels: int = 8):
        super().__init__()
        half = channels // 2
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.branch = nn.Sequential(
            nn.Conv2d(half, half, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(),
            nn.Conv2d(half, half, 3, padding=1, groups=half, bias=False),
            nn.BatchNorm2d(half),
            nn.Conv2d(half, half, 1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(),
        )
        self.down1 = nn.Sequential(
            nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels, bias=False),
            nn.BatchNorm2d(channels),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.down2 = nn.Sequential(
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.fc = nn.Linear(2 * channels, 5)

    def forward(self, x):
        x = self.stem(x)
        left, right = x.chunk(2, dim=1)
        x = channel_shuffle(torch.cat((left, self.branch(right)), dim=1), 2)
        x = channel_shuffle(torch.cat((self.down1(x), self.down2(x)), dim=1), 2)
        return self.fc(x.mean([2, 3]))


class SliceScalePad(nn.Module):
    """Slicing, split, zero padding (module and function), constant scaling, PReLU, mean(keepdim)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 6, 3)
        self.act1 = nn.PReLU(6)
        self.pad = nn.ZeroPad2d((1, 0, 2, 1))
        self.conv2 = nn.Conv2d(2, 3, 3)
        self.conv3 = nn.Conv2d(3, 3, 1)
        self.act2 = nn.PReLU()
        self.fc = nn.Linear(10, 4)

    def forward(self, x):
        y = self.act1(self.conv1(x))
        a = y[:, :2]
        b, c = torch.split(y[:, 2:], [3, 1], dim=1)
        a = F.relu(self.conv2(self.pad(a))) * 0.5
        b = self.act2(self.conv3(F.pad(b, (1, 1, 0, 0)))) / 4
        pooled = torch.cat(
            [
                a.mean((2, 3), keepdim=True),
                b.mean([2, 3], keepdim=True) * -2.0,
                F.relu(torch.mean(c, dim=(2, 3), keepdim=True)),
                F.adaptive_avg_pool2d(a, 1),
            ],
            dim=1,
        )
        return self.fc(pooled.flatten(1))


class TinyUNet(nn.Module):
    """Encoder, ConvTranspose decoder with BatchNorm, concat skip."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        )
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2, bias=False)
        self.up_bn = nn.BatchNorm2d(4)
        self.dec = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))

    def forward(self, x):
        skip = self.enc1(x)
        y = F.relu(self.up_bn(self.up(self.enc2(skip))))
        return self.dec(torch.cat([skip, y], dim=1))


class Conv3dNet(nn.Module):
    """3-D conv, BatchNorm3d, ceil-mode max and average pooling, grouped ConvTranspose3d."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(1, 4, 3, padding=1, bias=False),
            nn.BatchNorm3d(4),
            nn.ReLU(),
            nn.MaxPool3d(3, stride=2, ceil_mode=True),
            nn.ConvTranspose3d(4, 4, 2, stride=2, groups=2, output_padding=1, padding=1),
            nn.ReLU(),
            nn.AvgPool3d(2, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
            nn.AdaptiveAvgPool3d(1),
            nn.Flatten(),
            nn.Linear(4, 3),
        )

    def forward(self, x):
        return self.features(x)


class AudioNet(nn.Module):
    """1-d CNN with a transposed convolution and ceil-mode pooling."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(2, 4, 5, stride=2, padding=2),
            nn.BatchNorm1d(4),
            nn.ReLU(),
            nn.MaxPool1d(3, stride=2, ceil_mode=True),
            nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1),
            nn.LeakyReLU(0.1),
            nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True),
        )
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.body(x).mean(-1))


class UpsampleUNet(nn.Module):
    """A two-level U-Net decoding with every 2-d resize torch offers as fixed edges: nearest
    (module), bilinear with a non-integer scale (F.interpolate), UpsamplingBilinear2d
    (align_corners=True) and bilinear to a size; concatenated skips."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.up_nearest = nn.Upsample(scale_factor=2)
        self.up_corners = nn.UpsamplingBilinear2d(scale_factor=2)
        self.dec = nn.Sequential(nn.Conv2d(15, 3, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        skip = self.enc1(x)
        deep = self.enc2(skip)
        wide = F.interpolate(deep, scale_factor=1.5, mode="bilinear")
        y = torch.cat(
            [
                skip,
                self.up_nearest(deep),
                self.up_corners(deep),
                F.interpolate(wide, size=skip.shape[2:], mode="bilinear", align_corners=False),
            ],
            dim=1,
        )
        return self.head(self.dec(y))


class Upsample1d(nn.Module):
    """1-d linear resize to a size with align_corners=True, then nearest by a non-integer scale."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv1d(3, 3, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        x = F.interpolate(F.relu(self.conv1(x)), size=13, mode="linear", align_corners=True)
        x = F.interpolate(F.relu(self.conv2(x)), scale_factor=1.7)
        return self.fc(x.mean(-1))


class Upsample3d(nn.Module):
    """3-d trilinear (per-axis scales) and nearest resizes, concatenated."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(1, 2, 3, padding=1)
        self.up = nn.Upsample(scale_factor=(2, 1, 2), mode="trilinear")
        self.conv2 = nn.Conv3d(4, 3, 1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = torch.cat([self.up(x), F.interpolate(x, scale_factor=(2, 1, 2))], dim=1)
        return self.fc(F.relu(self.conv2(x)).mean([2, 3, 4]))


class PaddingModes(nn.Module):
    """Reflect, replicate and circular padding: F.pad, the padding modules and conv padding_mode."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
        self.conv2 = nn.Conv2d(3, 3, 3)
        self.pad = nn.ReplicationPad2d((1, 0, 2, 1))
        self.conv3 = nn.Conv2d(3, 3, 2, padding=(0, 1), padding_mode="circular")
        self.circular = nn.CircularPad2d(1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(F.pad(x, (1, 1, 2, 0), mode="reflect")))
        x = F.relu(self.conv3(self.pad(x)))
        x = F.max_pool2d(self.circular(x), 3, stride=1)
        return self.fc(x.mean([2, 3]))


class PaddedMaxPool(nn.Module):
    """NASNet-style padded max pooling: −inf padding (asymmetric) before a max-pool."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3)
        self.pad = nn.ConstantPad2d((1, 0, 1, 0), float("-inf"))
        self.conv2 = nn.Conv2d(3, 3, 1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        x = F.max_pool2d(F.pad(self.conv1(x), (0, 1, 0, 1), value=-math.inf), 3, stride=2)
        x = F.max_pool2d(self.pad(self.conv2(F.relu(x))), 2, stride=1)
        return self.fc(F.relu(x).mean([2, 3]))


class ScaleShift(nn.Module):
    """A per-channel scale and shift that follows no conv (BatchNorm exported as Mul and Add)."""

    def __init__(self, channels: int, shift: bool = True):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(channels, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(channels, 1, 1) * 0.3) if shift else None

    def forward(self, x):
        return x * self.scale + self.shift if self.shift is not None else x * self.scale


class RepVGGBlock(nn.Module):
    """RepVGG training block (3×3 conv + 1×1 conv + scaled identity), then a pre-activation
    scale-and-shift and a scale alone."""

    def __init__(self, channels: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(2, channels, 3, padding=1)
        self.conv3 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.identity = ScaleShift(channels)
        self.pre = ScaleShift(channels)
        self.conv = nn.Conv2d(channels, channels, 1)
        self.post = ScaleShift(channels, shift=False)
        self.fc = nn.Linear(channels, 2)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.conv3(x) + self.conv1(x) + self.identity(x))
        x = self.post(self.conv(F.relu(self.pre(x))))
        return self.fc(F.relu(x).mean([2, 3]))


class BroadcastAdd(nn.Module):
    """Sums whose inputs differ by broadcasting: 4 channels plus 1 channel, a map plus its mean."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 1)
        self.wide = nn.Conv2d(3, 4, 3, padding=1)
        self.narrow = nn.Conv2d(3, 1, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.wide(x) + self.narrow(x))
        x = F.relu(x + x.mean([2, 3], keepdim=True))
        return self.fc(x.mean([2, 3]))


class Differences(nn.Module):
    """Differences of activations: two conv branches subtracted (a 1-channel one broadcast over
    three), a negation, and a residual difference ``y - (-conv(y))``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 1)
        self.wide = nn.Conv2d(3, 3, 3, padding=1)
        self.narrow = nn.Conv2d(3, 1, 1)
        self.conv = nn.Conv2d(3, 3, 1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = F.relu(self.wide(x) - self.narrow(x))
        y = F.relu(torch.sub(y, -self.conv(y)))
        return self.fc(y.mean([2, 3]))


OPS_MODELS = {
    "upsample_unet": (UpsampleUNet, (1, 6, 8)),
    "upsample_1d": (Upsample1d, (2, 9)),
    "upsample_3d": (Upsample3d, (1, 3, 4, 3)),
    "shuffle_unit": (ShuffleUnit, (3, 8, 8)),
    "slice_scale_pad": (SliceScalePad, (2, 7, 6)),
    "tiny_unet": (TinyUNet, (1, 8, 8)),
    "conv3d": (Conv3dNet, (1, 6, 5, 6)),
    "audio": (AudioNet, (2, 23)),
    "padding_modes": (PaddingModes, (2, 8, 7)),
    "padded_maxpool": (PaddedMaxPool, (2, 9, 8)),
    "repvgg_block": (RepVGGBlock, (2, 6, 5)),
    "broadcast_add": (BroadcastAdd, (2, 5, 6)),
    "differences": (Differences, (2, 5, 6)),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    factory, shape = OPS_MODELS[name]
    torch.manual_seed(seed)
    return _randomise(factory(), seed), shape
