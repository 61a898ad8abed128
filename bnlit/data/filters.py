"""Document quality filters (pure functions over normalised text).

Each filter returns ``None`` to keep a document or a short reason to drop it; ``apply_filters``
runs them in a fixed order and the first reason wins, so every dropped document is counted once,
under one reason, in :class:`FilterStats`.

* ``length``: fewer than ``min_chars`` characters or ``min_words`` words, or more than
  ``max_chars`` characters.
* ``script``: the share of letters (Unicode ``L*`` and ``M*``) written in the language's script is
  below ``min_script_ratio`` (Bengali block U+0980-U+09FF for ``bn``, Latin for ``en``; other
  languages are not checked).
* ``repetition``: the heuristics of Gopher (Rae et al. 2021, table A1), also used by RefinedWeb:
  the fraction of duplicated lines (by count and by characters), the character share of the most
  frequent word 2/3/4-gram, and the character share of duplicated word 5..10-grams.
* ``symbols``: OCR noise. The share of non-space characters that are symbols or punctuation
  outside the common set (``COMMON_PUNCT``: ASCII punctuation, danda, quotes, dashes), U+FFFD,
  private-use or unassigned code points, is above ``max_symbol_ratio``.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

# Gopher table A1 thresholds
TOP_NGRAM_MAX = {2: 0.20, 3: 0.18, 4: 0.16}
DUP_NGRAM_MAX = {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
COMMON_PUNCT = set(".,;:!?'\"()[]{}-–—…/%&*#@_+=<>|\\`~$^।॥‘’“”«»·•") | {"\u2010", "\u2011", "\u2012"}
SCRIPTS = {
    "bn": lambda ch: "\u0980" <= ch <= "\u09ff",
    "en": lambda ch: ch.isascii() or "\u00c0" <= ch <= "\u024f" or "\u1e00" <= ch <= "\u1eff",
}
REASONS = ("length", "script", "repetition", "symbols")


@dataclass
class FilterConfig:
    """Thresholds; ``None`` switches a check off."""

    min_chars: int | None = 200
    max_chars: int | None = None
    min_words: int | None = 20
    min_script_ratio: float | None = 0.5
    max_dup_line_frac: float | None = 0.30
    max_dup_line_char_frac: float | None = 0.20
    repetition_ngrams: bool = True
    max_symbol_ratio: float | None = 0.10

    @classmethod
    def from_dict(cls, d: dict | None) -> "FilterConfig":
        from bnlit.errors import ConfigError

        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"data.clean.filters: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FilterStats:
    """Documents and characters dropped per reason (``docs``/``chars``) and per detail
    (``details``: e.g. ``repetition:top_2gram``)."""

    docs: Counter = field(default_factory=Counter)
    chars: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)

    def add(self, reason: str, n_chars: int) -> None:
        kind = reason.split(":", 1)[0]
        self.docs[kind] += 1
        self.chars[kind] += n_chars
        self.details[reason] += 1

    def merge(self, other: "FilterStats") -> None:
        self.docs.update(other.docs)
        self.chars.update(other.chars)
        self.details.update(other.details)

    def to_dict(self) -> dict:
        return {"docs": dict(self.docs), "chars": dict(self.chars), "details": dict(self.details)}


def words(text: str) -> list[str]:
    return text.split()


def length_filter(text: str, cfg: FilterConfig, n_words: int) -> str | None:
    if cfg.min_chars is not None and len(text) < cfg.min_chars:
        return "length:min_chars"
    if cfg.max_chars is not None and len(text) > cfg.max_chars:
        return "length:max_chars"
    if cfg.min_words is not None and n_words < cfg.min_words:
        return "length:min_words"
    return None


def script_ratio(text: str, language: str) -> float | None:
    """Share of letters (``L*``/``M*``) in the script of ``language``; None if unknown or no
    letters."""
    in_script = SCRIPTS.get(language)
    if in_script is None:
        return None
    letters = hits = 0
    for ch, k in Counter(text).items():  # per distinct character: a document has a few hundred
        if ch.isalpha() or unicodedata.category(ch)[0] == "M":
            letters += k
            hits += k * in_script(ch)
    return hits / letters if letters else None


def script_filter(text: str, language: str, cfg: FilterConfig) -> str | None:
    if cfg.min_script_ratio is None:
        return None
    ratio = script_ratio(text, language)
    if ratio is None:
        return "script:no_letters" if language in SCRIPTS else None
    return "script:ratio" if ratio < cfg.min_script_ratio else None


def line_duplication(text: str) -> tuple[float, float]:
    """(fraction of non-empty lines that repeat an earlier line, their share of characters)."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if not lines:
        return 0.0, 0.0
    seen: set[str] = set()
    dup = dup_chars = total_chars = 0
    for ln in lines:
        total_chars += len(ln)
        if ln in seen:
            dup += 1
            dup_chars += len(ln)
        else:
            seen.add(ln)
    return dup / len(lines), dup_chars / total_chars


class _Words:
    """Word ids and lengths of a document, for vectorised n-gram statistics."""

    def __init__(self, ws: list[str]):
        index: dict[str, int] = {}
        self.ids = np.fromiter((index.setdefault(w, len(index)) for w in ws), dtype=np.uint64, count=len(ws))
        self.lens = np.fromiter((len(w) for w in ws), dtype=np.int64, count=len(ws))
        self.total = int(self.lens.sum())

    def grams(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(inverse index of each n-gram start into the distinct n-grams, their counts)."""
        m = self.ids.size - n + 1
        h = np.zeros(m, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(n):  # polynomial hash of the word ids; 64-bit collisions are negligible
                h = h * np.uint64(0x100000001B3) + self.ids[j:j + m] + np.uint64(1)
        _, inv, counts = np.unique(h, return_inverse=True, return_counts=True)
        return inv, counts


def _top_frac(w: _Words, n: int) -> float:
    if w.ids.size < n or w.total == 0:
        return 0.0
    inv, counts = w.grams(n)
    best = int(np.argmax(counts))
    if counts[best] < 2:
        return 0.0
    start = int(np.flatnonzero(inv == best)[0])
    return float(w.lens[start:start + n].sum()) * int(counts[best]) / w.total


def _dup_frac(w: _Words, n: int) -> float:
    if w.ids.size < n or w.total == 0:
        return 0.0
    inv, counts = w.grams(n)
    starts = np.flatnonzero(counts[inv] > 1)
    if starts.size == 0:
        return 0.0
    edge = np.zeros(w.ids.size + 1, dtype=np.int64)
    np.add.at(edge, starts, 1)
    np.add.at(edge, starts + n, -1)
    covered = np.cumsum(edge[:-1]) > 0
    return float(w.lens[covered].sum()) / w.total


def top_ngram_char_frac(ws: list[str], n: int) -> float:
    """Characters covered by the most frequent word n-gram (counting each occurrence's words),
    over all word characters (Gopher)."""
    return _top_frac(_Words(ws), n)


def dup_ngram_char_frac(ws: list[str], n: int) -> float:
    """Characters of words inside any word n-gram that occurs more than once, over all word
    characters (Gopher; overlapping occurrences count their words once)."""
    return _dup_frac(_Words(ws), n)


def repetition_filter(text: str, ws: list[str], cfg: FilterConfig) -> str | None:
    if cfg.max_dup_line_frac is not None or cfg.max_dup_line_char_frac is not None:
        frac, char_frac = line_duplication(text)
        if cfg.max_dup_line_frac is not None and frac > cfg.max_dup_line_frac:
            return "repetition:dup_lines"
        if cfg.max_dup_line_char_frac is not None and char_frac > cfg.max_dup_line_char_frac:
            return "repetition:dup_line_chars"
    if cfg.repetition_ngrams:
        w = _Words(ws)
        for n, limit in TOP_NGRAM_MAX.items():
            if _top_frac(w, n) > limit:
                return f"repetition:top_{n}gram"
        for n, limit in DUP_NGRAM_MAX.items():
            if _dup_frac(w, n) > limit:
                return f"repetition:dup_{n}gram"
    return None


def symbol_ratio(text: str) -> float:
    """Share of non-space characters that look like OCR noise (see the module docstring)."""
    n = noise = 0
    for ch, k in Counter(text).items():
        if ch.isspace():
            continue
        n += k
        if ch.isalnum() or ch in COMMON_PUNCT:
            continue
        cat = unicodedata.category(ch)
        if cat[0] == "M" or cat == "Nd":
            continue
        if cat[0] in "SP" or cat in ("Co", "Cn", "Cs"):  # U+FFFD is a symbol (So)
            noise += k
    return noise / n if n else 0.0


def symbol_filter(text: str, cfg: FilterConfig) -> str | None:
    if cfg.max_symbol_ratio is None:
        return None
    return "symbols:ratio" if symbol_ratio(text) > cfg.max_symbol_ratio else None


def filter_reason(text: str, language: str, cfg: FilterConfig) -> str | None:
    """The first reason to drop ``text`` (``<filter>:<detail>``), or None to keep it."""
    ws = words(text)
    return (length_filter(text, cfg, len(ws)) or script_filter(text, language, cfg)
            or repetition_filter(text, ws, cfg) or symbol_filter(text, cfg))


def apply_filters(texts, language: str, cfg: FilterConfig, stats: FilterStats | None = None):
    """Yield the texts that pass every filter, counting the others in ``stats``."""
    for text in texts:
        reason = filter_reason(text, language, cfg)
        if reason is None:
            yield text
        elif stats is not None:
            stats.add(reason, len(text))
