"""Raw spellings of tokenizer pieces (bnlit/raw_spellings.py): every alias is a spelling that
bnlit's normalisation turns into its piece, and every such spelling the table names is listed."""

from __future__ import annotations

import unicodedata

import pytest

from bnlit.data.normalize import NUKTA
from bnlit.raw_spellings import (MAX_ALIASES_PER_PIECE, RAW_SPELLINGS, alias_score, canonical_ids, raw_spellings,
                                 spelling_aliases)
from bnlit.tokenizer import normalize

YYA, RRA, RHA = "\u09df", "\u09dc", "\u09dd"  # precomposed য় ড় ঢ়
E, AA, AU_MARK, O, AU = "\u09c7", "\u09be", "\u09d7", "\u09cb", "\u09cc"  # ে া ৗ ো ৌ
ALL = tuple(RAW_SPELLINGS)


def test_the_table_is_what_normalize_does():
    for normal, spellings in (kv for table in RAW_SPELLINGS.values() for kv in table.items()):
        assert normalize(normal) == normal
        for s in spellings:
            assert s != normal and normalize(s) == normal, (normal, s)
    # the nukta letters are Unicode composition exclusions: NFC decomposes them and never composes back
    for letter in (YYA, RRA, RHA):
        assert unicodedata.normalize("NFC", letter) == unicodedata.normalize("NFD", letter) != letter


def test_each_occurrence_gets_either_form():
    assert raw_spellings("\u2581হয" + NUKTA) == ["\u2581হ" + YYA]
    assert raw_spellings(O, ALL) == [E + AA]
    assert raw_spellings(AU, ALL) == [E + AU_MARK]
    # বড়ো: ড় and ো each in either form, three other spellings, each normalising to the piece
    piece = "\u2581বড" + NUKTA + O
    got = raw_spellings(piece, ALL)
    assert sorted(got) == sorted(["\u2581বড" + NUKTA + E + AA, "\u2581ব" + RRA + O, "\u2581ব" + RRA + E + AA])
    assert all(normalize(s) == piece for s in got)
    # nothing to respell: no alias; a lone nukta has no base letter to precompose with
    assert raw_spellings("\u2581নেই", ALL) == raw_spellings(NUKTA, ALL) == raw_spellings("abc", ALL) == []
    # the default kinds: the nukta letters only; no kinds: nothing
    assert raw_spellings(piece) == ["\u2581ব" + RRA + O] and raw_spellings(O) == [] == raw_spellings(piece, ())
    with pytest.raises(ValueError, match="accents"):
        raw_spellings(piece, ("accents",))


def test_a_piece_with_many_occurrences_keeps_the_uniform_spellings():
    piece = ("য" + NUKTA + O) * 3  # 6 occurrences: 63 mixed spellings
    got = raw_spellings(piece, ALL)
    assert len(got) <= MAX_ALIASES_PER_PIECE
    assert (YYA + E + AA) * 3 in got  # every occurrence in the other form
    assert all(normalize(s) == piece for s in got)


def test_vocabulary_aliases_skip_special_pieces_and_existing_texts():
    pieces = ["<unk>", "য" + NUKTA, YYA, O, "<0xE0>"]
    normal = [False, True, True, True, False]
    # YYA is already a piece (it cannot be after normalisation, but a foreign vocabulary may hold it)
    assert spelling_aliases(pieces, normal, ALL) == [(E + AA, 3)]
    assert spelling_aliases(["য" + NUKTA], [False]) == []


def test_scores_and_canonical_ids():
    assert alias_score(O, -500.0, 1.0) == 1.0  # two characters that NFC composes first: merged first
    assert alias_score("\u2581হয" + NUKTA, -42.0, 1.0) == -42.0
    assert canonical_ids([5, 100, 7, 101], {100: 9, 101: 5}) == [5, 9, 7, 5]
