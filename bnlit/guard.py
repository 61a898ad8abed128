"""Divergence checks behind the NaN/spike guard (``callbacks/nan_guard.py``): a step is bad when
its loss or gradient norm is not finite, or its loss exceeds ``spike_factor`` times the running
average of the good losses before it (after ``warmup`` good steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bnlit.errors import BnlitError

POLICIES = ("halt", "skip")


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
