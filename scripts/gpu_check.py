"""``python scripts/gpu_check.py``: the GPU check, one command, one JSON line per check.

On a CUDA machine (under 8 minutes on one H100):

1. ``train_h100``: ``python -m bnlit.train model=400m trainer=h100`` at seq 2048 for ``--steps``
   optimizer steps (the real entry point, data module, callbacks and parity probe; accumulation cut
   to ``--accumulate`` so the steps fit the time), with a validation and a checkpoint at the end;
2. ``bench_cuda``: ``python scripts/bench.py --json`` (its CUDA path: the same fast path on random
   tokens, timed after warm-up);
3. ``fsdp_2gpu``: ``model=400m trainer=fsdp trainer.devices=2`` for a few steps, when 2 GPUs exist;
4. with ``--switches``: ``bench_loss_<plain|chunked|fused>`` and ``bench_sdpa_<auto|cudnn|flash|efficient>``
   (document masking off: it runs flex attention, not SDPA), each line with its MFU and the
   attention kernel that ran; ``fused`` (torch's ``F.linear_cross_entropy``, refused under bf16) runs
   at ``trainer.precision=32-true``, beside ``bench_loss_chunked_32`` at the same precision.

Each line carries ``ok``, ``tokens_per_s``, ``mfu_pct``, ``peak_memory_gib``, ``parity`` (the
gradient-flow arbiter's fast-path verdict line) and the run's ``fast_path`` line, read from the
run's ``metrics.csv`` and ``train.log``. Without CUDA it exits at once with status 2 and one line
saying so; ``--dry-run`` prints the commands it would run (also on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bnlit.run_report import read_metrics  # noqa: E402


def train_command(run_dir: Path, preset: str, profile: str, steps: int, accumulate: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "bnlit.train", f"model={preset}", f"trainer={profile}", "logger=csv",
            f"trainer.max_steps={steps}", f"trainer.accumulate_grad_batches={accumulate}",
            f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=2", "validate_at_start=false",
            f"callbacks.model_checkpoint.every_n_train_steps={steps}", "trainer.enable_progress_bar=false",
            "~callbacks.progress_bar", f"hydra.run.dir={run_dir}", *extra]


def plan(args, root: Path, n_gpus: int) -> list[tuple[str, list[str], Path | None]]:
    """``(check name, command, run dir or None)`` in order."""
    checks = [("train_h100", train_command(root / "train_h100", args.model, "h100", args.steps, args.accumulate,
                                           args.override), root / "train_h100"),
              ("bench_cuda", [sys.executable, str(REPO / "scripts" / "bench.py"), "--json",
                              "--model", args.model, "--steps", str(args.bench_steps)], None)]
    if args.switches:  # MFU of each module.loss_impl, then each SDPA kernel (causal: masking uses flex attention)
        bench = checks[1][1]
        checks += [(f"bench_loss_{impl}", [*bench, f"--override=module.loss_impl={impl}"], None)
                   for impl in ("plain", "chunked")]
        # fused is correct at fp32 only (bnlit.loss.FUSED_PRECISIONS): compare it with chunked there
        checks += [(name, [*bench, f"--override=module.loss_impl={impl}", "--override=trainer.precision=32-true"], None)
                   for name, impl in (("bench_loss_fused", "fused"), ("bench_loss_chunked_32", "chunked"))]
        checks += [(f"bench_sdpa_{b}", [*bench, "--override=module.document_masking=false",
                                        f"--override=module.sdpa_backend={b}"], None)
                   for b in ("auto", "cudnn", "flash", "efficient")]
    if n_gpus >= 2:
        checks.append(("fsdp_2gpu", train_command(root / "fsdp_2gpu", args.model, "fsdp", args.fsdp_steps, 1,
                                                  ["trainer.devices=2", *args.override]), root / "fsdp_2gpu"))
    return checks


def last(series: dict, key: str) -> float | None:
    v = series.get(key)
    return v[-1][1] if v else None


def read_run(run_dir: Path) -> dict:
    """tokens/s, MFU, peak memory, the parity verdict and the fast-path line of a finished run."""
    csv_path = run_dir / "csv" / "metrics.csv"
    series = read_metrics(csv_path) if csv_path.is_file() else {}
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    lines = log.splitlines()
    pick = lambda word: next((l.split(" - ", 1)[-1] for l in lines if word in l), None)  # noqa: E731
    memory_key = "memory/peak_gib" if "memory/peak_gib" in series else "memory/peak_rss_gib"  # CUDA / CPU
    return {
        "tokens_per_s": last(series, "throughput/tokens_per_s"),
        "mfu_pct": last(series, "throughput/mfu"),  # the throughput callback logs percent
        "peak_memory_gib": last(series, memory_key),
        "peak_memory_key": memory_key,
        "train_loss": last(series, "train/loss"),
        "val_loss": last(series, "val/loss"),
        "parity": pick("fast-path parity"),
        "fast_path": pick("fast path: "),
        "checkpoint": (run_dir / "checkpoints" / "last.ckpt").is_file(),
    }


def read_bench(stdout: str) -> dict:
    r = json.loads(stdout[stdout.index("{"):])
    keys = ("device", "tokens_per_s", "mfu_pct", "peak_memory_gib", "micro_batch", "seq_len", "precision", "loss_impl",
            "sdpa_backend", "document_masking", "attention_kernel")
    return {k: r.get(k) for k in keys} | {
        "parity": "probe off in the bench (the train_h100 check runs it)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="400m", help="model preset of every check (conf/model/<name>.yaml)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps of the train_h100 check")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per step in train_h100 (profile: 16)")
    ap.add_argument("--bench-steps", type=int, default=20, help="timed optimizer steps of the bench_cuda check")
    ap.add_argument("--fsdp-steps", type=int, default=5, help="optimizer steps of the fsdp_2gpu check")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per check")
    ap.add_argument("--out", type=Path, default=None, help="run dirs here (default: a temporary dir)")
    ap.add_argument("--dry-run", action="store_true", help="print the checks' commands and exit")
    ap.add_argument("--switches", action="store_true", help="also bench MFU for each module.loss_impl and each "
                    "module.sdpa_backend (7 more bench runs, a few minutes each)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override for the runs (repeatable)")
    args = ap.parse_args(argv)

    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    root = args.out or Path(tempfile.mkdtemp(prefix="bnlit_gpu_check_"))
    checks = plan(args, root, n_gpus if not args.dry_run else max(n_gpus, 2))
    if args.dry_run:
        for name, cmd, _ in checks:
            print(json.dumps({"check": name, "command": cmd}))
        return 0
    if n_gpus == 0:
        print(json.dumps({"check": "cuda", "ok": False, "error": "no CUDA device: this is the GPU check; on CPU rehearse "
                          "with `python -m bnlit.train model=tiny trainer=h100 debug=rehearsal` (docs/production.md)"}))
        return 2
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    failed = 0
    for name, cmd, run_dir in checks:
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = 124, e.stdout or "", f"timed out after {args.timeout} s"
        line = {"check": name, "ok": rc == 0, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
        try:
            line |= read_run(run_dir) if run_dir else read_bench(stdout) if rc == 0 else {}
        except (ValueError, OSError) as e:
            line |= {"ok": False, "error": f"could not read the results: {e}"}
        if not line["ok"]:
            line["stderr_tail"] = str(stderr)[-1500:]
            failed += 1
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
