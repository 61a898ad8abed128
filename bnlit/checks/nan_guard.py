"""Divergence checks behind the NaN/spike guard (``callbacks/nan_guard.py``): a step is bad when
its loss or gradient norm is not finite, or its loss exceeds ``spike_factor`` times the running
average of the good losses before it (after ``warmup`` good steps).

``halt`` raises, naming the step and batch index; ``skip`` drops the batch (up to ``max_skips``).
Either way no update is ever applied from a bad step, and a checkpoint of non-finite weights is
refused, so the last good checkpoint is never overwritten by a diverged state. Two ways to keep
that promise (:class:`StepGuard` serves both):

- **On the device** (an optimizer that takes ``found_inf``: fused AdamW, as on ``trainer=h100``;
  not with an fp16 ``GradScaler``, which owns that flag): the verdict is computed on the device
  and handed to the optimizer's ``found_inf``, which makes the fused kernel leave weights,
  moments and step count untouched. Nothing is read to the host until the next logging step, a
  checkpoint or the end of training, where the pending steps are read in one copy
  (:meth:`StepGuard.settle`): ``halt`` raises then, naming the bad step; ``skip`` logs and counts it.
- **On the host** (any other optimizer): the verdict is read every optimizer step and a bad
  batch's gradients are dropped (``p.grad = None``: AdamW skips those parameters entirely).

The spike rule's running average lives on the device in both cases. Under DDP the verdict is
all-reduced (a device tensor), so every rank takes the same decision."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bnlit.errors import BnlitError, ConfigError

POLICIES = ("halt", "skip")
log = logging.getLogger("bnlit")


class DivergenceError(BnlitError):
    """Training produced a non-finite or spiking loss or gradient."""

    exit_code = 3


@dataclass
class SpikeTracker:
    """Exponential running average of the accepted losses.

    Args:
        factor: a loss above ``factor * average`` is a spike (``None`` or <= 0 disables it).
        beta: weight of the past in the running average.
        warmup: good steps seen before spikes are judged (the first losses fall fast).
    """

    factor: float | None = 3.0
    beta: float = 0.98
    warmup: int = 20
    average: float | None = None
    seen: int = 0

    def update(self, loss: float) -> None:
        self.average = loss if self.average is None else self.beta * self.average + (1 - self.beta) * loss
        self.seen += 1

    def state_dict(self) -> dict:
        return {"average": self.average, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.average, self.seen = state["average"], state["seen"]


def verdict(loss: float, grad_norm: float | None, tracker: SpikeTracker) -> str | None:
    """Why this step is bad (a short phrase), or None if it is good."""
    if not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return f"non-finite gradient norm ({grad_norm})"
    if (tracker.factor and tracker.factor > 0 and tracker.average is not None and tracker.seen >= tracker.warmup
            and loss > tracker.factor * tracker.average):
        return f"loss spike ({loss:.4g} > {tracker.factor:g} x running average {tracker.average:.4g})"
    return None


def bad_on_device(loss: torch.Tensor, grad_norm: torch.Tensor | None, average: torch.Tensor, seen: torch.Tensor,
                  tracker: SpikeTracker) -> torch.Tensor:
    """:func:`verdict` as a 0-dim bool tensor on the loss's device, without a host read:
    ``average`` and ``seen`` are the tracker's state kept on the device (``average`` is NaN before
    the first good step)."""
    bad = ~torch.isfinite(loss)
    if grad_norm is not None:
        bad = bad | ~torch.isfinite(grad_norm)
    if tracker.factor and tracker.factor > 0:
        bad = bad | ((seen >= max(tracker.warmup, 1)) & (loss > tracker.factor * average))
    return bad


def update_on_device(loss: torch.Tensor, bad: torch.Tensor, average: torch.Tensor, seen: torch.Tensor,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`SpikeTracker.update` on the device, applied only when the step is good."""
    new = torch.where(seen == 0, loss, beta * average + (1 - beta) * loss)
    return torch.where(bad, average, new), seen + (~bad).long()


@dataclass
class SkipBudget:
    """How many bad batches ``policy: skip`` may drop before the run halts anyway."""

    max_skips: int = 10
    skipped: list[tuple[int, int]] = field(default_factory=list)  # (step, batch index)

    def take(self, step: int, batch_idx: int) -> bool:
        """Record a skip; False once the budget is spent."""
        if len(self.skipped) >= self.max_skips:
            return False
        self.skipped.append((step, batch_idx))
        return True


@dataclass
class PendingStep:
    step: int
    batch_idx: int
    epoch: int
    bad: torch.Tensor
    values: torch.Tensor  # loss, gradient norm (0: not checked), running average before, good steps before


def grad_norm(grads: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The total L2 norm of ``grads`` on ``like``'s device and dtype (FSDP2 shards reduced)."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):  # FSDP2: a norm of sharded DTensor gradients, reduced here
        norm = norm.full_tensor()
    return norm.to(like.device, like.dtype)


class StepGuard:
    """The guard's state: the spike tracker (kept on the device between settles), the skip budget
    and the steps judged on the device but not yet read to the host."""

    def __init__(self, policy: str, tracker: SpikeTracker, budget: SkipBudget):
        if policy not in POLICIES:
            raise ConfigError(f"callbacks.nan_guard.policy={policy!r}: use one of {list(POLICIES)}")
        self.policy, self.tracker, self.budget = policy, tracker, budget
        self._average: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        self.pending: list[PendingStep] = []

    def judge(self, loss: torch.Tensor, norm: torch.Tensor | None, where: tuple[int, int, int],
              reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The step's verdict as a device bool (``reduce``: the sum over ranks), kept pending;
        ``where`` is (step, batch index, epoch)."""
        if self._average is None:
            avg = math.nan if self.tracker.average is None else self.tracker.average
            self._average = torch.tensor(avg, dtype=torch.float32, device=loss.device)
            self._seen = torch.tensor(self.tracker.seen, device=loss.device)
        bad = bad_on_device(loss, norm, self._average, self._seen, self.tracker)
        if reduce is not None:  # one scalar all-reduce, no host read
            bad = reduce(bad.float()) > 0
        unchecked = torch.zeros_like(loss)  # a finite norm: judged by the loss alone
        values = torch.stack([loss, unchecked if norm is None else norm, self._average, self._seen.to(loss.dtype)])
        self.pending.append(PendingStep(*where, bad, values))
        self._average, self._seen = update_on_device(loss, bad, self._average, self._seen, self.tracker.beta)
        return bad

    def settle(self) -> bool:
        """Read the pending verdicts to the host in one copy; raise for ``halt`` (or a spent skip
        budget), record skips. True if any pending step was bad."""
        if not self.pending:
            return False
        pending, self.pending = self.pending, []
        flags = torch.stack([s.bad for s in pending]).tolist()
        self.tracker.load_state_dict(self.tracker_state())
        if not any(flags):
            return False
        rows = torch.stack([s.values for s in pending]).tolist()
        for s, (loss, norm, avg, seen) in ((s, r) for s, bad, r in zip(pending, flags, rows) if bad):
            then = SpikeTracker(self.tracker.factor, self.tracker.beta, self.tracker.warmup,
                                average=None if int(seen) == 0 else avg, seen=int(seen))
            reason = verdict(loss, norm, then) or "bad loss or gradient on another rank"
            where = f"step {s.step}, batch index {s.batch_idx} (epoch {s.epoch})"
            if self.policy == "halt":
                raise DivergenceError(f"{reason} at {where}; the last good checkpoint is untouched; resume with "
                                      "ckpt_path=last and a lower optimizer.lr, or set callbacks.nan_guard.policy=skip")
            if not self.budget.take(s.step, s.batch_idx):
                raise DivergenceError(f"{reason} at {where} after skipping max_skips={self.budget.max_skips} "
                                      "batches; lower optimizer.lr or inspect the data, then resume with ckpt_path=last")
            log.warning("nan_guard: skipped %s: %s (%d of max_skips=%d)", where, reason,
                        len(self.budget.skipped), self.budget.max_skips)
        return True

    def tracker_state(self) -> dict:
        if self._average is None:
            return self.tracker.state_dict()
        avg, seen = torch.stack([self._average, self._seen.to(self._average.dtype)]).tolist()
        return {"average": None if int(seen) == 0 else avg, "seen": int(seen)}

    def state_dict(self) -> dict:
        return {"tracker": self.tracker_state(), "skipped": [list(s) for s in self.budget.skipped]}

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self._average = self._seen = None  # rebuilt on the device from the tracker at the next step
        self.budget.skipped = [tuple(s) for s in state["skipped"]]


def settle_due(step: int, log_every_n_steps: int, max_steps: int | None) -> bool:
    """Whether the verdicts kept on the device are read at optimizer step ``step`` (0-based, about
    to be taken): on logging steps and the run's last step."""
    last = max_steps is not None and 0 < max_steps <= step + 1
    return last or bool(log_every_n_steps and (step + 1) % log_every_n_steps == 0)


def check_finite_parameters(named_parameters, step: int) -> None:
    """Refuse to write a checkpoint of non-finite parameters over the last good one."""
    bad = [n for n, p in named_parameters if not torch.isfinite(p).all()]
    if bad:
        raise DivergenceError(f"parameters {bad[:3]} are not finite at step {step}; refusing to "
                              "overwrite the last good checkpoint; resume from it with ckpt_path=last")
