"""Import a ``torch.nn.Module`` as a ReLU DAG by symbolic tracing (torch.fx).

The traced graph is translated into an architecture spec (see :mod:`.spec`) and built with
:func:`graph_from_spec`, so a module and a spec file go through the same validation and give
the same nodes. Parameter keys are the module's ``state_dict`` keys. Every node that cannot
be translated is collected, so one error lists the whole graph's unsupported operations.
"""

from __future__ import annotations

import importlib
import operator
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from ..errors import InputError, UnsupportedModelError
from ..graph import Graph
from .spec import graph_from_spec

SUPPORTED_SUMMARY = (
    "pathcond supports Linear, Conv1d/2d, BatchNorm1d/2d, ReLU, LeakyReLU, Identity, Dropout, "
    "max/avg/adaptive-avg pooling, flatten, residual add and torch.cat(dim=1)"
)


class _Unsupported(Exception):
    """Why one fx node cannot be part of a ReLU DAG."""


def graph_from_module(
    module: nn.Module, input_shape: Sequence[int], *, source: str
) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The module's ReLU DAG for batch-free ``input_shape`` and its ``state_dict`` tensors.

    The module is traced in eval mode (its mode is restored afterwards), since pathcond
    rescales the inference function. The returned tensors share memory with the module.
    """
    traced = _trace(module, source)
    spec, problems = _spec_from_trace(traced)
    if problems:
        raise UnsupportedModelError(
            f"{source}: the network is not a supported ReLU DAG ({SUPPORTED_SUMMARY}):", problems
        )
    graph = graph_from_spec(spec, source=source, input_shape=tuple(input_shape))
    return graph, {key: tensor.detach() for key, tensor in module.state_dict().items()}


def load_factory(spec: str) -> nn.Module:
    """Call ``module.path:callable`` (``callable`` may be dotted) and return the nn.Module it builds.

    The current directory is put on ``sys.path`` so that a local ``mynet.py`` is found as
    ``mynet:build``.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise InputError(f"architecture factory '{spec}': expected the form module.path:callable, e.g. mynet:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # importing runs arbitrary user code, which may raise anything
        raise InputError(
            f"architecture factory '{spec}': cannot import module '{module_name}' "
            f"({type(exc).__name__}: {exc}); it is looked up on sys.path and in the current directory"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InputError(f"architecture factory '{spec}': module '{module_name}' has no attribute '{attribute}'")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"architecture factory '{spec}': '{attribute}' is not callable")
    try:
        built = target()
    except Exception as exc:  # the factory is user code
        raise InputError(f"architecture factory '{spec}': calling {attribute}() failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(built, nn.Module):
        raise InputError(
            f"architecture factory '{spec}': {attribute}() returned {type(built).__name__}, not a torch.nn.Module"
        )
    return built


def _trace(module: nn.Module, source: str) -> torch.fx.GraphModule:
    was_training = module.training
    module.eval()  # training-only branches and dropout flags are resolved for inference
    try:
        return torch.fx.symbolic_trace(module)
    except Exception as exc:  # fx reports untraceable code with many exception types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(
            f"{source}: torch.fx cannot trace the module ({type(exc).__name__}: {reason}); pathcond needs a "
            "forward without data-dependent control flow"
        ) from None
    finally:
        module.train(was_training)


def _spec_from_trace(traced: torch.fx.GraphModule) -> tuple[dict[str, Any], list[str]]:
    """The architecture spec of a traced module, and every reason it is not a ReLU DAG."""
    modules = dict(traced.named_modules())
    names = _layer_names(traced.graph)
    problems = _reused_modules(traced.graph, modules)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        problems.append(f"the module's forward takes {len(placeholders)} inputs; pathcond supports exactly one")
    layers: list[dict[str, Any]] = []
    outputs: list[str] = []
    for node in traced.graph.nodes:
        if node.op == "output":
            outputs, output_problems = _outputs(node, names)
            problems += output_problems
            continue
        if _is_shape_query(node):
            continue  # batch-size plumbing for view/reshape, checked where it is consumed
        try:
            layer = _translate(node, modules, traced)
            inputs = [names[_tensor(arg)] for arg in layer.pop("inputs")]
        except _Unsupported as exc:
            problems.append(f"fx node '{node.name}' ({_describe(node, modules)}): {exc}")
            continue
        layers.append({"name": names[node], **({"inputs": inputs} if inputs else {}), **layer})
    return {"layers": layers, "outputs": outputs}, problems


def _layer_names(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """Layer name of every fx node: the module path on a module's first call, else the fx name.

    fx names are unique, and a module path is only taken while it is still free, so the
    names never clash.
    """
    names: dict[torch.fx.Node, str] = {}
    taken: set[str] = set()
    for node in graph.nodes:
        preferred = node.target if node.op == "call_module" else node.name
        names[node] = preferred if preferred not in taken else node.name
        taken.add(names[node])
    return names


def _reused_modules(graph: torch.fx.Graph, modules: Mapping[str, nn.Module]) -> list[str]:
    calls: dict[str, list[str]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_module" and modules[node.target].state_dict():
            calls[node.target].append(node.name)
    return [
        f"module '{target}' ({type(modules[target]).__name__}) is applied {len(nodes)} times "
        f"(fx nodes {', '.join(nodes)}): a layer whose parameters are used twice is not a ReLU DAG "
        "pathcond can rescale"
        for target, nodes in calls.items()
        if len(nodes) > 1
    ]


def _outputs(node: torch.fx.Node, names: Mapping[torch.fx.Node, str]) -> tuple[list[str], list[str]]:
    result = node.args[0]
    values = list(result.values()) if isinstance(result, dict) else result
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    outputs: list[str] = []
    problems: list[str] = []
    for value in values:
        try:
            outputs.append(names[_tensor(value)])
        except _Unsupported as exc:
            problems.append(f"the module's output: {exc}")
    return outputs, problems


def _tensor(arg: Any) -> torch.fx.Node:
    """``arg`` as a tensor-valued fx node; constants and shape values are not layer inputs."""
    if not isinstance(arg, torch.fx.Node) or _is_shape_query(arg):
        raise _Unsupported(f"{arg!r} is not a tensor computed from the network's input")
    return arg


def _translate(node: torch.fx.Node, modules: Mapping[str, nn.Module], root: nn.Module) -> dict[str, Any]:
    """The spec layer (without its name; ``inputs`` as fx nodes) for one fx node."""
    if node.op == "placeholder":
        return {"type": "input", "inputs": []}
    if node.op == "call_module":
        module = modules[node.target]
        translate_module = _MODULES.get(type(module))
        if translate_module is None:
            raise _Unsupported("not supported")
        if len(node.args) != 1 or node.kwargs:
            raise _Unsupported("called with more than one argument")
        return {**translate_module(module, node.target), "inputs": [node.args[0]]}
    if node.op == "call_function":
        if node.target in _ADDITIONS:
            return _add(node.args, node.kwargs)
        translate_function = _FUNCTIONS.get(node.target)
        if translate_function is None:
            raise _Unsupported("not supported")
        normalized = node.normalized_arguments(root, normalize_to_only_use_kwargs=True)
        if normalized is None:
            raise _Unsupported("its arguments cannot be matched to the function's signature")
        return translate_function(normalized.kwargs)
    if node.op == "call_method":
        translate_method = _METHODS.get(node.target)
        if translate_method is None:
            raise _Unsupported("not supported")
        return translate_method(node.args, node.kwargs)
    raise _Unsupported("a parameter or constant used outside its module is not supported")


def _describe(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"module '{node.target}', {type(modules[node.target]).__name__}"
    if node.op == "call_function":
        return f"function {_qualified_name(node.target)}"
    if node.op == "call_method":
        return f"method Tensor.{node.target}"
    return f"{node.op} '{node.target}'"


_PUBLIC_MODULE_NAMES = {"torch._C._nn": "torch.nn.functional", "_operator": "operator"}


def _qualified_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__name__", repr(function))
    module = _PUBLIC_MODULE_NAMES.get(module, module)
    return f"{module}.{name}" if module else name


# -- modules -------------------------------------------------------------------------------


def _bias_key(module: nn.Module, target: str) -> str | None:
    return f"{target}.bias" if module.bias is not None else None


def _linear(module: nn.Linear, target: str) -> dict[str, Any]:
    return {"type": "linear", "weight": f"{target}.weight", "bias": _bias_key(module, target)}


def _conv(module: nn.Conv1d | nn.Conv2d, target: str) -> dict[str, Any]:
    if module.padding_mode != "zeros":
        raise _Unsupported(f"padding_mode='{module.padding_mode}' is not supported (only zero padding)")
    return {
        "type": "conv", "weight": f"{target}.weight", "bias": _bias_key(module, target),
        "stride": module.stride, "padding": _conv_padding(module), "dilation": module.dilation,
        "groups": module.groups,
    }


def _conv_padding(module: nn.Conv1d | nn.Conv2d) -> int | tuple[int, ...]:
    if module.padding == "valid":
        return 0
    if module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        if any(total % 2 for total in totals):
            raise _Unsupported("padding='same' with an even receptive field pads asymmetrically")
        return tuple(total // 2 for total in totals)
    return module.padding


def _batchnorm(module: nn.BatchNorm1d | nn.BatchNorm2d, target: str) -> dict[str, Any]:
    if not module.affine:
        raise _Unsupported("affine=False (no weight and bias to rescale) is not supported")
    if module.running_mean is None:
        raise _Unsupported("track_running_stats=False normalises with batch statistics even in eval mode")
    layer = {
        "type": "batchnorm", "weight": f"{target}.weight", "bias": f"{target}.bias",
        "running_mean": f"{target}.running_mean", "running_var": f"{target}.running_var", "eps": module.eps,
    }
    # momentum=None (cumulative average) only affects training; the spec default stands in.
    if module.momentum is not None:
        layer["momentum"] = module.momentum
    return layer


def _by_attributes(translate: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[[nn.Module, str], dict[str, Any]]:
    """A module translator from a functional one: torch names module attributes like the kwargs."""
    return lambda module, target: translate(vars(module))


def _fixed(layer_type: str) -> Callable[..., dict[str, Any]]:
    return lambda *_: {"type": layer_type}


# -- hyper-parameters shared by modules (attributes) and functions (normalised kwargs) -------


def _leaky_relu(args: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "leaky_relu", "negative_slope": args.get("negative_slope", 0.01)}


def _kernel_and_stride(args: Mapping[str, Any]) -> dict[str, Any]:
    # A missing stride is None for modules and [] for normalised avg_pool kwargs: the kernel size.
    return {"kernel": args["kernel_size"], "stride": args.get("stride") or args["kernel_size"],
            "padding": args.get("padding", 0)}


def _max_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    if args.get("return_indices"):
        raise _Unsupported("return_indices=True is not supported")
    return {"type": "maxpool", **_kernel_and_stride(args), "dilation": args.get("dilation", 1),
            "ceil_mode": bool(args.get("ceil_mode", False))}


def _avg_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    if args.get("divisor_override") is not None:
        raise _Unsupported("divisor_override is not supported")
    return {"type": "avgpool", **_kernel_and_stride(args), "ceil_mode": bool(args.get("ceil_mode", False)),
            "count_include_pad": bool(args.get("count_include_pad", True))}


def _adaptive_avg_pool(args: Mapping[str, Any]) -> dict[str, Any]:
    size = args["output_size"]
    if size is None or (isinstance(size, (list, tuple)) and None in size):
        raise _Unsupported("an output_size that keeps an input size (None) is not a fixed output size")
    return {"type": "adaptive_avgpool", "output_size": size}


def _flatten_args(args: Mapping[str, Any]) -> dict[str, Any]:
    return _flatten(args.get("start_dim", 0), args.get("end_dim", -1))


def _flatten(start_dim: Any, end_dim: Any) -> dict[str, Any]:
    if start_dim != 1 or end_dim != -1:
        raise _Unsupported(f"only flattening from dim 1 to the end is supported (got start_dim={start_dim}, end_dim={end_dim})")
    return {"type": "flatten"}


def _with_input(translate: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """A function translator: the layer from the kwargs, reading the ``input`` kwarg."""
    return lambda kwargs: {**translate(kwargs), "inputs": [kwargs["input"]]}


# -- functions and methods -------------------------------------------------------------------


def _dropout(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if kwargs.get("training", True):
        raise _Unsupported("training=True applies dropout at inference too")
    return {"type": "identity"}


def _cat(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if kwargs.get("dim", 0) != 1:
        raise _Unsupported(f"only concatenation along dim 1 (channels) is supported (got dim={kwargs.get('dim', 0)})")
    return {"type": "concat", "inputs": list(kwargs["tensors"])}


def _add(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if len(args) != 2 or kwargs.get("alpha", 1) != 1 or set(kwargs) - {"alpha"}:
        raise _Unsupported("only a plain sum of two tensors is supported")
    if not all(isinstance(arg, torch.fx.Node) for arg in args):
        raise _Unsupported("adding a constant is not supported (only tensor + tensor)")
    return {"type": "add", "inputs": list(args)}


def _flatten_method(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    start_dim = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    end_dim = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
    return {**_flatten(start_dim, end_dim), "inputs": [args[0]]}


def _view_as_flatten(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    shape = args[1:]
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = tuple(shape[0])
    if kwargs or len(shape) != 2 or not _is_batch_size(shape[0]) or shape[1] != -1:
        raise _Unsupported("only x.view(x.size(0), -1) / x.reshape(x.size(0), -1) flattening is supported")
    return {"type": "flatten", "inputs": [args[0]]}


def _relu_method(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "relu", "inputs": [args[0]]}


def _is_whole_shape(node: Any) -> bool:
    """``x.shape`` or ``x.size()``."""
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",))
        or (node.op == "call_method" and node.target == "size" and len(node.args) == 1 and not node.kwargs)
    )


def _is_shape_query(node: torch.fx.Node) -> bool:
    """``x.shape``, ``x.size(...)`` or an element of either: values, not tensors of the network."""
    if node.op == "call_method" and node.target == "size":
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        return _is_whole_shape(node.args[0])
    return _is_whole_shape(node)


def _is_batch_size(value: Any) -> bool:
    """``x.size(0)``, ``x.shape[0]`` or ``x.size()[0]``."""
    if not isinstance(value, torch.fx.Node):
        return False
    if value.op == "call_method" and value.target == "size":
        return value.args[1:] == (0,) or (len(value.args) == 1 and value.kwargs == {"dim": 0})
    return value.op == "call_function" and value.target is operator.getitem and value.args[1] == 0 \
        and _is_whole_shape(value.args[0])


_MODULES: dict[type[nn.Module], Callable[[Any, str], dict[str, Any]]] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.BatchNorm1d: _batchnorm,
    nn.BatchNorm2d: _batchnorm,
    nn.ReLU: _fixed("relu"),
    nn.LeakyReLU: _by_attributes(_leaky_relu),
    nn.Identity: _fixed("identity"),
    nn.Dropout: _fixed("identity"),
    nn.Dropout1d: _fixed("identity"),
    nn.Dropout2d: _fixed("identity"),
    nn.MaxPool1d: _by_attributes(_max_pool),
    nn.MaxPool2d: _by_attributes(_max_pool),
    nn.AvgPool1d: _by_attributes(_avg_pool),
    nn.AvgPool2d: _by_attributes(_avg_pool),
    nn.AdaptiveAvgPool1d: _by_attributes(_adaptive_avg_pool),
    nn.AdaptiveAvgPool2d: _by_attributes(_adaptive_avg_pool),
    nn.Flatten: _by_attributes(_flatten_args),
}

_FUNCTIONS: dict[Callable[..., Any], Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    F.relu: _with_input(_fixed("relu")),
    torch.relu: _with_input(_fixed("relu")),
    torch.relu_: _with_input(_fixed("relu")),
    F.leaky_relu: _with_input(_leaky_relu),
    F.dropout: _with_input(_dropout),
    F.max_pool1d: _with_input(_max_pool),
    F.max_pool2d: _with_input(_max_pool),
    F.avg_pool1d: _with_input(_avg_pool),
    F.avg_pool2d: _with_input(_avg_pool),
    F.adaptive_avg_pool1d: _with_input(_adaptive_avg_pool),
    F.adaptive_avg_pool2d: _with_input(_adaptive_avg_pool),
    torch.flatten: _with_input(_flatten_args),
    torch.cat: _cat,
}

# torch.add's schema is ambiguous to fx's normaliser, so additions read the raw arguments.
_ADDITIONS = (operator.add, operator.iadd, torch.add)

_METHODS: dict[str, Callable[[Sequence[Any], Mapping[str, Any]], dict[str, Any]]] = {
    "relu": _relu_method,
    "relu_": _relu_method,
    "add": _add,
    "add_": _add,
    "flatten": _flatten_method,
    "view": _view_as_flatten,
    "reshape": _view_as_flatten,
}
