"""Text normalisation applied to every document before filtering, deduplication, tokenizer
training and shard building (pure functions; ``normalize_text`` is idempotent and its output is
NFC-stable, so the tokenizer's own NFC leaves it unchanged).

Rules, in order:

1. **Newlines and controls.** ``\\r\\n`` and ``\\r`` become ``\\n``; a tab becomes a space; every
   other C0/C1 control character, the BOM/ZWNBSP (U+FEFF), the soft hyphen (U+00AD), the
   zero-width space (U+200B), the bidi marks and embeddings (U+200E/F, U+202A-U+202E,
   U+2066-U+2069) and the replacement-free invisible ``Cf`` characters other than ZWJ/ZWNJ are
   removed. Unicode space separators (NBSP, U+2000-U+200A, U+3000, ...) become an ASCII space.
2. **Unicode NFC, nukta forms decomposed.** The nukta letters য় ড় ঢ় (U+09DF, U+09DC, U+09DD) are
   Unicode composition exclusions: NFC turns them into letter + nukta (য + U+09BC, ড + U+09BC,
   ঢ + U+09BC) and never back. bnlit therefore unifies them one way, to the *decomposed* form:
   both spellings of a word become the same code points, and the tokenizer's NFC agrees.
   The legacy khanda-ta spelling ত + hasanta + ZWJ (before Unicode 4.1) becomes ৎ (U+09CE) when
   it ends a word, as the Unicode standard recommends.
3. **ZWJ (U+200D) and ZWNJ (U+200C).** They change Bangla rendering only next to the hasanta
   (U+09CD): ``্ + ZWNJ`` forces a visible hasanta instead of a conjunct (ক্‌ষ vs ক্ষ), ``্ + ZWJ``
   asks for a half form, and ``র + ZWJ + ্ + য`` writes ya-phala after ra (র‍্য) instead of
   reph (র্য). A joiner is kept when it directly follows a hasanta, or sits between a Bengali
   consonant and a hasanta; ZWJ is also kept between two emoji/symbols (emoji sequences). Every
   other joiner (at word edges, between Latin letters, after vowel signs, doubled) is stray and
   removed; a run of joiners keeps only its first.
4. **Whitespace.** Runs of spaces inside a line collapse to one (leading indentation, as in code,
   is kept), spaces at line ends are stripped, three or more newlines become a paragraph break
   (two), and blank lines and spaces at the document's ends are removed.

Rules 1-3 are :func:`normalize_chars`, the one character normalisation of bnlit: the tokenizer
applies it to every text it encodes (``bnlit.tokenizer.normalize`` is this function), so text
cleaned here and text a user types reach SentencePiece as the same code points.
"""

from __future__ import annotations

import re
import unicodedata

# bump when normalize_chars changes what it returns for some text: token shards are keyed by it
NORMALIZATION_VERSION = 3
ZWNJ, ZWJ = "\u200c", "\u200d"
HASANTA = "\u09cd"
NUKTA = "\u09bc"
KHANDA_TA = "\u09ce"
NUKTA_LETTERS = {"\u09dc": "\u09a1\u09bc", "\u09dd": "\u09a2\u09bc", "\u09df": "\u09af\u09bc"}
_KEEP_CF = {ZWJ, ZWNJ}
_NEWLINES = re.compile(r"\r\n?")
_SPACES = re.compile(r"(?<=\S) {2,}")  # inside a line; leading indentation (code) is kept
_LINE_END_SPACES = re.compile(r" +$", re.MULTILINE)
_PARAGRAPHS = re.compile(r"\n{3,}")
_JOINER_RUN = re.compile("[\u200c\u200d]{2,}")
_JOINER = re.compile("[\u200c\u200d]")
_LEGACY_KHANDA_TA = re.compile("\u09a4\u09cd\u200d(?![\u0980-\u09ff])")


def _build_table() -> dict[int, str | None]:
    table: dict[int, str | None] = {}
    # the BMP, plus the planes' few format characters (musical, Egyptian, shorthand, tag characters)
    astral = [*range(0x110BD, 0x110BE), 0x110CD, *range(0x13430, 0x13440), *range(0x1BCA0, 0x1BCA4),
              *range(0x1D173, 0x1D17B), 0xE0001, *range(0xE0020, 0xE0080)]
    for cp in [*range(0x10000), *astral]:
        ch = chr(cp)
        if ch in "\n":
            continue
        cat = unicodedata.category(ch)
        if ch == "\t" or cat == "Zs" and ch != " ":
            table[cp] = " "
        elif cat == "Cc" or (cat == "Cf" and ch not in _KEEP_CF):
            table[cp] = None
        elif cat in ("Zl", "Zp"):  # U+2028/U+2029 line and paragraph separators
            table[cp] = "\n"
    table[0x0D] = "\n"  # a lone CR left after the CRLF pass
    table[0x00AD] = None  # soft hyphen (Cf, listed for the reader)
    return table


_TABLE = _build_table()
# the characters the table changes, as one regex class: most text has none, and a search in C is
# ~10x cheaper than str.translate over a 65K-entry table
def _char_class(codepoints) -> re.Pattern:
    ranges: list[list[int]] = []
    for c in sorted(codepoints):
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return re.compile("[" + "".join(re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b)))
                                    for a, b in ranges) + "]")


_TABLE_CHARS = _char_class(_TABLE)  # ranges, not single characters: sre scans those fast


def _translate(text: str) -> str:
    return _TABLE_CHARS.sub(lambda m: _TABLE[ord(m.group())] or "", text) if _TABLE_CHARS.search(text) else text


def is_bengali_consonant(ch: str) -> bool:
    # one character: "" (the text's edge) is "in" every string
    return len(ch) == 1 and ("\u0995" <= ch <= "\u09b9" or ch in "\u09ce\u09dc\u09dd\u09df\u09f0\u09f1")


def _is_symbol(ch: str) -> bool:
    return bool(ch) and (unicodedata.category(ch) in ("So", "Sk") or ch == "\ufe0f")


def _joiner_kept(prev: str, joiner: str, nxt: str) -> bool:
    if prev == HASANTA:
        return True
    if nxt == HASANTA and is_bengali_consonant(prev):
        return True
    return joiner == ZWJ and _is_symbol(prev) and _is_symbol(nxt)


def clean_joiners(text: str) -> str:
    """Keep ZWJ/ZWNJ only where they change rendering (see the module docstring)."""
    if ZWJ not in text and ZWNJ not in text:
        return text
    text = _JOINER_RUN.sub(lambda m: m.group(0)[0], text)
    n = len(text)

    def keep(m: re.Match) -> str:  # looks at the joiner's neighbours only: a book with one joiner stays fast
        i = m.start()
        prev = text[i - 1] if i > 0 else ""
        nxt = text[i + 1] if i + 1 < n else ""
        return m.group(0) if _joiner_kept(prev, m.group(0), nxt) else ""

    return _JOINER.sub(keep, text)


def unify_nukta(text: str) -> str:
    """Precomposed য় ড় ঢ় -> letter + U+09BC (what NFC produces); NFC does this too, this is
    the explicit, documented form of the choice."""
    for composed, decomposed in NUKTA_LETTERS.items():
        if composed in text:
            text = text.replace(composed, decomposed)
    return text


def clean_whitespace(text: str) -> str:
    text = _SPACES.sub(" ", text)
    text = _LINE_END_SPACES.sub("", text)
    text = _PARAGRAPHS.sub("\n\n", text)
    return text.strip("\n ").rstrip() if text.strip() else ""


def normalize_chars(text: str) -> str:
    """Rules 1-3 (controls, NFC with decomposed nukta letters, khanda-ta, joiners): the character
    normalisation every text gets before a tokenizer sees it, in data cleaning (through
    :func:`normalize_text`) and in ``bnlit.tokenizer.Tokenizer.encode`` alike. Whitespace is left
    as it is. Idempotent, and ``unicodedata.normalize("NFC", out) == out``."""
    text = _translate(_NEWLINES.sub("\n", text))
    text = unify_nukta(unicodedata.normalize("NFC", text))
    text = _LEGACY_KHANDA_TA.sub(KHANDA_TA, text)
    cleaned = clean_joiners(text)
    # removing a joiner can bring canonically reorderable marks together: NFC again then
    return unicodedata.normalize("NFC", cleaned) if cleaned != text else cleaned


def normalize_text(text: str) -> str:
    """Normalise one document: :func:`normalize_chars`, then whitespace (rule 4).

    Idempotent, and ``unicodedata.normalize("NFC", out) == out``.
    """
    return clean_whitespace(normalize_chars(text))
