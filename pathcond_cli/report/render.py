"""Reports as plain data: the stable JSON schema (documented in docs/json.md) and rich tables.

Both views are built from the same dictionary, so what people read and what pipelines
parse never disagree.
"""

from __future__ import annotations

import decimal
import math
import os
import textwrap
from collections.abc import Sequence
from typing import Any

import rich.markup
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..analysis import Analysis
from ..engine.diag import PathNorm, norm_order_text
from ..engine.model import LoadedModel
from ..io.fileio import printable
from ..rescaling import RescaleResult
from ..statistics import LOG10_E, Conditioning, DiagSummary, ZeroCause
from ..version import __version__

SCHEMA_VERSION = 2


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


def _diag_section(summary: DiagSummary, bins: list[tuple[float, float, int]]) -> dict[str, Any]:
    """``diag_g`` (or ``diag_g_after``): spread, per-layer table and the histogram ``bins``."""
    low, high = (None if v is None else v * LOG10_E for v in (summary.ln_low, summary.ln_high))
    layers = summary.layers
    return {
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
            {"log10_low": low_edge, "log10_high": high_edge, "count": count} for low_edge, high_edge, count in bins
        ],
    }


def _conditioning(measure: Conditioning) -> dict[str, Any]:
    return {
        "D": _finite(measure.value),
        "D_per_parameter": _finite(measure.per_parameter),
        "parameters_counted": measure.counted,
        "zeros": measure.zeros,
    }


def path_norms_section(norms: dict[str, PathNorm] | None) -> dict[str, Any] | None:
    """``path_norms``: ‖Φ‖_q by key (``l1``, ``l2``, ``l<Q>``), each as log10 and value (null
    outside float64)."""
    if norms is None:
        return None
    return {key: {"q": norm.q, "log10": _finite(norm.log10), "value": norm.value} for key, norm in norms.items()}


def _zeros_section(causes: list[ZeroCause], p: int) -> dict[str, Any]:
    """``diag_g_zeros``: the share of g = 0 among the DAG parameters, and per layer with zeros
    how many and their most likely cause."""
    return {
        "share": sum(cause.zeros for cause in causes) / p if p else 0.0,
        "per_layer": [
            {
                "layer": cause.layer,
                "parameters": cause.parameters,
                "zeros": cause.zeros,
                "share": cause.zeros / cause.parameters,
                "unused_taps": cause.unused,
                "batchnorm_gamma": cause.gamma,
                "zero_weights": cause.weights,
                "batchnorm": cause.batchnorm.name if cause.batchnorm else None,
                "cause": cause.cause,
            }
            for cause in causes
        ],
    }


def loaded_report(model: LoadedModel, command: str) -> dict[str, Any]:
    """The keys known once the model is read, before any analysis: the report so far of a
    command that fails later (see :func:`error_document`)."""
    return {
        "schema": SCHEMA_VERSION,
        "pathcond_version": __version__,
        "command": command,
        "model": model.source,
        "format": model.format,
        "arch_source": model.arch_source,
        "parameters": model.parameter_count,
        "hidden_units": model.hidden_units,
        "input_shape": [list(node.shape) for node in model.graph.inputs],
        "processing": processing_section(model),
        "warnings": list(model.warnings),
    }


PROCESSING_NOTE = (
    "carried unchanged around the ReLU DAG; path norms, diag(G), compare and prune are those of the DAG between them"
)


def processing_section(model: LoadedModel) -> dict[str, Any] | None:
    """``processing``: the file's pre- and post-processing, carried unchanged (op types in file
    order), the file's own inputs, and what the measures are of; null when the DAG is the file."""
    carried = model.carried
    if not carried:
        return None
    return {
        "pre": list(carried.pre),
        "post": list(carried.post),
        "file_inputs": {name: list(shape) for name, shape in carried.inputs.items()},
        "note": PROCESSING_NOTE,
    }


def spec_processing_warnings(model: LoadedModel, source: str) -> list[str]:
    """What the user of ``model``'s spec must know when the ONNX file has pre- or post-processing:
    the spec is the DAG between them, without them."""
    carried = model.carried
    if not carried:
        return []
    parts = []
    if carried.pre:
        inputs = ", ".join(f"'{value}'" for value in carried.dag_inputs.values())
        parts.append(f"pre-processing ({_by_operation(carried.pre)}), whose outputs ({inputs}) are the spec's inputs")
    if carried.post:
        outputs = ", ".join(f"'{value}'" for value in carried.dag_outputs)
        parts.append(f"post-processing ({_by_operation(carried.post)}), which reads the spec's outputs ({outputs})")
    return [
        f"{source}: the spec is the ReLU DAG alone, not the whole network: the file carries "
        f"{', and '.join(parts)}; the spec has none of it. A checkpoint read with this spec computes the DAG "
        "only: apply that processing around it yourself, or use the ONNX file."
    ]


def _processing_rows(*sections: tuple[str, dict[str, Any] | None]) -> list[tuple[str, str]]:
    """The table's row of each (name suffix, ``processing`` section) that is not null."""
    return [
        (
            f"pre/post-processing{suffix}",
            f"pre {_safe(_by_operation(processing['pre']))} · post "
            f"{_safe(_by_operation(processing['post']))}: {processing['note']}",
        )
        for suffix, processing in sections
        if processing is not None
    ]


def _bound_row(processing: dict[str, Any] | None, radius: float, value: str) -> tuple[str, str]:
    """The output-change row: with pre- or post-processing, the change is of the DAG, for its
    inputs (:func:`~.toolkit.bound_scope`)."""
    if processing is None:
        return f"output change, ‖x‖∞ ≤ {radius:g}", value
    if processing["pre"]:
        return (
            "output change of the DAG",
            f"for DAG inputs ‖z‖∞ ≤ {radius:g} (after the file's pre-processing): {value}",
        )
    return "output change of the DAG", f"before the file's post-processing, for ‖x‖∞ ≤ {radius:g}: {value}"


def _bound_note(result) -> str | None:
    """``bound_note``: why no bound applies, then what the bound is of when the DAG is not the
    whole file; null when the bound applies to the file end to end."""
    return "; ".join(note for note in (result.bound_note, result.bound_scope) if note) or None


def _by_operation(ops: Sequence[str]) -> str:
    """``Sub, Div ×2, Flatten``: each operation once, in order of first appearance, with its count."""
    counts = {op: ops.count(op) for op in dict.fromkeys(ops)}
    return ", ".join(op if count == 1 else f"{op} ×{count}" for op, count in counts.items()) or "none"


def analysis_report(
    analysis: Analysis,
    *,
    bins: list[tuple[float, float, int]] | None = None,
    degenerate: int | None = None,
) -> dict[str, Any]:
    """The ``inspect`` report. ``bins`` is the histogram (default: over diag(G)'s own range);
    ``degenerate`` is the solver's count of frozen groups when known."""
    model, groups, summary = analysis.model, analysis.groups, analysis.summary
    unused = analysis.unused_parameters
    return {
        **loaded_report(model, "inspect"),
        "device": analysis.device,
        "dag_parameters": groups.p,
        "groups": {
            "free": groups.num_free,
            "fixed": groups.num_fixed,
            "degenerate": analysis.degenerate_groups if degenerate is None else degenerate,
            "colours": groups.num_colours,
        },
        "paths": {"log10": _finite(analysis.paths.log10), "exact": analysis.paths.exact},
        "path_norms": path_norms_section(analysis.path_norms),
        "conditioning": {"before": _conditioning(analysis.conditioning)},
        "diag_g": _diag_section(summary, analysis.bins if bins is None else bins),
        "diag_g_zeros": _zeros_section(analysis.zero_causes, groups.p),
        "unused_parameters": unused,
        "warnings": list(model.warnings) + _unused_warning(unused, model),
        "seconds": {stage: round(value, 6) for stage, value in analysis.seconds.items()},
    }


def failure_report(command: str, model: str) -> dict[str, Any]:
    """What is known of a file that failed before it was read, in a run over several files."""
    return {"schema": SCHEMA_VERSION, "pathcond_version": __version__, "command": command, "model": model}


def _unused_warning(unused: dict[str, int], model) -> list[str]:
    if not unused:
        return []
    shapes = ", ".join(str(tuple(node.shape)) for node in model.graph.inputs)
    where = ", ".join(f"{layer} ({count:,})" for layer, count in unused.items())
    return [
        f"{sum(unused.values()):,} DAG parameter(s) lie on no path at input shape {shapes} (conv taps that only "
        f"see padding): {where}. diag(G) depends on the input size: analyse at the training resolution "
        "(--input-shape)."
    ]


def _bound_keys(result: RescaleResult) -> dict[str, Any]:
    """How the bound on |u_h| was chosen (``--max-log-scale``) and what it cost."""
    bound = result.bound
    return {
        "max_log_scale_rule": bound.rule,
        "unbounded_u_inf": _finite(bound.unbounded.u_inf) if bound.unbounded is not None else None,
        "share_of_decrease_kept": _finite(bound.share_of_decrease_kept(result.solve)),
    }


def error_document(report: dict[str, Any], exc: BaseException, exit_code: int, message: str) -> dict[str, Any]:
    """The JSON document of a run that failed after its input was read: the report so far
    (``report``) with ``error`` = {exit_code, type (the exception's class name), message (the
    paragraph printed on stderr)}. A failed ``rescale`` or ``prune`` reports no output: ``output`` is null."""
    document = dict(report)
    if document["command"] in ("rescale", "prune"):
        document["output"] = None
    document["error"] = {"exit_code": exit_code, "type": type(exc).__name__, "message": message}
    return document


def rescale_report(result: RescaleResult, output: str | None, seconds: dict[str, float]) -> dict[str, Any]:
    """The ``rescale`` report; ``output`` and ``verification`` are null before the file is written."""
    analysis = result.analysis
    solve, verification = result.solve, result.verification
    before, after = analysis.summary, result.summary_after
    bins_before, bins_after = result.bins
    report = analysis_report(analysis, bins=bins_before, degenerate=len(solve.degenerate))
    report["command"] = "rescale"
    decrease = before.conditioning.value - after.conditioning.value
    report["conditioning"] = {
        "before": _conditioning(before.conditioning),
        "after": _conditioning(after.conditioning),
        "decrease": _finite(decrease),
        "fraction_of_gap_closed": _finite(decrease / before.conditioning.value)
        if before.conditioning.value > 0
        else None,
    }
    report["diag_g_after"] = _diag_section(after, bins_after)
    report["path_norms_after"] = path_norms_section(result.path_norms_after)
    if not solve.converged:
        report["warnings"].append(
            f"not converged: the solver stopped after {solve.iterations} iterations (--max-iter {solve.max_iter}) "
            f"with relative KKT residual {solve.kkt_residual:.3g} above the tolerance {solve.tol:g}; the output "
            "computes the same function but is not the PathCond optimum (raise --max-iter)."
        )
    labels = analysis.groups.labels
    report.update(
        {
            "criterion": result.criterion,
            "solver": {
                "name": solve.method,
                "iterations": solve.iterations,
                "max_iter": solve.max_iter,
                "tolerance": solve.tol,
                "passes": solve.passes,
                "objective": [_finite(v) for v in solve.objective],
                "objective_initial": _finite(solve.objective[0]),
                "objective_final": _finite(solve.objective[-1]),
                "decrease": _finite(solve.decrease),
                "kkt_residual": _finite(solve.kkt_residual),
                "converged": solve.converged,
                "max_log_scale": solve.max_log_scale,
                "groups_at_bound": solve.groups_at_bound,
                **_bound_keys(result),
            },
            "u_inf": _finite(solve.u_inf),
            "degenerate_groups": [labels[h] for h in solve.degenerate],
            "warnings": report["warnings"] + result.warnings,
            "verification": None
            if verification is None
            else {
                "max_abs_error": _finite(verification.max_abs_error),
                "max_rel_error": _finite(verification.max_rel_error),
                "tolerance": verification.tolerance,
                "modes": list(verification.modes),
                "passed": verification.passed,
                "by_mode": {
                    mode: {"max_rel_error": _finite(error), "tolerance": verification.tolerances[mode]}
                    for mode, error in verification.errors.items()
                },
                "independent": verification.independent,
            },
            "output": output,
            "seconds": {stage: round(value, 6) for stage, value in seconds.items()},
        }
    )
    return report


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _bound_fmt(value: float | None, digits: int, *, upper: bool) -> str:
    """A bound at ``digits`` significant digits, rounded away from what it bounds: an upper bound
    up, a lower bound down, so that the printed number is a bound too (JSON keeps the float)."""
    if value is None or not math.isfinite(value) or value == 0:
        return _fmt(value, digits)
    exact = decimal.Decimal(value)
    step = decimal.Decimal(1).scaleb(exact.adjusted() - digits + 1)
    directed = exact.quantize(step, rounding=decimal.ROUND_CEILING if upper else decimal.ROUND_FLOOR)
    return f"{float(directed):.{digits}g}"


def _safe(text: str, *, keep: str = "") -> str:
    """A string read from a file (a path, a node or tensor name), for rich markup: its control
    characters (ESC, ...) shown as escapes, its brackets not taken as markup."""
    return rich.markup.escape(printable(text, keep=keep))


def path_norms_text(norms: dict[str, Any]) -> str:
    """``ℓ1 4.331e+08 · ℓ2 0.2859``: each norm's value, or 10^log10 beyond float64."""
    return " · ".join(
        f"ℓ{norm_order_text(norm['q'])} "
        + (_fmt(norm["value"], 7) if norm["value"] is not None else f"10^{_fmt(norm['log10'], 7)}")
        for norm in norms.values()
    )


def _conditioning_text(measure: dict[str, Any]) -> str:
    return f"D {_fmt(measure['D'], 6)} (ln mean/geomean g {_fmt(measure['D_per_parameter'])})"


def _spread_text(diag: dict[str, Any]) -> str:
    return (
        f"min {_fmt(diag['min'])} · max {_fmt(diag['max'])} · log10 spread {_fmt(diag['log10_spread'])} · "
        f"zeros {_fmt(diag['zeros'])}"
    )


# Width tables are printed in when stderr is not a terminal: wider than any row.
UNBOUNDED_WIDTH = 100_000


def render(report: dict[str, Any], console: Console, *, per_layer: bool = True) -> None:
    """Rich tables for people (the console writes to stderr); warnings last."""
    console.print(
        f"pathcond {report['command']} · {printable(report['model'])}",
        style="bold",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    rows: list[tuple[str, str]] = []  # (name, value as rich markup)
    groups, paths, diag = report["groups"], report["paths"], report["diag_g"]
    after = report.get("diag_g_after")
    conditioning = report["conditioning"]
    rows.append(("format", report["format"]))
    rows.append(("architecture from", _safe(report["arch_source"])))
    rows.append(("device", report["device"]))
    rows.append(("input shape", " · ".join(str(tuple(shape)) for shape in report["input_shape"])))
    rows.extend(_processing_rows(("", report.get("processing"))))
    rows.append(("parameters", _fmt(report["parameters"])))
    rows.append(
        (
            "DAG parameters",
            f"{_fmt(report['dag_parameters'])} ({_fmt(conditioning['before']['parameters_counted'])} "
            "with g > 0: p of F and D)",
        )
    )
    rows.append(("hidden units", _fmt(report["hidden_units"])))
    rows.append(
        (
            "rescaling groups",
            f"{_fmt(groups['free'])} free · {_fmt(groups['fixed'])} fixed · "
            f"{_fmt(groups['degenerate'])} degenerate · {groups['colours']} colours",
        )
    )
    exact = f" ({_fmt(paths['exact'])})" if paths["exact"] is not None else ""
    rows.append(("paths", f"10^{_fmt(paths['log10'], 6)}{exact}"))
    rows.append(("path norms" + (" before" if after is not None else ""), path_norms_text(report["path_norms"])))
    if report.get("path_norms_after"):
        rows.append(("path norms after", path_norms_text(report["path_norms_after"])))
    if after is None:
        rows.append(("conditioning", _conditioning_text(conditioning["before"])))
        rows.append(("diag(G)", _spread_text(diag)))
    else:
        closed = conditioning["fraction_of_gap_closed"]
        rows.append(("conditioning before", _conditioning_text(conditioning["before"])))
        rows.append(
            (
                "conditioning after",
                f"{_conditioning_text(conditioning['after'])} · decrease "
                f"{_fmt(conditioning['decrease'], 6)}"
                + (f" ({100 * closed:.1f}% of the way to a constant diag(G))" if closed is not None else ""),
            )
        )
        rows.append(("diag(G) before", _spread_text(diag)))
        rows.append(("diag(G) after", _spread_text(after)))
    if "solver" in report:
        solver, verification = report["solver"], report["verification"]
        state = "[green]converged[/]" if solver["converged"] else "[yellow]NOT converged[/]"
        rows.append(("criterion", report["criterion"]))
        rows.append(
            ("solver", f"{solver['name']} · {solver['iterations']} iterations · {solver['passes']} passes · {state}")
        )
        name = "ln Σθ²" if report["criterion"] == "enorm" else "F"
        rows.append(
            (
                "objective",
                f"{name}(0) {_fmt(solver['objective_initial'], 10)} → {name}* "
                f"{_fmt(solver['objective_final'], 10)} (decrease {_fmt(solver['decrease'])})",
            )
        )
        rows.append(("KKT residual", f"{_fmt(solver['kkt_residual'])} (tolerance {solver['tolerance']:g})"))
        rows.append(("‖u‖∞", _fmt(report["u_inf"]) + _bound_text(solver)))
        check = "[green]passed[/]" if verification["passed"] else "[red]FAILED[/]"
        rows.append(
            (
                "verification",
                f"max abs {_fmt(verification['max_abs_error'])} · max rel "
                f"{_fmt(verification['max_rel_error'])} (tol {verification['tolerance']:g}, "
                f"{'+'.join(verification['modes'])}) {check}",
            )
        )
        independent = verification.get("independent")
        if independent and independent["runtime"]:
            rows.append(
                (
                    "independent check",
                    f"{independent['runtime']}: {independent['status']}"
                    + (f" ({_safe(independent['detail'])})" if independent["status"] != "passed" else ""),
                )
            )
        rows.append(("output", _safe(report["output"])))
    rows.append(("seconds", " · ".join(f"{k} {v:.3g}" for k, v in report["seconds"].items())))
    _print_summary(console, rows)
    if per_layer and diag["per_layer"]:
        _print_table(console, _layer_table(diag, after))
    if diag["histogram"]:
        console.print(histogram_text(diag["histogram"], after["histogram"] if after else None), highlight=False)
    zeros = report["diag_g_zeros"]
    if zeros["per_layer"]:
        console.print(zeros_text(zeros), highlight=False, soft_wrap=True)
    if report.get("degenerate_groups"):
        shown = ", ".join(_safe(group) for group in report["degenerate_groups"][:10])
        more = len(report["degenerate_groups"]) - 10
        console.print(f"[yellow]degenerate groups frozen at u = 0:[/] {shown}{f' (+{more} more)' if more > 0 else ''}")
    render_warnings(report, console)


def zeros_text(zeros: dict[str, Any], shown: int = 10) -> str:
    """The share of g = 0 and, per layer (the ``shown`` with most zeros, in network order), its
    most likely cause."""
    layers = zeros["per_layer"]
    kept = sorted(sorted(range(len(layers)), key=lambda i: -layers[i]["zeros"])[:shown])
    lines = [
        f"diag(G) is 0 on {100 * zeros['share']:.1f}% of the DAG parameters (left out of F and D; no rescaling "
        "moves them), by layer:"
    ]
    lines += [
        f"  {_safe(layers[i]['layer'])}: {100 * layers[i]['share']:.1f}% ({layers[i]['zeros']:,} of "
        f"{layers[i]['parameters']:,}) · {_safe(layers[i]['cause'])}"
        for i in kept
    ]
    if len(layers) > shown:
        lines.append(f"  (+{len(layers) - shown} more layers with zeros)")
    return "\n".join(lines)


def _bound_text(solver: dict[str, Any]) -> str:
    """The bound on |u_h| and how it was chosen, after ‖u‖∞ (nothing for an unbounded run)."""
    if solver["max_log_scale"] is None:
        return ""
    text = (
        f" (bound {_fmt(solver['max_log_scale'])}, {solver['max_log_scale_rule']}, "
        f"{solver['groups_at_bound']:,} groups at it"
    )
    if solver["share_of_decrease_kept"] is not None:
        text += (
            f"; unbounded ‖u*‖∞ {_fmt(solver['unbounded_u_inf'])}, "
            f"{100 * solver['share_of_decrease_kept']:.1f}% of its decrease kept"
        )
    return text + ")"


def render_warnings(report: dict[str, Any], console: Console) -> None:
    print_warnings(report["warnings"], console)


def print_warnings(warnings: list[str], console: Console) -> None:
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {_safe(warning, keep=chr(10))}", highlight=False, soft_wrap=True)


# Off a terminal, the summary's values are wrapped to this many columns unless COLUMNS says otherwise.
STACKED_COLUMNS = 100


def _print_summary(console: Console, rows: list[tuple[str, str]]) -> None:
    """The summary: a two-column table at a terminal; off one (a pipe, a log file), where the
    width is unknown, one ``name  value`` line per row, the value wrapped at ``·`` and spaces to
    COLUMNS (default :data:`STACKED_COLUMNS`) under its own column: no ~170-column table."""
    if console.is_terminal:
        summary = Table(show_header=False)
        summary.add_column("", style="bold")
        summary.add_column("")
        for name, value in rows:
            summary.add_row(name, value)
        _print_table(console, summary)
        return
    columns = os.environ.get("COLUMNS", "").strip()
    width = int(columns) if columns.isdigit() and int(columns) >= 40 else STACKED_COLUMNS
    indent = max(len(name) for name, _ in rows) + 2
    lines = []
    for name, value in rows:
        wrapped = textwrap.wrap(
            Text.from_markup(value).plain, width=max(width - indent, 20), break_long_words=False, break_on_hyphens=False
        ) or [""]
        lines.append(f"{name:<{indent}}{wrapped[0]}")
        lines += [" " * indent + line for line in wrapped[1:]]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _print_table(console: Console, table: Table) -> None:
    """Off a terminal (a pipe, a log file) the table takes its natural width: names stay whole
    and rows unwrapped, whatever width rich assumes for a file."""
    if not console.is_terminal:
        table.width = Measurement.get(console, console.options.update(width=UNBOUNDED_WIDTH), table).maximum
    console.print(table, crop=console.is_terminal)


def _layer_table(diag: dict[str, Any], after: dict[str, Any] | None) -> Table:
    title = "log10 diag(G) per layer (BatchNorm folded)" + (", before → after rescaling" if after else "")
    layers = Table(title=title, title_justify="left")
    columns = ["layer", "parameters", "zeros", "min", "max"] + (["min after", "max after"] if after else [])
    for column in columns:
        layers.add_column(column, justify="left" if column == "layer" else "right")
    rows_after = after["per_layer"] if after else [None] * len(diag["per_layer"])
    for row, row_after in zip(diag["per_layer"], rows_after):
        cells = [
            _safe(row["layer"]),
            _fmt(row["parameters"]),
            _fmt(row["zeros"]),
            _fmt(row["log10_min"]),
            _fmt(row["log10_max"]),
        ]
        if row_after is not None:
            cells += [_fmt(row_after["log10_min"]), _fmt(row_after["log10_max"])]
        layers.add_row(*cells)
    return layers


def histogram_text(bins: list[dict[str, Any]], bins_after: list[dict[str, Any]] | None = None) -> str:
    """log10 g histogram; with ``bins_after`` (the same bins), before and after side by side
    (narrower bars, so that a line fits 80 columns)."""
    width = 30 if bins_after is None else 14
    peak = max(b["count"] for b in [*bins, *(bins_after or [])]) or 1

    def bar(count: int) -> str:
        return f"{'█' * round(width * count / peak):<{width}} {count:>10,}"

    if bins_after is None:
        lines = ["log10 diag(G) histogram (g > 0)"]
        lines += [f"  [{b['log10_low']:8.2f}, {b['log10_high']:8.2f})  {bar(b['count'])}" for b in bins]
        return "\n".join(lines)
    lines = [
        "log10 diag(G) histogram (g > 0), same bins for both",
        f"  {'log10 g':<20}  {'before':<{width + 11}}  after",
    ]
    for b, a in zip(bins, bins_after):
        lines.append(f"  [{b['log10_low']:8.2f}, {b['log10_high']:8.2f})  {bar(b['count'])}  {bar(a['count'])}")
    return "\n".join(lines)


def summary_line(report: dict[str, Any]) -> str:
    """One line closing the run, printed last on stderr."""
    parts = [f"pathcond {report['command']}: {printable(report['model'])}"]
    if report["command"] == "compare":
        parts[0] += f" · {printable(report['other'])}"
        parts.append(f"{report['sign_flips']['total']:,} sign flips")
        metric = report["path_metric"]
        parts.append(f"path-metric {_metric_bounds_text(metric, 4, '..')}")
        parts.append(_summary_bound(report, report["processing"] or report["other_processing"]))
        parts.append(f"{report['seconds']['total']:.2f} s")
        return " · ".join(parts)
    if report["command"] == "prune":
        parts[0] += f" → {printable(report['output'])}"
        parts.append(f"{100 * report['sparsity_achieved']:.1f}% zero")
        parts.append(f"path-metric {_metric_bounds_text(report['path_metric'], 4, '..')}")
        parts.append(_summary_bound(report, report["processing"]))
        parts.append(f"{report['seconds']['total']:.2f} s")
        return " · ".join(parts)
    conditioning = report["conditioning"]
    if report["command"] == "rescale":
        verification, solver = report["verification"], report["solver"]
        parts[0] += f" → {printable(report['output'])}"
        parts.append(
            f"verified (max rel error {_fmt(verification['max_rel_error'], 2)})"
            if verification["passed"]
            else "NOT verified"
        )
        parts.append(f"D {_fmt(conditioning['before']['D'], 5)} → {_fmt(conditioning['after']['D'], 5)}")
        parts.append(f"‖u‖∞ {_fmt(report['u_inf'], 3)}")
        parts.append(
            "converged"
            if solver["converged"]
            else f"NOT converged (KKT {_fmt(solver['kkt_residual'], 2)} after {solver['iterations']} iterations)"
        )
    else:
        parts.append(f"D {_fmt(conditioning['before']['D'], 5)}")
    parts.append(f"{report['seconds']['total']:.2f} s")
    return " · ".join(parts)


def _summary_bound(report: dict[str, Any], processing: dict[str, Any] | None) -> str:
    if not report["bound_applies"]:
        return "no bound"
    return f"{'DAG ' if processing else ''}output change ≤ {_bound_fmt(report['output_change_bound'], 4, upper=True)}"


def _metric_section(metric) -> dict[str, Any]:
    return {
        "lower": _finite(metric.lower) if metric.lower is not None else None,
        "upper": _finite(metric.upper) if metric.upper is not None else None,
        "exact": metric.exact,
        "rounding": metric.rounding,
        "log10_lower": _finite(metric.ln_lower * LOG10_E),
        "log10_upper": _finite(metric.ln_upper * LOG10_E),
    }


def compare_report(comparison) -> dict[str, Any]:
    """The ``compare`` report (a :class:`~.toolkit.Comparison`)."""
    a, b, signs = comparison.a, comparison.b, comparison.signs
    return {
        "schema": SCHEMA_VERSION,
        "pathcond_version": __version__,
        "command": "compare",
        "model": a.source,
        "other": b.source,
        "format": a.format,
        "other_format": b.format,
        "device": comparison.device,
        "input_shape": [list(node.shape) for node in a.graph.inputs],
        "processing": processing_section(a),
        "other_processing": processing_section(b),
        "parameters": a.parameter_count,
        "path_norms": path_norms_section(comparison.path_norms_a),
        "other_path_norms": path_norms_section(comparison.path_norms_b),
        "sign_flips": {
            "total": signs.flips,
            "per_layer": [
                {"layer": layer.layer, "parameters": layer.parameters, "flips": layer.flips} for layer in signs.layers
            ],
        },
        "path_metric": _metric_section(comparison.metric),
        "input_bound": comparison.input_bound,
        "bound_applies": comparison.bound_applies,
        "bound_note": _bound_note(comparison),
        "output_change_bound": _finite(comparison.output_change_bound),
        "measured_output_change": _finite(comparison.measured_output_change),
        "warnings": [*a.warnings, *b.warnings],
        "seconds": {stage: round(value, 6) for stage, value in comparison.seconds.items()},
    }


def prune_report(result, output: str | None) -> dict[str, Any]:
    """The ``prune`` report (a :class:`~.toolkit.PruneResult`); ``output`` and ``verification``
    are null before the file is written."""
    model = result.model
    return {
        "schema": SCHEMA_VERSION,
        "pathcond_version": __version__,
        "command": "prune",
        "model": model.source,
        "format": model.format,
        "device": result.device,
        "input_shape": [list(node.shape) for node in model.graph.inputs],
        "processing": processing_section(model),
        "parameters": model.parameter_count,
        "criterion": result.criterion,
        "per_layer": result.per_layer,
        "sparsity_requested": result.sparsity,
        "sparsity_achieved": result.achieved_sparsity,
        "layers": [
            {
                "layer": layer.layer,
                "weight": layer.weight,
                "parameters": layer.parameters,
                "zeros_before": layer.zeros_before,
                "zeros_after": layer.zeros_after,
                "sparsity": layer.zeros_after / layer.parameters if layer.parameters else 0.0,
            }
            for layer in result.layers
        ],
        "path_norms": path_norms_section(result.path_norms_before),
        "path_norms_after": path_norms_section(result.path_norms_after),
        "path_metric": _metric_section(result.metric),
        "input_bound": result.input_bound,
        "bound_applies": result.bound_applies,
        "bound_note": _bound_note(result),
        "score_bound": _finite(result.score_bound),
        "output_change_bound": _finite(result.output_change_bound),
        "measured_output_change": _finite(result.measured_output_change),
        "verification": result.written,
        "output": output,
        "warnings": list(model.warnings),
        "seconds": {stage: round(value, 6) for stage, value in result.seconds.items()},
    }


def _metric_bounds_text(metric: dict[str, Any], digits: int, separator: str) -> str:
    """The path-metric's bounds, the lower one rounded down and the upper one up (an exact
    metric's, equal, to nearest)."""
    if metric["exact"]:
        return _fmt(metric["lower"], digits)
    return (
        f"{_bound_fmt(metric['lower'], digits, upper=False)}{separator}"
        f"{_bound_fmt(metric['upper'], digits, upper=True)}"
    )


def _metric_text(metric: dict[str, Any]) -> str:
    if metric["exact"]:
        return f"{_metric_bounds_text(metric, 7, '')} (exact: one parameter vector dominates the other)"
    return f"between {_metric_bounds_text(metric, 7, ' and ')}"


def render_compare(report: dict[str, Any], console: Console) -> None:
    console.print(
        f"pathcond compare · {printable(report['model'])} · {printable(report['other'])}",
        style="bold",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    processing = report["processing"] or report["other_processing"]
    same = report["processing"] == report["other_processing"]
    rows: list[tuple[str, str]] = _processing_rows(
        *(
            [("", processing)]
            if same
            else [(" (first)", report["processing"]), (" (second)", report["other_processing"])]
        )
    )
    rows.append(("path norms (first)", path_norms_text(report["path_norms"])))
    rows.append(("path norms (second)", path_norms_text(report["other_path_norms"])))
    rows.append(("sign flips", _fmt(report["sign_flips"]["total"])))
    rows.append(("ℓ1 path-metric", _metric_text(report["path_metric"])))
    if report["bound_applies"]:
        bound = f"at most {_bound_fmt(report['output_change_bound'], 6, upper=True)} (ℓ1)"
    else:
        bound = f"no bound: {_safe(report['bound_note'])}"
    rows.append(
        _bound_row(processing, report["input_bound"], f"{bound} · measured {_fmt(report['measured_output_change'], 6)}")
    )
    rows.append(("seconds", " · ".join(f"{k} {v:.3g}" for k, v in report["seconds"].items())))
    _print_summary(console, rows)
    flipped = [row for row in report["sign_flips"]["per_layer"] if row["flips"]]
    if flipped:
        layers = Table(title="sign flips per layer (BatchNorm folded)", title_justify="left")
        for column in ("layer", "parameters", "flips"):
            layers.add_column(column, justify="left" if column == "layer" else "right")
        for row in flipped:
            layers.add_row(_safe(row["layer"]), _fmt(row["parameters"]), _fmt(row["flips"]))
        _print_table(console, layers)
    render_warnings(report, console)


def render_prune(report: dict[str, Any], console: Console) -> None:
    console.print(
        f"pathcond prune · {printable(report['model'])}", style="bold", highlight=False, markup=False, soft_wrap=True
    )
    rows: list[tuple[str, str]] = _processing_rows(("", report["processing"]))
    rows.append(("criterion", report["criterion"] + (" · per layer" if report["per_layer"] else " · global")))
    rows.append(
        (
            "sparsity",
            f"{100 * report['sparsity_achieved']:.2f}% of Linear/Conv weights are zero "
            f"(asked {100 * report['sparsity_requested']:g}%)",
        )
    )
    rows.append(("path norms before", path_norms_text(report["path_norms"])))
    rows.append(("path norms after", path_norms_text(report["path_norms_after"])))
    rows.append(("ℓ1 path-metric", _metric_text(report["path_metric"])))
    if report["bound_applies"]:
        bound = (
            f"at most {_bound_fmt(report['output_change_bound'], 6, upper=True)} "
            f"(ℓ1; scores' sum {_bound_fmt(report['score_bound'], 6, upper=True)})"
        )
    else:
        bound = f"no bound: {_safe(report['bound_note'])}"
    rows.append(
        _bound_row(
            report["processing"],
            report["input_bound"],
            f"{bound} · measured {_fmt(report['measured_output_change'], 6)}",
        )
    )
    verification = report["verification"]
    if verification is not None:
        rows.append(
            (
                "verification",
                f"reloaded θ ⊙ m {verification['reloaded']} · independent runtime "
                f"{verification['runtime'] or '–'}: {verification['independent']}",
            )
        )
    rows.append(("output", _safe(report["output"] or "–")))
    rows.append(("seconds", " · ".join(f"{k} {v:.3g}" for k, v in report["seconds"].items())))
    _print_summary(console, rows)
    layers = Table(title="pruned weights per layer", title_justify="left")
    for column in ("layer", "weight", "parameters", "zeros before", "zeros after", "sparsity"):
        layers.add_column(column, justify="left" if column in ("layer", "weight") else "right")
    for row in report["layers"]:
        layers.add_row(
            _safe(row["layer"]),
            _safe(row["weight"]),
            _fmt(row["parameters"]),
            _fmt(row["zeros_before"]),
            _fmt(row["zeros_after"]),
            f"{100 * row['sparsity']:.1f}%",
        )
    _print_table(console, layers)
    render_warnings(report, console)
