"""Fertility maths, the characters-weighted mixture and the FertilityCheck callback."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from hydra.utils import instantiate

from bnlit.checks import fertility
from bnlit.data import BnDataModule, embedded
from bnlit.data.dataset import MixtureSampler
from bnlit.errors import ConfigError, TokenizerError
from bnlit.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, sample_by_language, train_tokenizer
from bnlit.train import train


@pytest.fixture(scope="module")
def bn_lines() -> list[str]:
    return list(fertility.iter_lines(embedded.bangla_documents()[:8]))


@pytest.fixture(scope="module")
def english_only(tmp_path_factory) -> Tokenizer:
    """A foreign tokenizer that has never seen Bangla: Bangla falls back to UTF-8 bytes. Trained
    with SentencePiece directly, as a user's own model might be: one bnlit trains always has every
    Bangla character as a piece (tests/test_tokenizer.py)."""
    import sentencepiece as spm

    path = tmp_path_factory.mktemp("en_tok") / "tokenizer.model"
    lines = list(fertility.iter_lines(embedded.english_documents()[:300]))
    with path.open("wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=f, vocab_size=1024,
                                       model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                       pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=2)
    return Tokenizer(path)


# ---- pure functions -------------------------------------------------------------------------
def test_byte_baseline_on_bangla():
    books = embedded.bangla_documents()
    f = fertility.measure(books, fertility.BYTES, "bn")
    assert f.tokens == f.bytes == sum(len(x.encode()) for x in books)
    assert f.bytes / f.chars == pytest.approx(2.66, abs=0.03)
    assert f.chars_per_token == pytest.approx(0.37, abs=0.01)
    assert f.byte_fallback_rate == 1.0 and f.unk_rate == 0.0


def test_piece_chars_count_decoded_text(english_only):
    table = fertility.piece_chars(english_only)
    for text in ["Hello, world! বাংলা ভাষা।", "আমি বাংলায় গান গাই"]:
        ids = english_only.encode(text)
        assert table[ids].sum() == len(" " + english_only.decode(ids))  # SentencePiece's dummy prefix
        cut = ids[: len(ids) // 2 + 1]  # a window may end inside a character's bytes
        assert table[cut].sum() <= len(text) + 1


def test_measure_counts_match_a_plain_encode(english_only):
    texts = ["Hello, world!", "The assert statement.", "বাংলা"]
    f = fertility.measure(texts, english_only, "x")
    ids = [english_only.encode(t) for t in texts]
    assert f.tokens == sum(map(len, ids))
    assert f.byte_tokens == sum(english_only.is_byte(i) for doc in ids for i in doc) > 0
    assert f.chars == sum(map(len, texts)) and f.words == 6
    assert f.tokens_per_word == f.tokens / 6


def test_english_only_tokenizer_is_flagged_on_bangla(english_only, bn_lines):
    bn = fertility.measure(bn_lines, english_only, "bn")
    assert bn.chars_per_token < 0.6 and bn.byte_fallback_rate > 0.5
    en = fertility.measure(list(fertility.iter_lines(embedded.english_documents()[:5])), english_only, "en")
    problems = fertility.floor_verdicts({"bn": bn.chars_per_token, "en": en.chars_per_token})
    assert len(problems) == 1
    assert "bn gets" in problems[0] and f"{bn.chars_per_token:.2f}" in problems[0]
    assert "retrain" in problems[0] and "2.50" in problems[0]


def test_token_premium_is_relative_to_english_or_first():
    assert fertility.token_premium({"bn": 300, "en": 100}) == {"bn": 3.0, "en": 1.0}
    assert fertility.token_premium({"bn": 300, "hi": 150}) == {"bn": 1.0, "hi": 0.5}


def test_report_adds_premium_only_for_parallel_text():
    par = fertility.report({"bn": ["আমি", "তুমি"], "en": ["I", "you"]}, fertility.BYTES)
    assert par["bn"]["premium"] == pytest.approx(len("আমিতুমি".encode()) / 4)
    assert par["en"]["premium"] == 1.0
    non = fertility.report({"bn": ["আমি"], "en": ["I", "you"]}, fertility.BYTES)
    assert "premium" not in non["bn"]


def test_char_shares_to_token_weights_and_back():
    cpt = {"bn": 0.37, "en": 1.0}
    w = fertility.token_weights_for_char_shares({"bn": 0.8, "en": 0.2}, cpt)
    assert w["bn"] == pytest.approx((0.8 / 0.37) / (0.8 / 0.37 + 0.2))
    tokens, chars = fertility.effective_shares(w, cpt)
    assert tokens == pytest.approx(w)
    assert chars == pytest.approx({"bn": 0.8, "en": 0.2})
    # the trap: the same 80/20 read as token weights is about 60/40 in text
    _, naive = fertility.effective_shares({"bn": 0.8, "en": 0.2}, cpt)
    assert naive["bn"] == pytest.approx(0.8 * 0.37 / (0.8 * 0.37 + 0.2))
    with pytest.raises(ValueError, match="no measured"):
        fertility.token_weights_for_char_shares({"bn": 1.0}, {"bn": float("nan")})


def test_share_verdicts_inverted_overrepresented_and_clean():
    intended = {"bn": 0.8, "en": 0.2}
    assert fertility.share_verdicts(intended, {"bn": 0.8, "en": 0.2}, {"bn": 0.78, "en": 0.22}) == []
    inv = fertility.share_verdicts(intended, {"bn": 0.8, "en": 0.2}, {"bn": 0.4, "en": 0.6}, {"bn": 0.37, "en": 1.0})
    assert any("inverted in characters" in m and "bn was meant to outweigh en" in m for m in inv)
    assert any("over-represents en in characters by 3.00x" in m for m in inv)
    assert all("weight_unit=chars" in m for m in inv) and "0.37 chars/token" in inv[0]
    over = fertility.share_verdicts({"bn": 0.5, "en": 0.5}, {"bn": 0.5, "en": 0.5}, {"bn": 0.5, "en": 0.5})
    assert over == []


def test_detect_language_from_script():
    assert fertility.detect_language("আমি বাংলায় গান গাই, OK") == "bn"
    assert fertility.detect_language("The assert statement") == "en"
    assert fertility.detect_language("日本語のテキスト") == "und"


def test_sample_by_language_delivers_character_shares():
    lines = {"bn": [f"বাংলা {i} " * (1 + i % 7) for i in range(3000)], "en": [f"english {i}" for i in range(300)]}
    for w in ({"bn": 0.8, "en": 0.2}, {"bn": 0.5, "en": 0.5}):
        pairs = sample_by_language(lines, w, seed=1, with_language=True)
        chars = {k: sum(len(x) for lang, x in pairs if lang == k) for k in lines}
        share = chars["bn"] / sum(chars.values())
        assert share == pytest.approx(w["bn"], abs=0.01)
    assert sample_by_language(lines, None) == lines["bn"] + lines["en"]
    with pytest.raises(TokenizerError, match="have no text"):
        sample_by_language(lines, {"hi": 1.0})


# ---- the data module's character-weighted mixture -------------------------------------------
def _delivered_char_share(dm) -> dict[str, float]:
    """Characters actually delivered by one epoch of the sampler, by decoding every window."""
    sizes = [len(d) for d in dm.train_sets]
    sampler = MixtureSampler(sizes, dm.sampling_weights, seed=0)
    offsets = np.cumsum([0, *sizes])
    table = fertility.piece_chars(dm.tokenizer)
    chars = {s.language: 0 for s in dm.sources}
    for i in sampler:
        src = int(np.searchsorted(offsets, i, side="right") - 1)
        x, _ = dm.train_sets[src][i - offsets[src]]
        chars[dm.sources[src].language] += int(table[x.numpy()].sum())
    total = sum(chars.values())
    return {k: v / total for k, v in chars.items()}


@pytest.mark.parametrize("unit", ["chars", "tokens"])
def test_mixture_in_characters_delivers_80_20(make_cfg, english_only, tmp_path, unit):
    """With a tokenizer that is ~10x less fertile on Bangla, reading 80/20 as token weights
    delivers far from 80% Bangla text; ``weight_unit=chars`` delivers 80/20 within 2 points."""
    path = english_only.save(tmp_path / "en.model")
    cfg = make_cfg(f"data.weight_unit={unit}", f"tokenizer.path={path}", "data.seq_len=32")
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    share = _delivered_char_share(dm)
    assert dm.mixture["unit"] == unit
    assert dm.mixture["chars"]["bn"] == pytest.approx(share["bn"], abs=0.02)
    if unit == "chars":
        assert share["bn"] == pytest.approx(0.8, abs=0.02)
        assert dm.mixture["tokens"]["bn"] > 0.9  # Bangla needs most of the tokens to get 80% of the text
    else:
        assert share["bn"] < 0.6
        assert dm.mixture["tokens"]["bn"] == pytest.approx(0.8, abs=0.01)


def test_mixture_in_characters_with_the_default_tokenizer(make_cfg):
    dm = instantiate(make_cfg().data)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.weight_unit == "chars"
    assert _delivered_char_share(dm)["bn"] == pytest.approx(0.8, abs=0.02)


def test_tokenizer_lang_weights_in_the_data_module(make_cfg):
    """Resampling the tokenizer's training text towards English trades Bangla fertility for
    English fertility, on the data module's own held-out slices."""
    cpt = {}
    for w in ("{bn: 0.8, en: 0.2}", "{bn: 0.2, en: 0.8}"):
        dm = instantiate(make_cfg(f"tokenizer.lang_weights={w}").data)
        dm.prepare_data()
        dm.setup("fit")
        stats = dm.split_stats("val")
        cpt[w] = {st["language"]: st["chars"] / (st["tokens"] - st["docs"]) for st in stats.values()}
    bangla, english = cpt["{bn: 0.8, en: 0.2}"], cpt["{bn: 0.2, en: 0.8}"]
    assert english["en"] > bangla["en"] * 1.05 and english["bn"] < bangla["bn"] / 1.05


def test_weight_unit_is_validated(make_cfg):
    kwargs = {k: v for k, v in make_cfg().data.items() if k != "_target_"}
    with pytest.raises(ConfigError, match="data.weight_unit='bytes'"):
        BnDataModule(**{**kwargs, "weight_unit": "bytes"})


# ---- the callback in real runs ----------------------------------------------------------------
def _metrics(run_dir) -> dict[str, float]:
    rows = []
    for f in run_dir.rglob("metrics.csv"):
        rows += list(csv.DictReader(f.open()))
    return {k: float(v) for r in rows for k, v in r.items() if k.startswith("tok/") and v}


# the random-twin comparison evaluates two models at train end (~30 s here); it is not under test
NO_TWIN = "~callbacks.random_twin"


def _all_metric_names(run_dir) -> set[str]:
    return {k for f in run_dir.rglob("metrics.csv") for r in csv.DictReader(f.open()) for k, v in r.items() if v}


def test_fertility_check_defaults(make_cfg):
    cfg = make_cfg(tiny=False).callbacks.fertility
    assert (cfg.floors.bn, cfg.on_fail, cfg.check_shares) == (2.5, "raise", True)
    assert make_cfg(tiny=False).data.weight_unit == "chars"


def test_fertility_check_passes_with_the_trained_tokenizer(make_cfg, tmp_path):
    """The default floor (2.5) and an 8192-token tokenizer trained on the tiny corpus."""
    train(make_cfg("model.config.vocab_size=8192", "callbacks.fertility.floors.bn=2.5", "trainer.max_steps=1",
                   NO_TWIN))
    assert {"val/loss", "train/loss"} <= _all_metric_names(tmp_path / "run")  # the run went on
    m = _metrics(tmp_path / "run")
    assert m["tok/bn_chars_per_token"] > 2.5 and m["tok/en_chars_per_token"] > 2.0
    assert m["tok/en_premium"] == 1.0
    assert m["tok/bn_char_share"] == pytest.approx(0.8, abs=0.01)
    table = json.loads((tmp_path / "run" / "tables" / "tok_fertility.json").read_text())
    assert [r[0] for r in table["rows"]] == ["bn", "en"]
    assert math.isclose(table["rows"][0][1], m["tok/bn_chars_per_token"], rel_tol=1e-6)


def test_fertility_check_stops_a_byte_level_run(make_cfg, english_only, tmp_path):
    path = english_only.save(tmp_path / "en.model")
    with pytest.raises(TokenizerError, match=r"bn gets 0\.[0-9]+ characters per token, below the floor of 2\.50"):
        train(make_cfg(f"tokenizer.path={path}", "callbacks.fertility.floors.bn=2.5", "validate_at_start=true"))
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    rows = json.loads((tmp_path / "run" / "tables" / "tok_fertility.json").read_text())["rows"]
    assert rows[0][0] == "bn" and rows[0][1] < 0.6  # logged before the run stopped
    assert "val/loss" not in _all_metric_names(tmp_path / "run")  # stopped before validate_at_start ran


def test_fertility_check_warns_and_flags_an_inverted_mixture(make_cfg, english_only, tmp_path):
    path = english_only.save(tmp_path / "en.model")
    cfg = make_cfg(f"tokenizer.path={path}", "data.weight_unit=tokens", "callbacks.fertility.on_fail=warn",
                   "trainer.max_steps=1", NO_TWIN)
    with pytest.warns(UserWarning) as record:
        train(cfg)
    messages = [str(w.message) for w in record]
    assert any("below the floor" in m for m in messages)
    assert any("mixture inverted in characters: bn was meant to outweigh en" in m for m in messages)


def test_chars_per_token_is_one_formula_and_nan_without_text():
    assert fertility.chars_per_token(10, 4) == 2.5
    assert fertility.chars_per_token(10, 6, docs=2) == 2.5  # end-of-document ids carry no text
    for chars, tokens, docs in ((0, 0, 0), (5, 2, 2), (3, 0, 0)):
        assert math.isnan(fertility.chars_per_token(chars, tokens, docs))
    assert math.isnan(fertility.Fertility("bn", 0, 0, 0, 0, 0, 0, 0).chars_per_token)
    counts = fertility.language_counts([{"language": "bn", "chars": 30, "tokens": 12, "docs": 2},
                                        {"language": "bn", "chars": 10, "tokens": 6, "docs": 1},
                                        {"language": "en", "chars": 8, "tokens": 5, "docs": 1}])
    assert counts == {"bn": {"chars": 40, "tokens": 15, "docs": 3}, "en": {"chars": 8, "tokens": 4, "docs": 1}}
    # an undefined ratio fails a floor instead of passing it silently
    assert fertility.floor_verdicts({"bn": fertility.chars_per_token(0, 0)}, {"bn": 2.5})


# ---- content-matched premium on parallel text -------------------------------------------------
PAIRS = [("আমি বাংলায় গান গাই।", "I sing in Bangla."), ("আজ আকাশ পরিষ্কার।", "The sky is clear today."),
         ("সে প্রতিদিন স্কুলে যায়।", "She goes to school every day."), ("আমরা একসাথে খাই।", "We eat together."),
         ("বইটি টেবিলের উপরে আছে।", "The book is on the table.")]


def _parallel(tmp_path) -> tuple:
    bn, en = tmp_path / "bn.txt", tmp_path / "en.txt"
    bn.write_text("\n".join(b for b, _ in PAIRS) + "\n", encoding="utf-8")
    en.write_text("\n".join(e for _, e in PAIRS) + "\n", encoding="utf-8")
    return bn, en


def test_premium_verdicts_warn_in_both_directions():
    assert fertility.premium_verdicts({"bn": 1.0, "en": 1.0}) == []
    high = fertility.premium_verdicts({"bn": 2.63, "en": 1.0}, source="FLORES")
    assert len(high) == 1 and "bn needs 2.63x the tokens en needs" in high[0] and "under-serves bn" in high[0]
    low = fertility.premium_verdicts({"bn": 0.62, "en": 1.0})
    assert len(low) == 1 and "under-serves en" in low[0] and "outside 0.80-1.25" in low[0]
    assert fertility.premium_verdicts({"bn": 0.62, "en": 1.0}, band=(0.5, 1.5)) == []


def test_parallel_text_and_band_are_checked_when_the_callback_is_built(tmp_path):
    from bnlit.callbacks.fertility import FertilityCheck

    bn, en = _parallel(tmp_path)
    assert FertilityCheck(parallel={"bn": str(bn), "en": str(en)}).settings.parallel_texts["en"][0] == "I sing in Bangla."
    assert FertilityCheck().settings.parallel_texts is None  # off unless given
    with pytest.raises(ConfigError, match=r"callbacks.fertility.parallel.bn: .*nope.txt does not exist"):
        FertilityCheck(parallel={"bn": str(tmp_path / "nope.txt"), "en": str(en)})
    short = tmp_path / "short.txt"
    short.write_text("এক\nদুই\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"\{'bn': 2, 'en': 5\} lines .* same number of non-empty lines"):
        FertilityCheck(parallel={"bn": str(short), "en": str(en)})
    with pytest.raises(ConfigError, match=r"premium_band=\[1.2, 1.5\]"):
        FertilityCheck(premium_band=[1.2, 1.5])


def test_fertility_check_reports_the_parallel_premium(make_cfg, english_only, tmp_path):
    """A tokenizer that never saw Bangla pays a premium far above the band: warned, logged, and
    equal to the premium ``fertility.report`` computes on the same files."""
    bn, en = _parallel(tmp_path)
    path = english_only.save(tmp_path / "en.model")
    cfg = make_cfg(f"tokenizer.path={path}", "callbacks.fertility.on_fail=warn", "trainer.max_steps=1", NO_TWIN,
                   f"callbacks.fertility.parallel={{bn:'{bn}',en:'{en}'}}")
    with pytest.warns(UserWarning) as record:
        train(cfg)
    premium = [str(w.message) for w in record if "tokenizer premium" in str(w.message)]
    assert len(premium) == 1 and "under-serves bn" in premium[0] and "bn.txt" in premium[0]
    want = fertility.report({"bn": [b for b, _ in PAIRS], "en": [e for _, e in PAIRS]}, english_only, parallel=True)
    m = _metrics(tmp_path / "run")
    assert m["tok/bn_parallel_premium"] == pytest.approx(want["bn"]["premium"]) and want["bn"]["premium"] > 1.25
    assert m["tok/en_parallel_premium"] == 1.0
    rows = json.loads((tmp_path / "run" / "tables" / "tok_fertility.json").read_text())["rows"]
    assert rows[0][-1] == pytest.approx(want["bn"]["premium"])
