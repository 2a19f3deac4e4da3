"""Prototype: one pass of PathCond's objective split across torch.distributed ranks (docs/distributed.md).

    python benchmarks/distributed_pass.py   # group counts and bytes moved per pass, ResNet-50 and an 822 M MLP

Each rank holds a share of every DAG parameter tensor's rows (output units): its log ḡ, its
group maps, nothing else of the network. A pass of F (value and gradient, SPEC §4) is then:
each rank reduces its rows to per-group log sums, [log A_h | log C_h | log S] over the H free
groups; one all-reduce of the element-wise maximum and one of the sums of exp(x - max)
combine them in the log domain (nothing overflows, the result is the single-process one up
to rounding); every rank then takes the same step of u (H numbers, replicated). The test
(tests/system/test_distributed_pass.py) runs it on 2 CPU processes over gloo and compares it with
:meth:`pathcond_cli.solve.objective.Objective.evaluate` in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pathcond_cli.engine.groups import DagParam, RescalingGroups  # noqa: E402
from pathcond_cli.engine.log_g import DiagG  # noqa: E402
from pathcond_cli.solve.objective import Objective, support  # noqa: E402


def row_share(groups: RescalingGroups, diag: DiagG, rank: int, world: int) -> tuple[RescalingGroups, DiagG]:
    """This rank's rows (output units within each convolution group) of every DAG tensor.

    Rows are dealt in contiguous blocks; a tensor with fewer rows than ranks leaves some
    ranks without a share of it. The value is a zero-stride stand-in: a pass reads only
    log ḡ and the group maps (and the parameter count).
    """
    shares, log_g = [], []
    for dp, lg in zip(groups.dag_params, diag.log_g):
        g, rows, cols, kernel = dp.view
        block = slice(rows * rank // world, rows * (rank + 1) // world)
        count = block.stop - block.start
        if count == 0:
            continue
        view = (g, count, cols, kernel)
        shares.append(
            DagParam(
                dp.name,
                dp.layer,
                torch.zeros((), dtype=torch.float64).expand(g * count * cols * kernel),
                dp.dst[:, block],
                dp.src,
                view,
                None if dp.self_loops is None else dp.self_loops[:, block],
            )
        )
        log_g.append(lg.reshape(dp.view)[:, block].reshape(-1))
    return dataclasses.replace(groups, dag_params=shares), DiagG(log_g)


def local_sums(objective: Objective, u: torch.Tensor) -> torch.Tensor:
    """[log A_h (H) | log C_h (H) | log S] over this rank's rows (self-loops taken out)."""
    ev = objective.evaluate(u)
    log_in = ev.log_a - objective.log_p + ev.log_total
    log_out = ev.log_c - objective.log_p + ev.log_total
    return torch.cat([log_in, log_out, ev.log_total.reshape(1)])


def all_reduce_logsumexp(log_values: torch.Tensor) -> torch.Tensor:
    """log Σ_ranks exp(values), element-wise: an all-reduce of the maximum, then of the sum
    of exp(values − maximum). Entries −inf on every rank stay −inf."""
    peak = log_values.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    summed = torch.exp(log_values - safe)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return torch.log(summed) + safe


def distributed_evaluate(groups: RescalingGroups, diag: DiagG, u: torch.Tensor) -> tuple[float, torch.Tensor]:
    """F(u) and ∂F/∂u, computed from this rank's rows and two all-reduces of 2H + 1 numbers."""
    share, share_diag = row_share(groups, diag, dist.get_rank(), dist.get_world_size())
    H = groups.num_free
    if share.dag_params and any(bool(torch.isfinite(lg).any()) for lg in share_diag.log_g):
        sums = local_sums(Objective(share, share_diag), u)
    else:
        sums = torch.full((2 * H + 1,), -math.inf, dtype=torch.float64)
    total = all_reduce_logsumexp(sums)
    log_in, log_out, log_total = total[:H], total[H : 2 * H], total[2 * H]
    # p and k over the whole network's support g > 0 (SPEC §4), as the single-process objective has them
    counts = support(groups, diag.parts)
    p, k = counts.size, counts.k
    log_a, log_c = log_in + math.log(p) - log_total, log_out + math.log(p) - log_total
    value = p * float(log_total) + 2 * float(k @ u)
    return value, 2 * (k - torch.exp(log_a) + torch.exp(log_c))


def bytes_per_pass(num_free: int, world: int) -> dict[str, float]:
    """Float64 payload of one pass's two all-reduces (2H + 1 numbers each) and what a ring
    all-reduce sends per rank for it (2 (W − 1) / W times the payload)."""
    payload = 2 * (2 * num_free + 1) * 8
    return {"payload": payload, "ring_per_rank": 2 * (world - 1) / world * payload}


def _mlp_groups(sizes: list[int]) -> int:
    """Free groups of a plain MLP: one per hidden unit (inputs and outputs are fixed)."""
    return sum(sizes[1:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    args = parser.parse_args()
    from reference_models import REFERENCE_MODELS

    from pathcond_cli.engine.groups import build_groups
    from pathcond_cli.module_route import module_model

    factory, shape, _, _ = REFERENCE_MODELS["resnet50"]
    torch.manual_seed(0)
    model = module_model(factory().eval(), tuple(shape))
    groups = build_groups(model.graph, model.params)
    activations = sum(math.prod(s) for name, s in groups.shapes.items())
    rows = [("ResNet-50 224x224", groups.p, groups.num_free, activations)]
    # An MLP of the size (820 M parameters; H is the sum of the hidden widths).
    sizes = [784] + [8192] * 13 + [1000]
    p = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    rows.append(("MLP 784-8192x13-1000", p, _mlp_groups(sizes), sum(sizes)))
    print(
        f"{'network':24} {'params':>14} {'groups H':>9} {'float64 state':>14} {'per pass':>10} "
        f"{'ring/rank W=' + str(args.world):>16} {'node outputs':>15}"
    )
    for name, params, free, acts in rows:
        moved = bytes_per_pass(free, args.world)
        print(
            f"{name:24} {params:>14,} {free:>9,} {params * 8 / 2**30:>11.2f} GiB {moved['payload'] / 2**20:>7.2f} MiB "
            f"{moved['ring_per_rank'] / 2**20:>12.2f} MiB {acts * 8 / 2**20:>11.1f} MiB"
        )


if __name__ == "__main__":
    main()
