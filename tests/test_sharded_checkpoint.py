"""``bnlit.checkpointing.ShardedWriter`` (``trainer=fsdp``'s checkpoints) in one process over a gloo
group: an asynchronous save returns before its shards are on disk and holds this step's values,
the checkpoint appears under its name only complete (meta.pt, then the rename), removals wait for
the save in flight, a second save of the same step links, and a save whose write fails leaves the
previous checkpoint as ``ckpt_path=last``. Several ranks, resharding and a killed rank:
tests/test_rehearsal.py and tests/test_dead_rank.py (slow)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from bnlit.checkpointing import (ShardedWriter, checkpoint_step, newest_checkpoint, read_checkpoint,
                                 remove_partial_writes, tmp_name)
from bnlit.errors import CheckpointError


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save(writer: ShardedWriter, path, step: int, w: torch.Tensor) -> None:
    writer.save({"state_dict": {"model.w": w}}, {"global_step": step, "model_config": {}}, path, tmp_name(path), rank=0)


def test_async_save_holds_the_step_and_completes_by_rename(group, tmp_path, monkeypatch):
    gate = threading.Event()
    write_data = FileSystemWriter.write_data

    def held(self, plan, planner):  # the disk is slow: the write waits until the test lets it go
        gate.wait(30)
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    writer = ShardedWriter(async_save=True)
    writer.setup()
    w = torch.ones(8)
    path = tmp_path / "step0000002.ckpt"
    save(writer, path, 2, w)
    w.add_(1)  # the next optimizer step changes the parameter while the save is in flight
    for _ in range(500):  # the writer thread makes the temporary directory, then waits on the disk
        if tmp_name(path).is_dir():
            break
        time.sleep(0.01)
    assert not path.exists() and tmp_name(path).is_dir()  # in flight: not a checkpoint yet
    assert newest_checkpoint(tmp_path) is None
    (tmp_path / "step0000001.ckpt").mkdir()
    writer.remove(tmp_path / "step0000001.ckpt")  # save_top_k's removal waits for the new one
    assert (tmp_path / "step0000001.ckpt").exists()
    gate.set()
    writer.wait()
    assert not (tmp_path / "step0000001.ckpt").exists()
    assert checkpoint_step(path) == 2 and newest_checkpoint(tmp_path) == path
    torch.testing.assert_close(read_checkpoint(path)["state_dict"]["model.w"], torch.ones(8), rtol=0, atol=0)
    assert not tmp_name(path).exists()

    save(writer, tmp_path / "last.ckpt", 2, w)  # ModelCheckpoint's last.ckpt of the same step
    assert os.readlink(tmp_path / "last.ckpt") == "step0000002.ckpt"
    save(writer, tmp_path / "last.ckpt", 3, w)  # a step of its own: a directory replaces the link
    writer.wait()
    assert not (tmp_path / "last.ckpt").is_symlink() and checkpoint_step(tmp_path / "last.ckpt") == 3
    assert checkpoint_step(path) == 2  # the link's target stays
    torch.testing.assert_close(read_checkpoint(tmp_path / "last.ckpt")["state_dict"]["model.w"], 2 * torch.ones(8))
    assert len(writer.blocked_s) == 3


def test_a_failed_write_leaves_the_previous_checkpoint(group, tmp_path, monkeypatch):
    writer = ShardedWriter(async_save=True)
    writer.setup()
    save(writer, tmp_path / "step0000002.ckpt", 2, torch.ones(4))
    writer.wait()

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    save(writer, tmp_path / "step0000004.ckpt", 4, torch.ones(4))
    with pytest.raises(CheckpointError, match="sharded checkpoint save failed .*; the newest earlier checkpoint, step0000002.ckpt at step 2, is intact"):
        writer.wait()
    assert not (tmp_path / "step0000004.ckpt").exists()
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000002.ckpt"
    assert tmp_name(tmp_path / "step0000004.ckpt") in remove_partial_writes(tmp_path)  # the next start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0000002.ckpt"]


def test_sync_save_writes_the_same_directory(group, tmp_path):
    writer = ShardedWriter(async_save=False)
    writer.setup()
    path = tmp_path / "step0000001.ckpt"
    save(writer, path, 1, torch.arange(6.0))
    assert writer.pending is None and checkpoint_step(path) == 1  # on disk when save() returns
    torch.testing.assert_close(read_checkpoint(path)["state_dict"]["model.w"], torch.arange(6.0))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_waits_for_the_asynchronous_interrupt_checkpoint(tmp_path, cache_dir):
    """SIGTERM on a 2-rank ``trainer=fsdp`` run whose disk takes 5 s per shard write: the interrupt
    checkpoint of the step is saved asynchronously, and the process exits (143) only after it is
    complete under its name."""
    from helpers_dist import run_train_cli
    from test_dead_rank import EXACT
    from test_rehearsal import DATA

    run = tmp_path / "run"
    out = run_train_cli(run, *DATA, *EXACT, "+callbacks.term._target_=helpers_faults.SignalAt",
                        "+callbacks.term.step=2", "+callbacks.term.slow_write_s=5", timeout=900)
    assert out.returncode == 143, out.stderr[-4000:]
    assert "interrupted at step 3: saved checkpoints/step0000003.ckpt; resume with ckpt_path=last" in out.stderr
    checkpoints = run / "checkpoints"
    assert checkpoint_step(checkpoints / "step0000003.ckpt") == 3
    assert newest_checkpoint(checkpoints) == checkpoints / "step0000003.ckpt"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]  # nothing left half-written
