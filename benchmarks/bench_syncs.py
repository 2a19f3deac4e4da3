"""Host–device synchronisations and aten operations of whole runs, per stage, counted on the
fake CUDA device (issues 17, 28 and 39).

No GPU needed: the commands run in-process under ``tests/fake_cuda.py``, which counts every
read of a device value on the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``,
``.cpu()``, ...), and under a dispatch mode that counts the aten operations they run. On a
real GPU each sync waits for the queued kernels and each operation that computes is a kernel
launch, so a stage that reads one value per layer, or runs a few operations per tensor, costs
time in proportion to the number of layers, not to the arithmetic.

    python benchmarks/bench_syncs.py                                   # mlp3 resnet18, every command
    python benchmarks/bench_syncs.py --models mlp3 resnet18 resnet50 resnet152
    python benchmarks/bench_syncs.py --models resnet50 --commands rescale --json syncs.json
    python benchmarks/bench_syncs.py --per-pass --models mnasnet resnet18   # issue 28's solver pass

Each model is written as a safetensors checkpoint (its architecture: this module's factory of
the same name), then ``pathcond rescale``, ``inspect``, ``compare`` (the model against its
rescaled copy) and ``prune`` run through the CLI on the fake device. Each sync and operation
is put in the stage of the outermost library function on the Python stack at that moment
(:data:`STAGES`, by function name, so that a function moved to another module keeps its
stage); the sync's site is the innermost line of the library. Prints per model and command the
syncs, operations and kernels (operations other than views and metadata) per stage and in all,
then the sites of the syncs, most frequent first.

``--per-pass`` prints issue 28's table instead: per Newton pass, host reads and operations of
the solve, and those of building its objective.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

PACKAGE = str(ROOT / "pathcond_cli")
COMMANDS = ("rescale", "inspect", "compare", "prune")
OTHER = "other"
# The stage of each library function, by name (``file.py:name`` where the name alone is
# ambiguous). The outermost one on the stack wins: the path norms of the check after a rescale
# build groups of their own, and count as that check.
STAGES = {
    "load": {"load_model", "module_import", "read_module", "graph_from_factory", "load_factory", "read_checkpoint"},
    "groups": {"build_groups"},
    "diag_g": {"balancing_exponents", "diag_g_and_l2_norm", "diag_g"},
    "path_count": {"path_count"},
    "path_norms": {"path_norms", "path_norms_of"},
    "solve": {"solve", "enorm", "within_dtype", "_nothing_to_rescale"},
    "apply": {"groups.py:apply", "check_storage", "ensure_storable"},
    "write": {"write_model"},
    "verify": {
        "verify.py:compare",
        "compare_modules",
        "check_path_norms",
        "_verify_written",
        "independent_check",
        "ignores_input",
    },
    "report": {
        "unused_parameters",
        "degenerate_mask",
        "zero_causes",
        "zero_gammas",
        "histogram",
        "summarise",
        "conditioning",
        "report_facts",
    },
    "metric": {"compare_signs", "path_metric", "_pruned_metric", "_measure_within_bound"},
    "scores": {"path_magnitude_scores", "select_pruned", "prunable", "magnitude_keys", "stored_weight_mask"},
}
STAGE_OF = {name: stage for stage, names in STAGES.items() for name in names}
ORDER = [*STAGES, OTHER]
BUILT = {}


def factory(name: str):
    """The architecture of model ``name`` (:func:`bench_solvers.build`), for ``--arch``."""
    from bench_solvers import build

    module, shape = build(name)
    BUILT[name] = shape
    return module


def mlp3():
    return factory("mlp3")


def resnet18():
    return factory("resnet18")


def resnet50():
    return factory("resnet50")


def resnet152():
    return factory("resnet152")


def operation_counter(on_operation=None):
    """A dispatch mode counting the aten operations run under it (``counts``, by name);
    ``on_operation(name)``, when given, sees each one."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OperationCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.counts[name] += 1
            if on_operation is not None:
                on_operation(name)
            return func(*args, **(kwargs or {}))

        def launching(self) -> int:
            """Operations other than views and metadata: those that run a kernel on a GPU."""
            return sum(n for name, n in self.counts.items() if not _is_view(torch, name))

    return OperationCounter()


def _is_view(torch, name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    schema = packet.default._schema if hasattr(packet, "default") else None
    aliasing = schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    return aliasing or name in {"detach", "alias", "lift_fresh", "_local_scalar_dense"}


def stage_and_site(frame) -> tuple[str, str]:
    """The stage of the outermost library function of :data:`STAGES` on the stack above
    ``frame``, and the innermost library line (``path:line``, relative to the package)."""
    stage, site = OTHER, None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            if site is None:
                site = f"{path[len(PACKAGE) + 1 :]}:{frame.f_lineno}"
            name = frame.f_code.co_name
            found = STAGE_OF.get(f"{Path(path).name}:{name}") or STAGE_OF.get(name)
            if found is not None:
                stage = found
        frame = frame.f_back
    return stage, site or "outside pathcond_cli"


class StageCounts:
    """Syncs, operations and kernels per stage, and the syncs per site, of what runs while
    :meth:`counting` is active."""

    def __init__(self):
        import torch

        self.syncs: Counter[str] = Counter()
        self.operations: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str]] = Counter()
        self._launching: dict[str, bool] = defaultdict(bool)
        self._torch = torch

    def on_sync(self, kind: str) -> None:
        stage, site = stage_and_site(sys._getframe(1))
        self.syncs[stage] += 1
        self.sites[(stage, site)] += 1

    def on_operation(self, name: str) -> None:
        stage, _ = stage_and_site(sys._getframe(1))
        self.operations[stage] += 1
        if name not in self._launching:
            self._launching[name] = not _is_view(self._torch, name)
        self.kernels[stage] += self._launching[name]

    def as_dict(self) -> dict:
        return {
            "syncs": dict(self.syncs),
            "operations": dict(self.operations),
            "kernels": dict(self.kernels),
            "sites": [[stage, site, n] for (stage, site), n in self.sites.most_common()],
        }


def run_command(args: list[str], *, operations: bool = True) -> tuple[StageCounts, dict]:
    """``pathcond ARGS --device cuda --json`` in-process on the fake device: its counts and its
    JSON report (without ``operations``, the syncs alone: counting operations by their stack
    takes most of the time)."""
    import fake_cuda
    from typer.testing import CliRunner

    from pathcond_cli.cli.app import app

    counts = StageCounts()
    counting = operation_counter(counts.on_operation) if operations else contextlib.nullcontext()
    with fake_cuda.installed() as mode, counting:
        mode.on_sync = counts.on_sync
        outcome = CliRunner().invoke(app, [*args, "--device", "cuda", "--json"])
    if outcome.exit_code != 0:
        raise RuntimeError(
            f"pathcond {' '.join(args)}: exit {outcome.exit_code}\n{outcome.stderr[-3000:]}\n{outcome.exception!r}"
        )
    return counts, json.loads(outcome.stdout)


def count_model(name: str, commands: list[str], folder: Path, *, operations: bool = True) -> dict[str, StageCounts]:
    """Each command of ``commands`` on model ``name``, written into ``folder``: its counts."""
    import safetensors.torch

    module = factory(name)
    shape = ",".join(str(n) for n in BUILT[name])
    checkpoint, rescaled = folder / f"{name}.safetensors", folder / f"{name}.rescaled.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, checkpoint)
    model = [str(checkpoint), "--arch", f"bench_syncs:{name}", "--input-shape", shape]
    runs = {
        "rescale": ["rescale", *model, "-o", str(rescaled)],
        "inspect": ["inspect", *model],
        "compare": ["compare", str(checkpoint), str(rescaled), "--arch", f"bench_syncs:{name}", "--input-shape", shape],
        "prune": ["prune", *model, "--sparsity", "0.5", "-o", str(folder / f"{name}.pruned.safetensors")],
    }
    results = {}
    for command in ("rescale", *[c for c in commands if c != "rescale"]):
        if command == "rescale" or command in commands:
            results[command] = run_command(runs[command], operations=operations)[0]
    return {command: results[command] for command in commands}


def print_model(name: str, counted: dict[str, StageCounts], top: int, *, operations: bool = True) -> None:
    commands = list(counted)
    width = 26 if operations else 8

    def cells(syncs: int, ops: int, kernels: int) -> str:
        return f"{syncs:>8} {ops:>8} {kernels:>8}" if operations else f"{syncs:>8}"

    print(f"\n{name}: syncs{' / operations / kernels' if operations else ''} per stage")
    print(f"  {'stage':<12}" + "".join(f"{command:>{width}}" for command in commands))
    for stage in ORDER:
        if any(c.operations[stage] or c.syncs[stage] for c in counted.values()):
            print(
                f"  {stage:<12}"
                + "".join(cells(c.syncs[stage], c.operations[stage], c.kernels[stage]) for c in counted.values())
            )
    print(
        f"  {'total':<12}"
        + "".join(
            cells(sum(c.syncs.values()), sum(c.operations.values()), sum(c.kernels.values())) for c in counted.values()
        )
    )
    for command, c in counted.items():
        print(f"  {command}: sync sites (stage, site, count)" + ("" if c.sites else ": none"))
        for (stage, site), n in c.sites.most_common(top):
            print(f"    {stage:<12}{site:<48}{n:>6}")


def count_solve(groups, diag, *, solver: str = "newton"):
    """(result, host reads by kind, aten operations of the solve, aten operations of building its
    objective alone) of one solve on the fake CUDA device (``groups`` and ``diag`` made there).
    Building the objective (kernel sums, the support, the flat buffers) runs once per solve and
    per tensor; the rest is what every pass costs."""
    import fake_cuda

    from pathcond_cli.solve.objective import Objective
    from pathcond_cli.solve.solvers import solve

    with fake_cuda.installed() as mode:
        with operation_counter() as setup:
            Objective(groups, diag, device="cuda")
        mode.syncs.clear()
        with operation_counter() as operations:
            result = solve(groups, diag, solver=solver, device="cuda")
        return result, dict(mode.syncs), operations, setup


def print_per_pass(models: list[str], solver: str) -> None:
    import fake_cuda
    from bench_solvers import build

    import pathcond_cli as pathcond
    from pathcond_cli.engine.model import LoadedModel
    from pathcond_cli.io.formats.fx_import import module_import

    print(
        f"{'model':<12}{'tensors':>8}{'passes':>7}{'analysis':>9}{'solve':>6}{'syncs/pass':>11}{'ops/pass':>9}"
        f"{'kernels/pass':>13}{'setup ops':>10}{'ops/pass after setup':>21}{'kernels':>8}  solve reads by kind"
    )
    for name in models:
        module, shape = build(name)
        graph, params, notes = module_import(module, tuple(shape), source=name)
        model = LoadedModel(graph, params, "module", name, payload=module, warnings=notes, arch_source="module")
        with fake_cuda.installed() as mode:
            analysis = pathcond.analyse(model, device="cuda")
            in_analysis = sum(mode.syncs.values())
        result, in_solve, operations, setup = count_solve(analysis.groups, analysis.diag, solver=solver)
        passes = max(result.passes, 1)
        total, ops, kernels = sum(in_solve.values()), sum(operations.counts.values()), operations.launching()
        setup_ops, setup_kernels = sum(setup.counts.values()), setup.launching()
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(in_solve.items(), key=lambda kv: -kv[1]))
        print(
            f"{name:<12}{len(analysis.groups.dag_params):>8}{result.passes:>7}{in_analysis:>9}{total:>6}"
            f"{total / passes:>11.1f}{ops / passes:>9.0f}{kernels / passes:>13.0f}{setup_ops:>10}"
            f"{(ops - setup_ops) / passes:>21.0f}{(kernels - setup_kernels) / passes:>8.0f}  {kinds}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp3", "resnet18"])
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--top", type=int, default=12, help="sync sites printed per command")
    parser.add_argument("--json", type=Path, help="write the counts, per model, command and stage, to this file")
    parser.add_argument("--syncs-only", action="store_true", help="count no operations (several times faster)")
    parser.add_argument("--per-pass", action="store_true", help="issue 28's table: per Newton pass")
    parser.add_argument("--solver", default="newton", help="the solver of --per-pass")
    args = parser.parse_args()
    if args.per_pass:
        print_per_pass(args.models, args.solver)
        return
    figures = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            counted = count_model(name, args.commands, Path(folder), operations=not args.syncs_only)
            print_model(name, counted, args.top, operations=not args.syncs_only)
            figures[name] = {command: c.as_dict() for command, c in counted.items()}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
