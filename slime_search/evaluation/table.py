"""The Search-R1 table: EM per test set and their average, each with its 95% interval, plus F1, search rate, turns and
the share of well-formed trajectories, in the paper's column order; and the paired comparison of two runs.

The input is one graded row per question: {"source", "id", "key", "em", "f1", "format_valid", "searches", "turns"}
(`graded_row` makes one from a scored sample), so the table is the same whoever produced the grades. `id` is the
question's stable identity in its set (its data row), `key` its prompt: two questions may share a prompt (PopQA has
14 such pairs in 1,000), so runs are paired by id.

Every interval says what it is about (slime_search.evaluation.intervals): "em" is about the population of questions
the set was drawn from, the same estimand for a whole set and a subset of it; "em_set" is about this set's own EM,
exact for a whole set and narrowed by the finite-population factor for a subset.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from slime_search.evaluation.intervals import POPULATION, SET, Draws, average_interval

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
# what a header says an interval is about
ABOUT = {POPULATION: "about the population of questions", SET: "about this set's EM"}


def graded_row(
    source: str,
    key: str,
    reward: dict[str, float],
    metrics: dict,
    set_size: int | None = None,
    row_id: str | None = None,
) -> dict:
    """One question's grades: the reward's numbers (a missing one counts 0, as for a sample never rewarded) and the
    generate plugin's counts (None when unknown); `set_size` when the question is one of a subset of its set;
    `row_id` its identity in its set (None: its prompt and the prompt's occurrence stand in, see `question_ids`)."""
    return {
        "source": source,
        "id": row_id,
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


def whole_set_size(group: list[dict]) -> int:
    """How many questions the group's set holds: the size its rows name as a subset, else the group's own."""
    return subset_of(group) or len(group)


def judged(group: list[dict], seed: int) -> dict:
    """With an LLM judge: the share its verdicts accept (EM's hits included) with its interval about the population
    of questions, over the judged questions, and how many it could not judge; nothing without one."""
    if not any("judge" in row for row in group):
        return {}
    verdicts = [row["judge"] for row in group if row.get("judge") is not None]
    cell = {"judge_unjudged": len(group) - len(verdicts)}
    if verdicts:
        cell["judge"] = Draws.of(verdicts, seed, stream=group[0]["source"]).interval().as_dict()
    return cell


def _mean(values) -> float | None:
    """The mean, or None when any value is unknown."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values) / len(values)


def search_r1_table(rows: list[dict], seed: int = 0) -> dict:
    """Per set and for the average over sets: EM with its interval about the population of questions ("em") and about
    this set's EM ("em_set"). Then F1's mean and interval (population), the search rate, mean turns, the format-valid
    rate, the number of questions graded and the set's size."""
    if not rows:
        raise ValueError("no graded questions: nothing to tabulate")
    grouped = by_source(rows)
    sizes = {source: whole_set_size(group) for source, group in grouped.items()}
    # each set resampled once per metric, on a stream of its own: its intervals and the average's read the same draws
    em = {s: Draws.of([r["em"] for r in group], seed, stream=s) for s, group in grouped.items()}
    f1 = {s: Draws.of([r["f1"] for r in group], seed, stream=s) for s, group in grouped.items()}
    table = {}
    for source in ordered_sources(grouped):
        group = grouped[source]
        table[source] = {
            "em": em[source].interval().as_dict(),
            "em_set": em[source].interval(population=sizes[source]).as_dict(),
            "f1": f1[source].interval().as_dict(),
            "set_size": sizes[source],
            "search_rate": _mean(None if r["searches"] is None else r["searches"] > 0 for r in group),
            "turns": _mean(r["turns"] for r in group),
            "format_valid": _mean(r["format_valid"] for r in group),
            "n": len(group),
            **judged(group, seed),
        }
    table[AVERAGE] = {
        "em": average_interval(em).as_dict(),
        "em_set": average_interval(em, populations=sizes).as_dict(),
        "f1": average_interval(f1).as_dict(),
        "search_rate": _mean(table[s]["search_rate"] for s in grouped),
        "turns": _mean(table[s]["turns"] for s in grouped),
        "format_valid": _mean(table[s]["format_valid"] for s in grouped),
        "n": len(rows),
    }
    verdicts = {s: [r["judge"] for r in g if r.get("judge") is not None] for s, g in grouped.items()}
    if all(verdicts.values()) and any("judge" in r for r in rows):
        judge = {s: Draws.of(v, seed, stream=s) for s, v in verdicts.items()}
        table[AVERAGE]["judge"] = average_interval(judge).as_dict()
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


def _set_interval(cell: dict) -> str:
    """A set's EM about itself: exact when every question was graded, else its interval as a subset."""
    interval = cell["em_set"]
    return f"{interval['mean']:.3f} (exact)" if interval["low"] == interval["high"] else _with_interval(interval)


def _is_subset(cell: dict) -> bool:
    return cell.get("set_size", cell["n"]) != cell["n"]


def table_markdown(table: dict, title: str = "") -> str:
    """The table as Markdown: one column per set (the paper's seven, '-' where a set was not evaluated) and the
    average; rows EM [95% interval about the population of questions], EM [about this set's EM] (only where a set
    was graded in part: a whole set's is exact), F1, search rate, turns, format valid, questions."""
    columns = _column_names(table)
    lines = [f"**{title}**", ""] if title else []
    lines += ["| | " + " | ".join(t for _, t in columns) + " |", "|---|" + "---|" * len(columns)]
    rows = (
        (f"EM [95% interval {ABOUT[POPULATION]}]", lambda c: _with_interval(c["em"])),
        (f"EM [95% interval {ABOUT[SET]}]", _set_interval),
        ("F1", lambda c: f"{c['f1']['mean']:.3f}"),
        ("search rate", lambda c: _maybe(c["search_rate"], ".3f")),
        ("turns", lambda c: _maybe(c["turns"], ".2f")),
        ("format valid", lambda c: f"{c['format_valid']:.3f}"),
        ("EM or judge [95% interval]", lambda c: _with_interval(c["judge"]) if "judge" in c else "-"),
        ("questions", lambda c: f"{c['n']} of {c['set_size']}" if _is_subset(c) else f"{c['n']}"),
    )
    for label, show in rows:
        if label.startswith("EM or judge") and not any("judge" in cell for cell in table.values()):
            continue  # no judge was asked
        if ABOUT[SET] in label and not any(_is_subset(cell) for name, cell in table.items() if name != AVERAGE):
            continue  # every set graded whole: each set's own EM is exact
        cells = [show(table[name]) if name in table else "-" for name, _ in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def question_ids(rows: list[dict]) -> list[tuple[str, str]]:
    """Each row's question as (set, id). Rows without an id (grade files written before rows had one) stand for the
    k-th question with their prompt, so that a prompt two questions share still names two questions."""
    seen: Counter = Counter()
    ids = []
    for row in rows:
        if row.get("id") is not None:
            ids.append((row["source"], str(row["id"])))
        else:
            seen[(row["source"], row["key"])] += 1
            ids.append((row["source"], f"{row['key']}#{seen[(row['source'], row['key'])]}"))
    return ids


def _by_question(rows: list[dict]) -> tuple[dict[tuple[str, str], dict], int]:
    """The rows by question, and how many rows were left out because another row of the run has the same id (which
    of them to pair would be a guess)."""
    ids = question_ids(rows)
    counts = Counter(ids)
    unique = {i: row for i, row in zip(ids, rows, strict=True) if counts[i] == 1}
    return unique, len(rows) - len(unique)


def compare_runs(a_rows: list[dict], b_rows: list[dict], seed: int = 0, metric: str = "em") -> dict:
    """Run A minus run B on the questions both graded (paired by set and question id), per set and on the average over
    sets. Each comes with its paired 95% interval about the population of questions and a verdict. "set" is the interval
    about the difference on this set itself; every question left unpaired is counted, by why."""
    a_keyed, a_repeated = _by_question(a_rows)
    b_keyed, b_repeated = _by_question(b_rows)
    shared = [question for question in a_keyed if question in b_keyed]
    if not shared:
        raise ValueError("the two runs share no question (the same sets and the same question ids are needed)")
    per_set: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for question in shared:
        per_set[question[0]][0].append(a_keyed[question][metric])
        per_set[question[0]][1].append(b_keyed[question][metric])
    a_sets, b_sets = by_source(a_rows), by_source(b_rows)
    sizes = {s: max(whole_set_size(a_sets[s]), whole_set_size(b_sets[s])) for s in per_set}
    # each set's paired differences resampled once: the set's two intervals and the average's read the same draws
    draws = {s: Draws.of([x - y for x, y in zip(*per_set[s], strict=True)], seed, stream=s) for s in per_set}
    out = {}
    for source in ordered_sources(per_set):
        out[source] = {
            **_difference_cell(draws[source].interval()),
            "a": _mean(per_set[source][0]),
            "b": _mean(per_set[source][1]),
            "set_size": sizes[source],
            "set": _difference_cell(draws[source].interval(population=sizes[source]), brief=True),
        }
    # The average over sets: each set's paired differences resampled on its own, as the table's average is.
    out[AVERAGE] = {
        **_difference_cell(average_interval(draws)),
        "a": _mean(_mean(per_set[s][0]) for s in per_set),
        "b": _mean(_mean(per_set[s][1]) for s in per_set),
        "set_size": sum(sizes.values()),
        "set": _difference_cell(average_interval(draws, populations=sizes), brief=True),
    }
    out["unmatched"] = {
        "only_a": len(a_keyed) - len(shared),
        "only_b": len(b_keyed) - len(shared),
        "repeated_id_a": a_repeated,
        "repeated_id_b": b_repeated,
    }
    # paired by id, but asked with different prompts: fine for comparing prompts, a warning sign otherwise
    out["prompt_differs"] = sum(a_keyed[q].get("key") != b_keyed[q].get("key") for q in shared)
    return out


def _difference_cell(interval, brief: bool = False) -> dict:
    verdict = "A is better" if interval.low > 0 else "B is better" if interval.high < 0 else "within noise"
    cell = {**interval.as_dict(), "verdict": verdict}
    return {key: cell[key] for key in ("low", "high", "about", "verdict")} if brief else cell


NOT_SETS = ("unmatched", "prompt_differs")  # the comparison's entries that are not a set's


def comparison_markdown(comparison: dict, metric: str = "em") -> str:
    """The comparison as Markdown: A - B with its paired interval about the population of questions and its verdict;
    where a set was graded in part, also about the whole set's difference; then every question left unpaired."""
    cells = {source: cell for source, cell in comparison.items() if source not in NOT_SETS}
    partly = any(cell["n"] != cell["set_size"] for source, cell in cells.items() if source != AVERAGE)
    header = f"| set | A {metric} | B {metric} | A - B [95% paired interval {ABOUT[POPULATION]}] | verdict |"
    header += f" A - B [95% paired interval about this set's {metric}] |" if partly else ""
    lines = [header + " questions |", "|---|---|---|---|---|" + ("---|" if partly else "") + "---|"]
    titles = dict(PAPER_SETS) | {AVERAGE: "Avg."}
    for source, cell in cells.items():
        line = (
            f"| {titles.get(source, source)} | {cell['a']:.3f} | {cell['b']:.3f} | {cell['mean']:+.3f} "
            f"[{cell['low']:+.3f}, {cell['high']:+.3f}] | {cell['verdict']} |"
        )
        if partly:
            on_set = cell["set"]
            line += f" [{on_set['low']:+.3f}, {on_set['high']:+.3f}] {on_set['verdict']} |"
        questions = f"{cell['n']}" if cell["n"] == cell["set_size"] else f"{cell['n']} of {cell['set_size']}"
        lines.append(f"{line} {questions} |")
    lines += unpaired_lines(comparison["unmatched"], comparison["prompt_differs"])
    return "\n".join(lines) + "\n"


def unpaired_lines(unmatched: dict, prompt_differs: int) -> list[str]:
    """What the comparison left out, and why; nothing when every question was paired."""
    lines = []
    if unmatched["only_a"] or unmatched["only_b"]:
        lines.append(f"{unmatched['only_a']} question(s) only in A, {unmatched['only_b']} only in B: left out.")
    if unmatched["repeated_id_a"] or unmatched["repeated_id_b"]:
        lines.append(
            f"{unmatched['repeated_id_a']} row(s) of A and {unmatched['repeated_id_b']} of B share their question id "
            "with another row of the same run: left out (which to pair would be a guess)."
        )
    if prompt_differs:
        lines.append(f"{prompt_differs} paired question(s) were asked with different prompts in A and B.")
    return ["", *lines] if lines else []


def write_rows(path, rows: list[dict]) -> None:
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def read_rows(path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
