"""pathcond 0.5.0 against the working tree: whole `pathcond rescale` processes side by side (issue 28, point 6).

    python benchmarks/bench_versions.py                                  # all four models, best of 3
    python benchmarks/bench_versions.py --models resnet50 mlp200 --repeats 2
    python benchmarks/bench_versions.py --baseline 0.5.0 --keep /tmp/pathcond-bench-models

The baseline runs from a git worktree of the commit that set its version in pyproject.toml,
made under /tmp (kept for the next run; ``git worktree remove`` drops it). Both trees run
``python -m pathcond_cli rescale MODEL -o OUT --device cpu -q`` with one thread
(OMP_NUM_THREADS=1, which both versions' torch obeys), alternated, each model ``--repeats``
times; each figure is the best over the repeats: wall time, CPU time (user + system of the
child, from wait4) and peak RSS (ru_maxrss). Each model is also timed against its floors on the
same machine, measured in a process of their own: reading the input's files (from the page
cache, as pathcond reads them after the first run), one float64 forward pass of the network
(pathcond's evaluator, batch 1) and writing the output's bytes (fsync included, as pathcond's
writer does). After the table, a line per model gives the CPU seconds of the work any version
must do (``_REQUIRED``: the imports, the verification's forward passes, the squared-network
passes) and the largest CPU ratio against the baseline that this work allows.

Models, built once (``--keep`` reuses a folder): ResNet-50, DenseNet-121 and VGG-11 with
BatchNorm exported to ONNX at 224x224 (BatchNorm kept, random statistics: a calibrated network),
and a 201 MB fp32 safetensors MLP 4096-4096x3-10 with a JSON spec.
Targets (issue 28): CPU time at least 2x lower on ResNet-50 and 3x lower on the MLP, peak RSS
no higher.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
MIB = 2**20

# Spawns the command from a small process and reports its wall time and wait4's usage: a child's
# ru_maxrss counts the pages it shared with its parent before exec, so a parent holding torch
# would report its own.
_MEASURE = """
import os, sys, time
started = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - started
open(sys.argv[1], "w").write(f"{wall} {usage.ru_utime + usage.ru_stime} {usage.ru_maxrss * 1024} "
                             f"{os.waitstatus_to_exitcode(status)}")
"""

# The floors of one model, in the working tree: seconds to read its files, run one float64
# forward pass, and write ``output_bytes`` (fsync included). Prints one JSON object.
_FLOORS = """
import json, os, sys, time
import torch
from pathcond_cli.model_files import load
from pathcond_cli.engine.evaluate import forward

model_args, files, output_bytes = json.loads(sys.argv[1])
started = time.perf_counter()
for file in files:
    with open(file, "rb") as handle:
        while handle.read(64 << 20):
            pass
read = time.perf_counter() - started
model = load(model_args[0], arch=model_args[1] if len(model_args) > 1 else None)
inputs = {node.name: torch.randn(1, *node.shape, dtype=torch.float64) for node in model.graph.inputs}
with torch.no_grad():
    forward(model.graph, model.params, inputs)  # warm-up: first-call allocations
    started = time.perf_counter()
    forward(model.graph, model.params, inputs)
    forward_seconds = time.perf_counter() - started
path = os.path.join(os.path.dirname(files[0]), "floor-write.bin")
block = b"\\0" * (64 << 20)
started = time.perf_counter()
with open(path, "wb") as out:
    left = output_bytes
    while left > 0:
        left -= out.write(block[:min(left, len(block))])
    out.flush()
    os.fsync(out.fileno())
write = time.perf_counter() - started
os.remove(path)
print(json.dumps({"read": read, "forward": forward_seconds, "write": write}))
"""


# The CPU seconds of the work every `rescale` must do, whatever the version: importing torch and
# pathcond, the verification's float64 forward passes (SPEC.md's eval and train modes, original
# and written network, at the verification's batch) and the squared-network passes (diag(G) and
# ℓ2, the path count, ℓ1, and ℓ1 and ℓ2 of the written file, which issue 26 requires). The
# baseline's CPU time over their sum is the largest ratio any version doing this work can reach.
# Prints one JSON object.
_REQUIRED = """
import json, sys, time
import torch
from pathcond_cli.model_files import load
imported = time.process_time()
from pathcond_cli.engine.diag import balancing_exponents, diag_g_and_l2_norm, path_count, path_norms
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.verify import compare

model_args = json.loads(sys.argv[1])
model = load(model_args[0], arch=model_args[1] if len(model_args) > 1 else None)
groups = build_groups(model.graph, model.params)
u_ext = groups.extend(balancing_exponents(groups))
started = time.process_time()
compare(model.graph, model.params, model.params)
verification = time.process_time() - started
started = time.process_time()
diag_g_and_l2_norm(groups, u_ext=u_ext)
path_count(groups)
path_norms(groups, [1.0], u_ext=u_ext)
path_norms(groups, [1.0, 2.0], u_ext=u_ext)
squared = time.process_time() - started
print(json.dumps({"import": imported, "verification": verification, "squared_networks": squared}))
"""


@dataclass
class Run:
    wall: float
    cpu: float
    peak_rss: int


# -- models -----------------------------------------------------------------------------------


def _densenet121():
    """torchvision's DenseNet-121 layout (growth 32, blocks 6-12-24-16, bottleneck 4 x growth,
    compression 0.5), written with plain modules: torchvision's compiled ops do not load here."""
    import torch
    from torch import nn

    class DenseLayer(nn.Module):
        def __init__(self, channels: int, growth: int = 32, bottleneck: int = 4):
            super().__init__()
            self.body = nn.Sequential(
                nn.BatchNorm2d(channels),
                nn.ReLU(),
                nn.Conv2d(channels, bottleneck * growth, 1, bias=False),
                nn.BatchNorm2d(bottleneck * growth),
                nn.ReLU(),
                nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False),
            )

        def forward(self, x):
            return torch.cat([x, self.body(x)], 1)

    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    channels = 64
    for number, depth in enumerate((6, 12, 24, 16)):
        for _ in range(depth):
            layers.append(DenseLayer(channels))
            channels += 32
        if number < 3:
            layers += [
                nn.BatchNorm2d(channels),
                nn.ReLU(),
                nn.Conv2d(channels, channels // 2, 1, bias=False),
                nn.AvgPool2d(2, stride=2),
            ]
            channels //= 2
    layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 1000)]
    return nn.Sequential(*layers)


def _vgg11_bn():
    from reference_models import VGG, _vgg_features

    return VGG(_vgg_features([64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"], batch_norm=True))


def _resnet50():
    from reference_models import resnet50

    return resnet50()


ONNX_MODELS = {"resnet50": _resnet50, "densenet121": _densenet121, "vgg11_bn": _vgg11_bn}
MODELS = (*ONNX_MODELS, "mlp200")


def build(name: str, folder: Path) -> list[str]:
    """The model's files in ``folder`` (built unless there), as pathcond's arguments."""
    if name == "mlp200":
        return _build_mlp(folder)
    import torch
    from reference_models import randomize_batchnorm

    path = folder / f"{name}.onnx"
    if not path.is_file():
        torch.manual_seed(0)
        module = randomize_batchnorm(ONNX_MODELS[name]()).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (torch.zeros(1, 3, 224, 224),),
                str(path),
                dynamo=False,
                opset_version=17,
                do_constant_folding=False,
                input_names=["x"],
                dynamic_axes={"x": {0: "batch"}},
            )
    return [str(path)]


def _build_mlp(folder: Path, sizes: tuple[int, ...] = (4096, 4096, 4096, 4096, 10)) -> list[str]:
    import torch
    from safetensors.torch import save_file

    checkpoint, spec = folder / "mlp200.safetensors", folder / "mlp200.json"
    if not checkpoint.is_file():
        generator = torch.Generator().manual_seed(0)
        tensors, layers = {}, [{"name": "x", "type": "input", "shape": [sizes[0]]}]
        for number, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            tensors[f"fc{number}.weight"] = torch.randn(fan_out, fan_in, generator=generator) * (2 / fan_in) ** 0.5
            tensors[f"fc{number}.bias"] = torch.randn(fan_out, generator=generator) * 0.01
            layers.append({"name": f"fc{number}", "type": "linear"})
            if number < len(sizes) - 2:
                layers.append({"name": f"relu{number}", "type": "relu"})
        # The metadata also moves the header's length off 640, whose first bytes (80 02) 0.5.0
        # takes for a pickle's and refuses.
        save_file(tensors, str(checkpoint), metadata={"built_by": "benchmarks/bench_versions.py"})
        spec.write_text(json.dumps({"format_version": 1, "layers": layers}))
    return [str(checkpoint), "--arch", str(spec)]


# -- runs -------------------------------------------------------------------------------------


def baseline_tree(version: str) -> Path:
    """A worktree under /tmp of the commit that set ``version`` in pyproject.toml (made once)."""
    tree = Path(tempfile.gettempdir()) / f"pathcond-{version}"
    if (tree / "pathcond_cli").is_dir():
        return tree
    git = ["git", "-C", str(ROOT)]
    candidates = subprocess.run(
        [*git, "log", "--format=%H", "-S", f'version = "{version}"', "--", "pyproject.toml"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for commit in candidates:
        text = subprocess.run(
            [*git, "show", f"{commit}:pyproject.toml"], capture_output=True, text=True, check=False
        ).stdout
        if f'version = "{version}"' in text:
            subprocess.run([*git, "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
            return tree
    sys.exit(f"no commit sets version {version} in pyproject.toml")


def measure(command: list[str], cwd: Path, log: Path) -> Run:
    env = {**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = log.with_suffix(".usage")
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-c", _MEASURE, str(result), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            check=True,
        )
    wall, cpu, peak, status = result.read_text().split()
    if int(status):
        sys.exit(f"{' '.join(command)} exited {status} in {cwd}; its output is in {log}")
    return Run(float(wall), float(cpu), int(peak))


def _in_working_tree(script: str, payload: str, scratch: Path) -> dict[str, float]:
    """Run one of the scripts above in a process of its own, on the working tree, one thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, payload], capture_output=True, text=True, env=env, cwd=scratch, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def floors(model_args: list[str], output: Path, scratch: Path) -> dict[str, float]:
    files = [model_args[0]] + ([model_args[2]] if len(model_args) > 2 else [])
    return _in_working_tree(
        _FLOORS, json.dumps([[model_args[0], *model_args[2:3]], files, output.stat().st_size]), scratch
    )


def required_work(model_args: list[str], scratch: Path) -> dict[str, float]:
    return _in_working_tree(_REQUIRED, json.dumps([model_args[0], *model_args[2:3]]), scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each version per model; the best is shown")
    parser.add_argument("--baseline", default="0.5.0", help="the version compared with the working tree")
    parser.add_argument("--keep", type=Path, help="build (or reuse) the models in this folder and keep them")
    parser.add_argument("--json", type=Path, help="append each model's figures to this JSON-lines file")
    args = parser.parse_args()
    trees = {args.baseline: baseline_tree(args.baseline), "tree": ROOT}
    with tempfile.TemporaryDirectory(prefix="pathcond-bench-versions-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        print(
            "| model | input | version | wall (s) | CPU (s) | peak RSS (GiB) | floors: read / forward / write (s) "
            "| wall / floors |\n| --- | ---: | --- | ---: | ---: | ---: | --- | ---: |",
            flush=True,
        )
        notes: list[str] = []
        for name in args.models:
            model_args = build(name, folder)
            size = sum(Path(file).stat().st_size for file in model_args[:1] + model_args[2:3])
            output = Path(scratch) / f"out-{Path(model_args[0]).name}"
            runs: dict[str, list[Run]] = {label: [] for label in trees}
            for repeat in range(args.repeats):
                for label, tree in trees.items():  # alternated: a change of load hits both
                    command = [
                        sys.executable,
                        "-m",
                        "pathcond_cli",
                        "rescale",
                        *model_args,
                        "-o",
                        str(output),
                        "--device",
                        "cpu",
                        "-q",
                    ]
                    runs[label].append(measure(command, tree, Path(scratch) / f"{name}-{label}-{repeat}.log"))
            floor = floors(model_args, output, Path(scratch))
            floor_total = sum(floor.values())
            best = {
                label: Run(min(r.wall for r in done), min(r.cpu for r in done), min(r.peak_rss for r in done))
                for label, done in runs.items()
            }
            for label, run in best.items():
                print(
                    f"| {name} | {size / MIB:,.0f} MiB | {label} | {run.wall:.2f} | {run.cpu:.2f} "
                    f"| {run.peak_rss / 2**30:.2f} | {floor['read']:.2f} / {floor['forward']:.2f} / "
                    f"{floor['write']:.2f} | {run.wall / floor_total:.1f} |",
                    flush=True,
                )
            old, new = best[args.baseline], best["tree"]
            print(
                f"| {name} | | **{args.baseline} / tree** | {old.wall / new.wall:.2f}x | {old.cpu / new.cpu:.2f}x "
                f"| {old.peak_rss / new.peak_rss:.2f}x | | |",
                flush=True,
            )
            required = required_work(model_args, Path(scratch))
            summed = sum(required.values())
            notes.append(
                f"{name}: required work {required['import']:.2f} s import + {required['verification']:.2f} s "
                f"verification forwards + {required['squared_networks']:.2f} s squared-network passes = "
                f"{summed:.2f} s CPU; {args.baseline}'s best CPU over it: {old.cpu / summed:.2f}x, the "
                "largest CPU ratio a version doing this work can reach"
            )
            if args.json:
                with open(args.json, "a") as handle:
                    handle.write(
                        json.dumps(
                            {
                                "model": name,
                                "bytes": size,
                                "floors": floor,
                                "required": required,
                                "best": {label: vars(run) for label, run in best.items()},
                                "runs": {label: [vars(r) for r in done] for label, done in runs.items()},
                            }
                        )
                        + "\n"
                    )
        print("", *notes, sep="\n")


if __name__ == "__main__":
    main()
