"""Layer-sized passes run block by block: the results must not depend on the block size.

Each check runs once with blocks so small that every tensor is cut into many (``BLOCK_ELEMENTS``
set to a few elements) and once with one block per tensor, and compares: bit for bit where the
arithmetic per element is the same (the rescaled tensors, the storage check, histograms), to
rounding where a reduction is split (the balancing's row norms).
"""

from __future__ import annotations

import math

import pytest
import torch
from cli_support import CountingReads

from pathcond_cli.engine import groups as groups_module
from pathcond_cli.engine.diag import balancing_exponents
from pathcond_cli.engine.groups import blocks, build_groups
from pathcond_cli.engine.log_g import OuterLog
from pathcond_cli.solve.dtype_limits import check_storage
from pathcond_cli.statistics import histogram

# Every stored layout: weight (grouped too), weight_t, conv_transpose, vector (biases, BatchNorm, PReLU).
LAYOUT_NETS = [
    "mlp",
    "mlp_nobias_transposed",
    "grouped_conv",
    "conv_transpose",
    "conv_bn",
    "prelu_scale",
    "self_loop",
    "conv3d",
]


@pytest.fixture
def tiny_blocks(monkeypatch):
    def set_to(elements: int) -> None:
        monkeypatch.setattr(groups_module, "BLOCK_ELEMENTS", elements)

    return set_to


def test_blocks_cover_the_axis_once_within_the_limit(tiny_blocks):
    tiny_blocks(10)
    for length, per_item in [(7, 3), (1, 100), (12, 1), (0, 5), (5, 0)]:
        slices = blocks(length, per_item)
        covered = [i for s in slices for i in range(length)[s]]
        assert covered == list(range(length))
        assert all(len(range(length)[s]) * per_item <= max(10, per_item) for s in slices)


@pytest.mark.parametrize("arch", LAYOUT_NETS)
def test_rescaled_tensors_do_not_depend_on_the_block_size(nets, arch, tiny_blocks):
    graph, params = nets.catalogue[arch](seed=3)
    groups = build_groups(graph, params)
    u = torch.randn(groups.num_free, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    whole = {key: tensor.clone() for key, tensor in groups.apply(params, u).items()}
    tiny_blocks(5)
    blocked = groups.apply(params, u)
    assert set(blocked) == set(whole) and whole
    for key, tensor in whole.items():
        assert torch.equal(blocked[key], tensor), key
        # An independent oracle for the factor: the stored tensor times exp(u_dst − u_src) per element.
        writeback = next(wb for wb in groups.writebacks if wb.key == key)
        u_ext = groups.extend(u)
        shape = tuple(params[key].shape)
        factor = torch.cat([writeback.factor(u_ext, shape, rows) for rows in blocks(shape[0], math.prod(shape[1:]))])
        assert torch.equal(torch.broadcast_to(factor, shape) * params[key].double(), tensor.double()), key


@pytest.mark.parametrize("arch", LAYOUT_NETS)
def test_balancing_does_not_depend_on_the_block_size(nets, arch, tiny_blocks):
    graph, params = nets.catalogue[arch](seed=5)
    groups = build_groups(graph, params)
    whole = balancing_exponents(groups)
    tiny_blocks(3)
    assert torch.allclose(balancing_exponents(groups), whole, rtol=1e-13, atol=1e-13)


def test_storage_check_finds_a_flushed_value_in_a_late_block(tiny_blocks):
    tiny_blocks(4)
    original = {"w": torch.ones(6, 5, dtype=torch.float32)}
    changed = {"w": torch.ones(6, 5, dtype=torch.float32)}
    changed["w"][5, 4] = 1e-45  # a subnormal where a normal value was: the last element of the last block
    (problem,) = check_storage(original, changed)
    assert (problem.key, problem.flushed, problem.overflowed) == ("w", 1, 0)
    changed["w"][5, 4] = float("inf")
    (problem,) = check_storage(original, changed)
    assert problem.overflowed == 1
    changed["w"][5, 4] = 2.0
    assert check_storage(original, changed) == []


def test_histogram_of_an_outer_product_in_blocks_equals_the_dense_one(tiny_blocks):
    generator = torch.Generator().manual_seed(2)
    rows, cols = (
        torch.randn(9, generator=generator, dtype=torch.float64),
        torch.randn(7, generator=generator, dtype=torch.float64),
    )
    rows[4], cols[0] = -math.inf, -math.inf
    outer = OuterLog(rows, cols)
    dense = histogram([outer.dense()], -4.0, 4.0, bins=9)
    tiny_blocks(8)
    assert histogram([outer], -4.0, 4.0, bins=9) == dense
    assert sum(count for _, _, count in dense) == 8 * 6


@pytest.mark.parametrize("arch", ["mlp", "conv_bn", "mlp_nobias_transposed", "conv_transpose"])
def test_dag_values_are_read_from_the_checkpoint_when_used_and_not_held(nets, arch):
    """The groups hold no weights: each DAG weight is computed from the checkpoint's
    tensors when a pass asks for it, and the analysis gives what eagerly held values give."""
    import dataclasses

    from pathcond_cli.engine.diag import diag_g
    from pathcond_cli.engine.groups import Reread

    graph, params = nets.catalogue[arch](seed=4)
    counting = CountingReads(params)
    groups = build_groups(graph, counting)
    # Weights are re-read; a bias (O numbers) is kept.
    assert all(isinstance(dp.source, Reread) or dp.source.dim() == 1 for dp in groups.dag_params)
    assert all(isinstance(dp.source, Reread) for dp in groups.dag_params if len(dp.shape) > 1)
    dp = groups.dag_params[0]
    before = dict(counting.reads)
    first, second = dp.value, dp.value
    assert torch.equal(first, second) and tuple(first.shape) == dp.shape
    assert sum(counting.reads.values()) > sum(before.values())
    held = dataclasses.replace(groups, dag_params=[dataclasses.replace(d, source=d.value) for d in groups.dag_params])
    for lazy_part, held_part in zip(diag_g(groups).log_g, diag_g(held).log_g):
        assert torch.equal(lazy_part, held_part)
