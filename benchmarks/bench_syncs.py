"""Host–device synchronisations and aten operations per solver pass, counted on the fake CUDA
device (issues 17 and 28).

No GPU needed: the analysis and the solve run under ``tests/fake_cuda.py``, which counts every
read of a device value on the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``,
``.cpu()``, ...), and under a dispatch mode that counts the aten operations the solve runs.
On a real GPU each sync waits for the queued kernels and each operation that computes is a
kernel launch, so a pass that reads one value per parameter tensor, or runs a few operations
per tensor, costs time in proportion to the number of tensors, not to the arithmetic.

    python benchmarks/bench_syncs.py                        # mnasnet resnet18
    python benchmarks/bench_syncs.py --models resnet18 resnet50 resnet152 mlp3

Prints, per model: tensors, passes, host reads in the analysis and in the solve, reads per
pass, the solve's aten operations per pass (all, and those that are not views or metadata,
which launch no kernel), the operations of building the objective (once per solve, per
tensor), the operations per pass without them (all, kernels), and the solve's reads by kind.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def operation_counter():
    """A dispatch mode counting the aten operations run under it (``counts``, by name)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OperationCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

        def launching(self) -> int:
            """Operations other than views and metadata: those that run a kernel on a GPU."""
            return sum(n for name, n in self.counts.items() if not _is_view(torch, name))

    return OperationCounter()


def _is_view(torch, name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    schema = packet.default._schema if hasattr(packet, "default") else None
    aliasing = schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    return aliasing or name in {"detach", "alias", "lift_fresh", "_local_scalar_dense"}


def count_solve(groups, diag, *, solver: str = "newton"):
    """(result, host reads by kind, aten operations of the solve, aten operations of building its
    objective alone) of one solve on the fake CUDA device (``groups`` and ``diag`` made there).
    Building the objective (kernel sums, the support, the flat buffers) runs once per solve and
    per tensor; the rest is what every pass costs."""
    import fake_cuda

    from pathcond_cli.solve.objective import Objective
    from pathcond_cli.solve.solvers import solve

    with fake_cuda.installed() as mode:
        with operation_counter() as setup:
            Objective(groups, diag, device="cuda")
        mode.syncs.clear()
        with operation_counter() as operations:
            result = solve(groups, diag, solver=solver, device="cuda")
        return result, dict(mode.syncs), operations, setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mnasnet", "resnet18"])
    parser.add_argument("--solver", default="newton")
    args = parser.parse_args()

    import fake_cuda
    from bench_solvers import build

    from pathcond_cli.api import analyse, module_model

    print(f"{'model':<12}{'tensors':>8}{'passes':>7}{'analysis':>9}{'solve':>6}{'syncs/pass':>11}{'ops/pass':>9}"
          f"{'kernels/pass':>13}{'setup ops':>10}{'ops/pass after setup':>21}{'kernels':>8}  solve reads by kind")
    for name in args.models:
        module, shape = build(name)
        model = module_model(module, shape, name=name)
        with fake_cuda.installed() as mode:
            analysis = analyse(model, device="cuda")
            in_analysis = sum(mode.syncs.values())
        result, in_solve, operations, setup = count_solve(analysis.groups, analysis.diag, solver=args.solver)
        passes = max(result.passes, 1)
        total, ops, kernels = sum(in_solve.values()), sum(operations.counts.values()), operations.launching()
        setup_ops, setup_kernels = sum(setup.counts.values()), setup.launching()
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(in_solve.items(), key=lambda kv: -kv[1]))
        print(f"{name:<12}{len(analysis.groups.dag_params):>8}{result.passes:>7}{in_analysis:>9}{total:>6}"
              f"{total / passes:>11.1f}{ops / passes:>9.0f}{kernels / passes:>13.0f}{setup_ops:>10}"
              f"{(ops - setup_ops) / passes:>21.0f}{(kernels - setup_kernels) / passes:>8.0f}  {kinds}")


if __name__ == "__main__":
    main()
