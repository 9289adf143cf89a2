"""The report as one self-contained HTML page: tables, inline SVG plots, removed samples.

Owns: `render_html(report) -> str` and its small SVG chart helpers. Must not: compute statistics
(report.py does) or load anything from the network: no scripts, fonts or stylesheets from
elsewhere, so the page opens the same from an air-gapped laptop or an S3 console.

Plots: the document funnel (documents left after each step), the top removal reasons of each step,
the duplicate-cluster size histogram, and the mixture's epochs per source; a table of the input
files that could not be read to their end.
"""

from __future__ import annotations

import html
from typing import Any

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}
details{margin:.3em 0}pre{white-space:pre-wrap;background:#f7f7f7;padding:.4em;font-size:85%}
.bad{color:#b00}.ok{color:#070}svg text{font-size:11px;font-family:sans-serif}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _bars(items: list[tuple[str, float]], unit: str = "", width_px: int = 640) -> str:
    """Horizontal bar chart: one labelled bar per (label, value)."""
    if not items:
        return "<p>(nothing)</p>"
    label_px, bar_px, row_px = 220, width_px - 300, 18
    top = max(v for _, v in items) or 1
    rows = []
    for i, (label, value) in enumerate(items):
        y = i * row_px
        length = bar_px * value / top
        rows.append(
            f'<text x="{label_px - 6}" y="{y + 13}" text-anchor="end">{_e(label)[:40]}</text>'
            f'<rect x="{label_px}" y="{y + 3}" width="{length:.1f}" height="{row_px - 6}" '
            f'fill="#4a7ab5"/><text x="{label_px + length + 4:.1f}" y="{y + 13}">'
            f'{value:,.4g}{unit}</text>')
    height = len(items) * row_px + 4
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{height}" '
            f'role="img">{"".join(rows)}</svg>')


def _counts_row(name: str, c: dict[str, Any], cls: str = "") -> str:
    return (f'<tr><td class="l {cls}">{_e(name)}</td><td>{c["docs_in"]:,}</td>'
            f'<td>{c["removed_docs"]:,}</td><td>{c["docs_out"]:,}</td>'
            f'<td>{100 * c["removed_share"]:.2f}%</td><td>{c["bytes_in"]:,}</td>'
            f'<td>{c["bytes_out"]:,}</td></tr>')


_COUNT_HEADER = ('<tr><th class="l">{}</th><th>docs in</th><th>removed</th><th>docs out</th>'
                 '<th>removed %</th><th>bytes in</th><th>bytes out</th></tr>')


def _step_section(step: dict[str, Any]) -> str:
    parts = [f'<h3 id="{_e(step["step"])}">{_e(step["step"])} <small>({_e(step["stage"])})</small>'
             f'</h3><p><i>{_e(step["why"])}</i></p>',
             f'<p>parameters: <code>{_e(step["params"])}</code>; {step["time_s"]} s'
             + (f', {step["docs_per_s"]:,} docs/s' if step["docs_per_s"] else "") + "</p>",
             "<table>" + _COUNT_HEADER.format("source")]
    for name, counts in step["sources"].items():
        parts.append(_counts_row(name, counts))
    parts.append(_counts_row("all", step["totals"], "b") + "</table>")
    if step["reasons"]:
        parts.append(_bars([(r["reason"], r["docs"]) for r in step["reasons"]], " docs"))
    for reason, samples in step["samples"].items():
        body = "".join(f'<p>{_e(s["source"])} / {_e(s["id"])}</p><pre>{_e(s["text"])}</pre>'
                       for s in samples)
        parts.append(f"<details><summary>removed as <b>{_e(reason)}</b>: "
                     f"{len(samples)} sample(s)</summary>{body}</details>")
    if step["counters"]:
        parts.append(f'<p>counters: <code>{_e(step["counters"])}</code></p>')
    if step.get("problem_files"):
        rows = "".join(f'<tr><td class="l">{_e(p["source"])}</td><td class="l">{_e(p["file"])}'
                       f'</td><td class="l">{_e(p["reason"])}</td><td class="l">{_e(p["detail"])}'
                       "</td></tr>" for p in step["problem_files"])
        parts.append(f'<p class="bad">{len(step["problem_files"])} file(s) not read to the end; '
                     "the records before each problem are kept:</p><table><tr>"
                     '<th class="l">source</th><th class="l">file</th><th class="l">reason</th>'
                     f'<th class="l">detail</th></tr>{rows}</table>')
    return "\n".join(parts)


def render_html(report: dict[str, Any]) -> str:
    steps = report["steps"]
    summary = report["summary"]
    checks = report["checks"]
    funnel = [("input", summary["docs_in"])] + [(s["step"], s["totals"]["docs_out"]) for s in steps]
    body = [
        "<h1>Corpus report</h1>",
        f'<p>output <code>{_e(report["run"]["final_output"])}</code>, '
        f'{report["run"]["shards"]} shard(s), config {_e(report["run"]["fingerprint"])}</p>',
        f'<p>{summary["docs_in"]:,} documents ({summary["bytes_in"]:,} bytes) in, '
        f'{summary["docs_out"]:,} ({summary["bytes_out"]:,} bytes) out: '
        f'{100 * summary["docs_kept_share"]:.2f}% of documents kept.</p>',
        '<p class="ok">in - removed = out at every step and source.</p>' if checks["adds_up"]
        else '<p class="bad">totals do not add up: ' + _e("; ".join(checks["problems"])) + "</p>",
        f'<p class="bad">{summary["problem_files"]} input file(s) not read to the end '
        '(see the read step).</p>' if summary.get("problem_files") else "",
        "<h2>Documents left after each step</h2>", _bars(funnel, " docs"),
        "<h2>Steps</h2><table>" + _COUNT_HEADER.format("step"),
        *(_counts_row(s["step"], s["totals"]) for s in steps), "</table>",
    ]
    clusters = report.get("dedup")
    if clusters:
        body.append("<h2>Duplicates</h2>")
        if clusters.get("exact"):
            exact = clusters["exact"]
            body.append(f'<p>exact: {exact["groups"]:,} groups, {exact["removed"]:,} removed</p>')
            body.append(_bars(list(exact["group_sizes"].items()), " groups"))
        if clusters.get("near"):
            near = clusters["near"]
            body.append(f'<p>near ({_e(near["config"])}, threshold ~{near["threshold"]}): '
                        f'{near["clusters"]:,} clusters, {near["removed"]:,} removed. '
                        "Cluster sizes:</p>")
            body.append(_bars(list(near["cluster_sizes"].items()), " clusters"))
    mixture = next((s for s in steps if s["step"] == "mixture"), None)
    if mixture:
        body.append("<h2>Mixture: epochs per source</h2>")
        body.append(_bars(list(mixture["params"]["epochs"].items()), " epochs"))
    body.append("<h2>Each step</h2>")
    body.extend(_step_section(s) for s in steps)
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>Corpus report</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")
