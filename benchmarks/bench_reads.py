"""How many times `pathcond rescale` (or `inspect`) reads each checkpoint tensor's values (issue 28).

    python benchmarks/bench_reads.py                       # 200 MB safetensors MLP and the sample ONNX ResNet
    python benchmarks/bench_reads.py --width 1024          # a 12 MB MLP, for development
    python benchmarks/bench_reads.py --command inspect --sites

The command runs in process, one thread (``OMP_NUM_THREADS=1``), with the functions that read tensor values wrapped:
``MappedTensors.__getitem__`` (one ``pread`` of a safetensors tensor: a full read) and
``onnx.numpy_helper.to_array`` (an ONNX tensor's bytes turned into values). Each read is
counted per file and tensor: the input checkpoint, and the file `rescale` writes and reads
back to verify it (an ONNX model's input tensors are converted once, when it is loaded, and
held). The MLP (``depth`` square ``width x width`` layers after an input of ``width``,
4096 → 200 MB of float32, 8 tensors) is written into a temporary directory; the ONNX model is
``sample_models/resnet_small.onnx``. ``--sites`` prints which pathcond functions read, so a
pass that reads more than it should can be found.

Issue 28's target is at most 3 full reads per tensor per `rescale` (diag(G), write, verify)
of the input. pathcond 0.5.0 read each tensor of the 200 MB MLP about 36 times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# One thread, set before torch starts its pools; pathcond takes it as the CPUs it may use (and
# a version without --threads, compared side by side, runs with it too).
os.environ["OMP_NUM_THREADS"] = "1"

import onnx.numpy_helper  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pathcond_cli.cli.app import main as pathcond_main  # noqa: E402
from pathcond_cli.io.formats.safetensors_format import SPEC_METADATA_KEY, MappedTensors  # noqa: E402

# Frames that only pass a read on: the site printed is the pathcond function behind them.
_PASS_THROUGH = {
    "__getitem__",
    "<lambda>",
    "value",
    "affine",
    "<listcomp>",
    "<genexpr>",
    "<dictcomp>",
    "__call__",
    "get",
    "__iter__",
    "param",
    "wrapped_getitem",
    "wrapped_to_array",
}


class ReadCounter:
    """Reads per (file, tensor) and per call site."""

    def __init__(self):
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def count(self, file: str, key: str) -> None:
        self.reads[file, key] += 1
        frames = [
            f for f in traceback.extract_stack()[:-2] if "pathcond_cli" in f.filename and f.name not in _PASS_THROUGH
        ]
        self.sites[f"{file}: " + " <- ".join(f"{f.name}" for f in reversed(frames[-3:]))] += 1

    def per_file(self) -> dict[str, dict[str, int]]:
        files: dict[str, dict[str, int]] = {}
        for (file, key), count in sorted(self.reads.items()):
            files.setdefault(file, {})[key] = count
        return files


@contextmanager
def counting_reads() -> Iterator[ReadCounter]:
    """Count every full read of a tensor's values while the block runs."""
    counter = ReadCounter()
    getitem, to_array = MappedTensors.__getitem__, onnx.numpy_helper.to_array

    def wrapped_getitem(self, key):
        tensor = getitem(self, key)  # a missing key is a KeyError, no read
        counter.count(Path(self._path).name, key)
        return tensor

    def wrapped_to_array(tensor, *args, **kwargs):
        # An ONNX file is read whole when parsed; its tensors become values here. The written
        # file is converted while it is verified, the input when it is loaded.
        verifying = any(f.name == "_verify_written" for f in traceback.extract_stack())
        counter.count("written .onnx" if verifying else "input .onnx", tensor.name)
        return to_array(tensor, *args, **kwargs)

    MappedTensors.__getitem__ = wrapped_getitem
    onnx.numpy_helper.to_array = wrapped_to_array
    try:
        yield counter
    finally:
        MappedTensors.__getitem__, onnx.numpy_helper.to_array = getitem, to_array


def build_mlp(path: Path, width: int, depth: int, outputs: int = 10) -> Path:
    """A float32 ReLU MLP ``width -> width x depth -> outputs`` with its spec embedded."""
    sizes = [width] * (depth + 1) + [outputs]
    layers = [{"name": "x", "type": "input", "shape": [width]}]
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for number, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if number:
            layers.append({"name": f"relu{number}", "type": "relu"})
        layers.append({"name": f"fc{number}", "type": "linear"})
        tensors[f"fc{number}.weight"] = torch.randn(fan_out, fan_in, generator=generator) * (2 / fan_in) ** 0.5
        tensors[f"fc{number}.bias"] = 0.1 * torch.randn(fan_out, generator=generator)
    save_file(tensors, str(path), metadata={SPEC_METADATA_KEY: json.dumps({"format_version": 1, "layers": layers})})
    return path


def run_command(command: str, model: Path, output: Path | None) -> float:
    """``pathcond COMMAND MODEL`` in process, one thread; its wall seconds."""
    argv = ["pathcond", command, str(model), "--quiet", "--device", "cpu"]
    if output is not None:
        argv += ["-o", str(output)]
    sys.argv = argv
    started = time.perf_counter()
    try:
        pathcond_main()
    except SystemExit as exit_:
        if exit_.code:
            raise RuntimeError(f"{' '.join(argv)} exited {exit_.code}") from None
    return time.perf_counter() - started


def measure(label: str, command: str, model: Path, output: Path | None, sites: bool) -> dict:
    with counting_reads() as counter:
        seconds = run_command(command, model, output)
    files = counter.per_file()
    print(f"\n{label}: pathcond {command}, {model.stat().st_size / 1e6:.0f} MB, {seconds:.2f} s")
    for file, counts in files.items():
        values = sorted(counts.values())
        print(
            f"  {file}: {len(counts)} tensors read, full reads per tensor: max {values[-1]}, "
            f"median {values[len(values) // 2]}, min {values[0]}"
        )
    if sites:
        for site, count in counter.sites.most_common():
            print(f"    {count:5d}  {site}")
    return {
        "label": label,
        "command": command,
        "seconds": round(seconds, 3),
        "max_reads": {file: max(counts.values()) for file, counts in files.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096, help="MLP width (4096: 200 MB)")
    parser.add_argument("--depth", type=int, default=3, help="hidden square layers after the first")
    parser.add_argument("--command", choices=("rescale", "inspect"), default="rescale")
    parser.add_argument("--onnx", type=Path, default=ROOT / "sample_models" / "resnet_small.onnx")
    parser.add_argument("--sites", action="store_true", help="print the pathcond functions that read")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line at the end")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_reads") as directory:
        folder = Path(directory)
        mlp = build_mlp(folder / "mlp.safetensors", args.width, args.depth)
        rescaling = args.command == "rescale"
        results.append(
            measure(
                "safetensors MLP", args.command, mlp, folder / "mlp.out.safetensors" if rescaling else None, args.sites
            )
        )
        results.append(
            measure("ONNX CNN", args.command, args.onnx, folder / "cnn.out.onnx" if rescaling else None, args.sites)
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
