"""One self-contained HTML file per case, rendered from the JSON report alone.

Everything is inline (CSS, PNG plots as data: URIs), so the file can be attached to a bug
report. Every string that came from an engine, a checkpoint or a case passes through
html.escape. Per engine, an inline SVG (drawn here, hover a point for its numbers): every
tensor along the data flow, the engine's per-row relative error (`err`, log scale) against
the measured noise floor and the threshold, tensors above noise in red, the tensor where the
error is introduced ringed, tie-skipped steps shaded; beside it the compact table of the
Markdown report and the ties. Plots (matplotlib, Agg backend):
  * elementwise statistics along the data flow (max |diff| and 1 - cos per tensor, per engine)
  * per-token error of the introduced-error tensor (row error / threshold per row)
  * chunk-vs-layer similarity heat map (fc_inputs diagnosis)
  * per-position acceptance rate, reference vs engine
"""

from __future__ import annotations

import base64
import io
import math
from html import escape

from difftest.records import AcceptLengthData, CheckResult, ComparisonData, PromptComparison, Report, ServerAcceptData
from difftest.records.report import SCHEMA, SCHEMA_VERSION
from difftest.records.tensor_diff import TensorDiff, TensorStatus
from difftest.report.writer import (
    INTERRUPTED,
    above_noise,
    accept_line,
    declared_floor_lines,
    fed_line,
    fix_line,
    portable,
    short,
    fix_lines,
    fixes,
    focus,
    interesting,
    memory_plan_said,
    noise_cells,
    noise_floor_line,
    num,
    ties_lines,
    verdict_word,
)

OUTCOME_COLOURS = {
    "passed": "#1a7f37",
    "failed": "#cf222e",
    "error": "#9a6700",
    "skipped": "#6e7781",
    "xfailed": "#8250df",
}  # xfailed: a declared expected failure, caught with its cause

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
svg.noise{width:100%;height:auto;font-family:system-ui,sans-serif} tr.above td{background:#ffebe9}
.noise-source{font-family:ui-monospace,monospace;font-size:.85em;background:#f6f8fa;padding:.4em .6em}
"""


def _plt():
    import matplotlib  # about a second to import, and only a report with plots needs it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # labels carry engine specs and tensor names verbatim: a `$` in a spec parameter must stay a
    # character, not open mathtext (which fails on unbalanced or invalid TeX at savefig)
    plt.rcParams["text.parse_math"] = False
    return plt


def decade_label(value: float, _position: object = None) -> str:
    """A log axis's tick as `1e-6`: with mathtext off (above), matplotlib's own labels would print
    their TeX source (`$\\mathdefault{10^{-6}}$`)."""
    if not value > 0:
        return "0"
    exponent = math.log10(value)
    return f"1e{round(exponent)}" if abs(exponent - round(exponent)) < 1e-9 else f"{value:.2g}"


def _log_axis(ax) -> None:
    """A log y axis labelled by decade_label, minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(decade_label))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(png: str, caption: str) -> str:
    return f'<figure><img alt="{escape(caption)}" src="data:image/png;base64,{png}"><figcaption>{escape(caption)}</figcaption></figure>'


def _comparison(report: Report, engine: str) -> PromptComparison | None:
    runs = report.comparisons.get(engine) or []
    return next((r for r in runs if r.first_divergence), runs[0] if runs else None)


# -- the noise view: error against the measured noise floor, per engine (inline SVG) ----------------
C_ERR, C_ABOVE, C_FLOOR, C_THRESH, C_TIE = "#0969da", "#cf222e", "#6e7781", "#bc4c00", "#eaeef2"


def _pos(x) -> float | None:
    """A positive finite float, or None (zero, inf, NaN, missing)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if 0 < x < math.inf else None


def _tip(t: TensorDiff) -> str:
    parts = [t.name, verdict_word(t)]
    if t.status.compared:
        err, floor, threshold, excess = noise_cells(t)
        parts.append(
            f"err {err} (rows above {t.rows_above}/{t.rows}), floor {floor}, threshold {threshold}, excess {excess}x"
        )
    elif t.detail:
        parts.append(t.detail)
    if t.introduced:
        parts.append("error introduced here")
    return escape(" · ".join(parts))


def _polyline(points: list[tuple[float, float] | None], colour: str, dash: str = "") -> str:
    """Segments of consecutive points (None breaks the line)."""
    out, run = [], []
    for p in points + [None]:
        if p is not None:
            run.append(p)
            continue
        if len(run) > 1:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
            out.append(
                f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5"'
                + (f' stroke-dasharray="{dash}"' if dash else "")
                + "/>"
            )
        run = []
    return "".join(out)


def svg_noise(entry: PromptComparison, engine: str) -> str | None:
    """Every tensor of one prompt along the data flow: err (log scale) against floor and threshold."""
    tensors = entry.tensors
    if not tensors or not any(t.has_noise_numbers for t in tensors):
        return None  # a report from before the noise criterion
    values = [v for t in tensors for v in (_pos(t.err), _pos(t.noise_floor), _pos(t.threshold)) if v]
    lo = math.floor(math.log10(min(values))) if values else -8
    hi = math.ceil(math.log10(max(values))) if values else 0
    hi = max(hi, lo + 1)
    n = len(tensors)
    longest = max(len(t.name) for t in tensors)
    left, right, top, height = 58, 16, 34, 230
    step = max(980 / n, 12.0)  # at least 980 wide (the legend), at least 12 per tensor (the names)
    width = left + right + step * n
    label_h = min(200, 10 + 5.4 * longest * 0.87)
    total_h = top + height + label_h + 8
    X = lambda i: left + step * (i + 0.5)  # noqa: E731
    Y = lambda v: top + height * (hi - math.log10(v)) / (hi - lo)  # noqa: E731
    bottom, ceiling = top + height, top
    s = [
        f'<svg class="noise" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {total_h:.0f}" '
        f'role="img" aria-label="{escape(engine)}: error against the noise floor along the data flow">'
    ]
    # tie-skipped tensors: shaded columns
    for i, t in enumerate(tensors):
        if t.status == TensorStatus.TIE:
            s.append(
                f'<rect x="{X(i) - step / 2:.1f}" y="{top}" width="{step:.1f}" height="{height}" fill="{C_TIE}">'
                f"<title>{_tip(t)}</title></rect>"
            )
    # decades
    for d in range(lo, hi + 1):
        y = Y(10.0**d)
        s.append(
            f'<line x1="{left}" x2="{width - right:.0f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d0d7de" stroke-width="0.6"/>'
            f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="9" text-anchor="end" fill="#57606a">1e{d}</text>'
        )
    s.append(
        f'<rect x="{left}" y="{top}" width="{width - left - right:.0f}" height="{height}" fill="none" stroke="#8c959f"/>'
    )
    s.append(
        f'<text x="12" y="{top + height / 2:.0f}" font-size="10" fill="#57606a" transform="rotate(-90 12 {top + height / 2:.0f})" '
        'text-anchor="middle">row error ||engine - ref|| / ||ref||</text>'
    )

    def series(key: str, keep=lambda t: True) -> list[tuple[float, float] | None]:
        return [(X(i), Y(v)) if (v := _pos(getattr(t, key))) and keep(t) else None for i, t in enumerate(tensors)]

    # floor, threshold, the engine's error
    s.append(_polyline(series("noise_floor"), C_FLOOR, "4 3"))
    s.append(_polyline(series("threshold"), C_THRESH))
    s.append(_polyline(series("err", lambda t: t.status.compared), "#54aeff"))
    for i, t in enumerate(tensors):
        x, tip = X(i), _tip(t)
        status, err = t.status, _pos(t.err)
        if status == TensorStatus.TIE:
            continue
        if status in (TensorStatus.MISSING, TensorStatus.SHAPE) or (status == TensorStatus.MISMATCH and err is None):
            s.append(
                f'<text x="{x:.1f}" y="{ceiling + 4:.1f}" font-size="13" text-anchor="middle" fill="{C_ABOVE}" '
                f'class="err above">×<title>{tip}</title></text>'
            )
            continue
        if status == TensorStatus.ALLOWED_MISSING:
            continue
        if err is None:  # bit-identical (or zero error): on the bottom axis
            s.append(
                f'<circle cx="{x:.1f}" cy="{bottom:.1f}" r="3" fill="#fff" stroke="{C_ERR}" class="err identical">'
                f"<title>{tip}</title></circle>"
            )
            continue
        y = Y(err)
        colour, cls, r = (C_ABOVE, "err above", 4.5) if above_noise(t) else (C_ERR, "err within", 3.5)
        if t.introduced:
            s.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="9" fill="none" stroke="{C_ABOVE}" stroke-width="2" class="introduced"/>'
            )
        s.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{colour}" class="{cls}"><title>{tip}</title></circle>'
        )
    first = entry.first_divergence
    if first and any(t.name == first for t in tensors):
        i = next(i for i, t in enumerate(tensors) if t.name == first)
        anchor, dx = ("start", 5) if i < n / 2 else ("end", -5)
        s.append(
            f'<line x1="{X(i):.1f}" x2="{X(i):.1f}" y1="{top}" y2="{bottom}" stroke="{C_ABOVE}" stroke-width="1" '
            f'stroke-dasharray="2 2" class="introduced-marker"/><text x="{X(i) + dx:.1f}" y="{top + 12}" font-size="11" '
            f'font-weight="600" fill="{C_ABOVE}" text-anchor="{anchor}">error introduced: {escape(first)}</text>'
        )
    # tensor names
    for i, t in enumerate(tensors):
        colour = C_ABOVE if above_noise(t) else ("#8c959f" if t.status == TensorStatus.TIE else "#1f2328")
        weight = ' font-weight="700"' if t.introduced else ""
        s.append(
            f'<text x="{X(i) + 3:.1f}" y="{bottom + 10:.1f}" font-size="9" fill="{colour}"{weight} text-anchor="end" '
            f'transform="rotate(-60 {X(i) + 3:.1f} {bottom + 10:.1f})">{escape(t.name)}</text>'
        )
    # legend
    items = [
        (f'<circle cx="6" cy="-3" r="3.5" fill="{C_ERR}"/>', "err (within noise)"),
        (f'<circle cx="6" cy="-3" r="4.5" fill="{C_ABOVE}"/>', "above noise"),
        (f'<circle cx="6" cy="-3" r="7" fill="none" stroke="{C_ABOVE}" stroke-width="2"/>', "error introduced"),
        (f'<circle cx="6" cy="-3" r="3" fill="#fff" stroke="{C_ERR}"/>', "bit-identical (on the axis)"),
        (
            f'<line x1="0" x2="14" y1="-3" y2="-3" stroke="{C_FLOOR}" stroke-width="1.5" stroke-dasharray="4 3"/>',
            "noise floor",
        ),
        (f'<line x1="0" x2="14" y1="-3" y2="-3" stroke="{C_THRESH}" stroke-width="1.5"/>', "threshold"),
        (f'<rect x="0" y="-9" width="14" height="12" fill="{C_TIE}"/>', "tie: not compared"),
    ]
    x = left
    for mark, label in items:
        s.append(
            f'<g transform="translate({x},16)">{mark}<text x="18" y="0" font-size="10" fill="#1f2328">{label}</text></g>'
        )
        x += 30 + 5.6 * len(label)
    s.append("</svg>")
    return "".join(s)


def _floor_rows(f) -> str:
    """The rows a tensor's floor stands on, of those captured, and whether they were too few."""
    of = f" of {f.total_rows}" if f.total_rows is not None else ""
    return f"{f.rows}{of}" + ("" if f.measured else f" (too few: {f.source})")


def noise_section(report: Report) -> list[str]:
    """The noise floor's source line, then per engine the SVG, the compact table and the ties."""
    h = [
        "<h2 id='noise'>Error against the noise floor</h2>",
        f"<p class='noise-source' id='noise-source'>{escape(noise_floor_line(report))}</p>",
    ]
    h += [f"<p class='noise-source'>{escape(line)}</p>" for line in declared_floor_lines(report)]
    nf = report.noise_floor
    if nf is not None and nf.tensors:
        h.append(
            "<details><summary>measured floor per tensor</summary><table><tr><th>tensor</th><th>floor</th>"
            "<th>max</th><th>rows</th><th>threshold</th></tr>"
        )
        for name, f in nf.tensors.items():
            h.append(
                f"<tr><td><code>{escape(name)}</code></td><td>{num(f.floor)}</td><td>{num(f.max)}</td>"
                f"<td>{escape(_floor_rows(f))}</td><td>{num(f.threshold)}</td></tr>"
            )
        h.append("</table></details>")
    comparisons = report.comparisons
    if not comparisons:
        h.append("<p>No engine was compared with the reference.</p>")
    for engine, entries in comparisons.items():
        entry = focus(entries)
        if entry is None:
            continue
        first = entry.first_divergence
        head = f"{escape(engine)} · prompt {escape(str(entry.prompt))} · " + (
            f"error introduced at <code>{escape(first)}</code>" if first else "every tensor within noise"
        )
        h.append(f"<h3 class='noise-engine'>{head}</h3>")
        if first:
            h.append(
                f"<p>first above noise <code>{escape(str(entry.first_above_noise))}</code> · first that differs "
                f"at all <code>{escape(str(entry.first_differs))}</code></p>"
            )
        svg = svg_noise(entry, engine)
        if svg:
            h.append(
                f"<figure>{svg}<figcaption>{escape(engine)}, prompt {escape(str(entry.prompt))}: per-row relative "
                "error of every tensor along the data flow (largest row, log scale) against the reference's measured "
                "noise floor and the threshold; hover a point for its numbers</figcaption></figure>"
            )
        rows, left = interesting(entry)
        if rows:
            h.append(
                "<table class='noise-table'><tr><th>tensor</th><th>err</th><th>floor</th><th>threshold</th><th>excess</th>"
                "<th>verdict</th><th>introduced</th></tr>"
            )
            for t in rows:
                cls = " class='above'" if above_noise(t) else ""
                err, floor, threshold, excess = noise_cells(t)
                h.append(
                    f"<tr{cls}><td><code>{escape(t.name)}</code></td><td>{err}</td><td>{floor}</td><td>{threshold}</td>"
                    f"<td>{excess}x</td><td>{escape(verdict_word(t))}</td>"
                    f"<td>{'◀ introduced' if t.introduced else ''}</td></tr>"
                )
            h.append("</table>")
            if left:
                h.append(f"<p>{left} more tensors above noise are in the plot and the JSON.</p>")
        tl = ties_lines(report, engine)
        if tl:
            h.append("<p>Ties:</p><ul class='ties'>" + "".join(f"<li>{escape(x)}</li>" for x in tl) + "</ul>")
        else:
            h.append("<p>Ties: none.</p>")
    return h


def plot_dataflow(report: Report) -> str | None:
    runs = {e: c for e in report.comparisons if (c := _comparison(report, e)) is not None}
    if not runs:
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    names: list[str] = []
    for c in runs.values():
        for t in c.tensors:
            if t.name not in names:
                names.append(t.name)
    x = {n: i for i, n in enumerate(names)}
    exact = 0  # tensors equal to the reference: a log axis has no zero, so they are counted, not drawn
    for e, c in runs.items():
        tensors = [t for t in c.tensors if t.numel]
        xs = [x[t.name] for t in tensors]
        ax1.plot(xs, [_pos(t.max_abs) or math.nan for t in tensors], marker="o", label=e)
        ax2.plot(xs, [_pos(1 - t.cosine) or math.nan for t in tensors], marker="o", label=e)
        exact += sum(1 for t in tensors if _pos(t.max_abs) is None)
        bad = [t for t in tensors if t.status == TensorStatus.MISMATCH]
        ax1.scatter(
            [x[t.name] for t in bad],
            [_pos(t.max_abs) or math.nan for t in bad],
            s=90,
            facecolors="none",
            edgecolors="red",
        )
    if exact == sum(len([t for t in c.tensors if t.numel]) for c in runs.values()):
        fig.clf()
        _plt().close(fig)
        return None  # every tensor equal to the reference: nothing a log axis can show
    for ax, values in (
        (ax1, [t.max_abs for c in runs.values() for t in c.tensors if t.numel]),
        (ax2, [1 - t.cosine for c in runs.values() for t in c.tensors if t.numel]),
    ):
        if any(_pos(v) for v in values):
            _log_axis(ax)
        else:  # a log axis has no 0: say it instead of drawing at a made-up floor
            ax.text(0.5, 0.5, "every value 0", transform=ax.transAxes, ha="center", va="center")
            ax.set_yticks([])
    ax1.set_ylabel("max |diff|"), ax2.set_ylabel("1 - cos")
    ax2.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax1.legend(fontsize=8), ax1.grid(alpha=0.3), ax2.grid(alpha=0.3)
    ax1.set_title(
        "elementwise statistics along the data flow, information only "
        f"(red ring: above noise; {exact} exact matches (difference 0) not drawn)"
    )
    return _png(fig)


def plot_tokens(report: Report) -> str | None:
    """Per-token error of each engine's introduced-error tensor: row error / threshold (1 = the noise
    threshold); reports from before the noise criterion: max |diff| per row."""
    plt = _plt()
    series = []
    for e in report.comparisons:
        c = _comparison(report, e)
        name = c.first_divergence if c is not None else None
        if c is None or not name:
            continue
        t = next((t for t in c.tensors if t.name == name), None)
        if t and (t.row_err or t.row_max_abs):
            series.append((e, name, c.prompt, t))
    if not series:
        return None
    noise_units = all(t.row_err and _pos(t.threshold) for _, _, _, t in series)
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for e, name, prompt, t in series:
        ys = [v / t.threshold for v in t.row_err] if noise_units else t.row_max_abs
        ax.plot([_pos(v) or math.nan for v in ys], marker=".", label=f"{e}: {name} (prompt {prompt})")
    if noise_units:
        ax.axhline(1.0, color=C_THRESH, linewidth=1, label="noise threshold")
        ax.set_ylabel("row error / threshold")
    else:
        ax.set_ylabel("max |diff| in row")
    _log_axis(ax)
    ax.set_xlabel("token position (row)")
    (
        ax.legend(fontsize=8),
        ax.grid(alpha=0.3),
        ax.set_title("per-token error of the tensor where the error is introduced"),
    )
    return _png(fig)


def plot_similarity(check: CheckResult) -> str | None:
    data = check.data if isinstance(check.data, ComparisonData) else ComparisonData()
    sim = data.similarity
    if sim is None or not sim.cosine:
        return None
    rows = sim.cosine
    plt = _plt()
    import numpy as np  # with the plots only (matplotlib has loaded it): the report floor stays numpy-free

    m = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(min(11, 2 + 0.45 * m.shape[1]), 1.2 + 0.5 * m.shape[0]))
    im = ax.imshow(m, cmap="viridis", vmin=min(0.0, float(np.nanmin(m))) if m.size else 0, vmax=1, aspect="auto")
    ax.set_xticks(
        range(m.shape[1]), [c.removeprefix("target.") for c in sim.candidates], rotation=60, ha="right", fontsize=8
    )
    ax.set_yticks(range(m.shape[0]), sim.chunks, fontsize=8)
    for j, fc in enumerate(data.fc_chunks or []):
        if fc.expected is not None and fc.expected in sim.candidates:
            ax.scatter([sim.candidates.index(fc.expected)], [j], marker="s", s=160, facecolors="none", edgecolors="red")
    fig.colorbar(im, ax=ax, label="mean per-token cosine")
    ax.set_title(f"{check.engine}: engine fc chunk vs reference tensor (red square: expected)", fontsize=9)
    return _png(fig)


def plot_acceptance(check: CheckResult) -> str | None:
    if not isinstance(check.data, (AcceptLengthData, ServerAcceptData)):
        return None
    ref, eng = check.data.reference, check.data.engine
    a, b = ref.acceptance_rate_per_pos, eng.acceptance_rate_per_pos
    if not a and not b:
        return None
    plt = _plt()
    n = max(len(a), len(b))
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([i - 0.2 for i in range(len(a))], a, width=0.4, label=f"reference ({ref.accept_length:.2f})")
    ax.bar([i + 0.2 for i in range(len(b))], b, width=0.4, label=f"{check.engine} ({eng.accept_length:.2f})")
    ax.set_xticks(range(n), [str(i + 1) for i in range(n)])
    ax.set_xlabel("draft position"), ax.set_ylabel("acceptance rate"), ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8), ax.set_title("per-position acceptance (accept length in the legend)", fontsize=9)
    return _png(fig)


def _outcome(o: str) -> str:
    return f'<span class="outcome" style="background:{OUTCOME_COLOURS.get(o, "#6e7781")}">{escape(o)}</span>'


def _plain(markdown_line: str) -> str:
    return markdown_line.replace("**", "").replace("`", "")


def diagnosed(report: Report) -> dict[str, CheckResult]:
    """Per engine, the one check whose message is the diagnosis shown in full: the first failing (or
    expected-failing) tensor comparison, else the first failing check of any kind."""
    out: dict[str, CheckResult] = {}
    bad = [c for c in report.checks if c.failed or c.outcome == "xfailed"]
    for c in sorted(bad, key=lambda c: c.check not in ("fc_inputs", "draft_logits")):
        out.setdefault(c.engine, c)
    return out


def _message_cell(c: CheckResult, shown: dict[str, CheckResult]) -> str:
    """A check's message in the table: a diagnosis shown above is linked, not repeated; a long message
    is one line with the rest folded."""
    diag = shown.get(c.engine)
    if diag is c:
        return f"<a href='#diagnosis-{escape(c.engine)}'>the diagnosis above</a>"
    text = c.message.strip()
    if diag is not None and text.splitlines()[:1] == diag.message.strip().splitlines()[:1]:
        rest = "\n".join(text.splitlines()[1:]).strip()  # the same divergence: only what this check adds
        head = f"same divergence as <a href='#diagnosis-{escape(c.engine)}'>the diagnosis above</a>"
        return head + (f"<details><summary>more</summary>{escape(rest)}</details>" if rest else "")
    line = short(text)
    if line == text:
        return escape(text)
    return f"{escape(line)}<details><summary>in full</summary>{escape(text)}</details>"


def environment_rows(report: Report) -> list[str]:
    """The engines (release, runner, kernels, their versions as a small table), then the harness."""
    h = ["<table class='env'><tr><th>engine</th><th>release</th><th>runner</th><th>kernels</th><th>versions</th></tr>"]
    for e, entry in report.engines.items():
        info = entry.info
        if info is None:
            h.append(
                f"<tr><td><code>{escape(e)}</code></td><td colspan='4'>did not start: {escape(entry.error or '')}</td></tr>"
            )
            continue
        versions = "".join(
            f"<tr><td>{escape(str(k))}</td><td><code>{escape(str(v))}</code></td></tr>"
            for k, v in info.versions.items()
        )
        extra = "".join(
            f"<tr><td>{escape(k)}</td><td><code>{escape(str(v))}</code></td></tr>"
            for k, v in (("live server", info.live), *info.settings.items())
            if v
        )
        h.append(
            f"<tr><td><code>{escape(e)}</code></td><td>{escape(info.label())}</td><td>{escape(info.code_path())}</td>"
            f"<td>{escape(info.kernels or '-')}</td><td><table>{versions}{extra}</table></td></tr>"
        )
    h.append("</table><table class='env'><tr><th>harness</th><th>value</th></tr>")
    h += [
        f"<tr><td>{escape(str(k))}</td><td><code>{escape(str(v))}</code></td></tr>"
        for k, v in report.environment.items()
    ]
    h.append(f"<tr><td>memory plan</td><td>{escape(memory_plan_said(report))}</td></tr>")
    return h + ["</table>"]


def render(report: Report) -> str:
    checks = report.checks
    failed = [c for c in checks if c.failed]
    title = f"difftest: {report.case}"
    expected = sum(1 for c in checks if c.outcome == "xfailed")
    head = (
        f"{len(failed)} of {len(checks)} checks failed: " + ", ".join(f"{c.engine}::{c.check}" for c in failed)
        if failed
        else f"all {len(checks)} checks passed" + (f" ({expected} as declared expected failures)" if expected else "")
    )
    h = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title><style>{CSS}</style></head><body>"
    ]
    h.append(f"<h1>{escape(title)}</h1>")
    h.append(
        f"<p>reference <code>{escape(report.reference)}</code> · case file <code>{escape(report.case_file)}</code>"
        f" (paths relative to its directory) · {escape(report.created)} · schema {SCHEMA} version {SCHEMA_VERSION}</p>"
    )
    if report.interrupted:
        head = f"interrupted: {INTERRUPTED} ({head})"
    bad = failed or report.interrupted
    # the banner: the verdict, then the cause, the acceptance change and the fix (writer's three lines)
    lines = [head] + [_plain(f(report)) for f in (fed_line, accept_line, fix_line)]
    h.append(
        f"<div class='verdict {'failed' if bad else 'passed'}' id='verdict'>"
        + "<br>".join(escape(x) for x in lines)
        + "</div>"
    )

    h.append("<h2 id='first-divergence'>First divergence and diagnosis</h2>")
    shown = diagnosed(report)
    if not shown:
        h.append("<p>No tensor diverges.</p>")
    for c in shown.values():
        data = c.data if isinstance(c.data, ComparisonData) else ComparisonData()  # lint: a message, no tensors
        fd = data.introduced or data.first_divergence
        where = f" · error introduced at <code>{escape(fd)}</code>" if fd else ""
        h.append(f"<h3 id='diagnosis-{escape(c.engine)}'>{escape(c.engine)} · {escape(c.check)}{where}</h3>")
        marks = [
            (k, v)
            for k, v in (("first above noise", data.first_above_noise), ("first differs", data.first_differs))
            if v
        ]
        if marks:
            h.append("<p>" + " · ".join(f"{k} <code>{escape(str(v))}</code>" for k, v in marks) + "</p>")
        h.append(f"<pre class='msg'>{escape(c.message)}</pre>")
    found = fixes(report)
    if found:
        h.append("<h2 id='fix'>Fix</h2>")
        for f in found:
            h.append(f"<h3>{escape(f.engine)}</h3><p>{escape(f.rule)}</p><ul>")
            h += [f"<li>{escape(line)}</li>" for line in fix_lines(f, report.case_file or "CASE")]
            h.append("</ul>")
    h += noise_section(report)

    h.append("<h2 id='checks'>Checks</h2><table><tr><th>engine</th><th>check</th><th>outcome</th><th>message</th></tr>")
    for c in checks:
        h.append(
            f"<tr><td><code>{escape(c.engine)}</code></td><td>{escape(c.check)}</td><td>{_outcome(c.outcome)}</td>"
            f"<td class='msg'>{_message_cell(c, shown)}</td></tr>"
        )
    h.append("</table>")

    h.append("<h2 id='plots'>Plots</h2>")
    figures = [
        (plot_dataflow(report), "elementwise statistics along the data flow (prompt of the first divergence)"),
        (plot_tokens(report), "per-token error of the tensor where the error is introduced"),
    ]
    for c in checks:
        if c.check == "fc_inputs":
            figures.append((plot_similarity(c), f"{c.engine}: chunk-vs-layer similarity"))
        if c.check == "accept_length":
            figures.append((plot_acceptance(c), f"{c.engine}: per-position acceptance"))
    pictures = [_figure(png, cap) for png, cap in figures if png]
    h += pictures or ["<p>No numeric data to plot.</p>"]

    h.append("<h2 id='environment'>Environment</h2>")
    h += environment_rows(report)
    h.append(f"<h2 id='reproduce'>Reproduce (from the case file's directory)</h2><pre>{escape(report.reproduce)}</pre>")
    h.append(f"<h2 id='case'>Case</h2><pre>{escape(report.case_yaml)}</pre>")
    h.append(f"<p>Accept length: {escape(report.accept_length_definition)}.</p>")
    if report.definitions:  # what each figure above counts, and how engines' own figures became it
        h.append(
            "<h2 id='definitions'>Definitions</h2><table><tr><th>figure</th><th>counts</th><th>to the harness's definition</th></tr>"
        )
        h += [
            f"<tr><td><code>{escape(d.name)}</code></td><td>{escape(d.counts)}</td><td>{escape(d.converts)}</td></tr>"
            for d in report.definitions
        ]
        h.append("</table>")
    h.append("</body></html>")
    # no machine path on the page; an embedded PNG is left alone (base64 may spell "/root/" by chance)
    return "\n".join(x if "base64," in x else portable(x, report.case_file) for x in h)
