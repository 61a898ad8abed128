"""The document path before tokenizer training and shard building:
normalise -> filter -> deduplicate (exact, near; across sources) -> split -> decontaminate.

``clean_sources`` reads every source once and writes the kept documents of each source, in their
original order, to ``<out>/<name>.jsonl`` with ``stats.json`` beside them (the counts the data
report shows). Normalisation, filters and MinHash signatures run in worker processes; dedup lookups
run in the main process, first-seen wins. The validation split is the content hash of the
normalised text (:func:`bnlit.data.shards.is_validation`, the same rule the shard builder
applies), so dedup before the split means no near-copy straddles train and validation. Training
documents are then checked against the evaluation sets (the validation slices, one per
language, and the user's benchmark files) and dropped or flagged.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bnlit import progress
from bnlit.data import filters as F
from bnlit.data.decontam import DecontamConfig, Decontaminator
from bnlit.data.dedup import DedupConfig, Deduplicator, canonical_words, exact_key, signature
from bnlit.data.normalize import normalize_text
from bnlit.data.shards import char_chunks, is_validation, ordered_map
from bnlit.errors import ConfigError

log = logging.getLogger(__name__)
STATS_FILE = "stats.json"
CHUNK_CHARS = 2_000_000


@dataclass
class CleanConfig:
    """``data.clean``: which stages run and their settings (``filters: null`` switches filtering
    off; ``dedup.exact/near: false`` and ``decontam.enabled: false`` switch those off)."""

    enabled: bool = True
    normalize: bool = True
    filters: F.FilterConfig | None = field(default_factory=F.FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)

    @classmethod
    def from_dict(cls, d) -> "CleanConfig":
        if d is None:
            return cls(enabled=False)
        d = dict(d)
        known = {"enabled", "normalize", "filters", "dedup", "decontam"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"data.clean: unknown keys {unknown}; known: {sorted(known)}")
        return cls(enabled=d.get("enabled", True), normalize=d.get("normalize", True),
                   filters=None if "filters" in d and d["filters"] is None else F.FilterConfig.from_dict(d.get("filters")),
                   dedup=DedupConfig.from_dict(d.get("dedup")),
                   decontam=DecontamConfig.from_dict(d.get("decontam")))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "normalize": self.normalize,
                "filters": self.filters.to_dict() if self.filters else None,
                "dedup": self.dedup.to_dict(), "decontam": self.decontam.to_dict()}


def _prepare(task: tuple[list[str], str, CleanConfig]) -> list[tuple[str, str | None, int | None, object]]:
    """Worker: (normalised text, filter reason, exact key, MinHash signature) per document."""
    texts, language, cfg = task
    out = []
    for raw in texts:
        text = normalize_text(raw) if cfg.normalize else raw
        reason = F.filter_reason(text, language, cfg.filters) if cfg.filters else None
        if not text.strip():
            reason = "length:empty"
        if reason is not None:
            out.append((text, reason, None, None))
            continue
        ws = canonical_words(text)
        key = exact_key(ws) if cfg.dedup.exact else None
        sig = signature(ws, cfg.dedup) if cfg.dedup.near else None
        out.append((text, None, key, sig))
    return out


_decon: dict = {}


def _init_decon(decon: Decontaminator) -> None:
    _decon["d"] = decon


def _match(texts: list[str]) -> list[dict]:
    d = _decon["d"]
    return [d.matches(canonical_words(t)) for t in texts]


def _jsonl(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def read_clean(out_dir: str | os.PathLike, name: str) -> Iterator[str]:
    """The kept documents of source ``name`` from a finished :func:`clean_sources` directory."""
    for row in _jsonl(Path(out_dir) / f"{name}.jsonl"):
        yield row["text"]


def load_stats(out_dir: str | os.PathLike) -> dict | None:
    path = Path(out_dir) / STATS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def clean_sources(
    out_dir: str | os.PathLike,
    sources: list[tuple[str, str, Iterable[str]]],
    cfg: CleanConfig,
    val_fraction: float,
    eval_sets: dict[str, Iterable[str]] | None = None,
    num_proc: int = 1,
    total_bytes: int | None = None,
) -> dict:
    """Clean ``sources`` (name, language, documents) into ``out_dir`` unless already done;
    returns the stats (also in ``out_dir/stats.json``). ``total_bytes``: the UTF-8 size of the
    input, if known, for the progress bar's ETA."""
    out_dir = Path(out_dir)
    done = load_stats(out_dir)
    if done is not None:
        return done
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pool = mp.get_context("spawn").Pool(num_proc) if num_proc > 1 else None
    try:
        stats = _clean(tmp, sources, cfg, val_fraction, eval_sets or {}, pool, num_proc, total_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for name, st in stats["sources"].items():
        log.info("clean %s: kept %d of %d documents (filters %s, dedup exact %d near %d, decontam %d)", name,
                 st["kept_docs"], st["input_docs"], st["filters"]["docs"] or "{}", st["dedup"]["exact"],
                 st["dedup"]["near"], st["decontam"]["docs"])
    (tmp / STATS_FILE).write_text(json.dumps(stats, indent=2))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return load_stats(out_dir)


def _clean(tmp: Path, sources, cfg: CleanConfig, val_fraction: float, eval_sets, pool, num_proc: int,
           total_bytes: int | None = None) -> dict:
    dedup = Deduplicator(cfg.dedup)
    dc = cfg.decontam
    decon = Decontaminator(dc.ngram, dc.min_overlap) if dc.enabled else None
    per_source: dict[str, dict] = {}
    chunk_chars = CHUNK_CHARS // max(1, num_proc)
    # pass 1: normalise, filter, dedup, split; validation texts go into the evaluation index
    bar = progress.bar("clean: normalise, filter, dedup", total=total_bytes, unit="B", unit_scale=True)
    for name, language, docs in sources:
        fstats = F.FilterStats()
        s = per_source[name] = {"language": language, "input_docs": 0, "input_chars": 0, "normalized_changed": 0}
        raw_chunks: deque = deque()

        def tasks(docs=docs, language=language):
            for chunk in char_chunks(docs, chunk_chars):
                raw_chunks.append(chunk)
                yield chunk, language, cfg

        with (tmp / f"{name}.pass1.jsonl").open("w", encoding="utf-8") as f:
            for results in ordered_map(_prepare, tasks(), pool):
                for original, (text, reason, key, sig) in zip(raw_chunks.popleft(), results):
                    bar.update(len(original.encode("utf-8")))
                    s["input_docs"] += 1
                    s["input_chars"] += len(original)
                    s["normalized_changed"] += text != original
                    if reason is not None:
                        fstats.add(reason, len(text))
                        continue
                    if dedup.check(name, key, sig, len(text)) is not None:
                        continue
                    val = is_validation(text, val_fraction)
                    if val and decon is not None and dc.against_validation:
                        decon.add(f"val/{language}", text)
                    f.write(json.dumps({"text": text, "val": val}, ensure_ascii=False) + "\n")
        s["filters"] = fstats.to_dict()
    bar.close()
    decon_pool = None
    if decon is not None:
        for set_name, texts in eval_sets.items():
            for t in texts:
                decon.add(set_name, normalize_text(t) if cfg.normalize else t)
        decon.freeze()
        if num_proc > 1:
            decon_pool = mp.get_context("spawn").Pool(num_proc, initializer=_init_decon, initargs=(decon,))
        else:
            _init_decon(decon)
    # pass 2: decontaminate the training documents, write the kept documents in order
    bar = progress.bar("clean: decontaminate", total=sum(dedup_kept(tmp, n) for n, _, _ in sources))
    try:
        for name, _, _ in sources:
            _pass2(tmp, name, per_source[name], decon, dc, decon_pool, chunk_chars, bar)
    finally:
        bar.close()
        if decon_pool is not None:
            decon_pool.close()
            decon_pool.join()
    for name, s in per_source.items():
        s["dedup"] = {k: v.get(name, 0) for k, v in dedup.stats.to_dict().items()}
    return {
        "config": cfg.to_dict(),
        "val_fraction": val_fraction,
        "sources": per_source,
        "decontam": decon.summary() if decon is not None else {},
        # every training document sharing an n-gram with validation text was removed
        "validation_decontaminated": bool(decon is not None and dc.against_validation and dc.mode == "drop"),
    }


def dedup_kept(tmp: Path, name: str) -> int:
    """Documents of source ``name`` that passed pass 1 (lines of its pass-1 file)."""
    with (tmp / f"{name}.pass1.jsonl").open("rb") as f:
        return sum(1 for _ in f)


def _pass2(tmp: Path, name: str, s: dict, decon, dc: DecontamConfig, pool, chunk_chars: int, bar=None) -> None:
    s.update(kept_docs=0, kept_chars=0, decontam={"docs": 0, "chars": 0, "by_set": {}})
    src = tmp / f"{name}.pass1.jsonl"
    with (tmp / f"{name}.jsonl").open("w", encoding="utf-8") as f:
        for row, hits in _decontaminate(src, decon, pool, chunk_chars):
            if bar is not None:
                bar.update()
            if hits:
                s["decontam"]["docs"] += 1
                s["decontam"]["chars"] += len(row["text"])
                for h in hits:
                    s["decontam"]["by_set"][h] = s["decontam"]["by_set"].get(h, 0) + 1
                if dc.mode == "drop":
                    continue
            f.write(json.dumps({"text": row["text"]}, ensure_ascii=False) + "\n")
            s["kept_docs"] += 1
            s["kept_chars"] += len(row["text"])
    src.unlink()


def _decontaminate(path: Path, decon: Decontaminator | None, pool, chunk_chars: int):
    """Yield (row, [evaluation sets it is contaminated with]) for the rows of ``path``;
    validation rows are never checked (workers hold ``decon``, see ``_init_decon``)."""
    if decon is None:
        for row in _jsonl(path):
            yield row, []
        return
    train = char_chunks((r["text"] for r in _jsonl(path) if not r["val"]), chunk_chars)
    results = (m for ms in ordered_map(_match, train, pool) for m in ms)
    for row in _jsonl(path):
        if row["val"]:
            yield row, []
            continue
        yield row, decon.record(next(results), len(row["text"]))
