"""``trainer=fsdp``'s strategy: FSDP2 (``fully_shard``, applied by ``LMModule.configure_model``:
:func:`bnlit.module.shard`) through Lightning's ``ModelParallelStrategy``, with sharded, asynchronous
checkpoints (:class:`bnlit.checkpointing.ShardedWriter`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from bnlit import lost_rank
from bnlit.checkpointing import ShardedWriter, tmp_name

log = logging.getLogger("bnlit")
GRACE_S = 30.0  # from the observer seeing a dead rank to killing the ranks that still run


class LostRankObserver(_ChildProcessObserver):
    """Lightning's child-process observer, but it waits ``grace_s`` before it kills: the main
    process's own exit (after its one line) ends this daemon thread, so the kill only reaches a
    main process that is still running after the grace period, and the children it started."""

    def __init__(self, main_pid: int, child_processes: list, grace_s: float = GRACE_S, sleep_period: float = 5):
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=sleep_period)
        self.grace_s = grace_s

    def _terminate_all(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and lost_rank.process_running(self._main_pid):
            time.sleep(0.1)
        if lost_rank.process_running(self._main_pid):
            super()._terminate_all()


class LostRankLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ``python -m bnlit.train`` with ``devices>1`` whose observer is
    :class:`LostRankObserver` (the rest is Lightning's ``launch``, line for line)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            LostRankObserver(main_pid=os.getpid(), child_processes=self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, applied by ``LMModule.configure_model``) whose
    checkpoints are sharded and written asynchronously by :class:`bnlit.checkpointing.ShardedWriter`
    (``async_save=False``: the same directories, written before the step loop goes on);
    ``save_distributed_checkpoint=False`` keeps Lightning's full file gathered on rank 0."""

    def __init__(self, async_save: bool = True, save_distributed_checkpoint: bool = True, **kwargs):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.sharded_writer = ShardedWriter(async_save) if save_distributed_checkpoint else None

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._launcher is not None:  # not under torchrun or SLURM, which start the ranks themselves
            self._launcher = LostRankLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        lost_rank.record_peers()  # so a rank that dies is named (bnlit/lost_rank.py)
        if self.sharded_writer is not None:
            self.sharded_writer.setup()

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if self.sharded_writer is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        path, tmp = self.broadcast((str(filepath), str(tmp_name(Path(filepath)))))  # rank 0's names
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self.sharded_writer.save(state, checkpoint, Path(path), Path(tmp), self.global_rank)

    def remove_checkpoint(self, filepath) -> None:
        if self.sharded_writer is None:
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self.sharded_writer.remove(filepath)

    def teardown(self) -> None:
        if self.sharded_writer is not None:
            try:  # the last save completes before the process ends
                self.sharded_writer.wait()
            except Exception as e:  # noqa: BLE001 - logged: the exception that ended the run, if any, goes on
                log.error("%s", e)
        super().teardown()
