"""The dynamo ONNX exporter's op registry and torch.export's list of composite ops, each built
once per process instead of once per export.

``torch.onnx.export(dynamo=True)`` rebuilds its registry of ONNX decompositions from torchlib
on every call (``ONNXRegistry.from_torchlib``): it re-reads the source of about 500 onnxscript
functions to learn each one's domain, more than half of a small network's export time. The
registry depends only on the opset version and on the installed torch and onnxscript, so
:func:`torchlib_registry_built_once` builds it once and hands every export its own copy (a new
registry object with new lists, so nothing an export registers leaks into the next). The
written ONNX files are the same bytes (checked on the dynamo exports of ``tests/ops_models.py``
with torch 2.13 and onnxscript 0.7.2).

``run_decompositions`` also lists every preservable CompositeImplicitAutograd operator twice per
export (``_collect_all_valid_cia_ops``: every op of every loaded namespace, about 0.1 s, an eighth
of a small export). The list depends only on the operators registered, so
:func:`composite_ops_listed_once` keeps it for as long as no namespace, no operator and no
composite kernel has been added (the same bytes again on the same networks). What the key cannot
see: as many operators removed as added, or a composite kernel registered from Python only; the
suite does neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

_BUILT: dict[object, object] = {}


@contextlib.contextmanager
def torchlib_registry_built_once() -> Iterator[None]:
    """While active, ``ONNXRegistry.from_torchlib`` returns a copy of a registry built once."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:  # an exporter without this internal: nothing to cache
        yield
        return
    registry_class = _registration.ONNXRegistry
    original = registry_class.__dict__["from_torchlib"]

    def from_torchlib(cls, *args, **kwargs):
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in _BUILT:
            _BUILT[key] = original.__func__(cls, *args, **kwargs)
        built = _BUILT[key]
        if not isinstance(getattr(built, "functions", None), dict):  # another torch's layout: no cache
            return original.__func__(cls, *args, **kwargs)
        copy = object.__new__(cls)
        copy.__dict__.update(built.__dict__)
        copy.functions = {target: list(metas) for target, metas in built.functions.items()}
        return copy

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry_class, "from_torchlib", classmethod(from_torchlib))
        yield


_LISTED: dict[object, object] = {}


def _registered_operators() -> tuple:
    """What the list of composite ops is made from: the loaded namespaces, the operators each has
    loaded so far, and the composite kernels registered with the dispatcher."""
    namespaces = tuple(torch.ops._dir)
    loaded = tuple(len(getattr(getattr(torch.ops, name), "_dir", ())) for name in namespaces)
    composite = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return namespaces, loaded, len(composite)


@contextlib.contextmanager
def composite_ops_listed_once() -> Iterator[None]:
    """While active, torch.export's ``_collect_all_valid_cia_ops`` returns the list it made for the
    same registered operators before."""
    try:
        from torch._export import utils
        from torch.export import decomp_utils, exported_program
    except ImportError:
        yield
        return
    users = [module for module in (decomp_utils, exported_program) if hasattr(module, "_collect_all_valid_cia_ops")]
    original = getattr(utils, "_collect_all_valid_cia_ops", None)
    if original is None or not users:
        yield
        return

    def listed_once():
        key = _registered_operators()
        if key not in _LISTED:
            _LISTED[key] = original()
        return _LISTED[key]

    with pytest.MonkeyPatch.context() as patch:
        for module in users:
            patch.setattr(module, "_collect_all_valid_cia_ops", listed_once)
        yield
