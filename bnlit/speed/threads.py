"""How many intra-op threads torch uses on CPU, chosen from the cores and the load.

On a quiet machine every core helps. On a machine whose cores are already busy with other jobs,
each extra OpenMP thread waits at every barrier for a core the scheduler gives to someone else,
and a step slows by far more than the load ratio (docs/getting-started.md "Threads and load": paired
``scripts/bench_threads.py`` figures). ``threads: auto`` therefore asks for the cores that are
idle now, at least one; an integer pins the count.

"Now" at start is measured, not read off the 1-minute load average: that average still counts a
job that ended seconds ago (the README's own ``pip install ... && python -m bnlit.train`` left
0.5-1.0 of it), which made a quiet 2-core machine start on one thread and compile again when
the second came (:func:`idle_cores`)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from bnlit.errors import ConfigError

log = logging.getLogger("bnlit")


def available_cpus() -> int:
    """Cores this process may run on (its affinity mask, e.g. under SLURM or taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


IDLE_WINDOW_S = 0.5  # how long idle_cores watches the cores at start


def _whole_cores(idle: float, cpus: int) -> int:
    """``idle`` cores rounded to the nearest integer, between 1 and ``cpus``."""
    return max(1, min(cpus, math.floor(idle + 0.5)))


def idle_cores(window: float = IDLE_WINDOW_S) -> float | None:
    """The idle cores among this process's (its affinity mask) over the next ``window`` seconds,
    from ``/proc/stat`` (idle and iowait count as idle, a VM's steal as busy), while this process
    sleeps; None where there is no ``/proc/stat``."""
    try:
        mine = os.sched_getaffinity(0)
        before = _cpu_times(mine)
        time.sleep(window)
        after = _cpu_times(mine)
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    if not after or before.keys() != after.keys():
        return None
    return sum((after[c][0] - before[c][0]) / (after[c][1] - before[c][1]) if after[c][1] > before[c][1] else 1.0
               for c in after)


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """``{cpu: (idle ticks, total ticks)}`` of ``/proc/stat``'s per-CPU lines for ``cpus``."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
                out[int(name[3:])] = (idle + iowait, user + nice + system + idle + iowait + irq + softirq + steal)
    return out


def choose_threads(setting: int | str, cpus: int, load: float | None, idle: float | None = None) -> tuple[int, str]:
    """``(threads, why)`` for ``threads=setting`` on ``cpus`` cores at 1-minute ``load``, with
    ``idle`` cores measured at start (:func:`idle_cores`; None where it cannot be).

    ``auto``: the idle cores rounded to the nearest integer, between 1 and ``cpus``: measured where
    they can be, else ``cpus - load`` (all of them when the load is unknown too).
    """
    if setting == "auto":
        if idle is not None:
            n = _whole_cores(idle, cpus)
            average = f", load average {load:.2f}" if load is not None else ""
            return n, f"auto: {cpus} cores, {idle:.1f} idle over {IDLE_WINDOW_S:g} s{average}"
        if load is None:
            return cpus, f"auto: {cpus} cores, load average unknown"
        idle = _whole_cores(cpus - load, cpus)
        return idle, f"auto: {cpus} cores, load average {load:.2f} leaves {idle} idle"
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting, "set by threads"
    raise ConfigError(f"threads={setting!r}: use auto or an integer >= 1, e.g. threads=1 on a busy machine")


def rechoose_threads(cpus: int, load: float, current: int) -> tuple[int, str]:
    """``(threads, why)`` for a running ``threads: auto`` process that uses ``current`` threads at
    1-minute ``load``. Its own busy threads are part of the load, so the other jobs' share is
    ``load - current``; the idle cores are what is left of ``cpus``, rounded, between 1 and ``cpus``.
    (Without that correction a quiet machine would read its own 2 threads as 2 busy cores and
    drop to 1.)"""
    others = max(0.0, load - current)
    idle = _whole_cores(cpus - others, cpus)
    return idle, f"auto: {cpus} cores, load average {load:.2f} of which ~{others:.1f} other jobs leaves {idle} idle"


def set_threads(setting: int | str) -> int:
    """Apply :func:`choose_threads` to torch and log the choice with the load; returns the count."""
    import torch  # here: the rest of this module (cores, load) serves tools that never import torch

    n, why = choose_threads(setting, available_cpus(), load_average(), idle_cores() if setting == "auto" else None)
    torch.set_num_threads(n)
    # Lightning's DDP launchers set torch's count from the cores per process unless OMP_NUM_THREADS is set
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    log.info("threads: %d (%s)", n, why)
    return n


def hold_threads(n: int) -> None:
    """Set torch back to the run's ``n`` threads when something changed the count after
    :func:`set_threads` chose it, and say so. An import while the callbacks, loggers and trainer are
    built can call ``torch.set_num_threads`` (a test helper's conftest did: a run with ``threads=1``
    trained on 2, and its gradients differed in the 7th digit from the same run without it)."""
    import torch

    now = torch.get_num_threads()
    if now != n:
        torch.set_num_threads(n)
        log.warning("threads: %d again (torch was set to %d while the callbacks, loggers and trainer were built)",
                    n, now)
