"""End-to-end benchmark (issue 6): `pathcond rescale` on an ImageNet model exported to ONNX.

    python benchmarks/bench_end_to_end.py                  # ResNet-50, 224x224, fp32
    python benchmarks/bench_end_to_end.py --model vgg16 --command inspect

Exports the reference model (BatchNormalization nodes kept), runs the real console command in
a child process and prints its wall time, the child's peak resident memory and the per-stage
seconds from its JSON report.
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


def export(name: str, directory: Path) -> Path:
    import torch

    from reference_models import REFERENCE_MODELS

    torch.manual_seed(0)
    factory, shape, _, _ = REFERENCE_MODELS[name]
    path = directory / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(factory().eval(), (torch.zeros(1, *shape),), str(path), dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--command", default="rescale", choices=["rescale", "inspect"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = export(args.model, Path(scratch))
        command = [sys.executable, "-m", "pathcond_cli.cli", args.command, str(model), "--json", "--device", args.device]
        if args.command == "rescale":
            command += ["-o", str(Path(scratch) / "out.onnx")]
        size_mib = model.stat().st_size / 2**20
        started = time.perf_counter()
        finished = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - started
    if finished.returncode:
        sys.exit(f"pathcond exited {finished.returncode}:\n{finished.stderr}")
    report = json.loads(finished.stdout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"{args.command} {args.model} ({size_mib:.0f} MiB ONNX, fp32, device {args.device}): "
          f"wall {wall:.1f} s, peak RSS {peak:.2f} GiB")
    print("  stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in report["seconds"].items()))
    if "solver" in report:
        solver = report["solver"]
        print(f"  solver {solver['name']}: {solver['iterations']} iterations, {solver['passes']} passes, "
              f"KKT {solver['kkt_residual']:.1e}, converged {solver['converged']}; "
              f"verification max rel {report['verification']['max_rel_error']:.2e}")


if __name__ == "__main__":
    main()
