"""scripts/gpu_check.py without a GPU: the plan of checks, the refusal on a CPU-only machine, and
(slow tier, in tests/test_rehearsal.py) reading a real run dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_dry_run_prints_one_json_line_per_check():
    out = run("--dry-run", "--steps", "7", "--out", "/tmp/x")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in out.stdout.splitlines()]
    assert [l["check"] for l in lines] == ["train_h100", "bench_cuda", "fsdp_2gpu"]
    train = lines[0]["command"]
    assert train[1:3] == ["-m", "bnlit.train"]
    assert {"model=400m", "trainer=h100", "trainer.max_steps=7", "hydra.run.dir=/tmp/x/train_h100"} <= set(train)
    assert lines[1]["command"][-5:] == ["--json", "--model", "400m", "--steps", "20"]
    assert {"trainer=fsdp", "trainer.devices=2"} <= set(lines[2]["command"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_cuda_it_fails_fast_with_one_line():
    out = run()
    assert out.returncode == 2
    line = json.loads(out.stdout)
    assert line["check"] == "cuda" and line["ok"] is False
    assert "no CUDA device" in line["error"] and "debug=rehearsal" in line["error"]
