"""scripts/bench.py on CPU is the run: the data module's real shards, the configured precision
(each path forced: bf16-mixed as on a CPU with native bf16, 32-true as on one without),
accumulation, keep_freed_memory and the parity probe; a variant the precision refuses is skipped
with one line, and Ctrl-C prints what was measured so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.utils import instantiate

from conftest import TINY

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
# the test corpus and tokenizer; everything else is the default run's config
DATA = [o for o in TINY if o.split("=")[0].lstrip("+~") in (
    "model.config.vocab_size", "data.sources.0.max_docs", "data.val_fraction", "data.sources.1.max_docs",
    "data.num_proc", "callbacks.fertility.floors.bn", "data.seq_len", "data.batch_size")]


def bench(*args: str, cache_dir: Path):
    sys.path.insert(0, str(SCRIPT.parent))
    import bench as b

    overrides = [f"--override={o}" for o in DATA + [f"paths.cache_dir={cache_dir}"]]
    return b.main(["--json", "--threads", "1", "--warmup", "1", "--steps", "2", "--reps", "1", *overrides, *args])


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_bench_completes_at_each_cpu_precision_and_skips_what_the_precision_refuses(precision, cache_dir, capsys,
                                                                                     make_cfg):
    r = bench("--variants", "lightning_fused_loss", f"--override=trainer.precision={precision}",
              "--override=trainer.accumulate_grad_batches=2", cache_dir=cache_dir)
    err = capsys.readouterr().err
    assert r["precision"] == precision and r["accumulate_grad_batches"] == 2 and r["interrupted"] is None
    assert r["lightning_vs_raw"] > 0 and r["arbiter_overhead_ratio_default"] > 0
    assert r["keep_freed_memory"] is True
    # the data module's shards (eos opens every document, so the mask is the run's), not random tokens
    dm = instantiate(make_cfg(*DATA, tiny=False).data)
    dm.prepare_data()
    dm.setup("fit")
    x, _ = next(iter(dm.train_dataloader()))
    assert r["first_window"] == x[0, :16].tolist() and r["shard_dir"] == str(dm.shard_dir)
    assert r["documents_per_window"] >= 1
    assert r["parity"]["ok"] is True and r["parity"]["num_ok"] == r["parity"]["names"] > 0  # the probe ran
    if precision == "bf16-mixed":  # torch's linear_cross_entropy sums in bf16: refused, one line, not a crash
        assert r["fused_loss_step_time_ratio"] is None
        assert "module.loss_impl=fused at trainer.precision=bf16-mixed" in r["skipped"]["lightning_fused_loss"]
        lines = [l for l in err.splitlines() if "lightning_fused_loss skipped" in l]
        assert len(lines) == 1, lines
    else:
        assert r["skipped"] == {} and r["fused_loss_step_time_ratio"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_prints_what_was_measured_so_far(inherited, cache_dir, tmp_path):
    """Ctrl-C after the first repetition's raw and lightning runs, as the next run is being built
    (outside the interrupt callback's latch). ``ignored``: the bench starts with SIGINT ignored, as
    a background job of a non-interactive shell does, or any child of a process in which Lightning
    caught a KeyboardInterrupt (it leaves SIGINT ignored): the bench restores Python's Ctrl-C (this
    test failed inside the whole slow tier, and 1 of 1 runs under ``trap '' INT``, before it did)."""
    def start():
        if inherited == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    overrides = [f"--override={o}" for o in DATA + [f"paths.cache_dir={cache_dir}"]]
    cmd = [sys.executable, str(SCRIPT), "--json", "--threads", "1", "--warmup", "1", "--steps", "3", "--reps", "5",
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                         preexec_fn=start)
    seen = []
    deadline = time.monotonic() + 900
    for line in p.stderr:  # the first repetition's runs are printed as they finish
        seen.append(line)
        if line.startswith("rep 1/5 ") and sum(l.startswith("rep 1/5 ") for l in seen) == 2:
            p.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen[-20:])
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    r = json.loads(out)
    assert r["interrupted"].startswith("interrupted")
    measured = {k: v for k, v in r["runs_tokens_per_s"].items() if v}
    assert len(measured) >= 2 and r["lightning_vs_raw"] is not None  # raw and lightning of repetition 1
