"""Reports as plain data: the stable JSON schema (documented in the README) and rich tables.

Both views are built from the same dictionary, so what people read and what pipelines
parse never disagree.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from . import __version__
from .api import Analysis, RescaleResult
from .diag import unused_parameters
from .objective import degenerate_mask

SCHEMA_VERSION = 1


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or Infinity: non-finite numbers become null."""
    return value if value is not None and math.isfinite(value) else None


def _power_of_ten(log10: float | None) -> float | None:
    if log10 is None:
        return None
    try:
        return _finite(10.0**log10)
    except OverflowError:
        return None


def analysis_report(analysis: Analysis) -> dict[str, Any]:
    model, groups = analysis.model, analysis.groups
    degenerate = degenerate_mask(groups, analysis.diag)
    low, high = analysis.log10_min, analysis.log10_max
    layers = analysis.per_layer()
    unused = unused_parameters(groups)
    return {
        "schema": SCHEMA_VERSION,
        "pathcond_version": __version__,
        "model": model.source,
        "format": model.format,
        "parameters": model.parameter_count,
        "dag_parameters": groups.p,
        "hidden_units": model.hidden_units,
        "groups": {
            "free": groups.num_free,
            "fixed": groups.num_fixed,
            "degenerate": int(degenerate.sum()),
            "colours": groups.num_colours,
        },
        "paths": {"log10": _finite(analysis.paths.log10), "exact": analysis.paths.exact},
        "diag_g": {
            "min": _power_of_ten(low),
            "max": _power_of_ten(high),
            "log10_min": _finite(low),
            "log10_max": _finite(high),
            "log10_spread": _finite(high - low) if low is not None and high is not None else None,
            "zeros": sum(layer.zeros for layer in layers),
            "per_layer": [
                {
                    "layer": layer.layer,
                    "parameters": layer.parameters,
                    "zeros": layer.zeros,
                    "log10_min": _finite(layer.log10_min),
                    "log10_max": _finite(layer.log10_max),
                }
                for layer in layers
            ],
            "histogram": [
                {"log10_low": low_edge, "log10_high": high_edge, "count": count}
                for low_edge, high_edge, count in analysis.histogram()
            ],
        },
        "input_shape": [list(node.shape) for node in model.graph.inputs],
        "unused_parameters": unused,
        "warnings": list(model.warnings) + _unused_warning(unused, model),
        "seconds": {stage: round(value, 6) for stage, value in analysis.seconds.items()},
    }


def _unused_warning(unused: dict[str, int], model) -> list[str]:
    if not unused:
        return []
    shapes = ", ".join(str(tuple(node.shape)) for node in model.graph.inputs)
    where = ", ".join(f"{layer} ({count:,})" for layer, count in unused.items())
    return [f"{sum(unused.values()):,} DAG parameter(s) lie on no path at input shape {shapes} (conv taps that only "
            f"see padding): {where}. diag(G) depends on the input size: analyse at the training resolution "
            "(--input-shape)."]


def rescale_report(result: RescaleResult, output: str, seconds: dict[str, float]) -> dict[str, Any]:
    report = analysis_report(result.analysis)
    solve, verification = result.solve, result.verification
    labels = result.analysis.groups.labels
    report["groups"]["degenerate"] = len(solve.degenerate)
    report.update({
        "solver": {
            "name": solve.method,
            "iterations": solve.iterations,
            "passes": solve.passes,
            "objective": [_finite(v) for v in solve.objective],
            "objective_initial": _finite(solve.objective[0]),
            "objective_final": _finite(solve.objective[-1]),
            "decrease": _finite(solve.decrease),
            "kkt_residual": _finite(solve.kkt_residual),
            "converged": solve.converged,
        },
        "u_inf": _finite(solve.u_inf),
        "degenerate_groups": [labels[h] for h in solve.degenerate],
        "verification": {
            "max_abs_error": _finite(verification.max_abs_error),
            "max_rel_error": _finite(verification.max_rel_error),
            "tolerance": verification.tolerance,
            "modes": list(verification.modes),
            "passed": verification.passed,
        },
        "output": output,
        "seconds": {stage: round(value, 6) for stage, value in seconds.items()},
    })
    return report


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render(report: dict[str, Any], console: Console, *, per_layer: bool = True) -> None:
    """Rich tables for people (the console writes to stderr)."""
    summary = Table(title=f"pathcond · {report['model']}", show_header=False, title_justify="left")
    summary.add_column("", style="bold")
    summary.add_column("")
    groups, paths, diag = report["groups"], report["paths"], report["diag_g"]
    summary.add_row("format", report["format"])
    summary.add_row("input shape", " · ".join(str(tuple(shape)) for shape in report["input_shape"]))
    summary.add_row("parameters", _fmt(report["parameters"]))
    summary.add_row("DAG parameters (p)", _fmt(report["dag_parameters"]))
    summary.add_row("hidden units", _fmt(report["hidden_units"]))
    summary.add_row("rescaling groups", f"{_fmt(groups['free'])} free · {_fmt(groups['fixed'])} fixed · "
                    f"{_fmt(groups['degenerate'])} degenerate · {groups['colours']} colours")
    exact = f" ({_fmt(paths['exact'])})" if paths["exact"] is not None else ""
    summary.add_row("paths", f"10^{_fmt(paths['log10'], 6)}{exact}")
    summary.add_row("diag(G)", f"min {_fmt(diag['min'])} · max {_fmt(diag['max'])} · "
                    f"log10 spread {_fmt(diag['log10_spread'])} · zeros {_fmt(diag['zeros'])}")
    if "solver" in report:
        solver, verification = report["solver"], report["verification"]
        state = "[green]converged[/]" if solver["converged"] else "[yellow]not converged[/]"
        summary.add_row("solver", f"{solver['name']} · {solver['iterations']} iterations · "
                        f"{solver['passes']} passes · {state}")
        summary.add_row("objective", f"F(0) {_fmt(solver['objective_initial'], 10)} → F* "
                        f"{_fmt(solver['objective_final'], 10)} (decrease {_fmt(solver['decrease'])})")
        summary.add_row("KKT residual", _fmt(solver["kkt_residual"]))
        summary.add_row("‖u‖∞", _fmt(report["u_inf"]))
        check = "[green]passed[/]" if verification["passed"] else "[red]FAILED[/]"
        summary.add_row("verification", f"max abs {_fmt(verification['max_abs_error'])} · max rel "
                        f"{_fmt(verification['max_rel_error'])} (tol {verification['tolerance']:g}, "
                        f"{'+'.join(verification['modes'])}) {check}")
        summary.add_row("output", report["output"])
    summary.add_row("seconds", " · ".join(f"{k} {v:.3g}" for k, v in report["seconds"].items()))
    console.print(summary)
    if per_layer and diag["per_layer"]:
        layers = Table(title="diag(G) per layer (BatchNorm folded)", title_justify="left")
        for column in ("layer", "parameters", "zeros", "log10 min", "log10 max"):
            layers.add_column(column, justify="left" if column == "layer" else "right")
        for row in diag["per_layer"]:
            layers.add_row(row["layer"], _fmt(row["parameters"]), _fmt(row["zeros"]),
                           _fmt(row["log10_min"]), _fmt(row["log10_max"]))
        console.print(layers)
    if diag["histogram"]:
        console.print(histogram_text(diag["histogram"]))
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    if report.get("degenerate_groups"):
        shown = ", ".join(report["degenerate_groups"][:10])
        more = len(report["degenerate_groups"]) - 10
        console.print(f"[yellow]degenerate groups frozen at u = 0:[/] {shown}{f' (+{more} more)' if more > 0 else ''}")


def histogram_text(bins: list[dict[str, Any]], width: int = 40) -> str:
    peak = max(b["count"] for b in bins) or 1
    lines = ["log10 diag(G) histogram (g > 0)"]
    for b in bins:
        bar = "█" * round(width * b["count"] / peak)
        lines.append(f"  [{b['log10_low']:8.2f}, {b['log10_high']:8.2f})  {bar} {b['count']:,}")
    return "\n".join(lines)
