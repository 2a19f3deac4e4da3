"""Host–device synchronisations per Newton pass, counted on the fake CUDA device (issue 17).

No GPU needed: the analysis and the solve run under ``tests/fake_cuda.py``, which counts every
read of a device value on the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``,
``.cpu()``, ...). On a real GPU each of these waits for the queued kernels, so a pass that
reads one value per parameter tensor costs a sync per tensor, not a few flat kernels.

    python benchmarks/bench_syncs.py                        # mnasnet resnet18
    python benchmarks/bench_syncs.py --models resnet50 mlp3

Prints, per model: tensors, passes, host reads in the analysis and in the solve, and the
solve's reads per pass by kind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mnasnet", "resnet18"])
    parser.add_argument("--solver", default="newton")
    args = parser.parse_args()

    import fake_cuda
    from bench_solvers import build
    from pathcond_cli.api import analyse, module_model
    from pathcond_cli.solve.solvers import solve

    print(f"{'model':<14}{'tensors':>8}{'passes':>8}{'analysis':>10}{'solve':>8}{'per pass':>10}  solve reads by kind")
    for name in args.models:
        module, shape = build(name)
        model = module_model(module, shape, name=name)
        with fake_cuda.installed() as mode:
            analysis = analyse(model, device="cuda")
            in_analysis = sum(mode.syncs.values())
            mode.syncs.clear()
            result = solve(analysis.groups, analysis.diag, solver=args.solver, device="cuda")
            in_solve = dict(mode.syncs)
        total = sum(in_solve.values())
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(in_solve.items(), key=lambda kv: -kv[1]))
        print(f"{name:<14}{len(analysis.groups.dag_params):>8}{result.passes:>8}{in_analysis:>10}{total:>8}"
              f"{total / max(result.passes, 1):>10.1f}  {kinds}")


if __name__ == "__main__":
    main()
