"""Data-path throughput: ``python scripts/bench_data.py [--procs 1 2] [--text FILE ...] [--json]``.

Measures, on the embedded corpus (or the given .txt/.jsonl/.parquet files, one language each via
``--lang``), with 1..N worker processes:

* **clean**: normalise -> filter -> exact + MinHash dedup -> 13-gram decontamination
  (:func:`bnlit.data.pipeline.clean_sources`);
* **shards**: tokenization and the chunked shard write (:func:`bnlit.data.shards.build_shards`)
  with a tokenizer trained once beforehand (not timed), over ``--repeat`` copies of the text.

Each figure is wall time of a fresh build (worker start-up included) and is printed as MB/s of
raw UTF-8 text, MB/s per process and tokens/s. ``h100_ratio`` is the shard build's tokens/s per
process times 8, over the 150k tokens/s that one H100 trains a 400m model on: above 1 the data
path keeps up from 8 cores (a projection from the per-process rate measured here, which assumes
the linear scaling the ``procs`` rows show); ``end_to_end_h100_ratio`` does the same for cleaning
plus tokenization per process. The host's core count and load are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

H100_TOKENS_PER_S = 150_000
CORES = 8


def load_corpus(args) -> list[tuple[str, str, list[str]]]:
    from bnlit.data import embedded
    from bnlit.data.sources import Source, iter_documents

    if not args.text:
        return [("bn", "bn", embedded.bangla_documents()), ("en", "en", embedded.english_documents())]
    langs = args.lang or ["bn"] * len(args.text)
    out = []
    for i, (path, lang) in enumerate(zip(args.text, langs)):
        src = Source(name=f"s{i}", language=lang, path=path, field=f"--text[{i}]")
        out.append((src.name, lang, list(iter_documents(src, Path(path), cache_dir=tempfile.mkdtemp()))))
    return out


def mb(corpus) -> float:
    return sum(len(d.encode("utf-8")) for _, _, docs in corpus for d in docs) / 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="worker-process counts to time, one build each")
    p.add_argument("--text", nargs="*", help="local files to benchmark on instead of the embedded corpus")
    p.add_argument("--lang", nargs="*", help="language of each --text file (all bn when not given)")
    p.add_argument("--repeat", type=int, default=3, help="copies of the corpus in the shard benchmark")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of the tokenizer trained (untimed) for the shard build")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    from bnlit.data.pipeline import CleanConfig, clean_sources  # after the arguments: --help answers without torch
    from bnlit.data.shards import build_shards
    from bnlit.tokenizer import Tokenizer, train_tokenizer

    corpus = load_corpus(args)
    size = mb(corpus)
    work = Path(tempfile.mkdtemp(prefix="bnlit_bench_data_"))
    tok = Tokenizer(train_tokenizer((d for _, _, docs in corpus for d in docs), work / "tok.model",
                                    vocab_size=args.vocab_size))
    result = {"host_cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "corpus_mb": round(size, 3),
              "vocab_size": args.vocab_size, "clean": [], "shards": []}
    for n in args.procs:
        t = time.perf_counter()
        clean_sources(work / f"clean{n}", corpus, CleanConfig(), 0.05, num_proc=n)
        dt = time.perf_counter() - t
        result["clean"].append({"procs": n, "s": round(dt, 2), "mb_per_s": round(size / dt, 3),
                                "mb_per_s_per_proc": round(size / dt / n, 3)})
    big = [(name, lang, docs * args.repeat) for name, lang, docs in corpus]
    big_mb = size * args.repeat
    for n in args.procs:
        t = time.perf_counter()
        out = build_shards(work / f"shards{n}", big, [f"bench{n}-{i}" for i in range(len(big))], tok, 0.05, num_proc=n)
        dt = time.perf_counter() - t
        index = json.loads((out / "index.json").read_text())
        tokens = sum(e[s]["tokens"] for e in index["sources"].values() for s in ("train", "val"))
        per_proc = tokens / dt / n
        result["shards"].append({"procs": n, "s": round(dt, 2), "mb": round(big_mb, 3), "mb_per_s": round(big_mb / dt, 3),
                                 "mb_per_s_per_proc": round(big_mb / dt / n, 3), "tokens_per_s": round(tokens / dt),
                                 "h100_ratio": round(per_proc * CORES / H100_TOKENS_PER_S, 2)})
    # the whole data path (clean + tokenize) per process, from the same-procs rows
    for c, sh in zip(result["clean"], result["shards"]):
        sec_per_mb = 1 / c["mb_per_s_per_proc"] + 1 / sh["mb_per_s_per_proc"]
        tokens_per_mb = sh["tokens_per_s"] / sh["mb_per_s"]
        sh["end_to_end_h100_ratio"] = round(tokens_per_mb / sec_per_mb * CORES / H100_TOKENS_PER_S, 2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"host: {result['host_cpus']} CPUs, load {result['load_avg_1m']:.2f}; corpus {size:.2f} MB; vocab {args.vocab_size}")
        for row in result["clean"]:
            print(f"clean   procs={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per process, {row['s']} s)")
        for row in result["shards"]:
            print(f"shards  procs={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per process), "
                  f"{row['tokens_per_s']:,} tokens/s; 8 cores / H100 150k tokens/s = {row['h100_ratio']:.2f}x "
                  f"(clean + tokenize: {row['end_to_end_h100_ratio']:.2f}x)")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
