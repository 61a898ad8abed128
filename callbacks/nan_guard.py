"""NaN/spike guard: checks every optimizer step's loss and gradient norm before the optimizer
applies it (``bnlit.guard.verdict``) and halts the run (``policy: halt``) or drops the batch
(``policy: skip``: gradients are discarded, so AdamW leaves weights and moments untouched; the
step counter and LR schedule still advance). It also refuses to write a checkpoint of
non-finite weights, so the last good checkpoint is never overwritten by a diverged state.

Cost: one device-to-host copy of two scalars per optimizer step, plus one all-reduce of a flag
under DDP so every rank takes the same decision."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from bnlit.errors import ConfigError
from bnlit.guard import POLICIES, DivergenceError, SkipBudget, SpikeTracker, verdict

log = logging.getLogger("bnlit")


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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0 or not self._losses:
            self._losses = []
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        # Lightning divides the loss by accumulate_grad_batches before backward
        self._losses.append(loss.detach().float() * trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self._losses:  # manual optimisation or a batch skipped by the module itself
            return
        loss = torch.stack(self._losses).mean()
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if self.check_grads and grads:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            if hasattr(norm, "full_tensor"):  # FSDP2: a norm of sharded DTensor gradients, reduced here
                norm = norm.full_tensor()
            loss_v, norm_v = torch.stack([loss, norm.to(loss.device, loss.dtype)]).tolist()
        else:
            loss_v, norm_v = loss.item(), None
        self._losses = []
        reason = verdict(loss_v, norm_v, self.tracker)
        if trainer.world_size > 1:
            bad_anywhere = trainer.strategy.reduce_boolean_decision(reason is not None, all=False)
            if bad_anywhere and reason is None:
                reason = "bad loss or gradient on another rank"
        step, batch = trainer.global_step, self._batch_idx
        if reason is None:
            self.tracker.update(loss_v)
            if self.policy == "skip":
                pl_module.log("guard/skipped_batches", float(len(self.budget.skipped)), rank_zero_only=True)
            return
        where = f"step {step}, batch index {batch} (epoch {trainer.current_epoch})"
        if self.policy == "skip":
            if self.budget.take(step, batch):
                for p in pl_module.parameters():
                    p.grad = None
                log.warning("nan_guard: skipped %s: %s (%d of max_skips=%d)", where, reason,
                            len(self.budget.skipped), self.budget.max_skips)
                pl_module.log("guard/skipped_batches", float(len(self.budget.skipped)), rank_zero_only=True)
                return
            raise DivergenceError(f"{reason} at {where} after skipping max_skips={self.budget.max_skips} batches; "
                                  "lower optimizer.lr or inspect the data, then resume with ckpt_path=last")
        raise DivergenceError(f"{reason} at {where}; the last good checkpoint is untouched; resume with "
                              "ckpt_path=last and a lower optimizer.lr, or set callbacks.nan_guard.policy=skip")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        bad = [n for n, p in pl_module.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise DivergenceError(f"parameters {bad[:3]} are not finite at step {trainer.global_step}; refusing to "
                                  "overwrite the last good checkpoint; resume from it with ckpt_path=last")

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict(), "skipped": [list(s) for s in self.budget.skipped]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict["tracker"])
        self.budget.skipped = [tuple(s) for s in state_dict["skipped"]]
