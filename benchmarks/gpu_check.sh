#!/usr/bin/env bash
# Check a machine with a CUDA GPU in one command (issue 17):
#   1. the solver benchmark (Newton) and the end-to-end benchmark, on the GPU and on the CPU;
#   2. issue 20's memory bound on the GPU: peak GPU and host memory of a rescale of a 1.03 GiB
#      sharded MLP (benchmarks/bench_memory.py --device cuda), against 1.5 x + 1 GiB (GPU) and
#      1.5 x + 2 GiB (host);
#   3. host syncs and aten operations per solver pass, counted on the fake CUDA device
#      (benchmarks/bench_syncs.py, on the CPU, within SYNCS_SECONDS, default 150);
#   4. one table of those figures, headed by the GPU's name, printed before the suite starts:
#      each model's seconds per Newton pass beside its syncs and operations per pass; then
#      (issue 39) ResNet-50's rescale stage by stage, seconds on the GPU and on the CPU
#      (benchmarks/bench_stages.py, a warm in-process run) beside its host syncs per stage on
#      the fake device (bench_syncs.py, within STAGE_SYNCS_SECONDS, default 120), and the
#      path-magnitude scores of ResNet-18, VGG-16 and AlexNet at 224² in float64 on both;
#   5. the whole default test suite, where `--device auto` and the API's default pick the GPU
#      and the CUDA-only tests run, within SUITE_SECONDS (default 420), on pytest-xdist's
#      workers when it is installed (WORKERS, default 8), each test's outcome streamed to the
#      log as it ends, so that a suite cut by the time limit still names every failure so far, and
#      each failure's traceback streamed to failures.log (benchmarks/failure_stream.py).
# Figures first, suite last: on 2026-11-26 the suite alone did not finish in 570 s on an H200
# run serially, and a lease of 15 minutes left nothing for the table. LOG_DIR (default: a
# temporary folder, removed) keeps suite.log and the benchmarks' JSON Lines.
# It installs nothing but pathcond itself: torch (a CUDA build) and the test extra must be
# there already. Usage: benchmarks/gpu_check.sh [MODEL ...]   (default: resnet50 mlp3)
# MODELs are names both benchmarks know (resnet18, resnet50, cifar_nv, mlp1, mlp3, inception_v3);
# the solver benchmark also runs issue 17's MnasNet-style model (mnasnet).
set -uo pipefail
cd "$(dirname "$0")/.."
unset PATHCOND_FAKE_CUDA  # the real GPU, not the test suite's fake one

python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . || exit 1
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
            'torch ' + torch.__version__ + ' sees no CUDA device: this script is for a GPU machine')" || exit 2

if [ $# -gt 0 ]; then models=("$@"); else models=(resnet50 mlp3); fi
if [ -n "${LOG_DIR:-}" ]; then
    scratch="$LOG_DIR"; mkdir -p "$scratch"
else
    scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
fi

for device in cuda cpu; do
    python3 benchmarks/bench_solvers.py --models "${models[@]}" mnasnet --solvers newton --warm --device "$device" \
        --json "$scratch/solvers.jsonl" || true
    for model in "${models[@]}"; do
        python3 benchmarks/bench_end_to_end.py --model "$model" --device "$device" --repeat 2 \
            --json "$scratch/end_to_end.jsonl" || true
    done
done

python3 benchmarks/bench_memory.py --inputs 8192 --width 8192 --depth 4 --outputs 1000 --shards 2 --device cuda \
    > "$scratch/memory.txt" 2>&1 || true

# On the CPU (the fake device counts what a GPU would wait for or launch), bounded: it adds to the lease.
timeout "${SYNCS_SECONDS:-150}" python3 benchmarks/bench_syncs.py --per-pass --models "${models[@]}" mnasnet \
    > "$scratch/syncs.txt" 2>&1 || true
timeout "${STAGE_SYNCS_SECONDS:-120}" python3 benchmarks/bench_syncs.py --models resnet50 --commands rescale \
    --json "$scratch/stage_syncs.json" > "$scratch/stage_syncs.txt" 2>&1 || true
for device in cuda cpu; do
    timeout 120 python3 benchmarks/bench_stages.py --device "$device" --models resnet50 --scores resnet18 vgg16 alexnet \
        --json "$scratch/stages.jsonl" > /dev/null 2>&1 || true
done

python3 - "$scratch" <<'PY'
import json, sys
from pathlib import Path

import torch

scratch = Path(sys.argv[1])
def rows(name):
    path = scratch / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

def per_pass_counts():
    """bench_syncs.py's figures per model, read by its header's column names (absent ones: '–')."""
    path = scratch / "syncs.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    # Before issue 28 the one column of syncs was headed "per pass".
    header = next((line.replace(" per pass", " syncs/pass").split() for line in lines if line.startswith("model")),
                  None)
    if header is None:
        return {}
    return {row[0]: dict(zip(header, row)) for row in map(str.split, lines) if row and row[0] != "model"
            and len(row) >= header.index("solve") + 1 and row[1].isdigit()}

print(f"\n## {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
print("| model | device | Newton solve (first) | passes | s / pass (warm) | syncs / pass | ops / pass | kernels / pass | diag(G) "
      "| whole run (wall) | in-process stages | peak RSS |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
end_to_end = {(r["model"], r["device"].split(":")[0]): r for r in rows("end_to_end.jsonl")}
counts = per_pass_counts()
for r in rows("solvers.jsonl"):
    newton = r["solvers"]["newton"]
    run = end_to_end.get((r["model"], r["device"]), {})
    # a warm solve's passes where the benchmark timed one (on CUDA: without CUDA's first calls)
    per_pass = newton.get("warm_seconds", newton["seconds"]) / newton["passes"] if newton["passes"] else float("nan")
    counted = counts.get(r["model"], {})
    print(f"| {r['model']} | {r['device']} | {newton['seconds']:.3f} s | {newton['passes']} | {per_pass * 1e3:.1f} ms "
          + "".join(f"| {counted.get(column, '–')} " for column in ("syncs/pass", "ops/pass", "kernels/pass"))
          + f"| {r['analysis_seconds'].get('diag_g', float('nan')):.3f} s "
          f"| {run.get('wall_seconds', float('nan')):.2f} s | {run.get('staged_seconds', float('nan')):.2f} s "
          f"| {run.get('peak_rss_gib', float('nan')):.2f} GiB |")
print("\nsyncs and operations per Newton pass on the fake CUDA device (bench_syncs.py):\n")
print((scratch / "syncs.txt").read_text() if (scratch / "syncs.txt").exists() else "not run")
stages = rows("stages.jsonl")
seconds = {r["device"]: r["warm"]["stages"] for r in stages if r["kind"] == "stages"}
walls = {r["device"]: r["warm"]["wall"] for r in stages if r["kind"] == "stages"}
counted = scratch / "stage_syncs.json"
syncs = json.loads(counted.read_text())["resnet50"]["rescale"]["syncs"] if counted.exists() else {}
# the run's timed stages under bench_syncs.py's names (two of them inside one of its stages)
named = {"storage_check": "apply", "path_norms_rescaled": "verify"}
print("\nResNet-50 rescale in-process, warm run, by stage (bench_stages.py; syncs: bench_syncs.py, fake device, "
      "the CLI's whole run, which also writes and reports):\n")
print("| stage | GPU s | CPU s | host syncs |")
print("| --- | ---: | ---: | ---: |")
timed = list(dict.fromkeys([*seconds.get("cuda", {}), *seconds.get("cpu", {})]))
for stage in dict.fromkeys([*timed, *syncs]):
    gpu, cpu = (seconds.get(device, {}).get(stage, float("nan")) for device in ("cuda", "cpu"))
    counted = f"in {named[stage]}" if stage in named else syncs.get(stage, 0) if syncs else "–"
    print(f"| {stage} | {gpu:.3f} | {cpu:.3f} | {counted} |")
print(f"| whole (wall) | {walls.get('cuda', float('nan')):.3f} | {walls.get('cpu', float('nan')):.3f} "
      f"| {sum(syncs.values()) if syncs else '–'} |")
print("\npath-magnitude scores at 224², float64, warm (seed 004's A100: ResNet-18 32 ms, VGG-16 61 ms, AlexNet 14 ms):\n")
print("| model | GPU ms | CPU ms |")
print("| --- | ---: | ---: |")
scores = {(r["model"], r["device"]): r["warm"] for r in stages if r["kind"] == "scores"}
for model in dict.fromkeys(r["model"] for r in stages if r["kind"] == "scores"):
    print(f"| {model} | {scores.get((model, 'cuda'), float('nan')) * 1e3:.1f} | {scores.get((model, 'cpu'), float('nan')) * 1e3:.1f} |")
memory = scratch / "memory.txt"
print("\nissue 20's bound on the GPU (bench_memory.py --device cuda, 1.03 GiB MLP):\n")
print(memory.read_text() if memory.exists() else "not run")
PY

workers=()
if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${WORKERS:-8}"); fi
FAILURE_STREAM="$scratch/failures.log" PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
    timeout "${SUITE_SECONDS:-420}" python3 -m pytest -p no:cacheprovider -p failure_stream -vv -rfE "${workers[@]}" \
    > "$scratch/suite.log" 2>&1
suite_status=$?
echo
echo "suite: exit $suite_status$([ "$suite_status" -eq 124 ] && echo " (cut at ${SUITE_SECONDS:-420} s)"), $(grep -cE ' PASSED' "$scratch/suite.log") passed, \
$(grep -cE ' (FAILED|ERROR)' "$scratch/suite.log") failed or errors, $(grep -cE ' SKIPPED' "$scratch/suite.log") skipped"
grep -E '(^|\] )(FAILED|ERROR) [^ ]+::|::[^ ]+ (FAILED|ERROR)' "$scratch/suite.log" \
    | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //; s/ +\[ *[0-9]+%\]$//' | sort -u | head -n 60
tail -n 5 "$scratch/suite.log"
exit "$suite_status"
