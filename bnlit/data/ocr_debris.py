"""OCR debris of scanned books: page numbers, tables and the number soup of figure pages.

The unit is the *page*: a line of a document (the embedded Bangla books hold one page per line,
:func:`bnlit.data.embedded.bangla_documents`; in web text a line is a paragraph). A *number token*
is a whitespace token made of digits (any script: ০-৯, 0-9) and number punctuation only
(``১৯৭১``, ``১২.৫``, ``(৩)``, ``১০/১২``); a token with a letter in it (``৫ই``, ``১৯৭১-এ``) is a word.

* ``max_number_share``: a page with at least ``min_numbers`` number tokens whose share of number
  tokens is above it is dropped (tables, figure and illustration pages whose OCR is digits and
  broken syllables); ``min_numbers`` keeps a short line of prose with a date
  (``১৯৭১ সালে স্বাধীনতা``). On the embedded Bangla books 3% of pages (1% of characters) are
  above 0.2 (docs/data.md "OCR debris: page numbers and tables").
* ``edge_number_digits``: the number tokens of at most this many digits at a page's start and
  end are stripped (page numbers, the numbers of running heads); a four-digit year that opens a
  page (``১৯৭১ সালে``) stays. Numbers inside a page's text always stay.

Only documents of ``languages`` are touched (default ``bn``: the OCR'd source); a language's web
text with lists numbered at the line start would lose those numbers, so leave it out there.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

NUMBER_TOKEN = re.compile(r"[\d.,:;/()\[\]%+\-–—]*\d[\d.,:;/()\[\]%+\-–—]*")  # \d: every script's digits
DIGIT = re.compile(r"\d")
TOKEN = re.compile(r"\S+")
STATS = ("pages", "dropped_pages", "dropped_chars", "stripped_tokens", "stripped_chars")


@dataclass
class OcrDebrisConfig:
    """``data.clean.ocr_debris``; ``None`` switches a rule off (``ocr_debris: null``: the step)."""

    max_number_share: float | None = 0.2
    min_numbers: int = 3
    edge_number_digits: int | None = 3
    languages: list[str] = field(default_factory=lambda: ["bn"])

    def __post_init__(self):
        from bnlit.errors import ConfigError

        s = self.max_number_share
        if s is not None and not 0 <= s < 1:
            raise ConfigError(f"data.clean.ocr_debris.max_number_share={s}: use a share in [0, 1), "
                              "or null to keep every page")
        if isinstance(self.min_numbers, bool) or not isinstance(self.min_numbers, int) or self.min_numbers < 1:
            raise ConfigError(f"data.clean.ocr_debris.min_numbers={self.min_numbers!r}: use a positive count "
                              "(a page needs that many number tokens to be dropped)")
        d = self.edge_number_digits
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ConfigError(f"data.clean.ocr_debris.edge_number_digits={d!r}: use a positive number of digits "
                              "(3 strips page numbers up to 999), or null to keep page-edge numbers")
        self.languages = [str(x) for x in self.languages]

    @classmethod
    def from_dict(cls, d: dict | None) -> "OcrDebrisConfig":
        from bnlit.errors import ConfigError

        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"data.clean.ocr_debris: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def is_number(token: str) -> bool:
    return NUMBER_TOKEN.fullmatch(token) is not None


def number_share(page: str) -> tuple[float, int]:
    """(share of the page's whitespace tokens that are number tokens, their count); (0, 0) for an
    empty page."""
    tokens = page.split()
    n = sum(map(is_number, tokens))
    return (n / len(tokens) if tokens else 0.0), n


def is_debris(page: str, cfg: OcrDebrisConfig) -> bool:
    """Whether the page goes: at least ``min_numbers`` number tokens, a share above ``max_number_share``."""
    if cfg.max_number_share is None:
        return False
    share, n = number_share(page)
    return n >= cfg.min_numbers and share > cfg.max_number_share


def _is_edge_number(token: str, max_digits: int) -> bool:
    return is_number(token) and len(DIGIT.findall(token)) <= max_digits


def strip_edge_numbers(page: str, max_digits: int) -> tuple[str, int]:
    """``page`` without the number tokens of at most ``max_digits`` digits at its start and end
    (the whitespace between the kept tokens unchanged), and how many were stripped."""
    spans = [m.span() for m in TOKEN.finditer(page)]
    i, j = 0, len(spans)
    while i < j and _is_edge_number(page[slice(*spans[i])], max_digits):
        i += 1
    while j > i and _is_edge_number(page[slice(*spans[j - 1])], max_digits):
        j -= 1
    if i == 0 and j == len(spans):
        return page, 0
    return (page[spans[i][0]:spans[j - 1][1]] if i < j else ""), len(spans) - (j - i)


def clean_ocr_debris(text: str, cfg: OcrDebrisConfig) -> tuple[str, dict[str, int]]:
    """``text`` without its debris pages and page-edge numbers, with the counts (:data:`STATS`):
    pages seen (non-blank lines), pages dropped and their characters, tokens stripped and their
    characters. A page stripped to nothing counts as stripped, not dropped."""
    stats = dict.fromkeys(STATS, 0)
    out = []
    for line in text.split("\n"):
        if not line.strip():
            out.append(line)
            continue
        stats["pages"] += 1
        if is_debris(line, cfg):
            stats["dropped_pages"] += 1
            stats["dropped_chars"] += len(line)
            continue
        if cfg.edge_number_digits is not None:
            kept, n = strip_edge_numbers(line, cfg.edge_number_digits)
            if n:
                stats["stripped_tokens"] += n
                stats["stripped_chars"] += len(line) - len(kept)
                if not kept:
                    continue
                line = kept
        out.append(line)
    if not (stats["dropped_pages"] or stats["stripped_tokens"]):
        return text, stats
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip("\n"), stats
