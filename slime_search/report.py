"""The run report: reward, EM and search-rate curves (PNG) and an HTML page with the curves, the per-step metrics
and a few rollouts with their search calls and retrieved passages highlighted.

    python -m slime_search.report RUN_DIR        # (re-)renders RUN_DIR/report/index.html

It reads only what a run writes (RUN_DIR/metrics.jsonl, RUN_DIR/rollouts.jsonl), so it renders a finished run, a
running one, or a copy of either.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

from slime_search.utils.records import read_records

CURVES = {  # file -> (title, [(metric, label)])
    "reward.png": ("Training reward", [("rollout/reward_mean", "rollout reward (mean)")]),
    "em.png": ("Exact match", [("eval/em", "held-out EM (greedy)"), ("rollout/reward_mean", "training reward")]),
    "search_rate.png": (
        "Search rate",
        [("eval/search_rate", "held-out (greedy)"), ("rollout/search_rate", "training rollouts (sampled)")],
    ),
    "loss.png": ("Training loss", [("train/loss", "loss")]),
}
TABLE_KEYS = (
    "rollout/reward_mean",
    "eval/em",
    "eval/search_rate",
    "rollout/search_rate",
    "rollout/searches_mean",
    "rollout/search_billed_calls",
    "rollout/search_cache_hits",
    "rollout/turns_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/kl_loss",
    "train/pg_clipfrac",
    "train/grad_norm",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
    "time/eval_s",
    "time/step_s",
)
TAG = re.compile(r"(<search>.*?</search>|<answer>.*?</answer>|<think>.*?</think>)", re.DOTALL)


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot_curves(records: list[dict], out_dir: Path) -> list[str]:
    """One PNG per curve that has data; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, (title, lines) in CURVES.items():
        drawn = [(label, *series(records, key)) for key, label in lines]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
        for label, steps, values in drawn:
            ax.plot(steps, values, marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step (weight version for eval)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(name)
    return written


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


def metrics_table(records: list[dict]) -> str:
    keys = [k for k in TABLE_KEYS if any(k in r for r in records)]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", *keys])
    rows = []
    for record in records:
        cells = [str(record["step"])] + [
            f"{record[k]:.4g}" if isinstance(record.get(k), (int, float)) else "" for k in keys
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1200px; }
img { margin: 0.5em; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
pre { white-space: pre-wrap; background: #fafafa; padding: 0.6em; border: 1px solid #eee; }
.search { background: #ffe08a; font-weight: bold; } .answer { background: #b7f0b1; font-weight: bold; }
.think { color: #666; } .obs { background: #dbe9ff; display: block; margin: 0.3em 0; }
.meta { color: #555; font-size: 12px; } .q { font-weight: bold; margin-top: 0.3em; }
.rollout { margin-bottom: 1.2em; }
"""


def render_report(run_dir: str | Path, examples_per_kind: int = 6) -> Path:
    """Write RUN_DIR/report/ (PNGs + index.html) from the run's files; returns the HTML path."""
    run_dir = Path(run_dir)
    records = read_records(run_dir / "metrics.jsonl")
    examples = read_records(run_dir / "rollouts.jsonl")
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = plot_curves(records, out)
    shown = []
    for kind in ("eval", "train"):
        of_kind = [e for e in examples if e.get("kind") == kind]
        last_step = max((e["step"] for e in of_kind), default=None)
        first_step = min((e["step"] for e in of_kind), default=None)
        for step in dict.fromkeys([first_step, last_step]):
            shown += [e for e in of_kind if e["step"] == step][:examples_per_kind]
    page = (
        f"<html><head><meta charset='utf-8'><title>{html.escape(run_dir.name)}</title><style>{STYLE}</style></head>"
        f"<body><h1>Run {html.escape(run_dir.name)}</h1>"
        + "".join(f'<img src="{name}" alt="{name}">' for name in images)
        + "<h2>Per-step metrics</h2>"
        + metrics_table(records)
        + "<h2>Rollouts (first and last step; search calls yellow, retrieved passages blue, answers green)</h2>"
        + "".join(render_rollout(e) for e in shown)
        + "</body></html>"
    )
    (out / "index.html").write_text(page)
    return out / "index.html"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m slime_search.report RUN_DIR", file=sys.stderr)
        return 2
    print(render_report(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
