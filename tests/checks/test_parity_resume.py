"""The fast-path parity probe after a resume (issue 25 item 5): healthy runs resumed from
checkpoints at several steps and seeds, in bf16-mixed (forced on CPUs without native bf16: it
still runs, emulated) and fp32, raise no parity alarm; a fast-path fault planted after a resume
is still caught at the first step. The runs use lr 2e-2 (the default run's until 2026-12-06; it is
1e-2 at dim 128 now), at which
the attention's query/key gradients become small after a few steps and bf16 rounds them visibly
(docs/gradient-flow.md, "The rounding floor")."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from bnlit.callbacks.gradient_flow import GradientFlowArbiter, GradientFlowError
from bnlit.model import Transformer
from bnlit.train import train
from test_gradient_flow import FastPathLinear, plant

STEPS = 25
EVERY = 5  # checkpoints at 5, 10, 15, 20, 25: each is a resume point
QUIET = ["trainer.val_check_interval=1000", "trainer.limit_val_batches=1", "callbacks.model_checkpoint.save_top_k=-1",
         "optimizer.lr=2e-2", "trainer.log_every_n_steps=50"]


def trained(make_cfg, root: Path, seed: int, precision: str) -> list[Path]:
    """One uninterrupted run of ``STEPS`` steps; its checkpoints, oldest first."""
    cfg = make_cfg(*QUIET, f"seed={seed}", f"trainer.precision={precision}", f"trainer.max_steps={STEPS}",
                   f"callbacks.model_checkpoint.every_n_train_steps={EVERY}", "callbacks.gradient_flow.fast_path_parity=false",
                   run_dir=root / f"{precision}-{seed}")
    train(cfg)
    return sorted(Path(cfg.paths.checkpoint_dir).glob("step*.ckpt"))


class KeepParity(L.Callback):
    """Test-only: keeps the run's latest parity report (the arbiter writes a file on failure only)."""

    reports: list[dict] = []

    def on_train_end(self, trainer, pl_module):
        arbiter = next(c for c in trainer.callbacks if isinstance(c, GradientFlowArbiter))
        KeepParity.reports.append(arbiter.last_report["fast_path_parity"])


def resume(make_cfg, ckpt: Path, run_dir: Path, precision: str, *overrides: str) -> dict:
    """Resume ``ckpt`` for one step with the probe on (it runs at the first check after a resume);
    the probe's report entry."""
    step = torch.load(ckpt, weights_only=True, mmap=True)["global_step"]
    cfg = make_cfg(*QUIET, f"trainer.precision={precision}", f"trainer.max_steps={step + 1}", f"ckpt_path={ckpt}",
                   f"callbacks.model_checkpoint.every_n_train_steps={STEPS * 10}",
                   f"+callbacks.keep_parity._target_={__name__}.KeepParity", *overrides, run_dir=run_dir)
    train(cfg)
    report = KeepParity.reports.pop()
    assert report["step"] == step + 1, report  # the probe ran at the resumed step
    return report


CASES = [("bf16-mixed", seed) for seed in (7, 1, 2, 3)] + [("32-true", seed) for seed in (7, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("precision, seed", CASES, ids=[f"{p}-seed{s}" for p, s in CASES])
def test_resumed_healthy_runs_raise_no_parity_alarm(make_cfg, tmp_path, precision, seed):
    ckpts = trained(make_cfg, tmp_path, seed, precision)
    assert len(ckpts) == STEPS // EVERY
    for ckpt in ckpts:  # 5 resumes per seed: 20 in bf16-mixed, 10 in fp32; a parity alarm would raise
        report = resume(make_cfg, ckpt, tmp_path / f"resumed-{ckpt.stem}", precision)
        assert report["ok"], (ckpt.name, report["problems"])
        if precision == "bf16-mixed":  # the rounding floor was measured for every parameter
            assert set(report["floor"]) == set(report["names"])
            assert all(0 < f["floor"] < 1 for f in report["floor"].values()), report["floor"]
        else:
            assert report["floor"] == {}  # fp32: the configured bounds, unwidened


class PlantedAfterResume(Transformer):
    """The real model with a fused kernel that is wrong only under autocast (the fast path): the
    weight gradient of layer 1's FFN gate scaled by 0.5, layer 0's query projection's sign flipped
    (its norm is right: only the parity probe can see it)."""

    def __init__(self, config, activation_checkpointing=False):
        super().__init__(config, activation_checkpointing)
        plant(self, "layers.1.feed_forward.w1", FastPathLinear)
        plant(self, "layers.0.attention.wq", FlippedFastPathLinear)


class FlippedFastPathLinear(FastPathLinear):
    scale = -1.0


@pytest.mark.slow
def test_fast_path_fault_planted_after_a_resume_is_caught(make_cfg, tmp_path):
    ckpt = trained(make_cfg, tmp_path, 7, "bf16-mixed")[-1]  # the latest state: the floors are at their widest
    with pytest.raises(GradientFlowError) as err:
        resume(make_cfg, ckpt, tmp_path / "planted", "bf16-mixed", f"model._target_={__name__}.PlantedAfterResume")
    msg = str(err.value)
    assert f"failed at step {STEPS + 1} for 2 parameter(s)" in msg, msg
    for name in ("model.layers.1.feed_forward.w1.weight", "model.layers.0.attention.wq.weight"):
        assert f"{name} [fast_path_parity] fast-path gradient disagrees" in msg, msg
