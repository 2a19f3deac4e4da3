"""Shared fixtures: tiny random ReLU DAGs (Graph + checkpoint params) for the oracle tests.

``nets`` (session scope, usable from hypothesis tests) exposes :class:`NetBuilder` and a
catalogue of named tiny networks, each small enough for explicit path enumeration
(at most a few hundred to a couple of thousand paths).
"""

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace

import export_cache
import fake_cuda
import pytest
import torch
import torch.nn.functional as F

from pathcond_cli.engine.graph import (
    AdaptiveAvgPool,
    Add,
    AvgPool,
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    ChannelGather,
    ChannelShuffle,
    ChannelSlice,
    Concat,
    Conv,
    ConvTranspose,
    FixedFilter,
    Flatten,
    Graph,
    Identity,
    Input,
    LeakyReLU,
    Linear,
    MaxPool,
    Pad,
    PReLU,
    ReLU,
    Scale,
    Sub,
    Upsample,
)


def pytest_configure(config):
    """With ``PATHCOND_FAKE_CUDA=1`` the whole session runs as on a machine with one CUDA device,
    the fake one of :mod:`fake_cuda`, which raises on any device mix a real GPU would refuse.

    Under pytest-xdist (pyproject's ``-n auto``: one worker per core) each worker, and each
    ``pathcond`` it starts, computes on one thread: OpenMP threads of two workers waiting on the
    same cores for each other made single tests 60 times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    else:
        _compile_the_package_once()
        export_cache.start_sharing()
    _build_each_cli_command_once()
    if fake_cuda.requested():
        config.fake_cuda = fake_cuda.installed()
        config.fake_cuda.__enter__()


def _compile_the_package_once() -> None:
    """Byte-compile the package before any worker starts. Where PYTHONDONTWRITEBYTECODE is set
    (the project's box sets it) nothing else writes its bytecode, so each worker, each of the
    fifty-odd ``pathcond`` processes the tests start and each other Python process that imports
    the package would compile it again: 0.2 s each."""
    import compileall

    import pathcond_cli

    compileall.compile_dir(os.path.dirname(pathcond_cli.__file__), quiet=1)


def _build_each_cli_command_once() -> None:
    """typer's ``CliRunner.invoke`` builds the click command from the Typer app on every call,
    reading every command's signature and type hints: 17 ms, a thousand times a run. The app
    does not change during a session (tests patch the functions its commands call, looked up
    when they run), so each app's command is built once. A typer without this helper keeps
    building it per call."""
    import typer.testing

    build = getattr(typer.testing, "_get_command", None)
    if build is not None and not hasattr(build, "cache_info"):
        typer.testing._get_command = functools.cache(build)


def pytest_unconfigure(config):
    if hasattr(config, "fake_cuda"):
        config.fake_cuda.__exit__(None, None, None)
    export_cache.stop_sharing()


def pytest_report_header(config):
    return "device: fake CUDA (PATHCOND_FAKE_CUDA=1)" if fake_cuda.requested() else None


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXP = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGP = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAP = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


class NetBuilder:
    """Append nodes one by one; tracks shapes with a dummy torch forward; draws random params."""

    def __init__(self, shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float64, scale: float = 1.0):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.scale = scale
        self.nodes = [Input("x", shape=tuple(shape))]
        self.params: dict[str, torch.Tensor] = {}
        self.dummy = {"x": torch.zeros((1, *shape))}
        self.cur = "x"
        self.count = 0

    # -- helpers -------------------------------------------------------------------------------
    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}{self.count}"

    def shape(self, name: str | None = None) -> tuple[int, ...]:
        return tuple(self.dummy[name or self.cur].shape[1:])

    def _rand(self, *shape, scale=None) -> torch.Tensor:
        s = self.scale if scale is None else scale
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * s).to(self.dtype)

    def _push(self, node, y: torch.Tensor) -> str:
        self.nodes.append(node)
        self.dummy[node.name] = y
        self.cur = node.name
        return node.name

    # -- layers --------------------------------------------------------------------------------
    def linear(self, out: int, bias: bool = True, transposed: bool = False, src: str | None = None) -> str:
        src = src or self.cur
        name = self._name("fc")
        (inp,) = self.shape(src)
        w = self._rand(out, inp, scale=self.scale / math.sqrt(inp))
        self.params[f"{name}.weight"] = w.t().contiguous() if transposed else w
        if bias:
            self.params[f"{name}.bias"] = self._rand(out, scale=0.5 * self.scale)
        node = Linear(
            name, (src,), weight=f"{name}.weight", bias=f"{name}.bias" if bias else None, weight_transposed=transposed
        )
        return self._push(node, torch.zeros(1, out))

    def conv(
        self, out: int, k, stride=1, padding=0, dilation=1, groups: int = 1, bias: bool = True, src: str | None = None
    ) -> str:
        src = src or self.cur
        name = self._name("conv")
        shp = self.shape(src)
        r = len(shp) - 1
        k = (k,) * r if isinstance(k, int) else tuple(k)
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        fan_in = shp[0] // groups * math.prod(k)
        self.params[f"{name}.weight"] = self._rand(out, shp[0] // groups, *k, scale=self.scale / math.sqrt(fan_in))
        if bias:
            self.params[f"{name}.bias"] = self._rand(out, scale=0.5 * self.scale)
        node = Conv(
            name,
            (src,),
            weight=f"{name}.weight",
            bias=f"{name}.bias" if bias else None,
            stride=tup(stride),
            padding=tup(padding),
            dilation=tup(dilation),
            groups=groups,
        )
        y = _CONV[r](
            self.dummy[src],
            torch.zeros(out, shp[0] // groups, *k),
            None,
            node.stride,
            node.padding,
            node.dilation,
            groups,
        )
        return self._push(node, y)

    def conv_transpose(
        self, out: int, k, stride=1, padding=0, output_padding=0, dilation=1, groups: int = 1, bias: bool = True
    ) -> str:
        name = self._name("convt")
        shp = self.shape()
        r = len(shp) - 1
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        k = tup(k)
        fan_in = shp[0] // groups * math.prod(k)
        self.params[f"{name}.weight"] = self._rand(shp[0], out // groups, *k, scale=self.scale / math.sqrt(fan_in))
        if bias:
            self.params[f"{name}.bias"] = self._rand(out, scale=0.5 * self.scale)
        node = ConvTranspose(
            name,
            (self.cur,),
            weight=f"{name}.weight",
            bias=f"{name}.bias" if bias else None,
            stride=tup(stride),
            padding=tup(padding),
            output_padding=tup(output_padding),
            dilation=tup(dilation),
            groups=groups,
        )
        y = _CONV_T[r](
            self.dummy[self.cur],
            torch.zeros(shp[0], out // groups, *k),
            None,
            node.stride,
            node.padding,
            node.output_padding,
            groups,
            node.dilation,
        )
        return self._push(node, y)

    def prelu(self, per_channel: bool = True) -> str:
        name = self._name("prelu")
        count = self.shape()[0] if per_channel else 1
        self.params[f"{name}.weight"] = (torch.rand(count, generator=self.gen, dtype=torch.float64) * 0.6 - 0.1).to(
            self.dtype
        )
        return self._push(PReLU(name, (self.cur,), weight=f"{name}.weight"), self.dummy[self.cur])

    def scale_by(self, factor: float) -> str:
        return self._push(Scale(self._name("scale"), (self.cur,), factor=factor), self.dummy[self.cur])

    def pad(self, begin, end, mode: str = "zeros") -> str:
        r = len(self.shape()) - 1
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        node = Pad(self._name("pad"), (self.cur,), begin=tup(begin), end=tup(end), mode=mode)
        pads = [v for b, e in reversed(list(zip(node.begin, node.end))) for v in (b, e)]
        return self._push(node, F.pad(self.dummy[self.cur], pads))

    def channel_bias(self, src: str | None = None) -> str:
        """A stored per-channel constant added (stored ``[C, 1, ..., 1]``, as ONNX constants are)."""
        src = src or self.cur
        name = self._name("bias")
        shape = self.shape(src)
        self.params[f"{name}.bias"] = self._rand(shape[0], *([1] * (len(shape) - 1)))
        return self._push(ChannelBias(name, (src,), bias=f"{name}.bias"), self.dummy[src])

    def fixed_filter(self, k, stride=1, padding=0, dilation=1, zero_taps: int = 0) -> str:
        """A depthwise filter of constants (not parameters), signed, its first ``zero_taps`` taps 0."""
        shp = self.shape()
        r = len(shp) - 1
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        k = tup(k)
        coefficients = self._rand(shp[0] * math.prod(k)).double()
        coefficients[:zero_taps] = 0.0
        node = FixedFilter(
            self._name("filter"),
            (self.cur,),
            kernel=k,
            coefficients=tuple(coefficients.tolist()),
            stride=tup(stride),
            padding=tup(padding),
            dilation=tup(dilation),
        )
        y = _CONV[r](
            self.dummy[self.cur], torch.zeros(shp[0], 1, *k), None, node.stride, node.padding, node.dilation, shp[0]
        )
        return self._push(node, y)

    def channel_affine(self, bias: bool = True, src: str | None = None) -> str:
        """A per-channel scale (stored ``[C, 1, ..., 1]``, as ONNX constants are) and shift."""
        src = src or self.cur
        name = self._name("affine")
        shape = self.shape(src)
        self.params[f"{name}.weight"] = self._rand(shape[0], *([1] * (len(shape) - 1)))
        if bias:
            self.params[f"{name}.bias"] = self._rand(shape[0], *([1] * (len(shape) - 1)), scale=0.3)
        node = ChannelAffine(name, (src,), weight=f"{name}.weight", bias=f"{name}.bias" if bias else None)
        return self._push(node, self.dummy[src])

    def upsample(self, mode: str = "nearest", size=(), scale_factor=(), align_corners: bool = False) -> str:
        x = self.dummy[self.cur]
        r = x.dim() - 2
        torch_mode = "nearest" if mode == "nearest" else {1: "linear", 2: "bilinear", 3: "trilinear"}[r]
        y = F.interpolate(
            x,
            size=tuple(size) or None,
            scale_factor=tuple(scale_factor) or None,
            mode=torch_mode,
            align_corners=align_corners if mode == "linear" else None,
        )
        node = Upsample(
            self._name("up"),
            (self.cur,),
            mode=mode,
            size=tuple(size),
            scale_factor=tuple(scale_factor),
            align_corners=align_corners,
        )
        return self._push(node, y)

    def shuffle(self, groups: int) -> str:
        return self._push(ChannelShuffle(self._name("shuffle"), (self.cur,), groups=groups), self.dummy[self.cur])

    def slice(self, start: int, stop: int, src: str | None = None) -> str:
        src = src or self.cur
        return self._push(
            ChannelSlice(self._name("slice"), (src,), start=start, stop=stop), self.dummy[src][:, start:stop]
        )

    def gather(self, channels: tuple[int, ...], src: str | None = None) -> str:
        src = src or self.cur
        return self._push(
            ChannelGather(self._name("gather"), (src,), channels=tuple(channels)), self.dummy[src][:, list(channels)]
        )

    def bn(self, eps: float = 1e-5) -> str:
        name = self._name("bn")
        C = self.shape()[0]
        g = self.gen
        self.params[f"{name}.weight"] = (
            (torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
            * torch.where(torch.rand(C, generator=g) < 0.2, -1.0, 1.0)
        ).to(self.dtype)
        self.params[f"{name}.bias"] = self._rand(C, scale=0.3)
        self.params[f"{name}.running_mean"] = self._rand(C, scale=0.3)
        self.params[f"{name}.running_var"] = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(self.dtype)
        node = BatchNorm(
            name,
            (self.cur,),
            weight=f"{name}.weight",
            bias=f"{name}.bias",
            running_mean=f"{name}.running_mean",
            running_var=f"{name}.running_var",
            eps=eps,
        )
        return self._push(node, self.dummy[self.cur])

    def relu(self, src: str | None = None) -> str:
        src = src or self.cur
        return self._push(ReLU(self._name("relu"), (src,)), self.dummy[src])

    def leaky(self, slope: float = 0.1) -> str:
        return self._push(LeakyReLU(self._name("lrelu"), (self.cur,), negative_slope=slope), self.dummy[self.cur])

    def identity(self) -> str:
        return self._push(Identity(self._name("id"), (self.cur,)), self.dummy[self.cur])

    def maxpool(self, k, stride=None, padding=0, dilation=1, ceil_mode=False) -> str:
        r = len(self.shape()) - 1
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        stride = k if stride is None else stride
        node = MaxPool(
            self._name("maxpool"),
            (self.cur,),
            kernel=tup(k),
            stride=tup(stride),
            padding=tup(padding),
            dilation=tup(dilation),
            ceil_mode=ceil_mode,
        )
        y = _MAXP[r](self.dummy[self.cur], node.kernel, node.stride, node.padding, node.dilation, ceil_mode=ceil_mode)
        return self._push(node, y)

    def avgpool(self, k, stride=None, padding=0, ceil_mode=False, count_include_pad=True) -> str:
        r = len(self.shape()) - 1
        tup = lambda v: (v,) * r if isinstance(v, int) else tuple(v)  # noqa: E731
        stride = k if stride is None else stride
        node = AvgPool(
            self._name("avgpool"),
            (self.cur,),
            kernel=tup(k),
            stride=tup(stride),
            padding=tup(padding),
            ceil_mode=ceil_mode,
            count_include_pad=count_include_pad,
        )
        y = _AVGP[r](self.dummy[self.cur], node.kernel, node.stride, node.padding, ceil_mode, count_include_pad)
        return self._push(node, y)

    def adaptive(self, size) -> str:
        r = len(self.shape()) - 1
        size = (size,) * r if isinstance(size, int) else tuple(size)
        return self._push(
            AdaptiveAvgPool(self._name("apool"), (self.cur,), output_size=size), _ADAP[r](self.dummy[self.cur], size)
        )

    def flatten(self) -> str:
        return self._push(Flatten(self._name("flat"), (self.cur,)), self.dummy[self.cur].flatten(1))

    def add(self, *srcs: str) -> str:
        return self._push(Add(self._name("add"), tuple(srcs)), sum(self.dummy[s] for s in srcs))

    def sub(self, a: str, b: str) -> str:
        return self._push(Sub(self._name("sub"), (a, b)), self.dummy[a] - self.dummy[b])

    def concat(self, *srcs: str) -> str:
        return self._push(Concat(self._name("cat"), tuple(srcs)), torch.cat([self.dummy[s] for s in srcs], 1))

    def build(self, outputs: tuple[str, ...] | None = None) -> tuple[Graph, dict[str, torch.Tensor]]:
        return Graph(list(self.nodes), tuple(outputs or (self.cur,))), dict(self.params)


# ----------------------------------------------------------------------------------------------
# Catalogue of tiny networks: name -> builder(seed, dtype) -> (graph, params)
# ----------------------------------------------------------------------------------------------


def mlp(seed=0, dtype=torch.float64, widths=(3, 4, 3, 2), bias=True, transposed=False, scale=1.0):
    b = NetBuilder((widths[0],), seed, dtype, scale)
    for i, w in enumerate(widths[1:]):
        b.linear(w, bias=bias, transposed=transposed and i == 0)
        if i < len(widths) - 2:
            b.relu()
    return b.build()


def mlp_leaky(seed=0, dtype=torch.float64):
    b = NetBuilder((3,), seed, dtype)
    b.linear(4)
    b.leaky(0.2)
    b.linear(3, bias=False)
    b.leaky(0.05)
    b.linear(2)
    return b.build()


def conv_maxpool(seed=0, dtype=torch.float64):
    b = NetBuilder((1, 4, 4), seed, dtype)
    b.conv(2, 3, padding=1)
    b.relu()
    b.maxpool(2)
    b.flatten()
    b.linear(2)
    return b.build()


def conv_maxpool_strided(seed=0, dtype=torch.float64):
    b = NetBuilder((2, 5, 5), seed, dtype)
    b.conv(2, 2, stride=1, dilation=2, padding=1)
    b.relu()
    b.maxpool(3, stride=2, padding=1, ceil_mode=True)
    b.flatten()
    b.linear(2)
    return b.build()


def residual(seed=0, dtype=torch.float64):
    b = NetBuilder((3,), seed, dtype)
    stem = b.relu(b.linear(3))
    b.relu(b.linear(2))
    y = b.linear(3)
    s = b.relu(b.add(stem, y))
    b.relu(b.linear(2, src=s))
    y2 = b.linear(3)
    b.add(s, y2)
    b.linear(2)
    return b.build()


def conv_residual(seed=0, dtype=torch.float64):
    b = NetBuilder((1, 3, 3), seed, dtype)
    stem = b.relu(b.conv(2, 1))
    b.conv(2, 3, padding=1)
    b.relu()
    y = b.conv(2, 1)
    b.relu(b.add(stem, y))
    b.adaptive(1)
    b.flatten()
    b.linear(2)
    return b.build()


def avgpool_net(seed=0, dtype=torch.float64, count_include_pad=True, ceil_mode=False):
    b = NetBuilder((1, 5, 5), seed, dtype)
    b.conv(2, 2, padding=1)
    b.relu()
    b.avgpool(3, stride=2, padding=1, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    b.flatten()
    b.linear(2)
    return b.build()


def concat_net(seed=0, dtype=torch.float64):
    b = NetBuilder((1, 3, 3), seed, dtype)
    a = b.relu(b.conv(2, 2))
    c = b.relu(b.conv(1, 3, padding=1, src="x"))
    c = b.maxpool(2, stride=1)
    b.concat(a, c)
    b.conv(2, 1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def conv_bn(seed=0, dtype=torch.float64):
    b = NetBuilder((2, 4, 4), seed, dtype)
    b.conv(3, 3, bias=False)
    b.bn()
    b.relu()
    b.conv(2, 2, bias=True)
    b.bn()
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def grouped_conv(seed=0, dtype=torch.float64):
    b = NetBuilder((4, 3, 3), seed, dtype)
    b.conv(4, 2, groups=2, padding=1)
    b.relu()
    b.conv(2, 2, groups=2)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def adaptive_net(seed=0, dtype=torch.float64):
    b = NetBuilder((1, 5, 4), seed, dtype)
    b.conv(2, 2)
    b.relu()
    b.adaptive((3, 2))
    b.flatten()
    b.linear(2)
    return b.build()


def conv1d_net(seed=0, dtype=torch.float64):
    b = NetBuilder((2, 7), seed, dtype)
    b.conv(3, 3, stride=2, padding=1)
    b.relu()
    b.maxpool(2, ceil_mode=True)
    b.conv(2, 2, dilation=1)
    b.relu()
    b.avgpool(2, stride=1, padding=1, count_include_pad=False)
    b.flatten()
    b.linear(2)
    return b.build()


def bottleneck(seed=0, dtype=torch.float64):
    """A residual stream S with a 3-conv bottleneck S→A→B→S: the colouring needs 3 colours."""
    b = NetBuilder((1, 2, 2), seed, dtype)
    s = b.relu(b.conv(2, 1))
    b.conv(2, 1)
    b.relu()
    b.conv(2, 3, padding=1)
    b.relu()
    y = b.conv(2, 1)
    b.relu(b.add(s, y))
    b.adaptive(1)
    b.flatten()
    b.linear(2)
    return b.build()


def mlp_bottleneck(seed=0, dtype=torch.float64):
    """Linear version of the bottleneck: stream S(2) → A(2) → B(2) → S, two blocks."""
    b = NetBuilder((2,), seed, dtype)
    s = b.relu(b.linear(2))
    for _ in range(2):
        b.relu(b.linear(2, src=s))
        b.relu(b.linear(2))
        y = b.linear(2)
        s = b.relu(b.add(s, y))
    b.linear(2)
    return b.build()


def self_loop(seed=0, dtype=torch.float64):
    """A layer that reads the residual stream and writes straight back into it: its weights
    join one group to itself (zero rows of B). A second layer reads [stream, other] (mixed)."""
    b = NetBuilder((2,), seed, dtype)
    s = b.relu(b.linear(2))
    y = b.linear(2, src=s)
    s = b.relu(b.add(s, y))
    t = b.relu(b.linear(2, src=s))
    c = b.concat(s, t)
    y = b.linear(2, src=c)
    s = b.relu(b.add(s, y))
    b.linear(2, src=s)
    return b.build()


def maxpool_dilated(seed=0, dtype=torch.float64):
    b = NetBuilder((1, 5, 5), seed, dtype)
    b.conv(2, 2)
    b.relu()
    b.maxpool(2, stride=1, padding=1, dilation=2)
    b.flatten()
    b.linear(2)
    return b.build()


def cnn_bn_residual(seed=0, dtype=torch.float64):
    """A small CNN with BatchNorm everywhere, an identity skip and pooling (invariance tests)."""
    b = NetBuilder((2, 6, 6), seed, dtype)
    b.conv(3, 3, padding=1, bias=False)
    b.bn()
    s = b.relu()
    b.conv(3, 3, padding=1)
    b.bn()
    b.relu()
    b.conv(3, 3, padding=1, bias=False)
    y = b.bn()
    b.relu(b.add(s, y))
    b.maxpool(2)
    b.conv(4, 3, padding=1)
    b.bn()
    b.relu()
    b.adaptive(1)
    b.flatten()
    b.linear(3)
    return b.build()


def prelu_scale_net(seed=0, dtype=torch.float64):
    """PReLU (per channel and shared), Mul/Div by constants (a negative one included)."""
    b = NetBuilder((1, 4, 4), seed, dtype)
    b.conv(2, 2)
    b.prelu()
    b.scale_by(0.5)
    b.maxpool(2, stride=1)
    b.flatten()
    b.linear(3)
    b.prelu(per_channel=False)
    b.scale_by(-3.0)
    b.linear(2)
    return b.build()


def pad_net(seed=0, dtype=torch.float64):
    """Zero padding (asymmetric) before a conv and before a max-pool."""
    b = NetBuilder((1, 3, 3), seed, dtype)
    b.pad((1, 0), (0, 2))
    b.conv(2, 2)
    b.relu()
    b.pad(1, 1)
    b.maxpool(2, stride=2, ceil_mode=True)
    b.flatten()
    b.linear(2)
    return b.build()


def crop_net(seed=0, dtype=torch.float64):
    """Negative pad widths crop (NASNet's ``ZeroPad2d((-1, 1, -1, 1))``, a spatial slice): a crop
    then a zero pad, a reflect pad of a cropped axis, a crop then −inf padding before a max-pool."""
    b = NetBuilder((1, 4, 5), seed, dtype)
    b.relu(b.conv(2, 1))
    b.pad((-1, -1), (1, 1))
    b.conv(2, 3, padding=1)
    b.relu()
    b.pad((1, -2), (-1, 1), mode="reflect")
    b.conv(2, 1)
    b.relu()
    b.pad((0, -1), (-1, 1), mode="-inf")
    b.maxpool(2, stride=1)
    b.flatten()
    b.linear(2)
    return b.build()


def channel_bias_net(seed=0, dtype=torch.float64):
    """MobileOne's train-time block: bias-free conv branches summed, a stored per-channel
    constant added to the sum, then ReLU; and a constant added straight to the input (fixed)."""
    b = NetBuilder((2, 2, 2), seed, dtype)
    shifted = b.channel_bias()
    left = b.conv(3, 3, padding=1, bias=False)
    right = b.conv(3, 1, bias=False, src=shifted)
    b.add(left, right)
    b.channel_bias()
    b.relu()
    b.conv(2, 1, bias=False)
    b.channel_bias()
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def fixed_filter_net(seed=0, dtype=torch.float64):
    """resnetblur's anti-aliased downsampling: reflect padding, then a strided depthwise filter
    of constants (signed here, one tap 0), and a dilated one in a residual branch."""
    b = NetBuilder((1, 4, 4), seed, dtype)
    b.relu(b.conv(2, 1))
    b.pad(1, 1, mode="reflect")
    b.fixed_filter(3, stride=2, zero_taps=1)
    b.conv(3, 1)
    stem = b.relu()
    b.fixed_filter(2, padding=1, dilation=2)
    b.add(b.cur, stem)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def sub_net(seed=0, dtype=torch.float64):
    """Differences of activations: a conv branch minus another (channels tied as in a sum), a
    1-channel map subtracted from a 3-channel one (broadcast: it feeds, and ties, every channel),
    and a negation (a fixed edge of −1) feeding a residual difference."""
    b = NetBuilder((1, 2, 2), seed, dtype)
    stem = b.relu(b.conv(2, 1))
    wide = b.conv(3, 3, padding=1, src=stem)
    narrow = b.conv(1, 1, src=stem)
    diff = b.relu(b.sub(wide, narrow))
    b.conv(3, 1, src=diff)
    b.scale_by(-1.0)
    b.sub(diff, b.cur)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def shuffle_split_net(seed=0, dtype=torch.float64):
    """ShuffleNetV2's unit: split the channels, transform one half, concat, shuffle."""
    b = NetBuilder((1, 3, 3), seed, dtype)
    stem = b.relu(b.conv(4, 1))
    left = b.slice(0, 2, src=stem)
    right = b.slice(2, 4, src=stem)
    b.conv(2, 1, src=right)
    b.relu()
    b.conv(2, 3, padding=1, groups=2)
    right = b.relu()
    b.concat(left, right)
    b.shuffle(2)
    b.conv(2, 1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def gather_net(seed=0, dtype=torch.float64):
    """A shuffle followed by a chunk is a strided channel selection; a repeated channel too."""
    b = NetBuilder((1, 2, 2), seed, dtype)
    stem = b.relu(b.conv(4, 1))
    odd = b.gather((1, 3), src=stem)
    b.conv(2, 1, src=b.gather((2, 0, 2), src=stem))
    right = b.relu()
    b.concat(odd, right)
    b.conv(2, 3, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def conv_transpose_net(seed=0, dtype=torch.float64):
    """U-Net-style decoder: a grouped strided ConvTranspose with BatchNorm, then a dilated one."""
    b = NetBuilder((2, 2, 2), seed, dtype)
    b.conv_transpose(4, 3, stride=2, padding=1, output_padding=1, groups=2, bias=False)
    b.bn()
    b.relu()
    b.conv_transpose(2, 2, dilation=2)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def conv_transpose_1d_net(seed=0, dtype=torch.float64):
    b = NetBuilder((2, 3), seed, dtype)
    b.conv_transpose(2, 3, stride=2, padding=1)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def upsample_net(seed=0, dtype=torch.float64, shape=(1, 2, 3), resizes=(("nearest", (), (2.0, 2.0), False),)):
    """Resizes between a conv and a conv (the rescaled channels feed and leave fixed edges)."""
    b = NetBuilder(shape, seed, dtype)
    b.conv(2, 1)
    b.relu()
    for mode, size, scale_factor, align_corners in resizes:
        b.upsample(mode, size, scale_factor, align_corners)
    b.conv(2, 2)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


UPSAMPLES = {
    "upsample_nearest2d": ((1, 2, 3), (("nearest", (), (2.0, 2.0), False),)),
    "upsample_nearest1d_frac": ((1, 4), (("nearest", (), (1.7,), False),)),
    "upsample_bilinear_frac": ((1, 3, 2), (("linear", (), (1.5, 2.0), False),)),
    "upsample_bilinear_corners_size": ((1, 2, 3), (("linear", (3, 5), (), True),)),
    "upsample_linear1d_down_up": ((1, 5), (("linear", (3,), (), False), ("linear", (), (2.5,), False))),
    "upsample_trilinear_nearest": (
        (1, 2, 1, 2),
        (("linear", (3, 2, 3), (), False), ("nearest", (), (1.0, 2.0, 1.0), False)),
    ),
}


def conv3d_net(seed=0, dtype=torch.float64, ceil_mode=True, count_include_pad=False):
    """3-D conv, ConvTranspose, max and average pooling (ceil mode, padding)."""
    b = NetBuilder((1, 3, 3, 2), seed, dtype)
    b.conv(2, (2, 2, 1), padding=(1, 0, 0))
    b.relu()
    b.maxpool((3, 2, 2), stride=2, ceil_mode=ceil_mode)
    b.conv_transpose(2, (2, 1, 1), stride=(2, 1, 1))
    b.relu()
    b.avgpool((2, 1, 1), stride=(2, 1, 1), padding=(1, 0, 0), ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    b.flatten()
    b.linear(2)
    return b.build()


def ceil_pool_net(seed=0, dtype=torch.float64, rank=2, is_max=True, padding=0, count_include_pad=True):
    """A pooling whose last ceil-mode window starts inside the input or hangs over the edge."""
    shape = {1: (1, 6), 2: (1, 6, 5), 3: (1, 4, 4, 3)}[rank]
    b = NetBuilder(shape, seed, dtype)
    b.conv(2, 1)
    b.relu()
    if is_max:
        b.maxpool(3, stride=2, padding=padding, ceil_mode=True)
    else:
        b.avgpool(3, stride=2, padding=padding, ceil_mode=True, count_include_pad=count_include_pad)
    b.flatten()
    b.linear(2)
    return b.build()


CEIL_POOLS = {
    f"ceil_{'max' if is_max else 'avg'}{rank}d_pad{padding}{'' if is_max else ('_incl' if incl else '_excl')}": (
        lambda seed=0, dtype=torch.float64, rank=rank, is_max=is_max, padding=padding, incl=incl: ceil_pool_net(
            seed, dtype, rank, is_max, padding, incl
        )
    )
    for rank in (1, 2, 3)
    for is_max in (True, False)
    for padding in (0, 1)
    for incl in ((True,) if is_max else (True, False))
}


def pad_modes_net(seed=0, dtype=torch.float64, rank=2):
    """Reflect, replicate and circular padding (each output pixel copies one input pixel of its
    channel), asymmetric, between convs, before a max-pool and a residual sum. The stem has no
    bias and the last conv is depthwise: the brute-force oracle's cost grows with the square of
    the path count (2,700 paths here, 10,000 with a biased stem and a full last conv)."""
    b = NetBuilder({1: (1, 5), 2: (1, 3, 2)}[rank], seed, dtype)
    stem = b.relu(b.conv(2, 1, bias=False))
    b.pad((2, 0)[:rank], 0, mode="reflect")
    b.conv(2, 3 if rank == 1 else (3, 1))
    b.relu()
    b.pad((0, 1)[:rank], (1, 0)[:rank], mode="replicate")
    b.conv(2, 2, groups=2, bias=False)
    b.relu()
    b.pad(1, 0, mode="circular")
    b.maxpool(2, stride=1)
    b.add(b.cur, stem)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def neg_inf_pad_net(seed=0, dtype=torch.float64):
    """NASNet-style padded max-pool: −inf padding (asymmetric) straight after a conv (negative
    values, so −inf and 0 differ), then a max-pool; a second one after a zero-padded one."""
    b = NetBuilder((1, 4, 5), seed, dtype)
    b.conv(2, 2)
    b.pad((0, 1), (1, 1), mode="-inf")
    b.maxpool(3, stride=2)
    b.relu()
    b.conv(3, 1)
    b.pad(1, (0, 1), mode="-inf")
    b.maxpool(2, stride=1)
    b.flatten()
    b.linear(2)
    return b.build()


def channel_affine_net(seed=0, dtype=torch.float64):
    """Per-channel scale and shift on a branch with no conv (RepVGG's identity BatchNorm exported
    as Mul and Add), in a pre-activation block, and a scale without shift."""
    b = NetBuilder((1, 3, 3), seed, dtype)
    stem = b.relu(b.conv(2, 1))
    identity = b.channel_affine(src=stem)
    b.conv(2, 1, src=stem)
    b.add(b.cur, identity)
    b.relu()
    b.channel_affine()
    b.relu()
    b.conv(2, 2)
    b.channel_affine(bias=False)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


def broadcast_add_net(seed=0, dtype=torch.float64):
    """Sums with broadcasting: a 4-channel conv plus a 1-channel conv (the one channel feeds all
    four), and a (4, 2, 2) feature map plus its pooled (C, 1, 1) summary (1,600 paths: the
    brute-force oracle's cost grows with the square of the path count)."""
    b = NetBuilder((1, 2, 2), seed, dtype)
    x = b.relu(b.conv(2, 1))
    wide = b.conv(4, 1, src=x)
    narrow = b.conv(1, 1, src=x)
    summed = b.relu(b.add(wide, narrow))
    pooled = b.adaptive(1)
    b.add(summed, pooled)
    b.relu()
    b.flatten()
    b.linear(2)
    return b.build()


NEW_OPS = {
    "pad_modes": pad_modes_net,
    "pad_modes_1d": lambda seed=0, dtype=torch.float64: pad_modes_net(seed, dtype, rank=1),
    "neg_inf_pad": neg_inf_pad_net,
    "channel_affine": channel_affine_net,
    "broadcast_add": broadcast_add_net,
    "prelu_scale": prelu_scale_net,
    "pad": pad_net,
    "crop": crop_net,
    "fixed_filter": fixed_filter_net,
    "channel_bias": channel_bias_net,
    "sub": sub_net,
    "shuffle_split": shuffle_split_net,
    "gather": gather_net,
    "conv_transpose": conv_transpose_net,
    "conv_transpose_1d": conv_transpose_1d_net,
    "conv3d": conv3d_net,
    "conv3d_floor_incl": lambda seed=0, dtype=torch.float64: conv3d_net(seed, dtype, False, True),
    **CEIL_POOLS,
    **{
        name: (
            lambda seed=0, dtype=torch.float64, shape=shape, resizes=resizes: upsample_net(seed, dtype, shape, resizes)
        )
        for name, (shape, resizes) in UPSAMPLES.items()
    },
}

CATALOGUE = {
    "mlp": mlp,
    "mlp_nobias_transposed": lambda seed=0, dtype=torch.float64: mlp(seed, dtype, bias=False, transposed=True),
    "mlp_leaky": mlp_leaky,
    "conv_maxpool": conv_maxpool,
    "conv_maxpool_strided": conv_maxpool_strided,
    "residual": residual,
    "conv_residual": conv_residual,
    "avgpool": avgpool_net,
    "avgpool_nopad": lambda seed=0, dtype=torch.float64: avgpool_net(seed, dtype, count_include_pad=False),
    "avgpool_ceil": lambda seed=0, dtype=torch.float64: avgpool_net(seed, dtype, ceil_mode=True),
    "avgpool_ceil_nopad": lambda seed=0, dtype=torch.float64: avgpool_net(seed, dtype, False, True),
    "concat": concat_net,
    "conv_bn": conv_bn,
    "grouped_conv": grouped_conv,
    "adaptive": adaptive_net,
    "conv1d": conv1d_net,
    "bottleneck": bottleneck,
    "mlp_bottleneck": mlp_bottleneck,
    "self_loop": self_loop,
    "maxpool_dilated": maxpool_dilated,
    **NEW_OPS,
}


@pytest.fixture(scope="session")
def nets():
    return SimpleNamespace(builder=NetBuilder, catalogue=CATALOGUE, cnn_bn_residual=cnn_bn_residual, **CATALOGUE)
