"""Where a run computes and how long each of its stages takes: the device choice and the
stopwatch every stage is timed with."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from .errors import UsageError

T = TypeVar("T")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device '{device}' was requested but torch sees no CUDA device on this machine.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"device '{device}' was requested but this machine has {torch.cuda.device_count()} CUDA "
            "device(s), numbered from 0."
        )
    return device


class Stopwatch:
    """Adds each stage's wall-clock seconds to ``seconds`` under the stage's name (a stage timed
    twice counts both times): ``timed("solve", work)`` runs ``work`` and returns its value, and
    ``with timed.stage("groups"):`` times a block. A stage that raises is not counted."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    def __call__(self, stage: str, work: Callable[[], T]) -> T:
        with self.stage(stage):
            return work()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
