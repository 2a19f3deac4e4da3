"""Seconds per stage of an in-process rescale, and the time of the path-magnitude scores
(issue 39, point 4), on one device.

    python benchmarks/bench_stages.py --device cpu --models resnet50
    python benchmarks/bench_stages.py --device cuda --models resnet50 --scores resnet18 vgg16 alexnet --json stages.json

``--models``: each is rescaled twice in-process (``rescale_module``, verified) and the second,
warm run's stage seconds printed (a first run also pays once per process for CUDA's first
calls). ``--scores``: seed 004's Table 3 figure, the path-magnitude scores of every weight in
float64 at 224², timed after one warm-up, with the device synchronised (groups and balancing
made beforehand, as ``prune`` makes them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def _synchronise(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stage_seconds(name: str, device: str) -> dict:
    """The warm run's stage seconds and wall time of rescaling model ``name`` in-process."""
    from bench_solvers import build

    import pathcond_cli as pathcond

    row = {}
    for run in ("first", "warm"):
        module, shape = build(name)
        start = time.perf_counter()
        result = pathcond.rescale_module(module, shape, device=device)
        _synchronise(device)
        row[run] = {"wall": time.perf_counter() - start, "stages": dict(result.seconds)}
    return {"model": name, "device": device, **row}


def score_seconds(name: str, device: str) -> dict:
    """Seconds of the path-magnitude scores of model ``name`` (after a warm-up run)."""
    from bench_solvers import build

    from pathcond_cli.engine.diag import balancing_exponents, path_magnitude_scores
    from pathcond_cli.engine.groups import build_groups
    from pathcond_cli.io.formats.fx_import import module_import

    module, shape = build(name)
    graph, params, _ = module_import(module, tuple(shape), source=name)
    groups = build_groups(graph, params).to(device)
    u_ext = groups.extend(balancing_exponents(groups))
    timings = []
    for _ in range(2):
        _synchronise(device)
        start = time.perf_counter()
        path_magnitude_scores(groups, device=device, u_ext=u_ext)
        _synchronise(device)
        timings.append(time.perf_counter() - start)
    return {"model": name, "device": device, "parameters": groups.p, "first": timings[0], "warm": timings[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="*", default=["resnet50"])
    parser.add_argument("--scores", nargs="*", default=[])
    parser.add_argument("--json", type=Path, help="append the rows to this JSON-lines file")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        row = stage_seconds(name, args.device)
        stages = ", ".join(f"{stage} {seconds:.3f}" for stage, seconds in row["warm"]["stages"].items())
        print(
            f"{name} on {args.device}: warm {row['warm']['wall']:.2f} s (first {row['first']['wall']:.2f} s): {stages}"
        )
        rows.append({"kind": "stages", **row})
    for name in args.scores:
        row = score_seconds(name, args.device)
        print(
            f"{name} path-magnitude scores on {args.device}: {row['warm'] * 1e3:.1f} ms warm "
            f"({row['first'] * 1e3:.1f} ms first), p = {row['parameters']:,}"
        )
        rows.append({"kind": "scores", **row})
    if args.json:
        with open(args.json, "a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
