"""The handler of each ONNX op type the DAG reads, registered where it is written with
:func:`handles`: a handler reads one node through the :class:`~.onnx_translate.Translator` and
adds its graph nodes, or raises :class:`~.offenders.Unsupported` (or
:class:`~.offenders.NotHomogeneous`). The op types refused as not homogeneous and those that carry
weights are listed here too."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from math import prod

import onnx
import torch

from ...engine.graph import (
    AdaptiveAvgPool,
    Add,
    AvgPool,
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    Concat,
    Conv,
    ConvTranspose,
    Flatten,
    Identity,
    LeakyReLU,
    Linear,
    MaxPool,
    Node,
    Pad,
    PReLU,
    ReLU,
    Scale,
    Sub,
    Upsample,
)
from .offenders import NotHomogeneous, Unsupported
from .onnx_read import (
    float_attribute,
    has_attribute,
    int_attribute,
    ints_attribute,
    node_label,
    string_attribute,
)
from .onnx_translate import Handler, OpTable, Translator

# Op types refused as not positively homogeneous (no ReLU DAG), not merely as unsupported, where no
# handler reads them.
NOT_HOMOGENEOUS = {
    "Sigmoid",
    "Tanh",
    "Gelu",
    "Erf",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "Elu",
    "Selu",
    "Celu",
    "Softplus",
    "Softsign",
    "HardSigmoid",
    "HardSwish",
    "Mish",
    "Exp",
    "Log",
    "Sqrt",
    "Pow",
    "InstanceNormalization",
    "GroupNormalization",
    "LpNormalization",
    "Clip",
    "Reciprocal",
    "Div",
    "Mul",
    "MatMul",
    "Einsum",
    "Attention",
    "Cos",
    "Sin",
    "Tan",
    "Swish",
    "ThresholdedRelu",
    "Shrink",
}


# Ops that carry weights: the first of them on a path ends the pre-processing, and no
# post-processing comes before the last.
PARAMETER_LAYERS = {
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "BatchNormalization",
    "PRelu",
    "InstanceNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "Einsum",
    "LSTM",
    "GRU",
    "RNN",
    "ConvInteger",
    "MatMulInteger",
    "QLinearConv",
    "QLinearMatMul",
}


# The handler of each op type of the default domains, filled by :func:`handles`.
HANDLERS: dict[str, Handler] = {}


def handles(*op_types: str) -> Callable[[Handler], Handler]:
    """Registers the decorated function as the handler of ``op_types``."""

    def register(handler: Handler) -> Handler:
        for op_type in op_types:
            if op_type in HANDLERS:
                raise ValueError(f"two handlers for ONNX op type {op_type}")
            HANDLERS[op_type] = handler
        return handler

    return register


@handles("Gemm")
def _gemm(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    if int_attribute(node, "transA", 0) != 0:
        raise Unsupported("transA=1 is not supported")
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if float_attribute(node, "alpha", 1.0) != 1.0 or (has_bias and float_attribute(node, "beta", 1.0) != 1.0):
        raise Unsupported("alpha and beta other than 1 are not supported")
    _linear(
        translator,
        node,
        x,
        node.input[1],
        stored_in_out=int_attribute(node, "transB", 0) == 0,
        bias=node.input[2] if has_bias else None,
    )


@handles("MatMul")
def _matmul(translator: Translator, node: onnx.NodeProto) -> None:
    _linear(translator, node, translator.activation(node), node.input[1], stored_in_out=True, bias=None)


def _linear(
    translator: Translator, node: onnx.NodeProto, x: str, weight_value: str, *, stored_in_out: bool, bias: str | None
) -> None:
    """``stored_in_out``: the op reads its weight input as ``[in, out]`` (MatMul, Gemm transB=0)."""
    if not translator.is_static(weight_value):
        raise NotHomogeneous()  # a product of two activations, whatever their ranks
    if translator.rank(x) != 2:
        raise Unsupported(f"input '{x}' has rank {translator.rank(x)}; only (batch, features) inputs are supported")
    if translator.rank(weight_value) != 2:
        raise Unsupported(f"weight '{weight_value}' must have rank 2")
    weight = translator.weight(weight_value)
    bias_key = translator.plain_weight(bias, "bias", 1) if bias is not None else None
    translator.emit_for(
        node, Linear, x, weight=weight.key, bias=bias_key, weight_transposed=stored_in_out != weight.transposed
    )


def _kernel_rank(translator: Translator, node: onnx.NodeProto, convolutions: str) -> int:
    """The rank of the kernel (input 1) of a 1-d, 2-d or 3-d convolution; ``convolutions``: what
    the node is, for the refusal of any other."""
    rank = translator.rank(node.input[1])
    if rank not in (3, 4, 5):
        raise Unsupported(f"only 1-d, 2-d and 3-d {convolutions} are supported (kernel rank {rank})")
    return rank


@handles("Conv")
def _conv(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    rank = _kernel_rank(translator, node, "convolutions")
    weight = translator.plain_weight(node.input[1], "kernel", rank)
    bias = translator.plain_weight(node.input[2], "bias", 1) if len(node.input) > 2 and node.input[2] else None
    spatial = rank - 2
    begin, end = _pads(node, spatial)
    if begin != end:
        # torch.export folds a ZeroPad before a conv into the conv's (asymmetric) pads.
        pad = translator.graph_node(
            Pad.op, translator.unique_name(f"{node_label(node)}/pad"), [translator.source_node(x)], begin=begin, end=end
        )
        translator.add_node(pad, None)
        padded = f"{node.output[0]}/padded"
        translator.node_of_value[padded] = pad.name
        x, begin = padded, (0,) * spatial
    translator.emit_for(
        node,
        Conv,
        x,
        weight=weight,
        bias=bias,
        stride=tuple(ints_attribute(node, "strides", [1] * spatial)),
        padding=begin,
        dilation=tuple(ints_attribute(node, "dilations", [1] * spatial)),
        groups=int_attribute(node, "group", 1),
    )


@handles("ConvTranspose")
def _conv_transpose(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    rank = _kernel_rank(translator, node, "transposed convolutions")
    if has_attribute(node, "output_shape"):
        raise Unsupported("an explicit output_shape is not supported; export with output_padding")
    weight = translator.plain_weight(node.input[1], "kernel", rank)
    bias = translator.plain_weight(node.input[2], "bias", 1) if len(node.input) > 2 and node.input[2] else None
    spatial = rank - 2
    translator.emit_for(
        node,
        ConvTranspose,
        x,
        weight=weight,
        bias=bias,
        stride=tuple(ints_attribute(node, "strides", [1] * spatial)),
        padding=_symmetric_pads(node, spatial),
        output_padding=tuple(ints_attribute(node, "output_padding", [0] * spatial)),
        dilation=tuple(ints_attribute(node, "dilations", [1] * spatial)),
        groups=int_attribute(node, "group", 1),
    )


@handles("PRelu")
def _prelu(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    if not translator.is_static(node.input[1]):
        raise Unsupported("a slope computed from the network input is not a PReLU")
    weight = translator.weight(node.input[1])
    slope_shape = tuple(translator.shapes.get(node.input[1]) or ())
    channels = translator.batch_free_shape(x)[0]
    # Broadcast against (batch, C, *spatial): one slope, or one per channel on the channel axis.
    batch_free_rank = len(translator.shapes[x]) - 1
    per_channel = len(slope_shape) >= batch_free_rank and slope_shape[-batch_free_rank] == channels
    if weight.transposed or not (prod(slope_shape) == 1 or (prod(slope_shape) == channels and per_channel)):
        raise Unsupported(f"only one slope per channel or one shared slope is supported (slope shape {slope_shape})")
    translator.emit_for(node, PReLU, x, weight=weight.key)


@handles("Mul", "Div")
def _scale(translator: Translator, node: onnx.NodeProto) -> None:
    """Mul or Div by a stored scalar: a fixed edge of that weight. Mul by a stored per-channel
    tensor: a per-channel scale (its DAG parameters), whose shift an Add may follow."""
    static = [i for i, v in enumerate(node.input) if translator.is_static(v)]
    if len(static) != 1:
        raise NotHomogeneous()
    if node.op_type == "Div" and static[0] == 0:
        raise Unsupported("dividing a constant by an activation is not homogeneous")
    x = translator.activation(node, 1 - static[0])
    scale = translator.per_channel_parameter(node, translator.activations)
    if scale is not None:
        # Its shift, when an Add follows, is set by that Add.
        translator.emit_for(node, ChannelAffine, x, weight=translator.weight(scale).key, bias=None)
        return
    constant = translator.static_floats(node.input[static[0]])
    if constant is None or len(constant) != 1:
        raise Unsupported(
            _layout_reason(translator, node.input[static[0]], x)
            or (
                f"only multiplication by a stored scalar or a per-channel tensor, or division by a stored scalar, is "
                f"supported ('{node.input[static[0]]}')"
            )
        )
    factor = constant[0]
    if node.op_type == "Div":
        if factor == 0:
            raise Unsupported("division by zero")
        factor = 1.0 / factor
    if not math.isfinite(factor):
        raise Unsupported(f"the constant factor {factor} is not finite")
    translator.emit_for(node, Scale, x, factor=factor)


# ONNX Pad modes as the graph's (a constant is zeros or -inf by its value).
_PAD_MODES = {"constant": "zeros", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@handles("Pad")
def _pad(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    onnx_mode = string_attribute(node, "mode", "constant")
    rank = translator.rank(x)
    pads = translator.static_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    value = translator.static_floats(node.input[2]) if len(node.input) > 2 and node.input[2] else [0.0]
    axes = translator.static_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else list(range(rank))
    mode = _PAD_MODES.get(onnx_mode)
    if mode is None:
        raise Unsupported(f"mode {onnx_mode!r} is not supported (constant, reflect, edge, wrap)")
    if mode == "zeros" and value == [-math.inf]:
        mode = "-inf"
    elif mode == "zeros" and value not in ([0.0], [0]):
        raise Unsupported(
            f"padding with the constant {value} is not positively homogeneous (a padded neuron "
            "keeps its value whatever its channel's scale); only 0, and −inf before max pooling, are"
        )
    if pads is None or axes is None:
        raise Unsupported("its pads and axes must be stored tensors")
    begin, end = [0] * rank, [0] * rank
    for axis, before, after in zip(axes, pads[: len(axes)], pads[len(axes) :]):
        begin[axis % rank], end[axis % rank] = before, after
    if begin[:2] != [0, 0] or end[:2] != [0, 0]:
        raise Unsupported(f"only padding or cropping (negative pads) of the spatial axes is supported (pads {pads})")
    if mode == "circular":
        shape = translator.shapes.get(x) or ()
        for axis in range(2, min(rank, len(shape))):
            size = shape[axis]
            if size is not None and max(begin[axis], end[axis]) > size:
                raise Unsupported(
                    f"wrap padding of {max(begin[axis], end[axis])} on axis {axis}, of size {size}, wraps around "
                    "more than once; pathcond pads circularly by at most the size of the axis (torch's "
                    "circular padding)"
                )
    if mode == "reflect":
        shape = translator.shapes.get(x) or ()
        for axis in range(2, min(rank, len(shape))):
            # ONNX crops first and reflects within what is left (onnxruntime refuses a wider
            # reflection, which torch's F.pad would compute otherwise).
            left = shape[axis] + min(begin[axis], 0) + min(end[axis], 0) if shape[axis] is not None else None
            if left is not None and max(begin[axis], end[axis]) > left - 1:
                raise Unsupported(
                    f"reflect padding of {max(begin[axis], end[axis])} on axis {axis}, which keeps {left} of its "
                    f"{shape[axis]} elements after cropping, reflects beyond the axis: ONNX reflects by at most "
                    "the elements kept − 1 (onnxruntime refuses this model)"
                )
    translator.emit_for(node, Pad, x, begin=tuple(begin[2:]), end=tuple(end[2:]), mode=mode)


@handles("Resize")
def _resize(translator: Translator, node: onnx.NodeProto) -> None:
    """Resize as torch exports nn.Upsample/F.interpolate: nearest (asymmetric, floor) or linear
    (half_pixel, pytorch_half_pixel, align_corners), with constant scales or known sizes."""
    x = translator.activation(node)
    mode, transform, nearest = (
        string_attribute(node, name, default)
        for name, default in (
            ("mode", "nearest"),
            ("coordinate_transformation_mode", "half_pixel"),
            ("nearest_mode", "round_prefer_floor"),
        )
    )
    if (
        int_attribute(node, "antialias", 0)
        or string_attribute(node, "keep_aspect_ratio_policy", "stretch") != "stretch"
    ):
        raise Unsupported("antialias and keep_aspect_ratio_policy other than stretch are not supported")
    rank = translator.rank(x)
    if has_attribute(node, "axes") and sorted(a % rank for a in ints_attribute(node, "axes", [])) != list(range(rank)):
        raise Unsupported("resizing a subset of the axes (axes attribute) is not supported")
    if mode == "nearest" and (transform, nearest) != ("asymmetric", "floor"):
        raise Unsupported(
            f"nearest mode is supported as torch's 'nearest' exports it (coordinate_transformation_mode "
            f"asymmetric, nearest_mode floor), not {transform}/{nearest}"
        )
    if mode == "linear" and transform not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        raise Unsupported(
            f"linear mode with coordinate_transformation_mode {transform!r} is not supported "
            "(half_pixel, pytorch_half_pixel, align_corners)"
        )
    if mode not in ("nearest", "linear"):
        raise Unsupported(f"mode {mode!r} is not supported (nearest and linear only)")
    if rank not in (3, 4, 5):
        raise Unsupported(f"only 1-d, 2-d and 3-d feature maps can be resized ('{x}' has rank {rank})")
    has_scales = len(node.input) > 2 and bool(node.input[2])
    if has_scales == (len(node.input) > 3 and bool(node.input[3])):
        raise Unsupported("exactly one of scales and sizes must be given")
    in_shape = translator.batch_free_shape(x)
    if has_scales:
        scales = _concatenated_floats(translator, node.input[2])
        if scales is None or len(scales) != rank or min(scales) <= 0:
            raise Unsupported(f"its scales must be a stored constant of {rank} positive numbers (got {scales})")
        # Shape inference does not follow scales through a Concat: the output size as ONNX defines it.
        out_shape = tuple(math.floor(n * scale) for n, scale in zip(in_shape, scales[1:]))
        translator.shapes[node.output[0]] = (translator.shapes[x][0], *out_shape)
        resize: dict[str, tuple] = {"scale_factor": tuple(scales[2:])}
    else:
        out_shape = translator.batch_free_shape(node.output[0])
        resize = {"size": tuple(out_shape[1:])}
    if in_shape[0] != out_shape[0] or (has_scales and scales[0] != 1):
        raise Unsupported("resizing the batch or channel axis is not supported")
    if transform == "pytorch_half_pixel" and 1 in out_shape[1:]:
        raise Unsupported("pytorch_half_pixel with an output size of 1 does not match torch's interpolation")
    translator.emit_for(node, Upsample, x, mode=mode, align_corners=transform == "align_corners", **resize)


def _concatenated_floats(translator: Translator, value: str) -> list[float] | None:
    """A stored float tensor, or a Concat of them (the TorchScript exporter without folding)."""
    producer = translator.producer.get(value)
    if producer is not None and producer.op_type == "Concat":
        parts = [translator.static_floats(v) for v in producer.input]
        return None if None in parts else [f for part in parts for f in part]
    return translator.static_floats(value)


@handles("BatchNormalization")
def _batch_norm(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    if int_attribute(node, "training_mode", 0) != 0:
        raise Unsupported("training_mode=1 (batch statistics) is not an inference graph")
    translator.require_unused(node, 1, 2)
    roles = ("scale", "bias", "mean", "variance")
    scale, bias, mean, var = (translator.plain_weight(v, role, 1) for v, role in zip(node.input[1:5], roles))
    # ONNX momentum weighs the running statistic, torch's the batch statistic.
    translator.emit_for(
        node,
        BatchNorm,
        x,
        weight=scale,
        bias=bias,
        running_mean=mean,
        running_var=var,
        eps=float_attribute(node, "epsilon", 1e-5),
        momentum=1.0 - float_attribute(node, "momentum", 0.9),
    )


@handles("Relu")
def _relu(translator: Translator, node: onnx.NodeProto) -> None:
    translator.emit_for(node, ReLU, translator.activation(node))


@handles("LeakyRelu")
def _leaky_relu(translator: Translator, node: onnx.NodeProto) -> None:
    translator.emit_for(
        node, LeakyReLU, translator.activation(node), negative_slope=float_attribute(node, "alpha", 0.01)
    )


@handles("Identity")
def _identity(translator: Translator, node: onnx.NodeProto) -> None:
    translator.emit_for(node, Identity, translator.activation(node))


@handles("Dropout")
def _dropout(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    training = node.input[2] if len(node.input) > 2 else ""
    if training and translator.static_ints(training) != [0]:
        raise Unsupported("training_mode must be absent or a constant false")
    translator.require_unused(node, 1)
    translator.emit_for(node, Identity, x)


def _spatial_rank(translator: Translator, value: str) -> int:
    rank = translator.rank(value)
    if rank not in (3, 4, 5):
        raise Unsupported(f"pooling needs a 1-d, 2-d or 3-d feature map ('{value}' has rank {rank})")
    return rank - 2


@handles("MaxPool")
def _max_pool(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    translator.require_unused(node, 1)
    spatial = _spatial_rank(translator, x)
    translator.emit_for(
        node,
        MaxPool,
        x,
        kernel=tuple(ints_attribute(node, "kernel_shape", [])),
        stride=tuple(ints_attribute(node, "strides", [1] * spatial)),
        padding=_symmetric_pads(node, spatial),
        dilation=tuple(ints_attribute(node, "dilations", [1] * spatial)),
        ceil_mode=bool(int_attribute(node, "ceil_mode", 0)),
    )


@handles("AveragePool")
def _average_pool(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    spatial = _spatial_rank(translator, x)
    if any(d != 1 for d in ints_attribute(node, "dilations", [1] * spatial)):
        raise Unsupported("dilated average pooling is not supported")
    translator.emit_for(
        node,
        AvgPool,
        x,
        kernel=tuple(ints_attribute(node, "kernel_shape", [])),
        stride=tuple(ints_attribute(node, "strides", [1] * spatial)),
        padding=_symmetric_pads(node, spatial),
        ceil_mode=bool(int_attribute(node, "ceil_mode", 0)),
        count_include_pad=bool(int_attribute(node, "count_include_pad", 0)),
    )


@handles("GlobalAveragePool")
def _global_average_pool(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.activation(node)
    translator.emit_for(node, AdaptiveAvgPool, x, output_size=(1,) * _spatial_rank(translator, x))


@handles("ReduceMean")
def _reduce_mean(translator: Translator, node: onnx.NodeProto) -> None:
    """A mean over every spatial axis is global average pooling (torch.export's form of it)."""
    _global_pooling(
        translator,
        node,
        "mean",
        lambda name, source, spatial: [
            translator.graph_node(AdaptiveAvgPool.op, name, [source], output_size=(1,) * len(spatial))
        ],
    )


@handles("ReduceMax")
def _reduce_max(translator: Translator, node: onnx.NodeProto) -> None:
    """A max over every spatial axis is global max pooling: one window, the whole map."""
    _global_pooling(
        translator,
        node,
        "max",
        lambda name, source, spatial: [
            translator.graph_node(
                MaxPool.op,
                name,
                [source],
                kernel=tuple(spatial),
                stride=tuple(spatial),
                padding=(0,) * len(spatial),
                dilation=(1,) * len(spatial),
            )
        ],
    )


@handles("ReduceSum")
def _reduce_sum(translator: Translator, node: onnx.NodeProto) -> None:
    """A sum over every spatial axis is global sum pooling: the mean times the window's size
    (each pixel's edge to the sum has weight 1/k·k = 1)."""
    _global_pooling(
        translator,
        node,
        "sum",
        lambda name, source, spatial: [
            translator.graph_node(AdaptiveAvgPool.op, f"{name}/mean", [source], output_size=(1,) * len(spatial)),
            translator.graph_node(Scale.op, name, [f"{name}/mean"], factor=float(prod(spatial))),
        ],
    )


def _global_pooling(
    translator: Translator,
    node: onnx.NodeProto,
    reduction: str,
    pooling: Callable[[str, str, tuple[int, ...]], list[Node]],
) -> None:
    """A reduction over every spatial axis as the chain of graph nodes ``pooling(name, source,
    spatial size)`` builds, each reading the one before.

    Its input may be a data movement of a graph node (torch.export pools 1-d maps as
    (C, 1, L)): as long as each channel keeps exactly its own elements, the reduction is
    over the same elements.
    """
    x = translator.viewed_activation(node)
    rank, axes = translator.rank(x), _axes(translator, node)
    if axes is None or rank < 3 or sorted(a % rank for a in axes) != list(range(2, rank)):
        raise Unsupported(
            f"only a {reduction} over all spatial axes (global pooling) is supported: a {reduction} "
            f"over the batch or channel axis combines neurons of different channels "
            f"(axes {axes} of a rank-{rank} input)"
        )
    if x in translator.moves and x not in translator.node_of_value:
        with contextlib.suppress(Unsupported):
            translator.materialised(x)  # a channel slice or shuffle becomes a node of its own
    if x in translator.moves and x not in translator.node_of_value:
        source, index, _ = translator.moves[x]
        channels, *spatial = translator.node_shape(source)
        per_channel = prod(spatial)
        own = torch.arange(channels * per_channel).reshape(1, channels, per_channel)
        if tuple(index.shape[:2]) != (index.shape[0], channels) or not torch.equal(
            index[:1].reshape(1, channels, -1).sort(dim=2).values, own
        ):
            raise Unsupported(f"its input '{x}' does not keep the channels of '{source}'")
    else:
        source = translator.activation(node)
        channels, *spatial = translator.node_shape(source)
    if len(spatial) not in (1, 2, 3):
        raise Unsupported(f"its input '{x}' is not a 1-d, 2-d or 3-d feature map of the graph")
    pooled_shape = (channels,) + (1,) * len(spatial)
    chain = pooling(translator.unique_name(node_label(node)), translator.source_node(source), tuple(spatial))
    for pool in chain:
        translator.add_node(pool, pooled_shape)
    pool = chain[-1]
    if not int_attribute(node, "keepdims", 1):
        flatten = translator.graph_node(Flatten.op, translator.unique_name(f"{pool.name}/flatten"), [pool.name])
        translator.emit(flatten, node.output[0])
        return
    pooled_value = f"{node.output[0]}/pooled"
    translator.node_of_value[pooled_value] = pool.name
    translator.activations.add(pooled_value)
    out_shape = translator.batch_free_shape(node.output[0])
    batch = translator.shapes[x][0]
    translator.moves[node.output[0]] = (pooled_value, torch.arange(batch * channels).reshape(batch, *out_shape), node)


def _axes(translator: Translator, node: onnx.NodeProto) -> list[int] | None:
    """The ``axes`` of a reduction or squeeze: an input from opset 13/18 on, an attribute before."""
    if len(node.input) > 1 and node.input[1]:
        return translator.static_ints(node.input[1])
    return ints_attribute(node, "axes", None)


@handles("Abs")
def _abs(translator: Translator, node: onnx.NodeProto) -> None:
    """|x| is a LeakyReLU of slope −1: positively homogeneous, piecewise linear, not a ReLU."""
    translator.emit_for(node, LeakyReLU, translator.activation(node), negative_slope=-1.0)


@handles("Gather")
def _gather(translator: Translator, node: onnx.NodeProto) -> None:
    """Gather by stored indices: data movement (each output element copies one input element)."""
    x = translator.viewed_activation(node)
    indices = translator.static_ints(node.input[1])
    if indices is None:
        raise Unsupported(f"its indices '{node.input[1]}' are not a stored tensor")
    rank = translator.rank(x)
    axis = int_attribute(node, "axis", 0) % rank
    indices_shape = translator.shapes.get(node.input[1])
    if indices_shape is None or None in indices_shape:
        raise Unsupported(f"the shape of its indices '{node.input[1]}' is unknown after shape inference")

    def transform(index: torch.Tensor) -> torch.Tensor:
        picked = torch.tensor(indices, dtype=torch.long) % index.shape[axis]
        gathered = index.index_select(axis, picked)
        return gathered.reshape(*index.shape[:axis], *indices_shape, *index.shape[axis + 1 :])

    translator.move(node, transform)


@handles("Flatten", "Reshape", "Squeeze", "Unsqueeze")
def _reshape(translator: Translator, node: onnx.NodeProto) -> None:
    """Reshape, Flatten, Squeeze, Unsqueeze: data movement to the inferred output shape."""
    out_shape = translator.shapes.get(node.output[0])
    if out_shape is None or any(d is None for d in out_shape):
        raise Unsupported(f"ONNX shape inference cannot determine the shape of '{node.output[0]}'")
    translator.move(node, lambda index: index.reshape(out_shape))


@handles("Transpose")
def _transpose(translator: Translator, node: onnx.NodeProto) -> None:
    perm = ints_attribute(node, "perm", None)
    translator.move(
        node, lambda index: index.permute(perm) if perm is not None else index.permute(*reversed(range(index.dim())))
    )


@handles("Split")
def _split(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.viewed_activation(node)
    axis = int_attribute(node, "axis", 0) % translator.rank(x)
    sizes = translator.static_ints(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if sizes is None:
        if len(node.input) > 1 and node.input[1]:
            raise Unsupported(f"its split sizes '{node.input[1]}' are not a stored tensor")
        sizes = [translator.shapes[out][axis] for out in node.output]
    translator.move(node, lambda index: list(torch.split(index, sizes, dim=axis)))


@handles("Slice")
def _slice(translator: Translator, node: onnx.NodeProto) -> None:
    x = translator.viewed_activation(node)
    rank = translator.rank(x)
    starts, ends = translator.static_ints(node.input[1]), translator.static_ints(node.input[2])
    axes = (
        translator.static_ints(node.input[3])
        if len(node.input) > 3 and node.input[3]
        else list(range(len(starts or [])))
    )
    steps = translator.static_ints(node.input[4]) if len(node.input) > 4 and node.input[4] else [1] * len(axes or [])
    if None in (starts, ends, axes, steps):
        raise Unsupported("its starts, ends, axes and steps must be stored tensors")
    if any(step != 1 for step in steps):
        raise Unsupported(f"only slices with step 1 are supported (steps {steps})")

    def transform(index: torch.Tensor) -> torch.Tensor:
        key = [slice(None)] * rank
        for start, end, axis in zip(starts, ends, axes):
            key[axis % rank] = slice(start, end)
        return index[tuple(key)]

    translator.move(node, transform)


@handles("Sum", "Add")
def _add(translator: Translator, node: onnx.NodeProto) -> None:
    static = [v for v in node.input if translator.is_static(v)]
    if not static:
        # Broadcasting is checked with the graph's shapes (graph.broadcast_problem).
        values = [translator.activation(node, i) for i in range(len(node.input))]
        translator.emit_for(node, Add, *values)
        return
    if len(node.input) != 2 or len(static) != 1:
        raise Unsupported("only a sum of activations, or a stored constant added to one, is supported")
    x = translator.activation(node, 1 - list(node.input).index(static[0]))
    if translator.adds_nothing(node, x, static[0]):
        # MobileOne's ``out += identity`` with identity = 0 in its stem: nothing is added.
        translator.emit_for(node, Identity, x)
        return
    _fuse_bias(translator, node, x, static[0])


@handles("Sub")
def _sub(translator: Translator, node: onnx.NodeProto) -> None:
    """Sub of two activations: a difference node. A stored constant subtracted is refused (it
    is no bias pathcond could write back: the tensor would have to change sign)."""
    if any(translator.is_static(v) for v in node.input):
        raise Unsupported("only a difference of two activations is supported, not a stored constant subtracted")
    translator.emit_for(node, Sub, translator.activation(node, 0), translator.activation(node, 1))


@handles("Neg")
def _neg(translator: Translator, node: onnx.NodeProto) -> None:
    """Neg: a fixed edge of weight −1, the scale node of factor −1."""
    translator.emit_for(node, Scale, translator.activation(node), factor=-1.0)


def _layout_reason(translator: Translator, constant: str, x: str) -> str | None:
    """Why stored ``constant`` is not read as per-channel when it holds one value per channel
    of the feature map that activation ``x`` moves, along another axis of ``x`` than axis 1
    (the last axis of an NHWC view): its layout; None for any other constant."""
    shape, x_shape = translator.shapes.get(constant), translator.shapes.get(x)
    if x not in translator.moves or shape is None or x_shape is None or len(shape) > len(x_shape) or None in shape:
        return None
    aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
    varying = [axis for axis, size in enumerate(aligned) if size != 1]
    if len(varying) != 1 or varying[0] < 2 or aligned[varying[0]] != x_shape[varying[0]]:
        return None
    axis = varying[0]
    source, index, _ = translator.moves[x]
    channels, *spatial = translator.node_shape(source)
    per_channel = prod(spatial)
    channel = (index[:1] % (channels * per_channel)).div(per_channel, rounding_mode="floor")
    lines = channel.movedim(axis, -1).reshape(-1, channel.shape[axis])
    if channels != channel.shape[axis] or not (
        bool((lines == lines[:1]).all()) and torch.equal(lines[0].sort().values, torch.arange(channels))
    ):
        return None
    last = ", its last axis (where an NHWC tensor has its channels)" if axis == len(x_shape) - 1 else ""
    return (
        f"'{constant}' holds one value per index of axis {axis} of '{x}'{last}: pathcond reads a per-channel "
        "constant along axis 1 (NCHW) only, so this layout is not supported; apply it in NCHW layout (after "
        "the Transpose back), where it is a per-channel scale or shift that rescales with its channel"
    )


def _fuse_bias(translator: Translator, node: onnx.NodeProto, x: str, bias_value: str) -> None:
    """``MatMul`` then ``Add`` of a stored vector: that vector is the Linear layer's bias; a
    per-channel scale (Mul) then ``Add`` of a stored per-channel tensor: its shift. Any other
    stored per-channel tensor added is a bias of its own on fixed edges (a ChannelBias)."""
    layer = translator.nodes.get(translator.source_node(x))
    if (
        isinstance(layer, ChannelAffine)
        and layer.bias is None
        and translator.readers(x) == 1
        and translator.is_per_channel(bias_value, x)
    ):
        bias = translator.weight(bias_value).key
        if translator.aliases.get(bias, bias) == translator.aliases.get(layer.weight, layer.weight):
            raise Unsupported(
                f"it adds '{bias_value}', the tensor node '{layer.name}' multiplies by: one tensor as both the "
                "per-channel scale and the shift after it cannot be rescaled (the scale changes by the ratio of "
                "two channel factors, the shift by one); store the shift as a tensor of its own"
            )
    elif isinstance(layer, Linear) and layer.bias is None and translator.readers(x) == 1:
        bias = translator.plain_weight(bias_value, "bias", 1)
    elif translator.is_per_channel(bias_value, x):
        translator.emit_for(node, ChannelBias, x, bias=translator.weight(bias_value).key)
        return
    else:
        raise Unsupported(
            _layout_reason(translator, bias_value, x)
            or (
                f"adding the constant '{bias_value}' is only supported as the bias of a MatMul, or as a tensor "
                "holding one value per channel (axis 1, broadcast along every other axis), which rescales with "
                "its channel: a constant shared by several channels would have to rescale by two factors at once, "
                "and one varying within a channel would be a bias per neuron, which pathcond does not read"
            )
        )
    translator.nodes[layer.name] = dataclasses.replace(layer, bias=bias)
    translator.node_of_value[node.output[0]] = layer.name


@handles("Concat")
def _concat(translator: Translator, node: onnx.NodeProto) -> None:
    axis = int_attribute(node, "axis", 1) % translator.rank(node.output[0])
    if axis != 1:
        _concat_moves(translator, node, axis)
        return
    values = [translator.activation(node, i) for i in range(len(node.input))]
    translator.emit_for(node, Concat, *values)


def _concat_moves(translator: Translator, node: onnx.NodeProto, axis: int) -> None:
    """Concat along another axis of pieces of one activation (the TorchScript exporter writes
    circular padding as Slices and a Concat): data movement of that activation."""
    pieces = []
    for i, value in enumerate(node.input):
        if value not in translator.activations:
            raise Unsupported(
                f"only concatenation along the channel axis, or of pieces of one activation, is "
                f"supported (axis={axis}; input {i} is a constant)"
            )
        pieces.append(translator.index_map(value))
    if len({source for source, _ in pieces}) != 1:
        raise Unsupported(
            f"only concatenation along the channel axis, or of pieces of one activation, is supported (axis={axis})"
        )
    translator.moves[node.output[0]] = (pieces[0][0], torch.cat([index for _, index in pieces], dim=axis), node)


def _pads(node: onnx.NodeProto, spatial: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``pads`` as per-axis (begin, end)."""
    auto_pad = string_attribute(node, "auto_pad", "NOTSET")
    if auto_pad == "VALID":
        return (0,) * spatial, (0,) * spatial
    if auto_pad != "NOTSET":
        raise Unsupported(f"auto_pad={auto_pad} is not supported; export with explicit pads")
    pads = ints_attribute(node, "pads", [0] * (2 * spatial))
    return tuple(pads[:spatial]), tuple(pads[spatial:])


def _symmetric_pads(node: onnx.NodeProto, spatial: int) -> tuple[int, ...]:
    """``pads`` as torch's per-axis padding; torch has no asymmetric padding for these ops."""
    begin, end = _pads(node, spatial)
    if begin != end:
        raise Unsupported(f"asymmetric padding {list(begin + end)} is not supported")
    return begin


# What the translator is given (``onnx_format`` hands it over): the registry itself, so that a
# handler registered or replaced later is the one it calls.
OPS = OpTable(HANDLERS, frozenset(NOT_HOMOGENEOUS), frozenset(PARAMETER_LAYERS))
