"""NaN/spike guard: the pure checks, and real fits with NaN (or a spike) injected into the
logits of one chosen batch."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bnlit.checks.nan_guard import DivergenceError, SkipBudget, SpikeTracker, verdict
from bnlit.train import train
from bnlit.callbacks.nan_guard import NaNGuard
from helpers_faults import Poison


POISON = ["+callbacks.poison._target_=helpers_faults.Poison", "+callbacks.poison.batch_idx=2"]


def test_verdict_names_the_problem():
    t = SpikeTracker(factor=3.0, warmup=2)
    assert verdict(math.nan, 1.0, t) == "non-finite loss (nan)"
    assert verdict(2.0, math.inf, t) == "non-finite gradient norm (inf)"
    assert verdict(100.0, 1.0, t) is None  # no average yet
    t.update(2.0)
    assert verdict(100.0, 1.0, t) is None  # still warming up
    t.update(2.0)
    assert verdict(6.5, 1.0, t) == "loss spike (6.5 > 3 x running average 2)"
    assert verdict(5.9, None, t) is None
    assert verdict(100.0, 1.0, SpikeTracker(factor=None, warmup=0, average=1.0, seen=5)) is None


def test_skip_budget_is_capped():
    b = SkipBudget(max_skips=2)
    assert b.take(3, 3) and b.take(7, 1) and not b.take(9, 0)
    assert b.skipped == [(3, 3), (7, 1)]


def test_nan_batch_halts_naming_step_and_batch_and_keeps_the_last_checkpoint(make_cfg):
    cfg = make_cfg(*POISON, "trainer.max_steps=6")
    with pytest.raises(DivergenceError, match=r"^non-finite loss \(nan\) at step 2, batch index 2 \(epoch 0\); "
                                              r"the last good checkpoint is untouched"):
        train(cfg)
    last = torch.load(Path(cfg.paths.checkpoint_dir) / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_skip_policy_drops_the_batch_and_logs_it(make_cfg, caplog):
    cfg = make_cfg(*POISON, "callbacks.nan_guard.policy=skip", "trainer.max_steps=4")
    with caplog.at_level(logging.WARNING, logger="bnlit"):
        metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"])
    p = Poison.last
    assert all(torch.equal(a, b) for a, b in zip(p.before, p.after))  # the skipped step changed no weight
    assert "nan_guard: skipped step 2, batch index 2 (epoch 0): non-finite loss (nan) (1 of max_skips=10)" in caplog.text
    rows = list(csv.DictReader(open(Path(cfg.paths.output_dir) / "csv" / "metrics.csv")))
    skipped = {int(r["step"]): float(r["guard/skipped_batches"]) for r in rows if r.get("guard/skipped_batches")}
    assert skipped == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}  # a running count, logged every step


def test_skip_policy_halts_once_max_skips_is_spent(make_cfg):
    with pytest.raises(DivergenceError, match=r"at step 2, batch index 2 .* after skipping max_skips=0 batches"):
        train(make_cfg(*POISON, "callbacks.nan_guard.policy=skip", "callbacks.nan_guard.max_skips=0"))


def test_loss_spike_halts(make_cfg):
    with pytest.raises(DivergenceError, match=r"^loss spike \(.* > 1.5 x running average .*\) at step 2, batch index 2"):
        train(make_cfg(*POISON, "+callbacks.poison.scale=40.0", "callbacks.nan_guard.spike_factor=1.5",
                       "callbacks.nan_guard.spike_warmup=1"))


def test_non_finite_weights_are_never_checkpointed():
    module = torch.nn.Linear(2, 2)
    NaNGuard().on_save_checkpoint(SimpleNamespace(global_step=4), module, {})  # finite: fine
    with torch.no_grad():
        module.weight[0, 0] = math.inf
    with pytest.raises(DivergenceError, match=r"parameters \['weight'\] are not finite at step 5; refusing to overwrite"):
        NaNGuard().on_save_checkpoint(SimpleNamespace(global_step=5), module, {})


def test_guard_state_is_checkpointed():
    g = NaNGuard(max_skips=3)
    g.guard.tracker.update(4.0)
    g.guard.budget.take(2, 2)
    h = NaNGuard()
    h.load_state_dict(torch.load(_roundtrip(g.state_dict()), weights_only=True))
    assert h.guard.tracker.average == 4.0 and h.guard.tracker.seen == 1 and h.guard.budget.skipped == [(2, 2)]


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
