"""A loaded checkpoint: the ReLU DAG, its tensors, and what its format needs to write it back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .graph import BatchNorm, Graph
from .layouts import layout_of, stand_ins
from .rules import rule_for

NON_LEARNABLE_ROLES = ("running_mean", "running_var")


@dataclass(frozen=True)
class Carried:
    """Operations of an ONNX file that run unchanged around the ReLU DAG: ``pre`` (computed from
    the network's inputs and constants only, before any layer with parameters) and ``post``
    (computed from values no rescaling changes, after the DAG), their op types in file order.
    With either, ``inputs`` are the file's own inputs (batch-free shapes), ``dag_inputs`` the
    file's value each input node of the DAG is (by node name) and ``dag_outputs`` the file's
    values the DAG's outputs are, in its output order."""

    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dag_inputs: dict[str, str] = field(default_factory=dict)
    dag_outputs: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.pre or self.post)


@dataclass
class LoadedModel:
    """What every loader returns and every writer takes.

    ``params`` holds every tensor of the checkpoint by key (those the graph does not read are
    carried through unchanged; a safetensors checkpoint's are read when used).
    ``format`` is ``onnx``, ``safetensors`` or ``module``;
    ``payload`` is the format's own state needed to write the result back (the ONNX
    ``ModelProto``, safetensors metadata and shard layout, ...). ``warnings`` are shown to
    the user but do not stop the run. ``arch_source`` says where the architecture came from:
    ``onnx graph``, ``module``, ``--arch FILE``, ``metadata`` (the spec pathcond embeds) or
    ``sidecar FILE``. ``files`` are the files the checkpoint was read from
    (main file first, then shards, external data and the spec file), which a run without
    ``--in-place`` never writes. ``file_states`` holds each file's ``fileio.file_state`` once
    read: an in-place run replaces nothing another process has written since. ``carried``: an
    ONNX file's pre- and post-processing, kept unchanged around the DAG. ``copies``: keys of
    ``params`` that hold a loader's copy of another stored tensor (an ONNX initializer several
    layers read gets one copy per reader), each with the key of the tensor it copies.
    """

    graph: Graph
    params: Mapping[str, torch.Tensor]
    format: str
    source: str
    payload: Any = None
    warnings: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    arch_source: str = ""
    file_states: dict[Path, tuple[int, int, int, int] | None] = field(default_factory=dict)
    carried: Carried = field(default_factory=Carried)
    copies: dict[str, str] = field(default_factory=dict)

    @property
    def parameter_count(self) -> int:
        """Learnable elements as torch counts them (BatchNorm γ, β included, statistics not). A
        weight that several layers read from one stored tensor (:attr:`copies`) is tied and
        counts once; any other shared tensor counts per reader, because exporters store equal
        tensors once (a fresh model's BatchNorm γ of ones, its zero biases) that torch counts
        per layer."""
        stored = {
            self.copies.get(key, key) if role == "weight" and node.creates_channels else key: key
            for node in self.graph.nodes
            for role, key in node.parameter_keys().items()
            if role not in NON_LEARNABLE_ROLES
        }
        return sum(math.prod(layout_of(self.params, key)[0]) for key in stored.values())

    @property
    def hidden_units(self) -> int:
        """Output channels/features of every Linear and Conv except those producing an output."""
        final = set()
        for name in self.graph.outputs:
            final |= _producing_layers(self.graph, name)
        return sum(
            rule_for(node).out_channels(node, stand_ins(self.params))
            for node in self.graph.nodes
            if node.creates_channels and node.name not in final
        )


def _producing_layers(graph: Graph, name: str) -> set[str]:
    """The Linear/Conv layers whose channels reach output ``name`` without another layer between."""
    found: set[str] = set()
    stack = [name]
    while stack:
        node = graph[stack.pop()]
        if node.creates_channels:
            found.add(node.name)
        elif isinstance(node, BatchNorm) or node.inputs:
            stack.extend(node.inputs)
    return found
