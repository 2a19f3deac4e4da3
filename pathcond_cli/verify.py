"""Does the rescaled network compute the original function? Measured, never assumed."""

from __future__ import annotations

import copy
import math
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .engine.calibration import outputs_ignore_input
from .engine.evaluate import forward
from .engine.graph import BatchNorm, Graph
from .engine.layouts import layout_of
from .engine.model import LoadedModel
from .errors import VerificationError
from .io.fileio import interrupts_deferred
from .io.formats import exception_line

# A rescaled ONNX model run by onnxruntime/onnx.reference in its own float type is compared
# with the original run the same way; never tighter than this (float32 kernels differ by ULPs).
INDEPENDENT_MIN_TOLERANCE = 1e-4
# onnx.reference evaluates in Python: beyond this many stored elements it is too slow to wait for.
REFERENCE_EVALUATOR_MAX_ELEMENTS = 2_000_000

LARGE_INPUT = 16384

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# A mode whose error exceeds the dtype's tolerance still passes within this many times the
# network's own sensitivity to one rounding of the rescaled tensors (see _rounding_floor).
ROUNDING_MARGIN = 10.0

# run(overrides, train) -> outputs, with ``overrides`` replacing checkpoint tensors (None: none).
Runner = Callable[[Mapping[str, torch.Tensor] | None, bool], list[torch.Tensor]]


@dataclass
class Verification:
    """Largest output differences between original and rescaled networks on random inputs.

    The relative error is the absolute error divided by the largest original output
    magnitude (per output). Each mode passes when its error is within the coarsest parameter
    dtype's tolerance, or within ``ROUNDING_MARGIN`` times what one rounding of the rescaled
    tensors to their dtype does to that network's outputs (train-mode BatchNorm over a small
    batch can amplify rounding far beyond the dtype's tolerance: no rescaled checkpoint in
    that dtype could do better). ``errors`` and ``tolerances`` are per mode; ``tolerance`` is
    the largest one used. ``independent`` is the check of the written file by another runtime
    (see :func:`independent_check`), None when no file was written. ``original_ignores_input``:
    whether the original's eval-mode outputs were the same for every input of the batch (the
    calibration check's question, answered by the run the comparison makes anyway).
    """

    max_abs_error: float
    max_rel_error: float
    tolerance: float
    modes: tuple[str, ...]
    independent: dict[str, Any] | None = None
    errors: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    original_ignores_input: bool = False

    @property
    def passed(self) -> bool:
        if self.errors:
            return all(self.errors[mode] <= self.tolerances[mode] for mode in self.errors)
        return self.max_rel_error <= self.tolerance


def tolerance_for(params: Mapping[str, torch.Tensor], keys: list[str]) -> float:
    """The loosest tolerance of the parameters' dtypes; float32's for a network without any (it
    computes in the input's dtype, and nothing of it was changed)."""
    return max((TOLERANCE.get(layout_of(params, k)[1], 1e-5) for k in keys), default=TOLERANCE[torch.float32])


def compare(
    graph: Graph,
    original: Mapping[str, torch.Tensor],
    rescaled: Mapping[str, torch.Tensor],
    *,
    batch: int | None = None,
    seed: int = 0,
    rescaled_graph: Graph | None = None,
) -> Verification:
    """Run both parameter sets on the same random float64 inputs, in eval mode and, when the
    network has BatchNorm (each with eps > 0), in train mode (batch statistics) too.

    ``rescaled_graph`` is the graph read back from a written file, run with ``rescaled`` (all
    of its tensors): a file whose graph reads a tensor differently from the original (a
    factor shared with a weight) is then measured as it is, not as the original graph reads it.

    The default batch is 8, or 2 for inputs of more than 16384 elements (ImageNet-sized
    images), where float64 convolutions dominate the run time.
    """
    if batch is None:
        batch = 2 if max(math.prod(n.shape) for n in graph.inputs) > LARGE_INPUT else 8
    generator = torch.Generator().manual_seed(seed)
    inputs = {n.name: torch.randn((batch, *n.shape), generator=generator, dtype=torch.float64) for n in graph.inputs}
    # torch computes no train-mode BatchNorm with eps = 0 (a channel's batch variance may be 0).
    train = any(isinstance(n, BatchNorm) for n in graph.nodes) and all(
        n.eps > 0 for n in graph.nodes if isinstance(n, BatchNorm)
    )
    modes = ("eval", "train") if train else ("eval",)
    # Keys only, found when the rounding floor needs them (each comparison reads both tensors):
    # each tensor is looked up when a run reads it, so a mapped or computed-when-read
    # ``rescaled`` is never held whole.
    changed = _Selected(
        rescaled, lambda: [key for key in rescaled if key in original and _differs(key, original, rescaled)]
    )

    def run(overrides: Mapping[str, torch.Tensor] | None, train: bool) -> list[torch.Tensor]:
        # The rescaled tensors themselves (not the rounding floor's) run on the written graph;
        # those ``rescaled`` holds equal to the original's run the same either way.
        written = rescaled_graph is not None and overrides is changed
        if overrides is changed:
            params = rescaled if written else ChainMap(rescaled, original)
        else:
            params = ChainMap(overrides, original) if overrides else original
        network = rescaled_graph if written else graph
        with torch.no_grad():
            outputs = forward(network, params, inputs, train=train)
        return [outputs[name] for name in network.outputs]

    return _measure(run, original, changed, modes, tolerance_for(rescaled, graph.parameter_keys()), seed)


def _differs(key: str, original: Mapping[str, torch.Tensor], rescaled: Mapping[str, torch.Tensor]) -> bool:
    # A function, so that both tensors are let go before the next key's are read.
    return not torch.equal(rescaled[key], original[key])


class _Selected(Mapping[str, torch.Tensor]):
    """The tensors of ``tensors`` under the keys ``select()`` lists (asked once, when first
    needed), each looked up when read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], select: Callable[[], list[str]]):
        self._tensors, self._select = tensors, select

    @cached_property
    def _keys(self) -> dict[str, None]:
        return dict.fromkeys(self._select())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._tensors[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _measure(
    run: Runner,
    original: Mapping[str, torch.Tensor],
    changed: Mapping[str, torch.Tensor],
    modes: tuple[str, ...],
    tolerance: float,
    seed: int,
) -> Verification:
    """Errors of the ``changed`` tensors against the original, mode by mode (see :class:`Verification`)."""
    max_abs = max_rel = 0.0
    errors: dict[str, float] = {}
    tolerances: dict[str, float] = {}
    rounded: dict[str, torch.Tensor] | None = None
    ignores_input = False
    for mode in modes:
        train = mode == "train"
        before = run(None, train)
        ignores_input = ignores_input or (mode == "eval" and outputs_ignore_input(before))
        if not all(bool(torch.isfinite(t).all()) for t in before):
            raise VerificationError(
                f"the original network's outputs are not finite ({mode} mode, on standard normal inputs): it "
                "overflows float64 by itself (a constant factor or weights too large?), so no rescaling can be "
                "verified to compute the same function. Nothing was written."
            )
        mode_abs, mode_rel = _max_errors(before, run(changed, train))
        limit = tolerance
        if math.isfinite(mode_rel) and mode_rel > tolerance:
            rounded = rounded if rounded is not None else _rounding_floor(original, changed, seed)
            floor = _max_errors(before, run(rounded, train))[1]
            limit = max(tolerance, ROUNDING_MARGIN * floor) if math.isfinite(floor) else tolerance
        errors[mode], tolerances[mode] = mode_rel, limit
        max_abs, max_rel = max(max_abs, mode_abs), max(max_rel, mode_rel)
    return Verification(
        max_abs,
        max_rel,
        max(tolerances.values()),
        modes,
        errors=errors,
        tolerances=tolerances,
        original_ignores_input=ignores_input,
    )


def _rounding_floor(
    original: Mapping[str, torch.Tensor], changed: Mapping[str, torch.Tensor], seed: int
) -> dict[str, torch.Tensor]:
    """The original tensors of ``changed``, each element moved by one rounding error of the
    rescaled tensor's dtype (relative ±u, random signs, in float64): what merely storing a
    rescaled checkpoint in that dtype can do, whatever the rescaling."""
    generator = torch.Generator().manual_seed(seed + 1)
    moved = {}
    for key, tensor in changed.items():
        unit = torch.finfo(tensor.dtype).eps / 2
        signs = torch.randint(0, 2, tensor.shape, generator=generator, dtype=torch.float64) * 2 - 1
        moved[key] = original[key].to(torch.float64) * (1 + unit * signs.to(original[key].device))
    return moved


def _max_errors(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[float, float]:
    if len(before) != len(after) or any(b.shape != a.shape for b, a in zip(before, after)):
        return math.inf, math.inf  # not the same outputs: nothing to compare them by
    max_abs = max_rel = 0.0
    for b, a in zip(before, after):
        if not (bool(torch.isfinite(b).all()) and bool(torch.isfinite(a).all())):
            return math.inf, math.inf
        diff = float((b - a).abs().max()) if b.numel() else 0.0
        scale = float(b.abs().max()) if b.numel() else 0.0
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale > 0 else diff)
    return max_abs, max_rel


def _output_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _output_tensors(item)]
    return []


def compare_modules(
    module: torch.nn.Module, changed: Mapping[str, torch.Tensor], input_shape: tuple[int, ...], *, seed: int = 0
) -> Verification:
    """Run the user's module against a copy holding the ``changed`` tensors, both in float64
    (each copy is made float64 before the tensors are put in, so nothing is rounded again).

    Both are deep copies, so the module itself (its running statistics, its mode) is never
    touched. Modes: eval, and train too when the module has BatchNorm layers (each with eps > 0).
    """
    device = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
    batch = 2 if math.prod(input_shape) > LARGE_INPUT else 8
    x = torch.randn((batch, *input_shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        device
    )
    batchnorms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    modes = ("eval", "train") if batchnorms and all(m.eps > 0 for m in batchnorms) else ("eval",)
    copies: dict[int, torch.nn.Module] = {}

    def run(overrides: Mapping[str, torch.Tensor] | None, train: bool) -> list[torch.Tensor]:
        if id(overrides) not in copies:
            replica = copy.deepcopy(module).to(torch.float64)
            state = replica.state_dict()
            with torch.no_grad():
                for key, tensor in (overrides or {}).items():
                    state[key].copy_(tensor)
            copies[id(overrides)] = replica
        replica = copies[id(overrides)]
        _batchnorm_mode(replica, train=train)
        with torch.no_grad():
            return _output_tensors(replica(x))

    state = module.state_dict()
    keys = [k for k, t in state.items() if t.is_floating_point()]
    return _measure(run, state, changed, modes, tolerance_for(state, keys or list(changed)), seed)


def _batchnorm_mode(module: torch.nn.Module, *, train: bool) -> None:
    """Eval mode, with only the BatchNorm layers in train mode (batch statistics) when ``train``.

    Dropout and other random layers stay in eval mode: two copies would draw different masks,
    and no rescaling could make them agree.
    """
    module.eval()
    for layer in module.modules():
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
            layer.train(train)


def independent_check(model: LoadedModel, written: Path, tolerance: float, *, seed: int = 1) -> dict[str, Any]:
    """Run the original and the written model in a runtime that is not pathcond's.

    onnxruntime when installed and able to evaluate the original; else onnx.reference (for a
    kernel onnxruntime lacks, such as float64 Conv). Every input is fed, with one batch size
    for all: the first one an input declares (1 when all are symbolic). Returns
    ``{"runtime", "status", "detail"}`` with status
    ``passed``; ``failed`` when the runtime that evaluates the original finds a difference, or
    cannot load or evaluate the written file; or ``unavailable`` when no runtime can evaluate
    the original (reported, never fatal).

    A file with pre- and post-processing runs end to end, and the runtime also fetches the
    values the DAG outputs (what post-processing reads): those are compared. Post-processing
    is carried unchanged, so its outputs are a fixed function of them; one of its outputs that
    differs while they agree (an ArgMax between two values that agree to the tolerance) is a
    near-tie, reported, not a failure. When the file lacks one of those values (one only the
    model as converted to another opset has), the file's outputs are compared end to end, and
    the detail says so.
    """
    if model.format != "onnx":
        return _no_independent_runtime(model)
    runners, why_not = _onnx_runners(model)
    feeds = _random_feeds(model, seed)
    fetched = _dag_outputs_fetched(model)
    unfetchable = _not_in_file(model.payload, fetched)
    if unfetchable:
        fetched = ()
    # The original as the user holds it: its own file when it came from one (the in-memory
    # model may carry initializers split for reading), else the bytes it was read from.
    if fetched:
        original = (_fetching(model.files[0] if model.files else model.payload, fetched)[0], None)
        updated = (_fetching(written, fetched)[0], None)
    else:
        original = (None, model.files[0]) if model.files else (model.payload.SerializeToString(), None)
        updated = (None, written)
    runtime, runner, before, reasons = _first_that_runs(runners, lambda runner: runner(*original, feeds), "original")
    if runner is None:
        return _unavailable(runners, why_not, reasons)
    try:
        after = runner(*updated, feeds)
    except Exception as exc:  # noqa: BLE001 - it evaluates the original: the written file is at fault
        return {
            "runtime": runtime,
            "status": "failed",
            "detail": f"it evaluates the original model but cannot load or evaluate the written one "
            f"({exception_line(exc)})",
        }
    before, after = ([torch.from_numpy(np.asarray(t, dtype=np.float64)) for t in ts] for ts in (before, after))
    limit = max(tolerance, INDEPENDENT_MIN_TOLERANCE)
    if fetched:
        # The file's outputs come first, then the values fetched that are not among them.
        position = {name: i for i, name in enumerate(_output_names(model, fetched))}
        dag = [position[value] for value in fetched]
        max_rel = _max_errors([before[i] for i in dag], [after[i] for i in dag])[1]
        detail = (
            f"max relative difference {max_rel:.3g} between the values the DAG outputs in original and "
            f"written model (tolerance {limit:g})"
        )
        files = len(model.payload.graph.output)
        detail += _near_ties(before[:files], after[:files], limit)
    else:
        max_rel = _max_errors(before, after)[1]
        detail = f"max relative difference {max_rel:.3g} between original and written model (tolerance {limit:g})"
        if unfetchable:
            detail += (
                f", their outputs compared end to end: the values the DAG outputs "
                f"({_listed(unfetchable)}) exist only in the model as pathcond converted it to read it, "
                "not in the file"
            )
    status = "passed" if max_rel <= limit else "failed"
    return {"runtime": runtime, "status": status, "detail": detail + "".join(f"; {reason}" for reason in reasons)}


def _not_in_file(proto: Any, values: tuple[str, ...]) -> list[str]:
    """The ``values`` that the ONNX model ``proto`` neither takes as input nor computes nor stores."""
    graph = proto.graph
    present = (
        {out for node in graph.node for out in node.output}
        | {v.name for v in graph.input}
        | {t.name for t in graph.initializer}
    )
    return [value for value in dict.fromkeys(values) if value not in present]


def _listed(values: list[str]) -> str:
    more = f" and {len(values) - 5} more" if len(values) > 5 else ""
    return ", ".join(f"'{value[:120]}'" for value in values[:5]) + more


def _dag_outputs_fetched(model: LoadedModel) -> tuple[str, ...]:
    """The values of the file a runtime fetches besides its outputs: those the DAG outputs, when
    post-processing follows it (otherwise the file's outputs are the DAG's)."""
    return model.carried.dag_outputs if model.carried.post else ()


def _near_ties(before: list[torch.Tensor], after: list[torch.Tensor], limit: float) -> str:
    """What the file's own outputs say, computed by unchanged post-processing from values that agree."""
    differing = [i for i, (b, a) in enumerate(zip(before, after)) if _max_errors([b], [a])[1] > limit]
    if not differing:
        return "; the file's outputs agree too"
    elements = sum(int((before[i] != after[i]).sum()) for i in differing)
    return (
        f"; {elements} element(s) of the file's output(s) {', '.join(str(i) for i in differing)} differ, computed "
        "by unchanged post-processing from values that agree: near-ties (e.g. an ArgMax between nearly equal "
        "values)"
    )


def _fetching(source: Path | Any, values: tuple[str, ...]) -> tuple[bytes, list[str]]:
    """The ONNX model at ``source`` (a path or a ModelProto) that also outputs ``values``,
    serialised, and the names of its outputs in order."""
    import onnx

    proto = onnx.ModelProto()
    proto.CopyFrom(source if isinstance(source, onnx.ModelProto) else onnx.load(str(source)))
    outputs = [o.name for o in proto.graph.output]
    extra = [value for value in dict.fromkeys(values) if value not in outputs]
    proto.graph.output.extend(onnx.ValueInfoProto(name=value) for value in extra)
    return proto.SerializeToString(), outputs + extra


def _output_names(model: LoadedModel, values: tuple[str, ...]) -> list[str]:
    """The outputs of :func:`_fetching`'s model, from the model's own outputs, without serialising it."""
    outputs = [o.name for o in model.payload.graph.output]
    return outputs + [value for value in dict.fromkeys(values) if value not in outputs]


def independent_agreement(written: LoadedModel, path: Path, *, seed: int = 1) -> dict[str, Any]:
    """Run the written ONNX file in a runtime that is not pathcond's and compare its outputs with
    pathcond's own evaluation of the model read back from it (a changed function has no original
    to compare with: this checks that the file loads and means what pathcond reads in it).
    Returns ``{"runtime", "status", "detail"}`` as :func:`independent_check` does."""
    if written.format != "onnx":
        return _no_independent_runtime(written)
    runners, why_not = _onnx_runners(written)
    feeds = _random_feeds(written, seed)
    # With pre- or post-processing, the runtime also fetches the DAG's inputs and outputs, and
    # pathcond's DAG runs on the inputs it fetched.
    carried = written.carried
    dag_inputs = tuple(carried.dag_inputs.values())
    fetched = (*dag_inputs, *carried.dag_outputs) if carried else ()
    unfetchable = _not_in_file(written.payload, fetched)
    if unfetchable:
        return _runs_only(runners, why_not, path, feeds, unfetchable)
    data, names = _fetching(path, fetched) if fetched else (None, [])
    file = None if fetched else path
    tolerance = max(tolerance_for(written.params, written.graph.parameter_keys()), INDEPENDENT_MIN_TOLERANCE)
    runtime, runner, theirs, reasons = _first_that_runs(runners, lambda runner: runner(data, file, feeds), "written")
    if runner is None:
        return _unavailable(runners, why_not, reasons)
    theirs = [torch.from_numpy(np.asarray(t, dtype=np.float64)) for t in theirs]
    if fetched:
        dag_values = dict(zip(names, theirs))
        fed = {name: dag_values[value] for name, value in carried.dag_inputs.items()}
        theirs = [dag_values[value] for value in carried.dag_outputs]
    else:
        fed = {name: torch.from_numpy(value.astype(np.float64)) for name, value in feeds.items()}
    with torch.no_grad():
        ours = forward(written.graph, written.params, fed)
    expected = [ours[name] for name in written.graph.outputs]
    if [tuple(t.shape) for t in theirs] != [tuple(t.shape) for t in expected]:
        return {
            "runtime": runtime,
            "status": "failed",
            "detail": f"its outputs have shapes {[list(t.shape) for t in theirs]}, pathcond's "
            f"{[list(t.shape) for t in expected]}",
        }
    _, max_rel = _max_errors(expected, theirs)
    status = "passed" if max_rel <= tolerance else "failed"
    return {
        "runtime": runtime,
        "status": status,
        "detail": f"max relative difference {max_rel:.3g} between {runtime} and pathcond on the written "
        f"model (tolerance {tolerance:g})" + "".join(f"; {reason}" for reason in reasons),
    }


def _runs_only(
    runners: list[tuple[str, Callable]], why_not: str, path: Path, feeds: dict[str, Any], unfetchable: list[str]
) -> dict[str, Any]:
    """What a runtime says of a written file whose DAG values it cannot fetch: that it runs it,
    its agreement with pathcond unchecked (unavailable, and why)."""
    runtime, runner, _, reasons = _first_that_runs(runners, lambda runner: runner(None, path, feeds), "written")
    if runner is None:
        return _unavailable(runners, why_not, reasons)
    return {
        "runtime": runtime,
        "status": "unavailable",
        "detail": f"{runtime} runs the written model, but "
        f"the values the DAG reads and outputs ({_listed(unfetchable)}) exist only in the model as "
        "pathcond converted it to read it, not in the file, so its agreement with pathcond's "
        "evaluation was not checked" + "".join(f"; {reason}" for reason in reasons),
    }


def _first_that_runs(
    runners: list[tuple[str, Callable]], attempt: Callable[[Callable], Any], which: str
) -> tuple[str | None, Callable | None, Any, list[str]]:
    """The runtimes in turn until ``attempt(runner)`` succeeds: that one's name, runner and what
    the attempt returned (None, None, None when none succeeds), and why each one before it
    failed to evaluate the ``which`` model."""
    reasons = []
    for runtime, runner in runners:
        try:
            return runtime, runner, attempt(runner), reasons
        except Exception as exc:  # noqa: BLE001 - a third-party runtime fails in its own ways: try the next
            reasons.append(f"{runtime} cannot evaluate the {which} model ({exception_line(exc)})")
    return None, None, None, reasons


def _unavailable(runners: list[tuple[str, Callable]], why_not: str, reasons: list[str]) -> dict[str, Any]:
    """No runtime evaluated the model: why, runtime by runtime, and why one is missing."""
    reasons = reasons + ([why_not] if why_not else [])
    return {"runtime": runners[-1][0] if runners else None, "status": "unavailable", "detail": "; ".join(reasons)}


def _no_independent_runtime(model: LoadedModel) -> dict[str, Any]:
    return {
        "runtime": None,
        "status": "unavailable",
        "detail": f"no independent runtime reads {model.format} checkpoints; the reloaded file was "
        "checked by pathcond's own evaluator",
    }


def _random_feeds(model: LoadedModel, seed: int) -> dict[str, Any]:
    """A random array for every input an ONNX model's caller feeds, in its declared element type,
    with one batch size for all: the first one an input declares (1 when all are symbolic)."""
    # onnx is imported for ONNX models only: a safetensors run stays without its memory (6 MiB and more).
    import onnx

    from .io.formats.onnx_format import declared_batch, fed_inputs

    graph_inputs = fed_inputs(model.payload, model.source)
    batch = declared_batch(graph_inputs) or 1
    generator = np.random.default_rng(seed)
    # The importer names each input node after its ONNX input; with pre- or post-processing
    # the file's inputs need not be the DAG's, and the model keeps their shapes.
    shapes = model.carried.inputs or {i.name: model.graph[i.name].shape for i in graph_inputs}
    return {
        i.name: generator.standard_normal((batch, *shapes[i.name])).astype(
            onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        )
        for i in graph_inputs
    }


def _onnx_runners(model: LoadedModel) -> tuple[list[tuple[str, Callable]], str]:
    """The runtimes to try, in order, as (name, run(model_bytes, model_path, feeds) -> outputs),
    ``feeds`` an array by input name, and why one is missing ("" when none is)."""
    runners: list[tuple[str, Callable]] = []
    try:
        with interrupts_deferred():
            import onnxruntime
    except ImportError:
        onnxruntime = None
    if onnxruntime is not None:

        def run_ort(data, path, feeds):
            options = onnxruntime.SessionOptions()
            options.log_severity_level = 3
            # The graph as written, without fusions: the model the file holds is what is checked,
            # and on a large model the session is built in a third of the time.
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
            session = onnxruntime.InferenceSession(
                data if data is not None else str(path), options, providers=["CPUExecutionProvider"]
            )
            return session.run(None, feeds)

        runners.append(("onnxruntime", run_ort))
    stored = sum(t.numel() for t in model.params.values())
    if stored > REFERENCE_EVALUATOR_MAX_ELEMENTS:
        missing = "onnxruntime is not installed and " if onnxruntime is None else ""
        return runners, (
            f"{missing}onnx.reference is too slow for {stored} stored elements"
            + (" (install pathcond[onnx-check])" if onnxruntime is None else "")
        )

    def run_reference(data, path, feeds):
        import onnx

        from .io.formats.onnx_format import reference_evaluator

        proto = onnx.load_from_string(data) if data is not None else onnx.load(str(path))
        return reference_evaluator(proto).run(None, feeds)

    runners.append(("onnx.reference", run_reference))
    return runners, ""
