"""W&B: an offline run records the composed config and the preset/trainer/mixture tags, and its
API key appears in no file of the run dir (config dumps, W&B files, logs); summary.md and the
plots are written for users without W&B."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bnlit.loggers import REDACTED, redact
from conftest import TINY

FAKE_KEY = "bnlit" + "0123456789abcdef" * 2 + "fake"  # 41 characters, like a real key


def test_redact_hides_secret_keys_and_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    cfg = {"logger": {"wandb": {"api_key": "x", "project": "bnlit"}}, "notes": [FAKE_KEY, "ok"],
           "tokenizer": {"path": "tok.model"}, "hf_token": "", "n_tokens": 5}
    assert redact(cfg) == {"logger": {"wandb": {"api_key": REDACTED, "project": "bnlit"}}, "notes": [REDACTED, "ok"],
                           "tokenizer": {"path": "tok.model"}, "hf_token": "", "n_tokens": 5}


@pytest.mark.slow
def test_offline_run_never_writes_the_api_key(tmp_path, cache_dir):
    run = tmp_path / "run"
    env = dict(os.environ, WANDB_API_KEY=FAKE_KEY, WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"))
    overrides = [o for o in TINY if o != "logger=csv"]
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *overrides, "logger=wandb", "tags=[ablation]",
                          "+secret.api_key=${oc.env:WANDB_API_KEY}", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert FAKE_KEY not in out.stdout + out.stderr
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    leaked = [p for p in run.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert leaked == []
    record = next(offline[0].glob("*.wandb")).read_bytes()  # W&B's offline record (protobuf)
    for key in (b"optimizer", b"seq_len", b"vocab_size", b"checkpoint_dir", REDACTED.encode()):
        assert key in record, key  # the full composed config, the secret redacted
    hparams = yaml.safe_load((run / "csv" / "hparams.yaml").read_text())  # the same dict, to the CSV logger
    assert hparams["secret"]["api_key"] == REDACTED and hparams["model"]["config"]["name"] == "tiny"
    for tag in (b"model:tiny", b"trainer:cpu", b"data:bn", b"ablation"):
        assert tag in record, tag
    # the CSV logger runs alongside W&B: the summary and its plots exist without W&B
    assert (run / "csv" / "metrics.csv").is_file()
    summary = (run / "summary.md").read_text()
    assert "| `val/loss` |" in summary and "![loss](plots/loss.png)" in summary
    assert (run / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_from_csv_and_tables(tmp_path):
    from bnlit.loggers import write_json_atomic
    from bnlit.run_report import read_metrics, write_summary

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text(
        "epoch,throughput/mfu,step,train/loss,twin/bn_nll_gap,val/loss\n"
        "0,,0,7.0,,\n0,31.5,1,6.5,,\n0,,1,6.25,,\n0,,2,6.0,0.5,6.1\n")  # step 1 re-logged after a resume
    write_json_atomic(tmp_path / "tables" / "tok_fertility.json",
                      {"columns": ["language", "chars_per_token"], "rows": [["bn", 3.25]], "step": 2})
    assert read_metrics(tmp_path / "csv" / "metrics.csv")["train/loss"] == [(0, 7.0), (1, 6.25), (2, 6.0)]
    text = write_summary(tmp_path, {"val/loss": 6.1}).read_text()
    assert "| `train/loss` | 6.0000 | 2 |" in text and "| `throughput/mfu` | 31.5000 | 1 |" in text  # value, the step it was logged at
    assert "## Table `tok_fertility` (step 2)" in text and "| bn | 3.2500 |" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss.png", "mfu.png", "twin_gap.png"]
