"""Every relative link of the README and the docs/ pages leads to a file or folder of the checkout."""

import re

from tests.conftest import REPO_ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages():
    return [
        REPO_ROOT / "README.md",
        *sorted((REPO_ROOT / "docs").rglob("*.md")),
        *sorted(REPO_ROOT.glob("examples/**/*.md")),
    ]


def broken_links(page, root=REPO_ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor of the page itself
        path = target.split("#")[0]
        if path and not (page.parent / path).exists():
            broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def test_every_relative_link_of_the_docs_resolves():
    assert len(pages()) > 20
    assert [link for page in pages() for link in broken_links(page)] == []


def test_a_link_to_a_missing_file_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[a](there.md) [b](missing.md#x) [c](https://example.org) [d](#top)")
    assert broken_links(page, tmp_path) == ["page.md: missing.md#x"]
