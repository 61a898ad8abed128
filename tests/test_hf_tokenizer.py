"""The Hugging Face export's ``tokenizer.json`` (bnlit/hf_tokenizer.py): ``AutoTokenizer`` on raw,
un-normalised text gives exactly :meth:`Tokenizer.encode`'s ids, with no bnlit call first."""

from __future__ import annotations

import json
import unicodedata

import pytest

from bnlit import hf_tokenizer
from bnlit.data import embedded
from bnlit.errors import CheckpointError
from bnlit.export import export_hf
from bnlit.model import ModelConfig, Transformer
from bnlit.tokenizer import BANGLA_CHARS, EOS_ID, Tokenizer, normalize, train_tokenizer

transformers = pytest.importorskip("transformers")
BOOKS = 12  # the tokenizer learns from the first books; the test text comes from the others


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    docs = embedded.bangla_documents()[:BOOKS] + embedded.english_documents()[:40]
    docs += embedded.word_lines("bn", 200_000)
    path = train_tokenizer(docs, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=4096, num_threads=1)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    model = Transformer(ModelConfig(vocab_size=4096, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=64))
    return export_hf(model, tokenizer, tmp_path_factory.mktemp("export") / "hf")


def held_out_lines(n_bn: int = 400, n_en: int = 150) -> list[str]:
    """Raw lines of the embedded corpus's books and addresses that the tokenizer did not learn
    from, as their packages ship them (not cleaned)."""
    bn = [line for doc in embedded.bangla_documents()[BOOKS:] for line in doc.splitlines() if line.strip()]
    en = [line for doc in embedded.english_documents()[40:] for line in doc.splitlines() if line.strip()]
    return bn[::max(1, len(bn) // n_bn)][:n_bn] + en[::max(1, len(en) // n_en)][:n_en]


def crafted_lines() -> list[str]:
    """Every Bangla letter, sign and digit alone, in a word, with a nukta in both forms, after a
    hasanta with each joiner; then the probe texts of the export's own check."""
    out = []
    for c in BANGLA_CHARS:
        out += [c, f"ক{c}", f" {c}ক ", f"{c}\u09cd\u200cক", f"{c}\u09cd\u200dক", f"\u200d{c}\u200c"]
    for composed, decomposed in (("\u09df", "য\u09bc"), ("\u09dc", "ড\u09bc"), ("\u09dd", "ঢ\u09bc")):
        out += [composed, decomposed, f"আ{composed}না", f"আ{decomposed}না", f"{composed}{decomposed}", composed * 3]
    out += ["হঠাত\u09cd\u200d", "হঠাত\u09cd\u200d কিছু", "হঠাত\u09cd\u200dক", "\u09ce", "উৎসব"]
    out += [f"a{chr(c)}b" for c in [*range(0x00, 0x20), *range(0x7f, 0xa1), 0xad, 0x200b, 0x200e, 0x2028, 0xfeff]]
    out += [" " * n + "x" + " " * n + "y" + " " * n for n in range(4)]
    return out + hf_tokenizer.probe_texts()


def test_auto_tokenizer_gives_bnlits_ids_on_raw_text(tokenizer, exported):
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    lines = crafted_lines() + held_out_lines()
    assert len(lines) > 900
    raw_differs = sum(normalize(line) != line for line in lines)
    assert raw_differs > 150, "the text must exercise the normalisation, not only already-normal text"
    assert sum("\u09df" in line for line in lines) >= 5 and sum("\u09bc" in line for line in lines) > 10
    want = tokenizer.encode_batch(lines)
    got = [hf.encode(line) for line in lines]  # the defaults: no special tokens are added
    bad = [(line, w, g) for line, w, g in zip(lines, want, got) if w != g]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ, first {bad[0]}"
    assert hf(lines[:8])["input_ids"] == want[:8]  # the batch call too
    # decode: the same text as SentencePiece's decode of the same ids, on every line
    assert [hf.decode(ids) for ids in want] == [tokenizer.decode(ids) for ids in want]


def test_the_normalizer_is_bnlits_normalisation(tokenizer, exported):
    """The normalizer alone reproduces ``normalize`` (then SentencePiece's whitespace rules and
    escaped spaces): it is the rules, not a coincidence of the vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer

    fast = HFTokenizer.from_file(str(exported / "tokenizer.json"))
    for line in crafted_lines() + held_out_lines(100, 30):
        expected = " ".join(normalize(line).split(" ")).strip(" ")
        while "  " in expected:
            expected = expected.replace("  ", " ")
        expected = "\u2581" + expected.replace(" ", "\u2581") if expected else ""
        assert fast.normalizer.normalize_str(line) == expected, repr(line)


def test_export_files_declare_the_document_start_and_no_added_tokens(tokenizer, exported):
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf.bos_token_id == hf.eos_token_id == EOS_ID and hf.pad_token_id == tokenizer.pad_id
    text = "আমার সোনার বাংলা"
    assert hf(text)["input_ids"] == tokenizer.encode(text)
    # special tokens typed as text are matched, as in every Hugging Face tokenizer (SentencePiece
    # keeps them as text); bnlit's lm-eval tasks rely on it to open a document (README)
    assert hf.encode("</s>" + text) == [EOS_ID] + tokenizer.encode(text)
    config = json.loads((exported / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == EOS_ID
    tc = json.loads((exported / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and "tokenizer.json" in tc["bnlit_normalization"]


def test_export_refuses_a_tokenizer_it_cannot_reproduce(tokenizer, tmp_path, monkeypatch):
    """A rule the normalizer lacks (here: NFC taken out) makes the export refuse in one line and
    write nothing."""
    rules = hf_tokenizer.normalizer_rules
    monkeypatch.setattr(hf_tokenizer, "normalizer_rules", lambda: [r for r in rules() if r != "NFC"])
    model = Transformer(ModelConfig(vocab_size=4096, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=64))
    with pytest.raises(CheckpointError, match=r"tokenizer.json would tokenize \d+ of \d+ probe texts unlike bnlit") as e:
        export_hf(model, tokenizer, tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()
    assert unicodedata.normalize("NFC", "ে\u09be") != "ে\u09be"  # the probe that catches it


def test_unigram_tokenizers_are_refused(tmp_path):
    docs = embedded.english_documents()[:5] + ["বাংলা লেখা " * 50]
    uni = Tokenizer(train_tokenizer(docs, tmp_path / "u.model", vocab_size=600, model_type="unigram", num_threads=1))
    with pytest.raises(CheckpointError, match="BPE only"):
        hf_tokenizer.build(uni)


def test_parity_script_counts_equal_lines(tokenizer, exported, tmp_path, capsys):
    """scripts/tokenizer_parity.py, the benchmark behind the export docs' FLORES figures, on the
    crafted lines: every line equal."""
    from test_export import script

    text = tmp_path / "lines.txt"
    lines = [line for line in crafted_lines() if line and "\n" not in line and "\r" not in line
             and "\u2028" not in line and "\u2029" not in line and "\x85" not in line and "\x0b" not in line
             and "\x0c" not in line and "\x1c" not in line and "\x1d" not in line and "\x1e" not in line]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    n = len([line for line in text.read_text(encoding="utf-8").split("\n") if line])
    assert script("tokenizer_parity").main(["--tokenizer", str(exported / "tokenizer.model"), "--hf", str(exported),
                                            "--text", str(text), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out).values()
    assert row["hf"]["lines"] == n > 200 and row["hf"]["same_ids"] == n and row["hf"]["same_decode"] == n
