"""``ThreadsFollowLoad``: with ``threads: auto``, re-choose torch's CPU thread count during the run
as the machine's load changes (:func:`bnlit.speed.threads.rechoose_threads`), not only at start.

The start-time choice (:func:`bnlit.speed.threads.set_threads`) sees the load of a moment; a run
that started on an idle machine keeps every core when other jobs arrive, and each extra OpenMP
thread then waits at every barrier for a core another job holds
(docs/getting-started.md "Threads and load": 2 threads 1.8-2.0x slower than 1 at a load of 7-30
on 2 cores). Every ``every_n_steps`` optimizer steps this callback reads the 1-minute load average
and applies the new count when it differs, logging the change and why. A pinned ``threads=N``, a
non-CPU accelerator or an OS without a load average: nothing to do."""

from __future__ import annotations

import logging

import lightning as L
import torch

from bnlit.errors import ConfigError
from bnlit.speed.threads import available_cpus, load_average, rechoose_threads

log = logging.getLogger("bnlit")


class ThreadsFollowLoad(L.Callback):
    """Args:
    setting: the run's ``threads`` value (``auto`` or an integer; only ``auto`` is followed).
    every_n_steps: optimizer steps between two looks at the load average.
    """

    def __init__(self, setting: int | str = "auto", every_n_steps: int = 50):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ConfigError(f"callbacks.threads.every_n_steps={every_n_steps!r}: use an integer >= 1, e.g. 50")
        self.active = setting == "auto"
        self.every_n_steps = every_n_steps
        self.changes: list[tuple[int, int, int]] = []  # (step, old, new)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if not self.active or pl_module.device.type != "cpu" or step == 0 or step % self.every_n_steps:
            return
        load = load_average()
        if load is None:
            return
        current = torch.get_num_threads()
        n, why = rechoose_threads(available_cpus(), load, current)
        if n != current:
            torch.set_num_threads(n)
            self.changes.append((step, current, n))
            log.info("threads: %d -> %d at step %d (%s)", current, n, step, why)
