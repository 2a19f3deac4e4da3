"""Reference ReLU architectures as plain ``torch.nn`` modules (no torchvision).

Every factory returns a module **in eval mode**. Factories draw their initial
weights from torch's global RNG, so ``torch.manual_seed(s); f()`` is
deterministic. All models are ``torch.fx.symbolic_trace``-able: no
data-dependent control flow, ``torch.flatten(x, 1)`` / ``nn.Flatten`` for
flattening, residual adds written with ``+``, channel concatenation with
``torch.cat``, and no module instance (ReLU, pooling, ...) is called twice in
one forward pass.

ImageNet models (exact torchvision layouts, same attribute names so that
torchvision state dicts load with ``strict=True``):

- ``resnet18`` / ``resnet34`` / ``resnet50`` (torchvision v1.5: the stride of a
  Bottleneck sits on its 3x3 conv),
- ``vgg16`` (configuration "D", no BatchNorm),
- ``alexnet``.

Paper models:

- ``cifar_nv``: the fully convolutional CIFAR-NV net of Gitman & Ginsburg (2017)
  as used by ENorm (Stock et al., 2019) and PathCond (see its docstring),
- ``mlp(depth)``: the CIFAR-10 MLPs 3072 -> 500 x depth -> 10.

Inverted-residual and Inception models (torchvision layouts, ReLU throughout):
``mnasnet`` (alpha 0.5 = ``mnasnet0_5``) and ``inception_v3`` (no auxiliary head), with
``small_mnasnet`` / ``small_inception_v3`` versions for fast tests.

Small models (< 100k parameters) for fast tests: ``small_resnet``,
``small_bottleneck_resnet``, ``small_vgg``, ``small_densenet``,
``small_inception``, ``grouped_conv_net``, ``conv1d_net``. Their BatchNorm
layers get non-trivial running statistics and affine parameters by default
(``random_bn=True``) so that BN folding is actually exercised.

``REFERENCE_MODELS`` maps a name to ``(factory, input_shape_without_batch,
expected_parameters or None, expected_hidden_units or None)``; the expected
counts of the six large models are the paper's Table 1 (Appendix I).
``hidden_units(module)`` computes the Table-1 hidden-unit count.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor, nn

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "VGG",
    "vgg16",
    "AlexNet",
    "alexnet",
    "CifarNV",
    "cifar_nv",
    "mlp",
    "small_resnet",
    "small_bottleneck_resnet",
    "small_vgg",
    "small_densenet",
    "small_inception",
    "grouped_conv_net",
    "conv1d_net",
    "MNASNet",
    "mnasnet",
    "small_mnasnet",
    "InceptionV3",
    "inception_v3",
    "small_inception_v3",
    "randomize_batchnorm",
    "calibrate_batchnorm",
    "hidden_units",
    "count_parameters",
    "REFERENCE_MODELS",
    "SMALL_MODELS",
    "TABLE1",
    "TORCHVISION_COUNTS",
]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def count_parameters(module: nn.Module) -> int:
    """``sum(p.numel() for p in module.parameters())``: weights, biases and
    BatchNorm gamma/beta; BatchNorm running statistics are buffers, not counted."""
    return sum(p.numel() for p in module.parameters())


def hidden_units(module: nn.Module) -> int:
    """Hidden-unit count as defined in the PathCond paper, Appendix I / Table 1.

    Sum of the output dimensionality (``out_channels`` of every ``nn.Conv1d/2d/3d``,
    ``out_features`` of every ``nn.Linear``) over all layers except the final
    classification layer. The final layer is the last Conv/Linear module in
    registration order (``module.modules()``); every model in this file registers
    its classifier last. (For CIFAR-NV the classifier is a 1x1 convolution, which
    is why this is not "every layer except the last nn.Linear".) Projection
    shortcuts (ResNet ``downsample`` convs) are counted, as Table 1 requires:
    ResNet-18 = 64 + 4*64 + (4*128 + 128) + (4*256 + 256) + (4*512 + 512) = 4,800.
    """
    layers = [m for m in module.modules() if isinstance(m, _CONV_TYPES + (nn.Linear,))]
    if not layers:
        return 0
    total = 0
    for m in layers[:-1]:
        total += m.out_features if isinstance(m, nn.Linear) else m.out_channels
    return total


@torch.no_grad()
def randomize_batchnorm(module: nn.Module, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Give every BatchNorm non-trivial eval-mode state: running_mean ~ N(0, 0.5²),
    running_var ~ U(0.5, 2), weight ~ U(0.5, 1.5) * random sign, bias ~ N(0, 0.2²).

    Draws from ``generator`` (or the global RNG), so it is deterministic under
    ``torch.manual_seed``. Negative gammas are included on purpose: folding must
    not assume gamma > 0. Returns ``module``.
    """
    for m in module.modules():
        if isinstance(m, _BN_TYPES):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=generator) * 0.5)
            m.running_var.copy_(torch.rand(c, generator=generator) * 1.5 + 0.5)
            if m.affine:
                sign = torch.where(torch.rand(c, generator=generator) < 0.15, -1.0, 1.0)
                m.weight.copy_((torch.rand(c, generator=generator) + 0.5) * sign)
                m.bias.copy_(torch.randn(c, generator=generator) * 0.2)
    return module


def _finish(model: nn.Module, random_bn: bool = False) -> nn.Module:
    if random_bn:
        randomize_batchnorm(model)
    return model.eval()


# --------------------------------------------------------------------------
# ResNet (torchvision layout)
# --------------------------------------------------------------------------


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision BasicBlock; the shared ``relu`` is split into ``relu1``/``relu2``."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.relu2 = nn.ReLU()
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:  # structural, resolved at trace time
            identity = self.downsample(x)
        out = out + identity
        return self.relu2(out)


class Bottleneck(nn.Module):
    """torchvision (v1.5) Bottleneck: 1x1 -> 3x3 (stride here) -> 1x1 (x4)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = _conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = downsample
        self.relu3 = nn.ReLU()
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu3(out)


_Block = Union[Type[BasicBlock], Type[Bottleneck]]


class ResNet(nn.Module):
    """torchvision ResNet, generalised over widths/stem so the small test models reuse it.

    Defaults reproduce torchvision exactly (7x7/2 stem conv, 3x3/2 max-pool,
    widths 64-128-256-512, strides 1-2-2-2, AdaptiveAvgPool2d((1, 1)), fc).
    Init as torchvision: kaiming_normal_(fan_out, relu) for convs, BN gamma=1,
    beta=0, default nn.Linear init for fc.
    """

    def __init__(
        self,
        block: _Block,
        layers: Sequence[int],
        num_classes: int = 1000,
        in_channels: int = 3,
        widths: Sequence[int] = (64, 128, 256, 512),
        stem_kernel: int = 7,
        stem_stride: int = 2,
        stem_pool: bool = True,
        stem_width: Optional[int] = None,
    ) -> None:
        super().__init__()
        if len(widths) != len(layers):
            raise ValueError("widths and layers must have the same length")
        self.inplanes = stem_width if stem_width is not None else widths[0]
        self.conv1 = nn.Conv2d(
            in_channels,
            self.inplanes,
            kernel_size=stem_kernel,
            stride=stem_stride,
            padding=stem_kernel // 2,
            bias=False,
        )
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if stem_pool else nn.Identity()
        for i, (w, n) in enumerate(zip(widths, layers)):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", self._make_layer(block, w, n, stride))
        self.num_stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1] * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: _Block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: List[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):  # static loop, unrolled by fx
            x = getattr(self, f"layer{i + 1}")(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes: int = 1000) -> nn.Module:
    """torchvision ResNet-18: 11,689,512 parameters, 4,800 hidden units (Table 1)."""
    return _finish(ResNet(BasicBlock, [2, 2, 2, 2], num_classes))


def resnet34(num_classes: int = 1000) -> nn.Module:
    """torchvision ResNet-34: 21,797,672 parameters, 8,512 hidden units (Table 1)."""
    return _finish(ResNet(BasicBlock, [3, 4, 6, 3], num_classes))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision ResNet-50 (v1.5): 25,557,032 parameters, 26,560 hidden units."""
    return _finish(ResNet(Bottleneck, [3, 4, 6, 3], num_classes))


# --------------------------------------------------------------------------
# VGG-16 and AlexNet (torchvision layout)
# --------------------------------------------------------------------------

_VGG16_CFG: List[Union[int, str]] = [
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    "M",
]


def _vgg_features(cfg: Sequence[Union[int, str]], in_channels: int = 3, batch_norm: bool = False) -> nn.Sequential:
    layers: List[nn.Module] = []
    c = in_channels
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            v = int(v)
            layers.append(nn.Conv2d(c, v, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(v))
            layers.append(nn.ReLU())
            c = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """torchvision VGG (features / avgpool / classifier), same init as torchvision."""

    def __init__(self, features: nn.Sequential, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg16(num_classes: int = 1000) -> nn.Module:
    """torchvision VGG-16 without BN: 138,357,544 parameters, 12,416 hidden units."""
    return _finish(VGG(_vgg_features(_VGG16_CFG), num_classes))


class AlexNet(nn.Module):
    """torchvision AlexNet (default PyTorch init, as torchvision)."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def alexnet(num_classes: int = 1000) -> nn.Module:
    """torchvision AlexNet: 61,100,840 parameters, 9,344 hidden units (Table 1)."""
    return _finish(AlexNet(num_classes))


# --------------------------------------------------------------------------
# CIFAR-NV
# --------------------------------------------------------------------------


class CifarNV(nn.Module):
    """CIFAR-NV, the fully convolutional CIFAR-10 net of Gitman & Ginsburg (2017).

    Layer list (all convolutions bias-free, "same" padding, stride 1)::

        block 1: conv3x3 3->128, ReLU; conv3x3 128->128, ReLU;
                 conv3x3 128->128, BN(128), ReLU; maxpool 3x3/2 pad 1
        block 2: conv3x3 128->256, ReLU; conv3x3 256->256, ReLU;
                 conv3x3 256->256, BN(256), ReLU; maxpool 3x3/2 pad 1
        block 3: conv3x3 256->320, ReLU; conv1x1 320->320, ReLU;
                 conv1x1 320->num_classes, ReLU; global average pool; flatten
        [optional] BatchNorm1d(num_classes) after the classifier (final_bn=True)

    Provenance. The seed paper only names the net. Its definition comes from
    (i) NVIDIA OpenSeq2Seq ``example_configs/image2label/cifar-nv.py`` (Gitman &
    Ginsburg's code): blocks 1-3 exactly as above, the third conv of blocks 1 and
    2 with ``use_bias=False`` followed by BN, the other convs with biases; and
    (ii) ENorm's PyTorch port (facebookresearch/enorm,
    ``enorm/models/fully_convolutional.py``), which the PathCond paper follows:
    the same blocks, **every conv with bias=False** (constructor default), BN
    after conv3 and conv6 only, and a 1x1 conv 320->10 + ReLU + AvgPool2d(5) head
    instead of a dense decoder.

    Why this variant (both Table-1 counts are matched exactly):

    - conv weights alone: 3*128*9 + 2*128*128*9 + 128*256*9 + 2*256*256*9
      + 256*320*9 + 320*320 + 320*10 = 2,615,808; the missing 768 =
      2*(128 + 256) is exactly gamma+beta of the two BatchNorms, so convs are
      bias-free (ENorm), BN is present and counted, nothing else has parameters
      -> 2,616,576. The OpenSeq2Seq variant with biases on the 6 non-BN convs
      and a 10-way dense layer would give 2,617,994; all-bias variants
      2,617,610 (no BN) or more; a dense decoder on the flattened 8x8 map would
      be ~2M parameters larger.
    - hidden units: 3*128 + 3*256 + 2*320 = 1,792; the final 1x1 conv (10
      channels) is the classification layer and is excluded.
    - the PathCond paper's "BatchNorm layer after the final fully connected layer"
      would add 2*10 parameters (2,616,596), so Table 1 counts the net without
      it; it is available here as ``final_bn=True`` and off by default.

    Deviation from the ENorm code: ENorm pads the final 1x1 conv by 1 and pools
    with AvgPool2d(5), which yields a 1x1 map only for its 28x28 crops (and a
    2x2 map, breaking its ``view``, for 32x32 inputs). Here the final conv has no
    padding and pooling is AdaptiveAvgPool2d((1, 1)), so any input size works
    (28x28 or 32x32); parameter and hidden-unit counts are unaffected.

    Init: kaiming_normal_ (fan_in, gain sqrt(2)) on every conv, as ENorm and the
    PathCond paper ("Kaiming's initialization scheme"); BN gamma=1, beta=0.
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 3, final_relu: bool = True, final_bn: bool = False
    ) -> None:
        super().__init__()
        # block 1
        self.conv1 = nn.Conv2d(in_channels, 128, 3, 1, 1, bias=False)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(128, 128, 3, 1, 1, bias=False)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(128, 128, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(128)
        self.relu3 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(3, 2, 1)
        # block 2
        self.conv4 = nn.Conv2d(128, 256, 3, 1, 1, bias=False)
        self.relu4 = nn.ReLU()
        self.conv5 = nn.Conv2d(256, 256, 3, 1, 1, bias=False)
        self.relu5 = nn.ReLU()
        self.conv6 = nn.Conv2d(256, 256, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(256)
        self.relu6 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(3, 2, 1)
        # block 3
        self.conv7 = nn.Conv2d(256, 320, 3, 1, 1, bias=False)
        self.relu7 = nn.ReLU()
        self.conv8 = nn.Conv2d(320, 320, 1, 1, 0, bias=False)
        self.relu8 = nn.ReLU()
        self.conv9 = nn.Conv2d(320, num_classes, 1, 1, 0, bias=False)  # classifier
        self.relu9 = nn.ReLU() if final_relu else nn.Identity()
        self.pool3 = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten(1)
        self.final_bn = nn.BatchNorm1d(num_classes) if final_bn else nn.Identity()

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.conv1(x))
        x = self.relu2(self.conv2(x))
        x = self.pool1(self.relu3(self.bn1(self.conv3(x))))
        x = self.relu4(self.conv4(x))
        x = self.relu5(self.conv5(x))
        x = self.pool2(self.relu6(self.bn2(self.conv6(x))))
        x = self.relu7(self.conv7(x))
        x = self.relu8(self.conv8(x))
        x = self.pool3(self.relu9(self.conv9(x)))
        return self.final_bn(self.flatten(x))


def cifar_nv(num_classes: int = 10, final_relu: bool = True, final_bn: bool = False) -> nn.Module:
    """CIFAR-NV (see :class:`CifarNV`): 2,616,576 parameters, 1,792 hidden units."""
    return _finish(CifarNV(num_classes, final_relu=final_relu, final_bn=final_bn))


# --------------------------------------------------------------------------
# CIFAR-10 MLPs
# --------------------------------------------------------------------------


def mlp(depth: int, width: int = 500, in_features: int = 3072, num_classes: int = 10) -> nn.Module:
    """The paper's CIFAR-10 MLP: Flatten, 3072 -> ``width`` x ``depth`` -> 10.

    ``depth`` = number of hidden layers (each ``width`` ReLU neurons): one
    Linear(in_features, width), ``depth - 1`` Linear(width, width), one
    Linear(width, num_classes); all with biases and PyTorch's default nn.Linear
    init (Kaiming-uniform, a=sqrt(5)). A leading nn.Flatten accepts (N, 3, 32, 32)
    or (N, 3072). depth=3 has 2,042,510 parameters (the paper's "2M" model).
    """
    if depth < 1:
        raise ValueError("depth must be >= 1")
    layers: List[nn.Module] = [nn.Flatten(1), nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return _finish(nn.Sequential(*layers))


# --------------------------------------------------------------------------
# small models for fast tests (< 100k parameters each)
# --------------------------------------------------------------------------


def small_resnet(in_channels: int = 3, num_classes: int = 10, width: int = 8, random_bn: bool = True) -> nn.Module:
    """Two-stage BasicBlock ResNet (CIFAR-style 3x3 stem, no stem pool).

    stage 1: one BasicBlock width->width (identity skip);
    stage 2: BasicBlock width->2*width stride 2 (1x1 conv + BN projection) then
    one BasicBlock 2*width->2*width (identity skip); global avg pool; fc.
    """
    model = ResNet(
        BasicBlock,
        [1, 2],
        num_classes,
        in_channels=in_channels,
        widths=(width, 2 * width),
        stem_kernel=3,
        stem_stride=1,
        stem_pool=False,
    )
    return _finish(model, random_bn)


def small_bottleneck_resnet(
    in_channels: int = 3, num_classes: int = 10, planes: int = 8, random_bn: bool = True
) -> nn.Module:
    """Stem conv 3x3 (16 ch) + BN + ReLU + maxpool, then two Bottlenecks:
    16 -> (planes, planes, 4*planes) with a 1x1 projection, then an identity one;
    global avg pool; fc."""
    model = ResNet(
        Bottleneck,
        [2],
        num_classes,
        in_channels=in_channels,
        widths=(planes,),
        stem_kernel=3,
        stem_stride=1,
        stem_pool=True,
        stem_width=2 * planes,
    )
    return _finish(model, random_bn)


class _SmallVGG(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int]) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2, 2)]
            c = w
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten(1)
        # 32x32 input -> 32 / 2**len(widths)
        side = 32 // (2 ** len(widths))
        self.classifier = nn.Sequential(nn.Linear(c * side * side, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.flatten(self.features(x)))


def small_vgg(
    in_channels: int = 3, num_classes: int = 10, widths: Sequence[int] = (8, 16, 16), random_bn: bool = True
) -> nn.Module:
    """[conv3x3(bias) - BN - ReLU - maxpool2] x 3, flatten, Linear-ReLU-Linear head.
    Expects 32x32 inputs (the head's input size is computed for 32x32)."""
    return _finish(_SmallVGG(in_channels, num_classes, widths), random_bn)


class _DenseLayer(nn.Module):
    """DenseNet layer: BN - ReLU - conv3x3(growth), output concatenated to its input."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_channels, growth, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        new = self.conv(self.relu(self.bn(x)))
        return torch.cat([x, new], 1)


class _SmallDenseNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, stem: int, growth: int, n_layers: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(in_channels, stem, 3, padding=1, bias=False)
        c = stem
        block: List[nn.Module] = []
        for _ in range(n_layers):
            block.append(_DenseLayer(c, growth))
            c += growth
        self.block1 = nn.Sequential(*block)
        # transition: BN - ReLU - conv1x1 - AvgPool2d(2)
        self.trans_bn = nn.BatchNorm2d(c)
        self.trans_relu = nn.ReLU()
        self.trans_conv = nn.Conv2d(c, c // 2, 1, bias=False)
        self.trans_pool = nn.AvgPool2d(2, 2)
        c = c // 2
        block = []
        for _ in range(n_layers):
            block.append(_DenseLayer(c, growth))
            c += growth
        self.block2 = nn.Sequential(*block)
        self.norm_final = nn.BatchNorm2d(c)
        self.relu_final = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block1(self.conv0(x))
        x = self.trans_pool(self.trans_conv(self.trans_relu(self.trans_bn(x))))
        x = self.block2(x)
        x = self.pool(self.relu_final(self.norm_final(x)))
        return self.classifier(torch.flatten(x, 1))


def small_densenet(
    in_channels: int = 3,
    num_classes: int = 10,
    stem: int = 8,
    growth: int = 4,
    n_layers: int = 3,
    random_bn: bool = True,
) -> nn.Module:
    """Pre-activation DenseNet: stem conv, dense block (BN-ReLU-conv3x3, torch.cat
    along channels), transition (BN-ReLU-conv1x1-AvgPool2d(2)), second dense
    block, BN-ReLU, global avg pool, Linear. BatchNorms here follow a concat or
    the stem, not directly a conv, in most places (pre-activation order)."""
    return _finish(_SmallDenseNet(in_channels, num_classes, stem, growth, n_layers), random_bn)


class _InceptionBlock(nn.Module):
    """Branches 1x1 / 1x1->3x3 / 3x3 max-pool(stride 1)->1x1, each conv-BN-ReLU,
    concatenated along channels."""

    def __init__(self, in_channels: int, c1: int, c3_reduce: int, c3: int, cpool: int) -> None:
        super().__init__()
        self.b1 = nn.Sequential(nn.Conv2d(in_channels, c1, 1, bias=False), nn.BatchNorm2d(c1), nn.ReLU())
        self.b3 = nn.Sequential(
            nn.Conv2d(in_channels, c3_reduce, 1, bias=False),
            nn.BatchNorm2d(c3_reduce),
            nn.ReLU(),
            nn.Conv2d(c3_reduce, c3, 3, padding=1, bias=False),
            nn.BatchNorm2d(c3),
            nn.ReLU(),
        )
        self.bpool = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1),
            nn.Conv2d(in_channels, cpool, 1, bias=False),
            nn.BatchNorm2d(cpool),
            nn.ReLU(),
        )
        self.out_channels = c1 + c3 + cpool

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.bpool(x)], 1)


class _SmallInception(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2)
        )
        self.inc1 = _InceptionBlock(16, 8, 8, 12, 4)
        self.pool = nn.MaxPool2d(2, 2)
        self.inc2 = _InceptionBlock(self.inc1.out_channels, 12, 8, 16, 4)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inc2.out_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inc2(self.pool(self.inc1(self.stem(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def small_inception(in_channels: int = 3, num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Stem conv-BN-ReLU-maxpool, two inception blocks (1x1 / 1x1->3x3 /
    maxpool->1x1 branches, torch.cat) separated by a max-pool, global avg pool, fc."""
    return _finish(_SmallInception(in_channels, num_classes), random_bn)


class _GroupedConvNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, slope: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.act1 = nn.LeakyReLU(slope)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, groups=2)  # grouped, groups=2
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.LeakyReLU(slope)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1, groups=16)  # depthwise, groups=C
        self.act3 = nn.LeakyReLU(slope)
        self.conv4 = nn.Conv2d(16, 32, 1)  # pointwise
        self.act4 = nn.LeakyReLU(slope)
        self.conv5 = nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=32, bias=False)
        self.bn5 = nn.BatchNorm2d(32)
        self.act5 = nn.LeakyReLU(slope)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act1(self.conv1(x))
        x = self.pool(self.act2(self.bn2(self.conv2(x))))
        x = self.act3(self.conv3(x))
        x = self.act4(self.conv4(x))
        x = self.act5(self.bn5(self.conv5(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def grouped_conv_net(
    in_channels: int = 3, num_classes: int = 10, negative_slope: float = 0.1, random_bn: bool = True
) -> nn.Module:
    """conv -> grouped conv (groups=2) + BN -> maxpool -> depthwise conv (groups=16)
    -> pointwise 1x1 -> strided depthwise conv (groups=32, bias-free) + BN, all
    with LeakyReLU(negative_slope); global avg pool; fc."""
    return _finish(_GroupedConvNet(in_channels, num_classes, negative_slope), random_bn)


class _Conv1dNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, 8, 5, padding=2)
        self.bn1 = nn.BatchNorm1d(8)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool1d(2)
        self.conv2 = nn.Conv1d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm1d(16)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool1d(3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(16, 16, 3, stride=2)
        self.relu3 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.bn2(self.conv2(x))))
        x = self.gap(self.relu3(self.conv3(x)))
        return self.fc(torch.flatten(x, 1))


def conv1d_net(in_channels: int = 3, num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Conv1d + BatchNorm1d + ReLU + MaxPool1d (x2), strided Conv1d + ReLU,
    AdaptiveAvgPool1d(1), flatten, Linear. Input (C, L) = (3, 64)."""
    return _finish(_Conv1dNet(in_channels, num_classes), random_bn)


# --------------------------------------------------------------------------
# MnasNet (torchvision layout: ReLU inverted residuals, linear bottlenecks)
# --------------------------------------------------------------------------

_MNASNET_BN_MOMENTUM = 1 - 0.9997


def _round_to_multiple_of(value: float, divisor: int, round_up_bias: float = 0.9) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded if rounded >= round_up_bias * value else rounded + divisor


class _InvertedResidual(nn.Module):
    """1x1 expand-BN-ReLU, depthwise kxk-BN-ReLU, 1x1 project-BN (linear bottleneck), plus
    the input when shapes allow (stride 1, same width)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, expansion: int) -> None:
        super().__init__()
        mid = in_ch * expansion
        self.apply_residual = in_ch == out_ch and stride == 1
        momentum = _MNASNET_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(in_ch, mid, 1, bias=False),
            nn.BatchNorm2d(mid, momentum=momentum),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, kernel_size, padding=kernel_size // 2, stride=stride, groups=mid, bias=False),
            nn.BatchNorm2d(mid, momentum=momentum),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch, momentum=momentum),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.apply_residual:
            return self.layers(x) + x
        return self.layers(x)


def _inverted_stack(
    in_ch: int, out_ch: int, kernel_size: int, stride: int, expansion: int, repeats: int
) -> nn.Sequential:
    first = _InvertedResidual(in_ch, out_ch, kernel_size, stride, expansion)
    rest = [_InvertedResidual(out_ch, out_ch, kernel_size, 1, expansion) for _ in range(1, repeats)]
    return nn.Sequential(first, *rest)


class MNASNet(nn.Module):
    """torchvision's MNASNet (B1): every activation is a ReLU, so it is a ReLU DAG.

    ``alpha`` is the width multiplier (0.5 gives 2,218,512 parameters, as
    torchvision's ``mnasnet0_5``). ``mean_pool`` pools with ``x.mean([2, 3])`` as
    torchvision does; ``False`` uses ``AdaptiveAvgPool2d(1)`` + flatten (same function).
    """

    def __init__(
        self,
        alpha: float,
        num_classes: int = 1000,
        in_channels: int = 3,
        last_width: int = 1280,
        mean_pool: bool = True,
    ) -> None:
        super().__init__()
        depths = [_round_to_multiple_of(d * alpha, 8) for d in (32, 16, 24, 40, 80, 96, 192, 320)]
        momentum = _MNASNET_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, depths[0], 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(depths[0], momentum=momentum),
            nn.ReLU(inplace=True),
            nn.Conv2d(depths[0], depths[0], 3, padding=1, groups=depths[0], bias=False),
            nn.BatchNorm2d(depths[0], momentum=momentum),
            nn.ReLU(inplace=True),
            nn.Conv2d(depths[0], depths[1], 1, bias=False),
            nn.BatchNorm2d(depths[1], momentum=momentum),
            _inverted_stack(depths[1], depths[2], 3, 2, 3, 3),
            _inverted_stack(depths[2], depths[3], 5, 2, 3, 3),
            _inverted_stack(depths[3], depths[4], 5, 2, 6, 3),
            _inverted_stack(depths[4], depths[5], 3, 1, 6, 2),
            _inverted_stack(depths[5], depths[6], 5, 2, 6, 4),
            _inverted_stack(depths[6], depths[7], 3, 1, 6, 1),
            nn.Conv2d(depths[7], last_width, 1, bias=False),
            nn.BatchNorm2d(last_width, momentum=momentum),
            nn.ReLU(inplace=True),
        )
        self.mean_pool = mean_pool
        self.pool = nn.Identity() if mean_pool else nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.classifier = nn.Sequential(nn.Dropout(p=0.2), nn.Linear(last_width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(x)
        x = x.mean([2, 3]) if self.mean_pool else self.pool(x)
        return self.classifier(x)


def mnasnet(alpha: float = 0.5, num_classes: int = 1000, mean_pool: bool = True, random_bn: bool = False) -> nn.Module:
    """MnasNet-style inverted residuals with ReLU (torchvision ``mnasnet0_5`` at alpha=0.5)."""
    return _finish(MNASNet(alpha, num_classes, mean_pool=mean_pool), random_bn)


def small_mnasnet(num_classes: int = 10, mean_pool: bool = True, random_bn: bool = True) -> nn.Module:
    """MnasNet at alpha 0.25 with a 64-wide head, for 32x32 inputs in fast tests."""
    return _finish(MNASNet(0.25, num_classes, last_width=64, mean_pool=mean_pool), random_bn)


# --------------------------------------------------------------------------
# Inception-v3 (torchvision layout, without the auxiliary classifier)
# --------------------------------------------------------------------------


class _BasicConv2d(nn.Module):
    """conv (no bias) - BN(eps 1e-3) - ReLU, as torchvision's BasicConv2d."""

    def __init__(self, in_channels: int, out_channels: int, **conv: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **conv)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.bn(self.conv(x)))


class _InceptionA(nn.Module):
    def __init__(self, in_channels: int, pool_features: int, w: Callable[[int], int]) -> None:
        super().__init__()
        self.branch1x1 = _BasicConv2d(in_channels, w(64), kernel_size=1)
        self.branch5x5_1 = _BasicConv2d(in_channels, w(48), kernel_size=1)
        self.branch5x5_2 = _BasicConv2d(w(48), w(64), kernel_size=5, padding=2)
        self.branch3x3dbl_1 = _BasicConv2d(in_channels, w(64), kernel_size=1)
        self.branch3x3dbl_2 = _BasicConv2d(w(64), w(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = _BasicConv2d(w(96), w(96), kernel_size=3, padding=1)
        self.branch_pool = _BasicConv2d(in_channels, w(pool_features), kernel_size=1)
        self.out_channels = w(64) + w(64) + w(96) + w(pool_features)

    def forward(self, x: Tensor) -> Tensor:
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(nn.functional.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), branch5x5, branch3x3dbl, branch_pool], 1)


class _InceptionB(nn.Module):
    def __init__(self, in_channels: int, w: Callable[[int], int]) -> None:
        super().__init__()
        self.branch3x3 = _BasicConv2d(in_channels, w(384), kernel_size=3, stride=2)
        self.branch3x3dbl_1 = _BasicConv2d(in_channels, w(64), kernel_size=1)
        self.branch3x3dbl_2 = _BasicConv2d(w(64), w(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = _BasicConv2d(w(96), w(96), kernel_size=3, stride=2)
        self.out_channels = w(384) + w(96) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = nn.functional.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([self.branch3x3(x), branch3x3dbl, branch_pool], 1)


class _InceptionC(nn.Module):
    def __init__(self, in_channels: int, channels_7x7: int, w: Callable[[int], int]) -> None:
        super().__init__()
        c7 = w(channels_7x7)
        self.branch1x1 = _BasicConv2d(in_channels, w(192), kernel_size=1)
        self.branch7x7_1 = _BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = _BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = _BasicConv2d(c7, w(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = _BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = _BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = _BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = _BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = _BasicConv2d(c7, w(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = _BasicConv2d(in_channels, w(192), kernel_size=1)
        self.out_channels = 4 * w(192)

    def forward(self, x: Tensor) -> Tensor:
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        dbl = self.branch7x7dbl_2(self.branch7x7dbl_1(x))
        dbl = self.branch7x7dbl_5(self.branch7x7dbl_4(self.branch7x7dbl_3(dbl)))
        branch_pool = self.branch_pool(nn.functional.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), branch7x7, dbl, branch_pool], 1)


class _InceptionD(nn.Module):
    def __init__(self, in_channels: int, w: Callable[[int], int]) -> None:
        super().__init__()
        self.branch3x3_1 = _BasicConv2d(in_channels, w(192), kernel_size=1)
        self.branch3x3_2 = _BasicConv2d(w(192), w(320), kernel_size=3, stride=2)
        self.branch7x7x3_1 = _BasicConv2d(in_channels, w(192), kernel_size=1)
        self.branch7x7x3_2 = _BasicConv2d(w(192), w(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = _BasicConv2d(w(192), w(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = _BasicConv2d(w(192), w(192), kernel_size=3, stride=2)
        self.out_channels = w(320) + w(192) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        branch7x7x3 = self.branch7x7x3_4(self.branch7x7x3_3(branch7x7x3))
        branch_pool = nn.functional.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([branch3x3, branch7x7x3, branch_pool], 1)


class _InceptionE(nn.Module):
    def __init__(self, in_channels: int, w: Callable[[int], int]) -> None:
        super().__init__()
        self.branch1x1 = _BasicConv2d(in_channels, w(320), kernel_size=1)
        self.branch3x3_1 = _BasicConv2d(in_channels, w(384), kernel_size=1)
        self.branch3x3_2a = _BasicConv2d(w(384), w(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = _BasicConv2d(w(384), w(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = _BasicConv2d(in_channels, w(448), kernel_size=1)
        self.branch3x3dbl_2 = _BasicConv2d(w(448), w(384), kernel_size=3, padding=1)
        self.branch3x3dbl_3a = _BasicConv2d(w(384), w(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = _BasicConv2d(w(384), w(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = _BasicConv2d(in_channels, w(192), kernel_size=1)
        self.out_channels = w(320) + 4 * w(384) + w(192)

    def forward(self, x: Tensor) -> Tensor:
        branch3x3 = self.branch3x3_1(x)
        branch3x3 = torch.cat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], 1)
        dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        dbl = torch.cat([self.branch3x3dbl_3a(dbl), self.branch3x3dbl_3b(dbl)], 1)
        branch_pool = self.branch_pool(nn.functional.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), branch3x3, dbl, branch_pool], 1)


class InceptionV3(nn.Module):
    """torchvision's Inception3 without AuxLogits; ``width`` scales every branch's channels
    (1.0 is torchvision's layout: 23,834,568 parameters, input 3x299x299)."""

    def __init__(self, num_classes: int = 1000, width: float = 1.0, in_channels: int = 3) -> None:
        super().__init__()

        def w(channels: int) -> int:
            return max(1, round(channels * width))

        self.Conv2d_1a_3x3 = _BasicConv2d(in_channels, w(32), kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = _BasicConv2d(w(32), w(32), kernel_size=3)
        self.Conv2d_2b_3x3 = _BasicConv2d(w(32), w(64), kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Conv2d_3b_1x1 = _BasicConv2d(w(64), w(80), kernel_size=1)
        self.Conv2d_4a_3x3 = _BasicConv2d(w(80), w(192), kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Mixed_5b = _InceptionA(w(192), 32, w)
        self.Mixed_5c = _InceptionA(self.Mixed_5b.out_channels, 64, w)
        self.Mixed_5d = _InceptionA(self.Mixed_5c.out_channels, 64, w)
        self.Mixed_6a = _InceptionB(self.Mixed_5d.out_channels, w)
        self.Mixed_6b = _InceptionC(self.Mixed_6a.out_channels, 128, w)
        self.Mixed_6c = _InceptionC(self.Mixed_6b.out_channels, 160, w)
        self.Mixed_6d = _InceptionC(self.Mixed_6c.out_channels, 160, w)
        self.Mixed_6e = _InceptionC(self.Mixed_6d.out_channels, 192, w)
        self.Mixed_7a = _InceptionD(self.Mixed_6e.out_channels, w)
        self.Mixed_7b = _InceptionE(self.Mixed_7a.out_channels, w)
        self.Mixed_7c = _InceptionE(self.Mixed_7b.out_channels, w)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=0.5)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool1(self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x))))
        x = self.maxpool2(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)))
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(self.Mixed_6a(x)))))
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


def inception_v3(num_classes: int = 1000, width: float = 1.0, random_bn: bool = False) -> nn.Module:
    """Inception-v3 (torchvision layout without the auxiliary head); input 3x299x299."""
    return _finish(InceptionV3(num_classes, width), random_bn)


def small_inception_v3(num_classes: int = 10, random_bn: bool = True) -> nn.Module:
    """Inception-v3 at 1/16 width (input 3x75x75, the smallest its strides accept)."""
    return _finish(InceptionV3(num_classes, width=1 / 16), random_bn)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------

Entry = Tuple[Callable[[], nn.Module], Tuple[int, ...], Optional[int], Optional[int]]

#: Table 1 of the PathCond paper (Appendix I): name -> (parameters, hidden units).
TABLE1: Dict[str, Tuple[int, int]] = {
    "resnet18": (11_689_512, 4_800),
    "resnet34": (21_797_672, 8_512),
    "resnet50": (25_557_032, 26_560),
    "alexnet": (61_100_840, 9_344),
    "vgg16": (138_357_544, 12_416),
    "cifar_nv": (2_616_576, 1_792),
}

#: torchvision's parameter counts (``mnasnet0_5``; ``inception_v3`` without AuxLogits) and
#: the Table-1 hidden-unit definition applied to them.
TORCHVISION_COUNTS: Dict[str, Tuple[int, int]] = {
    "mnasnet0_5": (2_218_512, 10_312),
    "inception_v3": (23_834_568, 17_216),
}

_IMAGENET = (3, 224, 224)
_CIFAR = (3, 32, 32)


def _mlp_params(depth: int, width: int = 500, d_in: int = 3072, n_out: int = 10) -> int:
    return (d_in + 1) * width + (depth - 1) * (width + 1) * width + (width + 1) * n_out


REFERENCE_MODELS: Dict[str, Entry] = {
    "resnet18": (resnet18, _IMAGENET, *TABLE1["resnet18"]),
    "resnet34": (resnet34, _IMAGENET, *TABLE1["resnet34"]),
    "resnet50": (resnet50, _IMAGENET, *TABLE1["resnet50"]),
    "alexnet": (alexnet, _IMAGENET, *TABLE1["alexnet"]),
    "vgg16": (vgg16, _IMAGENET, *TABLE1["vgg16"]),
    "cifar_nv": (cifar_nv, _CIFAR, *TABLE1["cifar_nv"]),
    "mlp1": (lambda: mlp(1), _CIFAR, _mlp_params(1), 500),
    "mlp3": (lambda: mlp(3), _CIFAR, _mlp_params(3), 1500),
    "small_resnet": (small_resnet, _CIFAR, None, None),
    "small_bottleneck_resnet": (small_bottleneck_resnet, _CIFAR, None, None),
    "small_vgg": (small_vgg, _CIFAR, None, None),
    "small_densenet": (small_densenet, _CIFAR, None, None),
    "small_inception": (small_inception, _CIFAR, None, None),
    "grouped_conv_net": (grouped_conv_net, _CIFAR, None, None),
    "conv1d_net": (conv1d_net, (3, 64), None, None),
    "mnasnet0_5": (mnasnet, _IMAGENET, *TORCHVISION_COUNTS["mnasnet0_5"]),
    "inception_v3": (inception_v3, (3, 299, 299), *TORCHVISION_COUNTS["inception_v3"]),
    "small_mnasnet": (small_mnasnet, _CIFAR, None, None),
    "small_inception_v3": (small_inception_v3, (3, 75, 75), None, None),
}

#: names of the fast (< 100k parameters) models
SMALL_MODELS: Tuple[str, ...] = (
    "small_resnet",
    "small_bottleneck_resnet",
    "small_vgg",
    "small_densenet",
    "small_inception",
    "grouped_conv_net",
    "conv1d_net",
)


@torch.no_grad()
def calibrate_batchnorm(
    module: nn.Module, input_shape: Sequence[int], batches: int = 2, batch_size: int = 8
) -> nn.Module:
    """Give every BatchNorm random affine terms (:func:`randomize_batchnorm`) and the running
    statistics training would leave: measured on random inputs (cumulative average over
    ``batches`` train-mode passes), so each layer's statistics match its actual scale.

    :func:`randomize_batchnorm` alone draws running variances unrelated to the scale of the
    conv before them; in a deep net with small initial weights (GoogLeNet's std 0.01) every
    folded layer then has a tiny gain, which no trained network has. Draws from the global
    RNG (deterministic under ``torch.manual_seed``). Returns ``module`` in eval mode.
    """
    randomize_batchnorm(module)
    norms = [m for m in module.modules() if isinstance(m, _BN_TYPES)]
    if not norms:
        return module.eval()
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    module.train()
    for _ in range(batches):
        module(torch.randn(batch_size, *input_shape))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return module.eval()
