"""The model families pathcond must rescale exactly (``tests/families.py``).

For every family (small widths by default, the published size under ``-m slow``):

- the module route: ``pathcond.rescale_module`` rescales the user's ``nn.Module`` in place,
  and torch itself (not pathcond's evaluator) runs the original and the rescaled module on
  the same inputs in eval mode and in train mode (batch statistics, the same dropout masks):
  fp32 relative error ≤ 1e-5;
- the ONNX route: the module exported by ``torch.onnx.export`` (the TorchScript exporter
  for every family, the dynamo exporter for a subset), rescaled by ``pathcond rescale``,
  original and rescaled files run by onnxruntime on the same inputs: fp32 relative error
  ≤ 1e-5;
- the canonical representative: a random admissible rescaling D (random positive factors on
  pathcond's own rescaling groups, checked by torch to leave the function unchanged) does
  not change PathCond's result: PathCond(Dθ) = PathCond(θ) tensor by tensor, relative
  ≤ 1e-6 in float64.

Every check also asserts that the rescaling really moved the weights, so none passes by
doing nothing. Families whose operations this branch does not support yet are marked
``xfail`` with the missing operation named (``MISSING``): drop an entry once the operation
lands and the check passes.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from cli_support import invoke
from families import FAMILIES
from onnx_models import export
from reference_models import calibrate_batchnorm, count_parameters
from torch import nn

import pathcond_cli as pathcond
from pathcond_cli.module_route import module_model

TOLERANCE = 1e-5
CANONICAL_TOLERANCE = 1e-6
BATCH = 3
# A route passes within the fp32 tolerance, or within this many times what one fp32 rounding
# of the changed tensors does (train-mode BatchNorm over 3 samples amplifies rounding).
ROUNDING_MARGIN = 10.0
MOVED = 1e-3  # the smallest max |ln λ| that counts as "the rescaling did something"

_ILL_CONDITIONED = (
    "not pathcond's error: onnxruntime and torch already disagree by 3.3e-5 on small Inception-v3's "
    "original export (fp32 kernels on a network that amplifies rounding), above the 1e-5 asked of "
    "the rescaled file"
)

#: (family, route) -> why the route is a known gap, stated.
MISSING: dict[tuple[str, str], str] = {
    ("inception_v3", "onnx"): _ILL_CONDITIONED,
    ("inception_v3", "dynamo"): _ILL_CONDITIONED.replace("3.3e-5", "2.9e-5"),
}

DYNAMO_FAMILIES = ("resnet", "densenet", "squeezenet1_1", "shufflenet_v2")
SLOW_DYNAMO_FAMILIES = tuple(name for name in FAMILIES if name not in DYNAMO_FAMILIES)


def _cases(route: str, names=tuple(FAMILIES), slow: bool = False) -> list:
    cases = []
    for name in names:
        marks = [pytest.mark.slow] if slow else []
        if (name, route) in MISSING:
            reason = MISSING[name, route]
            marks.append(pytest.mark.xfail(reason=reason, strict=True))
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


def build(name: str, *, full: bool = False) -> tuple[nn.Module, tuple[int, ...]]:
    """The family's network (seeded, eval mode, non-trivial BatchNorm state) and its input shape.

    A fresh module on every call (callers rescale it in place). The small ones are built and
    calibrated once per module and handed out as deep copies, with the global RNG left where
    building it leaves it: exactly what building it anew returns and does."""
    if full:
        family = FAMILIES[name]
        torch.manual_seed(0)
        return calibrate_batchnorm(family.full(), family.full_shape, batch_size=2), family.full_shape
    module, shape, rng_state = _built_small(name)
    torch.set_rng_state(rng_state)
    return copy.deepcopy(module), shape


@functools.cache
def _built_small(name: str) -> tuple[nn.Module, tuple[int, ...], torch.Tensor]:
    family = FAMILIES[name]
    torch.manual_seed(0)
    module = calibrate_batchnorm(family.small(), family.small_shape, batch_size=8)
    return module, family.small_shape, torch.get_rng_state()


def example(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn((BATCH, *shape), generator=torch.Generator().manual_seed(7)).to(dtype)


def run(module: nn.Module, x: torch.Tensor, *, train: bool) -> torch.Tensor:
    """``module``'s output in ``train`` mode, with the same dropout masks on every call; the
    module's buffers (running statistics) and modes are restored afterwards, so nothing leaks
    between calls (as running a deep copy would, without copying the whole module each time)."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    try:
        module.train(train)
        # the CPU's generator only: the module runs there (and the fake CUDA device has no generator)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(1234)
            return module(x)
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def rounding_perturbed(original: nn.Module, rescaled: nn.Module) -> nn.Module:
    """``original`` with every tensor the rescaling changed moved by one ulp of its dtype (up or
    down at random): what storing any rescaling of this network in fp32 can do to it, which
    bounds what fp32 verification can ask of the rescaled one."""
    moved = copy.deepcopy(original)
    after = rescaled.state_dict()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for key, tensor in moved.state_dict().items():
            if tensor.is_floating_point() and not torch.equal(tensor, after[key]):
                up = torch.randint(0, 2, tensor.shape, generator=generator).bool()
                tensor.copy_(torch.nextafter(tensor, torch.where(up, torch.inf, -torch.inf).to(tensor.dtype)))
    return moved


def relative(got: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray) -> float:
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return float((got - expected).abs().max() / expected.abs().max())


def largest_change(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return max(
        relative(after[key], before[key])
        for key in before
        if before[key].is_floating_point() and before[key].abs().max() > 0
    )


# -- the module route ------------------------------------------------------------------------


def check_module(name: str, *, full: bool = False) -> None:
    module, shape = build(name, full=full)
    original = copy.deepcopy(module)
    x = example(shape)
    result = pathcond.rescale_module(module, shape, device="cpu")
    assert result.solve.converged and result.solve.u_inf > MOVED, (result.solve.converged, result.solve.u_inf)
    assert largest_change(module.state_dict(), original.state_dict()) > MOVED
    rounded = rounding_perturbed(original, module)
    for train in (False, True):
        expected = run(original, x, train=train)
        error = relative(run(module, x, train=train), expected)
        limit = max(TOLERANCE, ROUNDING_MARGIN * relative(run(rounded, x, train=train), expected))
        assert error <= limit, f"{name} ({'train' if train else 'eval'} mode): relative error {error:.3g} > {limit:.3g}"


@pytest.mark.parametrize("name", _cases("module"))
def test_module_rescaled_in_place_computes_the_same_function(name):
    check_module(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases("module"))
def test_full_size_module_computes_the_same_function(name):
    check_module(name, full=True)


# -- the ONNX route --------------------------------------------------------------------------


def onnx_outputs(path: Path, x: torch.Tensor) -> np.ndarray:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def check_onnx(name: str, exporter: str, tmp_path: Path, *, full: bool = False) -> None:
    module, shape = build(name, full=full)
    x = example(shape)
    source, target = tmp_path / f"{name}.onnx", tmp_path / f"{name}.pathcond.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source.write_bytes(export(module, x, exporter))
    result = invoke("rescale", source, "-o", target, "--json", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["solver"]["converged"] and report["u_inf"] > MOVED, report["solver"]
    tolerance = TOLERANCE
    if full:
        # At published sizes fp32 itself moves the outputs by about 1e-5 (torch fp32 against
        # fp64: 1.4e-5 on ResNet-50), so 1e-5 would test the runtimes' rounding, not pathcond.
        fp32_floor = relative(run(module, x, train=False), run(copy.deepcopy(module).double(), x.double(), train=False))
        tolerance = max(TOLERANCE, ROUNDING_MARGIN * fp32_floor)
    expected = onnx_outputs(source, x)
    assert relative(expected, run(module, x, train=False)) <= tolerance  # the export is the module
    error = relative(onnx_outputs(target, x), expected)
    assert error <= tolerance, f"{name} ({exporter} export): onnxruntime relative error {error:.3g}"


@pytest.mark.parametrize("name", _cases("onnx"))
def test_torchscript_export_rescaled_by_the_cli_runs_the_same_in_onnxruntime(name, tmp_path):
    check_onnx(name, "torchscript", tmp_path)


@pytest.mark.parametrize("name", _cases("dynamo", DYNAMO_FAMILIES))
def test_dynamo_export_rescaled_by_the_cli_runs_the_same_in_onnxruntime(name, tmp_path):
    check_onnx(name, "dynamo", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases("dynamo", SLOW_DYNAMO_FAMILIES))
def test_dynamo_export_of_the_other_families(name, tmp_path):
    check_onnx(name, "dynamo", tmp_path)


@pytest.mark.slow
# full size: onnxruntime and torch agree on Inception-v3 there (the small one's gap is not this test's)
@pytest.mark.parametrize("name", _cases("onnx full size"))
def test_full_size_torchscript_export_runs_the_same_in_onnxruntime(name, tmp_path):
    check_onnx(name, "torchscript", tmp_path, full=True)


# -- the canonical representative ------------------------------------------------------------


def check_canonical(name: str, *, full: bool = False) -> None:
    module, shape = build(name, full=full)
    module = module.double()
    first = copy.deepcopy(module)
    # PathCond(θ) through the module route, verified on the float64 module (a tolerance float32's
    # check_module cannot ask for)
    groups = pathcond.rescale_module(first, shape, tol=1e-9, max_iter=5000, device="cpu").analysis.groups

    moved = copy.deepcopy(module)
    state = moved.state_dict()
    shift = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        for key, tensor in groups.apply(state, shift).items():
            state[key].copy_(tensor)
    assert largest_change(moved.state_dict(), module.state_dict()) > 0.1, "D must move the parameters"
    x = example(shape, torch.float64)
    for train in (False, True):
        assert relative(run(moved, x, train=train), run(module, x, train=train)) < 1e-10, "D is not admissible"

    # PathCond(Dθ): what rescale_module writes into ``moved`` (the same rescale on the module read
    # anew), without repeating the module-route verification the first call made on this orbit.
    second = pathcond.rescale(module_model(moved, shape), tol=1e-9, max_iter=5000, device="cpu", verify=False)
    expected, got = first.state_dict(), {**moved.state_dict(), **second.changed}
    for key, tensor in expected.items():
        if tensor.is_floating_point() and tensor.abs().max() > 0:
            error = relative(got[key], tensor)
            assert error <= CANONICAL_TOLERANCE, f"{name}: PathCond(Dθ) and PathCond(θ) differ in {key} by {error:.3g}"


@pytest.mark.parametrize("name", _cases("module"))
def test_canonical_representative(name):
    check_canonical(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases("module"))
def test_full_size_canonical_representative(name):
    check_canonical(name, full=True)


# -- the architectures themselves ------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.torchvision_parameters])
def test_full_size_parameter_count_is_torchvisions(name):
    family = FAMILIES[name]
    with torch.device("meta"):  # counts only: no memory, no initialisation
        module = family.full()
    assert count_parameters(module) == family.torchvision_parameters


@pytest.mark.parametrize("name", ["squeezenet1_0", "squeezenet1_1", "googlenet_32", "googlenet_64"])
def test_small_inputs_exercise_ceil_mode(name):
    """At the small input size some ceil-mode pool keeps a partial last window (its output is
    larger than floor mode's), which is the case the ceil-mode rules must get right."""
    module, shape = build(name)
    partial = []

    def record(pool: nn.MaxPool2d, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        floor = nn.functional.max_pool2d(inputs[0], pool.kernel_size, pool.stride, pool.padding, pool.dilation)
        partial.append(output.shape[-2:] != floor.shape[-2:])

    pools = [m for m in module.modules() if isinstance(m, nn.MaxPool2d) and m.ceil_mode]
    handles = [pool.register_forward_hook(record) for pool in pools]
    with torch.no_grad():
        module(example(shape))
    for handle in handles:
        handle.remove()
    assert pools and any(partial)
