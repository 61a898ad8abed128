import unicodedata

import pytest

from bnlit.data import embedded
from bnlit.errors import TokenizerError
from bnlit.data.normalize import normalize_text
from bnlit.tokenizer import (
    BANGLA_CHARS, BANGLA_DIGITS, BOS_ID, DANDA, DOUBLE_DANDA, EOS_ID, PAD_ID, Tokenizer, normalize, train_tokenizer,
    training_lines,
)

ZWJ, ZWNJ, HASANTA = "\u200d", "\u200c", "\u09cd"
# every character of the Bangla probe in a context where it belongs: consonants and vowels alone,
# marks after a consonant, the precomposed nukta letters (normalised to letter + nukta), the
# joiners where they change rendering (ক্‌ষ visible hasanta, র‍্য ya-phala after ra, ত্‍ half form)
MARKS = {c for c in BANGLA_CHARS if unicodedata.category(c) in ("Mn", "Mc")}
BANGLA_PROBE = " ".join([*(c if c not in MARKS else "ক" + c for c in BANGLA_CHARS), "\u09df", "\u09dc", "\u09dd",
                         "ক্" + ZWNJ + "ষ", "র" + ZWJ + "্যাব", "ত্" + ZWJ + "ম", "ঐতিহ্য।", "ঔষধ॥", "৳১২৩", "ঊষা ঋষি ঌ"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    docs = embedded.bangla_documents()[:10] + embedded.english_documents()[:30]
    path = train_tokenizer(docs, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=1024)
    return Tokenizer(path)


def test_special_tokens_are_declared_once(tokenizer):
    sp = tokenizer.sp
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, BOS_ID, EOS_ID)
    assert tokenizer.vocab_size == 1024


def test_nukta_danda_and_digits_are_pieces_not_bytes(tokenizer):
    for ch in ["\u09bc", "।", "০", "৯", "7", "?"]:
        pid = tokenizer.sp.piece_to_id(ch)
        assert pid != tokenizer.unk_id and not tokenizer.is_byte(pid), ch


def test_roundtrip_is_nfc_and_lossless(tokenizer):
    text = "আমি বাংলায় গান গাই। য় ড় ঢ় — 2024 সালে ১২৩টি বই। Hello, world!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    # the precomposed য় (U+09DF) and letter + nukta encode identically after NFC
    assert tokenizer.encode("\u09df") == tokenizer.encode("\u09af\u09bc")


def test_unseen_script_falls_back_to_bytes_not_unk(tokenizer):
    ids = tokenizer.encode("日本")
    assert tokenizer.unk_id not in ids
    assert all(tokenizer.is_byte(i) for i in ids if tokenizer.sp.id_to_piece(i) != "▁")


def test_training_lines_respect_sentencepiece_limit():
    long = "শব্দ " * 5000
    lines = list(training_lines([long]))
    assert len(lines) > 1 and all(len(l.encode()) <= 4000 for l in lines)
    assert " ".join(lines).split() == long.split()


def test_normalize_is_nfc():
    assert normalize("\u09df") == "\u09af\u09bc"


@pytest.mark.parametrize("vocab_size", [700, 1024])
def test_every_bangla_character_is_a_piece_even_without_bangla_training_text(vocab_size, tmp_path):
    english = embedded.english_documents()[:30]
    assert not any("\u0980" <= c <= "\u09ff" for d in english for c in d)
    tok = Tokenizer(train_tokenizer(english, tmp_path / "t.model", vocab_size=vocab_size))
    for ch in [*BANGLA_CHARS, DANDA, DOUBLE_DANDA, ZWJ, ZWNJ]:
        pid = tok.sp.piece_to_id(ch)
        assert pid != tok.unk_id and not tok.is_byte(pid), f"U+{ord(ch):04X} is not a piece"
    ids = tok.encode(BANGLA_PROBE)
    assert [tok.sp.id_to_piece(i) for i in ids if tok.is_byte(i) or i == tok.unk_id] == []
    assert tok.decode(ids) == normalize(BANGLA_PROBE)
    assert ZWNJ in tok.decode(tok.encode("ক্" + ZWNJ + "ষ"))  # the joiner that carries meaning survives


def test_every_bangla_character_is_a_piece_in_the_bangla_tokenizer(tokenizer):
    ids = tokenizer.encode(BANGLA_PROBE)
    assert sum(tokenizer.is_byte(i) for i in ids) == 0 and tokenizer.unk_id not in ids


def test_digits_are_one_token_each_in_both_scripts(tokenizer):
    pieces = lambda t: [tokenizer.sp.id_to_piece(i) for i in tokenizer.encode(t)]  # noqa: E731
    assert pieces("২০২৪ সালে") [:5] == ["▁", "২", "০", "২", "৪"]
    assert pieces("2024 and")[:5] == ["▁", "2", "0", "2", "4"]
    assert pieces("বই২০২৩")[-4:] == list("২০২৩")
    for d in BANGLA_DIGITS:
        assert tokenizer.encode(d * 3)[-3:] == [tokenizer.sp.piece_to_id(d)] * 3


def test_digits_can_merge_when_asked(tmp_path):
    docs = embedded.english_documents()[:20] + ["২০২৪ সালে ১২৩টি বই, 2024 and 123 books"] * 200
    tok = Tokenizer(train_tokenizer(docs, tmp_path / "t.model", vocab_size=700, split_digits=False))
    assert len(tok.encode("২০২৪")) < 4 and len(tok.encode("2024")) < 4


TRICKY = ("\ufeffপা\u09df়ে হঠা" + "ত্" + ZWJ + " এল, ক্" + ZWNJ + "ষ র" + ZWJ + "্যাব " + ZWJ + "বাংলা" + ZWNJ
          + " soft\u00adhyphen\u00a0x ড়\u09dc ঢ়\u09dd ২০২৪")


def test_one_normalisation_for_cleaning_training_and_encode(tokenizer):
    """The tricky string reaches SentencePiece as the same code points whichever way it comes."""
    cleaned = normalize_text(TRICKY)
    assert normalize(TRICKY) == cleaned  # a single line: cleaning adds only whitespace rules
    assert list(training_lines([TRICKY])) == [cleaned]
    assert "\u09ce" in cleaned and "\u09df" not in cleaned and "\ufeff" not in cleaned and "\u00ad" not in cleaned
    ids = tokenizer.encode(TRICKY)
    assert ids == tokenizer.sp.encode(cleaned) == tokenizer.encode(cleaned)
    assert tokenizer.encode_batch([TRICKY, cleaned]) == [ids, ids]
    assert tokenizer.decode(ids) == cleaned


def test_missing_or_foreign_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(tmp_path / "nope.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer(junk)


def test_word_lines_follow_the_frequency_list():
    lines = embedded.word_lines("bn", 200_000, seed=0)
    assert lines == embedded.word_lines("bn", 200_000, seed=0)
    text = " ".join(lines)
    assert abs(len(text) - 200_000) < 10_000
    words = text.split()
    assert all(all("\u0980" <= c <= "\u09ff" or c in "\u200c\u200d" for c in w) for w in words)
    counts = {w: words.count(w) for w in ("এবং", "করে", "বাংলাদেশ")}
    assert counts["এবং"] > counts["বাংলাদেশ"] > 0  # the commonest words come most often
    assert len(set(words)) > 5_000
    assert embedded.word_lines("bn", 0) == []
    with pytest.raises(Exception, match="word_frequencies.xx"):
        embedded.word_lines("xx", 1000)


def test_training_survives_a_redrawing_progress_bar(tmp_path, monkeypatch):
    """tqdm's update() returns True when it redraws (every 0.5 s): the lines must still be text."""
    import time

    from bnlit import progress

    def slow_docs():
        for i, doc in enumerate(embedded.english_documents()[:12]):
            if i in (1, 2):
                time.sleep(0.6)
            yield doc

    monkeypatch.setattr(progress, "ENABLED", True)  # a run before this one may have switched the bars off
    tok = Tokenizer(train_tokenizer(slow_docs(), tmp_path / "t.model", vocab_size=600))
    assert tok.vocab_size == 600
