"""The module route: rescale an ``nn.Module`` in place, its tensors changed only once copies
of it, run before and after, agree.

    import pathcond_cli as pathcond
    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))   # in place, verified
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping

import torch

from .analysis import check_path_norms
from .engine.model import LoadedModel
from .errors import InputError, PathcondError, UnsupportedModelError, VerificationError
from .io.formats.fx_import import module_import
from .rescaling import RescaleResult, rescale
from .verify import Verification, compare_modules


def module_model(module: torch.nn.Module, input_shape: tuple[int, ...], *, name: str | None = None) -> LoadedModel:
    """Wrap an ``nn.Module`` (traced with torch.fx) as a :class:`LoadedModel`."""
    source = name or type(module).__name__
    _check_on_a_device(module)
    graph, params, notes = module_import(module, tuple(input_shape), source=source)
    return LoadedModel(graph, params, "module", source, payload=module, warnings=notes, arch_source="module")


def rescale_module(module: torch.nn.Module, input_shape: tuple[int, ...], **options) -> RescaleResult:
    """Rescale ``module``'s parameters in place (function preserved, verified) and return the result.

    ``options`` are those of :func:`rescale` (``criterion``, ``solver``, ``tol``, ``max_iter``, ``device``,
    ``max_log_scale``).
    The rescaling is verified on the module itself: a copy holding the rescaled tensors is run
    against a copy of the original, in eval mode and, with BatchNorm, in train mode (the
    module's own running statistics are never touched). Only then are its tensors changed;
    on :class:`VerificationError` the module is left as it was. A module whose parameters are
    shared between layers (tied weights) is refused with :class:`UnsupportedModelError`.
    """
    _check_module(module)
    options.pop("verify", None)
    model = module_model(module, input_shape)
    result = rescale(model, verify=False, **options)
    verification = _compare_module(module, result.changed, tuple(input_shape), model.source)
    if not verification.passed:
        raise VerificationError(
            f"{model.source}: the rescaled module differs from the original by a relative "
            f"{verification.max_rel_error:.3g} (tolerance {verification.tolerance:.1g}); the module was not changed."
        )
    result.path_norms_after = check_path_norms(
        result.analysis,
        model.graph,
        ChainMap(result.changed, model.params),
        model.source,
        outcome="The module was not changed.",
        rescaled_by=result.solve.u,
    )
    # Computed once, before the module's tensors (which they are computed from) change.
    result.changed = result.changed.copy()
    state = module.state_dict()
    with torch.no_grad():
        for key, tensor in result.changed.items():
            state[key].copy_(tensor)
    result.verification = verification
    return result


def _compare_module(
    module: torch.nn.Module, changed: Mapping[str, torch.Tensor], input_shape: tuple[int, ...], source: str
) -> Verification:
    """:func:`compare_modules`, with a forward that cannot run as it runs the module (in float64) refused."""
    try:
        return compare_modules(module, changed, input_shape)
    except PathcondError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's forward, run on float64 copies, may raise anything
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise VerificationError(
            f"{source}: the rescaling cannot be verified: the verification runs copies of the module in float64 on "
            f"standard normal inputs, and its forward raises there ({type(exc).__name__}: {reason[:300]}). A "
            "forward that casts a stored tensor to a fixed dtype (self.filt.float(), .to(torch.float32)) runs in "
            "that dtype only: store the tensor in the dtype it is used in, and use it without the cast. The module "
            "was not changed."
        ) from None


def _check_on_a_device(module: torch.nn.Module) -> None:
    """Refuse a module with tensors on the meta device: it holds no values to read or run."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    on_meta = [key for key, tensor in tensors if tensor.is_meta]
    if on_meta:
        raise InputError(
            f"{type(module).__name__}: tensor(s) {', '.join(on_meta[:10])} are on the meta device and hold no "
            "values; load the weights (e.g. module.to_empty(device='cpu') then load_state_dict) first."
        )


def _check_module(module: torch.nn.Module) -> None:
    """Refuse what ``rescale_module`` cannot rescale exactly: meta tensors and tied parameters."""
    name = type(module).__name__
    _check_on_a_device(module)
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    owners: dict[tuple[int, int], list[str]] = {}
    for key, tensor in tensors:
        if tensor.numel():
            owners.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(key)
    tied = [keys for keys in owners.values() if len(keys) > 1]
    if tied:
        raise UnsupportedModelError(
            f"{name}: parameters are shared between layers (tied weights); one rescaling per layer would change "
            "the function, so pathcond does not rescale such a module:",
            [" = ".join(keys) for keys in tied],
        )
