"""The production path, executed on CPU (``debug=rehearsal``): ``trainer=h100``, ``trainer=fsdp``
(2 processes, FSDP2 over gloo) and ``trainer=multinode`` (2 processes on one node) each train
with every switch of their profile on, validate, checkpoint, state their fast path in one line and
pass the gradient-flow arbiter. FSDP2 matches 1 process with the same global batch, writes sharded
checkpoints that resume with ``ckpt_path=last`` on 1 and on 4 processes, and a planted zero-gradient parameter is caught by name
on sharded parameters."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bnlit import CONF_DIR
from bnlit.checkpointing import checkpoint_step
from bnlit.run_report import read_metrics
from conftest import TINY
from helpers_dist import run_two_ranks, same_error_on_both_ranks

# the rehearsal's own seq_len/batch/steps stay; only the data is cut to the test corpus
DATA = [o for o in TINY if o.split("=")[0].lstrip("+~") in (
    "model.config.vocab_size", "data.sources.0.max_docs", "data.val_fraction", "data.sources.1.max_docs",
    "data.num_proc", "logger", "callbacks.fertility.floors.bn", "trainer.enable_progress_bar", "callbacks.progress_bar")]


def run_cli(run_dir: Path, *overrides: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "bnlit.train", *DATA, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, cwd=run_dir.parent, env=env, timeout=timeout)


def metric(run_dir: Path, key: str) -> dict[int, float]:
    return dict(read_metrics(run_dir / "csv" / "metrics.csv")[key])


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_rehearsal_keeps_every_switch_of_the_profile_and_changes_only_what_cpu_needs():
    for profile, devices in (("h100", 1), ("fsdp", 2), ("multinode", 2)):
        gpu, cpu = compose_cfg("model=tiny", f"trainer={profile}"), compose_cfg("model=tiny", f"trainer={profile}", "debug=rehearsal")
        assert (cpu.trainer.accelerator, cpu.trainer.devices, cpu.trainer.num_nodes) == ("cpu", devices, 1)
        for key in ("trainer.precision", "trainer.strategy", "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
                    "module.compile", "module.fullgraph", "module.sdpa_backend", "optimizer.fused",
                    "data.num_workers", "data.prefetch_factor", "data.pin_memory"):
            assert OmegaConf.select(cpu, key) == OmegaConf.select(gpu, key), (profile, key)
        assert set(cpu.callbacks) == set(gpu.callbacks)
        assert cpu.data.seq_len < gpu.data.seq_len and cpu.trainer.max_steps < gpu.trainer.max_steps
        assert cpu.trainer.val_check_interval <= cpu.trainer.max_steps
        assert cpu.callbacks.model_checkpoint.every_n_train_steps <= cpu.trainer.max_steps


def test_fsdp_profile_builds_the_strategy_the_rehearsal_runs():
    from bnlit.fsdp import FSDP2Strategy

    for overrides in (("model=1b", "trainer=fsdp"), ("model=tiny", "trainer=fsdp", "debug=rehearsal")):
        strategy = instantiate(compose_cfg(*overrides).trainer.strategy)
        assert isinstance(strategy, FSDP2Strategy)
        # sharded (torch DCP) checkpoints, written asynchronously: nothing gathered on rank 0
        assert strategy._save_distributed_checkpoint is True and strategy.sharded_writer.async_save is True


# what every GPU profile's fast path turns on, as the module's log line names it under debug=rehearsal
FAST_PATH = ("fast path: bf16-mixed autocast, torch.compile(fullgraph) x2 blocks + loss, fused AdamW, sdpa=cpu, "
             "attention=sdpa:flash (document mask), loss=chunked, ")


def assert_rehearsal(out: subprocess.CompletedProcess, run_dir: Path, fast_path: str) -> str:
    assert out.returncode == 0, out.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert fast_path in log, [l for l in log.splitlines() if "fast path" in l]
    assert "gradient flow: " in log and "parameters ok at step 1" in log
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") is not None  # a file, or trainer=fsdp's directory
    assert metric(run_dir, "val/loss")  # validated inside the run
    summary = (run_dir / "summary.md").read_text()
    assert fast_path in summary
    return log


@pytest.mark.slow
def test_h100_rehearsal(tmp_path, cache_dir):
    run = tmp_path / "h100" / "run"
    out = run_cli(run, "model=tiny", "trainer=h100", "debug=rehearsal")
    log = assert_rehearsal(out, run, FAST_PATH + "strategy=single device (cpu), accumulate=16, workers=4 (prefetch 4, ")
    assert "fast-path parity (bf16-mixed, compiled)" in log
    assert "hardware=h100 (989.5 TFLOP/s bf16 dense on its GPU)" in log
    assert sorted(metric(run, "train/loss")) == [0, 1, 2, 3]
    # scripts/gpu_check.py reads its train_h100 check from such a run dir
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from gpu_check import read_run

    r = read_run(run)
    assert r["tokens_per_s"] > 0 and r["mfu_pct"] > 0 and r["hfu_pct"] > 0 and r["peak_memory_gib"] > 0
    assert {s["file"] for s in r["checkpoint_saves"]} >= {"step0000004.ckpt", "last.ckpt"}
    assert r["parity"].startswith("fast-path parity (bf16-mixed, compiled): 20/20 parameters within tolerance")
    assert r["fast_path"].startswith("fast path: bf16-mixed autocast")


@pytest.mark.slow
@pytest.mark.distributed
def test_multinode_rehearsal(tmp_path, cache_dir):
    run = tmp_path / "multinode" / "run"
    out = run_cli(run, "model=tiny", "trainer=multinode", "debug=rehearsal")
    log = assert_rehearsal(out, run, FAST_PATH + "strategy=ddp(2, gloo), accumulate=1, workers=4")
    assert "fast-path parity (bf16-mixed, compiled)" in log


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_rehearsal_parity_and_resume(tmp_path, cache_dir):
    """The full FSDP2 rehearsal (bf16, per-block compile, fused AdamW), then in fp32 eager for exact
    comparisons: 2 sharded processes match 1 unsharded process with the same global batch, and the
    sharded run's step-2 checkpoint (a DCP directory written asynchronously) resumes with
    ``ckpt_path=last`` onto the same curve on 1 process and on 4."""
    run = tmp_path / "fsdp" / "run"
    out = run_cli(run, "model=tiny", "trainer=fsdp", "hardware=a100", "debug=rehearsal")
    log = assert_rehearsal(out, run, "fast path: bf16-mixed autocast, torch.compile(fullgraph) x2 blocks + loss, fused AdamW, "
                               "sdpa=cpu, attention=sdpa:flash (document mask), loss=chunked, "
                               "strategy=fsdp2(2, gloo), mesh=1x2 (replicate x shard), all-gather=bf16, "
                               "reduce-scatter=fp32, accumulate=2, workers=4")
    # the device profile the line names: a measured CPU peak here, the A100's beside it
    assert re.search(r"peak=[0-9.e+-]+ TFLOP/s measured \(cpu bf16 matmul\), hardware=a100 \(312 TFLOP/s bf16 dense on "
                     r"its GPU\)$", next(l for l in log.splitlines() if "fast path: " in l))

    exact = ["trainer.precision=32-true", "module.compile=false", "data.num_workers=0", "validate_at_start=false"]
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    # the 1-process reference: the same profile without the strategy (trainer=fsdp is h100 + FSDP2 + accumulate 2)
    out = run_cli(one, "model=tiny", "trainer=h100", "debug=rehearsal", *exact, "data.batch_size=4",
                  "trainer.accumulate_grad_batches=2")
    assert out.returncode == 0, out.stderr[-4000:]
    out = run_cli(two, "model=tiny", "trainer=fsdp", "debug=rehearsal", *exact)
    assert out.returncode == 0, out.stderr[-4000:]
    ref, got = metric(one, "train/loss"), metric(two, "train/loss")
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3]
    assert max(abs(got[s] - ref[s]) for s in ref) < 1e-5, (ref, got)

    step2 = two / "checkpoints" / "step0000002.ckpt"
    assert (step2 / ".metadata").is_file() and (step2 / "__1_0.distcp").is_file()  # sharded: one file per rank
    assert os.readlink(two / "checkpoints" / "last.ckpt") == "step0000004.ckpt"  # the same step is not written twice

    # the sharded checkpoint resumes on another world size (DCP reshards on load), the same global
    # batch: FSDP2 on 1 process and on 4
    for devices, batch in ((1, 4), (4, 1)):
        resumed = tmp_path / f"resumed{devices}" / "run"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(step2, resumed / "checkpoints" / step2.name)
        out = run_cli(resumed, "model=tiny", "trainer=fsdp", "debug=rehearsal", *exact, "ckpt_path=last",
                      f"trainer.devices={devices}", f"data.batch_size={batch}")
        assert out.returncode == 0, out.stderr[-4000:]
        assert f"strategy=fsdp2({devices}, gloo)" in (resumed / "train.log").read_text()
        after = metric(resumed, "train/loss")
        assert sorted(after) == [1, 2, 3]  # 1: the checkpoint's own row (a fresh run dir has none)
        assert max(abs(after[s] - got[s]) for s in after) < 1e-5, (devices, got, after)


WORKER = textwrap.dedent('''
    from functools import partial
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from helpers_dist import fit_on_two_ranks
    from test_gradient_flow import ZeroWeightGrad, tiny
    from bnlit.module import LMModule
    from bnlit.callbacks.gradient_flow import GradientFlowArbiter

    class ZeroGradLinear(torch.nn.Linear):
        """A "fused kernel" whose weight gradient is always zero (planted in block 1's w3)."""
        def forward(self, x):
            return ZeroWeightGrad.apply(x, self.weight)

    model = tiny()
    ff = model.layers[1].feed_forward
    planted = ZeroGradLinear(ff.w3.in_features, ff.w3.out_features, bias=False)
    planted.weight.data.copy_(ff.w3.weight.data)
    ff.w3 = planted
    module = LMModule(model, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    fit_on_two_ranks(module, ModelParallelStrategy(save_distributed_checkpoint=False),
                     [GradientFlowArbiter(every_n_steps=1)])
''')


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_planted_zero_gradient_is_caught_by_name(tmp_path):
    msg = same_error_on_both_ranks(*run_two_ranks(WORKER, tmp_path, timeout=600))
    assert "gradient-flow check failed at step 1" in msg
    assert "model.layers.1.feed_forward.w3.weight" in msg and "zero" in msg, msg
