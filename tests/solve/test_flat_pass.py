"""The solver's flat pass: the same numbers as tensor-by-tensor sums, and a number of
operations per pass that does not grow with the number of tensors.

The reference here is the per-tensor computation the flat buffers replaced, done in the log
domain with logsumexp over each tensor's ``[G, O/G, I/G]`` weights (exact at any scale). Every
tensor lives on the run's device (the fake CUDA device under ``PATHCOND_FAKE_CUDA=1``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from reference_models import BasicBlock, ResNet, _finish
from test_families import build

from pathcond_cli.analysis import analyse
from pathcond_cli.engine.log_g import DiagG, OuterLog, dense
from pathcond_cli.module_route import module_model
from pathcond_cli.runtime import resolve_device
from pathcond_cli.solve.objective import Coupling, Objective, group_logsumexp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_syncs import operation_counter

FAMILIES = ["resnet", "densenet", "shufflenet_v2", "squeezenet1_1", "resnext", "vgg11_bn"]


DEVICE = resolve_device("auto")


def _analysis(module, shape):
    analysis = analyse(module_model(module, shape, name="flat"), device=DEVICE)
    return analysis.groups, analysis.diag


def _random(size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return _analysis(*build(request.param))


def _per_tensor(groups, diag: DiagG, u: torch.Tensor):
    """Per tensor: log row and column sums of w = ḡ e^{−2(Bu)}, and log A, log C per group and
    log S, each tensor reduced on its own in the log domain (self-loop parameters left out of A, C)."""
    H = groups.num_free
    u_ext = groups.extend(u)
    rows, cols, between_rows, between_cols, dst, src = [], [], [], [], [], []
    for lg, dp in zip(diag.parts, groups.dag_params):
        log_g = dense(lg).reshape(dp.view)
        log_w = torch.logsumexp(log_g, dim=3) - 2 * u_ext[dp.dst][:, :, None] + 2 * u_ext[dp.src][:, None, :]
        rows.append(torch.logsumexp(log_w, dim=2))
        cols.append(torch.logsumexp(log_w, dim=1))
        if dp.self_loops is not None:
            log_w = log_w.masked_fill(dp.self_loops[..., 0], -torch.inf)
        between_rows.append(torch.logsumexp(log_w, dim=2).reshape(-1))
        between_cols.append(torch.logsumexp(log_w, dim=1).reshape(-1))
        dst.append(dp.dst.reshape(-1))
        src.append(dp.src.reshape(-1))
    log_total = torch.logsumexp(torch.cat([r.reshape(-1) for r in rows]), dim=0)
    log_in = group_logsumexp(torch.cat(dst), torch.cat(between_rows), H + 1)[:H]
    log_out = group_logsumexp(torch.cat(src), torch.cat(between_cols), H + 1)[:H]
    return rows, cols, log_in, log_out, log_total


def _same_logs(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite])
    if finite.any():
        assert torch.allclose(got[finite], want[finite], rtol=0, atol=rel * (1 + float(want[finite].abs().max())))


@pytest.mark.parametrize("u_scale", [0.0, 3.0, 400.0])
def test_flat_evaluation_equals_the_per_tensor_sums(family, u_scale):
    """u_scale 400 puts e^{±800} between groups of one tensor: past linear scale, so the flat
    pass must take the log domain for those tensors and still agree."""
    groups, diag = family
    objective = Objective(groups, diag, device=DEVICE)
    u = u_scale * _random(groups.num_free, 3)
    got = objective.evaluate(u)
    rows, cols, log_in, log_out, log_total = _per_tensor(groups, diag, u)
    _same_logs(got.log_total, log_total, 1e-12)
    _same_logs(got.log_a, log_in + objective.log_p - log_total, 1e-12)
    _same_logs(got.log_c, log_out + objective.log_p - log_total, 1e-12)
    for t in range(len(groups.dag_params)):
        _same_logs(got.tensor_log_rows[t], rows[t], 1e-12)
        _same_logs(got.tensor_log_cols[t], cols[t], 1e-12)
    value = objective.p * float(log_total) + 2 * float(objective.k @ u)
    assert got.value == pytest.approx(value, rel=1e-12)


def test_flat_coupling_products_equal_the_per_tensor_products(family):
    groups, diag = family
    objective = Objective(groups, diag, device=DEVICE)
    u = _random(groups.num_free, 4)
    u_ext = groups.extend(u)
    log_total = objective.evaluate(u).log_total
    log_dst, log_src = -2 * u_ext - log_total, 2 * u_ext
    log_src[-1] = -torch.inf
    x = _random(len(u_ext), 5)
    want = torch.zeros_like(x)
    for lg, dp in zip(diag.parts, groups.dag_params):
        w = torch.exp(
            torch.logsumexp(dense(lg).reshape(dp.view), dim=3)
            + log_dst[dp.dst][:, :, None]
            + log_src[dp.src][:, None, :]
        )
        want.index_add_(0, dp.dst.reshape(-1), torch.bmm(w, x[dp.src][:, :, None]).reshape(-1))
        want.index_add_(0, dp.src.reshape(-1), torch.bmm(x[dp.dst][:, None, :], w).reshape(-1))
    got = Coupling(objective, log_dst, log_src).symmetric_product(x)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


def _resnet(blocks: int):
    torch.manual_seed(0)
    return _finish(
        ResNet(BasicBlock, [blocks, blocks], 10, widths=(8, 16), stem_kernel=3, stem_stride=1, stem_pool=False), True
    ), (3, 16, 16)


def _operations_per_pass(groups, diag) -> tuple[int, int, int]:
    """aten operations of one evaluation, of one Newton operator product, and of one accurate change of F."""
    objective = Objective(groups, diag, device=DEVICE)
    u = 0.1 * _random(groups.num_free, 6)
    current = objective.evaluate(u)
    u_ext = groups.extend(u)
    coupling = Coupling(objective, -2 * u_ext - current.log_total, 2 * u_ext)
    counts = []
    for work in (
        lambda: objective.evaluate(u),
        lambda: coupling.symmetric_product(u_ext),
        lambda: objective.change(u, current, u),
    ):
        with operation_counter() as operations:
            work()
        counts.append(sum(operations.counts.values()))
    return tuple(counts)


def test_operations_per_pass_do_not_grow_with_the_number_of_tensors():
    """A ResNet with 1 and with 6 blocks per stage: 3.5x the tensors, the same shapes, and the
    same count of operations per pass (a counted quantity, not a timing)."""
    small, large = _analysis(*_resnet(1)), _analysis(*_resnet(6))
    assert len(large[0].dag_params) > 3 * len(small[0].dag_params)
    assert _operations_per_pass(*large) == _operations_per_pass(*small)


def test_outer_products_and_biases_need_no_stacked_copy(family):
    """Biases (a column of one) and Linear layers fed one vector are held by their factors."""
    groups, diag = family
    objective = Objective(groups, diag, device=DEVICE)
    for t, dp in enumerate(groups.dag_params):
        if dp.view[0] == 1 and dp.view[2] == 1:
            assert isinstance(objective.log_gbar[t], OuterLog)
