"""``Pace``, a test-only callback that training processes import (``+callbacks.pace._target_=pace.Pace``):
a module of its own, so that importing it does not run ``conftest.py``, which sets torch's thread
count for the test process."""

from __future__ import annotations

import os
import time

import lightning as L


class Pace(L.Callback):
    """Slow each step down, so a preemption lands mid-run; with ``first_run_only`` a requeued job
    (``SLURM_RESTART_COUNT`` > 0) runs at full speed."""

    def __init__(self, seconds: float, first_run_only: bool = False):
        self.seconds = seconds
        if first_run_only and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            self.seconds = 0.0

    def on_train_batch_end(self, *args, **kwargs):
        time.sleep(self.seconds)
