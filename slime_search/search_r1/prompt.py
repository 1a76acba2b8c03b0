"""The Search-R1 prompt template and parquet row, byte-identical to Search-R1's qa_search_*_merge.py ('base')."""

from __future__ import annotations

from typing import Any

# One string, kept exactly as Search-R1 trained on it (including "as your want").
BASE_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
# Search-R1's template with ASearcher's page-access sentence, for --page-access (an <access> action).
ACCESS_TEMPLATE = BASE_TEMPLATE.replace(
    "You can search as many times as your want. ",
    "You can search as many times as your want. "
    "You can read a whole page by <access> url </access>, with a url shown in brackets after a searched document's "
    "title, and its text will be returned between <information> and </information>. ",
)
# For --tool-format qwen3: the search tool is declared by the chat template, so the instructions only say how to
# answer (read as in Search-R1's format).
NATIVE_TEMPLATE = (
    "Answer the given question. "
    "If you find you lack some knowledge, call the search tool; it returns the top searched results. "
    "You can search as many times as you want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
TEMPLATES = {"base": BASE_TEMPLATE, "access": ACCESS_TEMPLATE, "native": NATIVE_TEMPLATE}


def normalize_question(question: str) -> str:
    """Strip whitespace and end with '?', as Search-R1's data scripts do."""
    question = question.strip()
    if not question:
        raise ValueError("empty question")
    return question if question.endswith("?") else question + "?"


def make_prompt(question: str, template: str = "base") -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; valid: {', '.join(TEMPLATES)}")
    return TEMPLATES[template].format(question=normalize_question(question))


def make_row(example: dict[str, Any], data_source: str, split: str, index: int, template: str = "base") -> dict:
    """A FlashRAG example {"id","question","golden_answers"} -> a row of Search-R1's parquet schema.

    As in Search-R1 (whose `datasets.map` keeps the input columns), the row also carries id, the normalised
    question and golden_answers.
    """
    try:
        question = normalize_question(str(example["question"]))
        golden = example["golden_answers"]
    except KeyError as err:
        raise ValueError(f"{data_source} example {example.get('id', index)!r} lacks field {err.args[0]!r}") from err
    except ValueError as err:
        raise ValueError(f"{data_source} example {example.get('id', index)!r}: {err}") from err
    if isinstance(golden, str):
        golden = [golden]
    golden = [str(answer) for answer in golden]
    return {
        "id": str(example.get("id", f"{split}_{index}")),
        "question": question,
        "golden_answers": golden,
        "data_source": data_source,
        "prompt": [{"role": "user", "content": make_prompt(question, template)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golden}},
        "extra_info": {"split": split, "index": index},
    }
