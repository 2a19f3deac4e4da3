"""What the path-lifting toolkit costs against one forward pass (issue 26, point 5).

    python benchmarks/bench_pathlift.py [--models resnet50 mlp3] [--repeat 3] [--threads N] [--cli]

Per model, best of ``--repeat``: the network's own forward pass (pathcond's evaluator, float64,
batch 1: what "one forward pass" means in the issue), the path count's pass, the balancing,
each path norm (ℓ1, ℓ2: a balancing and one pass of the squared network each), all
path-magnitude scores (a balancing, one forward and one backward pass), and the ℓ1
path-metric's upper bound between the model and a perturbed copy (two balancings, two
streams). Ratios are against the network's forward pass. With ``--cli``, the model is
exported to ONNX (BatchNorm kept) and
``pathcond inspect A`` is timed against ``pathcond compare A B`` (B: A rescaled by pathcond)
as whole processes, alternated.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import reference_models  # noqa: E402

from pathcond_cli.engine.diag import balancing_exponents, path_count, path_magnitude_scores, path_norm  # noqa: E402
from pathcond_cli.engine.evaluate import forward  # noqa: E402
from pathcond_cli.engine.groups import build_groups  # noqa: E402
from pathcond_cli.engine.pathlift import telescoped_sum  # noqa: E402
from pathcond_cli.module_route import module_model  # noqa: E402

MODELS = {
    "mlp3": (lambda: reference_models.mlp(3), (3072,)),
    "resnet18": (reference_models.resnet18, (3, 224, 224)),
    "resnet50": (reference_models.resnet50, (3, 224, 224)),
}


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def in_process(name: str, repeat: int) -> None:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    module = factory().eval()
    model = module_model(module, shape)
    groups = build_groups(model.graph, model.params)
    perturbed = {
        key: tensor * (1 + 0.01 * (2 * torch.rand(tensor.shape) - 1)) if tensor.is_floating_point() else tensor
        for key, tensor in model.params.items()
    }
    other = build_groups(model.graph, perturbed)
    x = torch.randn(1, *shape, dtype=torch.float64)
    figures = {
        "network forward (float64)": best_of(repeat, lambda: forward(model.graph, model.params, x)),
        "path count pass": best_of(repeat, lambda: path_count(groups)),
        "balancing": best_of(repeat, lambda: balancing_exponents(groups)),
        "path norm l1": best_of(repeat, lambda: path_norm(groups, 1)),
        "path norm l2": best_of(repeat, lambda: path_norm(groups, 2)),
        "all path-magnitude scores": best_of(repeat, lambda: path_magnitude_scores(groups)),
        "path-metric upper bound": best_of(repeat, lambda: telescoped_sum(groups, other)),
    }
    network = figures["network forward (float64)"]
    print(f"\n{name}: p = {groups.p:,}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for label, seconds in figures.items():
        print(f"  {label:28s} {seconds:8.3f} s   {seconds / network:5.2f} x forward")


def cli(name: str, repeat: int) -> None:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    module = factory().eval()
    with tempfile.TemporaryDirectory() as scratch:
        first, second = Path(scratch) / "a.onnx", Path(scratch) / "b.onnx"
        torch.onnx.export(
            module,
            (torch.randn(1, *shape),),
            str(first),
            dynamo=False,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["y"],
        )
        command = [sys.executable, "-m", "pathcond_cli"]
        subprocess.run([*command, "rescale", str(first), "-o", str(second), "-q", "--device", "cpu"], check=True)
        timings: dict[str, list[float]] = {"inspect A": [], "compare A B": []}
        for _ in range(repeat):
            for label, args in (
                ("inspect A", ["inspect", str(first)]),
                ("compare A B", ["compare", str(first), str(second)]),
            ):
                start = time.perf_counter()
                subprocess.run([*command, *args, "-q", "--device", "cpu"], check=True)
                timings[label].append(time.perf_counter() - start)
        inspect_time, compare_time = min(timings["inspect A"]), min(timings["compare A B"])
        print(
            f"\n{name} ONNX, whole processes, best of {repeat}: inspect {inspect_time:.2f} s, compare "
            f"{compare_time:.2f} s, ratio {compare_time / inspect_time:.2f} (target ≤ 2)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mlp3", "resnet50"], choices=list(MODELS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cli", action="store_true", help="also time inspect against compare as processes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.models:
        in_process(name, args.repeat)
        if args.cli:
            cli(name, args.repeat)


if __name__ == "__main__":
    main()
