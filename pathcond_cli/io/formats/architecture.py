"""The architecture of a safetensors checkpoint, which holds tensors but none: resolved in a fixed
order and never guessed. ``--arch`` (a spec file or a Python factory) first, then the spec
pathcond embeds in every file it writes (metadata key :data:`SPEC_METADATA_KEY`), then a sidecar
spec beside the checkpoint. Then the checkpoint's tensors are checked against it: every tensor it
reads present, none left unused. Reading and writing the tensors is :mod:`.safetensors_format`'s."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...engine.graph import Graph
from ...errors import InputError, InvalidWeightsError
from ..companions import checkpoint_stem
from .common import KEYS_SHOWN, InputShape, contained_file, shown, some_keys
from .factory import factory_source_files, graph_from_factory
from .spec import SPEC_SUFFIXES, graph_from_spec, load_spec_file, parse_spec_text

SPEC_METADATA_KEY = "pathcond.spec"


def architecture_files(path: Path | None, arch: str | None) -> list[Path]:
    """The files resolving the architecture of the checkpoint at ``path`` (None for stdin) with
    ``--arch arch`` may read, known before loading: the spec file, the Python source of a factory,
    or, when ``arch`` is not given, the sidecar specs beside it (whether or not the embedded spec
    makes reading one unnecessary). Never raises."""
    if arch is not None and arch.lower().endswith(SPEC_SUFFIXES):
        return [Path(arch)]
    if arch is not None and ":" in arch:
        return factory_source_files(arch)
    if arch is None and path is not None:
        return [candidate for candidate in sidecar_candidates(path) if os.path.lexists(candidate)]
    return []


def sidecar_candidates(checkpoint: Path) -> list[Path]:
    """Where a spec for ``checkpoint`` is looked for, in order."""
    stem = checkpoint_stem(checkpoint.name)
    names = [f"{stem}.pathcond{suffix}" for suffix in SPEC_SUFFIXES] + [f"{stem}{suffix}" for suffix in SPEC_SUFFIXES]
    return [checkpoint.with_name(n) for n in names if n != checkpoint.name]


def resolve_architecture(
    arch: str | None,
    path: Path | None,
    metadata: Mapping[str, Any],
    input_shape: InputShape | None,
    display: str,
    params: Mapping[str, torch.Tensor],
) -> tuple[Graph, str, Path | None, list[str], frozenset[str]]:
    """The graph, where it came from (``--arch ...``, ``metadata``, ``sidecar FILE``), the spec
    file it was read from (None when embedded or a factory), a factory's import notes, and the
    keys of the checkpoint tensors (``params``) it reads as constants (a factory's filter
    buffers: see :func:`graph_from_factory`)."""
    if arch is not None:
        graph, notes, constants = _graph_from_arch(arch, input_shape, params, display)
        return graph, f"--arch {arch}", Path(arch) if arch.lower().endswith(SPEC_SUFFIXES) else None, notes, constants
    embedded = metadata.get(SPEC_METADATA_KEY)
    if embedded is not None:
        source = f"{display} (metadata '{SPEC_METADATA_KEY}')"
        if not isinstance(embedded, str):
            raise InputError(f"{source}: expected the spec as a JSON string")
        graph = graph_from_spec(parse_spec_text(embedded, source=source), source=source, input_shape=input_shape)
        return graph, "metadata", None, [], frozenset()
    candidates = sidecar_candidates(path) if path is not None else []
    for candidate in candidates:
        if candidate.is_file():
            candidate = contained_file(candidate.parent, candidate.name, display, "the sidecar spec")
            graph = graph_from_spec(load_spec_file(candidate), source=str(candidate), input_shape=input_shape)
            return graph, f"sidecar {candidate}", candidate, [], frozenset()
    raise InputError(_no_architecture_message(display, candidates))


def _graph_from_arch(
    arch: str, input_shape: InputShape | None, params: Mapping[str, torch.Tensor], display: str
) -> tuple[Graph, list[str], frozenset[str]]:
    """The graph of a spec file or a factory, the factory's import notes and the keys it reads as constants."""
    if arch.lower().endswith(SPEC_SUFFIXES):
        return graph_from_spec(load_spec_file(arch), source=arch, input_shape=input_shape), [], frozenset()
    if ":" in arch:
        return graph_from_factory(arch, input_shape, params, display)
    raise InputError(
        f"--arch '{arch}': expected a spec file (.yaml, .yml, .json) or a Python factory module.path:callable"
    )


def _no_architecture_message(display: str, candidates: list[Path]) -> str:
    sidecars = (
        f"sidecar spec files {', '.join(str(c) for c in candidates)}: none exists"
        if candidates
        else "sidecar spec files: none, the checkpoint was not given as a file"
    )
    return (
        f"{display}: no architecture found for this checkpoint. Searched, in order:\n"
        "  - --arch: not given\n"
        f"  - the checkpoint metadata key '{SPEC_METADATA_KEY}': absent\n"
        f"  - {sidecars}\n"
        "Pass --arch ARCH.yaml (a layer spec, see docs/spec-format.md) or --arch module.path:callable "
        "(a Python factory returning the torch.nn.Module, with --input-shape)."
    )


# Missing weights a mismatch hint names: enough to recognise another model's names.
MISSING_WEIGHTS_SHOWN = 3


def check_parameters(graph: Graph, params: Mapping[str, torch.Tensor], display: str, *, from_factory: bool) -> None:
    """``graph.check_parameters`` with the checkpoint named, and what the missing tensors most
    likely mean (``from_factory``: the graph is a factory's module's, not a spec's)."""
    try:
        graph.check_parameters(params)
    except (InvalidWeightsError, InputError) as exc:
        # A checkpoint with no tensor the architecture names is refused without problems listed:
        # it already says so.
        hint = _mismatch_hint(graph, params, from_factory) if exc.problems else exc.note
        raise type(exc)(f"{display}: {exc.message}", exc.problems, hint or exc.note) from None


def _mismatch_hint(graph: Graph, params: Mapping[str, torch.Tensor], from_factory: bool) -> str | None:
    """Why the architecture reads tensors the checkpoint lacks: another model's checkpoint when a
    tensor other than a bias is missing or most names do not match; else layers whose bias the
    checkpoint does not hold, beside BatchNorm statistics nothing reads (a spec from an ONNX
    export that folded them, or a factory building another variant) or not."""
    wanted = set(graph.parameter_keys())
    matched = len(wanted & params.keys())
    missing_required = [
        key
        for node in graph.nodes
        for role, key in node.parameter_keys().items()
        if key not in params and role not in node.optional_roles
    ]
    if missing_required or 2 * matched < len(wanted):
        route = "the factory's module" if from_factory else "the spec"
        examples = ", ".join(f"'{shown(key)}'" for key in missing_required[:MISSING_WEIGHTS_SHOWN])
        lacks = f", and lacks {len(missing_required)} that are no bias, such as {examples}" if missing_required else ""
        return (
            f"(the checkpoint holds {matched} of the {len(wanted)} tensors {route} reads{lacks}: it was probably "
            f"saved from another model than {route} describes; check that the architecture passed is this "
            "checkpoint's)"
        )
    missing_biases = [
        node.name
        for node in graph.nodes
        if "bias" in node.optional_roles and node.bias is not None and node.bias not in params
    ]
    if not missing_biases:
        return None
    folded = any(key.endswith("running_mean") and key not in wanted for key in params)
    if from_factory:
        remedy = (
            "the checkpoint holds BatchNorm statistics the module does not read: it was probably saved "
            "from another variant of the model (a BatchNorm after each conv without bias); check the "
            "factory's arguments"
            if folded
            else "the checkpoint was probably saved from another variant "
            "of the model (layers built with bias=False); check the factory's arguments"
        )
    else:
        remedy = (
            "the checkpoint holds BatchNorm statistics that the architecture does not read, as in a spec "
            "written from an ONNX export that folded each BatchNorm into its conv's weight and bias: take "
            "the spec from the module instead (pathcond spec CHECKPOINT --arch module:factory "
            "--input-shape ...)"
            if folded
            else "a layer without bias needs 'bias: null' in the spec"
        )
    return f"({len(missing_biases)} layer(s) have no bias tensor: {some_keys(set(missing_biases))}; {remedy})"


def unused_tensors(
    graph: Graph, params: Mapping[str, torch.Tensor], display: str, constants: frozenset[str] = frozenset()
) -> str:
    """A paragraph naming the checkpoint tensors the architecture does not read ('' if none),
    neither as parameters nor as the ``constants`` it holds, grouped by the layer they most
    likely belong to."""
    used = set(graph.parameter_keys()) | constants
    # BatchNorm's num_batches_tracked only counts training steps: never part of the function.
    unused = sorted(k for k in params if k not in used and not k.endswith("num_batches_tracked"))
    if not unused:
        return ""
    by_layer: dict[str, list[str]] = {}
    for key in unused:
        by_layer.setdefault(key.rpartition(".")[0], []).append(key)
    lines = []
    for layer, keys in list(by_layer.items())[:KEYS_SHOWN]:
        lines.append(f"  - {some_keys(set(keys))}: {_likely_owner(graph, layer, keys)}")
    if len(by_layer) > KEYS_SHOWN:
        lines.append(f"  - and the tensors of {len(by_layer) - KEYS_SHOWN} more layer(s)")
    return f"{display}: {len(unused)} checkpoint tensor(s) are not used by the architecture:\n" + "\n".join(lines)


def _likely_owner(graph: Graph, layer: str, keys: list[str]) -> str:
    names = [node.name for node in graph.nodes]
    if not layer:
        return "top-level names that no layer of the architecture reads"
    if layer in names:
        return f"layer '{shown(layer)}' ({graph[layer].op}) exists but does not read them"
    roles = {key.rpartition(".")[2] for key in keys}
    kind = "a batchnorm layer" if roles & {"running_mean", "running_var"} else "a layer"
    close = difflib.get_close_matches(layer, names, n=1)
    near = f"; the closest layer name is '{shown(close[0])}'" if close else ""
    return f"probably {kind} '{shown(layer)}' that the architecture lacks{near}"
