"""The training progress bar counts the run's optimizer steps (``37/500``, :func:`bnlit.progress.run_total_steps`)
with the run's ETA, across epoch boundaries (Lightning's own bar counts the current epoch's batches).
A resumed run starts at its checkpoint's step; ``smoothing=0`` makes the ETA the pace seen so far."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from bnlit.progress import run_total_steps


class RunProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose training bar is ``global_step / run_total_steps`` with the epoch
    in its description; the validation bar is Lightning's."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar = self.train_progress_bar
        bar.reset(total=run_total_steps(trainer))
        bar.initial = bar.n = trainer.global_step  # a resumed run starts where its checkpoint was
        bar.set_description("Training")
        self._shown = trainer.global_step

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description(f"Training (epoch {trainer.current_epoch})")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step, bar = trainer.global_step, self.train_progress_bar
        if step == self._shown or bar.disable:  # accumulating: no optimizer step yet
            return
        if step % self.refresh_rate == 0 or step == bar.total:
            self._shown = step
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
