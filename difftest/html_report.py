"""One self-contained HTML file per case, rendered from the JSON report alone.

Everything is inline (CSS, PNG plots as data: URIs), so the file can be attached to a bug
report. Every string that came from an engine, a checkpoint or a case passes through
html.escape. Plots (matplotlib, Agg backend):
  * per-tensor error along the data flow (max |diff| and 1 - cos per tensor, per engine)
  * per-token error of the first divergent tensor (max |diff| per row)
  * chunk-vs-layer similarity heat map (fc_inputs diagnosis)
  * per-position acceptance rate, reference vs engine
"""

from __future__ import annotations

import base64
import io
import math
from html import escape

OUTCOME_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "error": "#9a6700", "skipped": "#6e7781"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#1f2328;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em} h2{border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;font-size:.9em} td,th{border:1px solid #d0d7de;padding:.3em .5em;vertical-align:top;text-align:left}
th{background:#f6f8fa} pre{background:#f6f8fa;padding:.6em;overflow-x:auto;white-space:pre-wrap;font-size:.85em}
.outcome{font-weight:600;color:#fff;padding:.1em .5em;border-radius:1em;font-size:.85em}
.verdict{font-size:1.2em;padding:.6em;border-radius:.4em;margin:.6em 0}
.verdict.failed{background:#ffebe9;border:1px solid #cf222e} .verdict.passed{background:#dafbe1;border:1px solid #1a7f37}
figure{margin:1em 0} figcaption{color:#57606a;font-size:.9em} img{max-width:100%}
.msg{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.85em}
"""


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(png: str, caption: str) -> str:
    return f'<figure><img alt="{escape(caption)}" src="data:image/png;base64,{png}"><figcaption>{escape(caption)}</figcaption></figure>'


def _finite(x, floor=1e-12):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    if math.isnan(x):
        return None
    return max(min(x, 1e30), floor)


def _comparison(report: dict, engine: str) -> dict | None:
    runs = report.get("comparisons", {}).get(engine) or []
    return next((r for r in runs if r.get("first_divergence")), runs[0] if runs else None)


def plot_dataflow(report: dict) -> str | None:
    engines = [e for e in report.get("comparisons", {}) if _comparison(report, e)]
    if not engines:
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    names: list[str] = []
    for e in engines:
        for t in _comparison(report, e)["tensors"]:
            if t["name"] not in names:
                names.append(t["name"])
    x = {n: i for i, n in enumerate(names)}
    for e in engines:
        tensors = [t for t in _comparison(report, e)["tensors"] if t.get("numel")]
        xs = [x[t["name"]] for t in tensors]
        ax1.plot(xs, [_finite(t["max_abs"]) or 1e-12 for t in tensors], marker="o", label=e)
        ax2.plot(xs, [_finite(1 - t["cosine"]) or 1e-12 for t in tensors], marker="o", label=e)
        bad = [t for t in tensors if t["status"] == "mismatch"]
        ax1.scatter([x[t["name"]] for t in bad], [_finite(t["max_abs"]) or 1e-12 for t in bad], s=90, facecolors="none", edgecolors="red")
    ax1.set_yscale("log"), ax2.set_yscale("log")
    ax1.set_ylabel("max |diff|"), ax2.set_ylabel("1 - cos")
    ax2.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax1.legend(fontsize=8), ax1.grid(alpha=0.3), ax2.grid(alpha=0.3)
    ax1.set_title("error along the data flow (red ring: outside tolerance; exact matches drawn at 1e-12)")
    return _png(fig)


def plot_tokens(report: dict) -> str | None:
    plt = _plt()
    series = []
    for e in report.get("comparisons", {}):
        c = _comparison(report, e)
        name = c and c.get("first_divergence")
        t = next((t for t in c["tensors"] if t["name"] == name), None) if name else None
        if t and t.get("row_max_abs"):
            series.append((e, name, c["prompt"], t))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for e, name, prompt, t in series:
        ax.plot([_finite(v) or 1e-12 for v in t["row_max_abs"]], marker=".", label=f"{e}: {name} (prompt {prompt})")
    ax.set_yscale("log"), ax.set_xlabel("token position (row)"), ax.set_ylabel("max |diff| in row")
    ax.legend(fontsize=8), ax.grid(alpha=0.3), ax.set_title("per-token error of the first divergent tensor")
    return _png(fig)


def plot_similarity(check: dict) -> str | None:
    sim = (check.get("data") or {}).get("similarity") or {}
    rows = sim.get("cosine") or []
    if not rows:
        return None
    plt = _plt()
    import numpy as np

    m = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(min(11, 2 + 0.45 * m.shape[1]), 1.2 + 0.5 * m.shape[0]))
    im = ax.imshow(m, cmap="viridis", vmin=min(0.0, float(np.nanmin(m))) if m.size else 0, vmax=1, aspect="auto")
    ax.set_xticks(range(m.shape[1]), [c.removeprefix("target.") for c in sim["candidates"]], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(m.shape[0]), sim["chunks"], fontsize=8)
    for j, fc in enumerate((check.get("data") or {}).get("fc_chunks") or []):
        if fc.get("expected") in sim["candidates"]:
            ax.scatter([sim["candidates"].index(fc["expected"])], [j], marker="s", s=160, facecolors="none", edgecolors="red")
    fig.colorbar(im, ax=ax, label="mean per-token cosine")
    ax.set_title(f"{check['engine']}: engine fc chunk vs reference tensor (red square: expected)", fontsize=9)
    return _png(fig)


def plot_acceptance(check: dict) -> str | None:
    data = check.get("data") or {}
    ref, eng = data.get("reference") or {}, data.get("engine") or {}
    a, b = ref.get("acceptance_rate_per_pos") or [], eng.get("acceptance_rate_per_pos") or []
    if not a and not b:
        return None
    plt = _plt()
    n = max(len(a), len(b))
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([i - 0.2 for i in range(len(a))], a, width=0.4, label=f"reference ({ref.get('accept_length', float('nan')):.2f})")
    ax.bar([i + 0.2 for i in range(len(b))], b, width=0.4, label=f"{check['engine']} ({eng.get('accept_length', float('nan')):.2f})")
    ax.set_xticks(range(n), [str(i + 1) for i in range(n)])
    ax.set_xlabel("draft position"), ax.set_ylabel("acceptance rate"), ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8), ax.set_title("per-position acceptance (accept length in the legend)", fontsize=9)
    return _png(fig)


def _outcome(o: str) -> str:
    return f'<span class="outcome" style="background:{OUTCOME_COLOURS.get(o, "#6e7781")}">{escape(o)}</span>'


def render(report: dict) -> str:
    checks = report.get("checks", [])
    failed = [c for c in checks if c["outcome"] in ("failed", "error")]
    title = f"difftest: {report.get('case', '?')}"
    verdict = (
        f"{len(failed)} of {len(checks)} checks failed: " + ", ".join(f"{c['engine']}::{c['check']}" for c in failed)
        if failed
        else f"all {len(checks)} checks passed"
    )
    h = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title><style>{CSS}</style></head><body>"]
    h.append(f"<h1>{escape(title)}</h1>")
    h.append(f"<p>reference <code>{escape(str(report.get('reference')))}</code> · case file <code>{escape(str(report.get('case_file')))}</code>"
             f" · {escape(str(report.get('created', '')))} · schema {escape(str(report.get('schema')))}</p>")  # fmt: skip
    h.append(f"<div class='verdict {'failed' if failed else 'passed'}' id='verdict'>{escape(verdict)}</div>")

    h.append("<h2 id='first-divergence'>First divergence and diagnosis</h2>")
    diag = [c for c in failed if c["check"] in ("fc_inputs", "draft_logits", "lint")]
    if not diag:
        h.append("<p>No tensor diverges.</p>")
    for c in diag:
        fd = (c.get("data") or {}).get("first_divergence")
        h.append(f"<h3>{escape(c['engine'])} · {escape(c['check'])}" + (f" · first divergence <code>{escape(fd)}</code>" if fd else "") + "</h3>")
        h.append(f"<pre class='msg'>{escape(c['message'])}</pre>")

    h.append("<h2 id='checks'>Checks</h2><table><tr><th>engine</th><th>check</th><th>outcome</th><th>message</th></tr>")
    for c in checks:
        h.append(f"<tr><td><code>{escape(c['engine'])}</code></td><td>{escape(c['check'])}</td><td>{_outcome(c['outcome'])}</td>"
                 f"<td class='msg'>{escape(c['message'])}</td></tr>")  # fmt: skip
    h.append("</table>")

    h.append("<h2 id='plots'>Plots</h2>")
    figures = [(plot_dataflow(report), "per-tensor error along the data flow (prompt of the first divergence)"),
               (plot_tokens(report), "per-token error of the first divergent tensor")]  # fmt: skip
    for c in checks:
        if c["check"] == "fc_inputs":
            figures.append((plot_similarity(c), f"{c['engine']}: chunk-vs-layer similarity"))
        if c["check"] == "accept_length":
            figures.append((plot_acceptance(c), f"{c['engine']}: per-position acceptance"))
    shown = [_figure(png, cap) for png, cap in figures if png]
    h += shown or ["<p>No numeric data to plot.</p>"]

    h.append("<h2 id='environment'>Environment</h2><table><tr><th>what</th><th>value</th></tr>")
    for k, v in (report.get("environment") or {}).items():
        h.append(f"<tr><td>{escape(str(k))}</td><td><code>{escape(str(v))}</code></td></tr>")
    for e, entry in (report.get("engines") or {}).items():
        value = entry.get("info") or {"error": entry.get("error")}
        h.append(f"<tr><td>engine <code>{escape(e)}</code></td><td><code>{escape(str(value))}</code></td></tr>")
    h.append("</table>")
    h.append(f"<h2 id='reproduce'>Reproduce</h2><pre>{escape(str(report.get('reproduce', '')))}</pre>")
    h.append(f"<h2 id='case'>Case</h2><pre>{escape(str(report.get('case_yaml', '')))}</pre>")
    h.append(f"<p>Accept length: {escape(str(report.get('accept_length_definition', '')))}.</p></body></html>")
    return "\n".join(h)
