"""bnlit.speed.tree_memory: a stage's peak memory, in this process and in the processes it starts,
and no carry-over of an earlier stage's peak."""

from __future__ import annotations

import mmap
import subprocess
import sys

import pytest

from bnlit.speed import tree_memory

pytestmark = pytest.mark.skipif(not tree_memory.supported(), reason="needs Linux /proc smaps_rollup and children")

MB = 1e6
# touches every page (b"\x01" * n is written, unlike bytearray(n)'s untouched calloc pages)
CHILD = "import time; b = b'\\x01' * {n}; time.sleep({s})"


def test_a_child_processs_allocation_counts_in_its_stage_only():
    with tree_memory.TreeMemory(interval=0.02) as mem:
        base = mem.baseline_mb
        n = int(base * MB) + 300_000_000  # larger than this process (pytest has torch loaded)
        subprocess.run([sys.executable, "-c", CHILD.format(n=n, s=0.5)], check=True)
        busy = mem.mark()
        subprocess.run([sys.executable, "-c", CHILD.format(n=1, s=0.5)], check=True)
        idle = mem.mark()
    assert busy["samples"] >= 5 and idle["samples"] >= 5
    assert busy["largest_mb"] >= n / MB, (n, busy)  # the child's own peak
    assert busy["tree_mb"] >= base + n / MB - 10, (base, n, busy)  # this process plus the child
    assert idle["tree_mb"] < base + 100, (base, idle)
    assert idle["largest_mb"] < busy["largest_mb"] - 200, (busy, idle)  # the child of the stage before is gone


@pytest.mark.xfail(strict=False, reason="open: under load the calm stage's largest-process PSS (1610 MB) equalled the spike's "
                   "in the CI run of 2026-12-05 14:25 (the sampler missed the reset); cause not found")
def test_this_processs_peak_is_reset_between_stages():
    with tree_memory.TreeMemory(interval=0.02) as mem:
        base = mem.baseline_mb
        # fresh anonymous pages, touched and unmapped between two samples: only VmHWM sees them
        # (malloc could hand back freed pages still resident from an earlier test)
        block = mmap.mmap(-1, 150_000_000)
        for i in range(0, len(block), mmap.PAGESIZE):
            block[i] = 1
        block.close()
        spike = mem.mark()
        calm = mem.mark()
    assert spike["largest_mb"] >= base + 140, (base, spike)
    assert calm["largest_mb"] < spike["largest_mb"] - 140, (spike, calm)


def test_descendants_include_grandchildren():
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD.format(n=1, s=1.0)!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = tree_memory.descendants(proc.pid)
            if found:
                break
            time.sleep(0.02)
        assert len(found) == 1 and proc.pid in tree_memory.descendants(tree_memory.os.getpid())
    finally:
        proc.wait()
