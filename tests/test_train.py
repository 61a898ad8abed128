import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from bnlit.errors import CheckpointError, ConfigError, TokenizerError
from bnlit.tokenizer import Tokenizer
from bnlit.train import train


def test_fast_dev_run_of_the_composed_config(make_cfg):
    metrics = train(make_cfg("trainer.fast_dev_run=2"))
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_short_run_leaves_checkpoint_tokenizer_and_metrics(make_cfg, tmp_path):
    cfg = make_cfg()
    metrics = train(cfg)
    run = Path(cfg.paths.output_dir)
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "tokenizer.model").is_file()
    assert Tokenizer(run / "tokenizer.model").vocab_size == cfg.model.config.vocab_size
    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) >= 2 and all(v == v for v in val)  # step-0 validation plus at least one more
    assert {"train/loss", "train/lr", "val/bn_loss", "val/en_loss"} <= set(rows[0])
    assert metrics["val/loss"] == pytest.approx(val[-1])
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["model_config"]["name"] == "tiny"
    assert ckpt["global_step"] == 4


def test_validation_interval_counts_optimizer_steps_under_accumulation(make_cfg, tmp_path):
    """``trainer.val_check_interval=2`` with 4 micro-batches per step validates after steps 2 and 4
    (Lightning's own count is micro-batches: it would validate after every half step)."""
    cfg = make_cfg("trainer.accumulate_grad_batches=4", "validate_at_start=false", "data.batch_size=2")
    train(cfg)
    rows = list(csv.DictReader(open(Path(cfg.paths.output_dir) / "csv" / "metrics.csv")))
    assert sorted({int(r["step"]) for r in rows if r.get("val/loss")}) == [2, 4]
    assert sum(1 for r in rows if r.get("val/loss")) == 2


def test_loss_falls_on_the_embedded_corpus(make_cfg):
    cfg = make_cfg("trainer.max_steps=40", "trainer.val_check_interval=40", "optimizer.lr=1e-2")
    train(cfg)
    rows = list(csv.DictReader(open(Path(cfg.paths.output_dir) / "csv" / "metrics.csv")))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert val[-1] < val[0] - 0.5, val


def test_tokenizer_vocab_must_match_the_model(make_cfg, tmp_path):
    cfg = make_cfg("trainer.fast_dev_run=1")
    train(cfg)  # trains a 1024-token tokenizer into the run dir
    tok = Path(cfg.paths.output_dir) / "tokenizer.model"
    bad = make_cfg(f"tokenizer.path={tok}", "model.config.vocab_size=2048", run_dir=tmp_path / "other")
    with pytest.raises(TokenizerError, match=r"tokenizer.path: .* has 1024 tokens but model.config.vocab_size=2048"):
        train(bad)


def test_seq_len_above_model_maximum(make_cfg):
    with pytest.raises(ConfigError, match=r"data.seq_len=1024 exceeds model.config.max_seq_len=128"):
        train(make_cfg("data.seq_len=1024"))


def test_run_dir_with_another_runs_checkpoints_is_refused(make_cfg, tmp_path):
    cfg = make_cfg()
    train(cfg)
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(CheckpointError, match="already holds checkpoints.*ckpt_path=last.*overwrite=true"):
        train(make_cfg())
    assert last.read_bytes() == before  # nothing overwritten
    with open_dict(cfg):
        cfg.overwrite = True
    train(cfg)


def test_ckpt_path_last_without_checkpoints(make_cfg):
    with pytest.raises(CheckpointError, match="ckpt_path=last: no complete checkpoint"):
        train(make_cfg("ckpt_path=last"))


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "bnlit.train", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, cache_dir):
    out = run_cli("model=tiny", "data.seq_len=4096", "logger=none", f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    assert out.returncode == 2
    errors = [l for l in out.stderr.splitlines() if l.strip()]
    assert errors == ["error: data.seq_len=4096 exceeds model.config.max_seq_len=128 of preset tiny; "
                      "lower data.seq_len or raise max_seq_len"]


def test_cli_unknown_preset_names_the_group(tmp_path):
    out = run_cli("model=7b", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == "error: model=7b: model has no option '7b'; options: 125m, 1b, 25m, 400m, tiny\n"
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a run dir


def test_cli_missing_data_file(tmp_path, cache_dir):
    out = run_cli("data=files", f"data.sources.0.path={tmp_path}/missing.txt", f"data.sources.1.path={tmp_path}/m2.txt",
                  "logger=none", f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    assert out.returncode == 2
    assert f"error: data.sources[0].path: file {tmp_path}/missing.txt does not exist; fix the path" in out.stderr
