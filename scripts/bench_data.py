"""Data-path throughput: ``python scripts/bench_data.py [--procs 1 2] [--text FILE ...] [--json]``.

Measures, on the embedded corpus (or the given .txt/.jsonl/.parquet files, one language each via
``--lang``), the data build of bnlit/data/pipeline.py on datatrove's ``LocalPipelineExecutor``
with N workers and N pieces per source:

* **clean**: normalise -> filter -> exact + MinHash dedup -> 13-gram decontamination;
* **shards**: tokenization and the shard merge, with a tokenizer trained once beforehand (not
  timed), over ``--repeat`` copies of the text.

Each figure is wall time of a fresh build (worker start-up included) and is printed as MB/s of
raw UTF-8 text, MB/s per worker and tokens/s. ``h100_ratio`` is the shard build's tokens/s per
worker times 8, over the 150k tokens/s that one H100 trains a 400m model on: above 1 the data path
keeps up from 8 cores (a projection from the per-worker rate measured here, which assumes linear
scaling); ``end_to_end_h100_ratio`` does the same for cleaning plus tokenization per worker. The
host's core count and load are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bnlit.data import embedded
from bnlit.data.pipeline import CleanConfig, plan_data, run_local
from bnlit.data.sources import Source, fingerprint
from bnlit.tokenizer import Tokenizer, train_tokenizer

H100_TOKENS_PER_S = 150_000
CORES = 8


def load_corpus(args, work: Path) -> list[tuple[Source, Path]]:
    if not args.text:
        files = embedded.materialize(work / "embedded")
        return [(Source(name=lang, language=lang, path=str(files[lang])), files[lang]) for lang in ("bn", "en")]
    langs = args.lang or ["bn"] * len(args.text)
    return [(Source(name=f"s{i}", language=lang, path=path, field=f"--text[{i}]"), Path(path))
            for i, (path, lang) in enumerate(zip(args.text, langs))]


def repeated(sources: list[tuple[Source, Path]], n: int, work: Path) -> list[tuple[Source, Path]]:
    """Each source's file ``n`` times over, as JSONL (so the shard build has more to do)."""
    from bnlit.data.sources import iter_documents

    out = []
    for s, p in sources:
        path = work / f"{s.name}x{n}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            docs = list(iter_documents(s, p, cache_dir=str(work / "hf")))
            for _ in range(n):
                for d in docs:
                    f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        out.append((Source(name=s.name, language=s.language, path=str(path)), path))
    return out


def build(sources, clean: CleanConfig, cache: Path, tok: Path, n: int) -> dict[str, float]:
    plan = plan_data([s for s, _ in sources], [p for _, p in sources], [fingerprint(s, p) for s, p in sources], clean,
                     0.05, cache, {"path": str(tok), "vocab_size": Tokenizer(tok).vocab_size}, tasks=n)
    seconds: dict[str, float] = {}
    run_local(plan, workers=n, quiet=True, on_group=lambda group, s: seconds.update({group: s}))
    index = json.loads((plan.shard_dir() / "index.json").read_text())
    seconds["tokens"] = sum(e[s]["tokens"] for e in index["sources"].values() for s in ("train", "val"))
    return seconds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="worker counts to time, one build each")
    p.add_argument("--text", nargs="*", help="local files to benchmark on instead of the embedded corpus")
    p.add_argument("--lang", nargs="*", help="language of each --text file (all bn when not given)")
    p.add_argument("--repeat", type=int, default=3, help="copies of the corpus in the shard benchmark")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of the tokenizer trained (untimed) for the shard build")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bnlit_bench_data_"))
    sources = load_corpus(args, work)
    size = sum(p.stat().st_size for _, p in sources) / 1e6
    from bnlit.data.sources import iter_documents

    tok = train_tokenizer((d for s, p in sources for d in iter_documents(s, p, cache_dir=str(work / "hf"))),
                          work / "tok.model", vocab_size=args.vocab_size)
    big = repeated(sources, args.repeat, work)
    result = {"host_cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "corpus_mb": round(size, 3),
              "vocab_size": args.vocab_size, "clean": [], "shards": []}
    for n in args.procs:
        t = time.perf_counter()
        got = build(sources, CleanConfig(), work / f"clean{n}", tok, n)
        dt = got["clean"]
        result["clean"].append({"procs": n, "s": round(dt, 2), "mb_per_s": round(size / dt, 3),
                                "mb_per_s_per_proc": round(size / dt / n, 3), "wall_s": round(time.perf_counter() - t, 2)})
    big_mb = size * args.repeat
    for n in args.procs:
        got = build(big, CleanConfig(enabled=False), work / f"shards{n}", tok, n)
        dt, tokens = got["shards"], got["tokens"]
        per_proc = tokens / dt / n
        result["shards"].append({"procs": n, "s": round(dt, 2), "mb": round(big_mb, 3), "mb_per_s": round(big_mb / dt, 3),
                                 "mb_per_s_per_proc": round(big_mb / dt / n, 3), "tokens_per_s": round(tokens / dt),
                                 "h100_ratio": round(per_proc * CORES / H100_TOKENS_PER_S, 2)})
    for c, sh in zip(result["clean"], result["shards"]):
        sec_per_mb = 1 / c["mb_per_s_per_proc"] + 1 / sh["mb_per_s_per_proc"]
        tokens_per_mb = sh["tokens_per_s"] / sh["mb_per_s"]
        sh["end_to_end_h100_ratio"] = round(tokens_per_mb / sec_per_mb * CORES / H100_TOKENS_PER_S, 2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"host: {result['host_cpus']} CPUs, load {result['load_avg_1m']:.2f}; corpus {size:.2f} MB; vocab {args.vocab_size}")
        for row in result["clean"]:
            print(f"clean   workers={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per worker, {row['s']} s)")
        for row in result["shards"]:
            print(f"shards  workers={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per worker), "
                  f"{row['tokens_per_s']:,} tokens/s; 8 cores / H100 150k tokens/s = {row['h100_ratio']:.2f}x "
                  f"(clean + tokenize: {row['end_to_end_h100_ratio']:.2f}x)")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
