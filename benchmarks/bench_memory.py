"""Peak host memory of `pathcond rescale` on a large sharded ReLU MLP or conv net, against the checkpoint's size.

    python benchmarks/bench_memory.py                        # 1.5 B parameters, ~6 GB fp32, 4 shards
    python benchmarks/bench_memory.py --width 4096 --depth 4 --shards 2      # ~270 MB, for development
    python benchmarks/bench_memory.py --keep /tmp/mlp        # keep the checkpoint (and reuse it next time)
    python benchmarks/bench_memory.py --device cuda          # GPU peak too (benchmarks/gpu_check.sh runs it)
    python benchmarks/bench_memory.py --conv --width 1024 --depth 8 --shards 1   # 3x3 convs, ~0.28 GiB

The checkpoint is written by this script into a temporary directory (never committed): a
sharded safetensors checkpoint (index json + shards) of a ``depth``-layer ReLU MLP of square
``width x width`` hidden layers, or with ``--conv`` of ``depth`` 3x3 convolutions of ``width``
channels (padding 1, on ``--spatial`` x ``--spatial`` inputs) followed by a global average pool
and a Linear layer, tensor by tensor, so building it never holds more than one layer. The
architecture is embedded as the spec pathcond reads from the index's metadata.
Then the real command runs in a child process (``python -m pathcond_cli rescale --device
cpu``) and its peak resident memory (ru_maxrss of the child, which counts file pages it
mapped too) is printed next to the checkpoint's bytes and the bound 1.5 x bytes + 1 GiB, and
next to ``python -c "import torch"``'s own peak (the floor every pathcond process pays).
With ``--device cuda`` the command runs in process under a small wrapper that also records
torch's peak of allocated GPU memory, printed against the same bound; the host's peak is then
held to the issue's 1.5 x bytes + 2 GiB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def build_mlp(
    directory: Path, *, inputs: int, width: int, depth: int, outputs: int, shards: int, seed: int = 0
) -> Path:
    """A sharded fp32 ReLU MLP checkpoint ``inputs -> width x depth -> outputs``; returns the index path.

    Weights are He-scaled Gaussians; tensors are generated and written one layer at a time.
    """
    sizes = [inputs] + [width] * depth + [outputs]
    layers = [{"name": "x", "type": "input", "shape": [inputs]}]
    shapes = []
    for number in range(len(sizes) - 1):
        layers.append({"name": f"fc{number}", "type": "linear"})
        shapes.append((f"fc{number}", (sizes[number + 1], sizes[number])))
        if number < len(sizes) - 2:
            layers.append({"name": f"relu{number}", "type": "relu"})
    return _write_sharded(directory / "mlp.safetensors.index.json", layers, shapes, shards, seed)


def build_conv(
    directory: Path, *, channels: int, spatial: int, depth: int, outputs: int, shards: int, seed: int = 0
) -> Path:
    """A sharded fp32 ReLU network of ``depth`` 3x3 convolutions of ``channels`` channels (padding 1)
    on a ``channels x spatial x spatial`` input, then a global average pool and a Linear layer to
    ``outputs``; returns the index path. Written one layer at a time, as :func:`build_mlp`."""
    layers = [{"name": "x", "type": "input", "shape": [channels, spatial, spatial]}]
    shapes = []
    for number in range(depth):
        layers += [{"name": f"conv{number}", "type": "conv", "padding": 1}, {"name": f"relu{number}", "type": "relu"}]
        shapes.append((f"conv{number}", (channels, channels, 3, 3)))
    layers += [
        {"name": "pool", "type": "global_avgpool"},
        {"name": "flat", "type": "flatten"},
        {"name": "fc", "type": "linear"},
    ]
    shapes.append(("fc", (outputs, channels)))
    return _write_sharded(directory / "conv.safetensors.index.json", layers, shapes, shards, seed)


def _write_sharded(
    index: Path, layers: list[dict], weight_shapes: list[tuple[str, tuple[int, ...]]], shards: int, seed: int
) -> Path:
    """The safetensors shards of ``weight_shapes`` (each layer's weight, He-scaled Gaussian, and a
    bias), layers split evenly among ``shards``, and their index holding the spec of ``layers``."""
    import torch
    from safetensors.torch import save_file

    from pathcond_cli.io.formats.safetensors_format import SPEC_METADATA_KEY

    spec = json.dumps({"format_version": 1, "layers": layers})
    per_shard = -(-len(weight_shapes) // shards)
    generator = torch.Generator().manual_seed(seed)
    stem = index.name.split(".")[0]
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        file = f"{stem}-{shard + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for layer, shape in weight_shapes[shard * per_shard : (shard + 1) * per_shard]:
            fan_in = math.prod(shape[1:])
            tensors[f"{layer}.weight"] = torch.randn(shape, generator=generator) * (2 / fan_in) ** 0.5
            tensors[f"{layer}.bias"] = torch.randn(shape[0], generator=generator) * 0.01
        if tensors:
            save_file(tensors, str(index.parent / file))
            weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index.write_text(json.dumps({"metadata": {SPEC_METADATA_KEY: spec}, "weight_map": weight_map}))
    return index


# Runs pathcond's command line in process and writes torch's peak of allocated GPU memory
# (bytes, or "none" without CUDA) to the file named first, whatever the command's exit.
_GPU_PEAK = """
import sys, torch
from pathcond_cli.__main__ import main
record, sys.argv = sys.argv[1], ["pathcond", *sys.argv[2:]]
try:
    main()
finally:
    open(record, "w").write(str(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else "none")
"""


def checkpoint_bytes(index: Path) -> int:
    files = set(json.loads(index.read_text())["weight_map"].values())
    return sum((index.parent / file).stat().st_size for file in files)


# Forks from a small process: a child's ru_maxrss counts the pages it shared with its parent
# before exec, so measuring from a parent holding a model or torch would report the parent.
_MEASURE = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{usage.ru_maxrss * 1024} {os.waitstatus_to_exitcode(status)}")
"""


def child_peak(command: list[str], log: Path) -> tuple[int, float, int]:
    """Peak RSS in bytes (ru_maxrss of the command, from wait4 in a small wrapper process), wall
    seconds and exit status of ``command``, run from this tree (so ``-m pathcond_cli`` is its
    code); its stdout and stderr go to ``log``. ``command[0]`` is an executable's path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = log.with_suffix(".peak")
    started = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-c", _MEASURE, str(result), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            check=True,
        )
    peak, status = map(int, result.read_text().split())
    return peak, time.perf_counter() - started, status


def torch_floor(log: Path) -> int:
    """Peak RSS of a process that only imports torch."""
    return child_peak([sys.executable, "-c", "import torch"], log)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conv", action="store_true", help="3x3 convolutions instead of Linear layers")
    parser.add_argument("--inputs", type=int, default=8192, help="the MLP's input features")
    parser.add_argument("--spatial", type=int, default=8, help="the conv net's input height and width")
    parser.add_argument(
        "--width",
        type=int,
        default=16384,
        help="hidden width, or the convolutions' channels (default 16384: 1.5 B parameters at depth 6)",
    )
    parser.add_argument("--depth", type=int, default=6, help="hidden layers")
    parser.add_argument("--outputs", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="build (or reuse) the checkpoint in this folder and keep it")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where pathcond runs; cuda also records the GPU's peak"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pathcond-bench-memory-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        index = folder / f"{'conv' if args.conv else 'mlp'}.safetensors.index.json"
        if not index.is_file():
            started = time.perf_counter()
            if args.conv:
                build_conv(
                    folder,
                    channels=args.width,
                    spatial=args.spatial,
                    depth=args.depth,
                    outputs=args.outputs,
                    shards=args.shards,
                )
            else:
                build_mlp(
                    folder,
                    inputs=args.inputs,
                    width=args.width,
                    depth=args.depth,
                    outputs=args.outputs,
                    shards=args.shards,
                )
            print(f"built {index} in {time.perf_counter() - started:.1f} s")
        size = checkpoint_bytes(index)
        log = Path(scratch) / "child.log"
        floor = torch_floor(log)
        output = Path(scratch) / "out" / index.name
        output.parent.mkdir()
        gpu_record = Path(scratch) / "gpu.peak"
        launcher = (
            [sys.executable, "-m", "pathcond_cli"]
            if args.device == "cpu"
            else [sys.executable, "-c", _GPU_PEAK, str(gpu_record)]
        )
        peak, wall, status = child_peak(
            [*launcher, "rescale", str(index), "-o", str(output), "--device", args.device, "-q"], log
        )
        if status != 0:
            sys.exit(f"pathcond rescale exited {status}:\n{log.read_text()[-3000:]}")
        gpu_peak = gpu_record.read_text() if gpu_record.exists() else None
    bound = 1.5 * size + GIB
    layers = (
        f"3x3 convs of {args.width} channels on {args.spatial}x{args.spatial}"
        if args.conv
        else f"hidden layers of {args.width}"
    )
    print(f"checkpoint        {size / GIB:8.2f} GiB  ({args.depth} {layers}, {args.shards} shards)")
    print(f"import torch peak {floor / GIB:8.2f} GiB")
    print(
        f"rescale peak RSS  {peak / GIB:8.2f} GiB  = {peak / size:.2f} x the checkpoint; "
        f"above the torch floor {(peak - floor) / size:.2f} x"
    )
    if args.device == "cpu":
        print(f"bound 1.5x + 1GiB {bound / GIB:8.2f} GiB  ({'within' if peak <= bound else 'EXCEEDED'})")
    else:
        host_bound = 1.5 * size + 2 * GIB
        print(
            f"host bound        {host_bound / GIB:8.2f} GiB  "
            f"(1.5x + 2GiB: {'within' if peak <= host_bound else 'EXCEEDED'})"
        )
        if gpu_peak is None or not gpu_peak.isdigit():
            print(f"GPU peak          unavailable ({'no record' if gpu_peak is None else 'torch sees no CUDA device'})")
        else:
            gpu = int(gpu_peak)
            print(
                f"GPU peak          {gpu / GIB:8.2f} GiB  (torch.cuda.max_memory_allocated) = {gpu / size:.2f} x; "
                f"bound 1.5x + 1GiB {bound / GIB:.2f} GiB ({'within' if gpu <= bound else 'EXCEEDED'})"
            )
    print(f"wall              {wall:8.1f} s")


if __name__ == "__main__":
    main()
