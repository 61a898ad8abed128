"""Host allocator benchmark for the default CPU run: ``python scripts/bench_host_malloc.py``.

Times optimizer steps (forward, backward, AdamW) of the default model on random tokens with
glibc's default mmap/trim thresholds and with the raised ones of ``keep_freed_memory``
(:mod:`bnlit.speed.host_malloc`), switched block by block within one process (A, B, B, A, ...), and
prints each block's step time and minor page faults per step, the paired ratios (raised /
default) and their median with the 1-minute load average. Linux with glibc only.

``--runs N`` instead runs the default run itself (``python -m bnlit.train`` with ``--override``s,
default ``trainer.max_steps=100 threads=1``) N times with ``keep_freed_memory=true`` and N times
with ``false``, alternating (A, B, B, A, ...; the data cache warmed by one untimed run first), and
prints per run and as paired ratios (true / false): the peak resident set the run logs
(``memory/peak_rss_gib``), the whole process's peak (``wait4``), the median ``throughput/step_ms``
and the wall time, with the load average at each start.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GLIBC_DEFAULT = 128 * 1024  # the documented initial mmap and trim thresholds


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds; each times both settings once, alternating which goes first")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per setting per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--runs", type=int, default=0,
                   help="pairs of whole default runs (keep_freed_memory true/false) instead of the in-process steps")
    p.add_argument("--override", action="append", default=None,
                   help="with --runs: a Hydra override of those runs (repeatable; default: trainer.max_steps=100 threads=1)")
    p.add_argument("--work", type=Path, default=None, help="with --runs: where the run directories go (default: a temp dir)")
    return p.parse_args()


def default_run(overrides: list[str], keep: bool, run_dir: Path) -> dict:
    """One ``python -m bnlit.train`` with ``keep_freed_memory=keep``: its logged and process peaks, the
    median logged step time and the wall time."""
    import csv

    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "bnlit.train", *overrides, f"keep_freed_memory={str(keep).lower()}",
           f"hydra.run.dir={run_dir}"]
    log = run_dir.parent / f"{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak resident set
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {proc.returncode}; its output: {log}")
    logged, steps = 0.0, []
    with (run_dir / "csv" / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            if row.get("memory/peak_rss_gib"):
                logged = max(logged, float(row["memory/peak_rss_gib"]))
            if row.get("throughput/step_ms"):
                steps.append(float(row["throughput/step_ms"]))
    return {"keep": keep, "load": load, "logged_gib": logged, "process_gib": usage.ru_maxrss / 2**20,
            "step_ms": statistics.median(steps) if steps else float("nan"), "wall_s": wall}


def compare_runs(pairs: int, overrides: list[str], work: Path) -> None:
    default_run(overrides, True, work / "warm")  # builds or finds the data; not counted
    results: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(pairs):
        for keep in ((True, False) if r % 2 == 0 else (False, True)):
            res = default_run(overrides, keep, work / f"run{r}-{keep}")
            results[keep].append(res)
            print(f"  keep_freed_memory={str(keep).lower():5}: peak RSS logged {res['logged_gib']:.2f} GiB, "
                  f"process {res['process_gib']:.2f} GiB; step {res['step_ms']:.0f} ms; wall {res['wall_s']:.0f} s; "
                  f"load at start {res['load']:.1f}", flush=True)
    print(f"python -m bnlit.train {' '.join(overrides)}: {pairs} pairs, load average now {os.getloadavg()[0]:.1f}")
    for key, name in (("logged_gib", "peak RSS logged"), ("process_gib", "peak RSS of the process"),
                      ("step_ms", "step time"), ("wall_s", "wall time")):
        ratios = [a[key] / b[key] for a, b in zip(results[True], results[False])]
        print(f"  {name} true / false: median {statistics.median(ratios):.2f}  pairs {' '.join(f'{v:.2f}' for v in ratios)}")


def main() -> None:
    args = parse_args()
    if args.runs:
        import tempfile

        overrides = args.override if args.override is not None else ["trainer.max_steps=100", "threads=1"]
        with tempfile.TemporaryDirectory() as tmp:
            compare_runs(args.runs, overrides, args.work or Path(tmp))
        return
    import torch  # after the arguments: --help answers without it
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import bnlit.resolvers  # noqa: F401
    from bnlit import CONF_DIR
    from bnlit.speed.host_malloc import KEEP_BYTES, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    from bnlit.module import next_token_loss, param_groups

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
