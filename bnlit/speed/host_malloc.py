"""Keep freed host memory for reuse instead of handing it back to the OS (glibc ``mallopt``).

A CPU training step allocates and frees the same large tensors every step (the default run's
logits are 16 x 256 x 8192 floats, 134 MB, and their gradients). glibc serves every block above
``M_MMAP_THRESHOLD`` (128 KiB to 32 MiB, adjusted dynamically) with a fresh ``mmap`` and returns it
with ``munmap`` on free, so each step faults every page of those tensors in again: ~135,000 minor
page faults per step of the default model, and about 40% of the run's CPU time in the kernel
(``/usr/bin/time``: 231 s system of 577 s). Raising the mmap and trim thresholds keeps the freed
blocks in the heap for the next step: ~6,000 faults per step and 0.64x the step time, paired
(docs/getting-started.md "How long the default run takes"). The cost is memory: the large
temporaries of validation and the end-of-run baselines stay in the heap too, so the default run
peaks at ~5.4 GiB resident against ~1.1 GiB without (``scripts/bench_host_malloc.py --runs 3``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("bnlit")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`KEEP_BYTES`; True when applied (Linux with
    glibc), False elsewhere (macOS, musl), where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # mallopt returns 1 on success; musl has no mallopt symbol (AttributeError above)
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
