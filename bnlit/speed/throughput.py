"""Throughput and MFU bookkeeping, apart from the model (torchtitan's split).

``mfu = flops_per_token * tokens_per_s / peak_flops`` (Chowdhery et al. 2022, PaLM, appendix B):
model FLOPs per token come from :func:`bnlit.speed.flops.flops_per_token`, the peak from a table of
**dense** bf16 tensor-core figures (the datasheets print the 2:4-sparse figure first; the dense one
is half of it). A device the table does not know, and the CPU, are measured instead: the best
rate of a large matmul in the training dtype, labelled ``measured`` wherever it is reported.
Nothing here touches a Trainer.

Logged on rank zero, per device and in total (world size x rank zero's rate: DDP ranks step in
lockstep): :func:`throughput_metrics` -- ``throughput/tokens_per_s``, ``throughput/samples_per_s``,
``throughput/tflops`` (and ``*_per_device``), ``throughput/mfu`` (percent of
``throughput/peak_tflops``, PaLM's convention: the full attention matrix; with
``throughput/peak_measured`` 1.0 for a measured matmul peak rather than a datasheet figure),
``throughput/hfu`` and ``throughput/hardware_tflops`` (the FLOPs the causal and document masks
leave, and activation checkpointing's recompute: :mod:`bnlit.flops`), ``throughput/step_ms``, ``throughput/data_wait_pct`` (share of wall time
between a batch's end and the next one's start: the loader, host-to-device copy and loop
bookkeeping), and ``memory/peak_gib`` on CUDA or ``memory/peak_rss_gib`` on CPU.

The MFU floor: after ``warmup_steps``, a window whose MFU is below ``min_mfu_pct`` (on CUDA;
``cpu_min_mfu_pct`` on CPU, off by default) for ``patience`` consecutive logging steps warns loudly,
or raises :class:`LowMFUError` with ``on_low_mfu: raise`` (all ranks decide together).
"""

from __future__ import annotations

import functools
import re
import resource
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from bnlit.errors import BnlitError, ConfigError

UNKNOWN = "unknown"
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


class LowMFUError(BnlitError):
    """The run's model-FLOPs utilisation stayed below the configured floor after warm-up."""


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a Lightning precision string (``"bf16-mixed"`` -> bfloat16)."""
    return _PRECISION_DTYPES.get(str(precision).split("-")[0], torch.float32)


def batch_shape(batch) -> tuple[int, int]:
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


@dataclass(frozen=True)
class DevicePeak:
    """A datasheet peak. ``pattern`` is matched against the normalised device name."""

    key: str
    pattern: str
    bf16_flops: float  # dense (no 2:4 sparsity), FP32 accumulate where the sheet distinguishes
    source: str
    # dense TF32 tensor-core figure: fp32 matmuls on CUDA run as TF32 (train() sets
    # torch.set_float32_matmul_precision("high")); None: not in the table, a 32-true run is measured
    fp32_flops: float | None = None

    def flops(self, dtype: torch.dtype) -> float | None:
        """The peak for a run computing in ``dtype`` (bf16 and fp16 share the tensor-core figure)."""
        return self.fp32_flops if dtype in (torch.float32, torch.float64) else self.bf16_flops


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "NVIDIA H200 datasheet, https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
_A100 = ("NVIDIA A100 datasheet (40/80 GB, SXM and PCIe alike), https://www.nvidia.com/content/dam/en-zz/Solutions/"
         "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A10 = "NVIDIA A10 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"

# Most specific first: "h100 nvl" before "h100", "l40s" before "l40"; the patterns match whole words
# of the normalised name, so "l4" never matches "l40s" and "a10" never matches "a100".
PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("b200", r"\bb200\b", 4500e12 / 2,
               "NVIDIA HGX B200 specifications (per GPU: BF16 4.5, TF32 2.2 PFLOP/s sparse), https://www.nvidia.com/en-us/data-center/hgx/",
               2200e12 / 2),
    DevicePeak("gh200", r"\bgh200\b", 1979e12 / 2,
               "NVIDIA GH200 Grace Hopper datasheet (BF16 1,979, TF32 989 TFLOP/s sparse), https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip",
               989e12 / 2),
    DevicePeak("h200-nvl", r"\bh200\b.*\bnvl\b", 1671e12 / 2, _H200 + " (H200 NVL: BF16 1,671, TF32 835 TFLOP/s sparse)",
               835e12 / 2),
    DevicePeak("h200-sxm", r"\bh200\b", 1979e12 / 2, _H200 + " (H200 SXM: BF16 1,979, TF32 989 TFLOP/s sparse)",
               989e12 / 2),
    DevicePeak("h100-nvl", r"\bh100\b.*\bnvl\b", 1671e12 / 2, _H100 + " (H100 NVL: BF16 1,671, TF32 835 TFLOP/s sparse)",
               835e12 / 2),
    DevicePeak("h100-pcie", r"\bh100\b.*\b(pcie|hbm2e)\b", 1513e12 / 2, _H100 + " (H100 PCIe: BF16 1,513, TF32 756 TFLOP/s sparse)",
               756e12 / 2),
    # "NVIDIA H100 80GB HBM3" is the SXM5 part; a name without a form factor is taken as SXM too
    DevicePeak("h100-sxm", r"\bh100\b", 1979e12 / 2, _H100 + " (H100 SXM: BF16 1,979, TF32 989 TFLOP/s sparse)",
               989e12 / 2),
    DevicePeak("a100", r"\ba100\b", 312e12, _A100 + " (BF16 312, TF32 156 TFLOP/s dense)", 156e12),
    DevicePeak("a30", r"\ba30\b", 165e12,
               "NVIDIA A30 datasheet (BF16 165 TFLOP/s dense), https://www.nvidia.com/en-us/data-center/products/a30-gpu/"),
    DevicePeak("a40", r"\ba40\b", 149.7e12,
               "NVIDIA A40 datasheet (BF16 149.7 TFLOP/s dense), https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf"),
    DevicePeak("l40s", r"\bl40s\b", 362.05e12,
               "NVIDIA L40S datasheet (BF16 362.05 TFLOP/s dense), https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    DevicePeak("l40", r"\bl40\b", 181.05e12,
               "NVIDIA L40 datasheet (BF16 181.05 TFLOP/s dense), https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf"),
    DevicePeak("l4", r"\bl4\b", 242e12 / 2,
               "NVIDIA L4 datasheet (BF16 242 TFLOP/s sparse), https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"),
    # AWS's A10G has no NVIDIA datasheet of its own; the A10's figure is used, as Lightning does
    DevicePeak("a10g", r"\ba10g\b", 125e12, _A10 + " (A10 BF16 125 TFLOP/s dense; no A10G sheet exists)"),
    DevicePeak("a10", r"\ba10\b", 125e12, _A10 + " (BF16 125 TFLOP/s dense)"),
    DevicePeak("rtx-a6000", r"\brtx a6000\b", 309.7e12 / 2,
               "NVIDIA RTX A6000 datasheet (309.7 TFLOP/s sparse tensor), https://www.nvidia.com/en-us/design-visualization/rtx-a6000/"),
    DevicePeak("rtx-4090", r"\brtx 4090\b", 165.2e12,
               "NVIDIA Ada GPU architecture whitepaper, appendix A (BF16, FP32 accumulate, 165.2 TFLOP/s dense), "
               "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    DevicePeak("rtx-3090", r"\brtx 3090\b(?! ti)", 71e12,
               "NVIDIA GA102 whitepaper (BF16, FP32 accumulate, 71 TFLOP/s dense), "
               "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"),
)


def normalize_device_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"a100 sxm4 80gb"``: lower case, vendor words dropped,
    separators as single spaces."""
    words = re.sub(r"[-_/(),]+", " ", name.lower()).split()
    return " ".join(w for w in words if w not in ("nvidia", "geforce", "tesla"))


def lookup_peak(device_name: str) -> DevicePeak | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string, or None."""
    name = normalize_device_name(device_name)
    return next((p for p in PEAKS if re.search(p.pattern, name)), None)


def match_device(device_name: str) -> str:
    """The table key of a device name (``"h100-sxm"``, ``"a100"``...) or ``"unknown"``."""
    peak = lookup_peak(device_name)
    return peak.key if peak else UNKNOWN


@dataclass(frozen=True)
class Peak:
    """The peak an MFU figure is relative to, with where it came from."""

    flops: float
    device: str  # the device's name as torch reports it, or "cpu"
    key: str  # table key, or "unknown" for a measured peak
    source: str
    measured: bool
    dtype: str = "bf16"  # the figure's number format: bf16 (also fp16) or fp32 (TF32 on CUDA)

    def describe(self) -> str:
        kind = "measured matmul peak" if self.measured else f"datasheet dense {self.dtype} peak"
        return f"{self.flops / 1e12:.3g} TFLOP/s {kind} of {self.device} ({self.source})"


@functools.lru_cache(maxsize=8)
def _measured_matmul_flops(device: str, dtype: torch.dtype, n: int, repeats: int, threads: int) -> float:
    # ``threads`` keys the cache: a CPU peak measured on 1 thread is not the peak on 2
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b  # warm-up: thread pool, kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure_matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        n: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of an ``n x n`` matmul in ``dtype`` over ``repeats`` runs (cached per process and,
    on CPU, per intra-op thread count).

    A measured ceiling of this machine, not a datasheet figure: MFU against it says how far the
    training step is from the machine's own best matmul rate."""
    device = torch.device(device)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return _measured_matmul_flops(str(device), dtype, n, repeats, threads)


def table_peak(key: str) -> DevicePeak:
    """The table entry named ``key`` (``"a100"``, ``"h100-sxm"``...)."""
    entry = next((p for p in PEAKS if p.key == key), None)
    if entry is None:
        raise KeyError(f"{key!r} is not in bnlit.speed.throughput.PEAKS; known: {', '.join(p.key for p in PEAKS)}")
    return entry


def profile_flops(profile: Mapping[str, Any] | None, dtype: torch.dtype) -> float | None:
    """The dense peak (FLOP/s) a ``hardware=`` profile (``conf/hardware/*.yaml``'s ``hardware`` node:
    name, table_key, peak_tflops.bf16/fp32) gives for ``dtype``, or None when it has none."""
    figures = (profile or {}).get("peak_tflops") or {}
    tflops = figures.get("fp32" if dtype in (torch.float32, torch.float64) else "bf16")
    return None if tflops is None else float(tflops) * 1e12


def profile_mismatch(profile: Mapping[str, Any] | None, device_name: str) -> str | None:
    """A warning when a named GPU profile (``hardware=a100``) runs on another device (an H100), else
    None. The generic ``gpu`` and ``cpu`` profiles match any device of their kind."""
    name = str((profile or {}).get("name") or "")
    if name in ("", "gpu", "cpu") or re.search(rf"\b{re.escape(name)}\b", normalize_device_name(device_name)):
        return None
    entry = lookup_peak(device_name)
    against = f"the {entry.key} datasheet peak" if entry else "a measured matmul peak"
    return (f"hardware={name} but this device is {device_name}: the run uses {name}'s settings and MFU is "
            f"against {against}; pick this device's profile from conf/hardware/")


def resolve_peak(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 override_flops: float | None = None, profile: Mapping[str, Any] | None = None) -> Peak:
    """The peak for ``device`` computing in ``dtype``: an explicit override, the datasheet table for
    a known CUDA device, the ``hardware=`` profile's figure for a CUDA device the table does not
    know by name, else a measured matmul peak in ``dtype`` (labelled measured; always on CPU)."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if override_flops is not None:
        return Peak(float(override_flops), name, "override", "configured peak_tflops", measured=False)
    entry = lookup_peak(name) if device.type == "cuda" else None
    kind = "fp32" if dtype in (torch.float32, torch.float64) else "bf16"
    if entry is not None and entry.flops(dtype) is not None:
        return Peak(entry.flops(dtype), name, entry.key, entry.source, measured=False, dtype=kind)
    figure = profile_flops(profile, dtype) if device.type == "cuda" else None
    if figure is not None:
        key = str(profile.get("table_key") or profile.get("name"))
        return Peak(figure, name, key, f"hardware={profile.get('name')} profile (conf/hardware/)", measured=False,
                    dtype=kind)
    flops = measure_matmul_peak(device, dtype)
    dt = str(dtype).removeprefix("torch.")
    return Peak(flops, name, UNKNOWN, f"measured: best 1024x1024 {dt} matmul on this machine", measured=True,
                dtype=kind)


def refresh_peak(peak: Peak, device: torch.device | str, dtype: torch.dtype) -> Peak:
    """A measured peak again for the current CPU thread count (``callbacks.threads`` changes it during
    a run; measured once per count, then cached), so MFU is never against another count's peak; a
    datasheet or configured peak as it is."""
    return resolve_peak(device, dtype) if peak.measured else peak


# ---- sliding-window throughput -------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step (all its micro-batches): wall time since the previous step ended (pauses
    such as validation excluded), the part of it spent waiting for batches, and the work done."""

    elapsed_s: float
    wait_s: float
    tokens: int
    samples: int
    flops: float  # model FLOPs: tokens * flops_per_token at the batch's sequence length


def throughput_stats(records, peak_flops: float | None, world_size: int = 1) -> dict[str, float]:
    """Rates over ``records`` (one device's steps). Totals assume every rank does the same work
    in the same wall time, as ranks stepping in lockstep under DDP do.

    Returns per-device and total ``tokens_per_s`` and ``samples_per_s``, ``tflops`` (model FLOPs
    achieved), ``mfu_pct`` (``100 * flops / elapsed / peak_flops``; None without a peak),
    ``step_ms`` (mean optimizer step) and ``data_wait_pct`` (share of wall time spent waiting for
    batches)."""
    records = list(records)
    if not records:
        raise ValueError("throughput_stats needs at least one step record")
    elapsed = sum(r.elapsed_s for r in records)
    if elapsed <= 0:
        raise ValueError(f"throughput_stats: non-positive elapsed time {elapsed}")
    tokens = sum(r.tokens for r in records)
    samples = sum(r.samples for r in records)
    flops_per_s = sum(r.flops for r in records) / elapsed
    return {
        "tokens_per_s_per_device": tokens / elapsed,
        "tokens_per_s": world_size * tokens / elapsed,
        "samples_per_s_per_device": samples / elapsed,
        "samples_per_s": world_size * samples / elapsed,
        "tflops_per_device": flops_per_s / 1e12,
        "tflops": world_size * flops_per_s / 1e12,
        "mfu_pct": 100.0 * flops_per_s / peak_flops if peak_flops else None,
        "step_ms": 1e3 * elapsed / len(records),
        "data_wait_pct": 100.0 * sum(r.wait_s for r in records) / elapsed,
    }


def throughput_metrics(stats: dict, peak: "Peak | None", has_flops: bool) -> dict[str, float]:
    """The ``throughput/`` metrics of :func:`throughput_stats`: rates only without a FLOP count
    (``has_flops`` False), else TFLOP/s, ``mfu`` and the peak it is relative to."""
    metrics = {f"throughput/{k}": v for k, v in stats.items() if k != "mfu_pct"}
    if not has_flops:
        return {k: v for k, v in metrics.items() if "tflops" not in k}
    if stats["mfu_pct"] is not None:
        metrics["throughput/mfu"] = stats["mfu_pct"]
    if peak is not None:  # what the MFU is relative to: 1.0 marks a measured (not datasheet) peak
        metrics["throughput/peak_tflops"] = peak.flops / 1e12
        metrics["throughput/peak_measured"] = float(peak.measured)
    return metrics


def hardware_metrics(records, pairs: float, cfg, activation_checkpointing: bool, peak: "Peak | None",
                     world_size: int = 1) -> dict[str, float]:
    """``throughput/hfu`` (percent) and ``throughput/hardware_tflops`` (total): the FLOPs the
    hardware does over ``records`` given the ``pairs`` of (query, key) its attention computed
    (``bnlit.speed.flops.hardware_flops``: causal and document masks, activation checkpointing), beside
    PaLM's ``throughput/mfu`` that counts the full attention matrix."""
    from bnlit.speed.flops import hardware_flops

    records = list(records)
    elapsed = sum(r.elapsed_s for r in records)
    flops_per_s = hardware_flops(cfg, sum(r.tokens for r in records), pairs, activation_checkpointing) / elapsed
    out = {"throughput/hardware_tflops": world_size * flops_per_s / 1e12}
    if peak is not None:
        out["throughput/hfu"] = 100.0 * flops_per_s / peak.flops
    return out


def low_mfu_message(stats: dict, floor: float, step: int, peak: "Peak") -> str:
    return (f"MFU {stats['mfu_pct']:.2f}% is below the floor of {floor:g}% at step {step} "
            f"({stats['tokens_per_s']:,.0f} tokens/s, {stats['step_ms']:.1f} ms/step, "
            f"{stats['data_wait_pct']:.1f}% waiting for data) against the {peak.describe()}. "
            "Check trainer.precision (bf16-mixed), module.compile, module.sdpa_backend, module.loss_impl, "
            "optimizer.fused, data.num_workers and the micro-batch size; or lower callbacks.throughput.min_mfu_pct")


@dataclass
class MFUFloor:
    """The MFU floor of the module docstring, apart from the Trainer.

    Args:
        min_mfu_pct: the floor on CUDA devices, in percent; None: off.
        cpu_min_mfu_pct: the floor on CPU (against the measured matmul peak); None: off.
        warmup_steps: optimizer steps before the floor is judged.
        patience: consecutive low logging steps before it fires.
        on_low_mfu: ``"warn"`` or ``"raise"``.
    """

    min_mfu_pct: float | None = 20.0
    cpu_min_mfu_pct: float | None = None
    warmup_steps: int = 20
    patience: int = 1
    on_low_mfu: str = "warn"
    low: int = field(default=0, init=False)  # consecutive low logging steps so far (state, not a setting)

    def __post_init__(self):
        if self.on_low_mfu not in ("warn", "raise"):
            raise ConfigError(f"callbacks.throughput.on_low_mfu={self.on_low_mfu!r}: use 'warn' or 'raise'")
        for name in ("min_mfu_pct", "cpu_min_mfu_pct"):
            if (v := getattr(self, name)) is not None and not 0 < v <= 100:
                raise ConfigError(f"callbacks.throughput.{name}={v}: a percentage in (0, 100], or null to turn it off")
        if self.patience < 1 or self.warmup_steps < 0:
            raise ConfigError("callbacks.throughput: patience must be >= 1 and warmup_steps >= 0")

    def pct(self, device: torch.device) -> float | None:
        return self.cpu_min_mfu_pct if device.type == "cpu" else self.min_mfu_pct

    def judge(self, stats: dict, device: torch.device, step: int, peak: Peak,
              agree: Callable[[bool], bool] = bool) -> str | None:
        """The message when the floor fires at this logging step, else None. ``agree`` makes the
        verdict one for every rank (a raising rank would strand the others)."""
        floor = self.pct(device)
        if floor is None or stats["mfu_pct"] is None or step < self.warmup_steps:
            return None
        self.low = self.low + 1 if agree(stats["mfu_pct"] < floor) else 0
        return low_mfu_message(stats, floor, step, peak) if self.low >= self.patience else None


class StepTimer:
    """Turns host-clock readings at batch boundaries into :class:`StepRecord` s over a sliding
    window of optimizer steps. The clock is read twice per micro-batch and nothing is synchronised:
    on CUDA the reader makes the last reading after a device sync so the window's total is exact up
    to the host's lead at the window's start.

    ``clock`` is injectable (tests pass a fake one)."""

    def __init__(self, window_steps: int = 50, clock: Callable[[], float] = time.perf_counter):
        if window_steps < 1:
            raise ValueError(f"window_steps={window_steps}: must be >= 1")
        self.clock = clock
        self.window: deque[StepRecord] = deque(maxlen=window_steps)
        self.steps = 0  # optimizer steps recorded in total
        self._last_end: float | None = None
        self._paused = True  # nothing to measure a wait from before the first batch
        self._start = 0.0
        self._acc = [0.0, 0.0, 0, 0, 0.0]  # elapsed, wait, tokens, samples, flops of the current step

    def pause(self) -> None:
        """The time until the next batch starts is not training (validation, a checkpoint save)."""
        self._paused = True

    def batch_start(self) -> None:
        now = self.clock()
        if not self._paused and self._last_end is not None:
            gap = now - self._last_end
            self._acc[0] += gap
            self._acc[1] += gap
        self._paused = False
        self._start = now

    def batch_end(self, tokens: int, samples: int, flops: float, stepped: bool, now: float | None = None) -> StepRecord | None:
        """Close a micro-batch; when ``stepped`` (the optimizer stepped), close and return the step."""
        now = self.clock() if now is None else now
        self._acc[0] += now - self._start
        self._acc[2] += tokens
        self._acc[3] += samples
        self._acc[4] += flops
        self._last_end = now
        if not stepped:
            return None
        record = StepRecord(*self._acc)
        self._acc = [0.0, 0.0, 0, 0, 0.0]
        self.steps += 1
        self.window.append(record)
        return record

    def reset_window(self) -> None:
        self.window.clear()
