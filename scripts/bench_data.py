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
host's core count and its load average at the start and the end are printed with it.

**Memory**, per stage (:mod:`bnlit.speed.tree_memory`, Linux): the peak PSS of the process tree
(this process, the forkserver and the stage's workers; with one worker the stage runs in this
process) and the largest peak RSS of one process, next to the tree's baseline before the build.
``dedup peak`` is the largest of the dedup stages (``dedup_find``, ``dedup_cluster``, ``dedup``).

``--repeats R`` times each worker count R times, alternating (1, 2, 1, 2, ...), and prints the
median of the paired ratios (MB/s with N workers over MB/s with the first count).

``--synthetic-mb X`` builds, instead of reading the embedded corpus as it is, a multi-source corpus
of X MB from it (3 Bangla sources and 1 English, :func:`synthetic_corpus`): documents of random
spans of the embedded pages, their words shuffled, with ``--duplicates`` of them exact copies and as many near copies
(one word in 100 changed) of earlier documents, within and across sources; the tokenizer is
trained (untimed) on its first ``--tokenizer-mb`` MB.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bnlit.data import embedded
from bnlit.data.pipeline import CleanConfig, load_stats, plan_data, run_local
from bnlit.data.sources import Source, fingerprint
from bnlit.speed import tree_memory
from bnlit.tokenizer import Tokenizer, train_tokenizer

H100_TOKENS_PER_S = 150_000
CORES = 8


def synthetic_corpus(mb: float, work: Path, duplicates: float = 0.05, seed: int = 0) -> tuple[list[tuple[Source, Path]], dict]:
    """A corpus of about ``mb`` MB (UTF-8) in 4 JSONL sources, 3 Bangla and 1 English, derived
    from the embedded corpus: each document is 4-12 lines, each line a random span of 25-60
    words of a random embedded page (Bangla) or address paragraph (English) in shuffled order.
    The embedded text is reused ~12 times over at 200 MB; the shuffle keeps two documents from
    sharing word 5- and 13-grams by chance (unshuffled, 76% of the documents shared 13-grams
    with the validation split and were dropped as contaminated), so what dedup removes is
    what was planted. A ``duplicates`` share of the documents are exact copies, and as many
    are near copies (one word in 100 replaced, at least one: word 5-gram Jaccard ~0.9), of an
    earlier document of any source. Returns the sources and what was planted."""
    rng = random.Random(seed)
    bn = [p.split() for b in embedded.bangla_documents() for p in b.split("\n") if len(p.split()) > 60]
    en = [d.split() for d in embedded.english_documents() if len(d.split()) > 60]
    target = mb * 1e6 / 4
    pool: list[str] = []  # earlier documents to copy from (a bounded reservoir)
    planted = {"documents": 0, "exact_copies": 0, "near_copies": 0}
    out = []
    (work / "synthetic").mkdir(parents=True, exist_ok=True)
    for i, (lang, pages) in enumerate((("bn", bn), ("bn", bn), ("bn", bn), ("en", en))):
        path = work / "synthetic" / f"s{i}_{lang}.jsonl"
        size = 0
        with path.open("w", encoding="utf-8") as f:
            while size < target:
                r = rng.random()
                if pool and r < duplicates:
                    d = rng.choice(pool)
                    planted["exact_copies"] += 1
                elif pool and r < 2 * duplicates:
                    w = rng.choice(pool).split(" ")
                    for j in rng.sample(range(len(w)), max(1, len(w) // 100)):
                        w[j] = rng.choice(rng.choice(pages))
                    d = " ".join(w)
                    planted["near_copies"] += 1
                else:
                    lines = []
                    for _ in range(rng.randint(4, 12)):
                        ws, k = rng.choice(pages), rng.randint(25, 60)
                        start = rng.randrange(len(ws) - k)
                        span = ws[start:start + k]
                        rng.shuffle(span)  # reused text: no long n-gram shared by chance (dedup, decontamination)
                        lines.append(" ".join(span))
                    d = "\n".join(lines)
                if len(pool) < 5000:
                    pool.append(d)
                else:
                    pool[rng.randrange(5000)] = d
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
                size += len(d.encode("utf-8"))
                planted["documents"] += 1
        out.append((Source(name=f"s{i}_{lang}", language=lang, path=str(path)), path))
    return out, planted


def load_corpus(args, work: Path) -> list[tuple[Source, Path]]:
    if args.synthetic_mb:
        sources, args.planted = synthetic_corpus(args.synthetic_mb, work, args.duplicates)
        return sources
    if not args.text:
        files = embedded.materialize(work / "embedded")
        return [(Source(name=lang, language=lang, path=str(files[lang])), files[lang]) for lang in ("bn", "en")]
    langs = args.lang or ["bn"] * len(args.text)
    return [(Source(name=f"s{i}", language=lang, path=path, field=f"--text[{i}]"), Path(path))
            for i, (path, lang) in enumerate(zip(args.text, langs))]


def repeated(sources: list[tuple[Source, Path]], n: int, work: Path) -> list[tuple[Source, Path]]:
    """Each source's file ``n`` times over, as JSONL (so the shard build has more to do)."""
    from bnlit.data.sources import iter_documents

    if n == 1:
        return sources
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


def build(sources, clean: CleanConfig, cache: Path, tok: Path, n: int) -> dict:
    """One fresh build with ``n`` workers: seconds per group (clean, shards), tokens, and each
    stage's seconds and peak memory."""
    plan = plan_data([s for s, _ in sources], [p for _, p in sources], [fingerprint(s, p) for s, p in sources], clean,
                     0.05, cache, {"path": str(tok), "vocab_size": Tokenizer(tok).vocab_size}, tasks=n)
    out: dict = {"stages": []}
    measure = tree_memory.supported()
    mem = tree_memory.TreeMemory().start() if measure else None

    def on_stage(name: str, s: float) -> None:
        row = {"stage": name, "s": round(s, 2)}
        out["stages"].append({**row, **mem.mark()} if mem else row)

    try:
        run_local(plan, workers=n, quiet=True, on_group=lambda group, s: out.update({group: s}), on_stage=on_stage)
    finally:
        if mem:
            mem.stop()
    out["baseline_mb"] = round(mem.baseline_mb, 1) if mem else None
    dedup = [r for r in out["stages"] if r["stage"].startswith("dedup") and "tree_mb" in r]
    out["dedup_peak_mb"] = max((r["tree_mb"] for r in dedup), default=None)
    out["dedup_largest_mb"] = max((r["largest_mb"] for r in dedup), default=None)
    index = json.loads((plan.shard_dir() / "index.json").read_text())
    out["tokens"] = sum(e[s]["tokens"] for e in index["sources"].values() for s in ("train", "val"))
    out["clean_stats"] = load_stats(plan.clean_dir) if plan.clean_dir else None
    return out


def _mb(x) -> str:
    return "n/a" if x is None else f"{x:,.0f} MB"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="worker counts to time, one build each")
    p.add_argument("--repeats", type=int, default=1, help="builds per worker count, alternating between the counts")
    p.add_argument("--text", nargs="*", help="local files to benchmark on instead of the embedded corpus")
    p.add_argument("--lang", nargs="*", help="language of each --text file (all bn when not given)")
    p.add_argument("--synthetic-mb", type=float, default=0,
                   help="benchmark on a multi-source corpus of this many MB derived from the embedded one (0: off)")
    p.add_argument("--duplicates", type=float, default=0.05,
                   help="with --synthetic-mb: share of documents planted as exact copies (and as many near copies)")
    p.add_argument("--repeat", type=int, default=3, help="copies of the corpus in the shard benchmark")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of the tokenizer trained (untimed) for the shard build")
    p.add_argument("--tokenizer-mb", type=float, default=20, help="MB of the corpus the (untimed) tokenizer is trained on")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.synthetic_mb and args.text:
        p.error("--synthetic-mb and --text: give one of them")
    work = Path(tempfile.mkdtemp(prefix="bnlit_bench_data_"))
    load_start = os.getloadavg()
    t = time.perf_counter()
    sources = load_corpus(args, work)
    gen_s = time.perf_counter() - t
    size = sum(p.stat().st_size for _, p in sources) / 1e6
    from bnlit.data.sources import iter_documents

    budget = [args.tokenizer_mb * 1e6]

    def within_budget(doc: str) -> bool:
        budget[0] -= len(doc.encode("utf-8"))
        return budget[0] > 0

    # round-robin over the sources, so a cut-off tokenizer text still has every language
    docs = (d for group in itertools.zip_longest(*(iter_documents(s, p, cache_dir=str(work / "hf")) for s, p in sources))
            for d in group if d is not None)
    tok = train_tokenizer(itertools.takewhile(within_budget, docs), work / "tok.model", vocab_size=args.vocab_size)
    big = repeated(sources, args.repeat, work)
    result = {"host_cpus": os.cpu_count(), "load_avg_start": [round(x, 2) for x in load_start], "corpus_mb": round(size, 3),
              "sources": [s.name for s, _ in sources], "vocab_size": args.vocab_size, "clean": [], "shards": []}
    if args.synthetic_mb:
        result.update(synthetic_mb=args.synthetic_mb, planted=args.planted, generation_s=round(gen_s, 1))
    order = [n for _ in range(args.repeats) for n in args.procs]  # 1, 2, 1, 2, ...
    for i, n in enumerate(order):
        t = time.perf_counter()
        got = build(sources, CleanConfig(), work / f"clean{i}", tok, n)
        dt = got["clean"]
        result["clean"].append({"procs": n, "s": round(dt, 2), "mb_per_s": round(size / dt, 3),
                                "mb_per_s_per_proc": round(size / dt / n, 3), "wall_s": round(time.perf_counter() - t, 2),
                                "baseline_mb": got["baseline_mb"], "dedup_peak_mb": got["dedup_peak_mb"],
                                "dedup_largest_mb": got["dedup_largest_mb"], "stages": got["stages"],
                                "stats": got["clean_stats"]})
        shutil.rmtree(work / f"clean{i}", ignore_errors=True)
    big_mb = size * args.repeat
    for i, n in enumerate(order):
        got = build(big, CleanConfig(enabled=False), work / f"shards{i}", tok, n)
        dt, tokens = got["shards"], got["tokens"]
        per_proc = tokens / dt / n
        result["shards"].append({"procs": n, "s": round(dt, 2), "mb": round(big_mb, 3), "mb_per_s": round(big_mb / dt, 3),
                                 "mb_per_s_per_proc": round(big_mb / dt / n, 3), "tokens_per_s": round(tokens / dt),
                                 "h100_ratio": round(per_proc * CORES / H100_TOKENS_PER_S, 2),
                                 "baseline_mb": got["baseline_mb"], "stages": got["stages"]})
        shutil.rmtree(work / f"shards{i}", ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    for c, sh in zip(result["clean"], result["shards"]):
        sec_per_mb = 1 / c["mb_per_s_per_proc"] + 1 / sh["mb_per_s_per_proc"]
        tokens_per_mb = sh["tokens_per_s"] / sh["mb_per_s"]
        sh["end_to_end_h100_ratio"] = round(tokens_per_mb / sec_per_mb * CORES / H100_TOKENS_PER_S, 2)
    k = len(args.procs)
    for part in ("clean", "shards"):  # paired ratios: run i of count n against run i of the first count
        runs = result[part]
        result[f"{part}_speedup"] = {
            n: round(statistics.median(runs[r * k + j]["mb_per_s"] / runs[r * k]["mb_per_s"] for r in range(args.repeats)), 3)
            for j, n in enumerate(args.procs)}
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"host: {result['host_cpus']} CPUs, load average {load_start[0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end; "
          f"corpus {size:.2f} MB in {len(sources)} sources; vocab {args.vocab_size}")
    if args.synthetic_mb:
        pl = args.planted
        print(f"synthetic: {pl['documents']:,} documents, {pl['exact_copies']:,} exact and {pl['near_copies']:,} near copies "
              f"planted ({gen_s:.0f} s to generate)")
    for row in result["clean"]:
        print(f"clean   workers={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per worker, {row['s']} s); "
              f"dedup peak {_mb(row['dedup_peak_mb'])} (process tree, baseline {_mb(row['baseline_mb'])}; "
              f"largest process {_mb(row['dedup_largest_mb'])})")
        print("        " + "; ".join(_stage(r) for r in row["stages"]))
        if row["stats"]:
            print("        " + _removed(row["stats"]))
    for row in result["shards"]:
        print(f"shards  workers={row['procs']}: {row['mb_per_s']:.2f} MB/s ({row['mb_per_s_per_proc']:.2f} MB/s per worker), "
              f"{row['tokens_per_s']:,} tokens/s; 8 cores / H100 150k tokens/s = {row['h100_ratio']:.2f}x "
              f"(clean + tokenize: {row['end_to_end_h100_ratio']:.2f}x)")
        print("        " + "; ".join(_stage(r) for r in row["stages"]))
    for part in ("clean", "shards"):
        print(f"{part} MB/s over workers={args.procs[0]} (median of {args.repeats} paired): "
              + ", ".join(f"workers={n}: {v:.2f}x" for n, v in result[f"{part}_speedup"].items()))
    return result


def _removed(stats: dict) -> str:
    """What the clean build removed, from its stats.json."""
    src = stats["sources"].values()
    total = lambda f: sum(f(v) for v in src)  # noqa: E731
    return (f"{total(lambda v: v['input_docs']):,} documents in, {total(lambda v: v['kept_docs']):,} kept; removed: "
            f"{total(lambda v: sum(v['filters']['docs'].values())):,} by the filters, "
            f"{total(lambda v: v['dedup']['exact']):,} exact and {total(lambda v: v['dedup']['near']):,} near copies, "
            f"{total(lambda v: v['decontam']['docs']):,} sharing 13-grams with validation")


def _stage(r: dict) -> str:
    mem = f", peak {_mb(r['tree_mb'])} tree / {_mb(r['largest_mb'])} largest" if "tree_mb" in r else ""
    return f"{r['stage']} {r['s']} s{mem}"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
