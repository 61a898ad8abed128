"""Deduplication throughput and peak memory, the in-memory dedup bnlit used before datatrove
against the datatrove stages that replaced it, side by side in one run:
``python scripts/bench_dedup.py [--synthetic-mb 200] [--tasks 4] [--repeats 2] [--json]``.

Corpora: the embedded corpus (normalised, as the dedup stage sees it) and a synthetic
multi-source corpus of ``--synthetic-mb`` MB (4 sources, 3 Bangla and 1 English; documents of
random real Bangla words from the embedded books and English words from the embedded addresses,
with 4% exact and 4% near copies planted within and across sources). Each source is cut into
``--tasks`` pieces, written as one JSONL file per piece; both variants read the same files.

* **before** (bnlit <= the datatrove switch): one process reads every document, computes its
  exact key and datasketch MinHash, and checks and inserts them into an in-memory exact-key
  dict and ``MinHashLSH`` index (first seen wins): memory grows with the corpus.
* **datatrove**: bnlit's stages on datatrove's ``LocalPipelineExecutor`` with one worker:
  exact and MinHash signatures per task, datatrove's exact finder and MinHash buckets, bnlit's
  first-seen clustering, datatrove's exact and MinHash filters, kept documents written back.

Both run in a fresh process each (A, B, A, B for ``--repeats``); the script checks that they keep
exactly the same documents, then prints MB/s per worker (input UTF-8 MB over wall seconds, one
worker) and the peak resident memory of the process (``VmHWM``), with the ratios, the
host's cores and its load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = r"""
import json, os, resource, sys, time
sys.path.insert(0, {script_dir!r})
from bench_dedup import run_before, run_datatrove
t = time.perf_counter()
kept = {fn}({inp!r}, {out!r}, {tasks})
dt = time.perf_counter() - t
# VmHWM: this process's own peak (one worker: everything runs here). Not ru_maxrss: Linux carries
# the forking parent's high-water mark across exec into RUSAGE_SELF, and the parent holds the corpus.
try:
    peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
except (OSError, IndexError):
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({{"seconds": dt, "peak_mb": peak / 1024, "kept": kept}}))
"""


def write_pieces(sources: list[tuple[str, list[str]]], tasks: int, directory: Path) -> int:
    """Each source's documents in ``tasks`` contiguous pieces, ``<rank>.jsonl`` in source order;
    returns the UTF-8 bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    rank, size = 0, 0
    for _, docs in sources:
        n = len(docs)
        for j in range(tasks):
            with (directory / f"{rank:05d}.jsonl").open("w", encoding="utf-8") as f:
                for d in docs[n * j // tasks:n * (j + 1) // tasks]:
                    f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
                    size += len(d.encode("utf-8"))
            rank += 1
    return size


def embedded_corpus() -> list[tuple[str, list[str]]]:
    from bnlit.data import embedded
    from bnlit.data.normalize import normalize_text

    return [("bn", [normalize_text(d) for d in embedded.bangla_documents()]),
            ("en", [normalize_text(d) for d in embedded.english_documents()])]


def synthetic_corpus(mb: float, seed: int = 0) -> list[tuple[str, list[str]]]:
    from bnlit.data import embedded
    from bnlit.data.dedup import canonical_words

    rng = random.Random(seed)
    bn_words = sorted({w for d in embedded.bangla_documents()[:40] for w in canonical_words(d) if len(w) > 1})
    en_words = sorted({w for d in embedded.english_documents()[:200] for w in canonical_words(d) if w.isalpha()})
    target = mb * 1e6 / 4
    sources = []
    all_docs: list[str] = []
    for i, (lang, words, end) in enumerate((("bn", bn_words, "।"), ("bn", bn_words, "।"), ("bn", bn_words, "।"),
                                            ("en", en_words, "."))):
        docs, size = [], 0
        while size < target:
            r = rng.random()
            if all_docs and r < 0.04:  # an exact copy of an earlier document, this source or another
                d = rng.choice(all_docs)
            elif all_docs and r < 0.08:  # a near copy: one word changed
                w = rng.choice(all_docs).split(" ")
                w[len(w) // 2] = rng.choice(words)
                d = " ".join(w)
            else:
                lines = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 16))) + end for _ in range(rng.randint(15, 30))]
                d = "\n".join(lines)
            docs.append(d)
            all_docs.append(d)
            size += len(d.encode("utf-8"))
        sources.append((f"s{i}_{lang}", docs))
    return sources


def _texts(inp: str):
    for path in sorted(Path(inp).glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def run_before(inp: str, out: str, tasks: int) -> int:
    """The in-memory dedup of bnlit before datatrove (its Deduplicator, abridged: exact key dict
    and datasketch MinHashLSH of kept documents, first seen wins)."""
    import hashlib

    from datasketch import MinHash, MinHashLSH

    from bnlit.data.dedup import DedupConfig, canonical_words, signature

    cfg = DedupConfig()
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    exact: set[int] = set()
    n = kept = 0
    with open(Path(out) / "kept.jsonl", "w", encoding="utf-8") as f:
        for text in _texts(inp):
            ws = canonical_words(text)
            key = int.from_bytes(hashlib.blake2b(" ".join(ws).encode(), digest_size=8).digest(), "little")
            if key in exact:
                continue
            m = MinHash(num_perm=cfg.num_perm, seed=1, hashvalues=signature(ws, cfg), scheme="affine32")
            if lsh.query(m):
                continue
            lsh.insert(n, m, check_duplication=False)
            n += 1
            exact.add(key)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            kept += 1
    return kept


def run_datatrove(inp: str, out: str, tasks: int) -> int:
    """bnlit's dedup stages on datatrove (bnlit/data/pipeline.py), one worker."""
    from datatrove.executor.local import LocalPipelineExecutor
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter, ExactFindDedups
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupFilter
    from datatrove.pipeline.writers.jsonl import JsonlWriter
    from loguru import logger

    from bnlit.data import steps as S
    from bnlit.data.dedup import DedupConfig, lsh_bands

    logger.remove()
    cfg = DedupConfig()
    bands = lsh_bands(cfg)[0]
    ranks = len(list(Path(inp).glob("*.jsonl")))
    W = Path(out)
    stages = [
        ([S.RankReader(inp), S.ExactSignature(str(W / "exact/sigs"), bands), S.MinhashSignature(str(W / "mh/sigs"), cfg)], ranks),
        ([ExactFindDedups(str(W / "exact/sigs"), str(W / "exact/dups"), config=S.exact_config()),
          MinhashDedupBuckets(str(W / "mh/sigs"), str(W / "mh/buckets"), config=S.minhash_config(cfg))], bands),
        ([S.FirstSeenCluster(str(W / "mh/buckets"), str(W / "mh/remove"), bands, ranks, list(range(ranks)),
                             str(W / "exact/dups"))], 1),
        ([S.RankReader(inp), ExactDedupFilter(str(W / "exact/dups"), config=S.exact_config()),
          MinhashDedupFilter(str(W / "mh/remove")),
          JsonlWriter(str(W / "kept"), output_filename="${rank}.jsonl", compression=None, adapter=S.text_only)], ranks),
    ]
    prev = None
    for i, (pipeline, n) in enumerate(stages):
        prev = LocalPipelineExecutor(pipeline, tasks=n, workers=1, logging_dir=str(W / f"logs{i}"), depends=prev)
        prev.run()
    return sum(1 for _ in _texts(str(W / "kept")))


def measure(fn: str, inp: Path, work: Path, tasks: int) -> dict:
    out = work / f"out-{fn}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    code = RUN.format(script_dir=str(Path(__file__).parent), fn=fn, inp=str(inp), out=str(out), tasks=tasks)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{fn} failed: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kept = sorted(_texts(str(out / "kept")) if (out / "kept").is_dir() else _texts_file(out / "kept.jsonl"))
    result["kept_sha"] = hash(tuple(kept))
    shutil.rmtree(out, ignore_errors=True)
    return result


def _texts_file(path: Path):
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def bench(name: str, sources, tasks: int, repeats: int, work: Path) -> dict:
    inp = work / f"in-{name}"
    size = write_pieces(sources, tasks, inp)
    runs = {"run_before": [], "run_datatrove": []}
    for _ in range(repeats):  # A, B, A, B
        for fn in runs:
            runs[fn].append(measure(fn, inp, work, tasks))
    shas = {r["kept_sha"] for rs in runs.values() for r in rs}
    if len(shas) != 1:
        raise AssertionError(f"{name}: the two dedups kept different documents")
    mb = size / 1e6
    row = {"corpus": name, "mb": round(mb, 1), "docs": sum(len(d) for _, d in sources), "tasks": tasks * len(sources),
           "kept": runs["run_before"][0]["kept"]}
    for fn, key in (("run_before", "before"), ("run_datatrove", "datatrove")):
        s = statistics.median(r["seconds"] for r in runs[fn])
        row[f"{key}_mb_per_s_per_worker"] = round(mb / s, 3)
        row[f"{key}_peak_mb"] = round(max(r["peak_mb"] for r in runs[fn]), 1)
    ratios = [b["seconds"] / d["seconds"] for b, d in zip(runs["run_before"], runs["run_datatrove"])]
    row["speed_ratio_datatrove_over_before"] = round(statistics.median(ratios), 3)
    row["peak_memory_ratio_datatrove_over_before"] = round(row["datatrove_peak_mb"] / row["before_peak_mb"], 3)
    shutil.rmtree(inp, ignore_errors=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--synthetic-mb", type=float, default=200, help="size of the synthetic corpus (0: skip it)")
    p.add_argument("--tasks", type=int, default=4, help="pieces per source")
    p.add_argument("--repeats", type=int, default=2, help="A/B pairs per corpus")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bnlit_bench_dedup_"))
    result = {"host_cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "rows": []}
    try:
        result["rows"].append(bench("embedded", embedded_corpus(), args.tasks, args.repeats, work))
        if args.synthetic_mb > 0:
            t = time.perf_counter()
            corpus = synthetic_corpus(args.synthetic_mb)
            result["synthetic_generation_s"] = round(time.perf_counter() - t, 1)
            result["rows"].append(bench(f"synthetic {args.synthetic_mb:g} MB", corpus, args.tasks, args.repeats, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_avg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"host: {result['host_cpus']} CPUs; load average at start {result['load_avg_start'][0]:.2f}, "
          f"at end {result['load_avg_end'][0]:.2f}; one worker each; medians of {args.repeats} A/B pairs")
    cols = ["corpus", "mb", "docs", "tasks", "kept", "before_mb_per_s_per_worker", "datatrove_mb_per_s_per_worker",
            "speed_ratio_datatrove_over_before", "before_peak_mb", "datatrove_peak_mb",
            "peak_memory_ratio_datatrove_over_before"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in result["rows"]:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
