"""Exact resume: a run SIGKILLed after a checkpoint and resumed with ``ckpt_path=last`` logs the
same ``train/loss``, bit for bit, as an uninterrupted run; checkpoint writes are atomic; the
sampler position survives a change of world size or is refused in one line."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from bnlit.checkpointing import AtomicCheckpointIO
from bnlit.data.datamodule import rng_state, set_rng_state
from bnlit.data.dataset import MixtureSampler, reshard_start, resume_start
from bnlit.errors import CheckpointError
from bnlit.train import train
from conftest import TINY
from helpers_dist import run_train_cli, train_losses

TESTS = Path(__file__).parent
STEPS = ["trainer.max_steps=8", "callbacks.model_checkpoint.every_n_train_steps=3", "trainer.val_check_interval=4"]


class KillAt(L.Callback):
    """Test-only: SIGKILL this process as batch ``step`` starts (a checkpoint was saved before)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def run_cli(run_dir: Path, *overrides: str):
    return run_train_cli(run_dir, *TINY, *STEPS, *overrides)



@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path, cache_dir):
    ref = run_cli(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-2000:]
    expected = train_losses(tmp_path / "ref")
    assert sorted(expected) == list(range(8))

    run = tmp_path / "killed"
    out = run_cli(run, "+callbacks.kill._target_=test_resume.KillAt", "+callbacks.kill.step=5")
    assert out.returncode == -signal.SIGKILL
    ckpts = run / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 3
    assert not list(ckpts.glob(".*tmp*"))
    (run / "csv" / "metrics.csv").unlink(missing_ok=True)  # keep only what the resumed run logs

    resumed = run_cli(run, "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = train_losses(run)
    assert sorted(got) == [2, 3, 4, 5, 6, 7]  # 2: the checkpoint's own row (step 3's), which it carries
    assert {s: expected[s] for s in got} == got  # exact float equality, every later step


def test_position_is_checkpointed_and_a_changed_global_batch_is_refused(make_cfg, tmp_path):
    cfg = make_cfg()  # 4 steps of 4 windows, a checkpoint every 2 steps
    train(cfg)
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    state = ckpt["BnDataModule"]
    assert ckpt["global_step"] == 4
    assert state["position"] == {"epoch": 0, "samples_per_rank": 4 * 4, "world_size": 1, "batch_size": 4}
    assert len(state["rng"]) == 1 and state["rng"][0]["torch"].dtype == torch.uint8
    assert "tokenizer_model" in state and "tokenizer_sha256" in state
    # a larger per-rank batch on the same single rank changes the global batch: refused in one line
    with pytest.raises(CheckpointError, match=r"1 ranks x data.batch_size=4; this run has 1 x 8; resume with "
                                              r"the same global batch \(ranks x data.batch_size = 4\)"):
        train(make_cfg("trainer.max_steps=6", "data.batch_size=8", "ckpt_path=last", run_dir=Path(cfg.paths.output_dir)))
    assert torch.load(last, weights_only=True)["global_step"] == 4  # untouched


def test_resume_start_reshards_only_with_the_same_global_batch():
    pos = {"epoch": 0, "samples_per_rank": 8, "world_size": 2, "batch_size": 4}
    assert resume_start(pos, world_size=2, batch_size=4) == 8
    assert resume_start(pos, world_size=1, batch_size=8) == 16
    assert resume_start(pos, world_size=4, batch_size=2) == 4
    with pytest.raises(CheckpointError, match="same global batch"):
        resume_start(pos, world_size=1, batch_size=4)


def test_resharded_sampler_continues_the_global_order_exactly():
    sizes, weights = [53, 29], [0.7, 0.3]
    full = list(MixtureSampler(sizes, weights, seed=5))
    two = [MixtureSampler(sizes, weights, seed=5, rank=r, world_size=2) for r in range(2)]
    consumed = sorted(i for s in two for i in list(s)[:6])  # each of 2 ranks read 6 samples
    one = MixtureSampler(sizes, weights, seed=5)
    one.start = reshard_start(6, old_world=2, new_world=1)
    rest = list(one)
    assert sorted(full[:12]) == consumed and rest == full[12:]  # nothing replayed, nothing skipped
    three = [MixtureSampler(sizes, weights, seed=5, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.start = reshard_start(6, old_world=2, new_world=3)
    assert sorted(i for s in three for i in s) == sorted(full[12:81])  # 82 -> 81: a multiple of 3
    with pytest.raises(ValueError, match="cannot be split evenly"):
        reshard_start(5, old_world=2, new_world=4)


def test_rng_state_roundtrips_through_weights_only_load(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


class FullDisk(AtomicCheckpointIO):
    """Writes half of the checkpoint, then fails as a full disk does."""

    def _serialize(self, checkpoint, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_first_save_says_there_is_no_earlier_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"\(no earlier checkpoint exists: a rerun starts from step 0\)$"):
        FullDisk().save_checkpoint({"global_step": 2, "w": torch.zeros(2)}, tmp_path / "checkpoints" / "step0000002.ckpt")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "w": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*last.ckpt: No space left on device; "
                                              r"free disk space .*\(the newest earlier checkpoint, last.ckpt at step 3, is intact\)"):
        FullDisk().save_checkpoint({"global_step": 6, "w": torch.zeros(2)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temp file left
    assert AtomicCheckpointIO().load_checkpoint(path)["global_step"] == 3


def test_a_preloaded_checkpoint_is_returned_once(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1}, path)
    io.preload(path, {"global_step": 7})
    assert io.load_checkpoint(path)["global_step"] == 7  # the caller's validated copy, not re-read
    assert io.load_checkpoint(path)["global_step"] == 1  # and not kept afterwards


def test_resume_compares_every_model_config_field():
    from dataclasses import fields

    from bnlit.checkpointing import RESUME_MAY_DIFFER, check_resume
    from bnlit.model import ModelConfig

    cfg = ModelConfig(name="tiny", vocab_size=256, dim=64, n_layer=2, n_head=4, multiple_of=32, max_seq_len=128)
    check_resume(cfg, "a.ckpt", {"model_config": {**cfg.to_dict(), "name": "renamed", "init_std": 0.01}})
    for changed in ({"max_seq_len": 256}, {"rope_theta": 500000.0}, {"n_kv_heads": 2}, {"norm_eps": 1e-6}):
        (field, value), = changed.items()
        with pytest.raises(CheckpointError, match=rf"a.ckpt holds a tiny model of another shape: {field}={value} "
                                                  rf"\(config: {getattr(cfg, field)}\)"):
            check_resume(cfg, "a.ckpt", {"model_config": {**cfg.to_dict(), **changed}})
    # a field added to ModelConfig later is compared unless it is listed as allowed to differ
    assert RESUME_MAY_DIFFER < {f.name for f in fields(ModelConfig)}


def test_preload_only_where_the_strategy_reads_through_checkpoint_io():
    from omegaconf import OmegaConf

    from bnlit.checkpointing import loads_through_checkpoint_io

    fsdp = OmegaConf.create({"_target_": "lightning.pytorch.strategies.FSDPStrategy", "sharding_strategy": "FULL_SHARD"})
    assert loads_through_checkpoint_io("auto") and loads_through_checkpoint_io("ddp") and loads_through_checkpoint_io(None)
    assert not loads_through_checkpoint_io(fsdp) and not loads_through_checkpoint_io("fsdp")
    assert not loads_through_checkpoint_io("deepspeed")


def test_a_checkpoints_own_metrics_row_lost_to_a_kill_is_written_by_the_resumed_run(make_cfg, tmp_path):
    """Lightning logs a step's metrics after the ``on_train_batch_end`` hooks that save its
    checkpoint: a SIGKILL between the rename and that row lost it for good (chaos.py, issue 27).
    Planted here: the CSV cut back to the rows before the step-2 checkpoint's own row (logged as
    step 1, the row of the second optimizer step), the checkpoints after it removed."""
    from bnlit.loggers import read_whole_rows, write_rows

    cfg = make_cfg()  # 4 steps, a checkpoint every 2
    train(cfg)
    run = Path(cfg.paths.output_dir)
    expected = train_losses(run)
    assert sorted(expected) == [0, 1, 2, 3]
    ckpts = Path(cfg.paths.checkpoint_dir)
    assert torch.load(ckpts / "step0000002.ckpt", weights_only=True)["metrics_row"]["step"] == 1
    for p in ckpts.iterdir():
        if p.name != "step0000002.ckpt":
            p.unlink()
    metrics = run / "csv" / "metrics.csv"
    header, rows = read_whole_rows(metrics)
    write_rows(metrics, header, [r for r in rows if int(r["step"]) < 1])
    assert sorted(train_losses(run)) == [0]

    train(make_cfg("ckpt_path=last", run_dir=run))
    assert train_losses(run) == expected  # exact floats, the restored row's included
    rows = read_whole_rows(metrics)[1]
    assert sum(1 for r in rows if r["step"] == "1" and r.get("train/loss")) == 1  # once
