"""No host sync on the hot path: a real fit on CPU with every host read of a tensor counted per
optimizer step (``Tensor.item/tolist/__bool__/__float__/__int__/cpu/numpy`` and
``torch.cuda.synchronize``, each of which would drain the CUDA queue on a GPU). Steps that log
nothing must read nothing; the NaN guard's verdict stays on the device (fused AdamW's
``found_inf``) until a logging step, and a bad step still never reaches the weights."""

from __future__ import annotations

import math
import traceback
from collections import Counter

import lightning as L
import pytest
import torch

from bnlit.checks.nan_guard import DivergenceError
from bnlit.train import train

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


class SyncCounter(L.Callback):
    """Test-only: host reads per optimizer step (``steps[global_step]``), counted from the start of
    a step's first micro-batch to the end of its last one."""

    last = None

    def __init__(self):
        self.steps: Counter[int] = Counter()
        self.where: dict[int, list[str]] = {}
        self.active = False
        SyncCounter.last = self

    def count(self, name: str) -> None:
        if self.active:
            self.steps[self.step] += 1
            caller = next(f for f in traceback.extract_stack()[::-1][2:] if "test_host_sync" not in f.filename)
            self.where.setdefault(self.step, []).append(f"{name} at {caller.filename.split('site-packages/')[-1]}:{caller.lineno}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step, self.active = trainer.global_step, True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.active = False


@pytest.fixture
def counted(monkeypatch):
    def wrap(owner, name):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            if SyncCounter.last is not None:
                SyncCounter.last.count(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    for name in HOST_READS:
        wrap(torch.Tensor, name)
    wrap(torch.cuda, "synchronize")
    yield
    SyncCounter.last = None


# the arbiter's every-step sentinel reads its flag every step on CPU only (on CUDA on logging
# steps: callbacks/gradient_flow.py); everything else of the default run is counted
FAST = ["optimizer=adamw", "optimizer.fused=true", "trainer.log_every_n_steps=4", "trainer.max_steps=8",
        "callbacks.gradient_flow.sentinel=false",
        "callbacks.model_checkpoint.every_n_train_steps=100", "trainer.val_check_interval=100",
        "+callbacks.sync_counter._target_=test_host_sync.SyncCounter"]


def test_steps_that_log_nothing_read_nothing_from_the_device(make_cfg, counted):
    train(make_cfg(*FAST, "trainer.accumulate_grad_batches=2"))
    counter = SyncCounter.last
    quiet = [s for s in range(8) if (s + 1) % 4 and s != 0]  # global step 0: the arbiter's first check
    assert {s: counter.where.get(s) for s in quiet if counter.steps[s]} == {}
    assert counter.steps[3] > 0 and counter.steps[7] > 0  # logging steps do read: the counter works


POISON = ["+callbacks.poison._target_=helpers_faults.Poison", "+callbacks.poison.batch_idx=2"]
DEFERRED = ["optimizer=adamw", "optimizer.fused=true", "trainer.log_every_n_steps=4", "trainer.max_steps=8",
            "callbacks.model_checkpoint.every_n_train_steps=100", "trainer.val_check_interval=100"]


def test_device_side_guard_halts_at_the_next_logging_step_with_the_bad_step_never_applied(make_cfg):
    from helpers_faults import Poison

    with pytest.raises(DivergenceError, match=r"^non-finite loss \(nan\) at step 2, batch index 2 \(epoch 0\); "
                                              r"the last good checkpoint is untouched"):
        train(make_cfg(*POISON, *DEFERRED))
    p = Poison.last
    assert p.after is not None  # step 3 ran: the verdict was read at logging step 3, not at step 2
    assert all(torch.equal(a, b) for a, b in zip(p.before, p.after))  # fused AdamW skipped step 2 on the device


def test_device_side_guard_skip_policy_keeps_weights_and_training_going(make_cfg, caplog):
    import logging

    from helpers_faults import Poison

    with caplog.at_level(logging.WARNING, logger="bnlit"):
        metrics = train(make_cfg(*POISON, *DEFERRED, "callbacks.nan_guard.policy=skip"))
    assert math.isfinite(metrics["train/loss"]) and metrics["guard/skipped_batches"] == 1.0
    p = Poison.last
    assert all(torch.equal(a, b) for a, b in zip(p.before, p.after))
    assert "nan_guard: skipped step 2, batch index 2 (epoch 0): non-finite loss (nan) (1 of max_skips=10)" in caplog.text
