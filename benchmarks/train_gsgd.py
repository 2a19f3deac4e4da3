"""G-SGD against SGD, SGD from a PathCond-rescaled initialisation and ENorm (SPEC §9, issue 40).

The tasks of ``train_speedup.py`` on scikit-learn's ``load_digits``, with one-width MLPs (G-SGD's
setting):
- classification 64-128-128-128-10 (cross-entropy): ``train_speedup``'s "MLP even";
- reconstruction 64-32-32-32-64 (MSE): its autoencoder task with the hidden layers at one width
  (compression 2).

Two initialisations per seed: Kaiming-uniform weights with zero biases ("balanced"), and the
same network with every hidden neuron rescaled by e^{+3} or e^{−3} (drawn per neuron;
"unbalanced"): the same function, other weights.

Four methods, each with its own learning-rate sweep, from each initialisation:
- SGD: plain SGD (no momentum, no weight decay);
- PathCond: SGD from the initialisation rescaled by ``pathcond_cli.rescale_module``;
- ENorm: SGD with one cycle of equi-normalisation after every step (pathcond's ENorm solver,
  one iteration: every rescaling group updated once, as ENorm's paper does after each step);
- G-SGD: ``pathcond_cli.GSGD``, steps on the basis-path values.
Every run of one seed sees the same mini-batches. The training loss over the whole set is
recorded before training and after every epoch; all runs of one seed start from the same loss
(checked). A run whose loss leaves ``DIVERGED`` × its start, whose G-SGD step meets a singular
basis (a skeleton path reaching 0, a non-finite gradient), or whose ENorm cycle meets
non-finite weights, is cut and counts as diverged.

    python benchmarks/train_gsgd.py            # about 5 minutes on 2 cores
    python benchmarks/train_gsgd.py --quick    # a smoke run

Prints the tables and writes the loss curves (PNG, one per task) and the raw curves
(``train_gsgd_results.json``) next to this file (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import pathcond_cli as pathcond
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InvalidWeightsError, SingularBasisError
from pathcond_cli.module_route import module_model
from pathcond_cli.solve.enorm import enorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speedup import DIVERGED, digits, kaiming_init, mlp, task_loss  # noqa: E402 - a sibling script

METHODS = ("sgd", "pathcond", "enorm", "gsgd")
LABELS = {"sgd": "SGD", "pathcond": "SGD from PathCond init", "enorm": "SGD + ENorm every step", "gsgd": "G-SGD"}
COLOURS = {"sgd": "#555555", "pathcond": "#d62728", "enorm": "#1f77b4", "gsgd": "#2ca02c"}
INITS = ("balanced", "unbalanced")
UNBALANCE = 3.0  # ln of the factor each hidden neuron is rescaled by, sign drawn per neuron
# G-SGD moves a weight by η g / c² (c: a product of L − 1 skeleton weights, spread over decades
# from neuron to neuron at Kaiming scale), so its useful rates are far below SGD's and not known
# in advance: its grid spans seven decades.
LRS = {"sgd": [0.003, 0.01, 0.03, 0.1, 0.3, 1.0], "gsgd": [1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]}
QUICK_LRS = {"sgd": [0.03, 0.3], "gsgd": [1e-5, 1e-4]}


@dataclass(frozen=True)
class Task:
    name: str
    widths: tuple[int, ...]
    task: str  # "classify" or "reconstruct", as in train_speedup


TASKS = (
    Task("MLP 64-128x3-10", (64, 128, 128, 128, 10), "classify"),
    Task("AE 64-32x3-64", (64, 32, 32, 32, 64), "reconstruct"),
)


def learning_rates(method: str, quick: bool) -> list[float]:
    grids = QUICK_LRS if quick else LRS
    return grids["gsgd" if method == "gsgd" else "sgd"]


def unbalanced(model: torch.nn.Sequential, seed: int) -> torch.nn.Sequential:
    """A copy of ``model`` with each hidden neuron's incoming weights and bias multiplied by
    e^{±UNBALANCE} and its outgoing weights divided by it (the same function)."""
    generator = torch.Generator().manual_seed(20_000 + seed)
    copy = deepcopy(model)
    linears = [layer for layer in copy if isinstance(layer, torch.nn.Linear)]
    with torch.no_grad():
        for into, out_of in zip(linears, linears[1:]):
            signs = torch.randint(0, 2, (into.out_features,), generator=generator) * 2 - 1
            factor = torch.exp(UNBALANCE * signs.to(into.weight.dtype))
            into.weight.mul_(factor[:, None])
            into.bias.mul_(factor)
            out_of.weight.div_(factor[None, :])
    return copy


class EnormEveryStep:
    """One ENorm cycle (pathcond's solver, one iteration) on the module's weights, in place."""

    def __init__(self, model: torch.nn.Module, input_dim: int):
        self.graph = module_model(model, (input_dim,)).graph
        self.model = model

    def __call__(self) -> None:
        params = self.model.state_dict()
        groups = build_groups(self.graph, params)
        u = enorm(groups, max_iter=1, tol=0.0).u
        rescaled = groups.apply(params, u)
        with torch.no_grad():
            for key in rescaled:
                params[key].copy_(rescaled[key])


def starting_point(initial: torch.nn.Sequential, method: str, input_dim: int) -> torch.nn.Sequential:
    model = deepcopy(initial)
    if method == "pathcond":
        pathcond.rescale_module(model, input_shape=(input_dim,))
    return model


def train(
    model: torch.nn.Sequential,
    method: str,
    task: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    lr: float,
    epochs: int,
    batch: int,
    seed: int,
) -> list[float]:
    """The whole-set training loss before training and after each epoch; NaN-padded once diverged."""
    optimiser = pathcond.GSGD(model, lr=lr) if method == "gsgd" else torch.optim.SGD(model.parameters(), lr=lr)
    after_step = EnormEveryStep(model, images.shape[1]) if method == "enorm" else None
    order = torch.Generator().manual_seed(10_000 + seed)

    def full_loss() -> float:
        with torch.no_grad():
            return float(task_loss(task, model(images), images, labels))

    losses = [full_loss()]
    for _ in range(epochs):
        permutation = torch.randperm(len(images), generator=order)
        try:
            for start in range(0, len(images), batch):
                index = permutation[start : start + batch]
                optimiser.zero_grad(set_to_none=True)
                task_loss(task, model(images[index]), images[index], labels[index]).backward()
                optimiser.step()
                if after_step is not None:
                    after_step()
        except (SingularBasisError, InvalidWeightsError):  # G-SGD's basis singular; ENorm on non-finite weights
            return losses + [math.nan] * (epochs + 1 - len(losses))
        losses.append(full_loss())
        if not math.isfinite(losses[-1]) or losses[-1] > DIVERGED * losses[0]:
            return losses[:-1] + [math.nan] * (epochs + 2 - len(losses))
    return losses


def run(tasks, seeds: list[int], epochs: int, batch: int, quick: bool) -> dict[tuple[str, str, str, float], np.ndarray]:
    """Loss curves [seed, epoch] per (task, init, method, lr)."""
    images, labels = digits()
    curves: dict[tuple[str, str, str, float], list[list[float]]] = {}
    for task in tasks:
        started = time.perf_counter()
        for seed in seeds:
            balanced = kaiming_init(mlp(task.widths), seed)
            starts = []
            for init, initial in zip(INITS, (balanced, unbalanced(balanced, seed))):
                for method in METHODS:
                    start = starting_point(initial, method, task.widths[0])
                    for lr in learning_rates(method, quick):
                        curve = train(
                            deepcopy(start),
                            method,
                            task.task,
                            images,
                            labels,
                            lr=lr,
                            epochs=epochs,
                            batch=batch,
                            seed=seed,
                        )
                        curves.setdefault((task.name, init, method, lr), []).append(curve)
                        starts.append(curve[0])
            # every run of a seed starts from one function (rescalings preserve it)
            assert max(starts) - min(starts) <= 1e-4 * max(starts), (task.name, seed, min(starts), max(starts))
        print(f"  trained {task.name} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return {key: np.array(value) for key, value in curves.items()}


LAST_EPOCHS = 5  # the best rate is judged on the mean loss of the last epochs: SGD's curves spike at high rates


def best_lr(curves, task: str, init: str, method: str, quick: bool) -> float | None:
    """The rate with the lowest loss over the last ``LAST_EPOCHS`` epochs (mean over them and the
    seeds; a diverged seed disqualifies the rate)."""
    scores = {
        lr: float(curves[(task, init, method, lr)][:, -LAST_EPOCHS:].mean()) for lr in learning_rates(method, quick)
    }
    finite = {lr: score for lr, score in scores.items() if math.isfinite(score)}
    return min(finite, key=finite.get) if finite else None


def epochs_to(curve: np.ndarray, target: float) -> int | None:
    hits = np.nonzero(curve <= target)[0]
    return int(hits[0]) if hits.size else None


def summary_rows(curves, tasks, quick: bool, slack: float) -> list[dict]:
    """Per task, init and method, at the method's best rate: the loss over the last epochs (mean),
    the final loss (mean, min, max over seeds) and epochs (seed mean curve) to ``slack`` × SGD's
    final loss at its best rate from the balanced init."""
    rows = []
    for task in tasks:
        sgd_lr = best_lr(curves, task.name, "balanced", "sgd", quick)
        target = slack * float(curves[(task.name, "balanced", "sgd", sgd_lr)][:, -1].mean())
        for init in INITS:
            for method in METHODS:
                lr = best_lr(curves, task.name, init, method, quick)
                row = {"task": task.name, "init": init, "method": method, "lr": lr, "target": target}
                if lr is not None:
                    runs = curves[(task.name, init, method, lr)]
                    row.update(
                        last=float(runs[:, -LAST_EPOCHS:].mean()),
                        final=float(runs[:, -1].mean()),
                        low=float(runs[:, -1].min()),
                        high=float(runs[:, -1].max()),
                        epochs=epochs_to(runs.mean(axis=0), target),
                    )
                rows.append(row)
    return rows


def print_tables(curves, tasks, quick: bool, slack: float, epochs: int) -> None:
    print(
        f"\nEach method at its best learning rate (lowest mean loss over the last {LAST_EPOCHS} epochs): that mean; "
        f"the final training loss after {epochs} epochs (mean over seeds, [min, max]); epochs for the seed-mean curve "
        f"to reach {slack:g} × SGD's final loss (balanced init)"
    )
    print(
        f"{'task':<16} {'init':<10} {'method':<24} {'best lr':>8} {'last ' + str(LAST_EPOCHS):>8} {'final loss':>11} "
        f"{'[min, max]':>20} {'epochs':>7}"
    )
    for row in summary_rows(curves, tasks, quick, slack):
        if row["lr"] is None:
            print(f"{row['task']:<16} {row['init']:<10} {LABELS[row['method']]:<24} {'—':>8} {'diverged':>11}")
            continue
        spread = f"[{row['low']:.4g}, {row['high']:.4g}]"
        reached = "never" if row["epochs"] is None else str(row["epochs"])
        print(
            f"{row['task']:<16} {row['init']:<10} {LABELS[row['method']]:<24} {row['lr']:>8g} {row['last']:>8.4g} "
            f"{row['final']:>11.4g} "
            f"{spread:>20} {reached:>7}"
        )
    print("\nFinal loss per learning rate (mean over seeds; nan: diverged on at least one seed)")
    for task in tasks:
        for method in METHODS:
            cells = []
            for init in INITS:
                finals = [
                    f"{lr:g}: {curves[(task.name, init, method, lr)][:, -1].mean():.4g}"
                    for lr in learning_rates(method, quick)
                ]
                cells.append(f"{init} " + ", ".join(finals))
            print(f"{task.name:<16} {LABELS[method]:<24} " + " | ".join(cells))


def skeleton_spread(task: Task, seeds: list[int]) -> tuple[float, float, float]:
    """|v_S| of the skeleton paths at initialisation, over all seeds: min, median, max (the same
    for both initialisations: v does not change under rescaling)."""
    values = torch.cat(
        [pathcond.GSGD(kaiming_init(mlp(task.widths), seed), lr=1.0).basis_values().skeleton.abs() for seed in seeds]
    )
    return float(values.min()), float(values.median()), float(values.max())


def invariance_check(curves, task: Task, quick: bool, epochs: int, batch: int) -> dict[str, np.ndarray] | None:
    """G-SGD at its best rate (balanced init) from the balanced and the unbalanced initialisation
    of seed 0: the relative difference of the two loss curves, epoch by epoch, in float32 (the
    runs above) and in float64 (trained here). None when G-SGD diverged at every rate."""
    lr = best_lr(curves, task.name, "balanced", "gsgd", quick)
    if lr is None:
        return None
    images, labels = digits()
    balanced = kaiming_init(mlp(task.widths), 0).double()
    runs = [
        np.array(train(model, "gsgd", task.task, images.double(), labels, lr=lr, epochs=epochs, batch=batch, seed=0))
        for model in (balanced, unbalanced(balanced, 0))
    ]
    single = [curves[(task.name, init, "gsgd", lr)][0] for init in INITS]
    return {
        "float32": np.abs(single[0] - single[1]) / np.abs(single[0]),
        "float64": np.abs(runs[0] - runs[1]) / np.abs(runs[0]),
    }


def plot(curves, task: Task, quick: bool, path: Path) -> None:
    """Two panels (balanced, unbalanced init): each method at its best rate, seed mean and min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True, constrained_layout=True)
    for ax, init in zip(axes, INITS):
        for method in METHODS:
            lr = best_lr(curves, task.name, init, method, quick)
            if lr is None:
                continue
            runs = curves[(task.name, init, method, lr)]
            epochs = np.arange(runs.shape[1])
            ax.plot(epochs, runs.mean(axis=0), color=COLOURS[method], lw=1.8, label=f"{LABELS[method]} (lr {lr:g})")
            ax.fill_between(epochs, runs.min(axis=0), runs.max(axis=0), color=COLOURS[method], alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_title(
            f"{init} initialisation" + (f" (hidden neurons × e^±{UNBALANCE:g})" if init == "unbalanced" else "")
        )
        ax.set_xlabel("epoch")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("training loss (" + ("cross-entropy" if task.task == "classify" else "MSE") + ")")
    fig.suptitle(
        f"{task.name} on load_digits: each method at its best learning rate "
        f"({curves[(task.name, 'balanced', 'sgd', learning_rates('sgd', quick)[0])].shape[0]} seeds; line: "
        "mean, band: min–max)",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one task, two rates per method, fewer epochs (a smoke run)"
    )
    parser.add_argument("--epochs", type=int, help="epochs per run (default 20, quick 4)")
    parser.add_argument("--seeds", type=int, help="seeds (default 2, quick 1)")
    parser.add_argument("--batch", type=int, default=128, help="mini-batch size (default 128: 15 steps per epoch)")
    parser.add_argument("--slack", type=float, default=1.1, help="target = slack × SGD's final loss at its best rate")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these small nets)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="where the results go")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    epochs = args.epochs or (4 if args.quick else 20)
    seeds = list(range(args.seeds or (1 if args.quick else 2)))
    tasks = TASKS[:1] if args.quick else TASKS
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); epochs {epochs}, seeds {len(seeds)}, "
        f"batch {args.batch}",
        file=sys.stderr,
    )
    curves = run(tasks, seeds, epochs, args.batch, args.quick)
    print_tables(curves, tasks, args.quick, args.slack, epochs)
    print(
        "\nG-SGD's coordinates at initialisation, and its invariance: seed 0 at the best rate, balanced against "
        "unbalanced init, relative difference of the whole-set loss after 1, 5 and all epochs (nan: diverged)"
    )
    for task in tasks:
        low, median, high = skeleton_spread(task, seeds)
        print(f"{task.name:<16} skeleton-path values |v_S| {low:.2g} … {median:.2g} (median) … {high:.2g}")
        gaps = invariance_check(curves, task, args.quick, epochs, args.batch)
        for dtype, gap in (gaps or {}).items():
            print(
                f"{'':<16} {dtype}: "
                + ", ".join(f"epoch {e} {gap[e]:.2g}" for e in sorted({1, min(5, epochs), epochs}))
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_gsgd_results.json").write_text(
        json.dumps(
            [
                {
                    "task": t,
                    "init": i,
                    "method": m,
                    "lr": lr,
                    "losses": np.vectorize(lambda v: float(f"{v:.6g}"))(c).tolist(),
                }
                for (t, i, m, lr), c in curves.items()
            ]
        )
    )
    for task in tasks:
        slug = task.name.split()[0].lower()
        plot(curves, task, args.quick, args.out / f"train_gsgd_{slug}.png")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; results in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
