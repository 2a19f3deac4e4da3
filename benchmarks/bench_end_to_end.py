"""End-to-end benchmark: the real `pathcond rescale` (or `inspect`) command in a child process.

    python benchmarks/bench_end_to_end.py                          # ResNet-50, 224x224, ONNX, fp32
    python benchmarks/bench_end_to_end.py --model mlp3             # the paper's CIFAR MLP 3072-500x3-10,
                                                                   # safetensors + spec
    python benchmarks/bench_end_to_end.py --model vgg16 --command inspect --repeat 3

ONNX models are exported with BatchNormalization nodes kept; ``--format safetensors`` (the
default for the MLPs) writes the state dict and a spec file, passed with --arch. Each run
prints the wall time of the child process, its per-stage seconds (from its JSON report),
the seconds outside those stages (interpreter start, imports, argument parsing, report
building) and the child's peak resident memory; with --repeat the best run is shown, and
`python -c "import torch"` is timed alongside to show the floor that importing torch sets.
Targets (issue 13): MLP wall <= 3.0 s with in-process stages <= 0.3 s; ResNet-50 <= 8 s.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

IN_PROCESS_STAGES = ("load", "groups", "diag_g", "path_count", "solve", "apply", "write", "verify_written")


def export_onnx(name: str, directory: Path) -> list[str]:
    import torch
    from reference_models import REFERENCE_MODELS

    torch.manual_seed(0)
    factory, shape, _, _ = REFERENCE_MODELS[name]
    path = directory / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            factory().eval(),
            (torch.zeros(1, *shape),),
            str(path),
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "batch"}},
        )
    return [str(path)]


def export_safetensors(name: str, directory: Path) -> list[str]:
    import torch
    import yaml
    from reference_models import REFERENCE_MODELS
    from safetensors.torch import save_file

    from pathcond_cli.io.formats.fx_import import graph_from_module
    from pathcond_cli.io.formats.spec import spec_from_graph

    torch.manual_seed(0)
    factory, shape, _, _ = REFERENCE_MODELS[name]
    module = factory().eval()
    graph, _ = graph_from_module(module, tuple(shape), source=name)
    checkpoint, spec = directory / f"{name}.safetensors", directory / f"{name}.yaml"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(checkpoint))
    spec.write_text(yaml.safe_dump(spec_from_graph(graph)))
    return [str(checkpoint), "--arch", str(spec)]


def _seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument(
        "--format",
        choices=["onnx", "safetensors"],
        default=None,
        help="default: safetensors for the MLPs, onnx otherwise",
    )
    parser.add_argument("--command", default="rescale", choices=["rescale", "inspect"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=1, help="runs; the fastest is reported")
    parser.add_argument("--json", type=Path, help="append the best run's figures to this JSON-lines file")
    args = parser.parse_args()
    fmt = args.format or ("safetensors" if args.model.startswith("mlp") else "onnx")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        model = (export_safetensors if fmt == "safetensors" else export_onnx)(args.model, Path(scratch))
        size_mib = Path(model[0]).stat().st_size / 2**20
        command = [sys.executable, "-m", "pathcond_cli", args.command, *model, "--json", "--device", args.device]
        if args.command == "rescale":
            command += ["-o", str(Path(scratch) / f"out.{fmt}")]
        for _ in range(args.repeat):
            started = time.perf_counter()
            finished = subprocess.run(command, capture_output=True, text=True)
            wall = time.perf_counter() - started
            if finished.returncode:
                sys.exit(f"pathcond exited {finished.returncode}:\n{finished.stderr}")
            runs.append((wall, json.loads(finished.stdout)))
        import_torch = min(_seconds([sys.executable, "-c", "import torch"]) for _ in range(args.repeat))
        help_seconds = min(_seconds([sys.executable, "-m", "pathcond_cli", "--help"]) for _ in range(args.repeat))
    wall, report = min(runs, key=lambda run: run[0])
    seconds = report["seconds"]
    staged = sum(seconds.get(stage, 0.0) for stage in IN_PROCESS_STAGES)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(
        f"{args.command} {args.model} ({fmt}, {size_mib:.1f} MiB, {report['dag_parameters']:,} DAG parameters, "
        f"device {report['device']}): wall {wall:.2f} s (best of {len(runs)}: "
        f"{', '.join(f'{w:.2f}' for w, _ in runs)}), peak RSS {peak:.2f} GiB"
    )
    print("  stages: " + ", ".join(f"{k} {v:.3f}s" for k, v in seconds.items()))
    print(
        f"  in-process stages {staged:.3f} s; outside them (interpreter, imports, parsing, report) "
        f"{wall - staged:.2f} s; `import torch` alone {import_torch:.2f} s; `pathcond --help` {help_seconds:.2f} s"
    )
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(
                json.dumps(
                    {
                        "model": args.model,
                        "command": args.command,
                        "device": report["device"],
                        "wall_seconds": wall,
                        "staged_seconds": staged,
                        "seconds": seconds,
                        "peak_rss_gib": peak,
                    }
                )
                + "\n"
            )
    if "solver" in report:
        solver = report["solver"]
        print(
            f"  solver {solver['name']}: {solver['iterations']} iterations, {solver['passes']} passes, "
            f"KKT {solver['kkt_residual']:.1e}, converged {solver['converged']}; "
            f"verification max rel {report['verification']['max_rel_error']:.2e}; "
            f"D {report['conditioning']['before']['D']:.6g} -> {report['conditioning']['after']['D']:.6g}"
        )


if __name__ == "__main__":
    main()
