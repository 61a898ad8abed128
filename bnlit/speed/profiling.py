"""Where the time of a few training steps went, from a ``torch.profiler`` trace, in one line.

:func:`where_time_went` sorts what the profiler saw into matmul, attention, elementwise (and
reductions, copies, norms: everything else the kernels do), optimizer, communication, data wait
and host gaps, as shares of the profiled wall time:

- on CUDA, each device kernel by its name (``gemm``/``cutlass``/Inductor's ``mm`` templates are
  matmul, ``flash``/``fmha``/``sdpa``/``flex`` attention, ``nccl`` communication, Inductor's
  ``triton_poi``/``triton_red`` and ATen's elementwise and reduction kernels elementwise; a kernel
  launched inside ``Optimizer.step`` is optimizer time); **host gaps** are the wall time the
  device did nothing (no kernel running): Python, launches, syncs;
- a step's forward and backward that Lightning runs inside ``Optimizer.step`` (its closure, marked
  ``bnlit.forward_backward`` by :class:`bnlit.module.LMModule` while a profiler runs) count by name;
- on CPU, each ATen op's own (self) time by the op's name, and the time outside any op is the
  host gap (Python, Lightning, callbacks);
- **data wait** is the time inside the data loader's ``__next__`` (``enumerate(DataLoader)``).

The throughput monitor (:mod:`bnlit.callbacks.throughput`) takes such a trace when the MFU floor
fires and writes the line to the log and the run summary; ``scripts/gpu_check.py --profile`` takes
one of steady steps. Names are matched, not guessed: a kernel no rule knows is ``other``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("matmul", "attention", "elementwise", "optimizer", "communication", "other")
_RULES = (  # (category, pattern on the lower-cased kernel or op name); first match wins
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|c10d|broadcast"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|flex"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|xmma|\bmm\b|aten::(mm|addmm|bmm|baddbmm|matmul|linear)$|_mm_|tem_fused_(add)?mm"),
    ("optimizer", r"adam|multi_tensor|_foreach_|fused_sgd"),
    ("elementwise", r"^aten::|triton_(poi|red|per)_|elementwise|vectorized|reduce|cpp_fused|copy|memcpy|memset|fill"
                    r"|norm|softmax|cat|index|gather|scatter"),
)
DATA = "enumerate(DataLoader)"
OPTIMIZER_STEP = "Optimizer.step"
# Lightning runs the forward and backward inside ``Optimizer.step`` (its closure): the module marks
# the closure with this range while a profiler runs, so that work stays matmul, attention, ...
FORWARD_BACKWARD = "bnlit.forward_backward"


def marked_closure(closure):
    """``closure`` inside a ``FORWARD_BACKWARD`` profiler range while a profiler runs; else itself
    (nothing on the hot path of an unprofiled step but one flag read)."""
    import torch

    if closure is None or not torch.autograd.profiler._is_profiler_enabled:
        return closure

    def marked():
        with torch.profiler.record_function(FORWARD_BACKWARD):
            return closure()

    return marked


def _in_optimizer(names: list[str]) -> bool:
    """Whether an op whose own and enclosing range names are ``names`` (innermost first) is the
    optimizer's own work: inside ``Optimizer.step`` but not in the forward/backward closure it runs."""
    for name in names:
        if name == FORWARD_BACKWARD:
            return False
        if name.startswith(OPTIMIZER_STEP):
            return True
    return False


def category(name: str) -> str:
    """The category of a kernel or ATen op ``name`` (``other`` when no rule matches)."""
    low = name.lower()
    return next((cat for cat, pattern in _RULES if re.search(pattern, low)), "other")


@dataclass
class TimeSplit:
    """Seconds per category over ``wall_s`` of profiled time (``steps`` optimizer steps)."""

    wall_s: float
    steps: int
    device: str  # "cuda" (kernel time) or "cpu" (ATen op self time)
    seconds: dict[str, float] = field(default_factory=dict)
    data_wait_s: float = 0.0
    host_gaps_s: float = 0.0
    top: list[tuple[str, float]] = field(default_factory=list)  # the longest kernels/ops by total time

    def share(self, seconds: float) -> float:
        return 100.0 * seconds / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """``where the time went (3 steps, 2.41 s, cuda kernels): matmul 52%, attention 21%, ...``"""
        kind = "cuda kernels" if self.device == "cuda" else "cpu ops"
        parts = [f"{c} {self.share(s):.0f}%" for c, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]) if s > 0]
        gaps = "device idle" if self.device == "cuda" else "outside ops: Python, Lightning, callbacks"
        parts += [f"data wait {self.share(self.data_wait_s):.0f}%",
                  f"host gaps {self.share(self.host_gaps_s):.0f}% ({gaps})"]
        top = ", ".join(f"{name[:40]} {self.share(s):.0f}%" for name, s in self.top[:3])
        return (f"where the time went ({self.steps} steps, {self.wall_s:.2f} s, {kind}): {', '.join(parts)}"
                + (f"; top: {top}" if top else ""))

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "steps": self.steps, "device": self.device,
                "pct": {c: self.share(s) for c, s in self.seconds.items()},
                "data_wait_pct": self.share(self.data_wait_s), "host_gaps_pct": self.share(self.host_gaps_s),
                "top": [(n, self.share(s)) for n, s in self.top]}


def _ancestors(event) -> list[str]:
    names, parent = [], getattr(event, "cpu_parent", None)
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length (s) of the union of ``(start_us, end_us)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e6


def where_time_went(events, wall_s: float, steps: int) -> TimeSplit:
    """:class:`TimeSplit` of a profiler's ``events()`` (``torch.profiler.profile(...).events()``)
    over ``wall_s`` seconds of ``steps`` optimizer steps. CUDA kernels decide when there are any,
    else CPU ATen ops' self time."""
    from torch.autograd import DeviceType

    events = list(events)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    totals: dict[str, float] = {}
    data_wait = sum(e.time_range.elapsed_us() for e in events
                    if e.device_type == DeviceType.CPU and e.name.startswith(DATA)) / 1e6
    if kernels:
        # a kernel's launching CPU op (the profiler links them by correlation id): kernels launched
        # inside Optimizer.step are optimizer time whatever they are called
        ops = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        for k in kernels:
            s = k.time_range.elapsed_us() / 1e6
            op = ops.get(getattr(k, "linked_correlation_id", None))
            in_step = op is not None and _in_optimizer([op.name, *_ancestors(op)])
            cat = "optimizer" if in_step else category(k.name)
            seconds[cat] += s
            totals[k.name] = totals.get(k.name, 0.0) + s
        busy = _union_seconds([(k.time_range.start, k.time_range.end) for k in kernels])
        return TimeSplit(wall_s, steps, "cuda", seconds, data_wait, max(0.0, wall_s - busy),
                         sorted(totals.items(), key=lambda kv: -kv[1])[:5])
    inside = 0.0
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        s = e.self_cpu_time_total / 1e6
        ancestors = _ancestors(e)
        if any(a.startswith(DATA) for a in ancestors):
            continue  # the loader's own ops are data wait
        cat = "optimizer" if _in_optimizer(ancestors) else category(e.name)
        seconds[cat] += s
        inside += s
        totals[e.name] = totals.get(e.name, 0.0) + s
    return TimeSplit(wall_s, steps, "cpu", seconds, data_wait, max(0.0, wall_s - inside - data_wait),
                     sorted(totals.items(), key=lambda kv: -kv[1])[:5])


class StepProfiler:
    """One ``torch.profiler`` trace of ``steps`` optimizer steps, taken once: from ``at_step`` on,
    or from the step :meth:`schedule` names (the MFU floor fired). The caller says where optimizer
    steps begin and end (:class:`bnlit.callbacks.throughput.ThroughputMonitor`)."""

    def __init__(self, steps: int = 3, at_step: int | None = None):
        self.steps, self.at_step = steps, at_step
        self.running = self.taken = False
        self._from = at_step  # the optimizer steps completed when the trace may start
        self._prof = None
        self._memory = False
        self._t0 = 0.0
        self._start = 0

    def schedule(self, step: int) -> None:
        """Trace from the next optimizer step after ``step`` on (once)."""
        if not self.taken and not self.running:
            self._from = step

    def due(self, global_step: int, boundary: bool) -> bool:
        """Whether to start now: at the first micro-batch of an optimizer step (``boundary``)."""
        return boundary and not self.running and not self.taken and self._from is not None and global_step >= self._from

    def start(self, device, memory: bool = False) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.device(device).type == "cuda"
        self._memory = memory and cuda
        if self._memory:  # the allocator's history for torch.cuda.memory._dump_snapshot (pytorch.org/memory_viz)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if cuda:
            torch.cuda.synchronize(device)
        self._prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        self.running = True
        self._start = -1  # set by the first finished() call: the steps completed when it started

    def finished(self, steps_done: int) -> bool:
        """Called after each optimizer step with the steps completed so far."""
        if self._start < 0:
            self._start = steps_done - 1  # this call closes the first profiled step
        return steps_done - self._start >= self.steps

    def stop(self, device, out_dir: Path | None = None) -> tuple[TimeSplit, list[Path]]:
        """End the trace; its :class:`TimeSplit` and the files written into ``out_dir`` (the chrome
        trace, and the CUDA memory snapshot when asked for): rank zero passes the run's plots/."""
        import torch

        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self.running, self.taken = False, True
        split = where_time_went(self._prof.events(), wall, self.steps)
        files = []
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            trace = out_dir / f"profile_step{self._start + 1}.json"
            self._prof.export_chrome_trace(str(trace))
            files.append(trace)
            if self._memory:
                snapshot = out_dir / "memory_snapshot.pickle"
                torch.cuda.memory._dump_snapshot(str(snapshot))
                files.append(snapshot)
        if self._memory:
            torch.cuda.memory._record_memory_history(enabled=None)
        self._prof = None
        return split, files
