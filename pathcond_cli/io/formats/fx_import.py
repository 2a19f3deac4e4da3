"""Import a ``torch.nn.Module`` as a ReLU DAG by symbolic tracing (torch.fx).

The traced graph is translated into an architecture spec (see :mod:`.spec`) and built with
:func:`graph_from_spec`, so a module and a spec file go through the same validation and give
the same nodes. Parameter keys are the module's ``state_dict`` keys. Every node that cannot
be translated is collected, so one error lists the whole graph's unsupported operations.

This module traces the module (torch.fx, else torch.export), checks the graph against it and
walks it; the handler of each operation, and the registries it is looked up in, are in
:mod:`.fx_ops`.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from ...engine.graph import Graph
from ...errors import UnsupportedModelError, UsageError
from .common import shown
from .export_graph import exported_graph
from .fx_ops import (
    BUILTIN_SIGNATURES,
    CALLS,
    FILTER_BUFFER,
    FUNCTIONS,
    METHODS,
    MODULES,
    MOVEMENT_FUNCTIONS,
    MOVEMENT_METHODS,
    STORED_READERS,
    SUPPORTED_SUMMARY,
    StoredTensors,
)
from .movement import UnsupportedMovement, movement_layer
from .offenders import NOT_HOMOGENEOUS_TYPES, NotHomogeneous, Unsupported, grouped, offender_note
from .spec import graph_from_spec


def graph_from_module(
    module: nn.Module, input_shape: Sequence[int], *, source: str
) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The module's ReLU DAG for batch-free ``input_shape`` and its ``state_dict`` tensors
    (:func:`module_import` without its notes)."""
    graph, params, _ = module_import(module, input_shape, source=source)
    return graph, params


def module_import(
    module: nn.Module, input_shape: Sequence[int], *, source: str
) -> tuple[Graph, dict[str, torch.Tensor], list[str]]:
    """The module's ReLU DAG for batch-free ``input_shape``, its ``state_dict`` tensors, and
    notes for the user (:func:`read_module` without the filter buffers)."""
    read = read_module(module, input_shape, source=source)
    return read.graph, read.params, read.notes


@dataclass(frozen=True)
class ModuleRead:
    """A module read as a ReLU DAG (see :func:`read_module`)."""

    graph: Graph
    # The module's state_dict tensors, sharing memory with it.
    params: dict[str, torch.Tensor]
    # For the user: operations dropped because their result reaches no output.
    notes: list[str]
    # Fixed-filter layer name -> the state_dict key of the persistent buffer its coefficients were read from.
    filter_buffers: dict[str, str]


def read_module(module: nn.Module, input_shape: Sequence[int], *, source: str) -> ModuleRead:
    """The module's ReLU DAG for batch-free ``input_shape``, with its tensors.

    The module is traced in eval mode (its mode is restored afterwards), since pathcond
    rescales the inference function, and run once on a zero input so that view, reshape,
    transpose, split and slicing chains are resolved on concrete shapes.
    """
    traced, values, from_fx = _traced_and_run(module, tuple(input_shape), source)
    state = module.state_dict()
    parameters = frozenset(name for name, _ in module.named_parameters(remove_duplicate=False))
    spec, problems, follow_on, dropped, note = _spec_from_trace(traced, values, frozenset(state), parameters)
    if (problems or follow_on) and from_fx and _export_may_read(traced, note):
        exported = _exported_read(module, tuple(input_shape), source, frozenset(state), parameters)
        if exported is not None:
            spec, problems, follow_on, dropped, note = exported
    if problems or follow_on:
        raise UnsupportedModelError(
            f"{source}: the network is not a supported ReLU DAG ({SUPPORTED_SUMMARY}):", problems, follow_on, note=note
        )
    buffers = {layer["name"]: layer.pop(FILTER_BUFFER) for layer in spec["layers"] if FILTER_BUFFER in layer}
    graph = graph_from_spec(spec, source=source, input_shape=tuple(input_shape))
    return ModuleRead(
        graph,
        {key: tensor.detach() for key, tensor in state.items()},
        _dropped_note(dropped, source),
        {name: key for name, key in buffers.items() if key in state},
    )


def _export_may_read(traced: torch.fx.GraphModule, note: str | None) -> bool:
    """Whether torch.export's graph may read what fx's refuses: a call form (``convT(x,
    output_size=...)``) is recorded as ATen operations with plain arguments, but an operation
    that is not positively homogeneous (``note``) or a module applied twice stays what it is."""
    return note is None and not _reused_modules(traced.graph, dict(traced.named_modules()))


def _exported_read(
    module: nn.Module,
    input_shape: tuple[int, ...],
    source: str,
    state_keys: frozenset[str],
    parameter_keys: frozenset[str],
) -> tuple[dict[str, Any], list[str], list[str], list[str], None] | None:
    """The spec of torch.export's graph where it reads without a problem (None otherwise, and
    the fx graph's problems stand: they name the module's own calls)."""
    try:
        exported, values = _exported_and_run(
            module, input_shape, source, "torch.fx's graph has operations pathcond cannot read"
        )
    except UnsupportedModelError:
        return None
    spec, problems, follow_on, dropped, note = _spec_from_trace(exported, values, state_keys, parameter_keys)
    return None if problems or follow_on or note is not None else (spec, problems, follow_on, dropped, note)


def _dropped_note(dropped: Sequence[str], source: str) -> list[str]:
    if not dropped:
        return []
    return [
        f"{source}: {len(dropped)} operation(s) whose result reaches no output were dropped, as the ONNX "
        f"exporters drop them: {shown(', '.join(repr(name) for name in dropped), 400)}"
    ]


def _check_one_input(traced: torch.fx.GraphModule, source: str) -> None:
    """Refuse, before the module runs on one zero input (which would fail for want of the
    others and be blamed on the shape), a ``forward`` that takes other than one input."""
    placeholders = [str(n.target) for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        names = ", ".join(f"'{shown(name)}'" for name in placeholders) or "none"
        raise UnsupportedModelError(
            f"{source}: the module's forward takes {len(placeholders)} inputs ({names}); pathcond traces modules "
            "with exactly one. A network with several inputs can be given as its ONNX export (each graph input "
            "is an input of the network) or as a safetensors checkpoint with a spec that has an input layer "
            "for each (docs/spec-format.md)."
        )


def _traced_and_run(
    module: nn.Module, input_shape: tuple[int, ...], source: str
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, Any], bool]:
    """The module's graph, the value of each of its nodes on a zero input of batch 1, and
    whether the graph is torch.fx's (which :func:`read_module` may still replace by torch.export's).

    The graph is torch.fx's; where fx cannot trace the module (a forward that branches on its
    input's shape), or traces a graph that does not compute what the module does (a branch on
    ``isinstance`` or ``is None``, which fx takes as it will on its proxies: the graph raises, or
    runs and skips a layer), torch.export's, which runs the module and records the branches it
    takes. Each graph is checked against the module itself on a random input. Only a module that
    itself raises on the zero input has its input shape blamed (a usage error).
    """
    try:
        traced = _in_eval_mode(module, lambda: torch.fx.symbolic_trace(module))
    except Exception as exc:  # fx reports untraceable code with many exception types
        fx_failure = f"torch.fx cannot trace the module ({_first_line(exc)})"
    else:
        _check_one_input(traced, source)
        values, failure = _run_on_zeros(module, traced, input_shape)
        if failure is None:
            difference = _difference_from_module(module, traced, input_shape, batches=(2, 1))
            if difference is None:
                return traced, values, True
            fx_failure = (
                f"the graph torch.fx traced {difference}: fx took another branch than the module's "
                "forward (a test of isinstance or of None on a traced value)"
            )
        else:
            _check_module_runs(module, input_shape, source)
            fx_failure = (
                f"the graph torch.fx traced raises where the module does not ({_failed_node(traced, values)}: "
                f"{_first_line(failure)}): fx took another branch than the module's forward"
            )
    exported, values = _exported_and_run(module, input_shape, source, fx_failure)
    return exported, values, False


def _exported_and_run(
    module: nn.Module, input_shape: tuple[int, ...], source: str, fx_failure: str
) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, Any]]:
    """torch.export's graph of the module and the value of each of its nodes on a zero input of
    batch 1, checked against the module; ``fx_failure`` says why torch.fx's graph is not used."""
    try:
        exported = exported_graph(
            module, _zero_input(module, input_shape), {*FUNCTIONS, *CALLS, *STORED_READERS, *MOVEMENT_FUNCTIONS}
        )
    except Exception as exc:  # noqa: BLE001 - torch.export runs user code and raises many types
        _check_module_runs(module, input_shape, source)
        raise UnsupportedModelError(
            f"{source}: {fx_failure}, and torch.export, which takes the branches of the input shape "
            f"{input_shape}, cannot export it either ({_first_line(exc)}); pathcond needs a forward without "
            "data-dependent control flow. If torch.onnx.export can export it, pathcond may read the .onnx file"
        ) from None
    _check_one_input(exported, source)
    values, failure = _run_on_zeros(module, exported, input_shape)
    if failure is not None:
        _check_module_runs(module, input_shape, source)
        raise UnsupportedModelError(
            f"{source}: {fx_failure}, and the graph torch.export recorded, as pathcond reads it, raises where the "
            f"module does not ({_failed_node(exported, values)}: {_first_line(failure)}); this operation cannot be "
            "read on the module route. If torch.onnx.export can export the module, pathcond may read the .onnx file"
        )
    # torch.export records the shapes of the batch of 1 it ran (a reshape keeps its sizes).
    difference = _difference_from_module(module, exported, input_shape, batches=(1,))
    if difference is not None:
        raise UnsupportedModelError(
            f"{source}: {fx_failure}, and the graph torch.export recorded {difference}: the module's forward "
            "depends on something neither trace sees (a random draw, a global or attribute it changes while "
            "running, a value read back from a tensor). pathcond reads a forward whose operations depend only "
            "on the input's shape; if torch.onnx.export exports the module faithfully, pathcond may read the "
            ".onnx file"
        )
    return exported, values


def _difference_from_module(
    module: nn.Module, graph_module: torch.fx.GraphModule, input_shape: tuple[int, ...], *, batches: Sequence[int]
) -> str | None:
    """How the graph's outputs differ from the module's own on a random input, in eval mode
    (None when they agree to rounding in the module's dtype): a trace may take another branch
    than the forward and still run. The first batch size in ``batches`` the module runs on is
    used; the module's buffers are restored afterwards, since a forward may write them."""
    buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
    try:
        for batch in batches:
            example = _random_input(module, input_shape, batch)
            try:
                wanted = _in_eval_mode(module, lambda: module(example))
                break
            except Exception as exc:  # noqa: BLE001 - the user's forward, which may raise anything
                if batch == batches[-1]:
                    return (
                        f"cannot be checked: the module raises on a random input of shape "
                        f"{tuple(example.shape)} ({_first_line(exc)})"
                    )
        try:
            got = _in_eval_mode(module, lambda: torch.fx.Interpreter(graph_module).run(example))
        except Exception as exc:  # noqa: BLE001 - user code recorded in the graph
            return (
                f"raises on a random input of shape {tuple(example.shape)} where the module does not "
                f"({_first_line(exc)})"
            )
        return _outputs_difference(wanted, got)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a forward's result (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return [tensor for item in items for tensor in _tensors_in(item)]


def _outputs_difference(wanted: Any, got: Any) -> str | None:
    """How ``got`` (the graph's outputs) differs from ``wanted`` (the module's), or None."""
    wanted_leaves, got_leaves = _tensors_in(wanted), _tensors_in(got)
    if len(wanted_leaves) != len(got_leaves):
        return f"returns {len(got_leaves)} tensor(s) where the module returns {len(wanted_leaves)}"
    for index, (want, have) in enumerate(zip(wanted_leaves, got_leaves)):
        if want.shape != have.shape:
            return f"returns an output {index} of shape {tuple(have.shape)} where the module's is {tuple(want.shape)}"
        if not want.is_floating_point():
            continue
        # The graph runs the module's own kernels: anything beyond rounding is another function.
        # Non-finite outputs (invalid BatchNorm statistics, refused later with their cause) must
        # sit where the module's do; the rest is compared.
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(have)):
            return (
                f"computes another function than the module on a random input (output {index} is not "
                "finite at other positions than the module's)"
            )
        want, have = want[finite].double(), have[finite].double()
        tolerance = torch.finfo(wanted_leaves[index].dtype).eps ** 0.5
        error = (have - want).abs().max().item() if want.numel() else 0.0
        scale = want.abs().max().item() if want.numel() else 0.0
        if not error <= tolerance * max(scale, 1.0):
            return (
                f"computes another function than the module on a random input (output {index} differs by "
                f"{error:.3g}, the module's largest output being {scale:.3g})"
            )
    return None


def _run_on_zeros(
    module: nn.Module, traced: torch.fx.GraphModule, input_shape: tuple[int, ...]
) -> tuple[dict[torch.fx.Node, Any], Exception | None]:
    """The value of every fx node on a zero input of batch 1, in eval mode (as far as it runs),
    and the exception that stopped the run, if one did."""
    values: dict[torch.fx.Node, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            values[node] = super().run_node(node)
            return values[node]

    try:
        _in_eval_mode(module, lambda: Recorder(traced).run(_zero_input(module, input_shape)))
    except Exception as exc:  # noqa: BLE001 - user code, run by the caller's judgement of the failure
        return values, exc
    return values, None


def _check_module_runs(module: nn.Module, input_shape: tuple[int, ...], source: str) -> None:
    """Blame the input shape (a usage error quoting torch's reason) if the module itself raises
    on the zero input its graph ran on."""
    try:
        _in_eval_mode(module, lambda: module(_zero_input(module, input_shape)))
    except Exception as exc:  # noqa: BLE001 - the user's forward, which may raise anything
        _check_batch_free(module, input_shape, source, exc)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(
            f"{source}: the module raises when run on one example of the batch-free input shape "
            f"{input_shape} (a zero input of shape {(1, *input_shape)}): {shown(reason, 300)}. "
            "The input shape is batch-free: 3,32,32 for 32x32 RGB images, not 1,3,32,32."
        ) from None


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _check_batch_free(module: nn.Module, input_shape: tuple[int, ...], source: str, failure: Exception) -> None:
    """Refuse (unsupported, not a usage error) a module that raises on one example but runs on
    two: its inference function mixes the examples of a batch (a BatchNorm without running
    statistics normalises with the batch's), which the input shape cannot mend."""
    try:
        _in_eval_mode(module, lambda: module(_zero_input(module, input_shape, batch=2)))
    except Exception:  # noqa: BLE001 - the user's forward: it raises on any batch, the shape is blamed
        return
    batch_statistics = ", ".join(
        f"'{name}' ({type(layer).__name__})"
        for name, layer in module.named_modules()
        if isinstance(layer, _BATCH_NORMS) and layer.running_mean is None
    )
    culprit, remedy = (
        (
            f"the BatchNorm {batch_statistics} normalises with the batch's statistics in eval mode too "
            "(track_running_stats=False)",
            ". Give it running statistics (track_running_stats=True, then train or load them)",
        )
        if batch_statistics
        else ("its forward computes across the batch", "")
    )
    raise UnsupportedModelError(
        f"{source}: the module raises on a batch of one example of the input shape {input_shape} "
        f"({_first_line(failure)}) but runs on a batch of two: {culprit}, so each example's output depends on "
        f"the others' and it is no function of one input that pathcond can rescale{remedy}"
    )


def _failed_node(graph_module: torch.fx.GraphModule, values: Mapping[torch.fx.Node, Any]) -> str:
    """The first node of a graph run that did not finish (the one that raised), described."""
    node = next((node for node in graph_module.graph.nodes if node not in values), None)
    if node is None:
        return "after its last node"
    return f"fx node '{node.name}' ({_describe(node, dict(graph_module.named_modules()))})"


def _in_eval_mode(module: nn.Module, run: Callable[[], Any]) -> Any:
    """``run()`` with the module in eval mode and without autograd, its mode restored after:
    pathcond reads the inference function, and training-only branches and dropout flags are
    resolved for it."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return run()
    finally:
        module.train(was_training)


def _zero_input(module: nn.Module, input_shape: tuple[int, ...], batch: int = 1) -> torch.Tensor:
    """A zero example of ``batch`` inputs on the module's own device."""
    return torch.zeros((batch, *input_shape), dtype=_input_dtype(module), device=_device(module))


def _random_input(module: nn.Module, input_shape: tuple[int, ...], batch: int) -> torch.Tensor:
    """A standard normal example of ``batch`` inputs on the module's own device, the same on every
    run and device (drawn on the CPU, whose generator every build has)."""
    generator = torch.Generator().manual_seed(0)
    drawn = torch.randn((batch, *input_shape), generator=generator, dtype=_input_dtype(module))
    return drawn.to(_device(module))


def _device(module: nn.Module) -> torch.device:
    """The module's own device: its first parameter's or buffer's (the CPU without either)."""
    held = next(module.parameters(), None)
    held = held if held is not None else next(module.buffers(), None)
    return held.device if held is not None else torch.device("cpu")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {shown(lines[0], 300)}" if lines else type(exc).__name__


def _input_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the zero input a module is run on: its first floating-point parameter's."""
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def _spec_from_trace(
    traced: torch.fx.GraphModule,
    values: Mapping[torch.fx.Node, Any],
    state_keys: frozenset[str],
    parameter_keys: frozenset[str],
) -> tuple[dict[str, Any], list[str], list[str], list[str], str | None]:
    """The architecture spec of a traced module, every reason it is not a ReLU DAG (each
    root cause once per module type), the problems of nodes that read (directly or not) the
    output of a node already refused, the names of the operations dropped because their
    result reaches no output, and why the non-homogeneous operations are refused (None without
    any). ``state_keys`` are the module's ``state_dict`` keys and ``parameter_keys`` its
    parameters' names: a layer reads parameters and buffers through ``get_attr``."""
    modules = dict(traced.named_modules())
    names = _layer_names(traced.graph)
    problems = _reused_modules(traced.graph, modules)
    dead = _reaching_no_output(traced.graph, modules)
    moves = _Movements(values, names, dead)
    offenders: list[tuple[str, str]] = []
    refused: list[tuple[torch.fx.Node, str]] = []
    follow_on: list[str] = []
    after_refusal: set[torch.fx.Node] = set()
    layers: list[dict[str, Any]] = []
    outputs: list[str] = []
    stored = StoredTensors(values, state_keys, parameter_keys)
    dropped: list[str] = []
    for node in traced.graph.nodes:
        follows_refusal = any(arg in after_refusal for arg in node.all_input_nodes)
        if follows_refusal:
            after_refusal.add(node)
        if node.op == "output":
            outputs, output_problems = _outputs(node, names, moves, layers)
            problems += output_problems
            continue
        if _is_shape_check(node) or _is_shape_query(node) or isinstance(values.get(node), _NOT_TENSORS):
            continue  # size arithmetic for view/reshape, asserts on it, dtypes: checked where consumed, or no value
        if node.op == "get_attr":
            continue  # a stored tensor, read by the layer that uses it (refused there if used otherwise)
        if node in dead:
            if not _is_movement(node):  # an unread piece of a split computes nothing: no note
                dropped.append(names[node])
            continue
        try:
            if _is_movement(node):
                moves.record(node)
                continue
            steps = _translate(node, modules, traced, values, stored)
            for index, layer in enumerate(steps):
                name = names[node] if index == len(steps) - 1 else f"{names[node]}/{layer['type']}"
                inputs = (
                    [layers[-1]["name"]]
                    if index
                    else [moves.layer_input(_tensor(arg), layers) for arg in layer.pop("inputs")]
                )
                layer.pop("inputs", None)
                layers.append({"name": name, **({"inputs": inputs} if inputs else {}), **layer})
        except NotHomogeneous:
            offenders.append((_operation(node, modules), node.name))
            moves.offenders.add(node)
            after_refusal.add(node)
        except Unsupported as exc:
            if follows_refusal:
                follow_on.append(f"fx node '{node.name}' ({_describe(node, modules)}): {exc}")
            else:
                refused.append((node, str(exc)))
            after_refusal.add(node)
    problems[:0] = grouped(offenders)
    for node in moves.unresolved():
        try:
            moves.layer_input(node, layers)
        except Unsupported as exc:
            if node in after_refusal:
                follow_on.append(f"fx node '{node.name}' ({_describe(node, modules)}): {exc}")
            else:
                refused.append((node, str(exc)))
    problems += _once_per_module_type(refused, modules)
    return {"layers": layers, "outputs": outputs}, problems, follow_on, dropped, offender_note(offenders)


# Values of fx nodes that are no activations: sizes, numbers, a tensor's dtype or device.
_NOT_TENSORS = (int, float, torch.Size, torch.dtype, torch.device)


def _reaching_no_output(graph: torch.fx.Graph, modules: Mapping[str, nn.Module]) -> set[torch.fx.Node]:
    """The operations whose result reaches no output (DLA's unused ``project`` branches): the
    ONNX exporters drop them, and so does the import. An operation that may write into its
    input (``relu_``, ``inplace=True``, ``+=``) is kept, and refused where the graph is built,
    since what it writes may be read later."""
    live: set[torch.fx.Node] = set()
    stack = [node for node in graph.nodes if node.op == "output"]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return {
        node
        for node in graph.nodes
        if node not in live
        and node.op.startswith("call_")
        and not _is_shape_check(node)
        and not _may_write_its_input(node, modules)
    }


_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem)


def _may_write_its_input(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return bool(getattr(modules[node.target], "inplace", False))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place_name = isinstance(name, str) and name.endswith("_") and not name.endswith("__")
    return in_place_name or node.target in _IN_PLACE_OPERATORS or bool(node.kwargs.get("inplace"))


def _is_shape_check(node: torch.fx.Node) -> bool:
    """``torch._assert(...)`` (timm asserts on shapes): it computes no value, and the module
    ran on the traced input shape without raising."""
    return node.op == "call_function" and node.target in (torch._assert, torch._assert_async)


def _once_per_module_type(refused: Sequence[tuple[torch.fx.Node, str]], modules: Mapping[str, nn.Module]) -> list[str]:
    """One line per root cause: the same operation refused for the same reason inside every
    instance of one module type (each of densenet121's BatchNorms) is listed once, with the
    instances it occurs in."""
    by_cause: dict[tuple[Any, ...], list[tuple[torch.fx.Node, str, str | None]]] = {}
    for node, reason in refused:
        owner = _owner(node)
        if owner is None:
            cause: tuple[Any, ...] = (node,)
        else:
            path, owner_type = owner
            cause = (owner_type, _operation(node, modules), reason.replace(f"'{path}.", "'<module>."))
        by_cause.setdefault(cause, []).append((node, reason, owner[0] if owner else None))
    lines = []
    for cause, occurrences in by_cause.items():
        node, reason, _ = occurrences[0]
        line = f"fx node '{node.name}' ({_describe(node, modules)}): {reason}"
        if len(occurrences) > 1:
            paths = ", ".join(f"'{path}'" for _, _, path in occurrences[1:])
            line += f" (and the same in {len(occurrences) - 1} more {cause[0]} module(s): {shown(paths, 300)})"
        lines.append(line)
    return lines


def _owner(node: torch.fx.Node) -> tuple[str, str] | None:
    """The path and type of the innermost module whose code made ``node`` (fx records the
    module stack while tracing), or None for the top-level forward."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, owner_type = list(stack.values())[-1]
    # fx records the class, torch.export its qualified name.
    return path, owner_type.__name__ if isinstance(owner_type, type) else str(owner_type).rpartition(".")[2]


class _Movements:
    """Views, reshapes, transposes, splits and slices: pure data movement, resolved on concrete shapes.

    Each such fx node gets the flat index, into the batch-free elements of the layer it reads
    from, of each of its elements (the op re-run on an index tensor). Where a layer reads it,
    the index map must be the identity, a flatten, a channel slice or a channel shuffle.
    """

    def __init__(
        self, values: Mapping[torch.fx.Node, Any], names: Mapping[torch.fx.Node, str], dead: set[torch.fx.Node]
    ):
        self.values = values
        self.names = names
        self.dead = dead
        self.origin: dict[torch.fx.Node, torch.fx.Node] = {}
        self.index: dict[torch.fx.Node, Any] = {}
        self.emitted: dict[torch.fx.Node, str] = {}
        self.offenders: set[torch.fx.Node] = set()

    def record(self, node: torch.fx.Node) -> None:
        if node not in self.values:
            raise Unsupported("the module could not be run on a zero input to resolve its shapes")
        sources = [a for a in node.all_input_nodes if a in self.index or isinstance(self.values.get(a), torch.Tensor)]
        if len(sources) != 1:
            raise Unsupported("moves data between several tensors")
        (source,) = sources
        origin = self.origin.get(source, source)
        if source not in self.index and not isinstance(self.values.get(source), torch.Tensor):
            raise Unsupported(f"{source.name} is not a tensor")
        start = self.index.get(source)
        if start is None:
            shape = self.values[source].shape
            start = torch.arange(shape.numel() // shape[0]).reshape(1, *shape[1:])

        def substitute(arg: torch.fx.Node) -> Any:
            return start if arg is source else self.values[arg]

        args = torch.fx.node.map_arg(node.args, substitute)
        kwargs = torch.fx.node.map_arg(node.kwargs, substitute)
        try:
            if node.op == "call_method":
                result = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                result = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, IndexError, ValueError) as exc:
            raise Unsupported(f"cannot be replayed on its input's index map ({exc})") from None
        self.origin[node], self.index[node] = origin, result

    def unresolved(self) -> list[torch.fx.Node]:
        """Movements that a translatable layer reads but none took (its reader failed otherwise).

        Movements feeding only non-homogeneous operations (attention's head reshapes) are not
        reported again: the operation already is. Users whose result reaches no output (the
        pieces of a split that nothing reads) read nothing.
        """
        return [
            node
            for node in self.index
            if node not in self.emitted
            and any(
                user not in self.index and user not in self.offenders and user not in self.dead for user in node.users
            )
        ]

    def layer_input(self, arg: torch.fx.Node, layers: list[dict[str, Any]]) -> str:
        """The spec layer standing for ``arg``: its own, or one made for a data movement."""
        if arg not in self.index:
            return self.names[arg]
        if arg in self.emitted:
            return self.emitted[arg]
        origin, index = self.origin[arg], self.index[arg]
        if not isinstance(index, torch.Tensor):
            raise Unsupported(f"'{arg.name}' is a tuple of tensors, not a tensor")
        try:
            layer = movement_layer(tuple(self.values[origin].shape[1:]), index)
        except UnsupportedMovement as exc:
            raise Unsupported(str(exc)) from None
        if layer is None:
            self.emitted[arg] = self.names[origin]
        else:
            layers.append({"name": self.names[arg], "inputs": [self.names[origin]], **layer})
            self.emitted[arg] = self.names[arg]
        return self.emitted[arg]


def _layer_names(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """Layer name of every fx node: the module path on a module's first call (or of the first weight a
    functional layer reads), else the fx name.

    fx names are unique, and a module path is only taken while it is still free, so the
    names never clash.
    """
    names: dict[torch.fx.Node, str] = {}
    taken: set[str] = set()
    for node in graph.nodes:
        preferred = node.target if node.op == "call_module" else _owner_of_stored(node) or node.name
        names[node] = preferred if preferred not in taken else node.name
        taken.add(names[node])
    return names


def _owner_of_stored(node: torch.fx.Node) -> str | None:
    """The module path of the weight a functional layer reads (``conv1`` for ``F.conv2d(x,
    self.conv1.weight)``, and every layer torch.export records): its name as a module's."""
    stored = [arg.target for arg in node.all_input_nodes if arg.op == "get_attr"]
    owner = stored[0].rpartition(".")[0] if node.op == "call_function" and stored else ""
    return owner or None


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


def _outputs(
    node: torch.fx.Node, names: Mapping[torch.fx.Node, str], moves: _Movements, layers: list[dict[str, Any]]
) -> tuple[list[str], list[str]]:
    result = node.args[0]
    values = list(result.values()) if isinstance(result, dict) else result
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    outputs: list[str] = []
    problems: list[str] = []
    for value in values:
        try:
            outputs.append(moves.layer_input(_tensor(value), layers))
        except Unsupported as exc:
            problems.append(f"the module's output: {exc}")
    return outputs, problems


def _tensor(arg: Any) -> torch.fx.Node:
    """``arg`` as a tensor-valued fx node; constants and shape values are not layer inputs."""
    if not isinstance(arg, torch.fx.Node) or _is_shape_query(arg):
        raise Unsupported(f"{arg!r} is not a tensor computed from the network's input")
    if arg.op == "get_attr":
        raise Unsupported(
            f"the stored tensor '{arg.target}' is used as an activation; a parameter or constant "
            "outside its module is supported only as a per-channel scale or shift"
        )
    return arg


def _translate(
    node: torch.fx.Node,
    modules: Mapping[str, nn.Module],
    root: nn.Module,
    values: Mapping[torch.fx.Node, Any],
    stored: StoredTensors,
) -> list[dict[str, Any]]:
    """The spec layers (without names; ``inputs`` of the first as fx nodes) for one fx node."""
    if node.op == "placeholder":
        return [{"type": "input", "inputs": []}]
    if node.op == "call_module":
        module = modules[node.target]
        translate_module = MODULES.get(type(module))
        if translate_module is None:
            raise Unsupported(_not_supported(type(module).__name__))
        if len(node.args) != 1 or node.kwargs:
            raise Unsupported("called with more than one argument")
        steps = translate_module(module, node.target)
        steps = steps if isinstance(steps, list) else [steps]
        return [{**steps[0], "inputs": [node.args[0]]}, *steps[1:]]
    if node.op == "call_function":
        translate_call = CALLS.get(node.target)
        if translate_call is not None:
            return _held_in_state(translate_call(node, values), stored)
        translate_reader = STORED_READERS.get(node.target)
        if translate_reader is not None:
            kwargs = _keyword_arguments(node, root)
            return [{**translate_reader(kwargs, stored), "inputs": [kwargs["input"]]}]
        translate_function = FUNCTIONS.get(node.target)
        if translate_function is None:
            raise Unsupported(_not_supported(getattr(node.target, "__name__", "")) + _stored_reads(node))
        return [translate_function(_keyword_arguments(node, root), node, values)]
    if node.op == "call_method":
        translate_method = METHODS.get(node.target)
        if translate_method is None:
            raise Unsupported(_not_supported(node.target) + _stored_reads(node))
        return _held_in_state(translate_method(node, values), stored)
    raise Unsupported(f"fx operation '{node.op}' is not supported")


def _held_in_state(steps: list[dict[str, Any]], stored: StoredTensors) -> list[dict[str, Any]]:
    """``steps``, once every stored tensor they read as a per-channel scale or shift is checked
    to be in the module's state_dict."""
    for step in steps:
        for role in ("weight", "bias"):
            if isinstance(step.get(role), str):
                stored.in_state(step[role], role)
    return steps


def _stored_reads(node: torch.fx.Node) -> str:
    """Why an unsupported operation on a stored tensor is refused, where it reads one."""
    keys = [f"'{arg.target}'" for arg in node.all_input_nodes if arg.op == "get_attr"]
    if not keys:
        return ""
    return (
        f" (it reads the stored tensor {', '.join(keys)}: a parameter or constant used outside its module is "
        "supported only as the weight of F.conv1d/2d/3d, F.linear and F.batch_norm, or as a per-channel "
        "scale or shift, x * scale + shift)"
    )


def _not_supported(name: str) -> str:
    # An ATen operation left by torch.export is named with its overload (``gelu.default``).
    if name.partition(".")[0].lower().rstrip("_") in NOT_HOMOGENEOUS_TYPES:
        raise NotHomogeneous()
    return "not supported"


def _describe(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"module '{node.target}', {type(modules[node.target]).__name__}"
    if node.op == "call_function":
        return f"function {_qualified_name(node.target)}"
    if node.op == "call_method":
        return f"method Tensor.{node.target}"
    return f"{node.op} '{node.target}'"


def _operation(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> str:
    """The operation's name for grouping: module class, function or method name."""
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        return _qualified_name(node.target) + _module_of_aten(node)
    return f"Tensor.{node.target}"


def _module_of_aten(node: torch.fx.Node) -> str:
    """`` in InstanceNorm2d`` for an ATen operation torch.export recorded inside a module's
    forward: the module the user wrote, for an operation named as torch.export names it."""
    owner = _owner(node) if isinstance(node.target, torch._ops.OpOverload) else None
    return f" in {owner[1]}" if owner else ""


_PUBLIC_MODULE_NAMES = {
    "torch._C._nn": "torch.nn.functional",
    "_operator": "operator",
    "torch._ops.aten": "torch.ops.aten",
}


def _qualified_name(function: Callable[..., Any]) -> str:
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__name__", repr(function))
    module = _PUBLIC_MODULE_NAMES.get(module, module)
    return f"{module}.{name}" if module else name


def _keyword_arguments(node: torch.fx.Node, root: nn.Module) -> dict[str, Any]:
    """The call's arguments by parameter name (defaults filled in for torch's builtins)."""
    signature = BUILTIN_SIGNATURES.get(node.target)
    if signature is None:
        normalized = node.normalized_arguments(root, normalize_to_only_use_kwargs=True)
        if normalized is None:
            raise Unsupported("its arguments cannot be matched to the function's signature")
        return normalized.kwargs
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError as exc:
        raise Unsupported(f"its arguments cannot be matched to the function's signature ({exc})") from None
    bound.apply_defaults()
    return dict(bound.arguments)


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


def _is_movement(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in MOVEMENT_FUNCTIONS
    return node.op == "call_method" and node.target in MOVEMENT_METHODS
