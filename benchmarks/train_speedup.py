"""Does rescaling at initialisation speed up training? The paper's protocol on real data.

Data: scikit-learn's ``load_digits`` (1,797 8×8 images shipped with scikit-learn, no
download), pixels scaled to [0, 1].

Training runs (paper §5.1 and §5.3, scaled to a 2-core CPU):
- classification MLPs 64 → hidden → 10 with even hidden widths and with uneven ones
  (cross-entropy);
- autoencoders 64 → 128 → 64/c → 128 → 64 with compression factors c = 2, 4, 8, 16
  (mean squared error);
Kaiming-uniform weights (He et al.: gain √2, fan-in), zero biases, plus one small-variance
setting (the even MLP with Kaiming/10 weights, a regime the paper's Appendix J predicts
PathCond to change most); plain SGD (no momentum, no weight decay) with fixed learning rates
on a log grid, mini-batches of ``--batch``.
Every seed draws one initialisation; baseline, PathCond and ENorm start from that same θ,
rescaled once at initialisation with pathcond's Python API
(``rescale_module(model, input_shape=..., criterion=...)``), and see the same mini-batches.
The training loss is measured on the whole training set before training and after every
epoch; because rescaling preserves the function, the three methods start from the same
loss (checked).

Fig. 4 check (paper §5.3, Appendix J): ‖u*‖∞ of PathCond against the width ratio
(max/min hidden width) of depth-8 MLPs (32 → 8 hidden layers → 32, zero biases) whose
8 × 32 hidden neurons are spread over the layers by a symmetric Dirichlet draw, with
Kaiming and with small-variance (Kaiming/10) initialisation. The biases matter although
they are zero: paths that start at a bias are shorter, so their share of diag(G) grows as
the weights shrink; without biases a common weight scale cancels out of u*. These nets are
rescaled in float64 (u* is a property of θ, and e^{±u*} may not fit float32).

    python benchmarks/train_speedup.py            # everything, about 10 minutes on 2 cores
    python benchmarks/train_speedup.py --quick    # a smoke run in about a minute

Prints the tables and writes PNGs and the raw loss curves (``train_speedup_results.json``)
next to this file (``--out`` to change); ``--replot`` redraws from that file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import pathcond_cli as pathcond

METHODS = ("baseline", "pathcond", "placebo", "enorm")
RESCALINGS = METHODS[1:]
COLOURS = {"baseline": "#555555", "pathcond": "#d62728", "placebo": "#2ca02c", "enorm": "#1f77b4"}
LABELS = {
    "baseline": "baseline (no rescaling)",
    "pathcond": "PathCond",
    "placebo": "placebo (u* per-layer mean)",
    "enorm": "ENorm",
}
SHORT = {"baseline": "base", "pathcond": "PC", "placebo": "PL", "enorm": "EN"}
# ENorm and the placebo dashed/dotted: they often overlap PathCond
STYLES = {"baseline": ("-", 2.6), "pathcond": ("-", 1.6), "placebo": (":", 1.8), "enorm": ("--", 1.6)}
DIVERGED = 1e6  # a loss this many times the initial one counts as divergence
STALLED = 3.0  # a seed whose final loss is this many times the best method's on that seed (or diverged) stalled


@dataclass(frozen=True)
class Setting:
    """One architecture and task."""

    name: str
    widths: tuple[int, ...]
    task: str  # "classify" (cross-entropy on the digit) or "reconstruct" (MSE on the pixels)
    init_scale: float = 1.0  # multiplies the Kaiming-uniform weights

    @property
    def title(self) -> str:
        return f"{self.name.split(',')[0]}: {'-'.join(map(str, self.widths))}" + (
            f", Kaiming × {self.init_scale:g}" if self.init_scale != 1.0 else ""
        )


def settings(quick: bool) -> list[Setting]:
    compressions = (2, 16) if quick else (2, 4, 8, 16)
    return [
        Setting("MLP even", (64, 128, 128, 128, 10), "classify"),
        Setting("MLP uneven", (64, 512, 32, 512, 10), "classify"),
        Setting("MLP even, init/10", (64, 128, 128, 128, 10), "classify", init_scale=0.1),
        *(Setting(f"AE c={c}", (64, 128, 64 // c, 128, 64), "reconstruct") for c in compressions),
    ]


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)


def mlp(widths: tuple[int, ...]) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*layers)


def kaiming_init(model: torch.nn.Module, seed: int, *, scale: float = 1.0) -> torch.nn.Module:
    """Kaiming-uniform weights (gain √2 for ReLU, fan-in) times ``scale``, zero biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu", generator=generator)
                layer.weight.mul_(scale)
                if layer.bias is not None:
                    layer.bias.zero_()
    return model


def rescaled_copy(model: torch.nn.Sequential, method: str, input_dim: int) -> tuple[torch.nn.Sequential, float]:
    """A copy of ``model`` rescaled by ``method`` (function preserved and verified), and ‖u‖∞.

    The placebo applies PathCond's u* averaged over each layer's neurons: the same layer-level
    shift, without the conditioning within a layer (function preserved; the equal starting
    losses that ``run_training`` checks verify it).
    """
    copy = deepcopy(model)
    if method == "baseline":
        return copy, 0.0
    if method == "placebo":
        result = pathcond.rescale_module(deepcopy(model), input_shape=(input_dim,))
        u = per_layer_mean(result.solve.u, result.analysis.groups.labels)
        changed = result.analysis.groups.apply(copy.state_dict(), u)
        copy.load_state_dict(changed, strict=False)
        return copy, float(u.abs().max()) if u.numel() else 0.0
    result = pathcond.rescale_module(copy, input_shape=(input_dim,), criterion=method)
    return copy, result.solve.u_inf


def per_layer_mean(u: torch.Tensor, labels: list[str]) -> torch.Tensor:
    """``u`` with each group's value replaced by the mean over its layer (labels ``layer:channel``)."""
    layers = [label.rpartition(":")[0] for label in labels]
    means = {layer: float(u[[i for i, name in enumerate(layers) if name == layer]].mean()) for layer in set(layers)}
    return torch.tensor([means[layer] for layer in layers], dtype=u.dtype)


def task_loss(task: str, output: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, labels) if task == "classify" else F.mse_loss(output, images)


def train(
    model: torch.nn.Module,
    task: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    lr: float,
    epochs: int,
    batch: int,
    seed: int,
) -> list[float]:
    """Plain SGD; the whole-training-set loss before training and after each epoch.

    A diverged run (non-finite loss, or DIVERGED times the initial one) is cut and padded with NaN.
    """
    optimiser = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(10_000 + seed)
    n = len(images)

    def full_loss() -> float:
        with torch.no_grad():
            return float(task_loss(task, model(images), images, labels))

    losses = [full_loss()]
    for _ in range(epochs):
        permutation = torch.randperm(n, generator=order)
        for start in range(0, n, batch):
            index = permutation[start : start + batch]
            optimiser.zero_grad(set_to_none=True)
            task_loss(task, model(images[index]), images[index], labels[index]).backward()
            optimiser.step()
        losses.append(full_loss())
        if not math.isfinite(losses[-1]) or losses[-1] > DIVERGED * losses[0]:
            return losses[:-1] + [math.nan] * (epochs + 2 - len(losses))
    return losses


def epochs_to_target(curve: np.ndarray, target: float) -> int | None:
    """First epoch whose loss is at most ``target`` (None if never)."""
    hits = np.nonzero(curve <= target)[0]
    return int(hits[0]) if hits.size else None


@dataclass
class Runs:
    """Loss curves [seed, epoch] per (setting, lr, method), and ‖u‖∞ per (setting, method)."""

    curves: dict[tuple[str, float, str], np.ndarray] = field(default_factory=dict)
    u_inf: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def mean(self, setting: str, lr: float, method: str) -> np.ndarray:
        return self.curves[(setting, lr, method)].mean(axis=0)  # NaN once any seed diverged

    def to_json(self) -> dict:
        return {
            "curves": [
                {"setting": s, "lr": lr, "method": m, "losses": np.vectorize(lambda v: float(f"{v:.6g}"))(c).tolist()}
                for (s, lr, m), c in self.curves.items()
            ],
            "u_inf": [{"setting": s, "method": m, "values": v} for (s, m), v in self.u_inf.items()],
        }

    @classmethod
    def from_json(cls, data: dict) -> Runs:
        return cls(
            {(c["setting"], c["lr"], c["method"]): np.array(c["losses"], dtype=float) for c in data["curves"]},
            {(u["setting"], u["method"]): u["values"] for u in data["u_inf"]},
        )


def run_training(all_settings: list[Setting], lrs: list[float], seeds: list[int], epochs: int, batch: int) -> Runs:
    images, labels = digits()
    runs = Runs()
    for setting in all_settings:
        started = time.perf_counter()
        per_method: dict[tuple[float, str], list[list[float]]] = {}
        for seed in seeds:
            initial = kaiming_init(mlp(setting.widths), seed, scale=setting.init_scale)
            starts = {}
            for method in METHODS:
                model, u_inf = rescaled_copy(initial, method, setting.widths[0])
                runs.u_inf.setdefault((setting.name, method), []).append(u_inf)
                for lr in lrs:
                    curve = train(
                        deepcopy(model), setting.task, images, labels, lr=lr, epochs=epochs, batch=batch, seed=seed
                    )
                    per_method.setdefault((lr, method), []).append(curve)
                    starts.setdefault(lr, []).append(curve[0])
            for lr, values in starts.items():  # same function ⇒ same initial loss
                assert max(values) - min(values) <= 1e-5 * max(abs(v) for v in values), (setting.name, lr, values)
        for (lr, method), curves in per_method.items():
            runs.curves[(setting.name, lr, method)] = np.array(curves)
        print(f"  trained {setting.title} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return runs


def target_for(runs: Runs, setting: str, lr: float, slack: float) -> float:
    """The baseline's final loss (mean over seeds) at this learning rate, times ``slack``; NaN
    when that is no lower than the initial loss (the baseline did not learn: no target)."""
    curve = runs.mean(setting, lr, "baseline")
    target = float(curve[-1]) * slack
    return target if target < curve[0] else math.nan


def training_table(runs: Runs, all_settings: list[Setting], lrs: list[float], slack: float) -> list[dict]:
    rows = []
    for setting in all_settings:
        for lr in lrs:
            target = target_for(runs, setting.name, lr, slack)
            row = {"setting": setting.name, "lr": lr, "target": target}
            for method in METHODS:
                curve = runs.mean(setting.name, lr, method)
                row[f"final_{method}"] = float(curve[-1])
                row[f"epochs_{method}"] = epochs_to_target(curve, target) if math.isfinite(target) else None
            rows.append(row)
    return rows


def stalled(runs: Runs, setting: str, lr: float) -> dict[str, np.ndarray]:
    """Per method, which seeds stalled: diverged, or a final loss above ``STALLED`` times the best
    final loss of any method on the same seed (all start from the same loss)."""
    finals = {m: runs.curves[(setting, lr, m)][:, -1] for m in METHODS}
    best = np.nanmin(np.array(list(finals.values())), axis=0)
    return {m: ~np.isfinite(f) | (f > STALLED * best) for m, f in finals.items()}


def seed_table(runs: Runs, all_settings: list[Setting], lrs: list[float], slack: float) -> list[dict]:
    """Per (setting, lr) and rescaling: the median over seeds where neither it nor the baseline
    stalled of its final loss / the baseline's and of the epoch speed-up to ``slack`` × that
    seed's baseline final loss; and the seeds that stalled, per method, counted apart."""
    rows = []
    for setting in all_settings:
        for lr in lrs:
            stuck = stalled(runs, setting.name, lr)
            base = runs.curves[(setting.name, lr, "baseline")]
            row = {
                "setting": setting.name,
                "lr": lr,
                "seeds": base.shape[0],
                "stalled": {m: int(stuck[m].sum()) for m in METHODS},
            }
            for method in RESCALINGS:
                curves = runs.curves[(setting.name, lr, method)]
                clean = ~stuck[method] & ~stuck["baseline"]
                ratios, speedups = [], []
                for seed in np.nonzero(clean)[0]:
                    ratios.append(curves[seed, -1] / base[seed, -1])
                    target = base[seed, -1] * slack
                    if target >= base[seed, 0]:
                        continue  # the baseline did not learn on this seed: no target
                    reached = epochs_to_target(curves[seed], target)
                    speedups.append(0.0 if reached is None else epochs_to_target(base[seed], target) / max(reached, 1))
                row[f"ratio_{method}"] = float(np.median(ratios)) if ratios else None
                row[f"speedup_{method}"] = float(np.median(speedups)) if speedups else None
                row[f"clean_{method}"] = int(clean.sum())
            rows.append(row)
    return rows


def print_seed_table(rows: list[dict], slack: float) -> None:
    print(
        f"\nPer seed: median over the seeds where neither the method nor the baseline stalled of final loss / "
        f"baseline final loss (ratio) and of baseline epochs / method epochs to {slack:g} × that seed's baseline "
        f"final loss (speed-up; 0 = never; — where the baseline did not learn). "
        f"Stalled (final loss > {STALLED:g} × the best method's on that seed, or "
        "diverged): seeds per method, counted apart"
    )
    header = (
        f"{'setting':<18} {'lr':>7}"
        + "".join(f" {SHORT[m] + ' ratio':>9} {SHORT[m] + ' speed':>9}" for m in RESCALINGS)
        + "   stalled "
        + "/".join(SHORT[m] for m in METHODS)
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = "".join(
            f" {_fmt_ratio(row[f'ratio_{m}']):>9} {_fmt_ratio(row[f'speedup_{m}'], '×'):>9}" for m in RESCALINGS
        )
        print(
            f"{row['setting']:<18} {row['lr']:>7.3g}{cells}   "
            + "/".join(str(row["stalled"][m]) for m in METHODS)
            + f" of {row['seeds']}"
        )


def _fmt_ratio(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.3g}{unit}"


def _fmt_epochs(value: int | None) -> str:
    return "—" if value is None else str(value)


def _speedup(base: int | None, other: int | None) -> str:
    if base is None:
        return "—"
    if other is None:
        return "never"
    return f"{base / max(other, 1):.2f}×"


def print_training(rows: list[dict], runs: Runs, epochs: int, slack: float) -> None:
    print(
        f"\nFinal training loss after {epochs} epochs (mean over seeds) and epochs to reach "
        f"{slack:g} × the baseline's final loss (on the seed-mean curve); speed-up = baseline epochs / method epochs"
    )
    header = (
        f"{'setting':<18} {'lr':>7}"
        + "".join(f" {SHORT[m]:>9}" for m in METHODS)
        + "  "
        + "".join(f" {'ep ' + SHORT[m]:>7}" for m in METHODS)
        + "  "
        + "".join(f" {SHORT[m] + ' speed-up':>12}" for m in RESCALINGS)
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['setting']:<18} {row['lr']:>7.3g}"
            + "".join(f" {row[f'final_{m}']:>9.4g}" for m in METHODS)
            + "  "
            + "".join(f" {_fmt_epochs(row[f'epochs_{m}']):>7}" for m in METHODS)
            + "  "
            + "".join(f" {_speedup(row['epochs_baseline'], row[f'epochs_{m}']):>12}" for m in RESCALINGS)
        )
    print(
        "\n‖u‖∞ at initialisation (mean over seeds): "
        + "; ".join(
            f"{s}: "
            + ", ".join(
                f"{LABELS[m].split(' ')[0]} {np.mean(runs.u_inf[(s, m)]):.2f}"
                for m in RESCALINGS
                if (s, m) in runs.u_inf
            )
            for s in dict.fromkeys(k[0] for k in runs.u_inf)
        )
    )


# -- Fig. 4: ‖u‖∞ against the width ratio ------------------------------------------------------


def dirichlet_widths(rng: np.random.Generator, alpha: float, layers: int = 8, mean_width: int = 32) -> list[int]:
    """``layers`` widths summing to layers × mean_width, each ≥ 1, proportions ~ Dirichlet(α):
    one neuron per layer, the rest shared by the largest-remainder method (paper, Appendix J)."""
    total = layers * mean_width
    shares = rng.dirichlet([alpha] * layers) * (total - layers)
    widths = np.floor(shares).astype(int)
    remainder = (total - layers) - int(widths.sum())
    widths[np.argsort(-(shares - widths), kind="stable")[:remainder]] += 1
    return (widths + 1).tolist()


INITS = {"Kaiming": 1.0, "small variance (Kaiming / 10)": 0.1}
FIG4_MAX_ITER = 20_000  # small-variance nets can need more than the default 1,000 L-BFGS iterations


def run_width_ratio(alphas: list[float], repeats: int, io_width: int = 32) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for repeat in range(repeats):
        for alpha in alphas:
            hidden = dirichlet_widths(rng, alpha)
            widths = (io_width, *hidden, io_width)
            for init, scale in INITS.items():
                model = kaiming_init(mlp(widths).double(), seed=1000 * repeat + len(rows), scale=scale)
                result = pathcond.rescale_module(model, input_shape=(io_width,), max_iter=FIG4_MAX_ITER)
                rows.append(
                    {
                        "alpha": alpha,
                        "init": init,
                        "widths": hidden,
                        "ratio": max(hidden) / min(hidden),
                        "u_inf": result.solve.u_inf,
                        "converged": result.solve.converged,
                        "kkt_residual": result.solve.kkt_residual,
                    }
                )
    return rows


def print_width_ratio(rows: list[dict]) -> None:
    print(
        "\nFig. 4 check: PathCond ‖u‖∞ against the width ratio (max/min hidden width), depth-8 MLPs "
        "32 → 8 hidden layers (256 neurons) → 32, zero biases"
    )
    print(f"{'α':>7} {'width ratio':>11} {'‖u‖∞ Kaiming':>13} {'‖u‖∞ small':>11}   hidden widths")
    kaiming = [r for r in rows if r["init"] == "Kaiming"]
    small = [r for r in rows if r["init"] != "Kaiming"]
    for a, b in sorted(zip(kaiming, small), key=lambda pair: pair[0]["ratio"]):
        print(f"{a['alpha']:>7.3g} {a['ratio']:>11.1f} {a['u_inf']:>13.2f} {b['u_inf']:>11.2f}   {a['widths']}")
    for name, group in (("Kaiming", kaiming), ("small variance", small)):
        norms = [r["u_inf"] for r in group]
        print(
            f"{name}: Pearson correlation of ln(width ratio) and ‖u‖∞ = {_log_correlation(group):.2f}; "
            f"‖u‖∞ median {np.median(norms):.2f}, range {min(norms):.2f}–{max(norms):.2f}; "
            f"not converged: {sum(not r['converged'] for r in group)}"
        )


# -- figures -------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(runs: Runs, setting: Setting, lrs: list[float], path: Path, slack: float) -> None:
    """One panel per learning rate: seed-mean loss per method, shaded between the seeds' min and max."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(lrs), figsize=(3.3 * len(lrs), 3.8), sharey=True, constrained_layout=True)
    for ax, lr in zip(np.atleast_1d(axes), lrs):
        for method in METHODS:
            curves = runs.curves[(setting.name, lr, method)]
            epochs = np.arange(curves.shape[1])
            style, width = STYLES[method]
            ax.plot(epochs, curves.mean(axis=0), color=COLOURS[method], ls=style, lw=width, label=LABELS[method])
            ax.fill_between(epochs, curves.min(axis=0), curves.max(axis=0), color=COLOURS[method], alpha=0.15, lw=0)
        target = target_for(runs, setting.name, lr, slack)
        if math.isfinite(target):
            ax.axhline(target, color="black", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"lr = {lr:g}")
        ax.set_xlabel("epoch")
        ax.grid(True, which="major", alpha=0.3)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("training loss (" + ("cross-entropy" if setting.task == "classify" else "MSE") + ")")
    first.legend(loc="lower left", fontsize=8)
    seeds = runs.curves[(setting.name, lrs[0], "baseline")].shape[0]
    fig.suptitle(
        f"{setting.title} on load_digits: SGD, {seeds} seeds (line: mean, band: min–max; dotted: target = "
        f"{slack:g} × baseline final, none where the baseline did not learn)",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_summary(rows: list[dict], all_settings: list[Setting], lrs: list[float], epochs: int, path: Path) -> None:
    """Final-loss ratio to the baseline, per setting and learning rate, for PathCond and ENorm."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    names = [s.name for s in all_settings]
    fig, axes = plt.subplots(
        1, len(RESCALINGS), figsize=(5.5 * len(RESCALINGS), 0.55 * len(names) + 2.2), constrained_layout=True
    )
    lookup = {(r["setting"], r["lr"]): r for r in rows}
    for ax, method in zip(axes, RESCALINGS):
        ratio = np.array(
            [[lookup[(n, lr)][f"final_{method}"] / lookup[(n, lr)]["final_baseline"] for lr in lrs] for n in names]
        )
        log_ratio = np.log2(ratio)
        image = ax.imshow(
            np.nan_to_num(log_ratio, nan=0.0), cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -2.0, 2.0), aspect="auto"
        )
        for i in range(len(names)):
            for j in range(len(lrs)):
                text = "diverged" if not math.isfinite(ratio[i, j]) else f"{ratio[i, j]:.2f}"
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if math.isfinite(log_ratio[i, j]) and abs(log_ratio[i, j]) > 1.3 else "black",
                )
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("learning rate")
        ax.set_title(f"{LABELS[method]}: final loss / baseline final loss\n(< 1, blue: better than no rescaling)")
    fig.colorbar(image, ax=axes, label="log2 of the ratio (clipped at ±2)", shrink=0.9)
    fig.suptitle(
        f"load_digits, plain SGD, training loss after {epochs} epochs (mean over seeds); rescaling applied once, "
        "at initialisation",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_correlation(rows: list[dict]) -> float:
    return float(np.corrcoef(np.log([r["ratio"] for r in rows]), [r["u_inf"] for r in rows])[0, 1])


def plot_width_ratio(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.6), constrained_layout=True)
    for (init, marker), colour in zip(zip(INITS, ("o", "^")), ("#1f77b4", "#d62728")):
        group = [r for r in rows if r["init"] == init]
        for converged in (True, False):
            members = [r for r in group if r["converged"] is converged]
            if members:
                ax.scatter(
                    [r["ratio"] for r in members],
                    [r["u_inf"] for r in members],
                    marker=marker,
                    alpha=0.8,
                    color=colour if converged else "none",
                    edgecolors=colour,
                    label=f"{init} init (corr. with ln ratio {_log_correlation(group):.2f})"
                    if converged
                    else f"{init}: not converged",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("width ratio (max / min hidden width)")
    ax.set_ylabel("PathCond ‖u*‖∞  (ln of the largest neuron scale)")
    ax.set_title(
        "Depth-8 MLPs (zero biases), 256 hidden neurons spread by a Dirichlet draw\n(the paper's Fig. 4 check)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer settings, epochs, seeds and rates (a smoke run)")
    parser.add_argument("--epochs", type=int, help="epochs per run (default 50, quick 15)")
    parser.add_argument("--seeds", type=int, help="seeds (default 3, quick 2)")
    parser.add_argument("--batch", type=int, default=512, help="mini-batch size (default 512: 4 steps per epoch)")
    parser.add_argument("--lrs", type=float, nargs="+", help="learning rates (default 0.003 0.01 0.03 0.1 0.3)")
    parser.add_argument("--slack", type=float, default=1.1, help="target = slack × the baseline's final loss")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these small nets)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="where the PNGs go")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw the tables and figures from the last run's train_speedup_results.json in --out",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    epochs = args.epochs or (15 if args.quick else 50)
    seeds = list(range(args.seeds or (2 if args.quick else 3)))
    lrs = args.lrs or ([0.01, 0.1] if args.quick else [0.003, 0.01, 0.03, 0.1, 0.3])
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); epochs {epochs}, seeds {len(seeds)}, "
        f"batch {args.batch}, learning rates {lrs}",
        file=sys.stderr,
    )

    results_path = args.out / "train_speedup_results.json"
    all_settings = settings(args.quick)
    if args.replot:
        saved = json.loads(results_path.read_text())
        runs, width_rows, lrs = Runs.from_json(saved["training"]), saved["width_ratio"], saved["lrs"]
        all_settings = [s for s in all_settings if (s.name, lrs[0], "baseline") in runs.curves]
        epochs = len(next(iter(runs.curves.values()))[0]) - 1
    else:
        runs = run_training(all_settings, lrs, seeds, epochs, args.batch)
        alphas = [0.3, 1, 3, 10, 100] if args.quick else [0.2, 0.5, 1, 2, 5, 10, 30, 100, 1000]
        width_rows = run_width_ratio(alphas, repeats=1 if args.quick else 3)
        results_path.write_text(json.dumps({"lrs": lrs, "training": runs.to_json(), "width_ratio": width_rows}))
    rows = training_table(runs, all_settings, lrs, args.slack)
    print_training(rows, runs, epochs, args.slack)
    print_seed_table(seed_table(runs, all_settings, lrs, args.slack), args.slack)
    print_width_ratio(width_rows)
    for setting in all_settings:
        plot_curves(runs, setting, lrs, args.out / f"train_{_slug(setting.name)}.png", args.slack)
    plot_summary(rows, all_settings, lrs, epochs, args.out / "train_summary.png")
    plot_width_ratio(width_rows, args.out / "fig4_uinf_width_ratio.png")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; figures in {args.out}", file=sys.stderr)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


if __name__ == "__main__":
    main()
