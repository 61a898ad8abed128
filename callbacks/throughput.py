"""``ThroughputMonitor``: tokens/s, TFLOP/s, MFU, step time, data wait and peak memory of every run.

A thin adapter over :mod:`bnlit.speed.throughput`, whose docstring lists the ``throughput/`` metrics
and the MFU floor. The timing is this callback's: it reads the host clock at batch boundaries and
never synchronises on those; on CUDA it syncs the device once per logging step, right before it
reads the clock that closes the window (a Python float logged through Lightning becomes a device
tensor, a copy that waits for the stream). The first optimizer step (compilation, allocator
warm-up) never enters the window; validation and checkpoint saves are left out of it. (Not
Lightning's own ``ThroughputMonitor``, which needs a per-batch FLOP count and has no MFU floor.)

When the MFU floor fires, the alarm explains itself: one ``torch.profiler`` trace of the next
``profile_steps`` optimizer steps (with a CUDA memory snapshot on CUDA) is taken
(:class:`bnlit.speed.profiling.StepProfiler`), summarised in one "where the time went" line (matmul,
attention, elementwise, optimizer, communication, data wait, host gaps) in the log and the run's
``summary.md``, and written into the run's ``plots/``. The traced steps, slowed by the profiler, leave
the window. With ``on_low_mfu: raise`` the run stops once the trace is taken, the line in its error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.errors import ConfigError
from bnlit.tokenizer import EOS_ID
from bnlit.speed.flops import attended_pairs, flops_per_token
from bnlit.speed.profiling import StepProfiler
from bnlit.speed.throughput import (
    LowMFUError,
    MFUFloor,
    StepTimer,
    batch_shape,
    hardware_metrics,
    peak_memory_gib,
    precision_dtype,
    profile_mismatch,
    refresh_peak,
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
    peak_tflops: use this peak instead of the table or a measurement (new hardware, tests).
    hardware: the ``hardware=`` profile's ``hardware`` node (name, table_key, peak_tflops;
        ``conf/hardware/*.yaml``): its peak stands in for a CUDA device the table does not know by
        name, a run on another device than the profile's is warned about, and the ``fast path:``
        line names it (on a CPU rehearsal too, beside the measured peak the CPU run uses).
    profile_at_step: take one ``torch.profiler`` trace of ``profile_steps`` optimizer steps from
        this step on (``bnlit.speed.profiling.StepProfiler``): its "where the time went" line in the
        log, the chrome trace (and on CUDA the allocator's memory snapshot, for
        pytorch.org/memory_viz) in ``<run dir>/plots/``. None: no trace
        (``scripts/gpu_check.py --profile`` sets it after its measured window).
    profile_steps: optimizer steps in that trace.
    profile_on_low_mfu: when the floor fires, take that trace of the next ``profile_steps`` steps (once,
        unless one was taken already) and warn where their time went; false: the warning alone.
    profile_dir: where trace files go; None: ``<trainer.default_root_dir>/plots`` (the run's plots/).
    clock: the timer (``time.perf_counter``; tests inject a fake one).
    **floor: those of :class:`bnlit.speed.throughput.MFUFloor` (min_mfu_pct, cpu_min_mfu_pct,
        warmup_steps, patience, on_low_mfu), kept as ``self.floor``.
    """

    def __init__(self, window_steps: int = 50, log_every_n_steps: int | None = None, peak_tflops: float | None = None,
                 hardware: Mapping[str, Any] | None = None, profile_at_step: int | None = None, profile_steps: int = 3,
                 profile_on_low_mfu: bool = True, profile_dir: str | None = None,
                 clock: Callable[[], float] = time.perf_counter, **floor: Any):
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ConfigError(f"callbacks.throughput.log_every_n_steps={log_every_n_steps}: must be >= 1 or null")
        if not isinstance(profile_steps, int) or isinstance(profile_steps, bool) or profile_steps < 1:
            raise ConfigError(f"callbacks.throughput.profile_steps={profile_steps}: must be >= 1")
        self.floor = MFUFloor(**floor)
        self.profiler = StepProfiler(profile_steps, profile_at_step)
        self.profile: dict[str, Any] | None = None  # the trace's split and files, once taken
        self.profile_on_low_mfu = profile_on_low_mfu
        self.profile_dir = Path(profile_dir) if profile_dir else None
        self.where_time_went: str | None = None  # the trace's one line (bnlit.train puts it in summary.md)
        self._low_mfu_trace = False  # the trace under way was asked for by the floor
        self._raise_after_profile: str | None = None
        self.timer = StepTimer(window_steps, clock)
        self.log_every_n_steps, self.peak_tflops = log_every_n_steps, peak_tflops
        self.hardware = dict(hardware) if hardware else None
        self.peak = None  # a bnlit.speed.throughput.Peak from fit start
        self.last: dict[str, float] = {}  # the latest logged figures
        self._fpt: dict[int, int] = {}
        self._config = None
        self._last_global_step = 0
        # attended (query, key) pairs of the current step and of each step in the window, as
        # device tensors read once per report (HFU: bnlit.speed.flops.attended_pairs)
        self._pairs: torch.Tensor | None = None
        self._pairs_window: deque[torch.Tensor] = deque(maxlen=window_steps)
        self._eos: int | None = None
        self._recompute = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        override = None if self.peak_tflops is None else self.peak_tflops * 1e12
        self.peak = resolve_peak(pl_module.device, precision_dtype(trainer.precision), override, self.hardware)
        mismatch = profile_mismatch(self.hardware, self.peak.device) if pl_module.device.type == "cuda" else None
        if mismatch and trainer.is_global_zero:
            rank_zero_warn(mismatch)
        self._config = getattr(getattr(pl_module, "model", None), "config", None)
        if self._config is None:
            rank_zero_warn("ThroughputMonitor: pl_module.model has no .config; logging tokens/s without TFLOP/s or MFU")
        self._last_global_step = trainer.global_step
        self._eos = EOS_ID if getattr(pl_module, "document_masking", False) else None
        self._recompute = bool(getattr(getattr(pl_module, "model", None), "activation_checkpointing", False))
        self.timer.pause()
        floor, f = self.floor.pct(pl_module.device), self.floor
        if trainer.is_global_zero:
            log.info("throughput: peak %s; MFU floor %s", self.peak.describe(),
                     f"{floor:g}% after {f.warmup_steps} steps ({f.on_low_mfu})" if floor else "off")

    def _flops_per_token(self, seq_len: int) -> int:
        if seq_len not in self._fpt:
            self._fpt[seq_len] = flops_per_token(self._config, seq_len) if self._config is not None else 0
        return self._fpt[seq_len]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.profiler.due(trainer.global_step, batch_idx % trainer.accumulate_grad_batches == 0):
            self.profiler.start(pl_module.device, memory=True)
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
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        if self._config is not None and isinstance(x, torch.Tensor) and x.ndim == 2:
            pairs = attended_pairs(x, self._eos)
            self._pairs = pairs if self._pairs is None else self._pairs + pairs
        if self.timer.batch_end(tokens, samples, float(tokens * self._flops_per_token(seq_len)), stepped):
            self._pairs_window.append(self._pairs)
            self._pairs = None
        if stepped and self.profiler.running and self.profiler.finished(step):
            self._stop_profile(trainer, pl_module)
        if stepped and self.timer.steps == 1:
            self.timer.reset_window()  # the first step holds compilation and allocator warm-up
            self._pairs_window.clear()
        if due and self.timer.window:
            self._report(trainer, pl_module, step)

    def _stop_profile(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = (self.profile_dir or Path(trainer.default_root_dir) / "plots") if trainer.is_global_zero else None
        split, files = self.profiler.stop(pl_module.device, out)
        self.profile = {"line": split.line(), "files": [str(f) for f in files], **split.to_dict()}
        self.where_time_went = split.line()
        if not self._low_mfu_trace:
            if trainer.is_global_zero:
                log.info("profile: %s; %s", split.line(), ", ".join(str(f) for f in files))
            return
        self._low_mfu_trace = False
        self.timer.reset_window()  # the profiler slowed these steps down
        self._pairs_window.clear()
        if trainer.is_global_zero:
            log.warning("!!! MFU below the floor: %s (trace: %s)", split.line(), ", ".join(str(f) for f in files))
        if self._raise_after_profile is not None:
            message, self._raise_after_profile = self._raise_after_profile, None
            raise LowMFUError(f"{message}\n{split.line()}")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.profiler.running:
            self.profiler.stop(pl_module.device, None)  # the profiler off, nothing written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profiler.running:  # the run ended inside the traced steps: keep what was traced
            self._stop_profile(trainer, pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer.pause()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.timer.pause()

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        self.peak = refresh_peak(self.peak, pl_module.device, precision_dtype(trainer.precision))
        peak = self.peak if self._config is not None else None
        stats = throughput_stats(self.timer.window, peak.flops if peak else None, trainer.world_size)
        metrics = throughput_metrics(stats, peak, has_flops=self._config is not None)
        if self._config is not None and len(self._pairs_window) == len(self.timer.window) \
                and all(p is not None for p in self._pairs_window):
            pairs = float(torch.stack(list(self._pairs_window)).sum())  # one host read, after the sync above
            metrics |= hardware_metrics(self.timer.window, pairs, self._config, self._recompute, peak, trainer.world_size)
        self.last = metrics = {**metrics, **dict([peak_memory_gib(pl_module.device)])}  # + (key, GiB)
        for k, v in metrics.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, rank_zero_only=True)
        agree = bool if trainer.world_size == 1 else lambda low: trainer.strategy.reduce_boolean_decision(low, all=False)
        message = self.floor.judge(stats, pl_module.device, step, self.peak, agree)
        # the verdict is every rank's (agree), so every rank traces the same steps
        profiling = message is not None and self.profile_on_low_mfu and (
            self._low_mfu_trace or not (self.profiler.taken or self.profiler.running))
        if profiling and not self._low_mfu_trace:
            self.profiler.schedule(step)
            self._low_mfu_trace = True
        if message and self.floor.on_low_mfu == "raise":
            if not profiling:
                raise LowMFUError(message)
            if self._raise_after_profile is None:  # raised once the trace says where the time went
                self._raise_after_profile = message
            return
        if message:
            rank_zero_warn(message)
            log.warning("!!! %s", message)
