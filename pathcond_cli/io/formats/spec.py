"""Declarative architecture specs: a YAML or JSON list of layers mapping 1:1 onto graph.py nodes.

A safetensors checkpoint holds tensors but no architecture; a spec supplies it. The schema
(documented in ``docs/spec-format.md``)::

    format_version: 1                 # optional
    layers:
      - {name: x, type: input, shape: [3, 32, 32]}
      - {name: conv1, type: conv, padding: 1, bias: null}   # weight key: conv1.weight
      - {name: bn1, type: batchnorm}
      - {name: relu1, type: relu}
      - {name: skip, type: add, inputs: [relu1, x]}
    outputs: [skip]                   # optional: the last layer

Hyper-parameters carry the names of the node fields. Integers that torch accepts "per
spatial axis" (stride, padding, kernel, ...) may be a scalar or a list; once the graph is
known, they are expanded to the spatial rank of the layer's input, which follows from the
input shape. That is why every input needs a shape (in the spec or from ``input_shape``).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ...engine.graph import NODE_TYPES, AdaptiveAvgPool, Graph, Identity, Input, Node, first_names, node_attributes
from ...engine.schema import REQUIRED, ItemError, ints
from ...errors import InputError, UnsupportedModelError, UsageError
from .common import parse_json, shapes_by_input
from .offenders import NOT_HOMOGENEOUS_TYPES, grouped, offender_note

FORMAT_VERSION = 1
# What a spec file is named: the spec command writes these, --arch reads them, sidecars end so.
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
MAX_SPEC_BYTES = 10_000_000
MAX_SPEC_DEPTH = 64


@dataclass(frozen=True)
class _Field:
    """A hyper-parameter: ``convert`` validates a raw value (raising ValueError) and normalises it."""

    convert: Callable[[Any], Any]
    default: Any = REQUIRED


@dataclass(frozen=True)
class _LayerType:
    """How one spec ``type`` becomes a node.

    ``keys`` are the tensor-key roles (default ``<name>.<role>``), ``nullable_keys`` those
    that may be ``null``; ``pinned`` node fields an alias fixes; ``ignored`` fields are
    accepted for readability and dropped (dropout's ``p`` has no effect in inference).
    """

    node: type[Node]
    hyper: dict[str, _Field] = field(default_factory=dict)
    keys: tuple[str, ...] = ()
    nullable_keys: tuple[str, ...] = ()
    pinned: dict[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


def _layer_type(node: type[Node], **alias: Any) -> _LayerType:
    """The spec type of a node class: its validated fields and tensor roles (``alias``: pinned
    or ignored fields of an alias type)."""
    hyper = {
        f.name: _Field(f.metadata["convert"], f.metadata["spec_default"])
        for f in fields(node)
        if "convert" in f.metadata and f.name not in alias.get("pinned", {})
    }
    return _LayerType(node, hyper, tuple(node.roles), node.optional_roles, **alias)


LAYER_TYPES: dict[str, _LayerType] = {
    **{op: _layer_type(node) for op, node in NODE_TYPES.items()},
    "dropout": _layer_type(Identity, ignored=("p",)),
    "global_avgpool": _layer_type(AdaptiveAvgPool, pinned={"output_size": (1,)}),
}

_TOP_LEVEL_KEYS = ("format_version", "layers", "outputs")
_COMMON_KEYS = ("name", "type", "inputs")


def graph_from_spec(
    spec: Mapping[str, Any], *, source: str, input_shape: Sequence[int] | Mapping[str, Sequence[int]] | None = None
) -> Graph:
    """The validated :class:`Graph` a spec describes.

    ``input_shape`` (batch-free, e.g. ``(3, 32, 32)``) overrides the shape of the spec's
    single input layer; ``{layer name: shape}`` overrides those of the input layers it names.
    Every problem found in the spec is reported in one :class:`InputError`
    that names ``source`` and the layer; structural problems (cycles, dangling inputs,
    duplicate names) come from :class:`Graph` with ``source`` in the message.
    """
    problems: list[str] = []
    offenders: list[tuple[str, str]] = []
    layers = _top_level(spec, problems)
    nodes = []
    previous: str | None = None
    for index, layer in enumerate(layers):
        node = _parse_layer(index, layer, previous, problems, offenders)
        arity_problem = _arity_problem(node) if node is not None else None
        if arity_problem:
            problems.append(arity_problem)
        elif node is not None:
            nodes.append(node)
        previous = _layer_name(layer) or previous
    outputs = _outputs(spec, previous, problems)
    nodes = _with_input_shape(nodes, input_shape, source, problems)
    if offenders and not problems:
        raise UnsupportedModelError(
            f"{source}: the network is not a ReLU DAG pathcond can rescale exactly; {len(offenders)} problem(s):",
            grouped(offenders),
            note=offender_note(offenders),
        )
    problems += [f"layer '{name}' has type '{kind}': not positively homogeneous" for kind, name in offenders]
    _raise_if_any(problems, source)

    graph = Graph(nodes, outputs, source)
    input_problems: list[str] = []
    expanded = _expand_per_axis_fields(graph, problems, input_problems)
    if input_problems and input_shape is not None and not problems:
        raise UsageError(
            f"{source}: the input shape {_brief(input_shape)} does not fit the network (input shapes are batch-free):",
            input_problems,
        )
    _raise_if_any(problems + input_problems, source)
    return Graph(expanded, outputs, source)


def node_from_layer(layer: Mapping[str, Any], *, source: str) -> Node:
    """The node one spec layer describes (``name``, ``type``, ``inputs`` and the type's fields),
    validated and normalised as a spec file's layers are: the one node constructor, whose defaults
    are the only ones (see :mod:`pathcond_cli.engine.schema`). ONNX builds every node here; fx and
    data movement emit layers that :func:`graph_from_spec` builds with the same :func:`_parse_layer`."""
    problems: list[str] = []
    offenders: list[tuple[str, str]] = []
    node = _parse_layer(0, layer, None, problems, offenders)
    problems += [f"layer '{name}' has type '{kind}': not positively homogeneous" for kind, name in offenders]
    _raise_if_any(problems, source)
    return node


def spec_from_graph(graph: Graph) -> dict[str, Any]:
    """The spec of ``graph``, every field explicit: ``graph_from_spec`` of it gives an equal graph."""
    layers = []
    previous: str | None = None
    for node in graph.nodes:
        layers.append(spec_layer(node, previous))
        previous = node.name
    return {"format_version": FORMAT_VERSION, "layers": layers, "outputs": list(graph.outputs)}


def spec_layer(node: Node, previous: str | None = None) -> dict[str, Any]:
    """The spec layer of ``node``, every field explicit, which reads back as an equal node; ``inputs``
    is left out where the node reads ``previous`` alone (a layer reads the one before it by default)."""
    layer: dict[str, Any] = {"name": node.name, "type": node.op}
    if not isinstance(node, Input) and node.inputs != (previous,):
        layer["inputs"] = list(node.inputs)
    for field_name, value in node_attributes(node).items():
        layer[field_name] = list(value) if isinstance(value, tuple) else value
    return layer


def exporter_made_keys(graph: Graph) -> list[str]:
    """Tensor keys of ``graph`` that an ONNX exporter gave tensors it computed, which no
    module's state_dict has: TorchScript's constant folding names them ``onnx::Conv_114``;
    torch.export's optimiser names ``<weight key>_bias`` the bias of a BatchNorm it folds into
    a bias-free conv or Linear (and keeps the weight's key for the folded weight)."""
    keys = (key for node in graph.nodes for key in node.parameter_keys().values())
    return list(dict.fromkeys(key for key in keys if "::" in key or key.endswith(".weight_bias")))


def spec_warnings(graph: Graph, model_format: str, source: str, folded: Sequence[str] = ()) -> list[str]:
    """What the user of the spec of ``graph`` must know: that a spec read from an ONNX export
    whose exporter folded constants describes the folded network, not the module's checkpoint.

    ``folded`` are the tensors an exporter folded a BatchNorm into (see
    ``onnx_format.batchnorm_folded_tensors``). One that kept its state_dict name would let a
    checkpoint saved from the module match the spec by name but not by meaning: such a spec is
    refused (:class:`InputError`), naming the folded tensors (a long list: the first, and how many).
    """
    if model_format != "onnx":
        return []
    keys = {key for node in graph.nodes for key in node.parameter_keys().values()}
    made = exporter_made_keys(graph)
    renamed = set(made)
    folded_all = list(dict.fromkeys([*made, *(key for key in folded if key in keys)]))
    kept_names = [key for key in folded_all if key not in renamed]
    if kept_names:
        raise InputError(
            f"{source}: the exporter folded BatchNorm into the layer before it and kept the state_dict names of "
            f"{len(kept_names)} folded tensor(s) ({first_names(kept_names)}): a checkpoint saved from the module "
            f"would match this spec by name but not by meaning, so no spec is written. The {len(folded_all)} "
            f"tensor(s) whose values are the folded ones: {first_names(folded_all)}.",
            note="Get the spec from the module (pathcond spec CHECKPOINT --arch module:factory --input-shape ...), "
            "or from an export that keeps BatchNorm (torch.onnx.export(..., dynamo=False, "
            "do_constant_folding=False)).",
        )
    if not made:
        return []
    return [
        f"{source}: the spec reads {len(made)} tensor(s) that the exporter computed ({first_names(made)}), "
        "which the module's state_dict does not have: the exporter folded constants, such as a BatchNorm into the "
        "conv before it, so a checkpoint saved from the module does not match this spec. Get its spec from "
        "the module (pathcond spec CHECKPOINT --arch module:factory --input-shape ...) or from an export "
        "that keeps them (torch.onnx.export(..., dynamo=False, do_constant_folding=False))."
    ]


def spec_text(spec: Mapping[str, Any], *, as_json: bool = False) -> str:
    """A spec as a file's text: JSON, or YAML with one flow-style line per layer (as the docs
    write specs by hand); :func:`parse_spec_text` reads either back to ``spec``."""
    if as_json:
        return json.dumps(spec, indent=2, allow_nan=False) + "\n"

    def flow(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**31, allow_unicode=True).strip()

    lines = [f"format_version: {int(spec['format_version'])}", "layers:"]
    lines += [f"  - {flow(dict(layer))}" for layer in spec["layers"]]
    lines.append(f"outputs: {flow(list(spec['outputs']))}")
    return "\n".join(lines) + "\n"


def dump_spec(spec: Mapping[str, Any]) -> str:
    """Compact JSON of a spec (what pathcond embeds in checkpoint metadata)."""
    return json.dumps(spec, separators=(",", ":"), allow_nan=False)


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a spec file; JSON when its content starts with ``{``, YAML otherwise."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            raise InputError(f"{path}: not a regular file (a FIFO, device or socket), not an architecture spec file")
        size = info.st_size
        if size > MAX_SPEC_BYTES:
            raise InputError(f"{path}: an architecture spec of {size} bytes is refused (at most {MAX_SPEC_BYTES}).")
        text = path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not an architecture spec file") from None
    except FileNotFoundError:
        raise InputError(f"{path}: architecture spec file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the architecture spec: {exc}") from None
    return parse_spec_text(text, source=str(path))


def parse_spec_text(text: str, *, source: str) -> dict[str, Any]:
    """Parse spec text (JSON or YAML by content) into a mapping; ``source`` names it in errors.

    Limits keep a hostile spec cheap: at most :data:`MAX_SPEC_BYTES`, nesting at most
    :data:`MAX_SPEC_DEPTH` levels, and no YAML aliases (``*name``), whose expansion can make a
    500-byte file describe billions of elements.
    """
    if len(text) > MAX_SPEC_BYTES:
        raise InputError(
            f"{source}: an architecture spec of {len(text)} characters is refused (at most {MAX_SPEC_BYTES})."
        )
    try:
        if text.lstrip().startswith("{"):
            spec = parse_json(text, source, "the architecture spec")
        else:
            spec = _load_yaml(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: invalid JSON in the architecture spec: {_brief(str(exc), 300)}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: invalid YAML in the architecture spec: {_brief(str(exc), 500)}") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4300)
        raise InputError(
            f"{source}: a value in the architecture spec cannot be read: {_brief(str(exc), 300)}"
        ) from None
    if not isinstance(spec, dict):
        raise InputError(f"{source}: an architecture spec must be a mapping with a 'layers' list")
    return spec


# libyaml's loader where PyYAML has it: the pure-Python scanner took 0.6 ms a layer, most of a
# spec of 20,000 layers' loading.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_yaml(text: str) -> Any:
    """YAML read safely, refusing aliases and nesting deeper than :data:`MAX_SPEC_DEPTH`, which
    the parser's events show before anything is built."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML aliases (*name) are not allowed in an architecture spec; write the value out",
                event.start_mark,
            )
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(event, yaml.NodeEvent):
            if depth + 1 > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"the spec nests more than {MAX_SPEC_DEPTH} levels deep", event.start_mark
                )
            depth += isinstance(event, yaml.CollectionStartEvent)
    return yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader, aliases refused above


def _brief(value: Any, limit: int = 80) -> str:
    """``repr`` of a value from the spec (a string as is), cut so a message stays one paragraph."""
    text = value if isinstance(value, str) and limit > 80 else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _raise_if_any(problems: list[str], source: str) -> None:
    if problems:
        raise InputError(
            f"{source}: the architecture has {len(problems)} problem(s):", [_brief(p, 300) for p in problems]
        )


def _top_level(spec: Any, problems: list[str]) -> list[Any]:
    if not isinstance(spec, Mapping):
        problems.append("the spec must be a mapping with a 'layers' list")
        return []
    for key in spec:
        if key not in _TOP_LEVEL_KEYS:
            problems.append(f"unknown top-level key '{key}' (allowed: {', '.join(_TOP_LEVEL_KEYS)})")
    version = spec.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        problems.append(
            f"format_version {_brief(version)} is not supported (this pathcond reads version {FORMAT_VERSION})"
        )
    layers = spec.get("layers")
    if not isinstance(layers, list) or not layers:
        problems.append("'layers' must be a non-empty list of layers")
        return []
    return layers


def _outputs(spec: Any, last_layer: str | None, problems: list[str]) -> tuple[str, ...]:
    outputs = spec.get("outputs") if isinstance(spec, Mapping) else None
    if outputs is None:
        return () if last_layer is None else (last_layer,)
    names = _names(outputs)
    if names is None:
        problems.append("'outputs' must be a layer name or a list of layer names")
        return ()
    return names


def _names(value: Any) -> tuple[str, ...] | None:
    """A name or list of names as a tuple; None when it is neither."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        return None
    return tuple(items)


def _layer_name(layer: Any) -> str | None:
    name = layer.get("name") if isinstance(layer, Mapping) else None
    return name if isinstance(name, str) and name else None


def _parse_layer(
    index: int, layer: Any, previous: str | None, problems: list[str], offenders: list[tuple[str, str]]
) -> Node | None:
    """The node for one layer entry, or None after recording why it cannot be built (in
    ``offenders``, as ``(type, name)``, when its type is a known non-homogeneous function)."""
    if not isinstance(layer, Mapping):
        problems.append(f"layer #{index + 1} must be a mapping with 'name' and 'type', not {_brief(layer)}")
        return None
    name = _layer_name(layer)
    label = f"layer '{name}'" if name else f"layer #{index + 1}"
    if not name:
        problems.append(f"{label} needs a non-empty string 'name'")
    kind = layer.get("type")
    layer_type = LAYER_TYPES.get(kind) if isinstance(kind, str) else None
    if layer_type is None and name and isinstance(kind, str) and kind.lower() in NOT_HOMOGENEOUS_TYPES:
        offenders.append((kind, name))
        return None
    if layer_type is None:
        problems.append(f"{label} has unknown type {_brief(kind)} (known types: {', '.join(LAYER_TYPES)})")
        return None
    label = f"{label} ({kind})"
    count_before = len(problems)

    allowed = (*_COMMON_KEYS, *layer_type.hyper, *layer_type.keys, *layer_type.ignored)
    for key in layer:
        if key not in allowed:
            problems.append(f"{label}: unknown field '{key}' (allowed: {', '.join(allowed)})")

    values: dict[str, Any] = dict(layer_type.pinned)
    values["inputs"] = _layer_inputs(label, layer, layer_type, previous, problems)
    for key, spec_field in layer_type.hyper.items():
        if key not in layer:
            if spec_field.default is REQUIRED:
                problems.append(f"{label}: missing required field '{key}'")
            values[key] = spec_field.default
            continue
        try:
            values[key] = spec_field.convert(layer[key])
        except ItemError as exc:
            problems.append(f"{label}: '{key}' {exc}")
        except ValueError as exc:
            problems.append(f"{label}: '{key}' {exc}, got {_brief(layer[key])}")
    for role in layer_type.keys:
        values[role] = _tensor_key(label, layer, role, role in layer_type.nullable_keys, problems)
    if values.get("stride", ()) is None:
        values["stride"] = values.get("kernel")

    if len(problems) > count_before or not name:
        return None
    return layer_type.node(name=name, **values)


def _layer_inputs(
    label: str, layer: Mapping[str, Any], layer_type: _LayerType, previous: str | None, problems: list[str]
) -> tuple[str, ...]:
    if layer_type.node is Input:
        if "inputs" in layer:
            problems.append(f"{label}: an input layer takes no 'inputs'")
        return ()
    if "inputs" not in layer:
        if previous is None:
            problems.append(f"{label}: the first layer has no previous layer to read; give 'inputs'")
            return ()
        return (previous,)
    names = _names(layer["inputs"])
    if not names:
        problems.append(
            f"{label}: 'inputs' must be a layer name or a non-empty list of layer names, got {_brief(layer['inputs'])}"
        )
        return ()
    return names


def _arity_problem(node: Node) -> str | None:
    """What is wrong with the number of inputs a spec gives ``node``, None when its type takes that
    many: an ``add`` of one input is a wrong description (exit 3), not an unsupported network."""
    low, high = node.arity
    if low <= len(node.inputs) and (high is None or len(node.inputs) <= high):
        return None
    wanted = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
    return (
        f"layer '{node.name}' ({node.op}) reads {wanted} inputs, "
        f"and is given {len(node.inputs)}: {_brief(list(node.inputs))}"
    )


def _tensor_key(label: str, layer: Mapping[str, Any], role: str, nullable: bool, problems: list[str]) -> str | None:
    if role not in layer:
        return f"{layer.get('name')}.{role}"
    key = layer[role]
    if key is None and nullable:
        return None
    if not (isinstance(key, str) and key):
        null_hint = " or null" if nullable else ""
        problems.append(f"{label}: '{role}' must be a tensor key{null_hint}, got {_brief(key)}")
    return key


def _with_input_shape(nodes: list[Node], input_shape: Any, source: str, problems: list[str]) -> list[Node]:
    inputs = [n for n in nodes if isinstance(n, Input)]
    given = shapes_by_input(input_shape, [n.name for n in inputs], source)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in given.items():
        try:
            shapes[name] = ints(1)(shape)
        except ValueError as exc:
            problems.append(f"the input shape {exc}, got {_brief(shape)}")
    for node in inputs:
        if node.name in shapes and node.shape is not None and len(node.shape) != len(shapes[node.name]):
            raise UsageError(
                f"{source}: the input shape {shapes[node.name]} has {len(shapes[node.name])} dimension(s), but "
                f"layer '{node.name}' (input) has shape {node.shape}, with {len(node.shape)} (the shape is batch-free)."
            )
    nodes = [replace(n, shape=shapes[n.name]) if isinstance(n, Input) and n.name in shapes else n for n in nodes]
    for node in nodes:
        if isinstance(node, Input) and node.shape is None:
            problems.append(
                f"layer '{node.name}' (input) needs a 'shape' (batch-free, e.g. [3, 32, 32]), "
                "in the spec or from --input-shape"
            )
    return nodes


def _expand_per_axis_fields(graph: Graph, problems: list[str], input_problems: list[str]) -> list[Node]:
    """The graph's nodes with scalar per-axis fields repeated to their input's spatial rank;
    rank problems of layers reading an input layer go to ``input_problems``."""
    ranks: dict[str, int] = {}
    expanded: list[Node] = []
    for node in graph.nodes:
        rank = ranks[node.inputs[0]] if node.inputs else 0
        ranks[node.name] = node.output_spatial_rank(rank)
        reads_input = bool(node.inputs) and isinstance(graph[node.inputs[0]], Input)
        expanded.append(_expand_node(node, rank, reads_input, input_problems if reads_input else problems))
    return expanded


def _expand_node(node: Node, rank: int, reads_input: bool, problems: list[str]) -> Node:
    label = f"layer '{node.name}' ({node.op})"
    accepted = node.input_spatial_ranks
    if accepted is not None and rank not in accepted:
        if accepted == (0,) and reads_input:
            problems.append(
                f"{label} takes features, but input '{node.inputs[0]}' has {rank} spatial axes: "
                "leave the batch dimension out of its shape (for 8 features: 8, not 1,8), or put a "
                "flatten layer before the layer"
            )
        elif accepted == (0,):
            problems.append(
                f"{label} reads '{node.inputs[0]}', which has {rank} spatial axes; put a flatten layer before it"
            )
        else:
            shown = " or ".join(filter(None, [", ".join(map(str, accepted[:-1])), str(accepted[-1])]))
            problems.append(f"{label} needs an input with {shown} spatial axes, but '{node.inputs[0]}' has {rank}")
        return node
    changes = {}
    for name in node.per_axis_fields:
        value = getattr(node, name)
        if len(value) == 1:
            changes[name] = value * rank
        elif len(value) != rank:
            problems.append(f"{label}: '{name}' has {len(value)} values, but its input has {rank} spatial axes")
    return replace(node, **changes)
