"""``InterruptCheckpoint``: on SIGTERM, SIGUSR1/2 or Ctrl-C finish the optimizer step, write an
atomic checkpoint of it, flush the loggers and stop (a SLURM job on a requeue signal is requeued);
the signal bookkeeping is :mod:`bnlit.interrupt` (cost: its docstring), the checkpoint files :mod:`bnlit.checkpointing`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from bnlit.checkpointing import adopt_step_checkpoints, newest_step, step_checkpoint_path
from bnlit.interrupt import Interrupted, SignalLatch, agree, requeue_slurm_job, signal_number

log = logging.getLogger("bnlit")


class InterruptCheckpoint(L.Callback):
    """Args:
    dirpath: where the interrupt checkpoint goes when no ``ModelCheckpoint`` names the place and
        file name (normally it is ``ModelCheckpoint.format_checkpoint_name``: ``step0000037.ckpt``).
    signals: the signals that stop a run with a checkpoint.
    requeue_signals: those of them after which a SLURM job is requeued (SLURM's ``--signal``
        before the time limit; a job preempted with ``scontrol requeue`` is requeued by SLURM).
    """

    def __init__(self, dirpath: str, signals=("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"),
                 requeue_signals=("SIGUSR1", "SIGUSR2")):
        self.dirpath = Path(dirpath)
        self.latch = SignalLatch(signals)
        self.requeue = {signal_number(s) for s in requeue_signals}
        self._step = -1
        self._stop: Interrupted | None = None
        self._saved = False  # a checkpoint was written at the step that just ended

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # before Lightning installs its SIGTERM/SLURM handlers: the program's own
            self.latch.remember_outer()

    def on_train_start(self, trainer, pl_module) -> None:
        self.latch.install()  # after Lightning's: this one decides
        self._step = trainer.global_step
        checkpoint_cb = trainer.checkpoint_callback
        if isinstance(checkpoint_cb, ModelCheckpoint):
            adopt_step_checkpoints(checkpoint_cb, self.dirpath, trainer.global_step, delete=trainer.is_global_zero)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._step:  # inside a gradient accumulation: not a step boundary
            return
        self._step = trainer.global_step
        signum = agree(self.latch.received or 0, trainer.strategy)
        if not signum or self._stop is not None:
            return
        path = step_checkpoint_path(trainer.checkpoint_callback, self.dirpath, trainer.global_step,
                                    trainer.current_epoch)
        trainer.save_checkpoint(path)  # every rank takes part; rank zero writes, atomically
        # raised at the next hook, once Lightning has logged this step's metrics; a run whose
        # last step this was simply finishes
        self._stop = Interrupted(signum, trainer.global_step, path, rank_zero=trainer.is_global_zero,
                                 then=lambda: self._after(trainer, signum))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._stop is not None:
            raise self._stop
        if self._saved:  # the checkpointed step's own row is logged after its save: flushed here
            self._saved = False
            for lg in trainer.loggers:
                lg.save()

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._stop is not None and trainer.state.fn == "fit":  # no validation on the way out
            raise self._stop

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        for lg in trainer.loggers:  # the metrics up to a checkpoint survive a SIGKILL after it
            lg.save()
        self._saved = True

    def on_train_end(self, trainer, pl_module) -> None:
        """No optimizer step is left: the latch hands the signals back (to ``bnlit.interrupt.StopAtOnce``
        in a ``bnlit.train`` run, which stops the end-of-training reports at once), and a signal
        latched after the last step's checkpoint decision stops the run here, not never."""
        signum = agree(self.latch.received or 0, trainer.strategy)
        self.latch.restore()
        if not signum or self._stop is not None:
            return
        step, path = newest_step(self.dirpath)
        if path is None or step != trainer.global_step:  # the last steps are not saved yet
            path = step_checkpoint_path(trainer.checkpoint_callback, self.dirpath, trainer.global_step,
                                        trainer.current_epoch)
            trainer.save_checkpoint(path)
        raise Interrupted(signum, trainer.global_step, path, rank_zero=trainer.is_global_zero,
                          then=lambda: self._after(trainer, signum))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.latch.restore()

    def _after(self, trainer, signum: int) -> None:
        """After the checkpoint: hand the signal to the program's own handler (submitit requeues
        its job there), or requeue a plain SLURM job on a requeue signal."""
        if not self.latch.chain() and signum in self.requeue and "SLURM_JOB_ID" in os.environ \
                and trainer.is_global_zero:
            requeue_slurm_job()
