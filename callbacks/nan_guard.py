"""NaN/spike guard: checks every optimizer step's loss and gradient norm before the optimizer
applies it and halts the run (``policy: halt``) or drops the batch (``policy: skip``); a thin
adapter over :mod:`bnlit.checks.nan_guard`, whose docstring says how the verdict stays on the device (an
optimizer with ``found_inf``) or is read on the host (any other optimizer)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from bnlit.checks.nan_guard import SkipBudget, SpikeTracker, StepGuard, check_finite_parameters, grad_norm, settle_due


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
        self.policy, self.check_grads = policy, check_grads
        self.guard = StepGuard(policy, SpikeTracker(factor=spike_factor, beta=ema_beta, warmup=spike_warmup),
                               SkipBudget(max_skips=max_skips))
        self._losses: list[torch.Tensor] = []
        self._batch_idx = -1
        self.deferred: bool | None = None  # which way the last step was checked (None: not yet)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0 or not self._losses:
            self._losses = []
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        # Lightning divides the loss by accumulate_grad_batches before backward
        self._losses.append(loss.detach().float() * trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        self.deferred = (getattr(optimizer, "_step_supports_amp_scaling", False)
                         and getattr(trainer.precision_plugin, "scaler", None) is None)
        if self.deferred:
            optimizer.found_inf = None  # never a stale flag from an earlier step
        if not self._losses:  # manual optimisation or a batch skipped by the module itself
            return
        loss, self._losses = torch.stack(self._losses).mean(), []
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        norm = grad_norm(grads, loss) if self.check_grads and grads else None
        reduce = (lambda t: trainer.strategy.reduce(t, reduce_op="sum")) if trainer.world_size > 1 else None
        bad = self.guard.judge(loss, norm, (trainer.global_step, self._batch_idx, trainer.current_epoch), reduce)
        if self.deferred:
            # fused AdamW reads it on the device: weights, moments and step count stay untouched
            optimizer.found_inf = bad.float()
            if settle_due(trainer.global_step, trainer.log_every_n_steps, trainer.max_steps):
                self._settle(pl_module, log_metric=True)
        elif self._settle(pl_module, log_metric=True):
            for p in pl_module.parameters():
                p.grad = None  # the gradient-flow arbiter does not judge a step without gradients

    def _settle(self, pl_module, log_metric: bool) -> bool:
        any_bad = self.guard.settle()
        if log_metric and self.policy == "skip":
            pl_module.log("guard/skipped_batches", float(len(self.guard.budget.skipped)), rank_zero_only=True)
        return any_bad

    def on_train_end(self, trainer, pl_module) -> None:
        self._settle(pl_module, log_metric=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._settle(pl_module, log_metric=False)  # a pending bad step halts before anything is written
        check_finite_parameters(pl_module.named_parameters(), trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.guard.load_state_dict(state_dict)
