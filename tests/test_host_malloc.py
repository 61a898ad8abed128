"""Freed host tensors are reused, not faulted in again every step (bnlit/host_malloc.py)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from bnlit.host_malloc import keep_freed_memory

MIB = 1 << 20


def _faults_of_repeated_allocations(nbytes: int, times: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        t.fill_(1.0)  # touch every page
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_freed_tensors_are_reused_without_page_faults():
    nbytes, times = 64 * MIB, 5
    pages = times * nbytes // resource.getpagesize()
    assert keep_freed_memory()
    _faults_of_repeated_allocations(nbytes, 10)  # the heap grows over the first few (measured: 5 at 64 MiB)
    kept = _faults_of_repeated_allocations(nbytes, times)
    # glibc's default would mmap and munmap each 64 MiB block: every page faulted in every time
    assert kept < 0.1 * pages, f"{kept} page faults for {times} reuses of a {nbytes >> 20} MiB block ({pages} pages)"
