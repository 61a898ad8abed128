"""Learning-rate schedules as ``LambdaLR`` factories, configured with ``_partial_: true``; the
LightningModule supplies the optimizer."""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay_factor(
    step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay_fraction: float
) -> float:
    """WSD (Hu et al. 2024, MiniCPM): linear warmup, constant, then linear decay over the last
    ``decay_fraction`` of training."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total_steps - int(decay_fraction * total_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def _warmup_steps(warmup_fraction: float, total_steps: int) -> int:
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"scheduler.warmup_fraction={warmup_fraction}: must be in [0, 1)")
    return max(1, round(warmup_fraction * total_steps))


def warmup_cosine(
    optimizer: Optimizer, warmup_fraction: float, total_steps: int, min_lr_ratio: float = 0.1
) -> LambdaLR:
    warmup_steps = _warmup_steps(warmup_fraction, total_steps)
    return LambdaLR(
        optimizer,
        partial(warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio),
    )


def warmup_stable_decay(
    optimizer: Optimizer,
    warmup_fraction: float,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    decay_fraction: float = 0.2,
) -> LambdaLR:
    warmup_steps = _warmup_steps(warmup_fraction, total_steps)
    return LambdaLR(
        optimizer,
        partial(
            warmup_stable_decay_factor,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
            decay_fraction=decay_fraction,
        ),
    )
