"""Pure data movement (view, reshape, transpose, split, slicing) as ReLU DAG nodes.

Importers replay a chain of such operations on an index tensor (each element holds its own
flat position in the source) and ask :func:`movement_layer` what the chain amounts to: the
identity, a flatten, a channel slice, a channel shuffle, or any other selection of whole
channels (a gather). Anything else mixes neurons of different channels or of the batch and
is refused with the reason.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch


class UnsupportedMovement(Exception):
    """Why a data movement is not one the ReLU DAG can represent."""


def movement_layer(shape: tuple[int, ...], index: torch.Tensor) -> dict[str, Any] | None:
    """The spec layer of a data movement from batch-free ``shape`` (None: the identity).

    ``index`` holds, for every element of the moved tensor (batch axis first, batch of 1),
    the flat batch-free index of the element of the source it is.
    """
    if index.shape[0] != 1:
        raise UnsupportedMovement(f"it moves data across the batch axis (batch-axis size {index.shape[0]} for a batch of 1)")
    index = index[0]
    total = prod(shape)
    if tuple(index.shape) == shape and torch.equal(index.reshape(-1), torch.arange(total)):
        return None
    if index.dim() == 1 and torch.equal(index, torch.arange(total)) and len(shape) > 1:
        return {"type": "flatten"}
    per_channel = prod(shape[1:])
    if index.dim() == len(shape) and tuple(index.shape[1:]) == shape[1:]:
        channels = index.reshape(index.shape[0], -1)[:, 0] // per_channel
        expected = channels[:, None] * per_channel + torch.arange(per_channel)
        if torch.equal(index.reshape(index.shape[0], -1), expected):
            start = int(channels[0])
            if torch.equal(channels, torch.arange(start, start + len(channels))):
                return {"type": "channel_slice", "start": start, "stop": start + len(channels)}
            for groups in range(2, shape[0] + 1):
                if shape[0] % groups == 0 and len(channels) == shape[0] and torch.equal(
                        channels, torch.arange(shape[0]).reshape(groups, -1).t().reshape(-1)):
                    return {"type": "channel_shuffle", "groups": groups}
            return {"type": "channel_gather", "channels": channels.tolist()}
    raise UnsupportedMovement(
        f"it reshapes {shape} to {tuple(index.shape)} (batch excluded): only a flatten to (batch, features), "
        "or a selection of whole channels (slice, split, shuffle, gather) is supported"
    )
