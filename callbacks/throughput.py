"""``ThroughputMonitor``: tokens/s, TFLOP/s, MFU, step time, data wait and peak memory of every run.

A thin adapter over :mod:`bnlit.throughput`, whose docstring lists the ``throughput/`` metrics, the
timing rules (one CUDA sync per logging step, compilation and validation left out) and the MFU floor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.errors import ConfigError
from bnlit.flops import flops_per_token
from bnlit.throughput import (
    LowMFUError,
    Peak,
    StepTimer,
    batch_shape,
    low_mfu_message,
    peak_memory_gib,
    precision_dtype,
    resolve_peak,
    throughput_metrics,
    throughput_stats,
)

__all__ = ["LowMFUError", "ThroughputMonitor", "precision_dtype"]
log = logging.getLogger("bnlit")


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

    def __init__(self, window_steps: int = 50, log_every_n_steps: int | None = None, min_mfu_pct: float | None = 20.0,
                 cpu_min_mfu_pct: float | None = None, warmup_steps: int = 20, patience: int = 1,
                 on_low_mfu: Literal["warn", "raise"] = "warn", peak_tflops: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
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
        self._low = self._last_global_step = 0

    def floor(self, device: torch.device) -> float | None:
        return self.cpu_min_mfu_pct if device.type == "cpu" else self.min_mfu_pct

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        override = None if self.peak_tflops is None else self.peak_tflops * 1e12
        self.peak = resolve_peak(pl_module.device, precision_dtype(trainer.precision), override)
        self._config = getattr(getattr(pl_module, "model", None), "config", None)
        if self._config is None:
            rank_zero_warn("ThroughputMonitor: pl_module.model has no .config; logging tokens/s without TFLOP/s or MFU")
        self._last_global_step = trainer.global_step
        self.timer.pause()
        floor = self.floor(pl_module.device)
        if trainer.is_global_zero:
            log.info("throughput: peak %s; MFU floor %s", self.peak.describe(),
                     f"{floor:g}% after {self.warmup_steps} steps ({self.on_low_mfu})" if floor else "off")

    def _flops_per_token(self, seq_len: int) -> int:
        if seq_len not in self._fpt:
            self._fpt[seq_len] = flops_per_token(self._config, seq_len) if self._config is not None else 0
        return self._fpt[seq_len]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.timer.batch_start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        stepped, self._last_global_step = step > self._last_global_step, step
        every = self.log_every_n_steps or trainer.log_every_n_steps  # 0: the Trainer logs nothing
        due = bool(every) and stepped and step % every == 0 and self.timer.steps >= 1
        if due and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the window ends where the device really is
        samples, seq_len = batch_shape(batch)
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

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        peak = self.peak if self._config is not None else None
        stats = throughput_stats(self.timer.window, peak.flops if peak else None, trainer.world_size)
        metrics = throughput_metrics(stats, peak, has_flops=self._config is not None)
        key, gib = peak_memory_gib(pl_module.device)
        self.last = metrics = {**metrics, key: gib}
        for k, v in metrics.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, rank_zero_only=True)
        floor = self.floor(pl_module.device)
        if floor is None or stats["mfu_pct"] is None or step < self.warmup_steps:
            return
        low = stats["mfu_pct"] < floor
        if trainer.world_size > 1:  # one verdict on every rank, or a raising rank strands the others
            low = trainer.strategy.reduce_boolean_decision(low, all=False)
        self._low = self._low + 1 if low else 0
        if self._low < self.patience:
            return
        message = low_mfu_message(stats, floor, step, self.peak)
        if self.on_low_mfu == "raise":
            raise LowMFUError(message)
        rank_zero_warn(message)
        log.warning("!!! %s", message)
