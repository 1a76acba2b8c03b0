"""Evaluation metrics of Search-R1 rollouts: EM / sub-EM / F1 per data source, search rate and turns."""

from __future__ import annotations

from collections import defaultdict

from slime_search.search_r1.reward import em, extract_answer, f1, golden_answers_of, subem
from slime_search.types import Sample


def evaluate_samples(samples: list[Sample]) -> dict[str, float]:
    """Metrics per data source (metadata["data_source"]) and overall; failed samples count as wrong."""
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_source[str(sample.metadata.get("data_source") or "all")].append(sample)
    out: dict[str, float] = {}
    for source, group in [*sorted(by_source.items()), ("all", samples)]:
        prefix = "eval" if source == "all" else f"eval/{source}"
        scores = [_scores(s) for s in group]
        n = len(group)
        for name in ("em", "subem", "f1"):
            out[f"{prefix}/{name}"] = sum(s[name] for s in scores) / n
        out[f"{prefix}/search_rate"] = sum(s.metrics.get("searches", 0) > 0 for s in group) / n
        out[f"{prefix}/turns"] = sum(s.metrics.get("turns", 0) for s in group) / n
        out[f"{prefix}/n"] = float(n)
    return out


def _scores(sample: Sample) -> dict[str, float]:
    answer = extract_answer(sample.response) if sample.trainable else None
    if answer is None:
        return {"em": 0.0, "subem": 0.0, "f1": 0.0}
    golds = golden_answers_of(sample.label)
    return {"em": em(answer, golds), "subem": subem(answer, golds), "f1": f1(answer, golds)}
