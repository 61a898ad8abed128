"""scripts/chaos.py, short: real ``python -m bnlit.train`` runs interrupted from another process
(SIGINT, SIGTERM, SIGKILL) at random moments, rerun as the run's last line says until they finish,
must end bitwise equal to the uninterrupted run, with the documented exits and no debris. The
script's own checks are the assertions; its report is read back to see that it interrupted and judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 30-120 s (load average 7): the two reference runs and 3 trials, 2 on a cold cache
def test_a_short_chaos_run_finds_no_lost_or_corrupt_state(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--trials", "3", "--seed", "3",
                           "--cold-share", "0.5", "--compile-share", "0", "--run-timeout", "240", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    trials = report["trials"]
    assert len(trials) == 3 and all(t["finished"] and not t["problems"] for t in trials)
    assert sum(t["interruptions"] for t in trials) >= 3  # each trial was interrupted at least once
    assert "bitwise equal to the uninterrupted run's: 3 of 3" in (out / "report.md").read_text()


def test_chaos_refuses_an_output_dir_in_use(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chaos.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --out {tmp_path} is not empty"), proc.stderr
