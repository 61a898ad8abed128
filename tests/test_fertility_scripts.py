"""scripts/train_tokenizer.py and scripts/fertility.py, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bnlit.checks import fertility
from bnlit.data import embedded
from bnlit.tokenizer import Tokenizer

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run(script: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("corpus")
    (d / "bn.txt").write_text("\n".join(embedded.bangla_documents()[:60]), encoding="utf-8")
    (d / "en.txt").write_text("\n".join(embedded.english_documents()), encoding="utf-8")
    return {"bn": d / "bn.txt", "en": d / "en.txt"}


@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("parallel")
    (d / "bn").write_text("আমি বাংলায় গান গাই।\nতুমি কেমন আছ?\n", encoding="utf-8")
    (d / "en").write_text("I sing in Bangla.\nHow are you?\n", encoding="utf-8")
    return {"bn": d / "bn", "en": d / "en"}


@pytest.fixture(scope="module")
def bilingual(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    # bare file names: the language comes from the script detector
    p = run("train_tokenizer.py", "--input", str(corpus["bn"]), str(corpus["en"]), "--vocab-size", "8192",
            "--out", str(out), "--num-threads", "2")
    assert "held-out chars/token" in p.stdout
    return out


def test_train_tokenizer_card(bilingual):
    card = json.loads((bilingual / "tokenizer_card.json").read_text())
    tok = Tokenizer(bilingual / "tokenizer.model")
    assert card["vocab_size"] == tok.vocab_size == 8192 and card["sha256"] == tok.sha256
    assert card["model_type"] == "bpe" and card["normalization"]["sentencepiece_rule"] == "identity"
    text = card["training_text"]
    assert set(text) == {"bn", "en"}
    for lang in ("bn", "en"):
        assert text[lang]["train_lines"] + text[lang]["heldout_lines"] == text[lang]["lines"]
        assert 0 < text[lang]["heldout_lines"] < 0.1 * text[lang]["lines"]
    assert card["training_seconds"] > 0 and card["training_mb_per_s"] > 0
    held = card["heldout_fertility"]
    assert held["bn"]["tokens"] > 0 and held["bn"]["chars"] > held["bn"]["tokens"]


def test_bilingual_tokenizer_from_the_cli_passes_the_floor(bilingual, corpus):
    card = json.loads((bilingual / "tokenizer_card.json").read_text())
    cpt = {lang: f["chars_per_token"] for lang, f in card["heldout_fertility"].items()}
    assert fertility.floor_verdicts(cpt) == [] and cpt["bn"] > 2.5
    # the fertility CLI agrees on the same text
    p = run("fertility.py", "--tokenizer", str(bilingual / "tokenizer.model"), "--lang", f"bn={corpus['bn']}",
            "--lang", f"en={corpus['en']}", "--json")
    assert fertility.floor_verdicts({k: v["chars_per_token"] for k, v in json.loads(p.stdout).items()}) == []


def test_english_only_tokenizer_from_the_cli_is_flagged(corpus, tmp_path):
    run("train_tokenizer.py", "--input", f"en={corpus['en']}", "--vocab-size", "2048", "--out", str(tmp_path))
    p = run("fertility.py", "--tokenizer", str(tmp_path / "tokenizer.model"), "--lang", f"bn={corpus['bn']}", "--json")
    bn = json.loads(p.stdout)["bn"]
    # every Bangla character is a piece even with no Bangla training text: one token per character,
    # no byte fallback, and still far below the floor
    assert bn["chars_per_token"] < 1.2 and bn["byte_fallback_rate"] < 0.01  # OCR noise: Assamese ৰ, symbols
    assert len(fertility.floor_verdicts({"bn": bn["chars_per_token"]})) == 1


def test_lang_weights_set_the_training_character_shares(corpus, tmp_path):
    run("train_tokenizer.py", "--input", f"bn={corpus['bn']}", f"en={corpus['en']}", "--vocab-size", "2048",
        "--out", str(tmp_path), "--lang-weights", "bn=0.5,en=0.5", "--model-type", "unigram", "--word-frequencies", "none")
    card = json.loads((tmp_path / "tokenizer_card.json").read_text())
    assert card["lang_weights"] == {"bn": 0.5, "en": 0.5} and card["model_type"] == "unigram"
    assert card["training_text"]["bn"]["sampled_char_share"] == pytest.approx(0.5, abs=0.01)


def test_train_tokenizer_refuses_bad_input(corpus, tmp_path):
    p = run("train_tokenizer.py", "--input", str(tmp_path / "nope.txt"), "--vocab-size", "64", "--out",
            str(tmp_path), ok=False)
    assert p.returncode == 2 and "nope.txt does not exist" in p.stderr
    p = run("train_tokenizer.py", "--input", f"bn={corpus['bn']}", "--vocab-size", "64", "--out", str(tmp_path),
            "--lang-weights", "bn=lots", ok=False)
    assert p.returncode == 2 and "LANG=WEIGHT" in p.stderr
    junk = tmp_path / "cjk.txt"
    junk.write_text("日本語のテキスト\n" * 10, encoding="utf-8")
    p = run("train_tokenizer.py", "--input", str(junk), "--vocab-size", "64", "--out", str(tmp_path), ok=False)
    assert p.returncode == 2 and "cannot tell its language" in p.stderr


def test_fertility_cli_bytes_baseline_and_premium(parallel):
    p = run("fertility.py", "--tokenizer", "bytes", "--lang", f"bn={parallel['bn']}", "--lang",
            f"en={parallel['en']}", "--json")
    r = json.loads(p.stdout)
    bn_bytes = len("আমি বাংলায় গান গাই।".encode()) + len("তুমি কেমন আছ?".encode())
    en_bytes = len("I sing in Bangla.") + len("How are you?")
    assert r["bn"]["tokens"] == bn_bytes and r["en"]["tokens"] == en_bytes
    assert r["bn"]["premium"] == pytest.approx(bn_bytes / en_bytes) and r["en"]["premium"] == 1.0
    assert r["bn"]["byte_fallback_rate"] == 1.0 and r["bn"]["words"] == 7


def test_fertility_cli_table_and_plot(parallel, bilingual, tmp_path):
    png = tmp_path / "f.png"
    p = run("fertility.py", "--tokenizer", str(bilingual / "tokenizer.model"), "--lang", f"bn={parallel['bn']}",
            "--lang", f"en={parallel['en']}", "--plot", str(png))
    header, bn_row, en_row = p.stdout.splitlines()[1:4]
    assert header.split()[:2] == ["lang", "chars_per_token"] and "premium" in header
    assert bn_row.split()[0] == "bn" and en_row.split()[0] == "en"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = run("fertility.py", "--tokenizer", "bytes", "--lang", "bn", ok=False)
    assert p.returncode == 2 and "LANG=FILE" in p.stderr
