"""Does the network look uncalibrated (as at initialisation)? Such networks have extreme optima.

Folding BatchNorm uses its running statistics. At their defaults (mean 0, variance 1: a
network never run in train mode) each folded layer keeps its initial weights whatever the
scale of the activations it will see, and the PathCond optimum can be extreme (‖u*‖∞ of 82 and
322 on the small MnasNet- and GoogLeNet-style test networks at initialisation, 8.7 and 4.6 once
BatchNorm is calibrated on four random batches). A network whose output does
not depend on its input is a constant function: its rescaling has no signal to preserve and
its optimum comes from weights alone. Both are warnings, never errors: the paper rescales at
initialisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .evaluate import forward
from .graph import BatchNorm
from .groups import RescalingGroups
from .model import LoadedModel

EXTREME_NOTE = (
    "such optima can be extreme (‖u*‖∞ of 82 and 322 measured on small MnasNet- and GoogLeNet-style "
    "networks at initialisation), and --max-log-scale auto, the default, bounds them to what the "
    "checkpoint's dtypes can store"
)


def default_statistics(model: LoadedModel) -> list[str]:
    """The BatchNorm nodes, if every one of them (at least one) holds mean 0 and variance 1; else []."""
    norms = [node for node in model.graph.nodes if isinstance(node, BatchNorm)]
    if not norms:
        return []
    for node in norms:
        mean, var = model.params.get(node.running_mean), model.params.get(node.running_var)
        if mean is None or var is None or bool(mean.any()) or not bool((var == 1).all()):
            return []
    return [node.name for node in norms]


def ignores_input(model: LoadedModel, groups: RescalingGroups, seed: int = 0) -> bool:
    """Whether two random inputs give exactly the same outputs (eval mode, float64): one forward
    pass of its own, for a run whose verification (which runs the original anyway) does not
    answer it (:func:`outputs_ignore_input`)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {
        node.name: torch.randn((2, *groups.shapes[node.name]), generator=generator, dtype=torch.float64)
        for node in model.graph.inputs
    }
    with torch.no_grad():
        outputs = forward(model.graph, model.params, inputs)
    return outputs_ignore_input(outputs.values())


def outputs_ignore_input(outputs: Iterable[torch.Tensor]) -> bool:
    """Whether batched outputs, of the original network in eval mode on different random inputs,
    are exactly the same for every input of the batch."""
    return all(bool((out == out[:1]).all()) for out in outputs)


def calibration_warnings(model: LoadedModel, constant: bool | None) -> list[str]:
    """Warnings for a network that looks uncalibrated, saying what that does to the optimum
    (``constant``: whether its output ignores its input, :func:`ignores_input`; None when not yet
    known, for :func:`constant_output_warnings` to add once it is)."""
    notes = []
    norms = default_statistics(model)
    if norms:
        notes.append(
            f"{model.source}: all {len(norms)} BatchNorm layer(s) hold their default running statistics (mean 0, "
            "variance 1): the network looks uncalibrated, as at initialisation. Folded with these statistics "
            "each layer keeps its initial weights whatever the scale of its activations, so the optimum is that "
            f"of the network as initialised; {EXTREME_NOTE}. If the network will be used calibrated, run a few "
            "batches through it in train mode before rescaling (calibrated on four random batches, the same "
            "small networks have ‖u*‖∞ of 8.7 and 4.6)."
        )
    return notes + constant_output_warnings(model, bool(constant))


def constant_output_warnings(model: LoadedModel, constant: bool) -> list[str]:
    """The warning for a network whose output ignores its input (``constant``), if it does."""
    if not constant:
        return []
    return [
        f"{model.source}: the network's output does not depend on its input (different random inputs give the "
        "same outputs in eval mode): it computes a constant, so the rescaling has no signal to preserve and its "
        f"optimum comes from the weights alone; {EXTREME_NOTE}. Check the weights (an all-zero layer, dead "
        "ReLUs, BatchNorm statistics that do not match the weights)."
    ]
