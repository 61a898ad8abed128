"""NaN/spike guard: checks every optimizer step's loss and gradient norm before the optimizer
applies it (``bnlit.guard``) and halts the run (``policy: halt``) or drops the batch
(``policy: skip``). Either way no update is ever applied from a bad step, and a checkpoint of
non-finite weights is refused, so the last good checkpoint is never overwritten by a diverged state.

Two ways to keep that promise:

- **On the device** (an optimizer that takes ``found_inf``: fused AdamW, as on ``trainer=h100``;
  not with an fp16 ``GradScaler``, which owns that flag): the verdict is computed on the device
  and handed to the optimizer's ``found_inf``, which makes the fused kernel leave weights,
  moments and step count untouched. Nothing is read to the host until the next logging step
  (``trainer.log_every_n_steps``), a checkpoint or the end of training, where the pending steps
  are read in one copy: ``halt`` raises then, naming the bad step; ``skip`` logs and counts it.
- **On the host** (any other optimizer): the verdict is read every optimizer step and a bad
  batch's gradients are dropped (``p.grad = None``: AdamW skips those parameters entirely).

The spike rule's running average lives on the device in both cases. Under DDP the verdict is
all-reduced (a device tensor), so every rank takes the same decision."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from bnlit.errors import ConfigError
from bnlit.guard import (
    POLICIES,
    DivergenceError,
    SkipBudget,
    SpikeTracker,
    bad_on_device,
    update_on_device,
    verdict,
)

log = logging.getLogger("bnlit")


@dataclass
class _Step:
    step: int
    batch_idx: int
    epoch: int
    bad: torch.Tensor
    values: torch.Tensor  # loss, gradient norm (0: not checked), running average before, good steps before


class NaNGuard(L.Callback):
    """Args:
    policy: ``halt`` (raise, naming the step and batch index) or ``skip``.
    max_skips: batches ``skip`` may drop in a run before it halts anyway.
    spike_factor: a loss above this many times its running average is a spike (null: off).
    spike_warmup: good steps before spikes are judged.
    ema_beta: weight of the past in the running average.
    check_grads: also check the gradient norm (off: only the loss).
    """

    def __init__(self, policy: str = "halt", max_skips: int = 10, spike_factor: float | None = 3.0,
                 spike_warmup: int = 20, ema_beta: float = 0.98, check_grads: bool = True):
        if policy not in POLICIES:
            raise ConfigError(f"callbacks.nan_guard.policy={policy!r}: use one of {list(POLICIES)}")
        self.policy, self.check_grads = policy, check_grads
        self.tracker = SpikeTracker(factor=spike_factor, beta=ema_beta, warmup=spike_warmup)
        self.budget = SkipBudget(max_skips=max_skips)
        self._losses: list[torch.Tensor] = []
        self._batch_idx = -1
        self._average: torch.Tensor | None = None  # the tracker's state on the device
        self._seen: torch.Tensor | None = None
        self._pending: list[_Step] = []
        self.deferred: bool | None = None  # which way the last step was checked (None: not yet)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0 or not self._losses:
            self._losses = []
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        # Lightning divides the loss by accumulate_grad_batches before backward
        self._losses.append(loss.detach().float() * trainer.accumulate_grad_batches)

    @staticmethod
    def _can_defer(trainer, optimizer) -> bool:
        return (getattr(optimizer, "_step_supports_amp_scaling", False)
                and getattr(trainer.precision_plugin, "scaler", None) is None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        self.deferred = self._can_defer(trainer, optimizer)
        if self.deferred:
            optimizer.found_inf = None  # never a stale flag from an earlier step
        if not self._losses:  # manual optimisation or a batch skipped by the module itself
            return
        loss = torch.stack(self._losses).mean()
        self._losses = []
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = None
        if self.check_grads and grads:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            if hasattr(norm, "full_tensor"):  # FSDP2: a norm of sharded DTensor gradients, reduced here
                norm = norm.full_tensor()
            norm = norm.to(loss.device, loss.dtype)
        if self._average is None:
            avg = math.nan if self.tracker.average is None else self.tracker.average
            self._average = torch.tensor(avg, dtype=torch.float32, device=loss.device)
            self._seen = torch.tensor(self.tracker.seen, device=loss.device)
        bad = bad_on_device(loss, norm, self._average, self._seen, self.tracker)
        if trainer.world_size > 1:  # one scalar all-reduce, no host read
            bad = trainer.strategy.reduce(bad.float(), reduce_op="sum") > 0
        unchecked = torch.zeros_like(loss)  # a finite norm: judged by the loss alone
        values = torch.stack([loss, unchecked if norm is None else norm, self._average, self._seen.to(loss.dtype)])
        self._pending.append(_Step(trainer.global_step, self._batch_idx, trainer.current_epoch, bad, values))
        self._average, self._seen = update_on_device(loss, bad, self._average, self._seen, self.tracker.beta)
        if self.deferred:
            # fused AdamW reads it on the device: weights, moments and step count stay untouched
            optimizer.found_inf = bad.float()
            every = trainer.log_every_n_steps
            last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step + 1
            if last or (every and (trainer.global_step + 1) % every == 0):
                self._settle(trainer, pl_module, log_metric=True)
        elif self._settle(trainer, pl_module, log_metric=True):
            for p in pl_module.parameters():
                p.grad = None  # the gradient-flow arbiter does not judge a step without gradients

    def _settle(self, trainer, pl_module, log_metric: bool) -> bool:
        """Read the pending verdicts to the host in one copy; raise for ``halt`` (or a spent
        skip budget), record skips. True if any pending step was bad."""
        if not self._pending:
            return False
        pending, self._pending = self._pending, []
        flags = torch.stack([s.bad for s in pending]).tolist()
        self.tracker.load_state_dict(self._tracker_state())
        any_bad = False
        if any(flags):
            rows = torch.stack([s.values for s in pending]).tolist()
            for s, bad, (loss, norm, avg, seen) in zip(pending, flags, rows):
                if not bad:
                    continue
                any_bad = True
                then = SpikeTracker(self.tracker.factor, self.tracker.beta, self.tracker.warmup,
                                    average=None if int(seen) == 0 else avg, seen=int(seen))
                reason = verdict(loss, norm, then) or "bad loss or gradient on another rank"
                where = f"step {s.step}, batch index {s.batch_idx} (epoch {s.epoch})"
                if self.policy == "skip":
                    if self.budget.take(s.step, s.batch_idx):
                        log.warning("nan_guard: skipped %s: %s (%d of max_skips=%d)", where, reason,
                                    len(self.budget.skipped), self.budget.max_skips)
                        continue
                    raise DivergenceError(f"{reason} at {where} after skipping max_skips={self.budget.max_skips} "
                                          "batches; lower optimizer.lr or inspect the data, then resume with "
                                          "ckpt_path=last")
                raise DivergenceError(f"{reason} at {where}; the last good checkpoint is untouched; resume with "
                                      "ckpt_path=last and a lower optimizer.lr, or set callbacks.nan_guard.policy=skip")
        if log_metric and self.policy == "skip":
            pl_module.log("guard/skipped_batches", float(len(self.budget.skipped)), rank_zero_only=True)
        return any_bad

    def _tracker_state(self) -> dict:
        if self._average is None:
            return self.tracker.state_dict()
        avg, seen = torch.stack([self._average, self._seen.to(self._average.dtype)]).tolist()
        return {"average": None if int(seen) == 0 else avg, "seen": int(seen)}

    def on_train_end(self, trainer, pl_module) -> None:
        self._settle(trainer, pl_module, log_metric=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._settle(trainer, pl_module, log_metric=False)  # a pending bad step halts before anything is written
        bad = [n for n, p in pl_module.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise DivergenceError(f"parameters {bad[:3]} are not finite at step {trainer.global_step}; refusing to "
                                  "overwrite the last good checkpoint; resume from it with ckpt_path=last")

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self._tracker_state(), "skipped": [list(s) for s in self.budget.skipped]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict["tracker"])
        self._average = self._seen = None  # rebuilt on the device from the tracker at the next step
        self.budget.skipped = [tuple(s) for s in state_dict["skipped"]]
