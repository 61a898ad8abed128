"""``trainer=fsdp``'s strategy: FSDP2 (``fully_shard``, applied by ``LMModule.configure_model``:
:func:`bnlit.module.shard`) through Lightning's ``ModelParallelStrategy``, with sharded, asynchronous
checkpoints (:class:`bnlit.checkpointing.ShardedWriter`)."""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from bnlit import lost_rank
from bnlit.checkpointing import ShardedWriter, tmp_name

log = logging.getLogger("bnlit")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, applied by ``LMModule.configure_model``) whose
    checkpoints are sharded and written asynchronously by :class:`bnlit.checkpointing.ShardedWriter`
    (``async_save=False``: the same directories, written before the step loop goes on);
    ``save_distributed_checkpoint=False`` keeps Lightning's full file gathered on rank 0."""

    def __init__(self, async_save: bool = True, save_distributed_checkpoint: bool = True, **kwargs):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.sharded_writer = ShardedWriter(async_save) if save_distributed_checkpoint else None

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
