"""Solver benchmark (issues 6 and 12): the paper's sequential coordinate descent against the
block solver, L-BFGS and Newton (the default), on the same g and groups, to the same KKT
tolerance. "passes" are gradient-equivalent passes over the parameters (an F/∇F evaluation, a
Hessian product, or an accurate evaluation of a change of F: one each).

Run by hand, not by the test suite:

    python benchmarks/bench_solvers.py                      # every model, one process each
    python benchmarks/bench_solvers.py --models mlp3 resnet50 --sequential-budget 300
    python benchmarks/bench_solvers.py --models mnasnet inception_v3 --solvers newton lbfgs --threads 1
    python benchmarks/bench_solvers.py --device cuda
    # issue 11's 20 families, published sizes:
    python benchmarks/bench_solvers.py --models families --solvers newton --threads 1
    python benchmarks/bench_solvers.py --models mlp3 cifar_nv --solvers newton --paper-sweeps 10 --threads 1

``--paper-sweeps N`` adds the paper's practice, N sweeps of the sequential solver whatever the
residual, and prints how its time and F compare with Newton run to the tolerance.

Each model runs in its own process so that its peak resident memory is its own. Prints one
table row per solver and the ratios against the sequential baseline; ``--json`` writes the
raw figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "engine")]  # test_families: the family catalogue

FAMILY = "family:"
PAPER = "sequential×"
MODELS = [
    "mlp1",
    "mlp2",
    "mlp3",
    "mlp4",
    "mlp5",
    "mlp6",
    "mlp7",
    "mlp8",
    "mlp9",
    "cifar_nv",
    "resnet18",
    "resnet50",
    "densenet",
    "mnasnet",
    "inception_v3",
]


def build(name: str):
    import reference_models as zoo
    import torch

    if name.startswith(FAMILY):
        from test_families import build as build_family

        return build_family(name[len(FAMILY) :], full=True)
    torch.manual_seed(0)
    if name.startswith("mlp"):
        return zoo.mlp(int(name[3:])), (3072,)
    factory, shape = {
        "cifar_nv": (zoo.cifar_nv, (3, 32, 32)),
        "resnet18": (zoo.resnet18, (3, 224, 224)),
        "resnet50": (zoo.resnet50, (3, 224, 224)),
        "resnet152": (lambda: zoo._finish(zoo.ResNet(zoo.Bottleneck, [3, 8, 36, 3], 1000)), (3, 224, 224)),
        "vgg16": (zoo.vgg16, (3, 224, 224)),
        "alexnet": (zoo.alexnet, (3, 224, 224)),
        # the fx importer does not take x.mean yet: the head pools with AdaptiveAvgPool2d
        "mnasnet": (lambda: zoo.mnasnet(alpha=0.5, mean_pool=False), (3, 224, 224)),
        "inception_v3": (zoo.inception_v3, (3, 299, 299)),
        "densenet": (lambda: zoo.small_densenet(stem=64, growth=32, n_layers=12), (3, 32, 32)),
    }[name]
    return factory(), shape


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_one(name: str, args) -> dict:
    from pathcond_cli.analysis import analyse
    from pathcond_cli.module_route import module_model
    from pathcond_cli.solve.solvers import solve

    module, shape = build(name)
    start = time.perf_counter()
    model = module_model(module, shape, name=name)
    analysis = analyse(model, device=args.device)
    setup = time.perf_counter() - start
    row = {
        "model": name,
        "device": str(args.device),
        "parameters": model.parameter_count,
        "dag_parameters": analysis.groups.p,
        "groups": analysis.groups.num_free,
        "colours": analysis.groups.num_colours,
        "analysis_seconds": analysis.seconds,
        "setup_seconds": setup,
        "solvers": {},
    }
    for method in args.solvers:
        budget = args.sequential_budget if method == "sequential" else args.budget
        timed = _timed_solve(solve, analysis, method, args, budget)
        if args.warm and not timed["cut"]:
            # The first solve (the one a run makes) also pays once per process for what a second
            # reuses: CUDA's first calls (library handles, the caching allocator's growth), the
            # layouts cached on the groups. A second solve's seconds are the passes' own.
            timed["warm_seconds"] = _timed_solve(solve, analysis, method, args, budget)["seconds"]
        row["solvers"][method] = timed
    if args.paper_sweeps:
        row["solvers"][f"{PAPER}{args.paper_sweeps}"] = _timed_solve(
            solve, analysis, "sequential", args, args.sequential_budget, tol=0.0, max_iter=args.paper_sweeps
        )
    row["peak_rss_gib"] = peak_rss_gib()
    return row


class _OutOfTime(Exception):
    pass


def _timed_solve(
    solve, analysis, method: str, args, budget: float, *, tol: float | None = None, max_iter: int | None = None
) -> dict:
    """Solve to the tolerance (``args.tol`` unless ``tol``), or stop after ``budget`` seconds
    and report how far it got."""
    started = time.perf_counter()
    last = {"iterations": 0, "objective_final": None, "kkt_residual": None}

    def watch(iteration: int, value: float, residual: float) -> None:
        last.update(iterations=iteration, objective_final=value, kkt_residual=residual)
        if time.perf_counter() - started > budget:
            raise _OutOfTime

    try:
        result = solve(
            analysis.groups,
            analysis.diag,
            solver=method,
            tol=args.tol if tol is None else tol,
            max_iter=args.max_iter if max_iter is None else max_iter,
            device=args.device,
            progress=watch,
        )
    except _OutOfTime:
        return {**last, "passes": None, "seconds": time.perf_counter() - started, "converged": False, "cut": True}
    return {
        "iterations": result.iterations,
        "passes": result.passes,
        "seconds": result.seconds,
        "objective_initial": result.objective[0],
        "objective_final": result.objective[-1],
        "kkt_residual": result.kkt_residual,
        "converged": result.converged,
        "cut": False,
    }


def print_row(row: dict) -> None:
    base = row["solvers"].get("sequential")
    print(
        f"\n{row['model']}: {row['parameters']:,} parameters, p = {row['dag_parameters']:,}, "
        f"{row['groups']:,} free groups, {row['colours']} colours, analysis "
        f"{sum(row['analysis_seconds'].values()):.2f} s, peak RSS {row['peak_rss_gib']:.2f} GiB"
    )
    print(f"  {'solver':<14}{'iters':>7}{'passes':>8}{'seconds':>10}{'s/Mparam':>10}{'F*':>24}{'KKT':>10}  speed-up")
    for method, r in row["solvers"].items():
        ratio = (
            ""
            if base is None or method == "sequential"
            else (
                f"{base['seconds'] / r['seconds']:.1f}x"
                if not base["cut"]
                else f">{base['seconds'] / r['seconds']:.1f}x (baseline cut at KKT {base['kkt_residual']:.1e})"
            )
        )
        per_million = r["seconds"] / (row["dag_parameters"] / 1e6)
        iters = f"{r['iterations']}{'+' if r['cut'] else ''}"
        passes = r["passes"] if r["passes"] is not None else "–"
        print(
            f"  {method:<14}{iters:>7}{passes:>8}{r['seconds']:>10.3f}{per_million:>10.4f}"
            f"{r['objective_final']:>24.12g}{r['kkt_residual']:>10.1e}  {ratio}"
        )
    newton = row["solvers"].get("newton")
    for method, r in row["solvers"].items():
        if method.startswith(PAPER) and newton is not None and not r["cut"]:
            whole = r["objective_initial"] - newton["objective_final"]
            share = (r["objective_initial"] - r["objective_final"]) / whole if whole > 0 else float("nan")
            print(
                f"  the paper's practice, {r['iterations']} sequential sweeps: {r['seconds']:.3f} s, {r['passes']} "
                f"passes, F − F*(Newton) = {r['objective_final'] - newton['objective_final']:.4g} ({100 * share:.2f}% "
                f"of Newton's decrease of F; KKT {r['kkt_residual']:.1e}); Newton to KKT {newton['kkt_residual']:.1e} "
                f"is {r['seconds'] / newton['seconds']:.1f}x faster"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--solvers", nargs="+", default=["sequential", "block", "lbfgs", "newton"])
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--max-iter", type=int, default=100000)
    parser.add_argument("--sequential-budget", type=float, default=600.0, help="seconds before the baseline is cut")
    parser.add_argument(
        "--budget", type=float, default=float("inf"), help="seconds before any other solver is cut (default: none)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time a second solve, as warm_seconds (default: on a CUDA device only)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--paper-sweeps",
        type=int,
        default=0,
        help="also run N sweeps of the sequential solver (the paper's practice: 10), whatever the residual",
    )
    parser.add_argument("--json", type=Path, help="append raw rows to this JSON-lines file")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm is None:
        args.warm = args.device.startswith("cuda")
    if "families" in args.models:
        from families import FAMILIES

        at = args.models.index("families")
        args.models[at : at + 1] = [FAMILY + name for name in FAMILIES]
    if args.single:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(run_one(args.single, args)))
        return
    for name in args.models:
        command = [
            sys.executable,
            __file__,
            "--single",
            name,
            "--tol",
            str(args.tol),
            "--max-iter",
            str(args.max_iter),
            "--sequential-budget",
            str(args.sequential_budget),
            "--budget",
            str(args.budget),
            "--device",
            args.device,
            "--threads",
            str(args.threads),
            "--paper-sweeps",
            str(args.paper_sweeps),
            "--warm" if args.warm else "--no-warm",
            "--solvers",
            *args.solvers,
        ]
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode:
            print(f"{name}: failed\n{finished.stderr[-2000:]}")
            continue
        row = json.loads(finished.stdout.strip().splitlines()[-1])
        print_row(row)
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
