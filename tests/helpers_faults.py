"""Faults planted into real runs: a callback that turns one batch's logits into NaN (or scales
them), importable by a ``_target_`` from a ``python -m bnlit.train`` run in a fresh process."""

from __future__ import annotations

import math

import lightning as L


class Poison(L.Callback):
    """Test-only: multiply the logits of batch ``batch_idx`` by ``scale`` (NaN by default) and
    snapshot the weights around that batch."""

    def __init__(self, batch_idx: int, scale: float = math.nan):
        self.batch_idx, self.scale = batch_idx, scale
        self.handle = None
        self.before = self.after = None
        Poison.last = self

    def _snapshot(self, pl_module):
        return [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            self.before = self._snapshot(pl_module)
            self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * self.scale)
        elif batch_idx == self.batch_idx + 1:
            self.after = self._snapshot(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class KillRank(L.Callback):
    """Test-only: SIGKILL rank ``rank`` at optimizer step ``step``: ``where="step"`` between its
    forward and backward (the other ranks are then in the step's collectives), ``where="save"``
    while the asynchronous checkpoint save of that step writes its shards."""

    def __init__(self, rank: int, step: int, where: str = "step", stamp: str | None = None):
        self.rank, self.step, self.where, self.stamp = rank, step, where, stamp

    def _die(self):
        import os
        import signal
        import time

        if self.stamp:  # when it died, for the test's time bound
            with open(self.stamp, "w") as f:
                f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_before_backward(self, trainer, pl_module, loss):
        if self.where == "step" and trainer.global_rank == self.rank and trainer.global_step == self.step:
            self._die()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # before ModelCheckpoint's save of this step (callbacks run in order; ModelCheckpoint last)
        if self.where == "save" and trainer.global_rank == self.rank and trainer.global_step == self.step:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            write_data, die = FileSystemWriter.write_data, self._die

            def dying(writer, plan, planner):
                die()
                return write_data(writer, plan, planner)

            FileSystemWriter.write_data = dying


class SignalAt(L.Callback):
    """Test-only: rank ``rank`` sends itself ``signum`` (SIGTERM) during optimizer step ``step``,
    and every rank's checkpoint writes take ``slow_write_s`` longer (a slow disk), so the interrupt
    checkpoint is still being written when the run starts to stop."""

    def __init__(self, step: int, rank: int = 0, signum: int = 15, slow_write_s: float = 0.0):
        self.step, self.rank, self.signum, self.slow_write_s = step, rank, signum, slow_write_s

    def on_train_start(self, trainer, pl_module):
        if self.slow_write_s:
            import time

            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            write_data, pause = FileSystemWriter.write_data, self.slow_write_s

            def slow(writer, plan, planner):
                time.sleep(pause)
                return write_data(writer, plan, planner)

            FileSystemWriter.write_data = slow

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os

            os.kill(os.getpid(), self.signum)
