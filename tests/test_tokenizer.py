import unicodedata

import pytest

from bnlit.data import embedded
from bnlit.errors import TokenizerError
from bnlit.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, normalize, train_tokenizer, training_lines


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


def test_missing_or_foreign_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(tmp_path / "nope.model")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        Tokenizer(junk)
