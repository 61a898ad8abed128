"""What the shard checksum check costs: ``python scripts/bench_shard_check.py [--gib 2] [--rounds 3]``.

Writes a shard set of ``--gib`` GiB of random tokens with its block checksums (what
:func:`bnlit.data.shards.build_shards` records), then times, alternating in one run (A B A B):

* **check**: :func:`bnlit.data.shards.verify_index`, what the data module runs before training;
* **read**: a plain read of the same bytes with the same buffer, the floor of any check.

Each is timed twice per round: from the page cache (warm: the usual case, right after a build or on
a node that trained before) and with the files' pages dropped first (cold: ``posix_fadvise
DONTNEED``, the first open on a node; a network filesystem's own cache may still serve them).
Prints seconds per GiB (median over rounds), the check/read ratio and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bnlit.data import shards
from bnlit.speed.threads import load_average

WRITE_BYTES = 64 << 20


def write_shard_set(root: Path, gib: float) -> dict:
    """``root/s.train.bin`` of ``gib`` GiB of random uint16 tokens, a small ``s.val.bin``, and the
    index the builder would write for them."""
    rng = np.random.default_rng(0)
    sizes = {"train": int(gib * (1 << 30)) // 2 * 2, "val": 1 << 20}
    entry = {}
    for split, size in sizes.items():
        path = root / f"s.{split}.bin"
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, WRITE_BYTES)
                f.write(rng.integers(0, 1 << 16, n // 2, dtype=np.uint16).tobytes())
                left -= n
        entry[split] = {"file": path.name, "tokens": size // 2,
                        "blocks": shards.block_checksums(path, shards.BLOCK_BYTES)}
    return {"dtype": "uint16", "checksum": {"algorithm": shards.CHECKSUM, "block_bytes": shards.BLOCK_BYTES},
            "sources": {"s": entry}}


def drop_cache(root: Path) -> None:
    for p in root.glob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(root: Path, index: dict) -> int:
    buf = bytearray(index["checksum"]["block_bytes"])
    total = 0
    for split in shards.SPLITS:
        with open(root / index["sources"]["s"][split]["file"], "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="size of the training shard written and checked, in GiB")
    p.add_argument("--rounds", type=int, default=3, help="A B A B rounds (each: check and read, warm and cold)")
    p.add_argument("--dir", default=None, help="where to write the shard set (a temporary directory under it; "
                                               "default: the system's temporary directory)")
    args = p.parse_args(argv)
    load_start = load_average()
    root = Path(tempfile.mkdtemp(prefix="bench_shard_check_", dir=args.dir))
    try:
        index = write_shard_set(root, args.gib)
        gib = sum((root / e["file"]).stat().st_size for e in index["sources"]["s"].values()) / (1 << 30)
        runs = {"check": lambda: shards.verify_index(root, index), "read": lambda: plain_read(root, index)}
        times: dict[str, list[float]] = {f"{k}_{c}": [] for k in runs for c in ("warm", "cold")}
        for _ in range(args.rounds):
            for cache in ("warm", "cold"):
                for name, fn in runs.items():
                    if cache == "cold":
                        drop_cache(root)
                    else:
                        plain_read(root, index)  # into the page cache
                    t0 = time.perf_counter()
                    fn()
                    times[f"{name}_{cache}"].append((time.perf_counter() - t0) / gib)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(gib=gib, block_bytes=shards.BLOCK_BYTES, rounds=args.rounds, load_start=load_start, load_end=load_average())
    print(f"shard check of {gib:.2f} GiB ({shards.CHECKSUM}, {shards.BLOCK_BYTES >> 20} MiB blocks), "
          f"median of {args.rounds} alternating rounds; load average {load_start:.1f} at start, {out['load_end']:.1f} at end")
    for cache in ("warm", "cold"):
        c, r = out[f"check_{cache}"], out[f"read_{cache}"]
        print(f"  {cache:4s}: check {c:.3f} s/GiB ({1 / c:.2f} GiB/s), plain read {r:.3f} s/GiB; check/read {c / r:.2f}")
    return out


if __name__ == "__main__":
    main()
