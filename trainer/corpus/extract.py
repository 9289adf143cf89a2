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

import multiprocessing
from dataclasses import dataclass
from typing import Any, ClassVar

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.step import Formatter


class ExtractFailed(Exception):
    """trafilatura raised in the extracting process (the message says what), or that process
    died: counted as `extract_error`."""


def _extract(text: str, options: dict[str, Any]) -> str:
    import trafilatura

    return trafilatura.extract(text, include_comments=False, **options) or ""


def _serve(conn, parents_end) -> None:
    """The extracting process: a page in, its text (or what went wrong) out, until the pipe
    closes, the parent kills it or the parent dies (Linux: PR_SET_PDEATHSIG)."""
    parents_end.close()      # else the pipe never closes while this process lives
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the parent's kill or the pipe ends it
        pass
    while True:
        try:
            text, options = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _extract(text, options)))
        except Exception as err:  # noqa: BLE001 -- the parent counts it; the process goes on
            conn.send(("error", f"{type(err).__name__}: {err}"[:500]))


@dataclass
class ExtractHtml(Formatter):
    """Pages are extracted in a child process, killed when a page outlasts the step's time
    limit. libxml2's HTML parser, which trafilatura calls several times a page, is quadratic in
    one tag's attributes (30,000: 1.3 s a parse, 7.3 s in trafilatura; the 8 MiB record cap
    holds 750,000) and a C call cannot be stopped by the limit's signal, only once it returns;
    a process can. The child is forked from this one (trafilatura already imported, a few ms),
    one at a time, and replaced after a page it did not answer."""

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
        options = {"favor_precision": self.favour_precision,
                   "include_tables": self.include_tables}
        conn = self._child()
        # Busy until the answer is read: a page the limit interrupts leaves its child working,
        # and whatever the child says next belongs to that page, so the next page kills it.
        self._busy = True
        try:
            conn.send((text, options))
            status, value = conn.recv()
        except (EOFError, OSError) as err:
            self._stop()
            raise ExtractFailed(f"the extracting process died ({type(err).__name__})") from None
        except BaseException:
            # The limit: the page's child stops now (one syscall), not at the next page.
            self._proc.kill()
            raise
        self._busy = False
        if status != "ok":
            raise ExtractFailed(value)
        return value

    def _child(self):
        """The pipe to a live, idle child, forked now if there is none."""
        proc = getattr(self, "_proc", None)
        if proc is not None and (getattr(self, "_busy", False) or not proc.is_alive()):
            self._stop()
        if getattr(self, "_proc", None) is None:
            import trafilatura  # noqa: F401 -- imported before the fork, not in each child

            ours, theirs = multiprocessing.Pipe()
            proc = multiprocessing.get_context("fork").Process(
                target=_serve, args=(theirs, ours), name="crucible-extract", daemon=True)
            proc.start()
            theirs.close()
            self._proc, self._conn, self._busy = proc, ours, False
        return self._conn

    def _stop(self) -> None:
        proc, conn = getattr(self, "_proc", None), getattr(self, "_conn", None)
        self._proc = self._conn = None
        self._busy = False
        if proc is not None:
            proc.kill()
            proc.join()
        if conn is not None:
            conn.close()

    def __getstate__(self):
        """Pickled (a Ray task's steps): the settings, not the child."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_proc", "_conn", "_busy")}

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001 -- at interpreter exit the modules may be gone
            pass
