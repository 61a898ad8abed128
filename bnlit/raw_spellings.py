"""Raw spellings of a tokenizer piece: the other ways people type the text that bnlit's
normalisation turns into that piece, so that a tool which tokenizes raw text with no normaliser
(llama.cpp, ollama) still finds the piece the model learned.

bnlit's :func:`bnlit.tokenizer.normalize` maps several spellings to one (NFC with the nukta
letters decomposed): precomposed য় ড় ঢ় (U+09DF, U+09DC, U+09DD, what most keyboards and FLORES-200
type) become letter + nukta (U+09BC), and a vowel sign typed in two halves (ে + া, ে + ৗ) becomes
ো or ৌ. The tokenizer's pieces hold the normalised form only. llama.cpp's SentencePiece tokenizer
applies no normalisation and maps each piece's text to one id, so raw text in the other spelling
fell back to byte tokens the model never learned (+12.9% bits/char on raw FLORES Bangla,
docs/export.md "Raw text in llama.cpp").

:func:`spelling_aliases` lists, for a vocabulary, every piece's other spellings (:data:`RAW_SPELLINGS`,
each occurrence in either form). The GGUF export (``bnlit.export.export_gguf``) appends them to the
vocabulary as extra tokens whose embedding rows are copies of the piece's: llama.cpp then reads
either spelling as the same vector. Their output rows put their logits a fixed offset below the
piece's (:mod:`bnlit.alias_logits`). Their ids are new (llama.cpp gives one id per
text), so :func:`canonical_ids` maps them back for comparisons. A spelling alias of a
one-character piece (ো typed ে + া) has to be merged from two characters before anything else,
as NFC composes them first: its score is above every piece's. Other aliases keep the piece's
score, so llama.cpp's merges follow bnlit's.

What aliases cannot do: a character bnlit's normalisation *removes* (a stray joiner, a control
character, a zero-width space) or *collapses* (a run of spaces, an edge space) still reaches
llama.cpp as a token of its own (docs/export.md lists these by count on FLORES-200).
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Sequence

from bnlit.data.normalize import NUKTA, clean_joiners, normalize_chars

# kind -> {normalised text: the other spellings of it that normalize_chars maps to it}
RAW_SPELLINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "nukta": {
        "\u09af" + NUKTA: ("\u09df",),  # য়: precomposed YYA
        "\u09a1" + NUKTA: ("\u09dc",),  # ড়: precomposed RRA
        "\u09a2" + NUKTA: ("\u09dd",),  # ঢ়: precomposed RHA
    },
    "vowel_signs": {
        "\u09cb": ("\u09c7\u09be",),  # ো as ে + া
        "\u09cc": ("\u09c7\u09d7",),  # ৌ as ে + ৗ (au length mark)
    },
}
# the kinds a GGUF export adds unless told otherwise: two-part vowel signs are rare in raw text (4
# of 997 FLORES-200 dev Bangla lines) but ো is in 351 pieces, whose doubled output mass costs more
# than the lines gain (docs/export.md "Raw text in llama.cpp")
DEFAULT_KINDS = ("nukta",)
# a piece with k spelled occurrences has 2^k - 1 aliases; past this many only the spellings that
# use one form throughout (what a typist or a keyboard layout produces) are kept
MAX_ALIASES_PER_PIECE = 15


def _table(kinds: Sequence[str]) -> dict[str, tuple[str, ...]]:
    unknown = sorted(set(kinds) - set(RAW_SPELLINGS))
    if unknown:
        raise ValueError(f"raw spellings {unknown}: use any of {sorted(RAW_SPELLINGS)}")
    return {k: v for kind in kinds for k, v in RAW_SPELLINGS[kind].items()}


def raw_spellings(piece: str, kinds: Sequence[str] = DEFAULT_KINDS) -> list[str]:
    """The other spellings of ``piece`` that :func:`normalize_chars` turns into it, of the
    ``kinds`` of :data:`RAW_SPELLINGS` (``piece`` itself excluded; empty when it has none)."""
    table = _table(kinds)
    if not table:
        return []
    keys = re.compile("|".join(re.escape(k) for k in sorted(table, key=len, reverse=True)))
    parts = keys.split(piece)
    found = keys.findall(piece)
    if not found:
        return []
    choices = [(k, *table[k]) for k in found]
    combos = list(itertools.product(*choices))
    if len(combos) - 1 > MAX_ALIASES_PER_PIECE:
        n = max(len(c) for c in choices)
        combos = [tuple(c[min(i, len(c) - 1)] for c in choices) for i in range(n)]
    out = []
    for combo in combos:
        text = "".join(p + s for p, s in zip(parts, (*combo, "")))
        if text != piece and normalize_chars(text) == piece and text not in out:
            out.append(text)
    return out


def spelling_aliases(pieces: Sequence[str], normal: Sequence[bool],
                     kinds: Sequence[str] = DEFAULT_KINDS) -> list[tuple[str, int]]:
    """``(alias text, id of the piece it spells)`` for every normal piece of a vocabulary, in id
    order. An alias that is already a piece of the vocabulary is left out."""
    _table(kinds)  # an unknown kind is refused even for a vocabulary without such pieces
    taken = set(pieces)
    out = []
    for i, (piece, ok) in enumerate(zip(pieces, normal)):
        if not ok:
            continue
        for alias in raw_spellings(piece, kinds):
            if alias not in taken:
                taken.add(alias)
                out.append((alias, i))
    return out


def alias_score(piece: str, piece_score: float, top_score: float) -> float:
    """The alias's SentencePiece score: above every piece (``top_score``) for a one-character
    piece, whose other spelling is two characters merged first (as NFC composes them), else the
    piece's own."""
    return top_score if len(piece) == 1 else piece_score


def canonical_ids(ids: Sequence[int], alias_of: dict[int, int]) -> list[int]:
    """``ids`` with every alias id replaced by the id of the piece it spells."""
    return [alias_of.get(i, i) for i in ids]


_LEGACY_KHANDA_TA = re.compile("\u09a4\u09cd\u200d(?![\u0980-\u09ff])")


def raw_differences(line: str) -> list[str]:
    """The kinds of difference between a raw line and what bnlit's tokenizer reads
    (:func:`normalize_chars` and SentencePiece's whitespace rule), for counting them on a corpus
    (``scripts/tokenizer_parity.py``). The first two are what the raw-spelling kinds cover."""
    kinds = []
    if any(c in line for c in "\u09dc\u09dd\u09df"):
        kinds.append("precomposed nukta letter (nukta)")
    if "\u09c7\u09be" in line or "\u09c7\u09d7" in line:
        kinds.append("vowel sign typed in two parts (vowel_signs)")
    respelled = line.replace("\u09c7\u09be", "\u09cb").replace("\u09c7\u09d7", "\u09cc")
    for composed, (precomposed,) in RAW_SPELLINGS["nukta"].items():
        respelled = respelled.replace(precomposed, composed)
    if unicodedata.normalize("NFC", respelled) != respelled:
        kinds.append("other canonical (NFC) respelling")
    if _LEGACY_KHANDA_TA.search(line):
        kinds.append("legacy khanda-ta")
    if clean_joiners(line) != line:
        kinds.append("stray joiner")
    for c in sorted(set(line)):
        cat = unicodedata.category(c)
        if cat == "Cc" or (cat == "Cf" and c not in "\u200c\u200d"):
            kinds.append(f"control or invisible character U+{ord(c):04X}")
        elif cat in ("Zs", "Zl", "Zp") and c != " ":
            kinds.append(f"space or line separator U+{ord(c):04X}")
    if "  " in line or line != line.strip(" "):
        kinds.append("run of spaces or edge space")
    return kinds
