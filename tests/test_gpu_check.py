"""scripts/gpu_check.py without a GPU: the plan (production settings of trainer=h100, prepared data,
the profile and the tests), the budget it enforces (a check that runs into it is stopped with its
whole process group, later ones are skipped and listed), the refusal on a CPU-only machine in one
line, and (slow) the whole check rehearsed on the CPU with its JSON lines read back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import Check, run_checks  # noqa: E402


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def lines(out: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The script's main in this process (the config imports are paid once per session)."""
    rc = gpu_check.main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, captured.out, captured.err)


def test_dry_run_plans_prepared_data_then_the_production_run(capsys):
    out = main(capsys, "--dry-run", "--steps", "7", "--out", "/tmp/x")
    assert out.returncode == 0, out.stderr
    plan = lines(out)
    assert [l["check"] for l in plan] == ["prepare", "train_h100", "checkpoint_sharded", "fsdp_2gpu", "budget"]
    assert plan[2]["command"][2:4] == ["--sharded-save", "/tmp/x/checkpoint_sharded"]
    assert {"--override=model=400m", "--override=trainer=h100"} <= set(plan[2]["command"])
    prepare, train = plan[0]["command"], plan[1]["command"]
    assert prepare[1:3] == ["-m", "bnlit.prepare"] and {"model=400m", "trainer=h100"} <= set(prepare)
    assert train[1:3] == ["-m", "bnlit.train"]
    assert {"model=400m", "trainer=h100", "trainer.max_steps=7", "hydra.run.dir=/tmp/x/train_h100",
            "callbacks.throughput.log_every_n_steps=7", "callbacks.throughput.window_steps=6"} <= set(train)
    # the profile's own accumulation (16), micro-batch and sequence: nothing of the production run cut
    assert not [o for o in train if o.split("=")[0] in ("trainer.accumulate_grad_batches", "data.batch_size",
                                                          "data.seq_len", "module.compile")]
    assert not any("profile_at_step" in o for o in train)
    # the estimate that decides skipping: compile and saves plus 7 steps of 16 x 16 x 2048 tokens
    assert 180 < plan[1]["estimate_s"] < 480
    assert plan[-1] == {"check": "budget", "budget_s": 480}


def test_profile_tests_and_bench_join_the_plan(capsys):
    out = main(capsys, "--dry-run", "--profile", "--tests", "--bench", "--steps", "10", "--budget", "300", "--out", "/tmp/x")
    assert out.returncode == 0, out.stderr
    checks = {l["check"]: l.get("command") for l in lines(out)}
    assert list(checks) == ["prepare", "train_h100", "checkpoint_sharded", "gpu_tests", "bench_cuda", "fsdp_2gpu",
                            "budget"]
    # 3 more steps, traced after the measured window of 10
    assert {"trainer.max_steps=13", "callbacks.throughput.profile_at_step=10",
            "callbacks.throughput.log_every_n_steps=10"} <= set(checks["train_h100"])
    assert checks["gpu_tests"][1:5] == ["-m", "pytest", "-m", "gpu"]


def test_switches_bench_each_loss_impl_and_fused_at_fp32(capsys):
    out = main(capsys, "--dry-run", "--switches", "--out", "/tmp/x")
    assert out.returncode == 0, out.stderr
    checks = {l["check"]: l.get("command") for l in lines(out)}
    assert "--override=module.loss_impl=plain" in checks["bench_loss_plain"]
    # torch's linear_cross_entropy is refused under bf16: fused and its chunked twin run at 32-true
    for name, impl in (("bench_loss_fused", "fused"), ("bench_loss_chunked_32", "chunked")):
        assert {f"--override=module.loss_impl={impl}", "--override=trainer.precision=32-true"} <= set(checks[name])
    assert "--override=module.sdpa_backend=cudnn" in checks["bench_sdpa_cudnn"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine: has CUDA (checks the CPU-only refusal)")
def test_without_cuda_it_fails_fast_with_one_line():
    out = run()
    assert out.returncode == 2
    assert len(out.stdout.splitlines()) == 1
    line = json.loads(out.stdout)
    assert line["check"] == "cuda" and line["ok"] is False
    assert "no CUDA device" in line["error"] and "--rehearse" in line["error"]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_budget_stops_a_check_kills_its_children_and_skips_the_rest(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # a check that starts a child of its own (a loader worker, a compile worker) and outlives the budget
    slow = py(f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    checks = [Check("quick", py("print('ok')"), 0.0),
              Check("estimated_too_long", py("print('never')"), estimate_s=3600),
              Check("slow", slow),
              Check("after", py("print('never')"), 0.0),
              Check("needs_slow", py("print('never')"), needs="slow")]
    out: list[str] = []
    t0 = time.monotonic()
    failed = run_checks(checks, budget_s=4, emit=out.append)
    elapsed = time.monotonic() - t0
    got = [json.loads(l) for l in out]
    assert [l["check"] for l in got] == ["quick", "estimated_too_long", "slow", "after", "needs_slow", "budget"]
    assert got[0]["ok"] is True and got[0]["rc"] == 0
    assert got[1]["ok"] is None and "needs ~3600 s (an estimate)" in got[1]["skipped"]
    assert got[2]["ok"] is False and got[2]["rc"] is None and "stopped at the end of the 4 s budget" in got[2]["error"]
    assert got[3]["skipped"] == "the 4 s budget is spent" and got[4]["skipped"] == "slow failed"
    assert got[5]["skipped"] == ["estimated_too_long", "after", "needs_slow"] and got[5]["used_s"] < 10
    assert failed == 1 and elapsed < 10
    time.sleep(0.5)
    pid = int(pidfile.read_text())
    state = Path(f"/proc/{pid}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "the check's child outlived the budget"


def test_a_tiny_budget_on_the_command_line_stops_prepare_and_skips_the_run(tmp_path, capsys):
    out = main(capsys, "--rehearse", "--budget", "0.5", "--out", str(tmp_path))
    got = lines(out)
    assert out.returncode == 1, out.stderr[-2000:]
    assert [l["check"] for l in got] == ["prepare", "train_h100", "checkpoint_sharded", "budget"]
    assert got[0]["ok"] is False and "stopped at the end of the 0.5 s budget" in got[0]["error"]
    assert got[1]["ok"] is None and got[1]["skipped"] == "prepare failed"
    assert got[2]["ok"] is None and got[2]["skipped"] == "the 0.5 s budget is spent"
    assert got[3]["skipped"] == ["train_h100", "checkpoint_sharded"]


@pytest.mark.slow
def test_rehearsed_check_prints_every_figure_as_json_lines(tmp_path, cache_dir):
    """The whole check on the CPU (``--rehearse``: model=tiny trainer=h100 debug=rehearsal) with
    the profile and the gpu tests (which skip here): every figure the GPU run would print."""
    from conftest import TINY

    data = [f"--override={o}" for o in TINY if o.split("=")[0].lstrip("+~") in (
        "model.config.vocab_size", "data.sources.0.max_docs", "data.val_fraction", "data.sources.1.max_docs",
        "data.num_proc", "callbacks.fertility.floors.bn")]
    out = run("--rehearse", "--profile", "--tests", "--steps", "3", "--budget", "1200", "--out", str(tmp_path), *data,
              timeout=1500)
    got = {l["check"]: l for l in lines(out)}
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert list(got) == ["prepare", "train_h100", "checkpoint_sharded", "gpu_tests", "budget"]
    assert got["prepare"]["ok"] is True
    train = got["train_h100"]
    assert train["ok"] is True
    assert train["tokens_per_s"] > 0 and train["mfu_pct"] > 0 and train["hfu_pct"] > 0 and train["step_ms"] > 0
    assert train["hfu_pct"] < train["mfu_pct"]  # the document mask leaves part of PaLM's attention undone
    assert train["peak_memory_key"] == "memory/peak_rss_gib" and train["peak_memory_gib"] > 0
    assert train["estimate_gib"] > 0 and train["peak_over_estimate"] > 0
    assert train["parity"].startswith("fast-path parity (bf16-mixed, compiled): ")
    assert train["fast_path"].startswith("fast path: bf16-mixed autocast, torch.compile(fullgraph) x2 blocks + loss")
    assert train["compile"].startswith("torch.compile: 4 graphs (train 2, eval 2), 0 recompiles")
    assert train["recompile_warnings"] == 0
    saves = {s["file"] for s in train["checkpoint_saves"]}
    assert saves == {"step0000006.ckpt", "last.ckpt"} and all(s["s"] >= 0 and s["gib"] >= 0 for s in train["checkpoint_saves"])
    assert train["profile"].startswith(f"profile: where the time went ({3} steps, ")
    assert [Path(f).name for f in train["profile_files"]] == ["profile_step4.json"]  # steps 4-6, after the window
    sharded = got["checkpoint_sharded"]
    assert sharded["ok"] is True and sharded["complete"] is True and sharded["model"] == "tiny"
    assert 0 < sharded["blocked_s"] <= sharded["total_s"] and sharded["gib"] > 0
    tests = got["gpu_tests"]
    assert tests["ok"] is True and tests["tests"]["skipped"] >= 5 and "passed" not in tests["tests"]
    assert tests["skip_reasons"] == ["machine: no CUDA device"]
    assert got["budget"]["skipped"] == []


def test_the_sharded_save_check_writes_a_complete_dcp_checkpoint(tmp_path):
    result = gpu_check.sharded_save(["model=tiny", "trainer=h100", "debug=rehearsal"], tmp_path)
    assert result["complete"] is True and result["device"] == "cpu" and result["model"] == "tiny"
    # a tiny model's copy to host memory can take under 0.1 ms: only the order and the write are sure
    assert 0 <= result["blocked_s"] <= result["total_s"] and result["total_s"] > 0 and result["gib"] > 0
    from bnlit.checkpointing import read_checkpoint

    ckpt = read_checkpoint(result["path"])  # gathered back by the reader export and evaluate use
    assert ckpt["global_step"] == 1 and "output.weight" in ckpt["state_dict"]


def test_the_tests_line_counts_pytests_summary_and_its_skip_reasons():
    out = ("ss.F\nSKIPPED [2] tests/test_gpu.py:63: machine: no CUDA device\n"
           "SKIPPED [1] tests/checks/test_x.py:9: machine: no CUDA device\n1 failed, 1 passed, 3 skipped in 4.10s\n")
    assert gpu_check.read_pytest(out) == {"tests": {"failed": 1, "passed": 1, "skipped": 3},
                                          "skip_reasons": ["machine: no CUDA device"]}
