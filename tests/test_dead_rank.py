"""A rank SIGKILLed in the middle of a training step, or in the middle of an asynchronous sharded
checkpoint save, ends a ``trainer=fsdp`` job in bounded time: every surviving rank exits with
code 3 and one line naming the lost rank and the newest complete checkpoint, and ``ckpt_path=last``
picks the last complete checkpoint, never the interrupted save (bnlit/lost_rank.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from bnlit.checkpointing import newest_checkpoint, resolve_ckpt_path
from bnlit.fsdp import LostRankObserver
from bnlit.lost_rank import EXIT_CODE
from helpers_dist import run_train_cli
from test_rehearsal import DATA

EXACT = ["model=tiny", "trainer=fsdp", "debug=rehearsal", "trainer.precision=32-true", "module.compile=false",
         "data.num_workers=0", "validate_at_start=false", "trainer.max_steps=6", "logger=csv"]
BOUND_S = 60  # from the kill to the last survivor's exit; gloo fails the pending collective at once


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("devices,where,step", [(2, "step", 3), (2, "save", 4), (4, "step", 3)])
def test_a_killed_rank_ends_the_job_naming_it(tmp_path, cache_dir, devices, where, step):
    run = tmp_path / "run"
    lost = devices - 1
    stamp = tmp_path / "killed_at"
    out = run_train_cli(run, *DATA, *EXACT, f"trainer.devices={devices}", f"data.batch_size={4 // devices}",
                        "+callbacks.kill._target_=helpers_faults.KillRank", f"+callbacks.kill.rank={lost}",
                        f"+callbacks.kill.step={step}", f"+callbacks.kill.where={where}",
                        f"+callbacks.kill.stamp={stamp}", timeout=900)
    ended = time.time()
    assert out.returncode == EXIT_CODE, out.stderr[-4000:]
    assert ended - float(stamp.read_text()) < BOUND_S
    lines = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
    for rank in range(devices - 1):  # every survivor says which rank is gone, in one line
        mine = [l for l in lines if l.startswith(f"error: rank {rank} stops: ")]
        assert len(mine) == 1, lines
        assert re.search(rf"rank {lost} \(pid \d+ on \S+\)", mine[0]) and "is gone" in mine[0], mine[0]
        assert "the newest complete checkpoint is step0000002.ckpt; resume with ckpt_path=last" in mine[0], mine[0]
    checkpoints = run / "checkpoints"
    # the save of step 4 was interrupted: a temporary directory only, never ckpt_path=last
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith("step")] == ["step0000002.ckpt"]
    assert any(p.name.startswith(".step0000004.ckpt.tmp") for p in checkpoints.iterdir()) == (where == "save")
    assert newest_checkpoint(checkpoints) == checkpoints / "step0000002.ckpt"
    assert resolve_ckpt_path("last", checkpoints, overwrite=False) == str(checkpoints / "step0000002.ckpt")


def _process(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("main_exits_itself", [True, False])
def test_the_observer_lets_the_survivors_report_before_it_kills(main_exits_itself):
    """Lightning's observer SIGKILLs every rank <= 5 s after a child dies, racing the survivors'
    one line; bnlit's waits: a main process that reports and exits by itself keeps its exit code,
    and one still running after the grace period is killed with the children it started."""
    dead = _process("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    survivor = _process("import time; time.sleep(60)")
    main = _process(f"import time; time.sleep({1 if main_exits_itself else 60}); raise SystemExit({EXIT_CODE})")
    dead.wait()
    start = time.monotonic()
    observer = LostRankObserver(main_pid=main.pid, child_processes=[dead, survivor], grace_s=3, sleep_period=0.05)
    observer.start()
    try:
        if main_exits_itself:  # reaped only after the grace: the observer must not kill it meanwhile
            observer.join(timeout=10)
            assert main.wait(timeout=1) == EXIT_CODE
            assert survivor.poll() is None  # the survivors report and exit by themselves
        else:
            assert main.wait(timeout=20) == -signal.SIGKILL
            assert survivor.wait(timeout=5) == -signal.SIGKILL
            assert time.monotonic() - start >= 3
        assert not observer.is_alive()
    finally:
        for p in (survivor, main):
            p.kill()
            p.wait()
