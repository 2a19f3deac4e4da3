"""Time the analysis stages (groups, diag(G), path count) on reference models.

    python benchmarks/bench_analysis.py [--models mlp3 resnet50] [--repeat 3] [--threads N]

Prints the best of ``--repeat`` runs per stage, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import reference_models  # noqa: E402

from pathcond_cli.engine.diag import diag_g, path_count  # noqa: E402
from pathcond_cli.engine.groups import build_groups  # noqa: E402
from pathcond_cli.module_route import module_model  # noqa: E402

MODELS = {
    "mlp3": (lambda: reference_models.mlp(3), (3072,)),
    "resnet50": (reference_models.resnet50, (3, 224, 224)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.models:
        factory, shape = MODELS[name]
        model = module_model(factory(), shape)
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            start = time.perf_counter()
            groups = build_groups(model.graph, model.params)
            middle = time.perf_counter()
            diag_g(groups)
            end = time.perf_counter()
            path_count(groups)
            stop = time.perf_counter()
            for stage, seconds in (("groups", middle - start), ("diag_g", end - middle), ("path_count", stop - end)):
                best[stage] = min(best.get(stage, float("inf")), seconds)
        shown = "  ".join(f"{stage} {seconds:.3f} s" for stage, seconds in best.items())
        print(f"{name:10s} p={groups.p:,}  {shown}")


if __name__ == "__main__":
    main()
