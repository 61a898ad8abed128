"""Peak memory of this process and every process it started, stage by stage (Linux ``/proc``).

A data build runs its stages in this process (one worker) or in pools of worker processes
(datatrove's ``LocalPipelineExecutor`` forks them from a forkserver, a child of this process), so
neither ``RUSAGE_SELF`` nor ``RUSAGE_CHILDREN`` (one lifetime maximum each, and children count
only once waited for) gives a stage's peak. :class:`TreeMemory` samples the tree in a thread and
:meth:`TreeMemory.mark` closes a stage with two figures:

* ``tree_mb``: the largest sum over the tree's processes of their proportional set size (PSS:
  pages shared between processes, like a forked worker's with its parent, counted once in all),
  over the samples taken since the last mark: what the stage needed of the machine's memory;
* ``largest_mb``: the largest peak resident set (``VmHWM``, kept by the kernel, so a spike between
  two samples counts) of any one process of the stage, as of its last sample (a worker's last
  <= ``interval`` seconds before it exits can be missed); this process's own peak is reset at each
  mark (``/proc/self/clear_refs``), so an earlier stage's peak does not carry over.

``baseline_mb`` is the tree's PSS when sampling starts (the interpreter and its imports).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

MB = 1e6


def supported() -> bool:
    """Whether this kernel exposes what :class:`TreeMemory` reads."""
    pid = os.getpid()
    return Path(f"/proc/{pid}/smaps_rollup").is_file() and Path(f"/proc/{pid}/task/{pid}/children").is_file()


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on (``/proc/<pid>/task/<tid>/children``)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:  # gone
            continue
        for tid in tids:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _field(path: str, name: str) -> int | None:
    """A ``kB`` field of a ``/proc`` file, in bytes (None if the process is gone)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def pss(pid: int) -> int:
    return _field(f"/proc/{pid}/smaps_rollup", "Pss:") or 0


def peak_rss(pid: int) -> int:
    return _field(f"/proc/{pid}/status", "VmHWM:") or 0


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0; silently kept otherwise)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class TreeMemory:
    """Sample the memory of this process's tree every ``interval`` seconds, in a thread.

    >>> with TreeMemory() as mem:
    ...     run_stage_a(); a = mem.mark()   # {"tree_mb": ..., "largest_mb": ...}
    ...     run_stage_b(); b = mem.mark()
    """

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.root = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline_mb = 0.0
        self._reset()

    def _reset(self) -> None:
        self._tree = 0
        self._largest = 0
        self.samples = 0

    def sample(self) -> None:
        pids = [self.root] + descendants(self.root)
        total = sum(pss(p) for p in pids)
        largest = max(peak_rss(p) for p in pids)
        with self._lock:
            self._tree = max(self._tree, total)
            self._largest = max(self._largest, largest)
            self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreeMemory":
        reset_peak()
        self.sample()
        self.baseline_mb = self._tree / MB
        self._thread = threading.Thread(target=self._loop, name="tree-memory", daemon=True)
        self._thread.start()
        return self

    def mark(self) -> dict[str, float]:
        """The peaks since the last mark (or the start), then start a new stage."""
        self.sample()  # the end of the stage, even when it was shorter than one interval
        with self._lock:
            out = {"tree_mb": round(self._tree / MB, 1), "largest_mb": round(self._largest / MB, 1),
                   "samples": self.samples}
            self._reset()
        reset_peak()
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "TreeMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
