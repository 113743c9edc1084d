"""The resilience report: one self-contained HTML page from the numbers of :mod:`resilient_training.gates.metrics`.

Charts are rendered with matplotlib's Agg backend and inlined as base64 PNG; styles are
inline; nothing is fetched, so the file reads the same offline, attached to a ticket or
opened from a KFP artifact.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import sys
from pathlib import Path
from typing import Any

from resilient_training.gates import metrics as rt_metrics

LAYER_COLOURS = {"writer": "#fdae6b", "inprocess": "#2b8cbe", "launcher": "#e6550d", "pod": "#756bb1", "reload": "#31a354",
                 "unrecovered": "#d62728", "none": "#999999"}
SEGMENT_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _root_cause(fault: dict[str, Any]) -> str:
    """'sigkill on rank 1: …' with the other ranks' reports counted as symptoms, not faults."""
    root = fault.get("root_cause") or {}
    where = f" on rank {root['rank']}" if root.get("rank") is not None else ""
    detail = root.get("detail")
    text = f"{fault['cause']}{where}" + (f": {detail}" if detail and detail != fault["cause"] else "")
    if root.get("also_injected"):  # faults that struck while this one was being recovered
        text += f"; also injected meanwhile: {', '.join(map(str, root['also_injected']))}"
    if root.get("surfaced"):
        text += f" ({root['surfaced']})"
    symptoms = [s for s in fault.get("symptoms", []) if s.get("event") == "failure_detected"]
    return text + (f" ({len(symptoms)} symptom report(s) from other ranks)" if symptoms else "")


def _largest_phases(fault: dict[str, Any], count: int = 3) -> str:
    """The recovery's largest phases (metrics.recovery_phases), e.g. ``load_checkpoint 1.72 s, …``."""
    phases = sorted((fault.get("phases") or {}).items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases) or "–"


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1e12:  # an absurd value (1e308 bytes) was a number of 300 digits
            return f"{value:.3g}{unit}"
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


# Beyond this, matplotlib's transforms overflow (a loss of 1.7e308: "Singular matrix", "arange:
# cannot compute length", a stranger trial's tracebacks): such a value is left out of the chart,
# and the report says so. No training logs one (its loss is a float32: at most 3.4e38).
PLOT_LIMIT = 1e300


def _plottable(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= PLOT_LIMIT


def unplotted_losses(m: dict[str, Any]) -> list[tuple[int, float]]:
    """(step, loss) of the loss curve's values the chart leaves out: infinite, or beyond :data:`PLOT_LIMIT`
    (a NaN, null in metrics read back from JSON, is a gap in its line, as it was in the training).
    """
    return [(step, loss) for _, step, loss, *_ in m["loss"]
            if isinstance(loss, (int, float)) and not _plottable(loss) and not math.isnan(loss)]


def _figure(alt: str, chart: Any, m: dict[str, Any]) -> str:
    """``<img>`` of ``chart(m)``, or a line saying why it could not be drawn: the report is written
    whatever the values (a chart matplotlib cannot draw is named, not a traceback).
    """
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    try:
        return f'<img alt="{html.escape(alt)}" src="{chart(m)}">'
    except (ValueError, ArithmeticError) as exc:  # numpy's LinAlgError is a ValueError
        for number in set(plt.get_fignums()) - before:
            plt.close(number)
        what = " ".join(str(exc).split())[:200]
        return (f'<p class="muted">[{html.escape(alt)}: not drawn, matplotlib could not plot the values '
                f'({html.escape(type(exc).__name__)}: {html.escape(what)})]</p>')


def loss_chart(m: dict[str, Any]) -> str:
    """Loss per step, one line per (attempt, iteration), with fault and restore markers."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    # One line per contiguous run of steps within a (launch, attempt, iteration).
    lines: list[tuple[tuple[int, int, int], list[tuple[int, float]]]] = []
    for _, step, loss, attempt, iteration, launch in m["loss"]:
        loss = loss if _plottable(loss) else math.nan  # a gap (see unplotted_losses)
        key = (launch, attempt, iteration)
        if not lines or lines[-1][0] != key or step != lines[-1][1][-1][0] + 1:
            lines.append((key, []))
        lines[-1][1].append((step, loss))
    colours: dict[tuple[int, int, int], str] = {}
    relaunched = any(key[0] for key, _ in lines)
    by_step = {}
    for i, (key, points) in enumerate(lines):
        steps, losses = zip(*points, strict=True)
        last = i == len(lines) - 1
        new = key not in colours
        colours.setdefault(key, SEGMENT_COLOURS[len(colours) % len(SEGMENT_COLOURS)])
        launch, attempt, iteration = key
        label = (f"launch {launch + 1} · " if relaunched else "") + f"attempt {attempt} · iteration {iteration}"
        # Earlier lines drawn wide underneath: a bit-exact replay after a restore covers them.
        ax.plot(steps, losses, color=colours[key], lw=1.4 if last else 4.0, alpha=1.0 if last else 0.45,
                marker="." if last else None, ms=3, label=label if new else None)
        by_step.update({s: v for s, v in points if math.isfinite(v)})
    for n, fault in enumerate(m["faults"]):
        if fault["fault_step"] is not None:
            y = by_step.get(fault["fault_step"] - 1, by_step.get(fault["fault_step"]))
            ax.axvline(fault["fault_step"], color="#d62728", ls=":", lw=1)
            ax.annotate(f"✗ {fault['cause']}", (fault["fault_step"], y if y is not None else 0), color="#d62728",
                        fontsize=8, xytext=(3, 8 + 10 * (n % 2)), textcoords="offset points")
    restored = sorted({step for _, step in m["restores"] if step in by_step})
    if restored:
        ax.plot(restored, [by_step[s] for s in restored], marker="v", color="#31a354", ms=9, ls="none",
                label="restored checkpoint")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.7)
    ax.set_title("Loss per step (dotted: fault injected or detected; ▼: step restored)", fontsize=10)
    return _png(fig)


def timeline_chart(m: dict[str, Any]) -> str:
    """Attempts and in-process iterations over wall time, fault episodes shaded, commits ticked."""
    import matplotlib.pyplot as plt

    spans = m["timeline"]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * max(1, len(spans))))
    for i, span in enumerate(spans):
        ax.barh(i, span["end"] - span["start"], left=span["start"], height=0.6,
                color=SEGMENT_COLOURS[i % len(SEGMENT_COLOURS)], alpha=0.85)
        label = f"steps {span['first_step']}–{span['last_step']}" if span["first_step"] is not None else "no step"
        ax.text(span["start"] + 0.05, i, label, va="center", fontsize=8, color="white")
    for fault in m["faults"]:
        end = fault["end"] if fault["end"] is not None else m["wall_seconds"]
        ax.axvspan(fault["start"], max(end, fault["start"] + 1e-3), color=LAYER_COLOURS.get(fault["layer"], "#999"),
                   alpha=0.25)
    multi = any(s["launch"] for s in spans)
    ax.set_yticks(range(len(spans)), [(f"L{s['launch'] + 1} " if multi else "") + f"a{s['attempt']} i{s['iteration']}"
                                      for s in spans], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.set_title("Timeline: attempt (launcher restarts) · iteration (in-process restarts); shaded: recovery",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def goodput_chart(m: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 2.2))
    names = ["training", "infrastructure"]
    values = [m["training_goodput"] or 0.0, m["infrastructure_goodput"] or 0.0]
    bars = ax.barh(names, values, color=["#2b8cbe", "#31a354"])
    for bar, value in zip(bars, values, strict=True):
        ax.text(min(value, 0.85) + 0.02, bar.get_y() + bar.get_height() / 2, f"{value:.1%}", va="center", fontsize=9)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_title("Goodput", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def recovery_chart(m: dict[str, Any]) -> str:
    """Each recovery's seconds by restart layer, with the layer's p50 and p95."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 2.6))
    layers = sorted(m["recovery_seconds"]["by_layer"])
    for i, layer in enumerate(layers):
        values = [f["recovery_seconds"] for f in m["faults"] if f["layer"] == layer and f["recovery_seconds"] is not None]
        ax.scatter([i] * len(values), values, color=LAYER_COLOURS.get(layer, "#999"), s=36, zorder=3)
        stats = m["recovery_seconds"]["by_layer"][layer]
        for key, style in (("p50", "-"), ("p95", "--")):
            ax.hlines(stats[key], i - 0.25, i + 0.25, colors="black", linestyles=style, lw=1)
    ax.set_xticks(range(len(layers)), layers)
    ax.set_xlim(-0.6, max(0.6, len(layers) - 0.4))
    ax.set_ylabel("seconds")
    ax.set_title("Recovery time per fault (— p50, - - p95)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if not layers:
        ax.text(0.5, 0.5, "no restart in this run", ha="center", va="center", transform=ax.transAxes)
    return _png(fig)


def freshness_chart(m: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.4))
    series = m["freshness_steps"]["series"]
    if series:
        ts, _, fresh = zip(*series, strict=True)
        ax.step(ts, fresh, where="post", color="#6a51a3", lw=1.4)
        ax.fill_between(ts, fresh, step="post", color="#6a51a3", alpha=0.15)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("steps")
    ax.set_title("Checkpoint freshness: steps of work not yet in a committed checkpoint", fontsize=10)
    ax.grid(alpha=0.3)
    return _png(fig)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1000px;color:#222}
h1{margin-bottom:.2rem} h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
.badge{display:inline-block;padding:.15rem .6rem;border-radius:1rem;color:#fff;font-weight:600}
.ok{background:#31a354}.bad{background:#d62728}.cards{display:flex;flex-wrap:wrap;gap:.8rem;margin:1rem 0}
.card{border:1px solid #ddd;border-radius:.5rem;padding:.6rem .9rem;min-width:140px}
.card b{display:block;font-size:1.4rem}.card span{color:#666;font-size:.85rem}
table{border-collapse:collapse;width:100%;font-size:.9rem}td,th{border-bottom:1px solid #eee;padding:.3rem .5rem;
text-align:left}th{background:#fafafa}.row{display:flex;gap:1rem;flex-wrap:wrap;align-items:flex-start}
img{max-width:100%}.muted{color:#666;font-size:.85rem}
"""


def render_html(m: dict[str, Any], title: str) -> str:
    e = html.escape
    ok = m["status"] == "completed"
    cards = [
        ("steps completed", f"{m['steps']['completed']}", f"{m['steps']['replayed']} replayed after rollbacks"),
        ("training goodput", _fmt(100 * (m["training_goodput"] or 0), "%", 1), "productive step time / wall"),
        ("infrastructure goodput", _fmt(100 * (m["infrastructure_goodput"] or 0), "%", 1), "(wall − downtime) / wall"),
        ("faults", f"{len([f for f in m['faults'] if f['layer'] != 'none'])}",
         f"{m['unrecovered_faults']} unrecovered"),
        ("recovery p50", _fmt(m["recovery_seconds"]["all"]["p50"], " s"),
         f"p95 {_fmt(m['recovery_seconds']['all']['p95'], ' s')}"),
        ("wall time", _fmt(m["wall_seconds"], " s", 1), f"downtime {_fmt(m['downtime_seconds'], ' s', 1)}"),
    ]
    missed = m.get("faults_not_injected") or []
    not_fired = (f'<p><span class="badge bad">not injected</span> scheduled, never fired or not as often as '
                 f'scheduled (this run proves no recovery from them): {e(", ".join(missed))}</p>' if missed else "")
    fault_rows = "".join(
        f"<tr><td>{i + 1}</td><td>{e(str(f['fault'] or '–'))}</td><td>{e(_root_cause(f))}</td><td>{e(f['layer'])}</td>"
        f"<td>{_fmt(f['fault_step'])}</td><td>{_fmt(f['restored_step'])}</td><td>{_fmt(f['rollback_steps'])}</td>"
        f"<td>{_fmt(f['recovery_seconds'], ' s')}</td><td>{e(_largest_phases(f))}</td>"
        f"<td>{_fmt(f['start'], ' s', 1)}</td></tr>"
        for i, f in enumerate(m["faults"]))
    layer_rows = "".join(
        f"<tr><td>{e(layer)}</td><td>{s['count']}</td><td>{_fmt(s['mean'], ' s')}</td><td>{_fmt(s['p50'], ' s')}</td>"
        f"<td>{_fmt(s['p95'], ' s')}</td><td>{_fmt(s['max'], ' s')}</td></tr>"
        for layer, s in [("all", m["recovery_seconds"]["all"]), *m["recovery_seconds"]["by_layer"].items()])
    ck = m["checkpoints"]
    interval = m["suggested_checkpoint_interval"]
    causes = ", ".join(f"{e(str(k))} × {v}" for k, v in sorted(m["restart_causes"].items())) or "none"
    if interval["young_seconds"]:
        advice = (f"Observed save stall C = {_fmt(interval['save_cost_seconds'], ' s', 3)} per save and mean time between "
                  f"failures M = {_fmt(interval['mtbf_seconds'], ' s', 1)} suggest checkpointing every "
                  f"<b>{_fmt(interval['daly_seconds'], ' s', 1)}</b> "
                  f"(Daly; Young: {_fmt(interval['young_seconds'], ' s', 1)})"
                  f" ≈ <b>{_fmt(interval['daly_steps'], ' steps', 1)}</b>; this run saved every "
                  f"{_fmt(ck['interval_steps'], ' steps', 1)} on average (at most "
                  f"{_fmt(ck.get('interval_steps_max'), ' steps')} apart).")
    else:
        advice = "No failure or no checkpoint stall observed: no interval can be derived from this run."
    left_out = unplotted_losses(m)
    unplotted = (f'<p class="muted">{len(left_out)} loss value(s) not plotted: infinite, or beyond ±{PLOT_LIMIT:g} '
                 f'(no training step logs one: its loss is a float32): '
                 f'{e(", ".join(f"step {step}: {loss:g}" for step, loss in left_out[:10]))}'
                 f'{", …" if len(left_out) > 10 else ""}</p>' if left_out else "")
    launched = f"{m.get('launches', 1)} launch(es), {m['attempts']} launcher attempt(s)"
    worlds = e(" → ".join(map(str, m.get("world_sizes") or [])) or _fmt(m["world_size"]))  # each, in turn
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title><style>{CSS}</style></head><body>
<h1>Resilience report</h1>
<p class="muted">{e(str(m['run_dir']))} · world size {worlds} · {launched}</p>
<p><span class="badge {'ok' if ok else 'bad'}">{e(str(m['status']))}</span> {e(str(m['end_reason'] or ''))}</p>
<div class="cards">{''.join(f'<div class="card"><span>{e(a)}</span><b>{e(b)}</b><span>{e(c)}</span></div>'
                             for a, b, c in cards)}</div>
<h2>Loss</h2>{_figure("loss per step with fault and restore markers", loss_chart, m)}{unplotted}
<h2>Timeline</h2>{_figure("timeline of attempts and iterations", timeline_chart, m)}
<h2>Goodput and recovery</h2>
<div class="row">{_figure("goodput bars", goodput_chart, m)}{_figure("recovery times", recovery_chart, m)}</div>
<table><tr><th>layer</th><th>faults</th><th>mean</th><th>p50</th><th>p95</th><th>max</th></tr>{layer_rows}</table>
<p>Restart causes: {causes}.</p>
<h2>Faults</h2>
<table><tr><th>#</th><th>injected</th><th>cause</th><th>layer</th><th>at step</th><th>restored</th><th>rollback (steps)</th>
<th>recovery</th><th>where it went</th><th>at</th></tr>{fault_rows or '<tr><td colspan="10">no fault</td></tr>'}</table>
{not_fired}
<h2>Checkpoints</h2>
{_figure("checkpoint freshness over time", freshness_chart, m)}
<table>
<tr><th>committed</th><td>{ck['committed']} (steps {e(', '.join(map(str, ck['steps'])) or '–')})</td></tr>
<tr><th>lost (begun, never committed) / deferred</th><td>{ck['failed']} / {ck['deferred']}</td></tr>
<tr><th>training stall per save</th><td>mean {_fmt(ck['stall_seconds']['mean'], ' s', 3)}, p95
 {_fmt(ck['stall_seconds']['p95'], ' s', 3)}, max {_fmt(ck['stall_seconds']['max'], ' s', 3)};
 total {_fmt(ck['stall_total_seconds'], ' s', 2)}</td></tr>
<tr><th>save to commit</th><td>mean {_fmt(ck['commit_seconds']['mean'], ' s')},
 p95 {_fmt(ck['commit_seconds']['p95'], ' s')}</td></tr>
<tr><th>size</th><td>{_fmt((ck['bytes']['mean'] or 0) / 1e6, ' MB')}</td></tr>
<tr><th>freshness</th><td>mean {_fmt(m['freshness_steps']['mean'], ' steps', 1)},
 max {_fmt(m['freshness_steps']['max'], ' steps', 0)}</td></tr>
</table>
<h2>Suggested checkpoint interval</h2><p>{advice}</p>
<p class="muted">Definitions: training goodput = productive step time / wall; infrastructure goodput =
(wall − downtime) / wall; recovery = fault or failure → first completed step after the restore (layer writer: the
checkpoint writer process died and was replaced while training went on; recovery = its death → first step after the
new writer is ready, not downtime); rollback = last step completed before the restore − step restored;
where it went = the recovery's three largest phases (ft_launcher's own phases, the new process's start-up,
NVRx's in-process steps, each start-up phase);
freshness = current step − newest committed step. Computed by
resilient_training.gates.metrics from the event log.</p>
</body></html>
"""


def write_report(run_dir: str | os.PathLike[str], output: str | os.PathLike[str],
                 *, metrics: dict[str, Any] | None = None) -> Path | None:
    """Compute the metrics (unless given) and write the HTML report; returns its path (None for
    ``-``: printed to standard output).
    """
    import matplotlib

    matplotlib.use("Agg")
    m = metrics if metrics is not None else rt_metrics.compute_metrics(run_dir)
    if os.fspath(output) == "-":
        sys.stdout.write(render_html(m, f"Resilience report: {Path(run_dir).name}"))
        return None
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(render_html(m, f"Resilience report: {Path(run_dir).name}"), encoding="utf-8")
    os.replace(tmp, output)
    return output
