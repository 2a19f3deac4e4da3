"""The handler of each torch operation the module route reads, registered where it is written.

:mod:`.fx_import` traces the module and looks each fx node up in the registry of its kind,
filled here by the decorators: an ``nn.Module`` call in :data:`MODULES` (:func:`module_handler`,
or :func:`module_attributes_handler` for a translator of hyper-parameters, which torch names
alike as module attributes and function arguments), a function in :data:`CALLS` (raw node,
:func:`call_handler`), :data:`STORED_READERS` (a layer reading its weights through ``get_attr``,
:func:`stored_reader`) or :data:`FUNCTIONS` (arguments by name, :func:`function_handler`,
:func:`function_kwargs_handler`), a Tensor method in :data:`METHODS` (:func:`method_handler`).
Pure data movement is no handler: :data:`MOVEMENT_FUNCTIONS` and :data:`MOVEMENT_METHODS` are
replayed on index tensors and read by :mod:`.movement`.

A handler returns spec layers (``{"type": ..., "inputs": [fx nodes], **fields}``, see
:mod:`.spec`) or raises :class:`~.offenders.Unsupported` (or :class:`~.offenders.NotHomogeneous`).
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from ...engine.graph import COPYING_PAD_MODES
from .export_graph import slice_along
from .offenders import NotHomogeneous, Unsupported

SUPPORTED_SUMMARY = (
    "pathcond supports Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, BatchNorm1d/2d/3d, ReLU, LeakyReLU, "
    "PReLU, abs, Identity, Dropout, max/avg/adaptive-avg pooling, mean over spatial axes, zero, reflect, replicate "
    "and circular padding, spatial crops, -inf padding before max pooling, multiplication or division by a "
    "constant, negation, a per-channel scale and shift by stored tensors (or a shift alone), a depthwise "
    "convolution by a filter buffer (fixed), nearest and (bi/tri)linear Upsample/interpolate, flatten, channel "
    "slices/chunks/splits and shuffles, residual add, the difference of two tensors and torch.cat(dim=1)"
)


# Handlers of one fx node: of a module and its path (the prefix of its state_dict keys); of a
# function's arguments by name, with the node and the traced values; of those arguments and
# the stored tensors; of the raw node and the traced values.
ModuleHandler = Callable[[Any, str], dict[str, Any] | list[dict[str, Any]]]
FunctionHandler = Callable[[Mapping[str, Any], torch.fx.Node, Mapping[torch.fx.Node, Any]], dict[str, Any]]
StoredReader = Callable[[Mapping[str, Any], "StoredTensors"], dict[str, Any]]
CallHandler = Callable[[torch.fx.Node, Mapping[torch.fx.Node, Any]], list[dict[str, Any]]]

MODULES: dict[type[nn.Module], ModuleHandler] = {}
FUNCTIONS: dict[Callable[..., Any], FunctionHandler] = {}
# Functions whose weights are stored tensors read through get_attr (a module that calls the
# functional form on its own parameters, as timm's BatchNormAct2d and StdConv2d do).
STORED_READERS: dict[Callable[..., Any], StoredReader] = {}
# Functions read from their raw arguments: overloaded (torch.add's and torch.cat's schemas are
# ambiguous to fx's normaliser) or operators.
CALLS: dict[Callable[..., Any], CallHandler] = {}
METHODS: dict[str, CallHandler] = {}
# torch's own functions are overloaded C builtins whose overload fx's normaliser has to pick
# (ambiguous on some torch versions): their arguments are bound to these signatures.
BUILTIN_SIGNATURES: dict[Callable[..., Any], inspect.Signature] = {}

# Pure data movement, replayed on index tensors by the driver.
MOVEMENT_FUNCTIONS = (
    torch.flatten,
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.chunk,
    torch.split,
    torch.tensor_split,
    torch.unbind,
    torch.select,
    torch.squeeze,
    torch.unsqueeze,
    torch.narrow,
    torch.channel_shuffle,
    F.channel_shuffle,
    operator.getitem,
    slice_along,
)
MOVEMENT_METHODS = (
    "view",
    "reshape",
    "flatten",
    "transpose",
    "permute",
    "contiguous",
    "chunk",
    "split",
    "tensor_split",
    "unbind",
    "select",
    "squeeze",
    "unsqueeze",
    "narrow",
    "__getitem__",
)

_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def _registering(
    registry: dict[Any, Any],
    keys: Sequence[Any],
    wrap: Callable[[Any], Any] | None = None,
    signature: inspect.Signature | None = None,
) -> Callable[[_Handler], _Handler]:
    """A decorator filing its function (``wrap``-ped) in ``registry`` under each of ``keys``,
    and ``signature`` as theirs in :data:`BUILTIN_SIGNATURES`."""

    def register(handler: _Handler) -> _Handler:
        entry = handler if wrap is None else wrap(handler)
        for key in keys:
            if key in registry:
                raise ValueError(f"two fx handlers for {key!r}")
            registry[key] = entry
            if signature is not None:
                BUILTIN_SIGNATURES[key] = signature
        return handler

    return register


def module_handler(*module_types: type[nn.Module]) -> Callable[[_Handler], _Handler]:
    """Registers a :data:`ModuleHandler` of ``module_types``."""
    return _registering(MODULES, module_types)


def module_attributes_handler(*module_types: type[nn.Module]) -> Callable[[_Handler], _Handler]:
    """Registers a translator of hyper-parameters for ``module_types``, given each module's attributes:
    torch names them like the functional form's arguments, so one translator serves both."""
    return _registering(MODULES, module_types, lambda translate: lambda module, path: translate(vars(module)))


def function_handler(*functions: Callable[..., Any]) -> Callable[[_Handler], _Handler]:
    """Registers a :data:`FunctionHandler` of ``functions``."""
    return _registering(FUNCTIONS, functions)


def function_kwargs_handler(
    *functions: Callable[..., Any], signature: inspect.Signature | None = None
) -> Callable[[_Handler], _Handler]:
    """Registers a translator of hyper-parameters for ``functions``, given the call's arguments
    by name; the layer reads the ``input`` argument. ``signature``: see :data:`BUILTIN_SIGNATURES`."""

    def reading_input(translate: Callable[[Mapping[str, Any]], dict[str, Any]]) -> FunctionHandler:
        return lambda kwargs, node, values: {**translate(kwargs), "inputs": [kwargs["input"]]}

    return _registering(FUNCTIONS, functions, reading_input, signature)


def stored_reader(
    *functions: Callable[..., Any], signature: inspect.Signature | None = None
) -> Callable[[_Handler], _Handler]:
    """Registers a :data:`StoredReader` of ``functions``; ``signature``: see :data:`BUILTIN_SIGNATURES`."""
    return _registering(STORED_READERS, functions, signature=signature)


def call_handler(*functions: Callable[..., Any]) -> Callable[[_Handler], _Handler]:
    """Registers a :data:`CallHandler` of ``functions`` (operators, overloaded torch functions)."""
    return _registering(CALLS, functions)


def method_handler(*names: str) -> Callable[[_Handler], _Handler]:
    """Registers a :data:`CallHandler` of the Tensor methods ``names``."""
    return _registering(METHODS, names)


def _signature(*required: str, **defaults: Any) -> inspect.Signature:
    """A signature of positional-or-keyword parameters, in order: ``required``, then ``defaults``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [
            *(inspect.Parameter(name, kind) for name in required),
            *(inspect.Parameter(name, kind, default=value) for name, value in defaults.items()),
        ]
    )


# The field of a fixed filter's spec layer that names its buffer until the graph is built (no spec field).
FILTER_BUFFER = "filter_buffer"


class StoredTensors:
    """The tensors a functional layer reads through ``get_attr``: parameters, which it may
    rescale, and buffers, which are constants (timm's BatchNormAct2d calls ``F.batch_norm`` on
    its own parameters and statistics, BlurPool2d convolves with a filter buffer)."""

    def __init__(self, values: Mapping[torch.fx.Node, Any], state_keys: frozenset[str], parameter_keys: frozenset[str]):
        self.values = values
        self.state_keys = state_keys
        self.parameter_keys = parameter_keys

    def key(self, arg: Any, role: str) -> str:
        """The ``state_dict`` key of a parameter the layer reads as its ``role``."""
        target = self._target(arg, role)
        if target not in self.parameter_keys:
            raise Unsupported(_constant_outside_filter(target, role))
        return target

    def optional_key(self, arg: Any, role: str) -> str | None:
        return None if arg is None else self.key(arg, role)

    def statistic(self, arg: Any, role: str) -> str:
        """The ``state_dict`` key of a BatchNorm statistic (a buffer: read, never rescaled)."""
        return self.in_state(self._target(arg, role), role)

    def in_state(self, target: str, role: str) -> str:
        """``target``, a stored tensor the layer reads by name, which must be a ``state_dict`` key."""
        if target not in self.state_keys:
            raise Unsupported(
                f"its {role} '{target}' is not in the module's state_dict, where pathcond reads and writes the "
                "network's tensors: a buffer registered with persistent=False, or a tensor the forward computes "
                "from a stored one (self.scale.float(), which torch.fx keeps as a constant of its own). Register it "
                "as a parameter or a persistent buffer, and use it as stored"
            )
        return target

    def is_buffer(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and arg.target not in self.parameter_keys

    def value(self, arg: torch.fx.Node) -> torch.Tensor:
        return self.values[arg]

    @staticmethod
    def _target(arg: Any, role: str) -> str:
        if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr":
            raise Unsupported(
                f"its {role} is not a parameter or buffer of the module ({arg!r}); only stored "
                "tensors are layer parameters"
            )
        return arg.target


def _constant_outside_filter(target: str, role: str) -> str:
    return (
        f"its {role} '{target}' is a buffer of the module, a constant and not a parameter: pathcond reads a "
        "buffer as BatchNorm statistics, or as the filter of a depthwise convolution without bias (groups = "
        "channels, one filter per channel, as timm's BlurPool2d: a fixed per-channel filter), and nowhere "
        "else. Register it as an nn.Parameter to have it rescaled as a weight, or rescale the module's ONNX "
        "export, which stores it as a weight"
    )


def _rank(arg: Any, values: Mapping[torch.fx.Node, Any]) -> int:
    value = values.get(arg) if isinstance(arg, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        raise Unsupported("the rank of its input is unknown (the module could not be run on a zero input)")
    return value.dim()


# -- layers with weights --------------------------------------------------------------------


def _bias_key(module: nn.Module, target: str) -> str | None:
    return f"{target}.bias" if module.bias is not None else None


@module_handler(nn.Linear)
def _linear(module: nn.Linear, target: str) -> dict[str, Any]:
    return {"type": "linear", "weight": f"{target}.weight", "bias": _bias_key(module, target)}


@stored_reader(F.linear, signature=_signature("input", "weight", bias=None))
def _linear_function(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    return {
        "type": "linear",
        "weight": stored.key(kwargs["weight"], "weight"),
        "bias": stored.optional_key(kwargs.get("bias"), "bias"),
    }


@module_handler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def _conv(module: nn.Conv1d | nn.Conv2d, target: str) -> list[dict[str, Any]]:
    """A convolution; with a ``padding_mode`` other than zeros, the pad torch applies first
    (``F.pad(x, module._reversed_padding_repeated_twice, mode)``) and the conv without padding."""
    conv = _conv_layer(f"{target}.weight", _bias_key(module, target), module.stride, module.dilation, module.groups)
    if module.padding_mode == "zeros":
        return [{**conv, "padding": _conv_padding(module.padding, module.dilation, module.kernel_size)}]
    pad = _pad({"pad": module._reversed_padding_repeated_twice, "mode": module.padding_mode}, module.weight.dim())
    return [pad, {**conv, "padding": 0}]


def _conv_layer(weight: str, bias: str | None, stride: Any, dilation: Any, groups: int) -> dict[str, Any]:
    return {"type": "conv", "weight": weight, "bias": bias, "stride": stride, "dilation": dilation, "groups": groups}


def _conv_padding(padding: Any, dilation: Any, kernel_size: Sequence[int]) -> int | tuple[int, ...]:
    if padding == "valid":
        return 0
    if padding == "same":
        dilation = [dilation] * len(kernel_size) if isinstance(dilation, int) else dilation
        totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        if any(total % 2 for total in totals):
            raise Unsupported("padding='same' with an even receptive field pads asymmetrically")
        return tuple(total // 2 for total in totals)
    return padding


@stored_reader(
    torch.conv1d,
    torch.conv2d,
    torch.conv3d,
    signature=_signature("input", "weight", bias=None, stride=1, padding=0, dilation=1, groups=1),
)
def _conv_function(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    """``F.conv1d/2d/3d`` on a stored weight: a parameter, or a buffer holding fixed filters."""
    if stored.is_buffer(kwargs["weight"]):
        return _fixed_filter(kwargs, stored)
    conv = _conv_layer(
        stored.key(kwargs["weight"], "weight"),
        stored.optional_key(kwargs.get("bias"), "bias"),
        kwargs.get("stride", 1),
        kwargs.get("dilation", 1),
        kwargs.get("groups", 1),
    )
    padding = _conv_padding(kwargs.get("padding", 0), conv["dilation"], stored.value(kwargs["weight"]).shape[2:])
    return {**conv, "padding": padding}


def _fixed_filter(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    """A depthwise convolution by a buffer (timm's BlurPool2d): a filter of constants per channel."""
    weight = kwargs["weight"]
    filters = stored.value(weight)
    x = stored.values.get(kwargs["input"])
    channels = x.shape[1] if isinstance(x, torch.Tensor) else None
    if (
        kwargs.get("groups", 1) != channels
        or tuple(filters.shape[:2]) != (channels, 1)
        or kwargs.get("bias") is not None
    ):
        raise Unsupported(_constant_outside_filter(weight.target, "weight"))
    dilation = kwargs.get("dilation", 1)
    return {
        "type": "fixed_filter",
        FILTER_BUFFER: weight.target,
        "kernel": list(filters.shape[2:]),
        "coefficients": filters.detach().double().flatten().tolist(),
        "stride": kwargs.get("stride", 1),
        "padding": _conv_padding(kwargs.get("padding", 0), dilation, filters.shape[2:]),
        "dilation": dilation,
    }


@module_handler(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def _conv_transpose(
    module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d, target: str
) -> dict[str, Any]:
    if module.padding_mode != "zeros":
        raise Unsupported(f"padding_mode='{module.padding_mode}' is not supported (only zero padding)")
    return _conv_transpose_layer(f"{target}.weight", _bias_key(module, target), vars(module))


@stored_reader(
    torch.conv_transpose1d,
    torch.conv_transpose2d,
    torch.conv_transpose3d,
    signature=_signature("input", "weight", bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1),
)
def _conv_transpose_function(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    """``F.conv_transpose1d/2d/3d`` on a stored weight (torch.export records nn.ConvTranspose2d so)."""
    return _conv_transpose_layer(
        stored.key(kwargs["weight"], "weight"), stored.optional_key(kwargs.get("bias"), "bias"), kwargs
    )


def _conv_transpose_layer(weight: str, bias: str | None, args: Mapping[str, Any]) -> dict[str, Any]:
    """A transposed convolution from a module's attributes or the function's kwargs (named alike)."""
    return {
        "type": "conv_transpose",
        "weight": weight,
        "bias": bias,
        **{field: args[field] for field in ("stride", "padding", "output_padding", "dilation", "groups")},
    }


@module_handler(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def _batchnorm(module: nn.BatchNorm1d | nn.BatchNorm2d, target: str) -> dict[str, Any]:
    if not module.affine:
        raise Unsupported("affine=False (no weight and bias to rescale) is not supported")
    if module.running_mean is None:
        raise Unsupported("track_running_stats=False normalises with batch statistics even in eval mode")
    keys = (f"{target}.{role}" for role in ("weight", "bias", "running_mean", "running_var"))
    return _batchnorm_layer(*keys, eps=module.eps, momentum=module.momentum)


@stored_reader(F.batch_norm)
def _batch_norm_function(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    """``F.batch_norm`` on stored statistics and affine terms, in eval mode (timm's BatchNormAct2d)."""
    if kwargs.get("training"):
        raise Unsupported("training=True normalises with batch statistics even in eval mode")
    if kwargs.get("weight") is None or kwargs.get("bias") is None:
        raise Unsupported("without weight and bias (affine=False) there is nothing to rescale; not supported")
    return _batchnorm_layer(
        stored.key(kwargs["weight"], "weight"),
        stored.key(kwargs["bias"], "bias"),
        *(stored.statistic(kwargs.get(role), role) for role in ("running_mean", "running_var")),
        eps=kwargs.get("eps", 1e-5),
        momentum=kwargs.get("momentum", 0.1),
    )


def _batchnorm_layer(
    weight: str, bias: str, running_mean: str, running_var: str, *, eps: float, momentum: float | None
) -> dict[str, Any]:
    layer = {
        "type": "batchnorm",
        "weight": weight,
        "bias": bias,
        "running_mean": running_mean,
        "running_var": running_var,
        "eps": eps,
    }
    # momentum=None (cumulative average) only affects training; the spec default stands in.
    if momentum is not None:
        layer["momentum"] = momentum
    return layer


# -- activations -----------------------------------------------------------------------------


@module_attributes_handler(nn.ReLU)
@function_kwargs_handler(F.relu)
@function_kwargs_handler(torch.relu, torch.relu_, signature=_signature("input"))
def _relu(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "relu"}


@method_handler("relu", "relu_")
def _relu_method(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    return [{"type": "relu", "inputs": [node.args[0]]}]


@module_attributes_handler(nn.LeakyReLU)
@function_kwargs_handler(F.leaky_relu)
def _leaky_relu(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "leaky_relu", "negative_slope": args.get("negative_slope", 0.01)}


@module_handler(nn.PReLU)
def _prelu(module: nn.PReLU, target: str) -> dict[str, Any]:
    return {"type": "prelu", "weight": f"{target}.weight"}


@stored_reader(F.prelu, signature=_signature("input", "weight"))
def _prelu_function(kwargs: Mapping[str, Any], stored: StoredTensors) -> dict[str, Any]:
    """``F.prelu`` on a stored slope (torch.export records nn.PReLU so)."""
    return {"type": "prelu", "weight": stored.key(kwargs["weight"], "weight")}


@call_handler(torch.abs)
@method_handler("abs")
def _abs_call(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    """|x| is a LeakyReLU of slope −1 (as the ONNX route reads Abs): positively homogeneous, piecewise linear."""
    if len(node.args) != 1 or node.kwargs:
        raise Unsupported("only |x| of one tensor is supported")
    return [{"type": "leaky_relu", "negative_slope": -1.0, "inputs": [node.args[0]]}]


# Dropout modules are read as the module runs for inference, in eval mode.
@module_attributes_handler(nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d)
def _identity(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "identity"}


@function_kwargs_handler(F.dropout)
def _dropout(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if kwargs.get("training", True):
        raise Unsupported("training=True applies dropout at inference too")
    return {"type": "identity"}


# -- pooling -------------------------------------------------------------------------------


def _kernel_and_stride(args: Mapping[str, Any]) -> dict[str, Any]:
    # A missing stride is None for modules and [] for normalised avg_pool kwargs: the kernel size.
    return {
        "kernel": args["kernel_size"],
        "stride": args.get("stride") or args["kernel_size"],
        "padding": args.get("padding", 0),
    }


@module_attributes_handler(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
@function_kwargs_handler(F.max_pool1d, F.max_pool2d, F.max_pool3d)
def _max_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    if args.get("return_indices"):
        raise Unsupported("return_indices=True is not supported")
    return {
        "type": "maxpool",
        **_kernel_and_stride(args),
        "dilation": args.get("dilation", 1),
        "ceil_mode": bool(args.get("ceil_mode", False)),
    }


@module_attributes_handler(nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
@function_kwargs_handler(F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)
def _avg_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    if args.get("divisor_override") is not None:
        raise Unsupported("divisor_override is not supported")
    return {
        "type": "avgpool",
        **_kernel_and_stride(args),
        "ceil_mode": bool(args.get("ceil_mode", False)),
        "count_include_pad": bool(args.get("count_include_pad", True)),
    }


@module_attributes_handler(nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
@function_kwargs_handler(F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
def _adaptive_avg_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    size = args["output_size"]
    if size is None or (isinstance(size, (list, tuple)) and None in size):
        raise Unsupported("an output_size that keeps an input size (None) is not a fixed output size")
    return {"type": "adaptive_avgpool", "output_size": size}


@call_handler(torch.mean)
@method_handler("mean")
def _mean(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    """``x.mean([2, 3])`` / ``torch.mean(x, (2, 3), keepdim=...)`` over every spatial axis: global average pooling."""
    args, kwargs = node.args, node.kwargs
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    rank = _rank(x, values)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if set(kwargs) - {"dim", "keepdim"} or rank < 3 or sorted(d % rank for d in dims) != list(range(2, rank)):
        raise Unsupported(f"only a mean over every spatial axis is supported (dims {dims} of a rank-{rank} input)")
    pool = {"type": "adaptive_avgpool", "output_size": [1] * (rank - 2), "inputs": [x]}
    return [pool] if keepdim else [pool, {"type": "flatten"}]


# -- padding, resizing, reshaping ------------------------------------------------------------


_PAD_MODULES = {
    **{
        cls: ("constant", rank)
        for rank, cls in (
            (1, nn.ConstantPad1d),
            (2, nn.ConstantPad2d),
            (3, nn.ConstantPad3d),
            (1, nn.ZeroPad1d),
            (2, nn.ZeroPad2d),
            (3, nn.ZeroPad3d),
        )
    },
    **{
        cls: ("reflect", rank)
        for rank, cls in ((1, nn.ReflectionPad1d), (2, nn.ReflectionPad2d), (3, nn.ReflectionPad3d))
    },
    **{
        cls: ("replicate", rank)
        for rank, cls in ((1, nn.ReplicationPad1d), (2, nn.ReplicationPad2d), (3, nn.ReplicationPad3d))
    },
    **{cls: ("circular", rank) for rank, cls in ((1, nn.CircularPad1d), (2, nn.CircularPad2d), (3, nn.CircularPad3d))},
}


@module_handler(*_PAD_MODULES)
def _pad_module(module: nn.Module, target: str) -> dict[str, Any]:
    mode, rank = _PAD_MODULES[type(module)]
    return _pad({"pad": module.padding, "mode": mode, "value": getattr(module, "value", 0)}, rank + 2)


@function_handler(F.pad)
def _pad_function(
    kwargs: Mapping[str, Any], node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]
) -> dict[str, Any]:
    return {**_pad(kwargs, _rank(kwargs["input"], values)), "inputs": [kwargs["input"]]}


def _pad(args: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """F.pad's ``(last_begin, last_end, previous_begin, ...)`` as per-axis begin and end (a
    negative width crops, as in timm's NASNet ``nn.ZeroPad2d((-1, 1, -1, 1))``)."""
    mode, value = args.get("mode", "constant"), args.get("value") or 0
    if mode not in ("constant", *COPYING_PAD_MODES):
        raise Unsupported(f"mode={mode!r} is not supported (constant, {', '.join(COPYING_PAD_MODES)})")
    if mode == "constant" and value not in (0, -math.inf):
        raise Unsupported(
            f"padding with the constant {value!r} is not positively homogeneous (a padded neuron keeps "
            "its value whatever its channel's scale); only 0, and -inf before max pooling, are"
        )
    if mode == "constant":
        mode = "-inf" if value == -math.inf else "zeros"
    pad = list(args["pad"])
    spatial = rank - 2
    if len(pad) % 2 or len(pad) > 2 * spatial or any(not isinstance(v, int) for v in pad):
        raise Unsupported(f"only integer padding or cropping of the spatial axes is supported (pad={tuple(pad)})")
    pairs = [(0, 0)] * (spatial - len(pad) // 2) + [(pad[i], pad[i + 1]) for i in range(len(pad) - 2, -1, -2)]
    return {"type": "pad", "begin": [b for b, _ in pairs], "end": [e for _, e in pairs], "mode": mode}


_RESIZE_MODES = {"nearest": "nearest", "linear": "linear", "bilinear": "linear", "trilinear": "linear"}


@module_attributes_handler(nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)
def _upsample(args: Mapping[str, Any], input_size: Sequence[int] | None = None) -> dict[str, Any]:
    """nn.Upsample (attributes) and F.interpolate (kwargs): nearest or (bi/tri)linear, and
    nearest-exact where it copies what nearest does. ``input_size`` is the input's spatial size
    where known (F.interpolate's traced run)."""
    mode = args.get("mode", "nearest")
    if mode == "nearest-exact":
        mode = _nearest_exact_as_nearest(args, input_size)
    if mode not in _RESIZE_MODES:
        raise Unsupported(
            f"mode={mode!r} is not supported (nearest, linear, bilinear, trilinear): bicubic weights are negative "
            "and torch and ONNX runtimes disagree at the borders, area is adaptive average pooling"
        )
    if args.get("antialias"):
        raise Unsupported("antialias=True is not supported")
    if args.get("recompute_scale_factor"):
        raise Unsupported("recompute_scale_factor=True is not supported; pass the output size instead")
    size, scale_factor = args.get("size"), args.get("scale_factor")
    if (size is None) == (scale_factor is None):
        raise Unsupported("exactly one of size and scale_factor must be given")
    layer: dict[str, Any] = {
        "type": "upsample",
        "mode": _RESIZE_MODES[mode],
        "align_corners": bool(args.get("align_corners") or False),
    }
    if size is not None:
        layer["size"] = list(size) if isinstance(size, (list, tuple)) else size
    else:
        layer["scale_factor"] = list(scale_factor) if isinstance(scale_factor, (list, tuple)) else scale_factor
    return layer


def _nearest_exact_as_nearest(args: Mapping[str, Any], input_size: Sequence[int] | None) -> str:
    """'nearest', for a nearest-exact resize that copies the same pixels; refused otherwise.

    Output pixel i of an axis with scale s (input over output size, or 1/scale_factor) copies
    input pixel floor(i·s) in nearest mode and floor((i + ½)·s) in nearest-exact; they agree on
    every i exactly when 1/s is an integer: an integer upscaling factor on every axis.
    """
    size, scale_factor = args.get("size"), args.get("scale_factor")
    if scale_factor is not None and not args.get("recompute_scale_factor"):
        factors = scale_factor if isinstance(scale_factor, (list, tuple)) else [scale_factor]
        whole = all(float(factor).is_integer() and factor >= 1 for factor in factors)
    elif size is not None and input_size is not None:
        sizes = size if isinstance(size, (list, tuple)) else [size] * len(input_size)
        whole = all(out % given == 0 for out, given in zip(sizes, input_size))
    else:
        whole = False
    if not whole:
        shown_size = f"scale_factor={scale_factor!r}" if scale_factor is not None else f"size={size!r}"
        known = f" of an input of spatial size {tuple(input_size)}" if input_size is not None else ""
        raise Unsupported(
            f"mode='nearest-exact' with {shown_size}{known} is not supported: it copies the input pixel under each "
            "output pixel's centre, which pathcond's nearest resize (the pixel under its corner, torch's 'nearest', "
            "ONNX's asymmetric floor) matches only for an integer upscaling factor on every axis"
            + ("" if known else " (give scale_factor, or call F.interpolate, whose input size pathcond sees)")
        )
    return "nearest"


@function_handler(F.interpolate, F.upsample)
def _interpolate_function(
    kwargs: Mapping[str, Any], node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]
) -> dict[str, Any]:
    """F.interpolate; a size computed from other tensors' shapes (``size=skip.shape[2:]``) is
    the one the traced run produced, a constant for the input shape the graph is built for."""
    output, x = values.get(node), values.get(kwargs["input"])
    size = kwargs.get("size")
    sizes = size if isinstance(size, (list, tuple)) else [size]
    if size is not None and not all(isinstance(v, int) for v in sizes) and isinstance(output, torch.Tensor):
        kwargs = {**kwargs, "size": list(output.shape[2:])}
    input_size = tuple(x.shape[2:]) if isinstance(x, torch.Tensor) else None
    return {**_upsample(kwargs, input_size), "inputs": [kwargs["input"]]}


@module_attributes_handler(nn.Flatten)
def _flatten(args: Mapping[str, Any]) -> dict[str, Any]:
    start_dim, end_dim = args.get("start_dim", 0), args.get("end_dim", -1)
    if start_dim != 1 or end_dim != -1:
        raise Unsupported(
            f"only flattening from dim 1 to the end is supported (got start_dim={start_dim}, end_dim={end_dim})"
        )
    return {"type": "flatten"}


@module_handler(nn.ChannelShuffle)
def _channel_shuffle_module(module: nn.ChannelShuffle, target: str) -> dict[str, Any]:
    return {"type": "channel_shuffle", "groups": module.groups}


@call_handler(torch.cat)
def _cat(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    """``torch.cat(tensors, dim)`` from the raw arguments: fx's normaliser cannot match
    torch.cat's overloads (``dim`` as an int or a name) on every torch version."""
    args, kwargs = node.args, node.kwargs
    if len(args) > 2 or set(kwargs) - {"tensors", "dim"} or (args and "tensors" in kwargs):
        raise Unsupported("only torch.cat(tensors, dim) is supported")
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim != 1:
        raise Unsupported(f"only concatenation along dim 1 (channels) is supported (got dim={dim})")
    if not isinstance(tensors, (list, tuple)):
        raise Unsupported("its tensors must be a list or tuple of tensors")
    return [{"type": "concat", "inputs": list(tensors)}]


# -- arithmetic ------------------------------------------------------------------------------


@call_handler(operator.add, operator.iadd, torch.add)
@method_handler("add", "add_")
def _add_call(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    shift = _per_channel_pair(node, values)
    if shift is None:
        return [_add(node.args, node.kwargs)]
    product, shift_key = shift
    scaled = _per_channel_pair(product, values) if _is_product(product) and len(product.users) == 1 else None
    if scaled is None:
        return [{"type": "channel_bias", "bias": shift_key, "inputs": [product]}]
    x, scale_key = scaled
    return [{"type": "channel_affine", "weight": scale_key, "bias": shift_key, "inputs": [x]}]


def _add(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if len(args) != 2 or kwargs.get("alpha", 1) != 1 or set(kwargs) - {"alpha"}:
        raise Unsupported("only a plain sum of two tensors is supported")
    numbers = [arg for arg in args if not isinstance(arg, torch.fx.Node)]
    tensors = [arg for arg in args if isinstance(arg, torch.fx.Node)]
    if numbers == [0] and tensors:
        return {"type": "identity", "inputs": tensors}  # MobileOne's ``out += identity`` with identity = 0
    if numbers:
        raise Unsupported(
            f"adding the number {numbers[0]!r} is not supported: a constant that is no stored tensor "
            "cannot rescale with its channel (not positively homogeneous); a stored tensor holding "
            "one value per channel can (register it as a parameter or buffer)"
        )
    return {"type": "add", "inputs": list(args)}


@call_handler(operator.sub, operator.isub, torch.sub, operator.neg, torch.neg)
@method_handler("sub", "sub_", "neg")
def _sub_call(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    """``a - b``, ``torch.sub(a, b)``, ``a.sub(b)`` of two activations: a difference node;
    ``-x``, ``torch.neg(x)``, ``x.neg()``: a fixed edge of −1, the scale node of factor −1."""
    args, kwargs = node.args, node.kwargs
    if node.target in (operator.neg, torch.neg, "neg"):
        return [{"type": "scale", "factor": -1.0, "inputs": list(args)}]
    if len(args) != 2 or kwargs.get("alpha", 1) != 1 or set(kwargs) - {"alpha"}:
        raise Unsupported("only a plain difference of two tensors is supported")
    numbers = [arg for arg in args if not isinstance(arg, torch.fx.Node)]
    if numbers:
        raise Unsupported(
            f"subtracting the number {numbers[0]!r} or from it is not supported: a constant that is no "
            "stored tensor cannot rescale with its channel (not positively homogeneous)"
        )
    return [{"type": "sub", "inputs": list(args)}]


@call_handler(operator.mul, operator.imul, torch.mul, operator.truediv, operator.itruediv, torch.div)
@method_handler("mul", "mul_", "div", "div_")
def _scale_call(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> list[dict[str, Any]]:
    scaled = _per_channel_pair(node, values) if _is_product(node) else None
    if scaled is None:
        return [_scale(node.target, node.args, node.kwargs)]
    (user,) = node.users if len(node.users) == 1 else (None,)
    if user is not None and _is_sum(user) and _per_channel_pair(user, values) is not None:
        return []  # the scale of ``x * scale + shift``: translated with the shift
    x, scale_key = scaled
    return [{"type": "channel_affine", "weight": scale_key, "bias": None, "inputs": [x]}]


def _scale(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``x * c``, ``c * x``, ``x / c``: a fixed edge of weight c (1/c)."""
    if len(args) != 2 or kwargs:
        raise Unsupported("only a product or quotient of a tensor and a number is supported")
    tensors = [a for a in args if isinstance(a, torch.fx.Node)]
    numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(tensors) == 2:
        raise NotHomogeneous()
    if len(tensors) != 1 or len(numbers) != 1:
        raise Unsupported("only a product or quotient of a tensor and a number is supported")
    divides = getattr(target, "__name__", target) in ("truediv", "div", "div_", "itruediv")
    if divides and args[0] is not tensors[0]:
        raise Unsupported("dividing a number by a tensor is not homogeneous")
    factor = float(numbers[0])
    if divides:
        if factor == 0:
            raise Unsupported("division by zero")
        factor = 1.0 / factor
    return {"type": "scale", "factor": factor, "inputs": tensors}


def _is_product(node: torch.fx.Node) -> bool:
    return node.target in (operator.mul, operator.imul, torch.mul, "mul", "mul_")


def _is_sum(node: torch.fx.Node) -> bool:
    return node.target in (operator.add, operator.iadd, torch.add, "add", "add_")


def _per_channel_pair(node: torch.fx.Node, values: Mapping[torch.fx.Node, Any]) -> tuple[Any, str] | None:
    """``(x, key)`` when ``node`` combines activation ``x`` with a stored tensor (a get_attr:
    its state_dict key) that holds one value per channel of ``x``; None when it reads no stored
    tensor. A stored tensor of another shape is refused."""
    if len(node.args) != 2 or node.kwargs:
        return None
    stored = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    if len(stored) != 1:
        return None
    (x,) = [a for a in node.args if a is not stored[0]]
    tensor, activation = values.get(stored[0]), values.get(x) if isinstance(x, torch.fx.Node) else None
    if not isinstance(tensor, torch.Tensor) or not isinstance(activation, torch.Tensor):
        raise Unsupported(f"the stored tensor '{stored[0].target}' cannot be matched to its activation's channels")
    aligned = (1,) * (activation.dim() - tensor.dim()) + tuple(tensor.shape)
    if (
        tensor.dim() > activation.dim()
        or activation.shape[1] == 1
        or aligned[1] != activation.shape[1]
        or any(size != 1 for axis, size in enumerate(aligned) if axis != 1)
    ):
        raise Unsupported(
            f"the stored tensor '{stored[0].target}' of shape {tuple(tensor.shape)} does not hold one "
            f"value per channel of an activation of shape {tuple(activation.shape)}"
        )
    return x, stored[0].target
