"""Validators of node hyper-parameters, attached to the node fields of :mod:`.graph`.

Each validator takes a raw value (from a spec file, or an importer's spec dict), raises
ValueError with a phrase that completes "'<field>' ..." when it is not acceptable, and
returns the normalised value the node stores. :func:`hyper` declares a node field with its
validator and its default in a spec.

The spec's defaults are the only ones an imported node gets: every importer builds its nodes
with the spec's node constructor (``io/formats/spec.node_from_layer``). The dataclass default
serves code that builds a node directly (tests) and differs where a spec's cannot be a constant:
a spec must give a pooling kernel, an omitted stride is the kernel, an omitted tensor key is
``<name>.<role>``. Spec files rely on these, so they stay as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import field
from typing import Any

REQUIRED = object()
_SAME = object()


def hyper(default: Any, convert: Callable[[Any], Any], *, spec_default: Any = _SAME) -> Any:
    """A node field validated by ``convert``; ``spec_default``: its value when a spec omits it
    (:data:`REQUIRED`: a spec must give it), by default the field's own default."""
    return field(
        default=default,
        metadata={"convert": convert, "spec_default": default if spec_default is _SAME else spec_default},
    )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ints(minimum: int | None) -> Callable[[Any], tuple[int, ...]]:
    """Integers of at least ``minimum`` (None: of any sign), one or a list."""

    def convert(value: Any) -> tuple[int, ...]:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items or not all(is_int(v) and (minimum is None or v >= minimum) for v in items):
            bound = "" if minimum is None else f" >= {minimum}"
            raise ValueError(f"must be an integer{bound} or a list of them")
        return tuple(items)

    return convert


def integer(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if not is_int(value) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}")
        return value

    return convert


def number(requirement: str, accept: Callable[[float], bool] = math.isfinite) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        result = None
        if is_int(value) or isinstance(value, float):
            result = float(value)
        elif isinstance(value, str):
            # PyYAML (YAML 1.1) reads "1e-5" without a dot as a string.
            try:
                result = float(value)
            except ValueError:
                pass
        if result is None or not math.isfinite(result) or not accept(result):
            raise ValueError(f"must be {requirement}")
        return result

    return convert


def optional_sizes(value: Any) -> tuple[int, ...]:
    """An output size, or none (``null`` or ``[]``) when a scale factor is given instead."""
    return () if value is None or value == [] else ints(1)(value)


def optional_ints(minimum: int | None) -> Callable[[Any], tuple[int, ...]]:
    """Integers as :func:`ints` reads them, or none (``null`` or ``[]``)."""

    def convert(value: Any) -> tuple[int, ...]:
        return () if value is None or value == [] or value == () else ints(minimum)(value)

    return convert


def positive_floats(value: Any) -> tuple[float, ...]:
    """Scale factors, or none (``null`` or ``[]``) when an output size is given instead."""
    return _floats([] if value is None else value, number("a number > 0", lambda x: x > 0), "a number > 0")


def finite_floats(value: Any) -> tuple[float, ...]:
    """Finite numbers, one or a list (a fixed filter's coefficients)."""
    return _floats(value, number("a finite number"), "a finite number")


class ItemError(ValueError):
    """A list value with one item that is not acceptable, named in the message (whose other
    items, thousands of coefficients say, need not be quoted)."""


def _floats(value: Any, convert: Callable[[Any], float], requirement: str) -> tuple[float, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    converted = []
    for position, item in enumerate(items):
        try:
            converted.append(convert(item))
        except ValueError:
            if len(items) == 1:
                raise ValueError(f"must be {requirement} or a list of them") from None
            raise ItemError(
                f"must be {requirement} or a list of them; item {position} of {len(items)} is {item!r}"
            ) from None
    return tuple(converted)


def choice(*choices: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}")
        return value

    return convert


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value
