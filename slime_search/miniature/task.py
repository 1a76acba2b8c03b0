"""A synthetic Search-R1 task: facts about fictional people and companies, and questions only the corpus answers.

Everything is drawn from a seeded generator, so the same seed gives the same corpus and questions. Names are
built from invented syllables, so no model can know the answers; they must be searched. Each passage states one
fact (a person's birthplace, a company's founder), which keeps the reading part small enough for a policy trained
from scratch on two CPU cores. Single-hop questions ask a person's birthplace or a company's founder; two-hop
questions ask where a company's founder was born, which takes two searches.
Questions about one half of the entities train; questions about the other half are held out, so a policy cannot
memorise its way to held-out answers. Names combine words from closed lists (see `make_world`): every word is
trained, every held-out name is a combination never trained on.

    python -m slime_search.miniature.task --out DIR [--seed 0 --people 160 --companies 64]

writes DIR/corpus.jsonl (wiki-18's {"id","contents"}: a quoted title line, then the text) and DIR/train.parquet,
DIR/heldout.parquet in Search-R1's parquet schema (same prompt, `reward_model.ground_truth.target`).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "kr", "st", "dr", "gl"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ou"]
CODAS = ["", "n", "r", "s", "th", "l", "x", "m"]
CITIES = ["Qarnis", "Velbrook", "Ostmere", "Durhaven", "Kelvar", "Prynn", "Salwick", "Torvale", "Umbergate",
          "Yarrow", "Brisca", "Falmor", "Glenthos", "Harrowick", "Istra", "Jorvale"]  # fmt: skip
COMPANY_KINDS = ["Works", "Foundry", "Guild", "Mills", "Traders", "Press", "Forge", "Yards", "Looms", "Bank"]


@dataclass(frozen=True)
class Person:
    name: str
    city: str


@dataclass(frozen=True)
class Company:
    name: str
    founder: Person


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    hops: int
    entity: str  # the entity searched first
    kind: str  # the attribute asked: city or founder
    bridge: str = ""  # two-hop: the founder, searched second


def invented_words(rng: random.Random, count: int, syllables: tuple[int, int]) -> list[str]:
    """`count` distinct capitalised words of invented syllables."""
    words: set[str] = set()
    while len(words) < count:
        n = rng.randint(*syllables)
        words.add("".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(n)).title())
    return sorted(words)


def make_world(seed: int, people: int, companies: int, name_words: int = 40) -> tuple[list[Person], list[Company]]:
    """People named `first last` and companies named `first kind`, each part from a closed set of words.

    Names are combinations of a few dozen words. So every word is seen in training, while every held-out entity is a
    combination never trained on. Reading a name off a question or a passage is then a skill a small policy can learn in
    minutes. A fresh word per entity would have to be copied by an induction circuit it never forms.
    """
    rng = random.Random(seed)
    words = invented_words(rng, 2 * name_words, (2, 2))
    rng.shuffle(words)
    firsts, lasts = words[:name_words], words[name_words:]
    names = [f"{first} {last}" for first in firsts for last in lasts]
    # a company is named after a first name ("Farkan Foundry"), so its words are as familiar as people's
    firm_names = [f"{first} {kind}" for first in firsts for kind in COMPANY_KINDS]
    if people > len(names) or companies > len(firm_names):
        raise ValueError(f"{name_words} name words make at most {len(names)} people and {len(firm_names)} companies")
    if companies > people:
        raise ValueError(f"{companies} companies need as many founders; there are {people} people")
    persons = [Person(name, rng.choice(CITIES)) for name in rng.sample(names, people)]
    # company i is founded by a person of the same half (i % 2) as itself: the halves share no entity
    halves = [rng.sample(persons[h::2], (companies + 1 - h) // 2) for h in (0, 1)]
    founders = [halves[i % 2][i // 2] for i in range(companies)]
    firms = [Company(name, founder) for name, founder in zip(rng.sample(firm_names, companies), founders, strict=True)]
    return persons, firms


def person_document(person: Person) -> str:
    return f'"{person.name}"\n{person.name} was born in {person.city}.'


def company_document(company: Company) -> str:
    return f'"{company.name}"\n{company.name} was founded by {company.founder.name}.'


def person_questions(person: Person) -> list[Question]:
    return [Question(f"Where was {person.name} born?", person.city, 1, person.name, "city")]


def company_questions(company: Company) -> list[Question]:
    founder = company.founder
    return [
        Question(f"Who founded {company.name}?", founder.name, 1, company.name, "founder"),
        Question(f"Where was the founder of {company.name} born?", founder.city, 2, company.name, "city", founder.name),
    ]


@dataclass(frozen=True)
class Task:
    corpus: list[dict]
    train: list[Question]
    heldout: list[Question]


def make_task(seed: int = 0, people: int = 160, companies: int = 64) -> Task:
    """Corpus and questions; entities are split in halves between training and held-out questions."""
    persons, firms = make_world(seed, people, companies)
    docs = [person_document(p) for p in persons] + [company_document(c) for c in firms]
    corpus = [{"id": str(i), "contents": text} for i, text in enumerate(docs)]
    rng = random.Random(seed + 1)
    train: list[Question] = []
    heldout: list[Question] = []
    for i, person in enumerate(persons):
        (train if i % 2 == 0 else heldout).extend(person_questions(person))
    for i, company in enumerate(firms):
        (train if i % 2 == 0 else heldout).extend(company_questions(company))
    rng.shuffle(train)
    rng.shuffle(heldout)
    return Task(corpus, train, heldout)


def question_row(question: Question, split: str, index: int, template: str = "base") -> dict:
    from slime_search.search_r1.prompt import make_row

    source = "miniature_2hop" if question.hops == 2 else "miniature_1hop"
    example = {"question": question.question, "golden_answers": [question.answer]}
    row = make_row(example, source, split, index, template)
    row["extra_info"] = {**row["extra_info"], "hops": question.hops, "kind": question.kind}
    return row


def write_task(task: Task, out: str | Path, heldout_limit: int | None = None, template: str = "base") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as handle:
        for doc in task.corpus:
            handle.write(json.dumps(doc) + "\n")
    heldout = task.heldout[:heldout_limit] if heldout_limit else task.heldout
    for name, questions in (("train", task.train), ("heldout", heldout)):
        rows = [question_row(q, name, i, template) for i, q in enumerate(questions)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{name}.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the synthetic Search-R1 task (corpus + questions)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--people", type=int, default=160)
    parser.add_argument("--companies", type=int, default=64)
    parser.add_argument("--heldout-limit", type=int, default=None, help="keep the first N held-out questions")
    parser.add_argument(
        "--prompt-template", choices=("base", "native"), default="base", help="native: for --tool-format qwen3"
    )
    args = parser.parse_args(argv)
    task = make_task(args.seed, args.people, args.companies)
    write_task(task, args.out, args.heldout_limit, args.prompt_template)
    print(f"{len(task.corpus)} passages, {len(task.train)} training and {len(task.heldout)} held-out questions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
