"""Block-by-block passes allocate blocks, not tensors, whatever the stored layout.

The largest tensor a pass creates is measured with a dispatch mode that sees every tensor torch
allocates (views excluded), with ``BLOCK_ELEMENTS`` set to a few elements so that each tensor is
cut into many blocks. ``diag_after`` reads like ``analysis.diag``, slices included."""

from __future__ import annotations

import pytest
import torch
from conftest import NetBuilder
from torch.utils._python_dispatch import TorchDispatchMode

from pathcond_cli.engine import groups as groups_module
from pathcond_cli.engine.diag import diag_g
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.log_g import OuterLog
from pathcond_cli.engine.model import LoadedModel
from pathcond_cli.rescaling import rescale
from pathcond_cli.solve.dtype_limits import check_storage


class _LargestAllocation(TorchDispatchMode):
    """The most elements of any new (not a view) tensor of ``dtype`` created inside the block."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.largest = dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dtype == self.dtype:
                    self.largest = max(self.largest, tensor.numel())
        return out


def _one_by_one_transposed(groups: int):
    """A 1×1 ConvTranspose (8 → 6 channels): its per-element factor grid is as large as the weight."""
    b = NetBuilder((8, 2, 2), seed=4, dtype=torch.float32)
    b.conv(8, 1)
    b.relu()
    b.conv_transpose(6, 1, groups=groups)
    b.relu()
    b.conv(2, 1)
    return b.build()


def _one_by_one(transposed_linear: bool):
    """The same sizes for the two other weight layouts: a 1×1 conv (``weight``) and a Linear
    stored ``[in, out]`` (``weight_t``)."""
    if transposed_linear:
        b = NetBuilder((8,), seed=4, dtype=torch.float32)
        b.linear(8)
        b.relu()
        b.linear(6, transposed=True)
        b.relu()
        b.linear(2)
    else:
        b = NetBuilder((8, 2, 2), seed=4, dtype=torch.float32)
        b.conv(8, 1)
        b.relu()
        b.conv(6, 1)
        b.relu()
        b.conv(2, 1)
    return b.build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: _one_by_one_transposed(1),
        lambda: _one_by_one_transposed(2),
        lambda: _one_by_one(False),
        lambda: _one_by_one(True),
    ],
    ids=["conv_transpose", "conv_transpose_grouped", "weight", "weight_t"],
)
def test_rescaling_a_weight_holds_float64_of_a_block_not_of_the_tensor(build, monkeypatch):
    """d73cd94 built a ConvTranspose's whole factor grid (and its group-swapped copy) for every
    block of its first axis: float64 the size of the weight divided by its kernel, once per block."""
    graph, params = build()
    groups = build_groups(graph, params)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    whole = {key: tensor.clone() for key, tensor in groups.apply(params, u).items()}
    monkeypatch.setattr(groups_module, "BLOCK_ELEMENTS", 6)
    middle = "convt3.weight" if "convt3.weight" in params else next(key for key in params if key.endswith("3.weight"))
    size = params[middle].numel()
    assert size >= 24 and middle in whole
    changed = groups.apply(params, u)
    with _LargestAllocation(torch.float64) as seen:
        rescaled = changed[middle]
    assert torch.equal(rescaled, whole[middle])
    # A block (6 elements) and the per-channel vectors (8 channels at most) are all a pass may hold.
    assert seen.largest <= 8, f"a float64 tensor of {seen.largest} elements for a weight of {size}"


def test_storage_check_reads_the_block_size_when_it_runs(monkeypatch):
    """check_storage took ``BLOCK_ELEMENTS`` by value when dtype_limits was imported, so the block
    size set at run time (as tests/engine/test_block_passes.py sets it) never reached it: its block test ran
    the whole tensor as one block."""
    monkeypatch.setattr(groups_module, "BLOCK_ELEMENTS", 4)
    original = {"w": torch.ones(6, 5, dtype=torch.float32)}
    changed = {"w": torch.ones(6, 5, dtype=torch.float32)}
    changed["w"][5, 4] = 1e-45
    with _LargestAllocation(torch.float32) as seen:
        (problem,) = check_storage(original, changed)
    assert (problem.flushed, problem.normal) == (1, 30)
    assert seen.largest <= 4, f"a float32 tensor of {seen.largest} elements with blocks of 4"


def test_diag_after_slices_like_the_analysis_diag(nets):
    """``result.diag_after.log_g[:2]`` (and ``.parts[1:]``) raised AttributeError ('list' object has
    no attribute 'reshape'), while ``analysis.diag.log_g[:2]`` gives a list: both are DiagG."""
    graph, params = nets.mlp(seed=1)
    result = rescale(LoadedModel(graph, params, "safetensors", "mlp.safetensors"))
    after = result.diag_after
    # The oracle: diag(G) computed afresh from the rescaled checkpoint.
    fresh = diag_g(build_groups(graph, {**params, **result.changed.copy()})).log_g
    count = len(after.log_g)
    assert count == len(fresh) == 6
    for sliced, indices in [(after.log_g[:2], [0, 1]), (after.log_g[1::2], [1, 3, 5]), (after.log_g[-2:], [4, 5])]:
        assert isinstance(sliced, list) and len(sliced) == len(indices)
        for tensor, t in zip(sliced, indices):
            assert torch.equal(tensor, after.log_g[t])
            assert torch.allclose(tensor, fresh[t].to(tensor.device), rtol=0, atol=1e-9)
    parts = after.parts[1:]
    assert len(parts) == count - 1 and isinstance(parts[0], OuterLog) == isinstance(after.parts[1], OuterLog)
    assert len(result.analysis.diag.log_g[:2]) == 2


def _old_log_factor(wb, u_ext: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """WriteBack.log_factor as it was at 7a637c7, before blocks: the whole tensor's grid at once."""
    if wb.layout == "vector":
        log = u_ext[wb.dst] if wb.src is None else u_ext[wb.dst] - u_ext[wb.src]
        return log.reshape(shape)
    in_per_group = 1 if wb.src is None else len(wb.src) // wb.groups
    log = torch.zeros(wb.out_channels, in_per_group, dtype=u_ext.dtype)
    if wb.dst is not None:
        log += u_ext[wb.dst][:, None]
    if wb.src is not None:
        log.view(wb.groups, wb.out_channels // wb.groups, in_per_group).sub_(
            u_ext[wb.src].reshape(wb.groups, 1, in_per_group)
        )
    if wb.layout == "weight_t":
        log = log.t()
    elif wb.layout == "conv_transpose":
        a, b = log.shape[0] // wb.groups, log.shape[1]
        log = log.reshape(wb.groups, a, b).transpose(1, 2).reshape(wb.groups * b, a)
    return log.reshape(*log.shape, *([1] * (len(shape) - 2)))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _strided_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider one)."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype) if tensor.dim() else None
    if wide is None:
        return tensor
    wide[..., ::2] = tensor
    return wide[..., ::2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "arch",
    [
        "mlp",
        "mlp_nobias_transposed",
        "grouped_conv",
        "conv_transpose",
        "conv_bn",
        "prelu_scale",
        "self_loop",
        "conv3d",
        "channel_affine",
    ],
)
def test_rescaled_tensors_are_bit_identical_to_the_whole_tensor_computation(nets, arch, dtype, monkeypatch):
    """Per block, the float64 product cast back to the stored dtype must be the old whole-tensor
    ``original.to(float64) * factor`` then ``.to(dtype)`` bit for bit, overflows to inf and
    subnormals included (u ~ N(0, 6²) sends fp16 values to subnormals in most networks and to inf
    in channel_affine), for contiguous and strided originals. No defect found: a guard."""
    graph, params = nets.catalogue[arch](seed=6)
    params = {key: tensor.to(dtype) for key, tensor in params.items()}
    groups = build_groups(graph, params)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 6
    u_ext = groups.extend(u)
    writebacks = {wb.key: wb for wb in groups.writebacks}
    strided = {key: _strided_copy(tensor) for key, tensor in params.items()}
    assert any(not tensor.is_contiguous() for tensor in strided.values())
    monkeypatch.setattr(groups_module, "BLOCK_ELEMENTS", 5)
    for originals in (params, strided):
        changed = groups.apply(originals, u)
        assert len(changed)
        for key in changed:
            original = originals[key]
            old = original.to(torch.float64, copy=True).mul_(
                _old_log_factor(writebacks[key], u_ext, tuple(original.shape)).exp_()
            )
            assert torch.equal(_bits(changed[key]), _bits(old.to(dtype))), key
