"""The distributed prototype's pass (benchmarks/distributed_pass.py) on 2 CPU processes over
gloo gives the single-process F(u) and ∂F/∂u: each rank holds half the rows of every tensor."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

WORLD = 2


class _ResidualNet(nn.Module):
    """Convs with BatchNorm folded in, a residual tie, 3x3 kernels, grouped conv, a Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 6 * 6, 7), nn.ReLU(), nn.Linear(7, 5))

    def forward(self, x):
        y = self.stem(x)
        return self.head(torch.relu(y + self.block(y)))


def _problem():
    """The same network, diag(G) and u on every process (seeded)."""
    from pathcond_cli.analysis import analyse
    from pathcond_cli.module_route import module_model

    torch.manual_seed(0)
    module = _ResidualNet().eval()
    with torch.no_grad():
        for bn in module.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
    analysis = analyse(module_model(module, (3, 6, 6)), device="cpu")
    u = torch.randn(analysis.groups.num_free, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return analysis.groups, analysis.diag, u


def _rank(rank: int, port: int, out: str) -> None:
    from distributed_pass import distributed_evaluate

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        groups, diag, u = _problem()
        value, gradient = distributed_evaluate(groups, diag, u)
        torch.save({"value": value, "gradient": gradient}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_give_the_single_process_objective_and_gradient(tmp_path):
    from pathcond_cli.solve.objective import Objective

    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(_free_port(), out), nprocs=WORLD, join=True)
    groups, diag, u = _problem()
    # Both ranks hold rows of every tensor here, so neither alone has the whole pass.
    assert all(dp.view[1] >= WORLD for dp in groups.dag_params)
    single = Objective(groups, diag).evaluate(u)
    for rank in range(WORLD):
        result = torch.load(f"{out}.{rank}")
        assert abs(result["value"] - single.value) <= 1e-12 * abs(single.value)
        assert torch.allclose(result["gradient"], single.gradient, rtol=1e-11, atol=1e-12)
    # One rank's rows alone give another gradient: the all-reduce is what makes them agree.
    import distributed_pass

    share, share_diag = distributed_pass.row_share(groups, diag, 0, WORLD)
    half = Objective(share, share_diag).evaluate(u)
    assert not torch.allclose(half.gradient, single.gradient, rtol=1e-6)
