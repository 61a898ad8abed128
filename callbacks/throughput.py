"""``ThroughputMonitor``: tokens/s, TFLOP/s, MFU, step time, data wait and peak memory of every run.

A thin adapter over :mod:`bnlit.throughput` (not Lightning's ``lightning.pytorch.callbacks.ThroughputMonitor``,
which needs a per-batch FLOP count and logs no MFU floor).
It reads the host clock at batch boundaries and never synchronises on those: on CUDA it syncs
the device once per logging step, right before it reads the clock that closes the window, and
calls ``pl_module.log`` only then (a Python float logged through Lightning becomes a device tensor,
a host-to-device copy that waits for the stream). The first optimizer step (compilation, allocator
warm-up) never enters the window; validation and checkpoint saves are left out of it.

Logged on rank zero, per device and in total (world size x rank zero's rate: DDP ranks step in
lockstep): ``perf/tokens_per_s``, ``perf/samples_per_s``, ``perf/tflops`` (and ``*_per_device``),
``perf/mfu`` (percent of the device's peak: ``perf/peak_tflops``, with ``perf/peak_measured`` 1.0
when it is a measured matmul peak rather than a datasheet figure; the source is logged at fit start),
``perf/step_ms``, ``perf/data_wait_pct`` (share of wall time between a batch's end and the next
one's start: the loader, host-to-device copy and loop bookkeeping), ``memory/peak_gib`` on CUDA
(``torch.cuda.max_memory_allocated``) or ``memory/peak_rss_gib`` on CPU.

The MFU floor: after ``warmup_steps``, a window whose MFU is below ``min_mfu_pct`` (on CUDA;
``cpu_min_mfu_pct`` on CPU, off by default) for ``patience`` consecutive logging steps warns
loudly, or raises :class:`LowMFUError` with ``on_low_mfu: raise`` (all ranks decide together).
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.errors import BnlitError, ConfigError
from bnlit.flops import flops_per_token
from bnlit.throughput import Peak, StepTimer, resolve_peak, throughput_stats

log = logging.getLogger("bnlit")

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


class LowMFUError(BnlitError):
    """The run's model-FLOPs utilisation stayed below the configured floor after warm-up."""


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a Lightning precision string (``"bf16-mixed"`` -> bfloat16)."""
    return _PRECISION_DTYPES.get(str(precision).split("-")[0], torch.float32)


def _batch_shape(batch) -> tuple[int, int]:
    """(samples, tokens per sample) of an ``(x, y)`` batch or a bare tensor; shapes only, no sync."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        return 0, 0
    return int(x.shape[0]), int(x.shape[1]) if x.ndim > 1 else 1


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    """(metric key, GiB): the allocator's peak on CUDA, else the process's peak resident set."""
    if device.type == "cuda":
        return "memory/peak_gib", torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return "memory/peak_rss_gib", rss / (2**30 if sys.platform == "darwin" else 2**20)


class ThroughputMonitor(Callback):
    """Args:
    window_steps: optimizer steps the rates are averaged over.
    log_every_n_steps: log (and sync CUDA) every this many optimizer steps; None: the Trainer's.
    min_mfu_pct: the MFU floor on CUDA devices, in percent; None: off.
    cpu_min_mfu_pct: the floor on CPU (against the measured matmul peak); None: off.
    warmup_steps: optimizer steps before the floor is judged.
    patience: consecutive low logging steps before it fires.
    on_low_mfu: ``"warn"`` or ``"raise"``.
    peak_tflops: use this peak instead of the table or a measurement (new hardware, tests).
    clock: the timer (``time.perf_counter``; tests inject a fake one).
    """

    def __init__(
        self,
        window_steps: int = 50,
        log_every_n_steps: int | None = None,
        min_mfu_pct: float | None = 20.0,
        cpu_min_mfu_pct: float | None = None,
        warmup_steps: int = 20,
        patience: int = 1,
        on_low_mfu: Literal["warn", "raise"] = "warn",
        peak_tflops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if on_low_mfu not in ("warn", "raise"):
            raise ConfigError(f"callbacks.throughput.on_low_mfu={on_low_mfu!r}: use 'warn' or 'raise'")
        for name, v in (("min_mfu_pct", min_mfu_pct), ("cpu_min_mfu_pct", cpu_min_mfu_pct)):
            if v is not None and not 0 < v <= 100:
                raise ConfigError(f"callbacks.throughput.{name}={v}: a percentage in (0, 100], or null to turn it off")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ConfigError(f"callbacks.throughput.log_every_n_steps={log_every_n_steps}: must be >= 1 or null")
        if patience < 1 or warmup_steps < 0:
            raise ConfigError("callbacks.throughput: patience must be >= 1 and warmup_steps >= 0")
        self.timer = StepTimer(window_steps, clock)
        self.log_every_n_steps = log_every_n_steps
        self.min_mfu_pct, self.cpu_min_mfu_pct = min_mfu_pct, cpu_min_mfu_pct
        self.warmup_steps, self.patience, self.on_low_mfu = warmup_steps, patience, on_low_mfu
        self.peak_tflops = peak_tflops
        self.peak: Peak | None = None
        self.last: dict[str, float] = {}  # the latest logged figures
        self._fpt: dict[int, int] = {}
        self._config = None
        self._low = 0
        self._last_global_step = 0

    # -- set-up -----------------------------------------------------------------------------

    def floor(self, device: torch.device) -> float | None:
        return self.cpu_min_mfu_pct if device.type == "cpu" else self.min_mfu_pct

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        override = None if self.peak_tflops is None else self.peak_tflops * 1e12
        self.peak = resolve_peak(device, precision_dtype(trainer.precision), override)
        self._config = getattr(getattr(pl_module, "model", None), "config", None)
        if self._config is None:
            rank_zero_warn("ThroughputMonitor: pl_module.model has no .config; logging tokens/s without TFLOP/s or MFU")
        self._last_global_step = trainer.global_step
        self.timer.pause()
        floor = self.floor(device)
        if trainer.is_global_zero:
            log.info("mfu: peak %s; floor %s", self.peak.describe(),
                     f"{floor:g}% after {self.warmup_steps} steps ({self.on_low_mfu})" if floor else "off")

    def _flops_per_token(self, seq_len: int) -> int:
        if seq_len not in self._fpt:
            self._fpt[seq_len] = flops_per_token(self._config, seq_len) if self._config is not None else 0
        return self._fpt[seq_len]

    # -- timing -----------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.timer.batch_start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        stepped = step > self._last_global_step
        self._last_global_step = step
        every = self.log_every_n_steps or trainer.log_every_n_steps  # 0: the Trainer logs nothing
        due = bool(every) and stepped and step % every == 0 and self.timer.steps >= 1
        if due and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the window ends where the device really is
        samples, seq_len = _batch_shape(batch)
        tokens = samples * seq_len
        self.timer.batch_end(tokens, samples, float(tokens * self._flops_per_token(seq_len)), stepped)
        if stepped and self.timer.steps == 1:
            self.timer.reset_window()  # the first step holds compilation and allocator warm-up
        if due and self.timer.window:
            self._report(trainer, pl_module, step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer.pause()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.timer.pause()

    # -- reporting --------------------------------------------------------------------------

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        peak = self.peak.flops if self.peak is not None and self._config is not None else None
        stats = throughput_stats(self.timer.window, peak, trainer.world_size)
        metrics = {f"perf/{k}": v for k, v in stats.items() if k != "mfu_pct"}
        if self._config is None:  # no FLOP count: rates only
            metrics = {k: v for k, v in metrics.items() if "tflops" not in k}
        elif stats["mfu_pct"] is not None:
            metrics["perf/mfu"] = stats["mfu_pct"]
        if peak is not None:  # what the MFU is relative to: 1.0 marks a measured (not datasheet) peak
            metrics["perf/peak_tflops"] = self.peak.flops / 1e12
            metrics["perf/peak_measured"] = float(self.peak.measured)
        key, gib = peak_memory_gib(pl_module.device)
        metrics[key] = gib
        self.last = metrics
        for k, v in metrics.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, rank_zero_only=True)
        self._check_floor(trainer, pl_module, step, stats)

    def _check_floor(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, stats: dict) -> None:
        floor = self.floor(pl_module.device)
        mfu = stats["mfu_pct"]
        if floor is None or mfu is None or step < self.warmup_steps:
            return
        low = mfu < floor
        if trainer.world_size > 1:  # one verdict on every rank, or a raising rank strands the others
            low = trainer.strategy.reduce_boolean_decision(low, all=False)
        self._low = self._low + 1 if low else 0
        if self._low < self.patience:
            return
        message = (
            f"MFU {mfu:.2f}% is below the floor of {floor:g}% at step {step} "
            f"({stats['tokens_per_s']:,.0f} tokens/s, {stats['step_ms']:.1f} ms/step, "
            f"{stats['data_wait_pct']:.1f}% waiting for data) against the {self.peak.describe()}. "
            "Check trainer.precision (bf16-mixed), module.compile, module.sdpa_backend, module.loss_impl, "
            "optimizer.fused, data.num_workers and the micro-batch size; or lower callbacks.throughput.min_mfu_pct"
        )
        if self.on_low_mfu == "raise":
            raise LowMFUError(message)
        rank_zero_warn(message)
        log.warning("!!! %s", message)
