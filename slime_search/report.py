"""The run report. The run's health comes first: a verdict line, the health guard's events, and panels of the signals it
watches with its bounds drawn. Then come the reward, EM and search-rate curves, the per-step metrics, and a few rollouts
with their search calls and retrieved passages highlighted.

    python -m slime_search.report RUN_DIR        # (re-)renders RUN_DIR/report/index.html and prints the verdict
    python -m slime_search.report RUN_DIR --baseline OTHER_RUN   # the other run's held-out EM beside this one's

It reads only what a run writes (RUN_DIR/metrics.jsonl, rollouts.jsonl, health.jsonl, health_config.json), so it
renders a finished run, a running one, or a copy of either. Long runs stay readable: curves of more than a few
hundred points are downsampled and the tables list a bounded number of rows.
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from slime_search.evaluation.table import PAPER_SETS, ordered_sources
from slime_search.health.panels import COLORS, HEALTH_PANELS, Panel, number, plot_panels
from slime_search.health.verdict import LASTING, events_shown, level, verdict
from slime_search.utils.records import read_records

STEP_AXIS = "step (weight version for eval)"


def draw_eval_interval(ax, records: list[dict[str, Any]], config: dict[str, Any] | None) -> None:
    """The band of held-out EM's 95% interval (about the population of questions) at each evaluated version."""
    points = [(r["step"], number(r, "eval/em_low"), number(r, "eval/em_high")) for r in records]
    points = [p for p in points if p[1] is not None and p[2] is not None]
    if points:
        steps, lows, highs = zip(*points, strict=True)
        ax.fill_between(steps, lows, highs, color=COLORS[0], alpha=0.15, linewidth=0, label="95% interval")


def draw_baseline_eval(baseline: list[dict[str, Any]], name: str):
    """A panel drawing that adds another run's held-out EM (and its interval band) to this run's."""

    def draw(ax, records: list[dict[str, Any]], config: dict[str, Any] | None) -> None:
        draw_eval_interval(ax, records, config)
        points = [(r["step"], number(r, "eval/em")) for r in baseline if number(r, "eval/em") is not None]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, color="0.45", ls="--", marker="s", markersize=3, label=f"baseline {name}")
            bands = [(r["step"], number(r, "eval/em_low"), number(r, "eval/em_high")) for r in baseline]
            bands = [b for b in bands if b[1] is not None and b[2] is not None]
            if bands:
                xs, lows, highs = zip(*bands, strict=True)
                ax.fill_between(xs, lows, highs, color="0.6", alpha=0.12, linewidth=0)

    return draw


CURVES = (
    Panel("reward.png", "Training reward", (("rollout/reward_mean", "rollout reward (mean)"),), xlabel=STEP_AXIS),
    Panel(
        "em.png",
        "Exact match",
        (("eval/em", "held-out EM (greedy)"), ("rollout/reward_mean", "training reward")),
        xlabel=STEP_AXIS,
        draw=draw_eval_interval,
    ),
    Panel(
        "search_rate.png",
        "Search rate",
        (("eval/search_rate", "held-out (greedy)"), ("rollout/search_rate", "training rollouts (sampled)")),
        xlabel=STEP_AXIS,
    ),
)
MAX_TABLE_ROWS = 200  # steps listed in the per-step table; the others are counted
TABLE_KEYS = (
    "rollout/reward_mean",
    "eval/em",
    "eval/search_rate",
    "rollout/search_rate",
    "rollout/searches_mean",
    "rollout/search_billed_calls",
    "rollout/search_cache_hits",
    "rollout/search_cost_usd",
    "rollout/search_ledger_calls",
    "rollout/search_empty",
    "rollout/turns_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/kl_loss",
    "train/pg_clipfrac",
    "train/grad_norm",
    "train/entropy",
    "health/logprob_gap",
    "health/is_capped_share",
    "rollout/response_length_p90",
    "rollout/truncation_rate",
    "health/step_skipped",
    "health/warns",
    "health/refuses",
    "health/rollbacks",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "time/eval_s",
    "time/step_s",
)
TAG = re.compile(r"(<search>.*?</search>|<answer>.*?</answer>|<think>.*?</think>)", re.DOTALL)


def render_segment(text: str, generated: bool) -> str:
    """Generated text with its tags marked; retrieved (inserted) text as a passage block."""
    if not generated:
        return f'<span class="obs">{html.escape(text)}</span>'
    parts = []
    for piece in TAG.split(text):
        if not piece:
            continue
        kind = next((k for k in ("search", "answer", "think") if piece.startswith(f"<{k}>")), None)
        escaped = html.escape(piece)
        parts.append(f'<span class="{kind}">{escaped}</span>' if kind else escaped)
    return "".join(parts)


def render_rollout(example: dict) -> str:
    body = "".join(render_segment(text, bool(generated)) for text, generated in example.get("segments", []))
    label = example.get("label") or {}
    target = (label.get("ground_truth") or {}).get("target", label) if isinstance(label, dict) else label
    question = str(example.get("prompt", "")).rpartition("Question:")[2].strip() or str(example.get("prompt", ""))
    return (
        f'<div class="rollout"><div class="meta">{html.escape(example.get("kind", ""))} step {example.get("step")} · '
        f"reward {example.get('reward')} · searches {example.get('searches')} · gold {html.escape(str(target))}</div>"
        f'<div class="q">{html.escape(question)}</div><pre>{body}</pre></div>'
    )


def evenly(items: list, count: int) -> list:
    """`count` items spread evenly over `items`, the first and the last included."""
    if count >= len(items):
        return list(items)
    if count <= 1:
        return items[-1:]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def table_steps(steps: list[int], events: list[dict[str, Any]], limit: int = MAX_TABLE_ROWS) -> list[int]:
    """The steps the per-step table lists, `limit` rows in all at most.

    They are every rollback and stop, the last step, and steps with another event (a quarter of `limit` at most,
    evenly spread). Evenly spaced steps fill the rows left."""
    known = set(steps)
    must = {e["step"] for e in events if e.get("action") in LASTING} & known
    must |= set(steps[-1:])
    troubled = evenly(sorted({e["step"] for e in events} & known - must), limit // 4)
    chosen = must | set(troubled)
    return sorted(chosen | set(evenly(steps, max(limit - len(chosen), 0))))


def merged_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """One row per step: its training record and the evaluation of its weight version side by side."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records:
        rows.setdefault(record["step"], {}).update(record)
    return rows


def metrics_table(records: list[dict[str, Any]], events: list[dict[str, Any]], limit: int = MAX_TABLE_ROWS) -> str:
    rows = merged_by_step(records)
    shown = table_steps(sorted(rows), events, limit)
    keys = [k for k in TABLE_KEYS if any(k in r for r in records)]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", *keys])
    lines = []
    for step in shown:
        record = rows[step]
        cells = [str(step)] + [f"{record[k]:.4g}" if isinstance(record.get(k), (int, float)) else "" for k in keys]
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    omitted = len(rows) - len(shown)
    note = (
        f'<p class="note">{len(shown)} of {len(rows)} steps listed (evenly spaced, the steps of the guard\'s events, '
        f"the last); {omitted} omitted.</p>"
        if omitted
        else ""
    )
    return f"{note}<table><tr>{head}</tr>{''.join(lines)}</table>"


def verdict_section(events: list[dict[str, Any]]) -> str:
    """The verdict line, coloured by severity, and the guard's events (the first and last ones, every rollback and
    stop)."""
    line = f'<p class="verdict {level(events)}">Health: {html.escape(verdict(events))}</p>'
    if not events:
        return line
    rows = []
    for row in events_shown(events):
        if isinstance(row, int):
            rows.append(f'<tr><td colspan="4" class="note">… {row} events omitted …</td></tr>')
            continue
        cells = (row.get("step"), row.get("action"), row.get("rule"), row.get("message"))
        cells_html = "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
        rows.append(f'<tr class="{html.escape(str(row.get("action")))}">{cells_html}</tr>')
    head = "<tr><th>step</th><th>action</th><th>rule</th><th>message</th></tr>"
    return f'{line}<h2>Health events ({len(events)})</h2><table class="events">{head}{"".join(rows)}</table>'


def checkpoints_section(run_dir: Path) -> str:
    """The weights the run ended on (RUN/final.json) and the checkpoints rollbacks and stops set aside (never deleted
    by the guard; only --keep-checkpoints prunes them)."""
    import json

    from slime_search.run.folder import RunFolder

    final = run_dir / "final.json"
    lines = []
    if final.is_file():
        chosen = json.loads(final.read_text())
        where = chosen["checkpoint"] or "never saved"  # a stop before the first checkpoint
        where += f" (HF: {chosen['hf']})" if chosen.get("hf") else ""
        lines.append(f"The run ended on the weights of step {chosen['step']}, {where}: {chosen['reason']}.")
    aside = RunFolder(run_dir).undone_checkpoints()
    if aside:
        names = ", ".join(str(path.relative_to(run_dir)) for path in aside)
        lines.append(f"Set aside by rollbacks and stops ({len(aside)}): {names}.")
    if not lines:
        return ""
    return "<h2>Checkpoints</h2>" + "".join(f"<p>{html.escape(line)}</p>" for line in lines)


def search_cost_section(records: list[dict[str, Any]]) -> str:
    """What web search cost over the run (training rollouts and evaluations). Two figures, told apart. The first is the
    budget ledger's (`*/search_ledger_calls`), when the run had one. It is the running total a task's spending ledger
    wrote into the steps' records: every attempt a paid API may have billed, retried, failed, of steps a rollback undid,
    of evaluations. The second is the sum of the records kept (the first requester of each answered search, in the steps
    the run kept), with the cache's answers. Empty for a run that made no billed call."""
    totals = {"billed": 0.0, "usd": 0.0, "hits": 0.0}
    ledger = {"calls": None, "usd": None}
    for record in records:
        for prefix in ("rollout", "eval"):
            totals["billed"] += float(record.get(f"{prefix}/search_billed_calls", 0.0))
            totals["usd"] += float(record.get(f"{prefix}/search_cost_usd", 0.0))
            totals["hits"] += float(record.get(f"{prefix}/search_cache_hits", 0.0))
            for key in ledger:  # a running total: the newest reading is the largest
                reading = record.get(f"{prefix}/search_ledger_{key}")
                if reading is not None:
                    ledger[key] = max(float(reading), ledger[key] or 0.0)
    if not totals["billed"] and not totals["hits"] and ledger["calls"] is None:
        return ""
    kept = f"{totals['billed']:.0f} billed calls, ${totals['usd']:.3f}"
    hits = f"{totals['hits']:.0f} answers from the cache (not billed)"
    if ledger["calls"] is None:
        text = (
            f"Web search over the run, as the step records kept sum it: {kept} (the first requester of each answered "
            "search; retried attempts, failed searches and steps a rollback undid are not in it: a Serper budget's "
            f"ledger counts them, --serper-budget-calls); {hits}. Per step: the table below."
        )
    else:
        text = (
            f"Web search over the run: {ledger['calls']:.0f} billed calls, ${ledger['usd'] or 0.0:.3f}, as the Serper "
            "budget ledger counts them (every attempt Serper may have billed: retries, failed searches, steps a "
            "rollback undid and evaluations included; per step: rollout/search_ledger_calls). The step records kept "
            f"sum to {kept} (the first requester of each answered search, in the steps the run kept); {hits}."
        )
    return f'<p class="cost">{html.escape(text)}</p>'


def last_eval(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if "eval/em" in r), None)


def eval_table_section(records: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None) -> str:
    """The last evaluated version's EM per set with its 95% interval and question count, in the paper's column order
    (every set the run evaluated), and all questions pooled; a baseline run's last evaluation in a row below."""
    last = last_eval(records)
    if last is None:
        return ""
    sources = ordered_sources({k.split("/")[1] for k in last if k.count("/") == 2 and k.endswith("/em")})
    titles = dict(PAPER_SETS)
    columns = [(f"eval/{s}", titles.get(s, s)) for s in sources] + [("eval", "all (pooled)")]

    def cell(prefix: str, record: dict[str, Any] = last) -> str:
        em, low, high, n = (record.get(f"{prefix}/{k}") for k in ("em", "em_low", "em_high", "n"))
        if em is None:
            return "-"
        interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
        return f"{em:.3f}{interval}" + (f"<br><span class='note'>{n:.0f} questions</span>" if n is not None else "")

    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    cells = "".join(f"<td>{cell(prefix)}</td>" for prefix, _ in columns)
    rows = f"<tr><td>EM</td>{cells}</tr>"
    other = last_eval(baseline or [])
    if other is not None:
        other_cells = "".join(f"<td>{cell(prefix, other)}</td>" for prefix, _ in columns)
        rows += f"<tr><td>baseline (version {other['step']})</td>{other_cells}</tr>"
    note = (
        "<p class='note'>Intervals of two runs are unpaired here; for a paired comparison on the same questions, "
        "python -m slime_search.eval --compare A.grades.jsonl B.grades.jsonl.</p>"
        if other is not None
        else ""
    )
    return (
        f"<h2>Held-out EM at version {last['step']} (95% intervals)</h2>"
        f"<table><tr><th></th>{head}</tr>{rows}</table>{note}"
    )


def health_config(run_dir: Path) -> dict[str, Any] | None:
    """The guard's bounds as the run recorded them; None for a run that did not."""
    path = run_dir / "health_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1200px; }
img { margin: 0.5em; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
pre { white-space: pre-wrap; background: #fafafa; padding: 0.6em; border: 1px solid #eee; }
.search { background: #ffe08a; font-weight: bold; } .answer { background: #b7f0b1; font-weight: bold; }
.think { color: #666; } .obs { background: #dbe9ff; display: block; margin: 0.3em 0; }
.meta { color: #555; font-size: 12px; } .q { font-weight: bold; margin-top: 0.3em; }
.rollout { margin-bottom: 1.2em; } .note { color: #555; font-size: 12px; }
.verdict { font-size: 18px; font-weight: bold; padding: 0.5em 0.8em; border-radius: 4px; }
.verdict.healthy { background: #d8f3dc; color: #1b5e20; } .verdict.warned { background: #fff3c4; color: #7a5a00; }
.verdict.rolled_back { background: #ffe0c2; color: #a84300; } .verdict.stopped { background: #ffd6d6; color: #a00000; }
tr.watch td { background: #eef5ff; } tr.warn td { background: #fffbe6; } tr.refuse td, tr.skip td { background: #fff1e0; }
tr.rollback td { background: #ffe0c2; } tr.stop td { background: #ffd6d6; font-weight: bold; }
"""


def chosen_examples(examples: list[dict[str, Any]], per_kind: int) -> list[dict[str, Any]]:
    """Up to `per_kind` rollouts of the first and of the last step of each kind (eval, train)."""
    shown = []
    for kind in ("eval", "train"):
        of_kind = [e for e in examples if e.get("kind") == kind]
        last_step = max((e["step"] for e in of_kind), default=None)
        first_step = min((e["step"] for e in of_kind), default=None)
        for step in dict.fromkeys([first_step, last_step]):
            shown += [e for e in of_kind if e["step"] == step][:per_kind]
    return shown


def images(names: list[str]) -> str:
    return "".join(f'<img src="{name}" alt="{name}">' for name in names)


def render_report(run_dir: str | Path, examples_per_kind: int = 6, baseline: str | Path | None = None) -> Path:
    """Write RUN_DIR/report/ (PNGs + index.html) from the run's files; returns the HTML path. `baseline`: another
    run's folder, whose held-out EM is drawn and tabled beside this run's."""
    from dataclasses import replace

    run_dir = Path(run_dir)
    records = read_records(run_dir / "metrics.jsonl")
    other = read_records(Path(baseline) / "metrics.jsonl") if baseline is not None else None
    curves_panels = CURVES
    if other is not None:
        draw = draw_baseline_eval(other, Path(baseline).name)
        curves_panels = tuple(replace(p, draw=draw) if p.file == "em.png" else p for p in CURVES)
    events = read_records(run_dir / "health.jsonl")
    config = health_config(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    health = plot_panels(HEALTH_PANELS, records, events, config, out)
    curves = plot_panels(curves_panels, records, events, None, out)
    page = (
        f"<html><head><meta charset='utf-8'><title>{html.escape(run_dir.name)}</title><style>{STYLE}</style></head>"
        f"<body><h1>Run {html.escape(run_dir.name)}</h1>"
        + verdict_section(events)
        + checkpoints_section(run_dir)
        + search_cost_section(records)
        + (
            "<h2>Health signals (guard bounds dotted red; rollbacks dashed orange; the stop dark red)</h2>"
            if health
            else ""
        )
        + images(health)
        + "<h2>Reward, exact match, search rate</h2>"
        + images(curves)
        + eval_table_section(records, other)
        + "<h2>Per-step metrics</h2>"
        + metrics_table(records, events)
        + "<h2>Rollouts (first and last step; search calls yellow, retrieved passages blue, answers green)</h2>"
        + "".join(
            render_rollout(e) for e in chosen_examples(read_records(run_dir / "rollouts.jsonl"), examples_per_kind)
        )
        + "</body></html>"
    )
    (out / "index.html").write_text(page)
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    baseline = None
    if len(args) == 3 and args[1] == "--baseline":
        args, baseline = args[:1], args[2]
    if len(args) != 1 or not Path(args[0]).is_dir() or (baseline is not None and not Path(baseline).is_dir()):
        print("usage: python -m slime_search.report RUN_DIR [--baseline OTHER_RUN_DIR]", file=sys.stderr)
        return 2
    page = render_report(args[0], baseline=baseline)
    print(f"health: {verdict(read_records(Path(args[0]) / 'health.jsonl'))}")
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
