"""Sweeps on the tiny preset: a Hydra grid over the learning rate, and the Optuna config, whose
best value must be the smallest val/loss its trials logged (so train() returned the metric). Each
job of a sweep is its own W&B run (read back with W&B's own reader of its offline files), and a
sweep ends with its table, best first (bnlit/sweep_report.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bnlit.run_report import read_metrics
from conftest import TINY


# every sweep here sets or searches the learning rate; a fixed optimizer.lr on the command line would
# take it out of Optuna's search space
SWEEP_TINY = [o for o in TINY if not o.startswith("optimizer.lr=")]


def multirun(sweep_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bnlit.train", "-m", *SWEEP_TINY, f"hydra.sweep.dir={sweep_dir}", *overrides],
                          capture_output=True, text=True, cwd=sweep_dir.parent, timeout=900, env=env)


def sweep_summary(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())


def final(run_dir: Path, key: str) -> float:
    return read_metrics(run_dir / "csv" / "metrics.csv")[key][-1][1]


@pytest.mark.slow
def test_grid_over_the_learning_rate(tmp_path, cache_dir):
    sweep = tmp_path / "grid"
    out = multirun(sweep, "model=tiny", "optimizer.lr=1e-3,3e-3", "trainer.max_steps=2", "trainer.val_check_interval=2")
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    lrs = [yaml.safe_load((j / ".hydra" / "overrides.yaml").read_text()) for j in jobs]
    assert "optimizer.lr=0.001" in lrs[0] and "optimizer.lr=0.003" in lrs[1]
    peak = [max(v for _, v in read_metrics(j / "csv" / "metrics.csv")["train/lr"]) for j in jobs]
    assert peak[1] == pytest.approx(3 * peak[0])  # each job trained with its own learning rate
    assert all((j / "checkpoints" / "last.ckpt").is_file() and (j / "summary.md").is_file() for j in jobs)
    # the sweep's answer: every job, best first, with its own overrides and final figures
    table = sweep_summary(sweep)
    losses = {j.name: final(j, "val/loss") for j in jobs}
    assert [r["job"] for r in table["jobs"]] == sorted(losses, key=losses.get)
    for r in table["jobs"]:
        assert r["overrides"] == [f"optimizer.lr={'0.001' if r['job'] == '0' else '0.003'}"]
        assert r["val_loss"] == losses[r["job"]] and r["tokens_per_s"] > 0
        assert set(r["languages"]) == {"bn", "en"}
        for lang in r["languages"].values():
            assert lang["bits_per_char"] > 0 and isinstance(lang["beats_bigram"], bool)
    md = (sweep / "sweep_summary.md").read_text()
    best = table["jobs"][0]
    assert f"| 1 | {best['job']} | `{best['overrides'][0]}` | {best['val_loss']:.4f} |" in md
    assert md in out.stdout  # printed at the end of the sweep


@pytest.mark.slow
def test_optuna_minimises_val_loss(tmp_path, cache_dir):
    sweep = tmp_path / "optuna"
    out = multirun(sweep, "hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2",
                   "trainer.max_steps=2", "trainer.val_check_interval=2")
    assert out.returncode == 0, out.stderr[-3000:]
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    trials = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(trials) == 2
    losses = [final(t, "val/loss") for t in trials]
    assert result["best_value"] == pytest.approx(min(losses), abs=1e-6)
    assert set(result["best_params"]) == {"optimizer.lr", "optimizer.weight_decay", "scheduler.warmup_fraction"}
    table = sweep_summary(sweep)
    assert table["best_params"] == result["best_params"] and table["jobs"][0]["val_loss"] == pytest.approx(min(losses))
    for r in table["jobs"]:  # each trial's own overrides: the parameters Optuna chose
        assert sorted(o.split("=")[0] for o in r["overrides"]) == sorted(result["best_params"])
    assert "Optuna best: `optimizer.lr=" in (sweep / "sweep_summary.md").read_text()


@pytest.mark.slow
def test_sweep_shorter_than_one_validation_interval_runs_every_job(tmp_path, cache_dir):
    """2 points x 3 steps with validation every 50 steps: validation runs at the end of each job
    (bnlit.train.needs_final_validation), so both jobs log val/loss of their trained model, the
    sweep finishes, and each job's summary.md shows the numbers its console line printed."""
    import re

    sweep = tmp_path / "short"
    out = multirun(sweep, "model=tiny", "optimizer.lr=1e-3,3e-3", "trainer.max_steps=3", "trainer.val_check_interval=50")
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    console = re.findall(r"^train/loss (\S+)  val/loss (\S+)$", out.stdout, re.M)
    assert len(console) == 2 and "n/a" not in {v for pair in console for v in pair}, out.stdout[-2000:]
    for job, (train_loss, val_loss) in zip(jobs, console):
        series = read_metrics(job / "csv" / "metrics.csv")
        assert series["val/loss"][-1][0] == 3  # the trained model's, logged at the last step
        summary = (job / "summary.md").read_text()
        assert f"| `val/loss` | {val_loss} | 3 |" in summary and f"| `train/loss` | {train_loss} | " in summary
    assert "validation runs once, at the end of training (step 3)" in out.stdout + out.stderr


@pytest.mark.slow
def test_each_job_of_a_sweep_is_its_own_wandb_run(tmp_path, cache_dir):
    """Two jobs in one process, W&B offline: each job's W&B files, read by W&B's own reader of its
    transaction log (``wandb leet inspect``), hold that job's learning rate and its own final
    val/loss, equal to its CSV; the runs share the sweep's group and are named by their overrides."""
    sweep = tmp_path / "wandb_sweep"
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"))
    overrides = [o for o in SWEEP_TINY if o != "logger=csv"]
    out = subprocess.run([sys.executable, "-m", "bnlit.train", "-m", *overrides, "logger=wandb", "optimizer.lr=1e-3,3e-3",
                          f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "already in progress" not in out.stdout + out.stderr
    wandb = Path(sys.executable).parent / "wandb"
    losses = []
    for job, lr in (("0", 0.001), ("1", 0.003)):
        runs = list((sweep / job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        read = subprocess.run([str(wandb), "leet", "inspect", "--summary", "--json", str(runs[0])],
                              capture_output=True, text=True, timeout=120, env=env)
        record = json.loads(read.stdout)
        assert record["state"] == "finished" and record["exit_code"] == 0
        assert record["config"]["optimizer"]["lr"] == lr
        csv_loss = final(sweep / job, "val/loss")
        assert record["summary"]["val/loss"] == pytest.approx(csv_loss, rel=1e-9, abs=0)
        losses.append(csv_loss)
        assert record["name"] == f"{job}: optimizer.lr={lr}"
        raw = subprocess.run([str(wandb), "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True,
                             timeout=120, env=env).stdout.splitlines()
        run_record = next(json.loads(line)["run"] for line in raw if '"type":"run"' in line)
        assert run_record["run_group"] == sweep.name
    assert losses[0] != losses[1]
