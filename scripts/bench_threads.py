"""Intra-op thread count benchmark for the default CPU run: ``python scripts/bench_threads.py``.

Times optimizer steps (forward, backward, AdamW) of the default model (``model=tiny`` with the
default data shape) on random tokens, switching ``torch.set_num_threads`` between the candidate
counts block by block (A, B, A, B, ... within one process), so the machine's drift hits every count
alike. Prints each round's step time per count, the paired ratios against the first count, their
median, and the 1-minute load average before and after: what ``threads: auto``
(:func:`bnlit.speed.threads.choose_threads`) is based on. Quote the median ratio with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR
from bnlit.module import next_token_loss, param_groups


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts to compare; the first is the "
                   "reference of the ratios ('all' = os.cpu_count())")
    p.add_argument("--rounds", type=int, default=6, help="A,B,... rounds; each round times every count once")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per count per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round (allocator, kernels)")
    p.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per step (default: the data config's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the data config's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    counts = [os.cpu_count() or 1 if t == "all" else int(t) for t in args.threads.split(",")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args.model}"])
    batch = args.batch_size or cfg.data.batch_size
    seq = args.seq_len or cfg.data.seq_len
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    vocab = cfg.model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.randint(0, vocab, (batch, seq))

    def step() -> None:
        loss = next_token_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    load_before = os.getloadavg()
    for _ in range(args.warmup):
        step()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]  # A B, B A, ...: neither always goes first
        for n in order:
            torch.set_num_threads(n)
            step()  # one untimed step after a switch (the thread pool resizes)
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[n].append((time.perf_counter() - t) / args.steps)
    load_after = os.getloadavg()
    ref = counts[0]
    ratios = {n: [a / b for a, b in zip(times[n], times[ref])] for n in counts[1:]}
    result = {
        "model": args.model, "batch_size": batch, "seq_len": seq, "cpu_count": os.cpu_count(),
        "load_before": load_before, "load_after": load_after,
        "median_step_s": {n: statistics.median(v) for n, v in times.items()},
        "step_s": times,
        f"median_ratio_vs_{ref}_threads": {n: statistics.median(v) for n, v in ratios.items()},
        "paired_ratios": ratios,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"model={args.model} batch={batch} seq_len={seq} cpus={os.cpu_count()} "
          f"load average before {load_before[0]:.1f} after {load_after[0]:.1f}")
    for n in counts:
        print(f"  {n} thread(s): median step {statistics.median(times[n]):.3f} s  rounds "
              + " ".join(f"{t:.3f}" for t in times[n]))
    for n, v in ratios.items():
        print(f"  step time {n} threads / {ref}: median {statistics.median(v):.2f}  pairs "
              + " ".join(f"{r:.2f}" for r in v))


if __name__ == "__main__":
    main()
