"""HTML to main text, with trafilatura (the extractor FineWeb chose over Common Crawl's WET text).

Owns: `ExtractHtml`, a formatter that runs on documents a reader marked as HTML
(`metadata["format"] == "html"`) and passes every other document through unchanged. Must not:
fetch anything (trafilatura is only given the bytes we read).

Follows datatrove's `Trafilatura(favour_precision=True)` step as used in examples/fineweb.py:
FineWeb §3.2 found WET text "retained too much boilerplate and menu text" and that trafilatura on
the raw HTML trained better models. Comments are excluded (as datatrove). A page with no main text
is dropped as `empty_after_extract`, counted like every other reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.step import Formatter


@dataclass
class ExtractHtml(Formatter):
    name: ClassVar[str] = "extract"
    why: ClassVar[str] = "keep a page's main text, not its menus, scripts and markup"
    requires: ClassVar[tuple[str, ...]] = ("trafilatura",)

    favour_precision: bool = True   # examples/fineweb.py: fewer boilerplate lines, some text lost
    include_tables: bool = True     # trafilatura's default

    def process(self, doc: Document) -> Document | str:
        if doc.metadata.get("format") != "html":
            return doc
        self.count("html_pages")
        return super().process(doc)

    def format(self, text: str) -> str:
        import trafilatura

        extracted = trafilatura.extract(text, favor_precision=self.favour_precision,
                                        include_comments=False, include_tables=self.include_tables)
        return extracted or ""
