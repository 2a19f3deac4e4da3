"""Writing ONNX: the original ``ModelProto`` with only the changed tensors replaced, large
tensors in an external data file when the model was read with one."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from pathlib import Path

import onnx
import torch
from onnx import external_data_helper

from ...engine.model import LoadedModel
from ...errors import OutputError
from ..companions import external_data_name
from ..fileio import atomic_write, describe, output_error_from
from .onnx_read import TENSOR_DATA_FIELDS, constant_tensor, copy_without_data

# A model read with external data is written with its float initializers of at least this many
# bytes in an external data file (onnx's own default threshold); everything else stays inline.
EXTERNAL_MIN_BYTES = 1024
# The largest message protobuf serialises: a self-contained model must fit in it.
PROTOBUF_MAX_BYTES = 2**31 - 1
FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
}
_ONNX_TYPE_OF = {dtype: onnx_type for onnx_type, dtype in FLOAT_TYPES.items()}


def write_onnx(
    model: LoadedModel,
    changed: Mapping[str, torch.Tensor],
    destination: Path,
    metadata: dict[str, str],
    *,
    companion_name: Callable[[str], str] = str,
    self_contained: bool = False,
) -> None:
    """Write the loaded model with the tensors in ``changed`` replaced and ``metadata`` recorded.

    Every other part of the model — graph, opset, producer, doc strings, metadata already there,
    and each tensor not in ``changed`` — is written back exactly as it was read. A model read
    with external data is written with external data too, unless ``self_contained``: its float
    initializers of :data:`EXTERNAL_MIN_BYTES` or more go to one file beside ``destination``,
    ``<name>.data`` or what ``companion_name`` makes of it; every other tensor (small ones, and
    integer shapes and axes, which runtimes read while loading the graph) stays in the model.
    A model that protobuf cannot hold in one message (2 GiB) is refused with ``OutputError``
    when it must be self-contained.
    """
    destination = Path(destination)
    replaced = _with_detached_aliases(model.payload.graph, changed, model.params)
    proto = copy_without_data(model.payload, lambda tensor: tensor.name in replaced)
    _replace_tensors(proto.graph, replaced)
    _update_metadata(proto, metadata)
    if self_contained and proto.ByteSize() > PROTOBUF_MAX_BYTES:
        raise OutputError(
            f"cannot write '{describe(destination)}' as one self-contained model: it holds "
            f"{proto.ByteSize() / 2**30:.3g} GiB, beyond protobuf's 2 GiB; write it to a file (-o out.onnx), "
            "whose large tensors go to an external data file beside it. Nothing was written."
        )
    if len(model.files) > 1 and not self_contained:
        location = companion_name(external_data_name(destination.name))
        for tensor in proto.graph.initializer:
            if tensor.data_type in FLOAT_TYPES and len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
                external_data_helper.set_external_data(tensor, location)
        try:
            # onnx writes the data file beside the model it saves, named by the location itself.
            onnx.save_model(proto, str(destination))
        except OSError as exc:
            raise output_error_from(exc, destination) from None
    else:
        atomic_write(destination, lambda tmp: onnx.save_model(proto, str(tmp)))


def _with_detached_aliases(
    graph: onnx.GraphProto, changed: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """``changed`` plus each Identity alias (a parameter of its own) whose shared tensor changes.

    Such an alias must stop reading the shared tensor and keep the value it had. A view: the
    tensors of ``changed`` (computed when read) are not read here.
    """
    aliases = {
        node.output[0]: params[node.output[0]]
        for node in graph.node
        if node.op_type == "Identity"
        and node.output[0] in params
        and node.input[0] in changed
        and node.output[0] not in changed
    }
    return ChainMap(changed, aliases)


def _replace_tensors(graph: onnx.GraphProto, changed: Mapping[str, torch.Tensor]) -> None:
    """Each tensor of ``changed`` read when its place is reached and let go after it is stored,
    so that one rescaled tensor is held at a time beside the model."""
    remaining = dict.fromkeys(changed)
    for tensor in graph.initializer:
        if tensor.name in remaining:
            del remaining[tensor.name]
            _set_tensor_data(tensor, changed[tensor.name])
    for node in graph.node:
        key = node.output[0] if node.output else ""
        if key not in remaining:
            continue
        stored = constant_tensor(node)
        if stored is not None:
            del remaining[key]
            _set_tensor_data(stored, changed[key])
            if not any(a.name == "value" for a in node.attribute):
                # value_floats, sparse_value, ...: the rescaled tensor is held as a dense value.
                del node.attribute[:]
                node.attribute.append(onnx.helper.make_attribute("value", stored))
        elif node.op_type == "Identity":
            del remaining[key]
            _identity_to_constant(node, changed[key])
    if remaining:
        raise KeyError(f"no initializer or Constant named {', '.join(map(repr, remaining))} in the model")


def _identity_to_constant(node: onnx.NodeProto, tensor: torch.Tensor) -> None:
    """Give an Identity that aliased a shared tensor its own, rescaled, value."""
    value = onnx.TensorProto(name=node.output[0], data_type=_ONNX_TYPE_OF[tensor.dtype], dims=tensor.shape)
    _set_tensor_data(value, tensor)
    node.op_type = "Constant"
    del node.input[:]
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("value", value))


def _set_tensor_data(proto: onnx.TensorProto, tensor: torch.Tensor) -> None:
    """Store ``tensor`` in ``proto`` as raw little-endian bytes, keeping name, type and dims."""
    dtype = FLOAT_TYPES.get(proto.data_type)
    if dtype is None or tuple(tensor.shape) != tuple(proto.dims):
        raise ValueError(
            f"tensor '{proto.name}': cannot store {tuple(tensor.shape)} {tensor.dtype} values "
            f"in a {tuple(proto.dims)} {onnx.TensorProto.DataType.Name(proto.data_type)} tensor"
        )
    data = tensor.detach().to("cpu", dtype).contiguous()
    if dtype == torch.bfloat16:
        data = data.view(torch.int16)
    for field in (*TENSOR_DATA_FIELDS, "external_data"):
        proto.ClearField(field)
    proto.data_location = onnx.TensorProto.DEFAULT
    array = data.numpy()
    proto.raw_data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _update_metadata(proto: onnx.ModelProto, metadata: dict[str, str]) -> None:
    existing = {entry.key: entry for entry in proto.metadata_props}
    for key, value in metadata.items():
        entry = existing.get(key) or proto.metadata_props.add(key=key)
        entry.value = str(value)
