"""Does the rescaled network compute the original function? Measured, never assumed."""

from __future__ import annotations

import math
from collections.abc import Mapping
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .evaluate import forward
from .graph import BatchNorm, Graph
from .model import LoadedModel

# A rescaled ONNX model run by onnxruntime/onnx.reference in its own float type is compared
# with the original run the same way; never tighter than this (float32 kernels differ by ULPs).
INDEPENDENT_MIN_TOLERANCE = 1e-4
# onnx.reference evaluates in Python: beyond this many stored elements it is too slow to wait for.
REFERENCE_EVALUATOR_MAX_ELEMENTS = 2_000_000

LARGE_INPUT = 16384

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@dataclass
class Verification:
    """Largest output differences between original and rescaled networks on random inputs.

    The relative error is the absolute error divided by the largest original output
    magnitude (per output); ``tolerance`` depends on the coarsest parameter dtype.
    ``independent`` is the check of the written file by another runtime (see
    :func:`independent_check`), None when no file was written.
    """

    max_abs_error: float
    max_rel_error: float
    tolerance: float
    modes: tuple[str, ...]
    independent: dict[str, Any] | None = None

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


def _max_errors(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[float, float]:
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
    """Run the user's module against a copy holding the ``changed`` tensors, both in float64.

    Both are deep copies, so the module itself (its running statistics, its mode) is never
    touched. Modes: eval, and train too when the module has BatchNorm layers.
    """
    original = copy.deepcopy(module).to(torch.float64)
    rescaled = copy.deepcopy(module)
    state = rescaled.state_dict()
    with torch.no_grad():
        for key, tensor in changed.items():
            state[key].copy_(tensor)
    rescaled = rescaled.to(torch.float64)
    device = next((t.device for t in module.state_dict().values()), torch.device("cpu"))
    batch = 2 if math.prod(input_shape) > LARGE_INPUT else 8
    x = torch.randn((batch, *input_shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
    modes = ("eval", "train") if has_batchnorm else ("eval",)
    max_abs = max_rel = 0.0
    for mode in modes:
        _batchnorm_mode(original, train=mode == "train")
        _batchnorm_mode(rescaled, train=mode == "train")
        with torch.no_grad():
            errors = _max_errors(_output_tensors(original(x)), _output_tensors(rescaled(x)))
        max_abs, max_rel = max(max_abs, errors[0]), max(max_rel, errors[1])
    keys = [k for k, t in module.state_dict().items() if t.is_floating_point()]
    return Verification(max_abs, max_rel, tolerance_for(module.state_dict(), keys or list(changed)), modes)


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

    onnxruntime when installed, else onnx.reference. Returns ``{"runtime", "status",
    "detail"}`` with status ``passed``, ``failed`` (the runtime evaluated both and they differ)
    or ``unavailable`` (no runtime, or it cannot evaluate this graph: reported, never fatal).
    """
    if model.format != "onnx":
        return {"runtime": None, "status": "unavailable",
                "detail": f"no independent runtime reads {model.format} checkpoints; the reloaded file was "
                          "checked by pathcond's own evaluator"}
    import numpy as np
    import onnx

    runner, runtime, why_not = _onnx_runner(model)
    if runner is None:
        return {"runtime": runtime, "status": "unavailable", "detail": why_not}
    graph_input = model.graph.inputs[0]
    elem_type = next(i for i in model.payload.graph.input if i.name not in {t.name for t in model.payload.graph.initializer})
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type.type.tensor_type.elem_type)
    x = np.random.default_rng(seed).standard_normal((1, *graph_input.shape)).astype(dtype)
    try:
        before = runner(model.payload.SerializeToString(), None, x)
        after = runner(None, written, x)
    except Exception as exc:  # noqa: BLE001 - a third-party runtime fails in its own ways: reported, not fatal
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        return {"runtime": runtime, "status": "unavailable", "detail": f"it cannot evaluate this model ({text[:300]})"}
    max_abs, max_rel = _max_errors([torch.from_numpy(np.asarray(b, dtype=np.float64)) for b in before],
                                   [torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in after])
    limit = max(tolerance, INDEPENDENT_MIN_TOLERANCE)
    status = "passed" if max_rel <= limit else "failed"
    return {"runtime": runtime, "status": status,
            "detail": f"max relative difference {max_rel:.3g} between original and written model (tolerance {limit:g})"}


def _onnx_runner(model: LoadedModel):
    """(run(model_bytes, model_path, x) -> outputs, runtime name, why unavailable)."""
    try:
        import onnxruntime
    except ImportError:
        onnxruntime = None
    if onnxruntime is not None:
        def run_ort(data, path, x):
            options = onnxruntime.SessionOptions()
            options.log_severity_level = 3
            session = onnxruntime.InferenceSession(data if data is not None else str(path), options,
                                                   providers=["CPUExecutionProvider"])
            return session.run(None, {session.get_inputs()[0].name: x})

        return run_ort, "onnxruntime", ""
    stored = sum(t.numel() for t in model.params.values())
    if stored > REFERENCE_EVALUATOR_MAX_ELEMENTS:
        return None, "onnx.reference", (f"onnxruntime is not installed and onnx.reference is too slow for "
                                        f"{stored} stored elements (install pathcond[onnx-check])")
    from onnx.reference import ReferenceEvaluator

    def run_reference(data, path, x):
        import onnx

        proto = onnx.load_from_string(data) if data is not None else onnx.load(str(path))
        evaluator = ReferenceEvaluator(proto)
        return evaluator.run(None, {evaluator.input_names[0]: x})

    return run_reference, "onnx.reference", ""
