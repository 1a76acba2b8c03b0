"""The Search-R1 table: EM per test set and their average, each with its 95% interval, plus F1, search rate, turns and
the share of well-formed trajectories, in the paper's column order; and the paired comparison of two runs.

The input is one graded row per question: {"source", "key", "em", "f1", "format_valid", "searches", "turns"}
(`graded_row` makes one from a scored sample), so the table is the same whoever produced the grades.
"""

from __future__ import annotations

import json
from collections import defaultdict

from slime_search.evaluation.intervals import (
    average_over_sets_interval,
    bootstrap_interval,
    paired_difference,
)

# (data_source as Search-R1's data preparation names it, the paper's column)
PAPER_SETS = (
    ("nq", "NQ"),
    ("triviaqa", "TriviaQA"),
    ("popqa", "PopQA"),
    ("hotpotqa", "HotpotQA"),
    ("2wikimultihopqa", "2wiki"),
    ("musique", "Musique"),
    ("bamboogle", "Bamboogle"),
)
AVERAGE = "average"


def graded_row(source: str, key: str, reward: dict[str, float], metrics: dict, set_size: int | None = None) -> dict:
    """One question's grades: the reward's numbers (a missing one counts 0, as for a sample never rewarded) and the
    generate plugin's counts (None when unknown); `set_size` when the question is one of a subset of its set."""
    return {
        "source": source,
        "key": key,
        "set_size": set_size,
        "em": float(reward.get("em", 0.0)),
        "f1": float(reward.get("f1", 0.0)),
        "format_valid": float(reward.get("format_valid", 0.0)),
        "searches": _number_or_none(metrics.get("searches")),
        "turns": _number_or_none(metrics.get("turns")),
    }


def _number_or_none(value) -> float | None:
    """A count the generate plugin gave, or None where the grades came without it (trajectories graded as they
    stand): unknown, not zero."""
    return None if value is None else float(value)


def ordered_sources(sources) -> list[str]:
    """The paper's sets first in its order, then any other set by name."""
    known = [name for name, _ in PAPER_SETS if name in sources]
    return known + sorted(set(sources) - set(known))


def by_source(rows: list[dict]) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for row in rows:
        grouped[row["source"]].append(row)
    return dict(grouped)


def subset_of(group: list[dict]) -> int | None:
    """The size of the set a group of rows was drawn from; None when the group is its whole set."""
    sizes = {row.get("set_size") for row in group}
    return sizes.pop() if len(sizes) == 1 else None


def judged(group: list[dict], seed: int, population: int | None) -> dict:
    """With an LLM judge: the share its verdicts accept (EM's hits included) with its interval, over the judged
    questions, and how many it could not judge; nothing without one."""
    if not any("judge" in row for row in group):
        return {}
    verdicts = [row["judge"] for row in group if row.get("judge") is not None]
    cell = {"judge_unjudged": len(group) - len(verdicts)}
    if verdicts:
        cell["judge"] = bootstrap_interval(verdicts, seed, population=population).as_dict()
    return cell


def _mean(values) -> float | None:
    """The mean, or None when any value is unknown."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values) / len(values)


def search_r1_table(rows: list[dict], seed: int = 0) -> dict:
    """Per set and for the average over sets: EM with its interval, F1 mean and interval, search rate, mean turns,
    format-valid rate and the number of questions."""
    if not rows:
        raise ValueError("no graded questions: nothing to tabulate")
    grouped = by_source(rows)
    table = {}
    for source in ordered_sources(grouped):
        group = grouped[source]
        population = subset_of(group)
        table[source] = {
            "em": bootstrap_interval([r["em"] for r in group], seed, population=population).as_dict(),
            "f1": bootstrap_interval([r["f1"] for r in group], seed, population=population).as_dict(),
            "set_size": population or len(group),
            "search_rate": _mean(None if r["searches"] is None else r["searches"] > 0 for r in group),
            "turns": _mean(r["turns"] for r in group),
            "format_valid": _mean(r["format_valid"] for r in group),
            "n": len(group),
            **judged(group, seed, population),
        }
    sets = {source: [r["em"] for r in group] for source, group in grouped.items()}
    f1s = {source: [r["f1"] for r in group] for source, group in grouped.items()}
    populations = {source: subset_of(group) for source, group in grouped.items()}
    table[AVERAGE] = {
        "em": average_over_sets_interval(sets, seed, populations=populations).as_dict(),
        "f1": average_over_sets_interval(f1s, seed, populations=populations).as_dict(),
        "search_rate": _mean(table[s]["search_rate"] for s in grouped),
        "turns": _mean(table[s]["turns"] for s in grouped),
        "format_valid": _mean(table[s]["format_valid"] for s in grouped),
        "n": len(rows),
    }
    verdicts = {s: [r["judge"] for r in g if r.get("judge") is not None] for s, g in grouped.items()}
    if all(verdicts.values()) and any("judge" in r for r in rows):
        table[AVERAGE]["judge"] = average_over_sets_interval(verdicts, seed, populations=populations).as_dict()
        table[AVERAGE]["judge_unjudged"] = sum(table[s].get("judge_unjudged", 0) for s in grouped)
    return table


def _column_names(table: dict) -> list[tuple[str, str]]:
    titles = dict(PAPER_SETS)
    present = [s for s in table if s != AVERAGE]
    columns = [(name, title) for name, title in PAPER_SETS]  # the paper's seven, present or not
    columns += [(s, s) for s in ordered_sources(present) if s not in titles]
    return columns + [(AVERAGE, "Avg.")]


def _maybe(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _with_interval(cell: dict) -> str:
    return f"{cell['mean']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"


def table_markdown(table: dict, title: str = "") -> str:
    """The table as Markdown: one column per set (the paper's seven, '-' where a set was not evaluated) and the
    average; rows EM [95% interval], F1, search rate, turns, format valid, questions."""
    columns = _column_names(table)
    lines = [f"**{title}**", ""] if title else []
    lines += ["| | " + " | ".join(t for _, t in columns) + " |", "|---|" + "---|" * len(columns)]
    rows = (
        ("EM [95% interval]", lambda c: _with_interval(c["em"])),
        ("F1", lambda c: f"{c['f1']['mean']:.3f}"),
        ("search rate", lambda c: _maybe(c["search_rate"], ".3f")),
        ("turns", lambda c: _maybe(c["turns"], ".2f")),
        ("format valid", lambda c: f"{c['format_valid']:.3f}"),
        ("EM or judge [95% interval]", lambda c: _with_interval(c["judge"]) if "judge" in c else "-"),
        ("questions", lambda c: f"{c['n']}" if c.get("set_size", c["n"]) == c["n"] else f"{c['n']} of {c['set_size']}"),
    )
    for label, show in rows:
        if label.startswith("EM or judge") and not any("judge" in cell for cell in table.values()):
            continue  # no judge was asked
        cells = [show(table[name]) if name in table else "-" for name, _ in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_runs(a_rows: list[dict], b_rows: list[dict], seed: int = 0, metric: str = "em") -> dict:
    """Run A minus run B on the questions both graded (matched by set and key), per set and on the average over
    sets, each with its paired 95% interval and a verdict; how many questions only one run has."""
    a_keyed = {(r["source"], r["key"]): r for r in a_rows}
    b_keyed = {(r["source"], r["key"]): r for r in b_rows}
    shared = sorted(a_keyed.keys() & b_keyed.keys())
    if not shared:
        raise ValueError("the two runs share no question (same sets and the same prompts are needed)")
    per_set: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for source, key in shared:
        per_set[source][0].append(a_keyed[(source, key)][metric])
        per_set[source][1].append(b_keyed[(source, key)][metric])
    populations = {source: subset_of([a_keyed[k] for k in shared if k[0] == source]) for source in per_set}
    out = {
        source: paired_difference(*per_set[source], seed=seed, population=populations[source]).as_dict()
        for source in ordered_sources(per_set)
    }
    # The average over sets: each set's paired differences resampled on its own, as the table's average is.
    differences = {s: [x - y for x, y in zip(*per_set[s], strict=True)] for s in per_set}
    average = average_over_sets_interval(differences, seed, populations=populations)
    verdict = "A is better" if average.low > 0 else "B is better" if average.high < 0 else "within noise"
    out[AVERAGE] = {
        **average.as_dict(),
        "a": _mean(_mean(per_set[s][0]) for s in per_set),
        "b": _mean(_mean(per_set[s][1]) for s in per_set),
        "verdict": verdict,
    }
    out["unmatched"] = {"only_a": len(a_keyed) - len(shared), "only_b": len(b_keyed) - len(shared)}
    return out


def comparison_markdown(comparison: dict, metric: str = "em") -> str:
    lines = [
        f"| set | A {metric} | B {metric} | A - B [95% paired interval] | verdict | questions |",
        "|---|---|---|---|---|---|",
    ]
    titles = dict(PAPER_SETS) | {AVERAGE: "Avg."}
    for source, cell in comparison.items():
        if source == "unmatched":
            continue
        lines.append(
            f"| {titles.get(source, source)} | {cell['a']:.3f} | {cell['b']:.3f} | {cell['mean']:+.3f} "
            f"[{cell['low']:+.3f}, {cell['high']:+.3f}] | {cell['verdict']} | {cell['n']} |"
        )
    unmatched = comparison["unmatched"]
    if unmatched["only_a"] or unmatched["only_b"]:
        lines.append(f"\n{unmatched['only_a']} question(s) only in A, {unmatched['only_b']} only in B: left out.")
    return "\n".join(lines) + "\n"


def write_rows(path, rows: list[dict]) -> None:
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def read_rows(path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
