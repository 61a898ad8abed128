"""Host allocator benchmark for the default CPU run: ``python scripts/bench_host_malloc.py``.

Times optimizer steps (forward, backward, AdamW) of the default model on random tokens with
glibc's default mmap/trim thresholds and with the raised ones of ``keep_freed_memory``
(:mod:`bnlit.speed.host_malloc`), switched block by block within one process (A, B, B, A, ...), and
prints each block's step time and minor page faults per step, the paired ratios (raised /
default) and their median with the 1-minute load average. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR
from bnlit.speed.host_malloc import KEEP_BYTES, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
from bnlit.module import next_token_loss, param_groups

GLIBC_DEFAULT = 128 * 1024  # the documented initial mmap and trim thresholds


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds; each times both settings once, alternating which goes first")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per setting per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")

    def thresholds(raised: bool) -> None:
        value = KEEP_BYTES if raised else GLIBC_DEFAULT
        libc.mallopt(M_MMAP_THRESHOLD, value)
        libc.mallopt(M_TRIM_THRESHOLD, value)
        if not raised:
            libc.malloc_trim(0)

    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}", "paths.output_dir=."])
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    vocab, batch, seq = cfg.model.config.vocab_size, cfg.data.batch_size, cfg.data.seq_len
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))

    def step() -> None:
        next_token_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    load_before = os.getloadavg()[0]
    for _ in range(3):
        step()
    times: dict[bool, list[float]] = {False: [], True: []}
    faults: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for raised in ((False, True) if r % 2 == 0 else (True, False)):
            thresholds(raised)
            step()  # one untimed step after a switch
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for _ in range(args.steps):
                step()
            times[raised].append((time.perf_counter() - t0) / args.steps)
            faults[raised].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.steps)
    ratios = [a / b for a, b in zip(times[True], times[False])]
    print(f"model={args.model} batch={batch} seq_len={seq} vocab={vocab} threads={args.threads} "
          f"load average before {load_before:.1f} after {os.getloadavg()[0]:.1f}")
    for raised, name in ((False, "glibc default"), (True, "keep_freed_memory")):
        print(f"  {name:>17}: step s {' '.join(f'{t:.3f}' for t in times[raised])}  "
              f"page faults/step {' '.join(f'{f:,.0f}' for f in faults[raised])}")
    print(f"  step time keep_freed_memory / default: median {statistics.median(ratios):.2f}  "
          f"pairs {' '.join(f'{v:.2f}' for v in ratios)}")


if __name__ == "__main__":
    main()
