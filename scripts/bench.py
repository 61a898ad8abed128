"""Throughput benchmark: ``python scripts/bench.py [--json]``; the run as the trainer runs it.

CPU (no CUDA device): in one process, the same model, data and batches through (a) a plain
PyTorch training loop written below and (b) bnlit's Lightning path (``LMModule`` + ``L.Trainer``
built from the real config with the default callbacks), alternated over ``--reps`` repetitions,
plus the Lightning path without the gradient-flow arbiter. Prints tokens/s of each,
``lightning_vs_raw``, the arbiter's step-time ratio, the data loader's share of the raw loop's
step time, and MFU against this CPU's measured matmul peak. ``--variants``/``--all`` add the
arbiter checking every step, document masking flipped, the chunked and the fused loss, AdamW in
place of the configured optimizer (CPU: Muon with AdamW, ``optimizer=muon``) (a
variant the run's precision refuses, ``fused`` under bf16-mixed, is skipped with one line);
``--masking-pairs`` and ``--memory`` add longer measurements. Ctrl-C prints what was measured so
far.

Like for like, and like the trainer: the data module's real shards (EOS and the document mask as
in training), the configured precision (the raw loop runs the same autocast), accumulation (the
raw loop divides the loss by it, as Lightning does), ``keep_freed_memory`` as ``bnlit.train``
sets it on CPU, and the parity probe at step 1 in the untimed warm-up. Validation is off and
checkpoints fall outside the timed steps (the raw loop does neither). Every other default
callback runs: NaN guard, arbiter, MFU monitor, LR monitor, progress bar, CSV logger (the W&B
default is swapped for CSV).

CUDA: ``trainer=h100`` as configured (``400m`` at seq 2048, micro-batch 16, accumulation 16,
bf16-mixed, per-block compile, fused AdamW, the parity probe) on the data module's shards, built
on the CPU before the model reaches the device; a few warm-up and ``--steps`` timed optimizer
steps; prints tokens/s, MFU (PaLM convention) and HFU, the peak allocated memory against
``bnlit.speed.flops.training_memory_bytes``, the parity verdict and the compile count. A micro-batch that
does not fit is halved and the accumulation doubled (the figure says which ran).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

# the variants beside raw and lightning: the default set, and those behind --variants / --all
DEFAULT_VARIANTS = ("lightning_no_arbiter",)
EXTRA_VARIANTS = ("lightning_arbiter_every_step", "lightning_masking_flipped", "lightning_chunked_loss",
                  "lightning_fused_loss", "lightning_adamw")


def _parser() -> argparse.ArgumentParser:
    """The command line, built before torch and Lightning are imported (``--help`` answers at once)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    ap.add_argument("--model", default=None, help="preset (CPU default: tiny; CUDA default: 400m)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the config's (CPU 256, CUDA 2048)")
    ap.add_argument("--batch-size", type=int, default=None, help="micro-batch; default: the config's")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed optimizer steps (CPU: through the first logging step, 10; CUDA 5)")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (CPU 40, CUDA 10)")
    ap.add_argument("--reps", type=int, default=3, help="CPU: alternated repetitions")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    ap.add_argument("--variants", type=lambda v: v.split(","), default=None,
                    help="CPU: also these Lightning variants beside raw, lightning and lightning_no_arbiter "
                         f"(comma-separated: {', '.join(EXTRA_VARIANTS)}); figures of the others are null")
    ap.add_argument("--all", action="store_true", help="CPU: every variant (several minutes longer)")
    ap.add_argument("--masking-pairs", type=int, default=0,
                    help="CPU: optimizer steps per side of an interleaved masking on/off comparison (0: skip)")
    ap.add_argument("--accumulate", type=int, default=None, help="CUDA: micro-batches per step (default: the config's)")
    ap.add_argument("--cpu", action="store_true", help="run the CPU benchmark even if CUDA is available")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable); on CUDA "
                    "e.g. --override module.loss_impl=fused --override module.sdpa_backend=cudnn")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=False,
                    help="CPU: also measure the peak memory of the plain, chunked and fused loss (subprocesses)")
    ap.add_argument("--memory-model", default="25m", help="CPU memory check: preset (default 25m)")
    ap.add_argument("--memory-seq-len", type=int, default=512, help="CPU memory check: sequence length (default 512)")
    ap.add_argument("--memory-batch-size", type=int, default=8, help="CPU memory check: micro-batch size (default 8)")
    ap.add_argument("--memory-reps", type=int, default=2, help="repetitions of plain/chunked/fused, rotated")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoints", default=None, metavar="MODELS",
                    help="CPU, trainer=fsdp's checkpoints instead of throughput: for each preset (comma-separated, "
                         "e.g. 25m,125m) 2 gloo ranks save sharded sync, sharded async and full-file, alternated "
                         "over --reps; prints the step loop's blocked time (async vs sync) and rank 0's peak "
                         "host memory during a save (full vs sharded)")
    ap.add_argument("--checkpoint-child", default=None, help=argparse.SUPPRESS)
    return ap


if __name__ == "__main__":  # parse (and answer --help) before the heavy imports below
    _parser().parse_args()

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR
from bnlit.interrupt import Interrupted
from bnlit.speed.flops import flops_per_token, training_memory_bytes
from bnlit.document_masking import document_mask
from bnlit.errors import ConfigError
from bnlit.speed.flops import flops_per_token, training_memory_bytes
from bnlit.speed.host_malloc import KEEP_BYTES, keep_freed_memory
from bnlit.loss import loss_fn
from bnlit.module import param_groups
from bnlit.speed.throughput import precision_dtype, resolve_peak
from bnlit.tokenizer import EOS_ID
from bnlit.train import instantiate_group
from bnlit.preflight import check_config


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
        self.c0 = self.c1 = None  # the process's CPU time (every thread), beside the wall time
        self.tokens = 0

    def _now(self, pl_module) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup and self.t0 is None:
            self.t0, self.c0 = self._now(pl_module), time.process_time()
        elif self.t0 is not None and self.t1 is None:
            self.tokens += batch[0].numel()
            if trainer.global_step == self.warmup + self.steps:
                self.t1, self.c1 = self._now(pl_module), time.process_time()

    @property
    def tokens_per_s(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError("bench: the timed steps did not complete")
        return self.tokens / (self.t1 - self.t0)

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / (self.c1 - self.c0)


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
    if trainer.interrupted or any(getattr(getattr(c, "latch", None), "received", None) for c in callbacks):
        raise KeyboardInterrupt  # Ctrl-C during the fit (the interrupt callback may have let it finish)
    out = {"tokens_per_s": clock.tokens_per_s, "tokens_per_cpu_s": clock.tokens_per_cpu_s, "monitor": dict(mfu.last) if mfu else {},
           "attention_kernel": module.attention_kernel,
           "compile_summary": module.compile_watch.summary() if module.compile_watch is not None else None}
    if arbiter is not None and arbiter._parity_report is not None:
        out["parity"] = {k: arbiter._parity_report.get(k) for k in ("ok", "skipped", "num_ok", "names")
                         if k in arbiter._parity_report}
        out["parity"]["names"] = len(out["parity"].get("names") or [])
    if arbiter is not None and arbiter.state.sentinel_steps:
        # measured inside the same run: the sentinel's own time per step over the mean step time
        step_s = cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.accumulate_grad_batches / clock.tokens_per_s
        out["sentinel_share"] = arbiter.state.sentinel_seconds / arbiter.state.sentinel_steps / step_s
    return out


def forward_context(precision: str, device: torch.device | str = "cpu"):
    """The autocast Lightning's precision plugin runs the forward under (``bf16-mixed``,
    ``16-mixed``), or nothing: what the raw loop must do to compare like for like."""
    precision = str(precision)
    if "bf16" in precision and "mixed" in precision:
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    if precision.startswith("16") and "mixed" in precision:
        return torch.autocast(torch.device(device).type, dtype=torch.float16)
    return contextlib.nullcontext()


def raw_run(cfg: DictConfig, datamodule, warmup: int, steps: int) -> dict:
    """The same model, precision, optimizer, schedule, clipping, accumulation and batches in a
    plain PyTorch loop (the loss divided by the accumulation, as Lightning does)."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    model.loss_fn = loss_fn(cfg.module.loss_impl, "cpu", cfg.trainer.precision)
    optimizer = instantiate(cfg.optimizer)(param_groups(model, cfg.optimizer.weight_decay))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    clip = cfg.trainer.gradient_clip_val
    accumulate = int(cfg.trainer.accumulate_grad_batches)
    context = forward_context(cfg.trainer.precision)
    batches = iter(datamodule.train_dataloader())
    model.train()
    tokens, fetch, t0, docs = 0, 0.0, None, []
    for i in range(warmup + steps):
        if i == warmup:
            tokens, fetch, t0, c0 = 0, 0.0, time.perf_counter(), time.process_time()
        for _ in range(accumulate):
            tf = time.perf_counter()
            x, y = next(batches)
            fetch += time.perf_counter() - tf
            if not docs:
                first = x[0, :16].tolist()  # the data module's first window: what the test compares
            docs.append(float((x == EOS_ID).sum(1).float().mean()) + 1)  # an eos opens each document
            mask = document_mask(x, EOS_ID) if cfg.module.document_masking else None
            with context:
                loss = model(x, y, mask=mask)
            (loss / accumulate).backward()
            tokens += x.numel()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu, "data_share": fetch / elapsed,
            "documents_per_window": statistics.mean(docs), "first_window": first}


def masking_interleaved(cfg: DictConfig, datamodule, warmup: int, pairs: int) -> dict:
    """The step-time cost of document masking on its own: one model, one optimizer and one batch
    stream in a plain loop, the mask on and off on alternate optimizer steps (on/off, off/on, ...),
    so load that drifts over seconds cancels within each pair. ``ratio``: the median over pairs of
    (step time with the mask) / (step time without), the mask's construction included."""
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    model.loss_fn = loss_fn(cfg.module.loss_impl, "cpu", cfg.trainer.precision)
    optimizer = instantiate(cfg.optimizer)(param_groups(model, cfg.optimizer.weight_decay))
    context = forward_context(cfg.trainer.precision)

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
        with context:
            loss = model(x, y, mask=mask)
        loss.backward()
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


def cpu_variants(masking_on: bool, have_arbiter: bool) -> dict[str, list[str]]:
    variants: dict[str, list[str]] = {"lightning": [] if have_arbiter else ["~callbacks.gradient_flow"]}
    if have_arbiter:
        variants["lightning_no_arbiter"] = ["~callbacks.gradient_flow"]
        variants["lightning_arbiter_every_step"] = ["callbacks.gradient_flow.every_n_steps=1"]
    # the step-time cost of document masking and of the chunked/fused loss (module.* switches)
    variants["lightning_masking_flipped"] = [f"module.document_masking={str(not masking_on).lower()}"]
    variants["lightning_chunked_loss"] = ["module.loss_impl=chunked"]
    variants["lightning_fused_loss"] = ["module.loss_impl=fused"]  # torch's F.linear_cross_entropy (fp32 only)
    variants["lightning_adamw"] = ["optimizer=adamw"]  # trainer=cpu's Muon (optimizer=muon) against AdamW alone
    return variants


def refusal(cfg: DictConfig) -> str | None:
    """The one line the trainer would refuse ``cfg`` with (``bnlit.preflight``), or None."""
    try:
        check_config(cfg)
    except ConfigError as e:
        return str(e)
    return None


def cpu_bench(args, run_root: Path) -> dict:
    have_arbiter, note = arbiter_available()
    if args.warmup is None:
        # past the first logging step: Lightning's first self.log in a fit costs ~0.3 s of CPU once
        # (its logging machinery's caches), which the raw loop, logging nothing, never pays
        every = int(make_cfg([f"model={args.model}", *args.override], run_root / "probe").trainer.log_every_n_steps)
        args.warmup = max(5, every)
    # no validation inside the timed steps (the raw loop has none): its first one is after the last step
    base = [f"model={args.model}", "logger=csv", f"trainer.val_check_interval={10 * (args.warmup + args.steps)}",
            "validate_at_start=false",
            f"trainer.max_steps={args.warmup + args.steps}",
            f"callbacks.model_checkpoint.every_n_train_steps={10 * (args.warmup + args.steps)}",
            *(["data.seq_len=" + str(args.seq_len)] if args.seq_len else []),
            *(["data.batch_size=" + str(args.batch_size)] if args.batch_size else []), *args.override]
    probe = make_cfg(base, run_root / "probe")
    variants = cpu_variants(probe.module.document_masking, have_arbiter)
    wanted = set(EXTRA_VARIANTS) if args.all else set(args.variants or ())
    unknown = wanted - set(EXTRA_VARIANTS) - set(DEFAULT_VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {sorted(EXTRA_VARIANTS)}")
    keep = {"lightning", *DEFAULT_VARIANTS, *wanted}
    variants = {k: v for k, v in variants.items() if k in keep}
    cfgs, skipped = {}, {}
    for name, extra in variants.items():
        cfg = make_cfg(base + extra, run_root / name)
        why = refusal(cfg)
        if why is None:
            cfgs[name] = cfg
            continue
        if name == "lightning":
            raise SystemExit(f"bench: the configuration is refused: {why}")
        skipped[name] = why
        print(f"bench: {name} skipped at trainer.precision={cfg.trainer.precision}: {why}", file=sys.stderr, flush=True)
    cfg = cfgs["lightning"]
    if cfg.get("keep_freed_memory") and keep_freed_memory():  # as bnlit.train does on CPU
        print(f"bench: freed tensors kept for reuse (keep_freed_memory, {KEEP_BYTES >> 20} MiB)", file=sys.stderr)
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")

    order = ["raw", *cfgs]
    tps: dict[str, list[float]] = {k: [] for k in order}
    cpu_tps: dict[str, list[float]] = {k: [] for k in order}  # tokens per second of the process's CPU time
    data_share, monitor, sentinel_share, docs, parity, first_window = [], {}, [], [], None, None
    interrupted = None
    try:
        for rep in range(args.reps):
            for name in order[rep % len(order):] + order[: rep % len(order)]:  # rotate who goes first
                if name == "raw":
                    r = raw_run(cfg, datamodule, args.warmup, args.steps)
                    data_share.append(r["data_share"])
                    docs.append(r["documents_per_window"])
                    first_window = r["first_window"]
                else:
                    r = lightning_run(cfgs[name], datamodule, args.warmup, args.steps)
                    if name == "lightning":
                        monitor, parity = r["monitor"], r.get("parity")
                        sentinel_share += [r["sentinel_share"]] if "sentinel_share" in r else []
                tps[name].append(r["tokens_per_s"])
                cpu_tps[name].append(r["tokens_per_cpu_s"])
                print(f"rep {rep + 1}/{args.reps} {name:30s} {r['tokens_per_s']:10,.0f} tokens/s "
                      f"{r['tokens_per_cpu_s']:10,.0f} tokens/CPU-s", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, Interrupted, SystemExit) as e:
        interrupted = f"interrupted ({type(e).__name__}) after {sum(map(len, tps.values()))} runs: figures so far"
        print(f"bench: {interrupted}", file=sys.stderr, flush=True)

    # medians over the alternated repetitions; best-of (timeit's rule: other load only slows a
    # run down) alongside, since on a shared machine one lucky repetition can carry it
    best = {k: max(v) for k, v in tps.items() if v}
    med = {k: statistics.median(v) for k, v in tps.items() if v}

    # a ratio within one repetition compares runs made minutes apart, not a whole benchmark apart:
    # the median of these paired ratios is the least sensitive to load that drifts over the run
    # (None where a variant was left out, skipped or not reached)
    def paired(a: str, b: str, runs: dict[str, list[float]] = tps) -> float | None:
        pairs = list(zip(runs.get(a, []), runs.get(b, [])))
        return statistics.median(x / y for x, y in pairs) if pairs else None

    def best_of(a: str, b: str) -> float | None:
        return best[a] / best[b] if a in best and b in best else None

    model_cfg = instantiate(cfg.model.config)
    fpt = flops_per_token(model_cfg, cfg.data.seq_len)
    peak = resolve_peak("cpu", precision_dtype(cfg.trainer.precision))
    mfu = lambda k: 100 * fpt * med[k] / peak.flops if k in med else None  # noqa: E731
    out = {
        "device": "cpu", "threads": torch.get_num_threads(), "model": model_cfg.name,
        "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size, "warmup_steps": args.warmup,
        "timed_steps": args.steps, "reps": args.reps, "precision": str(cfg.trainer.precision),
        "accumulate_grad_batches": int(cfg.trainer.accumulate_grad_batches),
        "keep_freed_memory": bool(cfg.get("keep_freed_memory")), "interrupted": interrupted, "skipped": skipped,
        "load_average_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "tokens_per_s_raw": med.get("raw"), "tokens_per_s_lightning": med.get("lightning"),
        "lightning_vs_raw": paired("lightning", "raw"),
        # the same in CPU time of the process (one torch thread: the work done, whatever the load)
        "lightning_vs_raw_cpu": paired("lightning", "raw", cpu_tps),
        "lightning_vs_raw_of_medians": med["lightning"] / med["raw"] if "lightning" in med and "raw" in med else None,
        "lightning_vs_raw_best_of": best_of("lightning", "raw"),
        "arbiter_overhead_ratio_default": None, "arbiter_overhead_ratio_every_step": None,
        "arbiter_every_n_steps_default": None, "arbiter_sentinel_share": None, "arbiter_note": note,
        "data_loader_share": statistics.median(data_share) if data_share else None,
        "documents_per_window": statistics.mean(docs) if docs else None, "first_window": first_window,
        "shard_dir": str(getattr(datamodule, "shard_dir", None)), "parity": parity,
        "lightning_data_wait_pct": monitor.get("throughput/data_wait_pct"),
        "flops_per_token": fpt, "peak_flops": peak.flops, "peak_source": peak.source,
        "mfu_cpu_pct_raw": mfu("raw"), "mfu_cpu_pct_lightning": mfu("lightning"),
        "peak_rss_gib": monitor.get("memory/peak_rss_gib"),
        "runs_tokens_per_s": tps, "runs_tokens_per_cpu_s": cpu_tps,
    }
    # step-time ratios (1.05 = 5% slower): masking on / off, chunked or fused / the configured loss
    masking_on = cfg.module.document_masking
    on, off = ("lightning", "lightning_masking_flipped") if masking_on else ("lightning_masking_flipped", "lightning")
    out["document_masking_step_time_ratio"] = paired(off, on)
    out["document_masking_step_time_ratio_best_of"] = best_of(off, on)
    out["chunked_loss_step_time_ratio"] = paired("lightning", "lightning_chunked_loss")  # vs the configured loss_impl
    out["fused_loss_step_time_ratio"] = paired("lightning", "lightning_fused_loss")
    out["adamw_step_time_ratio"] = paired("lightning", "lightning_adamw")  # vs the configured optimizer
    out["loss_impl"] = cfg.module.loss_impl
    if args.masking_pairs and not interrupted:
        out["document_masking_interleaved"] = masking_interleaved(cfg, datamodule, args.warmup, args.masking_pairs)
    if args.memory and not interrupted:
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
                               "step 1 is in the untimed warm-up, as in the trainer")
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


CHECKPOINT_MODES = ("sync", "async", "full")


def checkpoint_child(mode: str, model: str, out_dir: Path) -> dict | None:
    """One rank of a 2-rank gloo group (``torch.distributed.run``): ``model`` sharded with FSDP2 as
    ``trainer=fsdp`` shards it, one AdamW step (so the optimizer has its states), then one save:
    ``sync``/``async`` through :class:`bnlit.checkpointing.ShardedWriter` (what ``FSDP2Strategy``
    saves), ``full`` as Lightning's ``ModelParallelStrategy(save_distributed_checkpoint=False)``
    does (full state dicts gathered to rank 0, written by rank 0). Rank 0 returns the seconds the
    caller was blocked, the seconds until the checkpoint was complete, and its peak RSS growth
    during the save (``VmHWM`` reset just before it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from bnlit.checkpointing import AtomicCheckpointIO, ShardedWriter, tmp_name
    from bnlit.module import shard
    from bnlit.speed.tree_memory import reset_peak

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = make_cfg([f"model={model}"], Path(tempfile.gettempdir()))
    net = instantiate(cfg.model)
    shard(net, init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(param_groups(net, 0.1), lr=1e-4)
    x = torch.randint(0, net.config.vocab_size, (1, 33))
    net(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    writer = ShardedWriter(async_save=mode == "async")
    writer.setup()
    path = out_dir / f"{mode}.ckpt"
    dist.barrier()
    base = _rss_mib("VmRSS")
    reset_peak()
    start = time.perf_counter()
    if mode == "full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        ckpt = {"state_dict": get_model_state_dict(net, options=options),
                "optimizer_states": [get_optimizer_state_dict(net, opt, options=options)]}
        if rank == 0:
            AtomicCheckpointIO().save_checkpoint(ckpt, path)
        del ckpt
        dist.barrier()  # Lightning's save_checkpoint: the other ranks wait for rank 0's write
        blocked = time.perf_counter() - start
    else:
        state = {"state_dict": get_model_state_dict(net), "optimizer_0": get_optimizer_state_dict(net, opt)}
        writer.save(state, {"global_step": 1}, path, tmp_name(path), rank)
        blocked = time.perf_counter() - start
        del state
        writer.wait()
    complete = time.perf_counter() - start
    peak = _rss_mib("VmHWM") - base
    size = sum(f.stat().st_size for f in (path.rglob("*") if path.is_dir() else [path])) if rank == 0 else 0
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"mode": mode, "model": model, "blocked_s": blocked, "complete_s": complete, "rank0_peak_growth_mib": peak,
            "bytes": size, "params": sum(p.numel() for p in net.parameters())}


def checkpoint_bench(models: list[str], reps: int) -> dict:
    """``--checkpoints``: for each preset, ``reps`` rounds of the three saves (:func:`checkpoint_child`),
    each in a fresh 2-rank ``torch.distributed.run`` launch, in a rotating order; ratios are medians
    of ratios paired within a round."""
    import socket
    import subprocess

    out: dict = {"what": "2 gloo ranks on this CPU, FSDP2-sharded model + AdamW states; one save each",
                 "load_average_start": os.getloadavg()[0]}
    for model in models:
        runs: dict[str, list[dict]] = {m: [] for m in CHECKPOINT_MODES}
        for rep in range(reps):
            k = rep % len(CHECKPOINT_MODES)
            for mode in CHECKPOINT_MODES[k:] + CHECKPOINT_MODES[:k]:
                for attempt in (1, 2):  # a shared machine: another process may take the free port first
                    with tempfile.TemporaryDirectory(prefix="bnlit_ckpt_bench_") as tmp, socket.socket() as sock:
                        sock.bind(("127.0.0.1", 0))
                        port = sock.getsockname()[1]
                        sock.close()
                        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               f"--master-port={port}", __file__, "--checkpoint-child", mode, "--model", model,
                               "--override", tmp]
                        done = subprocess.run(cmd, capture_output=True, text=True,
                                              env={**os.environ, "OMP_NUM_THREADS": "1"})
                    if done.returncode == 0:
                        break
                    errors = [l for l in done.stderr.splitlines() if "Error" in l][:3]
                    print(f"checkpoints {model} {mode} attempt {attempt} failed: {errors}", file=sys.stderr, flush=True)
                else:
                    raise RuntimeError(f"checkpoint bench {mode} {model} failed twice: {done.stderr[-2000:]}")
                r = json.loads(done.stdout.strip().splitlines()[-1])
                runs[mode].append(r)
                print(f"checkpoints {model} rep {rep + 1}/{reps} {mode:5s}: blocked {r['blocked_s']:.2f} s, complete "
                      f"{r['complete_s']:.2f} s, rank 0 peak +{r['rank0_peak_growth_mib']:.0f} MiB",
                      file=sys.stderr, flush=True)
        med = lambda key, m: statistics.median(r[key] for r in runs[m])  # noqa: E731
        pair = lambda key, a, b: statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b]))  # noqa: E731
        out[model] = {
            "params": runs["sync"][0]["params"], "sharded_bytes": runs["sync"][0]["bytes"],
            **{f"{m}_blocked_s": med("blocked_s", m) for m in CHECKPOINT_MODES},
            **{f"{m}_complete_s": med("complete_s", m) for m in CHECKPOINT_MODES},
            **{f"{m}_rank0_peak_growth_mib": med("rank0_peak_growth_mib", m) for m in CHECKPOINT_MODES},
            "async_vs_sync_blocked": pair("blocked_s", "async", "sync"),
            "full_vs_sharded_rank0_peak": pair("rank0_peak_growth_mib", "full", "sync"),
            "full_vs_async_rank0_peak": pair("rank0_peak_growth_mib", "full", "async"),
            "runs": runs,
        }
    out["load_average_end"] = os.getloadavg()[0]
    return out


def print_checkpoints(result: dict) -> None:
    for model, r in result.items():
        if not isinstance(r, dict):
            continue
        print(f"{model}: {r['params'] / 1e6:.1f}M parameters, sharded checkpoint {r['sharded_bytes'] / 2**20:.0f} MiB; "
              f"step loop blocked: sync {r['sync_blocked_s']:.2f} s, async {r['async_blocked_s']:.2f} s "
              f"(async/sync {r['async_vs_sync_blocked']:.3f}; async complete after {r['async_complete_s']:.2f} s); "
              f"rank 0 peak host memory growth during a save: full file +{r['full_rank0_peak_growth_mib']:.0f} MiB, sharded "
              f"sync +{r['sync_rank0_peak_growth_mib']:.0f} MiB, sharded async +{r['async_rank0_peak_growth_mib']:.0f} MiB "
              f"(its staging copy; full/async {r['full_vs_async_rank0_peak']:.2f})")
    print(f"load average {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}")


def cuda_bench(args, run_root: Path) -> dict:
    """``trainer=h100`` as configured (400m at seq 2048, its micro-batch and accumulation, compiled,
    the parity probe at step 1) on the run's own data module, prepared on the CPU before the
    device is touched; ``--warmup`` untimed and ``--steps`` timed optimizer steps. A micro-batch
    that does not fit is halved and the accumulation doubled (the same global batch; the figure
    says which ran)."""
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda", torch.cuda.current_device())
    have_arbiter, note = arbiter_available()
    total = args.warmup + args.steps
    base = [f"model={args.model}", "trainer=h100", "logger=csv", *(["data.seq_len=" + str(args.seq_len)] if args.seq_len else []),
            f"trainer.max_steps={total}", f"trainer.val_check_interval={10 * total}", "validate_at_start=false",
            "trainer.enable_progress_bar=false", "~callbacks.progress_bar",
            f"callbacks.model_checkpoint.every_n_train_steps={10 * total}",
            "~callbacks.random_twin",  # it scores held-out text at the end of training: evaluation, not the step
            f"callbacks.throughput.warmup_steps={args.warmup}",
            *([] if have_arbiter else ["~callbacks.gradient_flow"]), *args.override]
    cfg = make_cfg(base, run_root / "cuda")
    micro = args.batch_size or int(cfg.data.batch_size)
    accumulate = args.accumulate or int(cfg.trainer.accumulate_grad_batches)
    why = refusal(cfg)
    if why:
        raise SystemExit(f"bench: the configuration is refused: {why}")
    datamodule = instantiate(cfg.data)  # real shards: EOS and the document mask are the run's
    datamodule.prepare_data()
    while True:
        cfg = make_cfg(base + [f"data.batch_size={micro}", f"trainer.accumulate_grad_batches={accumulate}"],
                       run_root / f"cuda_mb{micro}")
        datamodule.batch_size = micro
        torch.cuda.reset_peak_memory_stats(device)
        t_start = time.perf_counter()
        try:
            r = lightning_run(cfg, datamodule, args.warmup, args.steps)
            break
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
            print(f"bench: micro-batch {micro} ran out of memory; retrying with {micro // 2} x {2 * accumulate}",
                  file=sys.stderr)
            micro, accumulate = micro // 2, 2 * accumulate
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    wall = time.perf_counter() - t_start
    model_cfg = instantiate(cfg.model.config)
    seq_len = int(cfg.data.seq_len)
    fpt = flops_per_token(model_cfg, seq_len)
    peak = resolve_peak(device, torch.bfloat16)
    estimate = training_memory_bytes(model_cfg, seq_len, micro, bool(cfg.model.get("activation_checkpointing")))
    monitor = r["monitor"]
    return {
        "device": torch.cuda.get_device_name(device), "device_key": peak.key, "model": model_cfg.name,
        "seq_len": seq_len, "micro_batch": micro, "accumulate_grad_batches": accumulate,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "precision": cfg.trainer.precision, "compile": cfg.module.compile, "fullgraph": cfg.module.fullgraph,
        "sdpa_backend": cfg.module.sdpa_backend, "fused_adamw": cfg.optimizer.fused,
        "loss_impl": cfg.module.loss_impl, "document_masking": cfg.module.document_masking,
        "attention_kernel": r["attention_kernel"],
        "tokens_per_s": r["tokens_per_s"], "flops_per_token": fpt, "tflops": fpt * r["tokens_per_s"] / 1e12,
        "peak_flops": peak.flops, "peak_measured": peak.measured, "peak_source": peak.source,
        "mfu_pct": 100 * fpt * r["tokens_per_s"] / peak.flops,
        "hfu_pct": monitor.get("throughput/hfu"),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "memory_estimate_gib": estimate["total"] / 2**30,
        "monitor": monitor, "arbiter_note": note, "fit_wall_s": wall,
        "parity_probe": bool(have_arbiter and cfg.callbacks.gradient_flow.fast_path_parity),
        "parity": r.get("parity"), "compile_summary": r.get("compile_summary"),
    }


def print_cpu(result: dict) -> None:
    """The CPU result in a few lines; a figure not measured (variant off, skipped, interrupted) is null."""
    fmt = lambda v, f: "null" if v is None else format(v, f)  # noqa: E731
    print(f"cpu ({result['threads']} threads, {result['precision']}, accumulate {result['accumulate_grad_batches']}), "
          f"{result['model']} seq {result['seq_len']} batch {result['batch_size']}, {result['timed_steps']} timed steps "
          f"x {result['reps']} reps (medians, ratios paired per rep; load average {result['load_average_1m']:.1f} on "
          f"{result['cpu_count']} cores)")
    if result["interrupted"]:
        print(f"  {result['interrupted']}")
    for name, why in result["skipped"].items():
        print(f"  {name} skipped: {why}")
    print(f"  raw PyTorch loop   {fmt(result['tokens_per_s_raw'], '10,.0f')} tokens/s")
    print(f"  bnlit Lightning    {fmt(result['tokens_per_s_lightning'], '10,.0f')} tokens/s  "
          f"lightning_vs_raw {fmt(result['lightning_vs_raw'], '.3f')} (best of: {fmt(result['lightning_vs_raw_best_of'], '.3f')}; "
          f"in CPU time {fmt(result['lightning_vs_raw_cpu'], '.3f')})")
    share = result["arbiter_sentinel_share"]
    print(f"  arbiter step-time ratio: every {result['arbiter_every_n_steps_default']} steps "
          f"{fmt(result['arbiter_overhead_ratio_default'], '.3f')}, every step "
          f"{fmt(result['arbiter_overhead_ratio_every_step'], '.3f')}; every-step sentinel "
          f"{fmt(None if share is None else 100 * share, '.2f')}% of step time (timed within the default runs)")
    print(f"  data loader share of raw step time {fmt(None if result['data_loader_share'] is None else 100 * result['data_loader_share'], '.1f')}%; "
          f"Lightning data wait {fmt(result['lightning_data_wait_pct'], '.1f')}%")
    print(f"  document masking step-time ratio {fmt(result['document_masking_step_time_ratio'], '.3f')}; step-time "
          f"ratio to the {result['loss_impl']} loss: chunked {fmt(result['chunked_loss_step_time_ratio'], '.3f')}, "
          f"fused {fmt(result['fused_loss_step_time_ratio'], '.3f')}; step-time ratio of AdamW to the configured "
          f"optimizer {fmt(result['adamw_step_time_ratio'], '.3f')}")
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
    print(f"  MFU {fmt(result['mfu_cpu_pct_lightning'], '.2f')}% (raw {fmt(result['mfu_cpu_pct_raw'], '.2f')}%) of the "
          f"measured matmul peak {result['peak_flops'] / 1e9:.1f} GFLOP/s")


def ctrl_c_raises() -> None:
    """Make Ctrl-C raise ``KeyboardInterrupt`` (so the figures so far are printed) even when this
    process started with SIGINT ignored: Python then keeps it ignored, and a Ctrl-C between two
    fits (outside the interrupt callback's latch) would be lost. A background job of a
    non-interactive shell starts so, and so does every child of a process in which Lightning has
    caught a ``KeyboardInterrupt`` (its ``_call_and_handle_interrupt`` sets SIGINT to ``SIG_IGN``
    for good): the cause of the Ctrl-C test's failures inside the whole slow tier."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def warnings_only(names: tuple[str, ...] = ("lightning.pytorch", "lightning.fabric", "bnlit")):
    """Only warnings from the trainers' loggers while the benchmark runs. Their levels are restored
    after, so a process that goes on (a notebook, a test session) logs as before: left at WARNING,
    a later run in the same process wrote no info line to its train.log, and a test of a full disk
    under train.log then saw the run finish (its xfail inside the whole slow tier)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    ctrl_c_raises()
    if args.memory_child:
        torch.set_num_threads(args.threads or 1)
        result = memory_child(args.memory_child, args.model, args.seq_len, args.batch_size)
        print(json.dumps(result))
        return result
    if args.checkpoint_child:
        torch.set_num_threads(1)
        result = checkpoint_child(args.checkpoint_child, args.model, Path(args.override[0]))
        if result is not None:
            print(json.dumps(result))
        return result or {}
    if args.checkpoints:
        with warnings_only():
            result = checkpoint_bench(args.checkpoints.split(","), args.reps)
        print(json.dumps(result, indent=2, default=str)) if args.json else print_checkpoints(result)
        return result
    cuda = torch.cuda.is_available() and not args.cpu
    args.model = args.model or ("400m" if cuda else "tiny")
    args.warmup = 5 if args.warmup is None and cuda else args.warmup  # CPU: cpu_bench's (the first logging step)
    args.steps = args.steps or (10 if cuda else 40)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    # the Trainer prints model summaries to stdout: keep stdout for the result alone
    with warnings_only(), tempfile.TemporaryDirectory(prefix="bnlit_bench_") as tmp, \
            contextlib.redirect_stdout(sys.stderr):
        result = cuda_bench(args, Path(tmp)) if cuda else cpu_bench(args, Path(tmp))
    fmt = lambda v, f: "null" if v is None else format(v, f)  # noqa: E731
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif cuda:
        print(f"{result['device']}: {result['model']} seq {result['seq_len']} micro-batch {result['micro_batch']} x "
              f"{result['accumulate_grad_batches']}: {result['tokens_per_s']:,.0f} tokens/s, {result['tflops']:.1f} "
              f"TFLOP/s, MFU {result['mfu_pct']:.1f}% (PaLM) of {result['peak_flops'] / 1e12:.1f} TFLOP/s, HFU "
              f"{fmt(result['hfu_pct'], '.1f')}%, peak memory {result['peak_memory_gib']:.1f} GiB (estimate "
              f"{result['memory_estimate_gib']:.1f}); {result['compile_summary']}")
    else:
        print_cpu(result)
    return result


if __name__ == "__main__":
    main()
