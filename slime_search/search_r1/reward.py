"""Search-R1 answer scoring: EM / sub-EM / F1 with FlashRAG semantics, and the qa_em_format reward.

Differences from Search-R1's `qa_em_format.py`, each deliberate:
- Everything is read from the *response only*. Search-R1 (and slime's port) score prompt + response and take
  the last `<answer>` once there are at least two matches, assuming the prompt holds one. The 'base' prompt
  actually holds two ("inside <answer> and </answer>" and "<answer> Beijing </answer>"), so a response with no
  answer at all is scored as answering "Beijing". Here the last `<answer>` of the response is the answer, and
  a response without one has none.
- The format check ignores end-of-turn markers (`<|im_end|>`, `<|endoftext|>`) after the final answer; a
  response decoded with special tokens would otherwise never be well-formed.
- `structure_format_score`, `final_format_score` and `retrieval_score` are applied as configured. The paper's
  reward is pure EM, which is the default (all three 0); Search-R1 v0.3 used 0.2 / 0.1 / 0.
- An optional guard gives 0 to responses with more `<answer>` blocks than allowed, so a policy cannot spray
  answers and rely on the last one.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from slime_search.search_r1.config import PerRollout, RewardConfig

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_TAG = re.compile(r"(</?(?:think|search|information|answer)>)")
_TRAILING_END_MARKERS = re.compile(r"(?:\s*(?:<\|im_end\|>|<\|endoftext\|>))+\s*$")
_SPECIAL_F1_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """SQuAD/FlashRAG normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _as_list(golden_answers: str | list[str]) -> list[str]:
    return [golden_answers] if isinstance(golden_answers, str) else [str(g) for g in golden_answers]


def em(prediction: str, golden_answers: str | list[str]) -> float:
    """1.0 when the normalised prediction equals any normalised golden answer."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) == pred for g in _as_list(golden_answers)))


def subem(prediction: str, golden_answers: str | list[str]) -> float:
    """1.0 when any normalised golden answer is a substring of the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in _as_list(golden_answers)))


def f1(prediction: str, golden_answers: str | list[str]) -> float:
    """Best token-level F1 over golden answers; yes/no/noanswer must match exactly (FlashRAG's rule)."""
    pred = normalize_answer(prediction)
    best = 0.0
    for golden in _as_list(golden_answers):
        gold = normalize_answer(golden)
        if (pred in _SPECIAL_F1_ANSWERS or gold in _SPECIAL_F1_ANSWERS) and pred != gold:
            continue
        pred_tokens, gold_tokens = pred.split(), gold.split()
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(response: str) -> str | None:
    """The content of the last complete <answer>...</answer> in the response, stripped; None if there is none."""
    matches = _ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def count_answers(response: str) -> int:
    return len(_ANSWER.findall(response))


def information_blocks(response: str) -> list[str]:
    return [block.strip() for block in _INFORMATION.findall(response)]


def retrieval_hit(response: str, golden_answers: str | list[str]) -> bool:
    """Whether any retrieved block contains a golden answer (after normalisation)."""
    golds = [normalize_answer(g) for g in _as_list(golden_answers)]
    return any(g in normalize_answer(block) for block in information_blocks(response) for g in golds)


# The Search-R1 trajectory grammar: (think (search information)?)* think answer, whitespace between tags.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_CONTENT_STATES = frozenset({"in_think", "in_search", "in_information", "in_answer"})


@dataclass(frozen=True)
class FormatCheck:
    valid: bool
    reason: str


def check_format(response: str) -> FormatCheck:
    """Validate the response against the Search-R1 tag grammar (the state machine of qa_em_format)."""
    content = _TRAILING_END_MARKERS.sub("", response)
    for tag in ("think", "search", "information", "answer"):
        opening, closing = content.count(f"<{tag}>"), content.count(f"</{tag}>")
        if opening != closing:
            return FormatCheck(False, f"unbalanced <{tag}>: {opening} opening vs {closing} closing")
    state = "start"
    for part in _TAG.split(content):
        if not part.strip():
            continue
        if _TAG.fullmatch(part):
            next_state = _TRANSITIONS.get((state, part))
            if next_state is None:
                return FormatCheck(False, f"unexpected tag {part} in state {state}")
            state = next_state
        elif state not in _CONTENT_STATES:
            return FormatCheck(False, f"unexpected text {part.strip()[:40]!r} in state {state}")
    if state != "end":
        return FormatCheck(False, f"incomplete: ended in state {state}")
    return FormatCheck(True, "ok")


@dataclass(frozen=True)
class RewardBreakdown:
    score: float
    answer: str | None
    em: float
    subem: float
    f1: float
    format_valid: bool
    format_reason: str
    retrieval_hit: bool
    answer_spam: bool

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def qa_em_format_score(response: str, golden_answers: str | list[str], config: RewardConfig) -> RewardBreakdown:
    """Score a response as Search-R1's qa_em_format does, on the response alone.

    correct answer: score (well-formed) or score - structure_format_score (malformed)
    wrong / no answer, well-formed: structure_format_score (+ retrieval_score if a retrieved block had the answer)
    wrong answer, malformed: final_format_score; no answer, malformed: 0
    """
    golds = _as_list(golden_answers)
    answer = extract_answer(response)
    fmt = check_format(response)
    hit = fmt.valid and retrieval_hit(response, golds)
    spam = config.max_answer_tags is not None and count_answers(response) > config.max_answer_tags
    exact = em(answer, golds) if answer is not None else 0.0
    if spam:
        score = 0.0
    elif answer is not None and exact:
        score = config.score if fmt.valid else config.score - config.structure_format_score
    elif fmt.valid:
        score = config.structure_format_score + (config.retrieval_score if hit else 0.0)
    elif answer is not None:
        score = config.final_format_score
    else:
        score = 0.0
    return RewardBreakdown(
        score=score,
        answer=answer,
        em=exact,
        subem=subem(answer, golds) if answer is not None else 0.0,
        f1=f1(answer, golds) if answer is not None else 0.0,
        format_valid=fmt.valid,
        format_reason=fmt.reason,
        retrieval_hit=hit,
        answer_spam=spam,
    )


def golden_answers_of(label: Any) -> list[str]:
    """Accept the label shapes that reach the reward: a list, a string, or Search-R1's ground_truth dict."""
    if isinstance(label, dict):
        label = label.get("target", label.get("ground_truth", label))
        if isinstance(label, dict):
            label = label.get("target")
    if label is None:
        raise ValueError("sample has no label: expected golden answers (list, string or {'target': [...]})")
    if isinstance(label, str):
        return [label]
    return [str(item) for item in list(label)]


_REWARD_CONFIGS: PerRollout[RewardConfig] = PerRollout(RewardConfig.from_args)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> dict[str, Any]:
    """slime's reward plugin signature. Returns the breakdown; its "score" is the training reward."""
    config = _REWARD_CONFIGS.get(args)
    return qa_em_format_score(sample.response, golden_answers_of(sample.label), config).as_dict()
