"""Web pages as text for Serper's full-page mode: visible text of an HTML page, its decoding, and the paragraphs of
the page that hold a search result's snippet."""

from __future__ import annotations

import html
from html.parser import HTMLParser


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page, one line per block, without scripts and styles."""

    SKIP = {"script", "style", "noscript", "head", "template"}
    BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_to_text(page: str) -> str:
    parser = _TextExtractor()
    parser.feed(page)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def decode_page(raw: bytes, declared: str | None) -> str:
    """Decode with the declared charset when it works, else chardet's guess, else utf-8 with replacement."""
    import chardet

    for encoding in (declared, chardet.detect(raw[:65536]).get("encoding"), "utf-8"):
        if not encoding:
            continue
        try:
            return raw.decode(encoding)
        except (LookupError, UnicodeDecodeError):
            continue
    return raw.decode("utf-8", errors="replace")


def snippet_sentences(snippet: str) -> list[str]:
    """Serper snippets join fragments with '...'; keep fragments long enough to locate in the page."""
    return [part.strip() for part in snippet.split("...") if len(part.strip().split()) > 5]


def page_context(snippet: str, page_text: str) -> str:
    """The paragraphs of the page that contain the snippet's fragments (the snippet itself if none match)."""
    paragraphs = page_text.split("\n")
    flat = [" ".join(p.split()) for p in paragraphs]
    found: list[str] = []
    for fragment in snippet_sentences(snippet):
        fragment = " ".join(fragment.split())
        for paragraph in flat:
            if fragment in paragraph and paragraph not in found:
                found.append(paragraph)
    return "\n".join(found) if found else html.unescape(snippet)
