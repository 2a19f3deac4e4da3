"""``--plot``: log10 diag(G) per layer before and after rescaling, and F per iteration.

matplotlib is an optional extra (``pip install 'pathcond[plot]'``); the CLI checks for it
before doing any work. Each layer is drawn as a box (quartiles, median line) with whiskers
from its smallest to its largest g > 0, before and after side by side, in network order.
The whiskers are the exact per-layer extremes of the report; the quartiles come from an
evenly strided sample of at most QUARTILE_SAMPLE values per layer, so that a 25 M-parameter
network is drawn without copying its diag(G).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.log_g import LogG, OuterLog, dense
from ..statistics import LOG10_E, DiagSummary

QUARTILE_SAMPLE = 200_000
BEFORE_COLOUR, AFTER_COLOUR = "#9e9e9e", "#1f77b4"


def _layer_boxes(groups, log_g: Sequence[LogG], summary: DiagSummary) -> dict[str, dict[str, Any]]:
    """Box statistics of log10 g > 0 per layer, in network order."""
    tensors: dict[str, list[LogG]] = {}
    for dp, lg in zip(groups.dag_params, log_g):
        tensors.setdefault(dp.layer, []).append(lg)
    boxes = {}
    for spread in summary.layers:
        step = max(1, spread.parameters // QUARTILE_SAMPLE)
        sample = torch.cat([_strided(t, step) for t in tensors[spread.layer]]).to("cpu", torch.float64)
        sample = sample[torch.isfinite(sample)].numpy() * LOG10_E
        q1, med, q3 = np.percentile(sample, [25, 50, 75]) if sample.size else (np.nan,) * 3
        low, high = (np.nan if v is None else v for v in (spread.log10_min, spread.log10_max))
        boxes[spread.layer] = {"label": spread.layer, "whislo": low, "q1": q1, "med": med, "q3": q3, "whishi": high}
    return boxes


def _strided(lg: LogG, step: int) -> torch.Tensor:
    """Every ``step``-th entry of the flattened log g, without expanding an outer product."""
    if isinstance(lg, OuterLog):
        return lg.flat_entries(torch.arange(0, lg.numel(), step, device=lg.rows.device))
    return dense(lg).reshape(-1)[::step]


def short_label(layer: str, limit: int = 28) -> str:
    """A readable tick label: exporter paths such as ``/layer1/layer1.0/conv1/Conv`` become
    ``layer1.0/conv1`` (no segment that the next one repeats, no trailing op type)."""
    parts = [part for part in layer.split("/") if part]
    if len(parts) > 1 and parts[-1][:1].isupper():
        parts = parts[:-1]
    parts = [
        part
        for part, following in zip(parts, [*parts[1:], None])
        if following is None or not following.startswith(part)
    ]
    label = "/".join(parts) or layer
    return label if len(label) <= limit else label[: limit // 2 - 1] + "…" + label[-(limit // 2) :]


def draw(report: dict[str, Any], analysis, result, path: Path, fmt: str) -> None:
    """Write the figure for ``report`` to ``path`` (``result`` is None for ``inspect``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = analysis.groups
    before = _layer_boxes(groups, analysis.diag.parts, analysis.summary)
    after = _layer_boxes(groups, result.diag_after.parts, result.summary_after) if result is not None else None
    layers = list(before)
    width = min(max(8.0, 0.45 * len(layers) + 3.0), 40.0)
    figure = plt.figure(figsize=(width, 8.0 if result is not None else 5.0), layout="constrained")
    if result is not None:
        grid = figure.add_gridspec(2, 2, height_ratios=[1.6, 1.0])
        boxes = figure.add_subplot(grid[0, :])
        _draw_objective(figure.add_subplot(grid[1, 0]), figure.add_subplot(grid[1, 1]), report)
    else:
        boxes = figure.add_subplot(1, 1, 1)
    _draw_layers(boxes, layers, before, after, report)
    figure.suptitle(f"pathcond {report['command']} · {Path(report['model']).name}", fontsize=13, x=0.01, ha="left")
    figure.savefig(path, format=fmt, dpi=110)
    plt.close(figure)


def _draw_layers(axes, layers: list[str], before: dict, after: dict | None, report: dict[str, Any]) -> None:
    positions = np.arange(len(layers), dtype=float)
    offset, box_width = (0.2, 0.36) if after is not None else (0.0, 0.6)
    series = [(before, -offset, BEFORE_COLOUR, "before")]
    if after is not None:
        series.append((after, offset, AFTER_COLOUR, "after rescaling"))
    for values, shift, colour, label in series:
        axes.bxp(
            [values[layer] for layer in layers],
            positions=positions + shift,
            widths=box_width,
            showfliers=False,
            patch_artist=True,
            boxprops={"facecolor": colour, "edgecolor": "black", "linewidth": 0.6},
            medianprops={"color": "black", "linewidth": 1.0},
            whiskerprops={"color": colour, "linewidth": 1.2},
            capprops={"color": colour, "linewidth": 1.2},
        )
        axes.plot([], [], color=colour, linewidth=8, label=label)
    axes.set_xticks(positions)
    # Horizontal labels while they fit side by side (about 12 characters per inch at this size).
    longest = max(len(short_label(layer)) for layer in layers)
    rotation = 0 if longest * len(layers) <= 12 * axes.figure.get_figwidth() else 90
    axes.set_xticklabels(
        [short_label(layer) for layer in layers], rotation=rotation, fontsize=9 if len(layers) <= 30 else 7
    )
    axes.set_xlim(-0.6, len(layers) - 0.4)
    axes.set_ylabel("log10 diag(G)  (g > 0)")
    axes.grid(axis="y", alpha=0.3)
    conditioning = report["conditioning"]
    title = (
        f"diag(G) per layer, network order: box = quartiles, whiskers = min–max; D = {conditioning['before']['D']:.4g}"
    )
    if after is not None:
        title += f" → {conditioning['after']['D']:.4g} after"
    axes.set_title(title, fontsize=10, loc="left")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9, frameon=False)


def _draw_objective(values_axes, gap_axes, report: dict[str, Any]) -> None:
    from matplotlib.ticker import MaxNLocator

    solver = report["solver"]
    history = np.array([v for v in solver["objective"] if v is not None], dtype=float)
    iterations = np.arange(history.size)
    values_axes.plot(iterations, history, marker="o", markersize=3, color=AFTER_COLOUR)
    values_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    values_axes.set_xlabel("iteration")
    values_axes.set_ylabel("F(u)")
    values_axes.set_title(
        f"F per iteration ({solver['name']}, {'converged' if solver['converged'] else 'NOT converged'})",
        fontsize=10,
        loc="left",
    )
    values_axes.grid(alpha=0.3)
    values_axes.ticklabel_format(axis="y", useOffset=False, style="plain")
    gap = history[:-1] - history[-1]
    shown = gap > 0
    if shown.any():
        gap_axes.semilogy(iterations[:-1][shown], gap[shown], marker="o", markersize=3, color=AFTER_COLOUR)
    gap_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    gap_axes.set_xlabel("iteration")
    gap_axes.set_ylabel("F(u) − F(final)")
    gap_axes.set_title(
        f"F − final F, log scale (final KKT residual {solver['kkt_residual']:.2g})", fontsize=10, loc="left"
    )
    gap_axes.grid(alpha=0.3, which="both")
