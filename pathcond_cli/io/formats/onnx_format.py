"""ONNX import and export: an ONNX ReLU network as a :class:`Graph`, and the rescaled file back.

Import translates the nodes that carry the activation (the values computed from the graph
input) into graph nodes; everything else — weight initializers, ``Constant`` nodes, the
``Transpose``/``Identity`` exporters put in front of weights, and shape arithmetic feeding
``Reshape`` — is static and only read. Shapes come from ONNX shape inference (with data
propagation, so the ``Shape → Gather → Concat`` chains of the TorchScript exporter resolve).

A model older than opset 13, or with its nodes out of dependency order, is translated from a
copy converted and sorted in memory (:func:`.onnx_read.readable_model`); tensors and nodes keep
their names there, which is how what is read maps back to the file.

Export copies the original ``ModelProto`` and replaces only the tensors the rescaling changed,
so every other byte of the model (opset, producer, node order, doc strings, untouched tensors)
survives.

This module is the format (:class:`OnnxFormat`) and :func:`load_onnx`; reading is in
:mod:`.onnx_read`, translation in :mod:`.onnx_translate`, writing in :mod:`.onnx_write`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError

from ...engine.graph import Graph, check_batchnorm_statistics
from ...engine.model import LoadedModel
from ...errors import InputError, OutputError, UnsupportedModelError
from .common import InputShape, check_weight_types, exception_line, shown
from .onnx_ops import OPS
from .onnx_read import (
    READ_OPSET,
    batchnorm_folded_tensors,
    declared_batch,
    default_opset,
    external_data_files,
    fed_inputs,
    node_label,
    own_external_data,
    read_onnx,
    read_tensors,
    reference_evaluator,
    reference_outputs,
)
from .onnx_translate import Translator
from .onnx_write import PROTOBUF_MAX_BYTES, write_onnx

__all__ = [
    "FORMAT",
    "PROTOBUF_MAX_BYTES",
    "OnnxFormat",
    "batchnorm_folded_tensors",
    "declared_batch",
    "external_data_files",
    "fed_inputs",
    "load_onnx",
    "own_external_data",
    "reference_evaluator",
    "reference_outputs",
    "write_onnx",
]


def load_onnx(
    source: str | Path | bytes,
    *,
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None,
    name: str | None = None,
) -> LoadedModel:
    """Read an ONNX ReLU network: its DAG, every tensor it stores, and the model for writing back.

    ``input_shape`` (batch excluded; or ``{input name: shape}``, the only form for a model with
    several inputs) overrides the shape the model declares and is required for each input with
    a symbolic non-batch dimension. Each graph input becomes an input node of the DAG. ``params``
    holds every initializer and ``Constant`` tensor by ONNX name, plus, for a stored tensor that several layers read
    through ``Identity`` nodes, one copy per such Identity keyed by its output name.
    """
    label = name or (str(source) if not isinstance(source, bytes) else "<stdin>")
    model, external, shapes, inferred, read_nodes = read_onnx(source, input_shape, label)
    params = read_tensors(model, label)
    translation = Translator(
        inferred, label, OPS, read_nodes=read_nodes, written=model.graph, written_opset=default_opset(model)
    )
    graph = translation.translate(shapes)
    for alias, key in translation.aliases.items():
        params[alias] = params[key].clone()
    written_nodes = {node.output[0]: node for node in model.graph.node} if translation.splits else {}
    for alias, key, node_index, position in translation.splits:
        # One stored tensor read by several layers (torch.export deduplicates equal tensors,
        # e.g. zero biases and running means), or by a layer and another node: each extra
        # reader gets its own copy.
        reader, written_position = _written_read(written_nodes, read_nodes[node_index], position, key, label)
        params[alias] = params[key].clone()
        copy = onnx.TensorProto()
        copy.CopyFrom(translation.stored_proto(key))
        copy.name = alias
        model.graph.initializer.append(copy)
        reader.input[written_position] = alias
    _check_written_keys(graph, params, label)
    # Each copy by the key of the tensor the file stores (an Identity alias stands for it).
    copies = dict(translation.aliases)
    copies.update((alias, translation.aliases.get(key, key)) for alias, key, _, _ in translation.splits)
    files = [] if isinstance(source, bytes) else [Path(source), *external]
    return LoadedModel(
        graph=graph,
        params=params,
        format="onnx",
        source=label,
        payload=model,
        files=files,
        arch_source="onnx graph",
        warnings=[*translation.notes, *_shared_weight_notes(graph, copies)],
        carried=translation.carried,
        copies=copies,
    )


def _shared_weight_notes(graph: Graph, copies: dict[str, str]) -> list[str]:
    """A note for each stored tensor that several layers read as their weight: each reads a copy of
    its own (see ``copies``), which a rescaling changes by that layer's scales."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        key = node.parameter_keys().get("weight")
        if key is not None and node.creates_channels:
            readers.setdefault(copies.get(key, key), []).append(node.name)
    return [
        f"tensor '{shown(key)}' is the weight of {len(layers)} layers ({', '.join(shown(n) for n in layers[:5])}"
        f"{', ...' if len(layers) > 5 else ''}): each is analysed with a copy of its own, so a rescaled or pruned "
        "file stores one tensor per layer (the layers no longer share it); it counts once among the parameters"
        for key, layers in readers.items()
        if len(layers) > 1
    ]


def _written_read(
    written_nodes: dict[str, onnx.NodeProto], read: onnx.NodeProto, position: int, key: str, label: str
) -> tuple[onnx.NodeProto, int]:
    """The node of the file (by its first output, in ``written_nodes``) and the input position at
    which it reads ``key``, which node ``read`` of the model as read (in dependency order,
    converted to the opset pathcond reads: its inputs perhaps moved) reads as input ``position``."""
    written = written_nodes.get(read.output[0])
    if written is not None and position < len(written.input) and written.input[position] == key:
        return written, position
    positions = [index for index, value in enumerate(written.input) if value == key] if written is not None else []
    if len(positions) != 1:
        raise UnsupportedModelError(
            f"{label}: node '{node_label(read)[:120]}' ({read.op_type}) reads parameter '{key[:120]}' besides its "
            f"layer, in the model as converted to ONNX opset {READ_OPSET} but not as one input of a node of the file; "
            "the file cannot give it its own copy of the original value."
        )
    return written, positions[0]


def _check_written_keys(graph: Graph, params: dict[str, torch.Tensor], label: str) -> None:
    """Every tensor the DAG reads is one the file stores: the converter to the opset pathcond
    reads can add tensors, which the file written back (the model as it was) would lack."""
    missing = [key for key in graph.parameter_keys() if key not in params]
    if missing:
        raise UnsupportedModelError(
            f"{label}: the network reads tensor(s) {', '.join(repr(key[:120]) for key in missing[:5])}, which only "
            f"its conversion to ONNX opset {READ_OPSET} makes, so the rescaled file could not keep the model as it "
            f"is; exported again with opset {READ_OPSET} or later, it is read without conversion."
        )


class OnnxFormat:
    """ONNX models (``.onnx``, or any file that is not safetensors): the :class:`~.interface.Format`."""

    name = "onnx"

    def detect(self, path: Path | None, structure: str | None) -> str | None:
        """Asked last, ONNX reads any file no other format claims: onnx.load says what is wrong with it."""
        return "onnx"

    def load(
        self,
        source: Path | bytes,
        *,
        arch: str | None,
        input_shape: InputShape | None,
        name: str | None,
        allow_unused: bool,
    ) -> LoadedModel:
        if arch is not None:
            raise InputError(
                f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph."
            )
        try:
            model = load_onnx(source, input_shape=input_shape, name=name)
        except (text_format.Error, json_format.Error) as exc:
            # onnx.load picks a text parser from extensions such as .textproto or .pbtxt.
            label = name or str(source)
            raise InputError(f"cannot read '{label}': it is not a valid ONNX model ({exception_line(exc)}).") from None
        check_weight_types(model.graph, model.params, model.source)
        # Refused here for every command, `spec` included, which reads no other value.
        check_batchnorm_statistics(model.graph, model.params)
        return model

    def write(
        self,
        model: LoadedModel,
        changed: dict[str, torch.Tensor],
        destination: Path,
        metadata: dict[str, str],
        *,
        companion_name: Callable[[str], str],
        self_contained: bool,
    ) -> None:
        write_onnx(model, changed, destination, metadata, companion_name=companion_name, self_contained=self_contained)

    def check_streamable(self, model: LoadedModel) -> None:
        """Refuse a model whose tensors, all inline, exceed what protobuf holds in one message (2 GiB)."""
        size = model.payload.ByteSize()
        if size > PROTOBUF_MAX_BYTES:
            raise OutputError(
                f"{shown(model.source)}: cannot send the rescaled model to stdout (-o -): stdout takes one "
                f"self-contained file, and with its external data inline this model takes {size / 2**30:.3g} GiB, "
                "beyond the 2 GiB protobuf allows; write it with -o FILE.onnx instead (its large tensors then go "
                "to an external data file beside it). Nothing was written."
            )

    def companions(self, path: Path) -> list[Path]:
        try:
            return external_data_files(path)
        except (InputError, OSError, ValueError, DecodeError):
            return []  # not a model pathcond can read: it consists of itself

    def architecture_files(self, path: Path | None, arch: str | None) -> list[Path]:
        return []  # the model carries its graph

    def own_companions(self, path: Path) -> list[Path]:
        return own_external_data(path)


FORMAT = OnnxFormat()
