"""The recovery benchmark's comparison: one row per strategy, every number from its event log.

The numbers come from :func:`resilient_training.gates.metrics.compute_metrics` (the same module the
resilience report uses); this module only lines strategies up side by side, as a text table for
the terminal, Markdown, and a self-contained HTML page with the table and two charts.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import Any

from resilient_training.gates import metrics as rt_metrics

COLUMNS: list[tuple[str, str]] = [
    ("strategy", "strategy"),
    ("status", "status"),
    ("wall_s", "wall s"),
    ("training_goodput", "train goodput"),
    ("infrastructure_goodput", "infra goodput"),
    ("recovery_mean_s", "recovery mean s"),
    ("recovery_max_s", "recovery max s"),
    ("layers", "restarts by layer"),
    ("rollback_mean", "rollback steps"),
    ("stall_mean_s", "ckpt stall s"),
    ("deferred", "saves deferred"),
    ("final_loss", "final loss"),
]


def row(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The comparison row of one strategy's run directory (its name is the directory's)."""
    name = Path(run_dir).name
    try:
        m = rt_metrics.compute_metrics(run_dir)
    except (rt_metrics.RunError, IndexError, FileNotFoundError) as exc:
        return {"strategy": name, "status": f"no usable event log: {exc}"}
    recovery = m["recovery_seconds"]["all"]
    checkpoints = m["checkpoints"]
    return {
        "strategy": name,
        "status": m["status"],
        "wall_s": m["wall_seconds"],
        "training_goodput": m["training_goodput"],
        "infrastructure_goodput": m["infrastructure_goodput"],
        "recovery_mean_s": recovery["mean"],
        "recovery_max_s": recovery["max"],
        "layers": ", ".join(f"{k} {v}" for k, v in sorted(m["restarts_by_layer"].items())) or "none",
        "rollback_mean": m["rollback_steps"]["mean"],
        "stall_mean_s": checkpoints["stall_seconds"]["mean"],
        "deferred": checkpoints["deferred"],
        "final_loss": _final_loss(m),
    }


def _final_loss(m: dict[str, Any]) -> float | None:
    """The last logged loss of the run (metrics' loss points are [t, step, loss, ...])."""
    points = m.get("loss") or []
    return points[-1][2] if points else None


PERCENT_COLUMNS = ("training_goodput", "infrastructure_goodput")


def _cell(value: Any, key: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.1%}" if key in PERCENT_COLUMNS else f"{value:.3g}" if abs(value) < 0.1 else f"{value:.2f}"
    return str(value)


def text_table(rows: list[dict[str, Any]]) -> str:
    header = [title for _, title in COLUMNS]
    body = [[_cell(r.get(key), key) for key, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(key), key) for key, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _bars(rows: list[dict[str, Any]], keys: list[tuple[str, str]], title: str, percent: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from resilient_training.gates.report import _png

    names = [r["strategy"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 0.5 + 0.55 * len(rows)))
    height = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        values = [r.get(key) or 0.0 for r in rows]
        ax.barh([y + i * height for y in range(len(rows))], values, height=height, label=label)
    ax.set_yticks([y + height * (len(keys) - 1) / 2 for y in range(len(rows))], names)
    ax.invert_yaxis()
    if percent:
        ax.set_xlim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def render_html(rows: list[dict[str, Any]], title: str = "Recovery benchmark") -> str:
    header = "".join(f"<th>{html.escape(t)}</th>" for _, t in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(k), k))}</td>" for k, _ in COLUMNS) + "</tr>"
                   for r in rows)
    charts = ""
    usable = [r for r in rows if "wall_s" in r]
    if usable:
        goodput = _bars(usable, [("training_goodput", "training"), ("infrastructure_goodput", "infrastructure")],
                        "Goodput", percent=True)
        recovery = _bars(usable, [("recovery_mean_s", "mean"), ("recovery_max_s", "max")],
                         "Recovery seconds per fault (fault → first step after restore)", percent=False)
        charts = f'<img alt="goodput" src="{goodput}"><img alt="recovery" src="{recovery}">'
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child"
        "{text-align:left}img{display:block;margin:1em 0;max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>Same model, data, seed and fault schedule for every strategy; "
        "every number is computed from the strategy's event log.</p>"
        f"<table><tr>{header}</tr>{body}</table>{charts}</body></html>"
    )


def compare(run_dirs: list[str]) -> list[dict[str, Any]]:
    return [row(d) for d in run_dirs]
