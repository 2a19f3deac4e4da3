"""The dynamo ONNX exporter's op registry, built once per process instead of once per export.

``torch.onnx.export(dynamo=True)`` rebuilds its registry of ONNX decompositions from torchlib
on every call (``ONNXRegistry.from_torchlib``): it re-reads the source of about 500 onnxscript
functions to learn each one's domain, more than half of a small network's export time. The
registry depends only on the opset version and on the installed torch and onnxscript, so
:func:`torchlib_registry_built_once` builds it once and hands every export its own copy (a new
registry object with new lists, so nothing an export registers leaks into the next). The
written ONNX files are the same bytes (checked on the dynamo exports of ``tests/ops_models.py``
with torch 2.13 and onnxscript 0.7.2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

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
