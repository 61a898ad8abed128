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


def test_switches_bench_each_loss_impl_and_fused_at_fp32():
    out = run("--dry-run", "--switches", "--out", "/tmp/x")
    assert out.returncode == 0, out.stderr
    checks = {l["check"]: l["command"] for l in map(json.loads, out.stdout.splitlines())}
    assert "--override=module.loss_impl=plain" in checks["bench_loss_plain"]
    # torch's linear_cross_entropy is refused under bf16: fused and its chunked twin run at 32-true
    for name, impl in (("bench_loss_fused", "fused"), ("bench_loss_chunked_32", "chunked")):
        assert {f"--override=module.loss_impl={impl}", "--override=trainer.precision=32-true"} <= set(checks[name])
    assert "--override=module.sdpa_backend=cudnn" in checks["bench_sdpa_cudnn"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine: has CUDA (checks the CPU-only refusal)")
def test_without_cuda_it_fails_fast_with_one_line():
    out = run()
    assert out.returncode == 2
    line = json.loads(out.stdout)
    assert line["check"] == "cuda" and line["ok"] is False
    assert "no CUDA device" in line["error"] and "debug=rehearsal" in line["error"]
