"""``python scripts/bench_block_mask.py``: the cost of building one micro-batch's document
``BlockMask`` (flex attention's mask on CUDA), three ways, each in a fresh process, alternated
over ``--reps``: ``eager`` (``create_block_mask`` as bnlit called it before: every token pair
evaluated eagerly), ``compiled`` (``create_block_mask(..., _compile=True)``, what torchtitan
does) and ``per_block`` (:func:`bnlit.document_masking.document_block_mask`, from block boundary ids).
Prints per variant the median build time over ``--builds`` (after one untimed build) and the peak
resident-memory growth over the process's resident set once the windows exist, and the paired
ratios against ``per_block``; on this machine's CPU (the device the mask is built on in a CUDA
run is the GPU: ``--device cuda`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("eager", "compiled", "per_block")


def rss(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) * 1024


def child(variant: str, batch: int, seq_len: int, builds: int, device: str) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from bnlit.document_masking import document_block_mask, document_ids
    from bnlit.tokenizer import EOS_ID

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(EOS_ID + 1, 1000, (batch, seq_len), generator=g)
    x[torch.rand(batch, seq_len, generator=g) < 1 / 300] = EOS_ID  # documents of ~300 tokens
    x = x.to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def build():
        doc = document_ids(x, EOS_ID)
        if variant == "per_block":
            return document_block_mask(doc)

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (doc[b, q] == doc[b, kv])

        return create_block_mask(same_document_causal, batch, None, seq_len, seq_len, device=device,
                                 _compile=variant == "compiled")

    base = rss("VmRSS")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    build()  # the first build: compilation for "compiled"
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(builds):
        t0 = time.perf_counter()
        build()
        sync()
        times.append(time.perf_counter() - t0)
    out = {"variant": variant, "first_ms": 1e3 * first, "build_ms": 1e3 * statistics.median(times),
           "peak_growth_mib": (rss("VmHWM") - base) / 2**20}
    if device == "cuda":
        out["cuda_peak_growth_mib"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16, help="windows per micro-batch (trainer=h100: 16)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
    ap.add_argument("--builds", type=int, default=5, help="timed builds per process, after an untimed first")
    ap.add_argument("--reps", type=int, default=2, help="alternated repetitions of every variant")
    ap.add_argument("--device", default="cpu", help="where the mask is built (cuda on a GPU machine)")
    ap.add_argument("--variants", type=lambda v: v.split(","), default=list(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        r = child(args.child, args.batch_size, args.seq_len, args.builds, args.device)
        print(json.dumps(r))
        return r
    out = {"batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
           "load_average_start": os.getloadavg()[0], "runs": {v: [] for v in args.variants}}
    for rep in range(args.reps):
        k = rep % len(args.variants)
        for v in args.variants[k:] + args.variants[:k]:
            cmd = [sys.executable, __file__, "--child", v, "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len), "--builds", str(args.builds), "--device", args.device]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if p.returncode:
                raise SystemExit(f"{v}: {p.stderr[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            out["runs"][v].append(r)
            print(f"rep {rep + 1} {v:10s} first {r['first_ms']:9.1f} ms, then {r['build_ms']:8.2f} ms per build, "
                  f"peak memory +{r['peak_growth_mib']:.0f} MiB", file=sys.stderr, flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    runs = out["runs"]
    for v in args.variants:
        out[f"{v}_build_ms"] = statistics.median(r["build_ms"] for r in runs[v])
        out[f"{v}_peak_growth_mib"] = statistics.median(r["peak_growth_mib"] for r in runs[v])
        if "per_block" in runs and v != "per_block":
            out[f"{v}_vs_per_block_time"] = statistics.median(
                a["build_ms"] / b["build_ms"] for a, b in zip(runs[v], runs["per_block"]))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
