"""Throughput benchmark: ``python scripts/bench.py [--json]``.

CPU (no CUDA device): in one process, the same model, data and batches through (a) a plain
PyTorch training loop written below and (b) bnlit's Lightning path (``LMModule`` + ``L.Trainer``
built from the real config with the default callbacks), alternated over ``--reps`` repetitions,
plus the Lightning path without the gradient-flow arbiter and with it checking every step.
Prints tokens/s of each, ``lightning_vs_raw``, the arbiter's step-time ratios, the data loader's
share of the raw loop's step time, and MFU against this CPU's measured matmul peak.

Like for like: validation is off and checkpoints fall outside the timed steps (the raw loop does
neither); the first ``--warmup`` optimizer steps are not timed (the arbiter's one-time parity probe
is among them). Every other default callback runs: NaN guard, arbiter, MFU monitor, LR monitor,
progress bar, CSV logger (the W&B default is swapped for CSV).

CUDA: the ``400m`` preset at seq 2048 on the ``trainer=h100`` fast path (bf16-mixed, compiled
fullgraph, flash SDPA, fused AdamW) on random tokens through a pinned, prefetching loader, a few
warm-up and ``--steps`` timed steps; prints tokens/s, MFU against the datasheet peak and the peak
allocated memory. A micro-batch that does not fit is halved and retried (the figure says which ran).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from torch.utils.data import DataLoader

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR
from bnlit.data.dataset import PackedWindows
from bnlit.speed.flops import flops_per_token
from bnlit.document_masking import document_mask
from bnlit.loss import loss_fn
from bnlit.module import param_groups
from bnlit.speed.throughput import resolve_peak
from bnlit.tokenizer import EOS_ID
from bnlit.train import instantiate_group


def arbiter_available() -> tuple[bool, str | None]:
    """Whether ``bnlit.callbacks.gradient_flow.GradientFlowArbiter`` can be imported (imported lazily:
    the benchmark runs without it)."""
    try:
        from bnlit.callbacks.gradient_flow import GradientFlowArbiter  # noqa: F401
    except ImportError as e:
        return False, f"bnlit.callbacks.gradient_flow.GradientFlowArbiter not importable ({e}); arbiter figures are null"
    return True, None


def make_cfg(overrides: list[str], run_dir: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    return cfg


class Clock(L.Callback):
    """Wall time from the end of optimizer step ``warmup`` to the end of step ``warmup + steps``
    (CUDA synchronised at both ends)."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.t0 = self.t1 = None
        self.tokens = 0

    def _now(self, pl_module) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup and self.t0 is None:
            self.t0 = self._now(pl_module)
        elif self.t0 is not None and self.t1 is None:
            self.tokens += batch[0].numel()
            if trainer.global_step == self.warmup + self.steps:
                self.t1 = self._now(pl_module)

    @property
    def tokens_per_s(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError("bench: the timed steps did not complete")
        return self.tokens / (self.t1 - self.t0)


def lightning_run(cfg: DictConfig, datamodule, warmup: int, steps: int, train_dataloaders=None) -> dict:
    """bnlit's path as ``bnlit.train.train`` builds it (minus validation); tokens/s of the timed steps."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    module = instantiate(cfg.module)(model=model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler)
    clock = Clock(warmup, steps)
    callbacks = [*instantiate_group(cfg.get("callbacks")), clock]
    loggers = instantiate_group(cfg.get("logger"))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    trainer.fit(module, datamodule=datamodule, train_dataloaders=train_dataloaders)
    mfu = next((c for c in callbacks if type(c).__name__ == "ThroughputMonitor"), None)
    arbiter = next((c for c in callbacks if type(c).__name__ == "GradientFlowArbiter"), None)
    out = {"tokens_per_s": clock.tokens_per_s, "monitor": dict(mfu.last) if mfu else {},
           "attention_kernel": module.attention_kernel}
    if arbiter is not None and arbiter.state.sentinel_steps:
        # measured inside the same run: the sentinel's own time per step over the mean step time
        step_s = cfg.data.batch_size * cfg.data.seq_len / clock.tokens_per_s
        out["sentinel_share"] = arbiter.state.sentinel_seconds / arbiter.state.sentinel_steps / step_s
    return out


def raw_run(cfg: DictConfig, datamodule, warmup: int, steps: int) -> dict:
    """The same model, optimizer, schedule, clipping and batches in a plain PyTorch loop."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    model.loss_fn = loss_fn(cfg.module.loss_impl, "cpu", cfg.trainer.precision)
    optimizer = instantiate(cfg.optimizer)(param_groups(model, cfg.optimizer.weight_decay))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    clip = cfg.trainer.gradient_clip_val
    batches = iter(datamodule.train_dataloader())
    model.train()
    tokens, fetch, t0 = 0, 0.0, None
    for i in range(warmup + steps):
        if i == warmup:
            tokens, fetch, t0 = 0, 0.0, time.perf_counter()
        tf = time.perf_counter()
        x, y = next(batches)
        fetch += time.perf_counter() - tf
        mask = document_mask(x, EOS_ID) if cfg.module.document_masking else None
        loss = model(x, y, mask=mask)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        tokens += x.numel()
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, "data_share": fetch / elapsed}


def masking_interleaved(cfg: DictConfig, datamodule, warmup: int, pairs: int) -> dict:
    """The step-time cost of document masking on its own: one model, one optimizer and one batch
    stream in a plain loop, the mask on and off on alternate optimizer steps (on/off, off/on, ...),
    so load that drifts over seconds cancels within each pair. ``ratio``: the median over pairs of
    (step time with the mask) / (step time without), the mask's construction included."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    model.loss_fn = loss_fn(cfg.module.loss_impl, "cpu", cfg.trainer.precision)
    optimizer = instantiate(cfg.optimizer)(param_groups(model, cfg.optimizer.weight_decay))
    def forever():
        while True:
            yield from datamodule.train_dataloader()

    batches = forever()
    model.train()
    times: dict[bool, list[float]] = {True: [], False: []}
    docs = []
    for i in range(2 * (warmup + pairs)):
        masked = (i % 2 == 0) == ((i // 2) % 2 == 0)  # who goes first alternates from pair to pair
        x, y = next(batches)
        t0 = time.perf_counter()
        mask = document_mask(x, EOS_ID) if masked else None
        model(x, y, mask=mask).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2 * warmup:
            times[masked].append(time.perf_counter() - t0)
            docs.append(float((x == EOS_ID).sum(1).float().mean()) + 1)
    ratios = [on / off for on, off in zip(times[True], times[False])]
    return {"ratio": statistics.median(ratios), "pairs": pairs, "ratio_quartiles": statistics.quantiles(ratios, n=4),
            "step_ms_masked": 1e3 * statistics.median(times[True]),
            "step_ms_causal": 1e3 * statistics.median(times[False]),
            "documents_per_window": statistics.mean(docs), "load_average_1m": os.getloadavg()[0]}


def cpu_bench(args, run_root: Path) -> dict:
    have_arbiter, note = arbiter_available()
    base = [f"model={args.model}", "logger=csv", "trainer.limit_val_batches=0", "validate_at_start=false",
            f"trainer.max_steps={args.warmup + args.steps}",
            f"callbacks.model_checkpoint.every_n_train_steps={10 * (args.warmup + args.steps)}",
            *(["data.seq_len=" + str(args.seq_len)] if args.seq_len else []),
            *(["data.batch_size=" + str(args.batch_size)] if args.batch_size else []), *args.override]
    variants: dict[str, list[str]] = {"lightning": []}
    if have_arbiter:
        variants["lightning_no_arbiter"] = ["~callbacks.gradient_flow"]
        variants["lightning_arbiter_every_step"] = ["callbacks.gradient_flow.every_n_steps=1"]
    else:
        variants["lightning"] = ["~callbacks.gradient_flow"]
    # the step-time cost of document masking and of the chunked loss (module.* switches)
    masking_on = make_cfg(base, run_root / "probe").module.document_masking
    variants["lightning_masking_flipped"] = [f"module.document_masking={str(not masking_on).lower()}"]
    variants["lightning_chunked_loss"] = ["module.loss_impl=chunked"]
    variants["lightning_fused_loss"] = ["module.loss_impl=fused"]  # torch's F.linear_cross_entropy (fp32 only)
    if args.variants:  # a subset, for a longer paired comparison of one switch
        unknown = set(args.variants) - set(variants)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {sorted(set(variants) - {'lightning'})}")
        variants = {k: v for k, v in variants.items() if k == "lightning" or k in args.variants}
    cfgs = {name: make_cfg(base + extra, run_root / name) for name, extra in variants.items()}
    cfg = cfgs["lightning"]
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")

    order = ["raw", *variants]
    tps: dict[str, list[float]] = {k: [] for k in order}
    data_share, monitor, sentinel_share = [], {}, []
    for rep in range(args.reps):
        for name in order[rep % len(order):] + order[: rep % len(order)]:  # rotate who goes first
            if name == "raw":
                r = raw_run(cfg, datamodule, args.warmup, args.steps)
                data_share.append(r["data_share"])
            else:
                r = lightning_run(cfgs[name], datamodule, args.warmup, args.steps)
                if name == "lightning":
                    monitor = r["monitor"]
                    sentinel_share += [r["sentinel_share"]] if "sentinel_share" in r else []
            tps[name].append(r["tokens_per_s"])
            print(f"rep {rep + 1}/{args.reps} {name:30s} {r['tokens_per_s']:10,.0f} tokens/s", file=sys.stderr, flush=True)

    # medians over the alternated repetitions; best-of (timeit's rule: other load only slows a
    # run down) alongside, since on a shared machine one lucky repetition can carry it
    best = {k: max(v) for k, v in tps.items()}
    med = {k: statistics.median(v) for k, v in tps.items()}
    # a ratio within one repetition compares runs made minutes apart, not a whole benchmark apart:
    # the median of these paired ratios is the least sensitive to load that drifts over the run
    # (None where --variants left one of the two out)
    def paired(a: str, b: str) -> float | None:
        return statistics.median(x / y for x, y in zip(tps[a], tps[b])) if a in tps and b in tps else None

    def best_of(a: str, b: str) -> float | None:
        return best[a] / best[b] if a in best and b in best else None

    model_cfg = instantiate(cfg.model.config)
    fpt = flops_per_token(model_cfg, cfg.data.seq_len)
    peak = resolve_peak("cpu", torch.float32)
    out = {
        "device": "cpu", "threads": torch.get_num_threads(), "model": model_cfg.name,
        "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "warmup_steps": args.warmup,
        "timed_steps": args.steps, "reps": args.reps,
        "load_average_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "tokens_per_s_raw": med["raw"], "tokens_per_s_lightning": med["lightning"],
        "lightning_vs_raw": paired("lightning", "raw"),
        "lightning_vs_raw_of_medians": med["lightning"] / med["raw"],
        "lightning_vs_raw_best_of": best["lightning"] / best["raw"],
        "arbiter_overhead_ratio_default": None, "arbiter_overhead_ratio_every_step": None,
        "arbiter_every_n_steps_default": None, "arbiter_sentinel_share": None, "arbiter_note": note,
        "data_loader_share": statistics.median(data_share),
        "lightning_data_wait_pct": monitor.get("throughput/data_wait_pct"),
        "flops_per_token": fpt, "peak_flops": peak.flops, "peak_source": peak.source,
        "mfu_cpu_pct_raw": 100 * fpt * med["raw"] / peak.flops,
        "mfu_cpu_pct_lightning": 100 * fpt * med["lightning"] / peak.flops,
        "peak_rss_gib": monitor.get("memory/peak_rss_gib"),
        "runs_tokens_per_s": tps,
    }
    # step-time ratios (1.05 = 5% slower): masking on / off, chunked or fused / the configured loss
    on, off = ("lightning", "lightning_masking_flipped") if masking_on else ("lightning_masking_flipped", "lightning")
    out["document_masking_step_time_ratio"] = paired(off, on)
    out["document_masking_step_time_ratio_best_of"] = best_of(off, on)
    out["chunked_loss_step_time_ratio"] = paired("lightning", "lightning_chunked_loss")  # vs the configured loss_impl
    out["fused_loss_step_time_ratio"] = paired("lightning", "lightning_fused_loss")
    out["loss_impl"] = cfg.module.loss_impl
    if args.masking_pairs:
        out["document_masking_interleaved"] = masking_interleaved(cfg, datamodule, args.warmup, args.masking_pairs)
    if args.memory:
        out["loss_memory"] = loss_memory(args)
    if have_arbiter:
        # step-time ratio with / without the arbiter (1.01 = 1% slower)
        out["arbiter_overhead_ratio_default"] = paired("lightning_no_arbiter", "lightning")
        out["arbiter_overhead_ratio_every_step"] = paired("lightning_no_arbiter", "lightning_arbiter_every_step")
        out["arbiter_overhead_ratio_default_best_of"] = best_of("lightning_no_arbiter", "lightning")
        out["arbiter_overhead_ratio_every_step_best_of"] = best_of("lightning_no_arbiter", "lightning_arbiter_every_step")
        out["arbiter_every_n_steps_default"] = int(cfg.callbacks.gradient_flow.every_n_steps)
        # the every-step sentinel's share of the default run's step time, timed within each run
        out["arbiter_sentinel_share"] = statistics.median(sentinel_share) if sentinel_share else None
        out["arbiter_note"] = ("step-time ratio with/without GradientFlowArbiter; its one-time parity probe at "
                               "step 1 is in the untimed warm-up")
    return out


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(impl: str, model: str, seq_len: int, batch_size: int) -> dict:
    """In a fresh process: peak resident memory (VmHWM) over one forward+backward of ``model`` at
    ``seq_len`` x ``batch_size`` with ``module.loss_impl=impl``, above the resident memory once the
    model and the batch exist."""
    cfg = make_cfg([f"model={model}", f"module.loss_impl={impl}"], Path(tempfile.gettempdir()))
    torch.manual_seed(0)
    net = instantiate(cfg.model)
    net.loss_fn = loss_fn(impl, "cpu", "32-true")
    x, y = torch.randint(0, net.config.vocab_size, (2, batch_size, seq_len))
    mask = document_mask(x, EOS_ID) if cfg.module.document_masking else None
    base = _rss_mib("VmRSS")
    net(x, y, mask=mask).backward()
    return {"impl": impl, "baseline_mib": base, "peak_mib": _rss_mib("VmHWM"), "growth_mib": _rss_mib("VmHWM") - base}


MEMORY_IMPLS = ("plain", "chunked", "fused")


def loss_memory(args) -> dict:
    """Peak memory of one forward+backward with each loss (fp32), each in its own process, in a
    rotating order over ``--memory-reps`` repetitions: ``<impl>_vs_plain`` is the median ratio of
    the growth above the model's resident memory, paired within a repetition."""
    import subprocess

    runs: dict[str, list[dict]] = {impl: [] for impl in MEMORY_IMPLS}
    for rep in range(args.memory_reps):
        k = rep % len(MEMORY_IMPLS)
        for impl in MEMORY_IMPLS[k:] + MEMORY_IMPLS[:k]:
            cmd = [sys.executable, __file__, "--memory-child", impl, "--model", args.memory_model,
                   "--seq-len", str(args.memory_seq_len), "--batch-size", str(args.memory_batch_size)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            runs[impl].append(r)
            print(f"memory rep {rep + 1}/{args.memory_reps} {impl:8s} peak growth {r['growth_mib']:8.0f} MiB",
                  file=sys.stderr, flush=True)
    out = {"model": args.memory_model, "seq_len": args.memory_seq_len, "batch_size": args.memory_batch_size,
           "what": "peak RSS growth over one forward+backward, above the resident model and batch"}
    for impl in MEMORY_IMPLS:
        out[f"{impl}_growth_mib"] = statistics.median(r["growth_mib"] for r in runs[impl])
    for impl in MEMORY_IMPLS[1:]:
        out[f"{impl}_vs_plain"] = statistics.median(
            r["growth_mib"] / p["growth_mib"] for p, r in zip(runs["plain"], runs[impl]))
    return {**out, "runs": runs}


def cuda_bench(args, run_root: Path) -> dict:
    """400m at seq 2048 on trainer=h100 settings, random tokens, one optimizer step per micro-batch."""
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda", torch.cuda.current_device())
    seq_len = args.seq_len or 2048
    micro = args.batch_size or 16
    have_arbiter, note = arbiter_available()
    total = args.warmup + args.steps
    while True:
        overrides = [f"model={args.model}", "trainer=h100", "logger=csv",
                     f"data.seq_len={seq_len}", f"data.batch_size={micro}", "trainer.accumulate_grad_batches=1",
                     f"trainer.max_steps={total}", "trainer.limit_val_batches=0", "validate_at_start=false",
                     "trainer.enable_progress_bar=false", "~callbacks.progress_bar",
                     f"callbacks.model_checkpoint.every_n_train_steps={10 * total}",
                     # both read the tokenizer and held-out text of a data module; this one is random tokens
                     "~callbacks.fertility", "~callbacks.random_twin",
                     f"callbacks.throughput.warmup_steps={args.warmup}",
                     *([] if have_arbiter else ["~callbacks.gradient_flow"]),
                     # the eager fp32 parity probe with math attention at this size needs far more
                     # memory than training; --parity turns it back on
                     *([] if args.parity or not have_arbiter else ["callbacks.gradient_flow.fast_path_parity=false"]),
                     *args.override]
        cfg = make_cfg(overrides, run_root / f"cuda_mb{micro}")
        vocab = cfg.model.config.vocab_size
        tokens = np.random.default_rng(0).integers(0, vocab, size=micro * total * seq_len + 1, dtype=np.int64)
        loader = DataLoader(PackedWindows(tokens, seq_len), batch_size=micro, shuffle=False, drop_last=True,
                            num_workers=cfg.data.num_workers, pin_memory=True,
                            persistent_workers=cfg.data.num_workers > 0,
                            prefetch_factor=cfg.data.get("prefetch_factor") if cfg.data.num_workers > 0 else None)
        torch.cuda.reset_peak_memory_stats(device)
        t_start = time.perf_counter()
        try:
            r = lightning_run(cfg, None, args.warmup, args.steps, train_dataloaders=loader)
            break
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
            print(f"bench: micro-batch {micro} ran out of memory; retrying with {micro // 2}", file=sys.stderr)
            micro //= 2
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    wall = time.perf_counter() - t_start
    model_cfg = instantiate(cfg.model.config)
    fpt = flops_per_token(model_cfg, seq_len)
    peak = resolve_peak(device, torch.bfloat16)
    return {
        "device": torch.cuda.get_device_name(device), "device_key": peak.key, "model": model_cfg.name,
        "seq_len": seq_len, "micro_batch": micro, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "precision": cfg.trainer.precision, "compile": cfg.module.compile, "fullgraph": cfg.module.fullgraph,
        "sdpa_backend": cfg.module.sdpa_backend, "fused_adamw": cfg.optimizer.fused,
        "loss_impl": cfg.module.loss_impl, "document_masking": cfg.module.document_masking,
        "attention_kernel": r["attention_kernel"],
        "tokens_per_s": r["tokens_per_s"], "flops_per_token": fpt, "tflops": fpt * r["tokens_per_s"] / 1e12,
        "peak_flops": peak.flops, "peak_measured": peak.measured, "peak_source": peak.source,
        "mfu_pct": 100 * fpt * r["tokens_per_s"] / peak.flops,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "monitor": r["monitor"], "arbiter_note": note, "fit_wall_s": wall,
        "parity_probe": bool(args.parity),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    ap.add_argument("--model", default=None, help="preset (CPU default: tiny; CUDA default: 400m)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the config's (CPU 256, CUDA 2048)")
    ap.add_argument("--batch-size", type=int, default=None, help="micro-batch; default: the config's")
    ap.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps (CPU 5, CUDA 5)")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (CPU 100, CUDA 20)")
    ap.add_argument("--reps", type=int, default=3, help="CPU: alternated repetitions")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    ap.add_argument("--variants", type=lambda v: v.split(","), default=None,
                    help="CPU: only these Lightning variants beside raw and lightning (comma-separated: "
                         "lightning_masking_flipped, lightning_chunked_loss, lightning_fused_loss, lightning_no_arbiter, "
                         "lightning_arbiter_every_step); figures of the others are null")
    ap.add_argument("--masking-pairs", type=int, default=50,
                    help="CPU: optimizer steps per side of the interleaved masking on/off comparison (0: skip)")
    ap.add_argument("--parity", action="store_true", help="CUDA: keep the arbiter's fp32 parity probe")
    ap.add_argument("--cpu", action="store_true", help="run the CPU benchmark even if CUDA is available")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable); on CUDA "
                    "e.g. --override module.loss_impl=fused --override module.sdpa_backend=cudnn")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="CPU: also measure the peak memory of the plain, chunked and fused loss (subprocesses)")
    ap.add_argument("--memory-model", default="25m", help="CPU memory check: preset (default 25m)")
    ap.add_argument("--memory-seq-len", type=int, default=512, help="CPU memory check: sequence length (default 512)")
    ap.add_argument("--memory-batch-size", type=int, default=8, help="CPU memory check: micro-batch size (default 8)")
    ap.add_argument("--memory-reps", type=int, default=2, help="repetitions of plain/chunked/fused, rotated")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        torch.set_num_threads(args.threads or 1)
        result = memory_child(args.memory_child, args.model, args.seq_len, args.batch_size)
        print(json.dumps(result))
        return result
    cuda = torch.cuda.is_available() and not args.cpu
    args.model = args.model or ("400m" if cuda else "tiny")
    args.warmup = 5 if args.warmup is None else args.warmup
    args.steps = args.steps or (20 if cuda else 100)
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric", "bnlit"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("WANDB_MODE", "disabled")
    # the Trainer prints model summaries to stdout: keep stdout for the result alone
    with tempfile.TemporaryDirectory(prefix="bnlit_bench_") as tmp, contextlib.redirect_stdout(sys.stderr):
        result = cuda_bench(args, Path(tmp)) if cuda else cpu_bench(args, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif cuda:
        print(f"{result['device']}: {result['model']} seq {result['seq_len']} micro-batch {result['micro_batch']}: "
              f"{result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} TFLOP/s, MFU {result['mfu_pct']:.1f}% "
              f"of {result['peak_flops'] / 1e12:.1f} TFLOP/s, peak memory {result['peak_memory_gib']:.1f} GiB")
    else:
        fmt = lambda v, f: "null" if v is None else format(v, f)  # noqa: E731
        print(f"cpu ({result['threads']} threads), {result['model']} seq {result['seq_len']} batch {result['batch_size']}, "
              f"{result['timed_steps']} timed steps x {result['reps']} reps (medians, ratios paired per rep; load average "
              f"{result['load_average_1m']:.1f} on {result['cpu_count']} cores)")
        print(f"  raw PyTorch loop   {result['tokens_per_s_raw']:10,.0f} tokens/s")
        print(f"  bnlit Lightning    {result['tokens_per_s_lightning']:10,.0f} tokens/s  "
              f"lightning_vs_raw {result['lightning_vs_raw']:.3f} (best of: {result['lightning_vs_raw_best_of']:.3f})")
        print(f"  arbiter step-time ratio: every {result['arbiter_every_n_steps_default']} steps "
              f"{fmt(result['arbiter_overhead_ratio_default'], '.3f')}, every step "
              f"{fmt(result['arbiter_overhead_ratio_every_step'], '.3f')}; every-step sentinel "
              f"{fmt(None if result['arbiter_sentinel_share'] is None else 100 * result['arbiter_sentinel_share'], '.2f')}% "
              f"of step time (timed within the default runs)")
        print(f"  data loader share of raw step time {100 * result['data_loader_share']:.1f}%; "
              f"Lightning data wait {fmt(result['lightning_data_wait_pct'], '.1f')}%")
        print(f"  document masking step-time ratio {fmt(result['document_masking_step_time_ratio'], '.3f')}; step-time "
              f"ratio to the {result['loss_impl']} loss: chunked {fmt(result['chunked_loss_step_time_ratio'], '.3f')}, "
              f"fused {fmt(result['fused_loss_step_time_ratio'], '.3f')}")
        if result.get("document_masking_interleaved"):
            m = result["document_masking_interleaved"]
            print(f"  document masking, interleaved step by step ({m['pairs']} pairs, {m['documents_per_window']:.1f} "
                  f"documents per window): step-time ratio {m['ratio']:.3f} (quartiles "
                  f"{m['ratio_quartiles'][0]:.3f}-{m['ratio_quartiles'][2]:.3f}), {m['step_ms_masked']:.1f} vs "
                  f"{m['step_ms_causal']:.1f} ms")
        if result.get("loss_memory"):
            m = result["loss_memory"]
            print(f"  peak memory of one forward+backward ({m['model']}, seq {m['seq_len']}, batch {m['batch_size']}): "
                  f"plain +{m['plain_growth_mib']:.0f} MiB, chunked +{m['chunked_growth_mib']:.0f} MiB "
                  f"({m['chunked_vs_plain']:.2f}x), fused +{m['fused_growth_mib']:.0f} MiB ({m['fused_vs_plain']:.2f}x)")
        print(f"  MFU {result['mfu_cpu_pct_lightning']:.2f}% (raw {result['mfu_cpu_pct_raw']:.2f}%) of the measured "
              f"matmul peak {result['peak_flops'] / 1e9:.1f} GFLOP/s")
    return result


if __name__ == "__main__":
    main()
