"""Does the rescaled network compute the original function? Measured, never assumed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .evaluate import forward
from .graph import BatchNorm, Graph

LARGE_INPUT = 16384

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@dataclass
class Verification:
    """Largest output differences between original and rescaled networks on random inputs.

    The relative error is the absolute error divided by the largest original output
    magnitude (per output); ``tolerance`` depends on the coarsest parameter dtype.
    """

    max_abs_error: float
    max_rel_error: float
    tolerance: float
    modes: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.max_rel_error <= self.tolerance


def tolerance_for(params: Mapping[str, torch.Tensor], keys: list[str]) -> float:
    return max(TOLERANCE.get(params[k].dtype, 1e-5) for k in keys)


def compare(
    graph: Graph,
    original: Mapping[str, torch.Tensor],
    rescaled: Mapping[str, torch.Tensor],
    *,
    batch: int | None = None,
    seed: int = 0,
) -> Verification:
    """Run both parameter sets on the same random float64 inputs, in eval mode and, when the
    network has BatchNorm, in train mode (batch statistics) too.

    The default batch is 8, or 2 for inputs of more than 16384 elements (ImageNet-sized
    images), where float64 convolutions dominate the run time.
    """
    if batch is None:
        batch = 2 if max(math.prod(n.shape) for n in graph.inputs) > LARGE_INPUT else 8
    generator = torch.Generator().manual_seed(seed)
    inputs = {n.name: torch.randn((batch, *n.shape), generator=generator, dtype=torch.float64) for n in graph.inputs}
    modes = ("eval", "train") if any(isinstance(n, BatchNorm) for n in graph.nodes) else ("eval",)
    max_abs = max_rel = 0.0
    for mode in modes:
        train = mode == "train"
        with torch.no_grad():
            before = forward(graph, original, inputs, train=train)
            after = forward(graph, rescaled, inputs, train=train)
        for name in graph.outputs:
            if not (bool(torch.isfinite(before[name]).all()) and bool(torch.isfinite(after[name]).all())):
                return Verification(math.inf, math.inf, tolerance_for(rescaled, graph.parameter_keys()), modes)
            diff = float((before[name] - after[name]).abs().max())
            scale = float(before[name].abs().max())
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / scale if scale > 0 else diff)
    return Verification(max_abs, max_rel, tolerance_for(rescaled, graph.parameter_keys()), modes)
