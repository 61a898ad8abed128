"""Freed host tensors are reused, not faulted in again every step (bnlit/speed/host_malloc.py).

Measured in a fresh interpreter, as a training run calls it at start: inside the pytest process the
heap's state depends on every test that ran before (a mapping above the program break makes glibc
fall back to mmap), which made the in-process version fail about 1 run in 4 in the full suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import torch
from bnlit.speed.host_malloc import keep_freed_memory

def faults(nbytes, times):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        t.fill_(1.0)  # touch every page
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

nbytes, times = 64 << 20, 5
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
faults(nbytes, 10)  # the heap grows over the first few (measured: 5 at 64 MiB)
print(json.dumps({"applied": applied, "faults": faults(nbytes, times),
                  "pages": times * nbytes // resource.getpagesize()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="machine: not Linux (glibc mallopt)")
def test_large_freed_tensors_are_reused_without_page_faults():
    kept, default = _probe("keep"), _probe("default")
    assert kept["applied"]
    # glibc's default mmaps and munmaps each 64 MiB block: every page is faulted in every time
    assert default["faults"] >= 0.9 * default["pages"], default
    assert kept["faults"] < 0.1 * kept["pages"], kept
