"""ONNX import and export: an ONNX ReLU network as a :class:`Graph`, and the rescaled file back.

Import translates the nodes that carry the activation (the values computed from the graph
input) into graph nodes; everything else — weight initializers, ``Constant`` nodes, the
``Transpose``/``Identity`` exporters put in front of weights, and shape arithmetic feeding
``Reshape`` — is static and only read. Shapes come from ONNX shape inference (with data
propagation, so the ``Shape → Gather → Concat`` chains of the TorchScript exporter resolve).

Export copies the original ``ModelProto`` and replaces only the tensors the rescaling changed,
so every other byte of the model (opset, producer, doc strings, untouched tensors) survives.

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

from ...engine.model import LoadedModel
from ...errors import InputError, OutputError
from .common import InputShape, check_weight_types, exception_line, shown
from .onnx_read import (
    batchnorm_folded_tensors,
    declared_batch,
    external_data_files,
    fed_inputs,
    own_external_data,
    read_onnx,
    read_tensors,
    reference_outputs,
)
from .onnx_translate import Translator
from .onnx_write import PROTOBUF_MAX_BYTES, write_onnx

__all__ = ["FORMAT", "PROTOBUF_MAX_BYTES", "OnnxFormat", "batchnorm_folded_tensors", "declared_batch",
           "external_data_files", "fed_inputs", "load_onnx", "own_external_data", "reference_outputs", "write_onnx"]


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
    model, external, shapes, inferred = read_onnx(source, input_shape, label)
    params = read_tensors(model, label)
    translation = Translator(inferred, label, read_nodes=model.graph.node, written=model.graph)
    graph = translation.translate(shapes)
    for alias, key in translation.aliases.items():
        params[alias] = params[key].clone()
    for alias, key, node_index, position in translation.splits:
        # One stored tensor read by several layers (torch.export deduplicates equal tensors,
        # e.g. zero biases and running means), or by a layer and another node: each extra
        # reader gets its own copy.
        params[alias] = params[key].clone()
        copy = onnx.TensorProto()
        copy.CopyFrom(translation.stored_proto(key))
        copy.name = alias
        model.graph.initializer.append(copy)
        model.graph.node[node_index].input[position] = alias
    files = [] if isinstance(source, bytes) else [Path(source), *external]
    return LoadedModel(graph=graph, params=params, format="onnx", source=label, payload=model, files=files,
                       arch_source="onnx graph", warnings=translation.notes)


class OnnxFormat:
    """ONNX models (``.onnx``, or any file that is not safetensors): the :class:`~.interface.Format`."""

    name = "onnx"

    def detect(self, path: Path | None, structure: str | None) -> str | None:
        """Asked last, ONNX reads any file no other format claims: onnx.load says what is wrong with it."""
        return "onnx"

    def load(self, source: Path | bytes, *, arch: str | None, input_shape: InputShape | None, name: str | None,
             allow_unused: bool) -> LoadedModel:
        if arch is not None:
            raise InputError(f"{name or source}: --arch applies to safetensors checkpoints; an ONNX model carries its graph.")
        try:
            model = load_onnx(source, input_shape=input_shape, name=name)
        except (text_format.Error, json_format.Error) as exc:
            # onnx.load picks a text parser from extensions such as .textproto or .pbtxt.
            label = name or str(source)
            raise InputError(f"cannot read '{label}': it is not a valid ONNX model ({exception_line(exc)}).") from None
        check_weight_types(model.graph, model.params, model.source)
        return model

    def write(self, model: LoadedModel, changed: dict[str, torch.Tensor], destination: Path, metadata: dict[str, str],
              *, companion_name: Callable[[str], str], self_contained: bool) -> None:
        write_onnx(model, changed, destination, metadata, companion_name=companion_name,
                   self_contained=self_contained)

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
