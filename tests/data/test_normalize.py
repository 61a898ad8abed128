import unicodedata

import pytest

from bnlit.data.normalize import HASANTA, NUKTA, ZWJ, ZWNJ, normalize_text
from bnlit.tokenizer import normalize as tokenizer_nfc

YA, DDA, DDHA = "\u09af", "\u09a1", "\u09a2"
RA, KA, SSA, TA = "\u09b0", "\u0995", "\u09b7", "\u09a4"


@pytest.mark.parametrize("composed, decomposed", [("\u09df", YA + NUKTA), ("\u09dc", DDA + NUKTA), ("\u09dd", DDHA + NUKTA)])
def test_nukta_letters_unify_to_the_decomposed_nfc_form(composed, decomposed):
    word_a = "পা" + composed + "ে"
    word_b = "পা" + decomposed + "ে"
    assert normalize_text(word_a) == normalize_text(word_b) == "পা" + decomposed + "ে"
    assert composed not in normalize_text(word_a)
    assert tokenizer_nfc(normalize_text(word_a)) == normalize_text(word_a)  # the tokenizer's NFC agrees


def test_zwnj_after_hasanta_is_kept_and_changes_the_text():
    explicit = KA + HASANTA + ZWNJ + SSA  # ক্‌ষ: visible hasanta, no conjunct
    assert normalize_text(explicit) == explicit
    assert normalize_text(explicit) != normalize_text(KA + HASANTA + SSA)


def test_zwj_for_ya_phala_after_ra_is_kept():
    ya_phala = RA + ZWJ + HASANTA + YA  # র‍্য, not reph + ya
    assert normalize_text("আ" + ya_phala) == "আ" + ya_phala


def test_stray_joiners_are_removed():
    assert normalize_text(ZWJ + "বাংলা" + ZWNJ + " text" + ZWJ + "word") == "বাংলা textword"
    assert normalize_text("কা" + ZWJ + "ল") == "কাল"  # after a vowel sign: no rendering effect
    assert normalize_text(KA + HASANTA + ZWNJ + ZWNJ + ZWJ + SSA) == KA + HASANTA + ZWNJ + SSA  # a run keeps its first
    # at the text's start nothing precedes the joiner: stray even before a hasanta (the edge is not a consonant)
    assert normalize_text(ZWJ + HASANTA + ZWNJ) == HASANTA + ZWNJ


def test_emoji_zwj_sequence_survives():
    family = "\U0001F468" + ZWJ + "\U0001F469" + ZWJ + "\U0001F467"
    assert normalize_text("hi " + family) == "hi " + family


def test_legacy_khanda_ta_becomes_u09ce_only_at_word_end():
    assert normalize_text("হঠা" + TA + HASANTA + ZWJ + " এল") == "হঠা\u09ce এল"
    half = TA + HASANTA + ZWJ + "ম"
    assert normalize_text(half) == half  # inside a word the ZWJ asks for a half form: kept


def test_mixed_script_whitespace_and_controls():
    raw = "  বাংলা\u00a0and\tEnglish \u200bmixed\x00\x07 ১২৩ 123\r\n\r\n\r\n\r\nনতুন  অনুচ্ছেদ   \ufeff\n"
    assert normalize_text(raw) == "বাংলা and English mixed ১২৩ 123\n\nনতুন অনুচ্ছেদ"


def test_code_indentation_is_kept_and_output_is_idempotent_and_nfc_stable():
    code = "def f():\n    return  1   \n"
    assert normalize_text(code) == "def f():\n    return 1"
    samples = ["\u09df\u09be\u200d", "ে" + "া", "a\u0301", RA + ZWJ + HASANTA + YA, " x\u2028y "]
    for s in samples:
        out = normalize_text(s)
        assert normalize_text(out) == out
        assert unicodedata.normalize("NFC", out) == out
    assert normalize_text("ে" + "া") == "\u09cb"  # e-kar + aa-kar compose canonically to o-kar
