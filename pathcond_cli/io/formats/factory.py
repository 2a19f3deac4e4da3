"""Architecture factories (``--arch module.path:callable``): finding the Python files one runs,
importing it (the current directory on ``sys.path``), calling it, and tracing the module it
builds. The safetensors route and the library's module route both load factories here."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...engine.graph import Graph, all_finite
from ...errors import InputError, InvalidWeightsError, UsageError
from .common import InputShape, shapes_by_input
from .fx_import import ModuleRead, read_module


def factory_source_files(spec: str) -> list[Path]:
    """The files ``import`` executes for ``module.path:callable`` (each package's ``__init__``
    and the module), found as :func:`load_factory` finds them but without importing anything."""
    module_name = spec.rpartition(":")[0]
    search: list[str] = [os.getcwd(), *sys.path]
    files = []
    parts = module_name.split(".") if module_name else []
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = sys.modules.get(name)
        if module is not None:
            origin, locations = getattr(module, "__file__", None), getattr(module, "__path__", None)
        else:
            try:
                found = PathFinder.find_spec(name, search)
            except (ImportError, ValueError, OSError):
                break
            if found is None:
                break
            origin = found.origin if found.has_location else None
            locations = found.submodule_search_locations
        if origin:
            files.append(Path(origin))
        search = list(locations or [])
        if not search:
            break
    return files


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
    except (Exception, SystemExit) as exc:  # importing runs arbitrary user code, which may raise anything
        raise InputError(
            f"architecture factory '{spec}': cannot import module '{module_name}' "
            f"({_raised(exc)}); it is looked up on sys.path and in the current directory"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InputError(f"architecture factory '{spec}': module '{module_name}' has no attribute '{attribute}'")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"architecture factory '{spec}': '{attribute}' is not callable")
    try:
        built = target()
    except (Exception, SystemExit) as exc:  # the factory is user code; sys.exit() there ends nothing but the factory
        raise InputError(f"architecture factory '{spec}': calling {attribute}() failed ({_raised(exc)})") from None
    if not isinstance(built, nn.Module):
        raise InputError(
            f"architecture factory '{spec}': {attribute}() returned {type(built).__name__}, not a torch.nn.Module"
        )
    return built


def _raised(exc: BaseException) -> str:
    """What user code raised, in a message; a sys.exit() call is named as such."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})" if exc.code is not None else "it called sys.exit()"
    return f"{type(exc).__name__}: {exc}"


def graph_from_factory(
    arch: str, input_shape: InputShape | None, checkpoint: Mapping[str, torch.Tensor], display: str
) -> tuple[Graph, list[str], frozenset[str]]:
    """The traced graph of the module ``arch`` returns, its import notes, and the keys of the
    ``checkpoint`` tensors it reads as constants: the persistent filter buffers of its fixed
    filters, whose coefficients are the checkpoint's, not the factory's (as ``load_state_dict``
    would load them). ``input_shape`` may name the module's one input (the module is traced
    with the first shape named: one whose forward takes several is refused before it runs, and
    a name that is not its input afterwards)."""
    named = dict(input_shape) if isinstance(input_shape, Mapping) else {}
    if input_shape is None:
        raise UsageError(
            f"--arch '{arch}': tracing a Python factory needs the batch-free shape of the module's one input "
            "(--input-shape, e.g. 3,32,32)"
        )
    shape = next(iter(named.values())) if named else input_shape
    read = read_module(load_factory(arch), shape, source=arch)
    shapes_by_input(named or None, [node.name for node in read.graph.inputs], f"--arch '{arch}'")
    graph = _checkpoint_filters(read, checkpoint, display) if read.filter_buffers else read.graph
    return graph, read.notes, frozenset(read.filter_buffers.values())


def _checkpoint_filters(read: ModuleRead, checkpoint: Mapping[str, torch.Tensor], display: str) -> Graph:
    """``read.graph`` with each fixed filter's coefficients taken from the checkpoint tensor of its buffer."""
    coefficients: dict[str, tuple[float, ...]] = {}
    problems = []
    for layer, key in read.filter_buffers.items():
        expected = tuple(read.params[key].shape)
        if key not in checkpoint:
            problems.append(
                f"node '{layer}' (fixed_filter) needs tensor '{key}' (the filter buffer of the "
                f"factory's module, a persistent buffer of shape {expected}), which the checkpoint lacks"
            )
            continue
        tensor = checkpoint[key]
        if tuple(tensor.shape) != expected or not tensor.is_floating_point():
            problems.append(
                f"node '{layer}' (fixed_filter): tensor '{key}' has shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}, expected the factory's filter buffer's shape {expected}, floating point"
            )
        elif not all_finite(tensor):
            raise InvalidWeightsError(
                f"{display}: tensor '{key}' (the filter of fixed filter '{layer}') holds NaN or Inf values"
            )
        else:
            coefficients[layer] = tuple(tensor.detach().double().flatten().tolist())
    if problems:
        raise InputError(f"{display}: the checkpoint does not match the architecture:", problems)
    nodes = [
        replace(node, coefficients=coefficients[node.name]) if node.name in coefficients else node
        for node in read.graph.nodes
    ]
    return Graph(nodes, read.graph.outputs, source=read.graph.source)
