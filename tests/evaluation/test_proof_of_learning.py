"""Proof of learning in a real run: n-gram baselines next to the twin, the starvation alarm, the
dead-vocabulary report, multiple choice during training, and evaluate.py's baselines and
contamination (tiny configs on CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from bnlit.evaluation.ngram import NgramCounts, baseline_path
from bnlit.checks.starvation import LanguageStarvationError
from bnlit.train import train

FIXTURES = Path(__file__).parents[1] / "fixtures"
ROOT = Path(__file__).parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, cache_dir):
    """A tiny default run with multiple choice on; shared by the tests below."""
    from conftest import TINY
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from bnlit import CONF_DIR

    run = tmp_path_factory.mktemp("healthy") / "run"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, "trainer.max_steps=8", "callbacks.random_twin.max_tokens=2000",
                                          "++callbacks.random_twin.learning_after_steps=4",
                                          f"+callbacks.multiple_choice.tasks.small={FIXTURES / 'multiple_choice_small.jsonl'}"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(run)
        cfg.paths.cache_dir = str(cache_dir)
    return cfg, train(cfg)


def test_baselines_are_logged_saved_and_judged(healthy_run):
    cfg, metrics = healthy_run
    run = Path(cfg.paths.output_dir)
    for lang in ("bn", "en"):
        uni, bi = metrics[f"baseline/{lang}_unigram_bits_per_char"], metrics[f"baseline/{lang}_bigram_bits_per_char"]
        assert 0 < bi < uni < metrics[f"twin/{lang}_bits_per_char"]
        assert metrics[f"learned_context/{lang}"] == pytest.approx(bi - metrics[f"twin/{lang}_trained_bits_per_char"])
        counts = NgramCounts.load(baseline_path(run, lang))
        assert counts.vocab_size == 1024 and counts.tokens > 1000
    table = json.loads((run / "tables" / "twin_table.json").read_text())
    cols = table["columns"]
    assert cols[-5:] == ["unigram_bits_per_char", "bigram_bits_per_char", "beat_twin", "beat_unigram", "beat_bigram"]
    for row in table["rows"]:
        r = dict(zip(cols, row))
        assert r["beat_bigram"] == (r["trained_bits_per_char"] < r["bigram_bits_per_char"])
        assert r["beat_twin"] is True
    summary = (run / "summary.md").read_text()
    assert "## Proof of learning" in summary and "the bigram (" in summary
    assert (run / "plots" / "learned_context.png").is_file()


def test_dead_vocabulary_report_of_a_run(healthy_run):
    cfg, metrics = healthy_run
    report = json.loads((Path(cfg.paths.output_dir) / "dead_vocabulary.json").read_text())
    never = report["never_in_training"]
    assert report["vocab_size"] == 1024 and never["count"] == len(never["ids"]) > 0
    # the pad/unk/bos pieces never occur in text; </s> ends every document
    assert never["by_kind"]["special"] == 3
    # 8 steps of 4 x 64 tokens look up far fewer rows than the shards contain
    assert set(never["ids"]) <= set(report["never_looked_up"]["ids"])
    assert metrics["vocab/never_looked_up"] > metrics["vocab/never_in_training"]


def test_multiple_choice_during_training(healthy_run):
    _, metrics = healthy_run
    assert metrics["multiple_choice/small_chance"] == pytest.approx(1 / 3)
    assert 0 <= metrics["multiple_choice/small_acc_norm"] <= 1


def test_evaluate_reports_baselines_and_contamination(healthy_run, tmp_path, capsys):
    cfg, _ = healthy_run
    run = Path(cfg.paths.output_dir)
    ckpt = run / "checkpoints" / "last.ckpt"
    report = json.loads((run / "data_report.json").read_text())
    # a held-out file that copies a training document (planted overlap) and one that is new
    from bnlit.data.pipeline import read_clean
    from bnlit.data.shards import is_validation

    train_doc = next(t for t in read_clean(report["clean_dir"], "bn_books") if not is_validation(t, report["val_fraction"]))
    copied, fresh = tmp_path / "copied.txt", tmp_path / "fresh.txt"
    copied.write_text(train_doc[:3000], encoding="utf-8")
    fresh.write_text("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। চিরদিন তোমার আকাশ, তোমার বাতাস, আমার প্রাণে "
                     "বাজায় বাঁশি। ও মা, ফাগুনে তোর আমের বনে ঘ্রাণে পাগল করে, মরি হায়, হায় রে।", encoding="utf-8")
    assert script("evaluate").main(["--checkpoint", str(ckpt), "--text", f"bn={copied}", "--text", f"en={fresh}",
                                    "--json"]) == 0
    printed = capsys.readouterr()
    res = json.loads(printed.out)
    assert res["run_dir"] == str(run)
    # progress on stderr, stage by stage, each with the seconds so far (stdout stays the JSON)
    stages = [re.sub(r" \(\d+ s\)$", "", line) for line in printed.err.splitlines() if line.startswith("evaluate: ")]
    assert stages[:3] == ["evaluate: reading the texts", f"evaluate: loading {ckpt}", "evaluate: the run's n-gram baselines"]
    for stage in ("bn: 1 documents, ", "bn: the random twin", "bn: overlap with the training text", "en: the random twin"):
        assert any(stage in s for s in stages), (stage, stages)
    for lang in ("bn", "en"):
        r = res[lang]
        for m in ("twin", "unigram", "bigram"):
            assert r[f"{m}_bits_per_char"] == pytest.approx(r[f"{m}_nll_per_token"] * r["tokens"] / r["chars"] / math.log(2))
            assert r["beats"][m] == (r["bits_per_char"] < r[f"{m}_bits_per_char"])
        assert r["learned_context"] == pytest.approx(r["bigram_bits_per_char"] - r["bits_per_char"])
    assert res["bn"]["contamination"]["ngram_rate"] > 0.9 and res["bn"]["contamination"]["contamination_rate"] == 1.0
    assert res["en"]["contamination"]["ngram_rate"] == 0.0
    # the bigram of a copied training passage is far better than of fresh text
    assert res["bn"]["bigram_bits_per_char"] < res["bn"]["unigram_bits_per_char"]
    assert script("evaluate").main(["--checkpoint", str(ckpt), "--text", f"bn={copied}"]) == 0
    text = capsys.readouterr().out
    assert "bigram" in text and "of 13-grams in training" in text and "learned context" in text


def test_evaluate_scores_each_document_as_if_alone(healthy_run, tmp_path, capsys):
    """scripts/evaluate.py packs documents into windows with the training's document mask (saved in
    the checkpoint): its NLL is the sum of each document scored on its own."""
    import torch

    from bnlit.checkpointing import load_model
    from bnlit.evaluation.heldout import evaluate_documents

    cfg, _ = healthy_run
    ckpt = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["document_masking"] is True
    docs = ["আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।", "চিরদিন তোমার আকাশ, তোমার বাতাস।", "A third one, in English."]
    held_out = tmp_path / "docs.jsonl"
    held_out.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    args = ["--checkpoint", str(ckpt), "--text", f"bn={held_out}", "--json", "--no-twin", "--no-contamination"]
    assert script("evaluate").main(args) == 0
    res = json.loads(capsys.readouterr().out)
    model, tok, _ = load_model(ckpt)
    alone = sum(evaluate_documents(model, tok, [d], seq_len=res["seq_len"]).nll_sum for d in docs)
    assert res["document_masking"] is True
    assert res["bn"]["nll_per_token"] * res["bn"]["tokens"] == pytest.approx(alone, rel=1e-5)
    assert script("evaluate").main([*args, "--no-document-masking"]) == 0
    causal = json.loads(capsys.readouterr().out)
    assert causal["bn"]["nll_per_token"] * causal["bn"]["tokens"] != pytest.approx(alone, rel=1e-4)


def test_starvation_alarm_trips_on_a_bangla_weight_of_one_percent(make_cfg):
    cfg = make_cfg("data.sources.0.weight=0.01", "data.sources.1.weight=0.99", "trainer.max_steps=16",
                   "callbacks.starvation.on_starved=raise", "callbacks.starvation.patience=2",
                   "~callbacks.random_twin", "~callbacks.dead_vocabulary", "~callbacks.gradient_flow")
    with pytest.raises(LanguageStarvationError, match="language starvation: bn's held-out loss has not improved"):
        train(cfg)


def test_healthy_mixture_does_not_trip_the_starvation_alarm(make_cfg):
    cfg = make_cfg("trainer.max_steps=16", "callbacks.starvation.on_starved=raise", "callbacks.starvation.patience=2",
                   "~callbacks.random_twin", "~callbacks.dead_vocabulary", "~callbacks.gradient_flow")
    metrics = train(cfg)
    assert "val/bn_loss" in metrics
    table = json.loads((Path(cfg.paths.output_dir) / "tables" / "starvation_table.json").read_text())
    assert [r[0] for r in table["rows"]] == ["bn", "en"] and all(r[-1] is None for r in table["rows"])


def test_belebele_rows_are_read_as_cloze_items(tmp_path):
    from bnlit.evaluation.multiple_choice import load_items

    row = {"flores_passage": "নদীর ধারে একটি গ্রাম। ", "question": "গ্রামটি কোথায়?", "mc_answer1": "পাহাড়ে",
           "mc_answer2": "নদীর ধারে", "mc_answer3": "শহরে", "mc_answer4": "সমুদ্রে", "correct_answer_num": "2"}
    path = tmp_path / "ben_Beng.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    (item,) = load_items(path)
    assert item.context == "নদীর ধারে একটি গ্রাম।\nQuestion: গ্রামটি কোথায়?\nAnswer:"
    assert item.choices == [" পাহাড়ে", " নদীর ধারে", " শহরে", " সমুদ্রে"] and item.label == 1
