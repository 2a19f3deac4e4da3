"""Many checkpoints: N copies of the sample MLP rescaled by one `pathcond` process against N processes.

    python benchmarks/bench_many.py                    # N = 100, every one of the N processes timed
    python benchmarks/bench_many.py --separate 20      # time 20 separate processes, extrapolate to N
    python benchmarks/bench_many.py --threads 1        # OMP_NUM_THREADS=1 for every child

The files (sample_models/mlp.safetensors, 0.9 MB each, with sample_models/mlp.yaml) are copied
into a temporary folder. One process: ``pathcond rescale F1 ... FN --arch mlp.yaml --output-dir
OUT --json``, its wall time, its CPU time (user + system: on a machine shared with other work,
the wall time grows with the load, the CPU time far less), its peak resident memory and the sum
of the in-process stages of its N JSON lines (what each file costs once torch is loaded).
N processes: ``pathcond rescale Fi
--arch mlp.yaml -o OUT/Fi --json`` one after another, as a shell loop runs them. Target (issue
20): N = 100 in one process in <= 15 s on the project's 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
IN_PROCESS_STAGES = ("load", "groups", "diag_g", "path_count", "solve", "apply", "write", "verify_written")


def command(*args: object) -> list[str]:
    return [sys.executable, "-m", "pathcond_cli", "rescale", *map(str, args)]


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    completed = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        sys.exit(f"exit {completed.returncode}: {' '.join(args[:6])} ...\n{completed.stderr[-2000:]}")
    return seconds, completed.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--files", type=int, default=100, help="number of checkpoints (default 100)")
    parser.add_argument(
        "--separate",
        type=int,
        default=None,
        help="time only this many separate processes and extrapolate to N (default: all N)",
    )
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every child")
    options = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if options.threads is not None:
        env["OMP_NUM_THREADS"] = str(options.threads)
    separate = min(options.separate or options.files, options.files)
    print(
        f"{options.files} copies of {SAMPLES / 'mlp.safetensors'}; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}"
    )

    with tempfile.TemporaryDirectory(prefix="bench-many-") as name:
        folder = Path(name)
        inputs = folder / "in"
        inputs.mkdir()
        files = []
        for index in range(options.files):
            files.append(inputs / f"run{index:04d}.safetensors")
            shutil.copyfile(SAMPLES / "mlp.safetensors", files[-1])
        arch = SAMPLES / "mlp.yaml"

        one = folder / "one"
        one.mkdir()
        cpu_before = children_cpu_seconds()
        seconds, stdout = run(command(*files, "--arch", arch, "--output-dir", one, "--json", "--quiet"), env)
        cpu_one = children_cpu_seconds() - cpu_before
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        reports = [json.loads(line) for line in stdout.splitlines()]
        assert len(reports) == options.files and len(list(one.iterdir())) == options.files
        in_process = sum(sum(r["seconds"][stage] for stage in IN_PROCESS_STAGES) for r in reports)
        totals = sum(r["seconds"]["total"] for r in reports)
        print(
            f"one process : {seconds:7.2f} s wall for {options.files} files ({seconds / options.files * 1000:.0f} ms "
            f"a file); in-process stages {in_process:.2f} s, per-file totals {totals:.2f} s, "
            f"peak RSS {peak_mib:.0f} MiB; CPU time {cpu_one:.2f} s"
        )

        many = folder / "many"
        many.mkdir()
        started, cpu_before = time.perf_counter(), children_cpu_seconds()
        for path in files[:separate]:
            run(command(path, "--arch", arch, "-o", many / path.name, "--json", "--quiet"), env)
        elapsed = time.perf_counter() - started
        per_process, cpu_per_process = elapsed / separate, (children_cpu_seconds() - cpu_before) / separate
        shown = (
            f"{elapsed:7.2f} s wall for {separate} processes"
            if separate == options.files
            else f"{per_process * options.files:7.2f} s for {options.files} (extrapolated from {separate} "
            f"processes: {elapsed:.2f} s)"
        )
        print(
            f"{options.files} processes: {shown} ({per_process * 1000:.0f} ms a process; CPU time "
            f"{cpu_per_process * options.files:.2f} s for {options.files})"
        )
        print(f"speed-up    : {per_process * options.files / seconds:.1f}x")


if __name__ == "__main__":
    main()
