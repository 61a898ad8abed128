"""``python scripts/gpu_check.py``: the first minutes on a rented GPU, inside a time budget it enforces itself.

The checks, in order, one JSON line each (``{"check": name, "ok": ..., ...}``):

1. ``prepare``: ``python -m bnlit.prepare`` for the run's config with CUDA hidden, so the tokenizer
   and the shards are built (or found in ``BNLIT_CACHE``) on the CPU before the device is touched
   (``--prepare-only`` does just this, on any machine, ahead of renting one);
2. ``train_h100``: ``python -m bnlit.train model=400m trainer=h100``, the production settings
   (bf16-mixed, per-block compile, fused AdamW, chunked loss, flex attention with the document mask,
   micro-batch 16 x seq 2048, the profile's accumulation of 16) for ``--steps`` optimizer steps,
   with the parity probe, a validation and a checkpoint at the end. It prints ``tokens_per_s``, both
   MFUs (``mfu_pct``, PaLM's convention; ``hfu_pct``, the FLOPs the masked attention really does)
   over the steady window (every step after the first, which compiles), ``peak_memory_gib`` against
   ``estimate_gib`` (``bnlit.speed.flops.training_memory_bytes``), the parity verdict, the
   checkpoint saves' times and the compile summary (graphs, recompiles). With ``--profile`` the
   run goes on for 3 more steps under ``torch.profiler`` (``callbacks.throughput.profile_at_step``):
   a chrome trace and a CUDA memory snapshot in the run's ``plots/``, and "where the time went";
3. ``checkpoint_sharded``: one sharded checkpoint of the model's full training state (weights and
   AdamW moments on the device) through ``bnlit.checkpointing.ShardedWriter``, the writer of
   ``trainer=fsdp`` (torch Distributed Checkpoint, asynchronous): ``blocked_s`` (what the step
   loop waits for: the copy to host memory) and ``total_s`` (complete on disk), with its size;
4. ``gpu_tests`` (``--tests``): ``pytest -m gpu`` (the tests marked ``gpu``);
5. ``bench_cuda`` (``--bench``) and, with ``--switches``, ``scripts/bench.py`` for each loss and SDPA kernel;
6. ``fsdp_2gpu``: ``trainer=fsdp trainer.devices=2`` for a few steps, when 2 GPUs exist.

The budget (``--budget``, 480 s) covers everything from the start, ``prepare`` included: a check
whose estimate (compile allowance plus its steps at an assumed MFU: a guess, never measured on a
GPU, used only to skip) does not fit what is left is skipped with a line saying so; a check that
runs into the end of the budget is stopped (its process group killed) and every later one is
skipped; the last line (``"check": "budget"``) lists what was skipped. Without CUDA it exits at once
with status 2 and one line; ``--rehearse`` runs the same checks on the CPU (``model=tiny
debug=rehearsal``) and ``--dry-run`` prints the plan (both anywhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BUDGET_S = 480  # 8 minutes of a rented GPU, compile included
# the estimates that decide what to skip (not measured on a GPU: no GPU has run bnlit yet)
ASSUMED_MFU = 0.30  # of the profile's dense bf16 peak
COMPILE_S = 120  # start-up, data module and the per-block compile of the train and eval graphs
SAVE_S = 60  # a validation and the checkpoint saves (400m: ~4.5 GiB each of step file and last.ckpt)
SHARDED_S = 60  # build the model and its AdamW state on the device, one sharded save (~4.5 GiB at 400m)
TESTS_S = 150  # pytest -m gpu: tiny models, one trainer=h100 step at tiny, compiles included
BENCH_S = 180
PROFILE_STEPS = 3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model preset (default 400m; tiny with --rehearse)")
    ap.add_argument("--steps", type=int, default=12,
                    help="optimizer steps of train_h100; the steady window is every step after the first")
    ap.add_argument("--accumulate", type=int, default=None, help="micro-batches per step (default: the profile's, 16)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything, prepare included")
    ap.add_argument("--profile", action="store_true", help=f"trace {PROFILE_STEPS} steady steps after the measured "
                    "window: chrome trace and CUDA memory snapshot in the train run's plots/")
    ap.add_argument("--tests", action="store_true", help="run the tests marked gpu (pytest -m gpu)")
    ap.add_argument("--bench", action="store_true", help="also scripts/bench.py --json on the device")
    ap.add_argument("--switches", action="store_true", help="also bench each module.loss_impl and "
                    "module.sdpa_backend (7 bench runs; implies --bench)")
    ap.add_argument("--bench-steps", type=int, default=20, help="timed optimizer steps of each bench check")
    ap.add_argument("--fsdp-steps", type=int, default=5, help="optimizer steps of the fsdp_2gpu check")
    ap.add_argument("--out", type=Path, default=None, help="run dirs here (default: a temporary dir)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (one JSON line per check) and exit")
    ap.add_argument("--prepare-only", action="store_true", help="build the data into BNLIT_CACHE and exit (no GPU)")
    ap.add_argument("--rehearse", action="store_true", help="run the checks on the CPU: model=tiny debug=rehearsal")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override of the runs (repeatable)")
    ap.add_argument("--sharded-save", type=Path, default=None, help=argparse.SUPPRESS)  # the checkpoint_sharded child
    return ap


@dataclass
class Check:
    name: str
    command: list[str]
    estimate_s: float | None = None  # None: no estimate (runs whenever budget is left)
    run_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    needs: str | None = None  # a check whose failure makes this one pointless

    def plan_line(self) -> dict:
        return {"check": self.name, "command": self.command,
                "estimate_s": None if self.estimate_s is None else round(self.estimate_s)}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import bnlit.resolvers  # noqa: F401
    from bnlit import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def train_estimate_s(cfg, steps: int) -> float | None:
    """Seconds for ``steps`` optimizer steps of ``cfg`` at :data:`ASSUMED_MFU` of its profile's
    bf16 peak, plus compile and saves; None without a peak (a CPU rehearsal)."""
    from bnlit.model import ModelConfig
    from bnlit.speed.flops import flops_per_token

    peak = (cfg.get("hardware") or {}).get("peak_tflops", {}).get("bf16")
    if not peak or cfg.trainer.accelerator == "cpu":
        return None
    model = ModelConfig(**{k: v for k, v in cfg.model.config.items() if k != "_target_"})
    tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.accumulate_grad_batches * steps
    return COMPILE_S + SAVE_S + tokens * flops_per_token(model, cfg.data.seq_len) / (ASSUMED_MFU * peak * 1e12)


def run_overrides(args) -> list[str]:
    """The config of the train run (and of prepare, which builds its data)."""
    model = args.model or ("tiny" if args.rehearse else "400m")
    out = [f"model={model}", "trainer=h100"]
    if args.rehearse:
        out.append("debug=rehearsal")
    if args.accumulate:
        out.append(f"trainer.accumulate_grad_batches={args.accumulate}")
    return out + list(args.override)


def plan(args, root: Path, n_gpus: int) -> list[Check]:
    base = run_overrides(args)
    cfg = compose(base)
    steps = args.steps + (PROFILE_STEPS if args.profile else 0)
    train_dir = root / "train_h100"
    # one report at the end of the window (steps 2..N; the first compiles), a validation and a
    # checkpoint at the end, and with --profile 3 more steps traced after the window
    train = [*base, "logger=csv", f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={args.steps}",
             f"callbacks.throughput.log_every_n_steps={args.steps}",
             f"callbacks.throughput.window_steps={max(1, args.steps - 1)}",
             f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=2", "validate_at_start=false",
             f"callbacks.model_checkpoint.every_n_train_steps={steps}", "trainer.enable_progress_bar=false",
             "~callbacks.progress_bar", f"hydra.run.dir={train_dir}"]
    if args.profile:
        train.append(f"callbacks.throughput.profile_at_step={args.steps}")
    py = sys.executable
    checks = [
        Check("prepare", [py, "-m", "bnlit.prepare", *base, f"hydra.run.dir={root / 'prepare'}"], 0.0,
              env={"CUDA_VISIBLE_DEVICES": ""}),  # the data on the CPU, before the device is touched
        Check("train_h100", [py, "-m", "bnlit.train", *train], train_estimate_s(cfg, steps), train_dir, needs="prepare"),
    ]
    sharded = [py, str(Path(__file__).resolve()), "--sharded-save", str(root / "checkpoint_sharded"),
               *[f"--override={o}" for o in base]]
    checks.append(Check("checkpoint_sharded", sharded, None if args.rehearse else SHARDED_S))
    if args.tests:
        checks.append(Check("gpu_tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                                          str(REPO / "tests")], None if args.rehearse else TESTS_S))
    if args.bench or args.switches:
        bench = [py, str(REPO / "scripts" / "bench.py"), "--json", "--model", cfg.model.config.name,
                 "--steps", str(args.bench_steps)]
        variants = [("bench_cuda", [])]
        if args.switches:  # MFU of each module.loss_impl, then each SDPA kernel (causal: masking uses flex attention)
            variants += [(f"bench_loss_{impl}", [f"--override=module.loss_impl={impl}"]) for impl in ("plain", "chunked")]
            # fused is correct at fp32 only (bnlit.loss.FUSED_PRECISIONS): compare it with chunked there
            variants += [(name, [f"--override=module.loss_impl={impl}", "--override=trainer.precision=32-true"])
                         for name, impl in (("bench_loss_fused", "fused"), ("bench_loss_chunked_32", "chunked"))]
            variants += [(f"bench_sdpa_{b}", ["--override=module.document_masking=false",
                                              f"--override=module.sdpa_backend={b}"])
                         for b in ("auto", "cudnn", "flash", "efficient")]
        checks += [Check(name, [*bench, *extra], None if args.rehearse else BENCH_S, needs="prepare")
                   for name, extra in variants]
    if n_gpus >= 2:
        fsdp_dir = root / "fsdp_2gpu"
        fsdp = [py, "-m", "bnlit.train", *[o for o in base if not o.startswith("trainer=")], "trainer=fsdp",
                "trainer.devices=2", "logger=csv", f"trainer.max_steps={args.fsdp_steps}",
                f"trainer.val_check_interval={args.fsdp_steps}", "trainer.limit_val_batches=2",
                "validate_at_start=false", f"callbacks.model_checkpoint.every_n_train_steps={args.fsdp_steps}",
                "trainer.enable_progress_bar=false", "~callbacks.progress_bar", f"hydra.run.dir={fsdp_dir}"]
        estimate = train_estimate_s(compose([*base, "trainer=fsdp"]), args.fsdp_steps)
        checks.append(Check("fsdp_2gpu", fsdp, estimate and estimate / 2, fsdp_dir, needs="prepare"))
    return checks


# -- reading what a check left --------------------------------------------------------------------

def last(series: dict, key: str) -> float | None:
    v = series.get(key)
    return v[-1][1] if v else None


def first(series: dict, key: str) -> float | None:
    v = series.get(key)
    return v[0][1] if v else None


def memory_estimate_gib(run_dir: Path) -> float | None:
    """``bnlit.speed.flops.training_memory_bytes`` of the run's own config (``.hydra/config.yaml``)."""
    from omegaconf import OmegaConf

    from bnlit.model import ModelConfig
    from bnlit.speed.flops import training_memory_bytes

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    cfg = OmegaConf.load(path)
    model = ModelConfig(**{k: v for k, v in OmegaConf.to_container(cfg.model.config).items() if k != "_target_"})
    est = training_memory_bytes(model, cfg.data.seq_len, cfg.data.batch_size,
                                bool(cfg.model.get("activation_checkpointing", False)))
    return est["total"] / 2**30


SAVED = re.compile(r"checkpoint: saved (\S+) \(([\d.]+) GiB\) in ([\d.]+) s")


def read_run(run_dir: Path) -> dict:
    """What a finished (or stopped) train run left: tokens/s, both MFUs and the step time over its
    first throughput window, peak memory against the estimate, the parity verdict, the fast-path
    line, the checkpoint saves, the compile summary and the profile."""
    from bnlit.run_report import read_metrics  # here, not at the top: --help answers without torch

    csv_path = run_dir / "csv" / "metrics.csv"
    series = read_metrics(csv_path) if csv_path.is_file() else {}
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    lines = [l.split(" - ", 1)[-1] for l in log.splitlines()]
    pick = lambda word: next((l for l in lines if word in l), None)  # noqa: E731
    memory_key = "memory/peak_gib" if "memory/peak_gib" in series else "memory/peak_rss_gib"  # CUDA / CPU
    peak, estimate = first(series, memory_key), memory_estimate_gib(run_dir)
    profile = pick("profile: where the time went")
    return {
        "tokens_per_s": first(series, "throughput/tokens_per_s"),
        "mfu_pct": first(series, "throughput/mfu"),  # PaLM's convention: the full attention matrix
        "hfu_pct": first(series, "throughput/hfu"),  # what causal and document masking leave to compute
        "step_ms": first(series, "throughput/step_ms"),
        "peak_memory_gib": peak,
        "peak_memory_key": memory_key,
        "estimate_gib": estimate,
        "peak_over_estimate": round(peak / estimate, 3) if peak and estimate else None,
        "train_loss": last(series, "train/loss"),
        "val_loss": last(series, "val/loss"),
        "parity": pick("fast-path parity"),
        "fast_path": pick("fast path: "),
        "compile": next((l for l in lines if re.match(r"torch\.compile: \d+ graphs? \(", l)), None),
        "recompile_warnings": sum("recompiled after warm-up" in l for l in lines),
        "checkpoint_saves": [{"file": m[1], "gib": float(m[2]), "s": float(m[3])}
                             for m in map(SAVED.search, lines) if m],
        "profile": profile,
        "profile_files": sorted(str(p) for p in (run_dir / "plots").glob("profile_step*.json"))
                         + sorted(str(p) for p in (run_dir / "plots").glob("memory_snapshot*")),
    }


def read_bench(stdout: str) -> dict:
    r = json.loads(stdout[stdout.index("{"):])
    keys = ("device", "tokens_per_s", "mfu_pct", "peak_memory_gib", "micro_batch", "seq_len", "precision", "loss_impl",
            "sdpa_backend", "document_masking", "attention_kernel")
    return {k: r.get(k) for k in keys}


def read_pytest(stdout: str) -> dict:
    """The counts of pytest's last summary line ("3 passed, 2 skipped in 4.1s") and its skip reasons."""
    tail = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail)}
    # "SKIPPED [2] tests/test_gpu.py:63: machine: no CUDA device" -> the reason
    skips = [re.sub(r"^\S+:\d+: ", "", l.split("] ", 1)[-1]) for l in stdout.splitlines() if l.startswith("SKIPPED")]
    return {"tests": counts, "skip_reasons": sorted(set(skips))[:5]}


def sharded_save(overrides: list[str], out: Path) -> dict:
    """One sharded checkpoint of the training state of ``overrides``' model (fp32 weights and
    AdamW moments, on CUDA when there is one), written by ``ShardedWriter`` as an FSDP2 run writes
    it (one process here: torch DCP saves without a process group): the seconds the caller was
    blocked, the seconds until it was complete on disk, and its size."""
    import torch
    from hydra.utils import instantiate

    from bnlit.checkpointing import ShardedWriter, sharded_complete

    cfg = compose(overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = instantiate(cfg.model.config)
    from bnlit.model import Transformer

    net = Transformer(model).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    for p in net.parameters():  # one step, so the moments exist as in every checkpoint after step 1
        p.grad = torch.randn_like(p)
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    path, tmp = out / "step0000001.ckpt", out / ".step0000001.ckpt.tmp"
    writer = ShardedWriter(async_save=True)
    t0 = time.perf_counter()
    writer.save({"state_dict": net.state_dict(), "optimizer_0": opt.state_dict()}, {"global_step": 1, "model_config": model.to_dict()},
                path, tmp, 0)
    blocked = time.perf_counter() - t0
    writer.wait()
    total = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else 0
    return {"device": device, "model": cfg.model.config.name, "blocked_s": round(blocked, 4), "total_s": round(total, 4),
            "gib": round(size / 2**30, 3), "complete": sharded_complete(path), "path": str(path)}


# -- running inside the budget --------------------------------------------------------------------

def run_one(check: Check, timeout_s: float) -> tuple[int | None, str, str]:
    """``(returncode or None when stopped at the timeout, stdout, stderr)``; on the timeout the
    check's whole process group (loader workers, compile workers) is killed."""
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), **check.env)
    proc = subprocess.Popen(check.command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout_s, 0.1))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own just now
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def run_checks(checks: list[Check], budget_s: float, emit=print, clock=time.monotonic) -> int:
    """Run ``checks`` in order inside ``budget_s`` seconds, one JSON line each through ``emit``,
    then the budget line; returns how many failed."""
    start = clock()
    failed, skipped, outcome = 0, [], {}
    for check in checks:
        left = budget_s - (clock() - start)
        line: dict = {"check": check.name}
        if check.needs and outcome.get(check.needs) is False:
            reason = f"{check.needs} failed"
        elif left <= 0:
            reason = f"the {budget_s:g} s budget is spent"
        elif check.estimate_s is not None and check.estimate_s > left:
            reason = f"needs ~{check.estimate_s:.0f} s (an estimate), {left:.0f} s of the {budget_s:g} s budget left"
        else:
            reason = None
        if reason:
            skipped.append(check.name)
            outcome[check.name] = None
            emit(json.dumps({**line, "ok": None, "skipped": reason}))
            continue
        t0 = clock()
        rc, out, err = run_one(check, left)
        line |= {"ok": rc == 0, "rc": rc, "wall_s": round(clock() - t0, 1)}
        if rc is None:
            line["error"] = f"stopped at the end of the {budget_s:g} s budget after {line['wall_s']} s"
        try:
            if check.run_dir is not None:
                line |= read_run(check.run_dir)
            elif check.name.startswith("bench") and rc == 0:
                line |= read_bench(out)
            elif check.name == "gpu_tests":
                line |= read_pytest(out)
            elif check.name == "checkpoint_sharded" and rc == 0:
                line |= json.loads(out.strip().splitlines()[-1])
        except (ValueError, OSError) as e:
            line |= {"ok": False, "error": f"could not read the results: {e}"}
        if not line["ok"]:
            line["stderr_tail"] = str(err)[-1500:]
            failed += 1
        outcome[check.name] = bool(line["ok"])
        emit(json.dumps(line, default=str))
    emit(json.dumps({"check": "budget", "budget_s": budget_s, "used_s": round(clock() - start, 1), "skipped": skipped}))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: must be >= 2 (the first step compiles and stays out of the window)")
    if args.sharded_save is not None:
        print(json.dumps(sharded_save(args.override, args.sharded_save)))
        return 0
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 0 and not (args.dry_run or args.rehearse or args.prepare_only):
        print(json.dumps({"check": "cuda", "ok": False, "error": "no CUDA device: this is the GPU check; rehearse it "
                          "on CPU with `python scripts/gpu_check.py --rehearse` (docs/production.md)"}))
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="bnlit_gpu_check_"))
    checks = plan(args, root, max(n_gpus, 2) if args.dry_run else n_gpus)
    if args.dry_run:
        for check in checks:
            print(json.dumps(check.plan_line()))
        print(json.dumps({"check": "budget", "budget_s": args.budget}))
        return 0
    if args.prepare_only:
        checks = checks[:1]
    return 1 if run_checks(checks, args.budget, emit=lambda s: print(s, flush=True)) else 0


if __name__ == "__main__":
    build_parser().parse_args()  # --help without importing torch
    sys.exit(main())
