"""bnlit's data stages as datatrove pipeline steps: thin adapters over the pure functions of
:mod:`~bnlit.data.sources`, :mod:`~bnlit.data.normalize`, :mod:`~bnlit.data.filters`,
:mod:`~bnlit.data.dedup`, :mod:`~bnlit.data.decontam` and :mod:`~bnlit.data.shards`.

Every parallel stage runs one task per *piece*: a contiguous slice of one source, pieces ordered
by source then by position (:class:`~bnlit.data.sources.Piece`). So task order is document
order, and "the first copy wins" across tasks is "lower rank wins, then lower index in the task".
datatrove's own blocks do the generic work (exact-dedup signatures, hash-range finders and
filters, MinHash buckets and filter, JSONL readers and writers, per-task statistics); the steps
here carry what is bnlit's: the readers of its source kinds, its normalisation and Bangla
filters, its MinHash signature (canonical words, word shingles, datasketch's ``affine32``
permutations, the LSH bands datasketch picks for the threshold), the first-seen clustering, the
validation split, decontamination and its token-shard format. :mod:`bnlit.data.pipeline` puts
them in order.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
import xxhash
from datatrove.data import Document, DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupSignature
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.readers.base import BaseReader
from datatrove.pipeline.readers.jsonl import JsonlReader
from datatrove.utils.binaryio import read_tuples_from_file
from datatrove.utils.hashing import HashConfig
from datatrove.utils.typeshelper import ExtensionHelperSD, StatHints
from datatrove.utils.word_tokenizers import WordTokenizer

from bnlit import storage
from bnlit.data import filters as F
from bnlit.data.dedup import DedupConfig, canonical_words, lsh_bands, minhash_values, shingles
from bnlit.data.normalize import normalize_text
from bnlit.data.ocr_debris import STATS as DEBRIS_STATS
from bnlit.data.ocr_debris import OcrDebrisConfig, clean_ocr_debris
from bnlit.data.sources import Piece, iter_documents

log = logging.getLogger(__name__)
STATS_FILE = "stats.json"  # a finished cleaning's statistics: its presence marks the cleaning done
PRIORITY_MAX = 65535  # datatrove's exact dedup keeps the highest 16-bit priority of a duplicate group


def docs_file(rank: int) -> str:
    """The JSONL file a task writes (datatrove's ``${rank}`` naming)."""
    return f"{rank:05d}.jsonl"


def text_only(self, document: Document) -> dict:
    """JSONL writer adapter: the text alone (the task's rank says where it came from)."""
    return {"text": document.text}


class SourceReader(BaseReader):
    """Reads the piece of a source that this task's rank names (``pieces[rank]``)."""

    name = "📖 bnlit source"

    def __init__(self, pieces: list[Piece], cache_dir: str | None = None):
        super().__init__()
        self.pieces = pieces
        self.cache_dir = cache_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        p = self.pieces[rank]
        with self.track_time():
            docs = iter_documents(p.source, p.path, cache_dir=self.cache_dir, piece=p.index, pieces=p.of)
        for i, text in enumerate(docs):
            doc = Document(text=text, id=f"{p.source.name}/{p.index}/{i}", metadata={"language": p.source.language})
            self.stat_update("documents")
            self.update_doc_stats(doc)
            yield doc


class RankReader(JsonlReader):
    """datatrove's JSONL reader on exactly this task's file of an earlier stage (a task that
    kept nothing wrote no file), so document indices line up with that stage's."""

    name = "📖 bnlit stage output"

    def __init__(self, data_folder: str, language_of: list[str] | None = None):
        super().__init__(data_folder, compression=None, add_file_path=False)
        self.language_of = language_of

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        name = docs_file(rank)
        if not self.data_folder.exists(name):
            return
        for doc in self.read_files_shard([name]):
            if self.language_of is not None:
                doc.metadata["language"] = self.language_of[rank]
            self.update_doc_stats(doc)
            yield doc


class Normalize(PipelineStep):
    """:func:`bnlit.data.normalize.normalize_text` on every document."""

    type = "✂️ - FORMAT"
    name = "🔤 bnlit normalize"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            with self.track_time():
                text = normalize_text(doc.text)
                if text != doc.text:
                    self.stat_update("changed")
                doc.text = text
            yield doc


class OcrDebris(PipelineStep):
    """:func:`bnlit.data.ocr_debris.clean_ocr_debris` on the documents of ``cfg.languages``: debris
    pages dropped, page-edge numbers stripped. Counts the pages seen, dropped and their characters,
    the tokens stripped and their characters, and the characters in and out of the documents it
    checks (an emptied document goes on: the quality filter drops it as ``length:empty``)."""

    type = "✂️ - FORMAT"
    name = "🔢 bnlit OCR debris"

    def __init__(self, cfg: OcrDebrisConfig):
        super().__init__()
        self.cfg = cfg

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            if doc.metadata["language"] in self.cfg.languages:
                with self.track_time():
                    text, counts = clean_ocr_debris(doc.text, self.cfg)
                    self.stat_update("docs")
                    self.stat_update("chars_in", value=len(doc.text))
                    self.stat_update("chars_out", value=len(text))
                    for k, v in counts.items():
                        self.stat_update(k, value=v)
                    doc.text = text
            yield doc


class QualityFilter(BaseFilter):
    """bnlit's length, script, repetition and symbol filters (:func:`bnlit.data.filters.filter_reason`;
    ``cfg=None``: none of them); an empty document is always dropped. Drops are counted per
    reason (``dropped_<filter>:<detail>``) and their characters per filter
    (``dropped_chars_<filter>``)."""

    name = "🇧🇩 bnlit quality"

    def __init__(self, cfg: F.FilterConfig | None):
        super().__init__()
        self.cfg = cfg

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        reason = "length:empty" if not text.strip() else (
            F.filter_reason(text, doc.metadata["language"], self.cfg) if self.cfg else None)
        if reason is None:
            return True
        self.stat_update(f"dropped_chars_{reason.split(':', 1)[0]}", value=len(text))
        return False, reason


class CanonicalWords(WordTokenizer):
    """bnlit's words for datatrove's text blocks: :func:`bnlit.data.dedup.canonical_words`."""

    def word_tokenize(self, text: str) -> list[str]:
        return canonical_words(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [line for line in text.split("\n") if line.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans, start = [], 0
        for line in text.split("\n"):
            if line.strip():
                spans.append((start, start + len(line)))
            start += len(line) + 1
        return spans


_LAST_WORDS: list = [None, None]


def words_of(text: str) -> list[str]:
    """:func:`canonical_words`, remembered for the last text: the exact and MinHash signature
    steps see the same string one after the other."""
    if _LAST_WORDS[0] is not text:
        _LAST_WORDS[:] = [text, canonical_words(text)]
    return _LAST_WORDS[1]


def canonical_text(doc: Document) -> str:
    return " ".join(words_of(doc.text))


def exact_config() -> ExactDedupConfig:
    """datatrove's exact dedup over the canonical words (64-bit xxhash)."""
    return ExactDedupConfig(content_getter=canonical_text)


class ExactSignature(ExactDedupSignature):
    """datatrove's exact-dedup stage 1 over the canonical words, passing every document on (so the
    MinHash signature step after it reads the same stream). The priority of a task's documents is
    ``PRIORITY_MAX - rank``: of a duplicate group, the copy in the lowest rank (then the lowest
    index) is kept, i.e. the first copy in document order."""

    name = "💥 bnlit exact signature"

    def __init__(self, output_folder: str, finder_workers: int = 1):
        super().__init__(output_folder, exact_config(), finder_workers=finder_workers)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if world_size >= PRIORITY_MAX:
            raise ValueError(f"exact dedup ranks its {world_size} tasks by a 16-bit priority: use fewer than "
                             f"{PRIORITY_MAX} tasks (data.executor.tasks x sources)")
        signatures = []
        for i, doc in enumerate(data):
            with self.track_time():
                self.stat_update(StatHints.total)
                signatures.append((self.hash_fc(canonical_text(doc).encode()), PRIORITY_MAX - rank, i))
            yield doc
        self.save_hashes(rank, signatures)


def minhash_config(cfg: DedupConfig) -> MinhashConfig:
    """datatrove's MinHash layout for bnlit's settings: the (bands, rows) datasketch's
    ``MinHashLSH`` chooses for ``cfg.threshold`` and ``cfg.num_perm``, 32-bit values."""
    bands, rows = lsh_bands(cfg)
    return MinhashConfig(n_grams=cfg.shingle, num_buckets=bands, hashes_per_bucket=rows,
                         hash_config=HashConfig(precision=32))


class MinhashSignature(MinhashDedupSignature):
    """datatrove's MinHash stage 1 with bnlit's signature: word ``shingle``-grams of the canonical
    words, hashed with xxh32, permuted as datasketch's ``affine32`` MinHash (seed 1), split into
    the LSH bands. Two documents share a bucket exactly when datasketch's LSH would have paired
    them, so the clustering decides as the in-memory index of earlier bnlit versions did."""

    name = "🎯 bnlit MinHash signature"

    def __init__(self, output_folder: str, cfg: DedupConfig):
        super().__init__(output_folder, config=minhash_config(cfg), language=CanonicalWords())
        self.dedup = cfg

    def get_shingles(self, text: str) -> np.ndarray:
        grams = shingles(words_of(text), self.dedup.shingle)
        return np.fromiter((xxhash.xxh32_intdigest(g) for g in grams), dtype=np.uint64, count=len(grams)).reshape(-1, 1)

    def get_signature(self, shingle_hashes: np.ndarray) -> list[list[int]]:
        values = minhash_values(shingle_hashes.ravel(), self.dedup.num_perm)
        r = self.config.hashes_per_bucket
        return [values[i * r:(i + 1) * r].tolist() for i in range(self.config.num_buckets)]


class FirstSeenCluster(PipelineStep):
    """MinHash stage 3 (one task), in place of datatrove's ``MinhashDedupCluster``: the earliest
    document (lowest task, then index) of each near-duplicate group is kept, and a document is
    dropped only when it shares a bucket with a document that is *kept*, never through a chain
    of dropped ones (as datasketch's LSH index of kept documents decided). Writes datatrove's
    ``<rank>.remove`` files for ``MinhashDedupFilter``, with indices counted after exact dedup
    (``exact_dups``: the folder of ``ExactFindDedups``; exact copies are left to its filter), and
    ``clusters.json``: per task, documents dropped as near copies, exact or near copies whose kept
    copy is in another source, and the number of groups."""

    type = "🫂 - DEDUP"
    name = "🎯 bnlit first-seen clusters"

    def __init__(self, input_folder: str, output_folder: str, num_buckets: int, ranks: int,
                 source_of: list[int], exact_dups: str | None = None):
        super().__init__()
        self.input_folder = get_datafolder(input_folder)
        self.output_folder = get_datafolder(output_folder)
        self.num_buckets, self.ranks, self.source_of = num_buckets, ranks, source_of
        self.exact_dups = get_datafolder(exact_dups) if exact_dups else None

    def _exact_removed(self) -> dict[int, np.ndarray]:
        out: dict[int, list] = defaultdict(list)
        if self.exact_dups is None:
            return {}
        for name in self.exact_dups.list_files(glob_pattern=f"*/*{ExtensionHelperSD.stage_2_duplicates}"):
            rank = int(Path(name).name.split(".")[0])
            with self.exact_dups.open(name, "rb") as f:
                out[rank].append(np.frombuffer(f.read(), dtype="<u4"))
        return {r: np.sort(np.concatenate(v)) for r, v in out.items()}

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        assert world_size == 1, "first-seen clustering runs as one task"
        with self.track_time():
            groups: dict[tuple[int, int], list] = defaultdict(list)  # document -> its (bucket, group) ids
            for name in sorted(self.input_folder.list_files(glob_pattern="*.dups")):
                bucket = int(name.split("_")[0])
                parent: dict = {}

                def root(x):
                    while parent.get(x, x) != x:
                        parent[x] = parent.get(parent[x], parent[x])
                        x = parent[x]
                    return x

                with self.input_folder.open(name, "rb") as f:
                    pairs = list(read_tuples_from_file(f, "4I"))
                for f1, d1, f2, d2 in pairs:  # pairs chain the documents sharing one bucket value
                    a, b = root((f1, d1)), root((f2, d2))
                    if a != b:
                        parent[max(a, b)] = min(a, b)
                for f1, d1, f2, d2 in pairs:
                    for doc in ((f1, d1), (f2, d2)):
                        gid = (bucket, root(doc))
                        if not groups[doc] or groups[doc][-1] != gid:
                            groups[doc].append(gid)
            exact = self._exact_removed()
            owner_of_group: dict = {}
            removed: dict[int, list[int]] = defaultdict(list)
            stats = {r: {"near": 0, "near_cross": 0, "exact_cross": 0} for r in range(self.ranks)}
            clusters = 0
            for doc in sorted(groups):  # document order: the first of a group is kept
                kept_by = [owner_of_group[g] for g in groups[doc] if g in owner_of_group]
                r, i = doc
                if not kept_by:
                    clusters += 1
                    for g in groups[doc]:
                        owner_of_group[g] = doc
                    continue
                owner = min(kept_by)
                before = int(np.searchsorted(exact[r], i)) if r in exact else 0  # exact copies before it
                is_exact = r in exact and before < exact[r].size and exact[r][before] == i
                cross = self.source_of[owner[0]] != self.source_of[r]
                if is_exact:
                    stats[r]["exact_cross"] += cross
                    continue
                stats[r]["near"] += 1
                stats[r]["near_cross"] += cross
                removed[r].append(i - before)  # its index after exact dedup
            for r in range(self.ranks):
                with self.output_folder.open(f"{r:06d}.remove", "wb") as f:
                    for i in sorted(removed[r]):
                        f.write(struct.pack("<I", i))
            self.stat_update("clusters", value=clusters)
            self.stat_update("near_removed", value=sum(len(v) for v in removed.values()))
            with self.output_folder.open("clusters.json", "w") as f:
                json.dump({"clusters": clusters, "tasks": stats}, f)


class ValidationCopy(PipelineStep):
    """Passes every document on, and writes the validation ones (:func:`bnlit.data.shards.is_validation`)
    to ``<folder>/<rank>.jsonl`` as well: the decontamination index reads only those."""

    type = "💽 - WRITER"
    name = "🎲 bnlit validation copy"

    def __init__(self, folder: str, val_fraction: float):
        super().__init__()
        self.folder, self.val_fraction = folder, val_fraction

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from datatrove.pipeline.writers.jsonl import JsonlWriter

        from bnlit.data.shards import is_validation

        with JsonlWriter(self.folder, output_filename="${rank}.jsonl", compression=None, adapter=text_only) as w:
            for doc in data:
                if is_validation(doc.text, self.val_fraction):
                    w.write(doc, rank)
                    self.stat_update("val_docs")
                yield doc


class DecontamIndex(PipelineStep):
    """One task: the evaluation sets' n-gram index (:class:`bnlit.data.decontam.Decontaminator`):
    the validation documents every task wrote to ``docs_folder`` (:class:`ValidationCopy`; one set
    per language, when ``against_validation``) and the evaluation files, saved to ``index_path``."""

    type = "🧪 - DECONT"
    name = "🧪 bnlit decontamination index"

    def __init__(self, docs_folder: str, language_of: list[str], index_path: str, cfg, val_fraction: float,
                 eval_sources: list, normalize: bool, cache_dir: str | None = None):
        super().__init__()
        self.docs_folder, self.language_of, self.index_path = docs_folder, language_of, index_path
        self.cfg, self.val_fraction, self.eval_sources = cfg, val_fraction, eval_sources
        self.normalize, self.cache_dir = normalize, cache_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from bnlit.data.decontam import Decontaminator

        with self.track_time():
            decon = Decontaminator(self.cfg.ngram, self.cfg.min_overlap)
            if self.cfg.against_validation:
                reader = RankReader(self.docs_folder)
                for r, language in enumerate(self.language_of):
                    for doc in reader.run(rank=r):
                        decon.add(f"val/{language}", doc.text)
            for set_name, (source, path) in self.eval_sources:
                for text in iter_documents(source, path, cache_dir=self.cache_dir):
                    decon.add(set_name, normalize_text(text) if self.normalize else text)
            decon.freeze().save(self.index_path)
            self.stat_update("eval_docs", value=sum(s.docs for s in decon.sets.values()))


class Decontaminate(BaseFilter):
    """Training documents contaminated by an evaluation set (:meth:`Decontaminator.matches`) are
    dropped (``mode: drop``) or counted (``flag``); validation documents pass unchecked. The
    task's share of each set's counters goes to ``<partials>/<rank>.npz`` for the summary."""

    name = "🧪 bnlit decontaminate"

    def __init__(self, index_path: str, partials: str, cfg, val_fraction: float):
        super().__init__()
        self.index_path, self.partials, self.cfg, self.val_fraction = index_path, partials, cfg, val_fraction
        self.decon = None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        from bnlit.data.shards import is_validation

        if is_validation(doc.text, self.val_fraction):
            return True
        hits = self.decon.record(self.decon.matches(canonical_words(doc.text)), len(doc.text))
        if not hits:
            return True
        self.stat_update("contaminated")
        self.stat_update("contaminated_chars", value=len(doc.text))
        for h in hits:
            self.stat_update(f"set_{h}")
        return (False, "contaminated") if self.cfg.mode == "drop" else True

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from bnlit.data.decontam import Decontaminator

        self.decon = Decontaminator.load(self.index_path)
        yield from super().run(data, rank, world_size)
        os.makedirs(self.partials, exist_ok=True)
        self.decon.save_counts(os.path.join(self.partials, f"{rank:05d}.npz"))


class Tokenize(PipelineStep):
    """bnlit's shard format, per task: each document's tokens and EOS appended to
    ``<rank>.<split>.bin`` (the split by content hash), with ``<rank>.json`` holding the
    documents, characters, UTF-8 bytes and tokens of each split. :class:`MergeShards` joins the
    tasks in order."""

    type = "🔢 - TOKENIZER"
    name = "🔢 bnlit tokenize"

    def __init__(self, output_folder: str, tokenizer_path: str, val_fraction: float, chunk_chars: int = 1_000_000):
        super().__init__()
        self.output_folder, self.tokenizer_path = output_folder, tokenizer_path
        self.val_fraction, self.chunk_chars = val_fraction, chunk_chars

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from bnlit.data.shards import SPLITS, encode_documents, token_dtype
        from bnlit.tokenizer import Tokenizer

        tok = Tokenizer(self.tokenizer_path)
        dtype = token_dtype(tok.vocab_size)
        out = Path(self.output_folder)
        out.mkdir(parents=True, exist_ok=True)
        files = {split: (out / f"{rank:05d}.{split}.bin").open("wb") for split in SPLITS}
        totals = {split: {"tokens": 0, "docs": 0, "chars": 0, "bytes": 0} for split in SPLITS}

        def flush(chunk: list[str]) -> None:
            with self.track_time():
                for split, (arr, st) in encode_documents(chunk, tok, dtype, self.val_fraction).items():
                    files[split].write(arr.tobytes())
                    for k, v in st.items():
                        totals[split][k] += v
                        self.stat_update(f"{split}_{k}", value=v)

        try:
            chunk, size = [], 0
            for doc in data:
                chunk.append(doc.text)
                size += len(doc.text)
                if size >= self.chunk_chars:
                    flush(chunk)
                    chunk, size = [], 0
            if chunk:
                flush(chunk)
        finally:
            for f in files.values():
                f.close()
        (out / f"{rank:05d}.json").write_text(json.dumps(totals))


# ---- the one-task stages that close the cleaning and build the tokenizer and shards -----------
def task_stats(logging_dir: Path, rank: int) -> dict[str, dict]:
    """datatrove's statistics of one finished task: {step name: {label: MetricStats}}, plus each
    step's seconds under ``"_seconds"``."""
    from datatrove.utils.stats import MetricStats

    path = Path(logging_dir) / "stats" / f"{rank:05d}.json"
    if not path.is_file():
        return {}
    out = {}
    for step in json.loads(path.read_text()):
        name = step["name"].split(": ", 1)[-1]
        stats = {k: MetricStats.from_dict(v) for k, v in step["stats"].items()}
        t = step.get("time_stats")
        stats["_seconds"] = MetricStats(total=t.get("total", 0.0) if isinstance(t, dict) else float(t or 0.0))
        out[name] = stats
    return out


def _total(stats: dict, step: str, label: str) -> float:
    m = stats.get(step, {}).get(label)
    return m.total if m is not None else 0


def _count(stats: dict, step: str, label: str = "doc_len") -> int:
    m = stats.get(step, {}).get(label)
    return m.n if m is not None and m.total else 0


EXACT_FILTER = "💥 exact-deduplication stage 3"  # datatrove's step names, as its statistics call them
MINHASH_FILTER = "🎯 MinHash stage 4"
JSONL_WRITER = "🐿 Jsonl"


class CleanStats(PipelineStep):
    """One task: datatrove's per-task statistics of the cleaning stages, the first-seen
    clusters and the decontamination counts, summed per source into ``stats.json`` (what the
    data report shows), with ``stages``: documents and characters into and out of each stage.
    The intermediate copies are removed first; ``stats.json`` marks the cleaning finished."""

    type = "📊 - STATS"
    name = "📊 bnlit clean statistics"

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.track_time():
            stats = self.summary()
            remove_intermediates(self.plan.clean_dir)
            storage.write_text(self.plan.clean_dir / STATS_FILE, json.dumps(stats, indent=2, ensure_ascii=False))

    def summary(self) -> dict:
        plan, cfg = self.plan, self.plan.clean
        logs = plan.clean_dir / "logs"
        exact, near, decon = cfg.dedup.exact, cfg.dedup.near, cfg.decontam.enabled
        clusters = {"clusters": 0, "tasks": {}}
        if near:
            clusters = json.loads((plan.clean_dir / "minhash/remove/clusters.json").read_text())
        sources: dict[str, dict] = {}
        stage_rows = {k: dict.fromkeys(("docs_in", "chars_in", "docs_out", "chars_out", "seconds"), 0)
                      for k in ("normalize", "ocr_debris", "filters", "dedup", "decontam")}
        for r, piece in enumerate(plan.pieces):
            s = sources.setdefault(piece.source.name, {
                "language": piece.source.language, "input_docs": 0, "input_chars": 0, "normalized_changed": 0,
                "ocr_debris": dict.fromkeys(DEBRIS_STATS, 0),
                "filters": {"docs": {}, "chars": {}, "details": {}}, "kept_docs": 0, "kept_chars": 0,
                "decontam": {"docs": 0, "chars": 0, "by_set": {}},
                "dedup": {"exact": 0, "near": 0, "exact_cross": 0, "near_cross": 0, "chars": 0}})
            read = task_stats(logs / "read", r)
            docs_in, chars_in = _count(read, SourceReader.name), int(_total(read, SourceReader.name, "doc_len"))
            s["input_docs"] += docs_in
            s["input_chars"] += chars_in
            s["normalized_changed"] += int(_total(read, Normalize.name, "changed"))
            debris = read.get(OcrDebris.name, {})
            for k in DEBRIS_STATS:
                s["ocr_debris"][k] += int(debris[k].total) if k in debris else 0
            cut = 0  # characters the OCR debris step took out before the filters
            if cfg.ocr_debris is not None:
                n = int(_total(read, OcrDebris.name, "docs"))
                d_in, d_out = int(_total(read, OcrDebris.name, "chars_in")), int(_total(read, OcrDebris.name, "chars_out"))
                _add(stage_rows["ocr_debris"], (n, d_in), (n, d_out), debris)
                cut = d_in - d_out
            q = read.get(QualityFilter.name, {})
            for label, m in q.items():
                if label.startswith("dropped_chars_"):
                    kind = label[len("dropped_chars_"):]
                    s["filters"]["chars"][kind] = s["filters"]["chars"].get(kind, 0) + int(m.total)
                elif label.startswith("dropped_") and ":" in label:
                    reason = label[len("dropped_"):]
                    kind = reason.split(":", 1)[0]
                    s["filters"]["details"][reason] = s["filters"]["details"].get(reason, 0) + int(m.total)
                    s["filters"]["docs"][kind] = s["filters"]["docs"].get(kind, 0) + int(m.total)
            kept = (_count(read, QualityFilter.name), int(_total(read, QualityFilter.name, "doc_len")))
            _add(stage_rows["normalize"], (docs_in, chars_in), (docs_in, chars_in), read.get(Normalize.name))
            _add(stage_rows["filters"], (docs_in, chars_in - cut), kept, read.get(QualityFilter.name))
            if exact or near:
                d = task_stats(logs / "dedup", r)
                d_in = (_count(d, RankReader.name), int(_total(d, RankReader.name, "doc_len")))
                kept = (_count(d, JSONL_WRITER), int(_total(d, JSONL_WRITER, "doc_len")))
                s["dedup"]["exact"] += int(_total(d, EXACT_FILTER, StatHints.dropped))
                s["dedup"]["near"] += int(_total(d, MINHASH_FILTER, StatHints.dropped))
                s["dedup"]["chars"] += d_in[1] - kept[1]
                for k in ("exact_cross", "near_cross"):
                    s["dedup"][k] += clusters["tasks"].get(str(r), {}).get(k, 0)
                _add(stage_rows["dedup"], d_in, kept, *(d.get(n) for n in (EXACT_FILTER, MINHASH_FILTER)))
            if decon:
                d = task_stats(logs / "decontam", r)
                d_in = (_count(d, RankReader.name), int(_total(d, RankReader.name, "doc_len")))
                kept = (_count(d, JSONL_WRITER), int(_total(d, JSONL_WRITER, "doc_len")))
                s["decontam"]["docs"] += int(_total(d, Decontaminate.name, "contaminated"))
                s["decontam"]["chars"] += int(_total(d, Decontaminate.name, "contaminated_chars"))
                for label, m in d.get(Decontaminate.name, {}).items():
                    if label.startswith("set_"):
                        by = s["decontam"]["by_set"]
                        by[label[4:]] = by.get(label[4:], 0) + int(m.total)
                _add(stage_rows["decontam"], d_in, kept, d.get(Decontaminate.name))
            s["kept_docs"] += kept[0]
            s["kept_chars"] += kept[1]
        summary = {}
        if decon:
            from bnlit.data.decontam import Decontaminator

            d = Decontaminator.load(plan.clean_dir / "decontam/index.npz")
            for r in range(len(plan.pieces)):
                counts = plan.clean_dir / "decontam/counts" / f"{r:05d}.npz"
                if counts.is_file():
                    d.merge_counts(counts)
            summary = d.summary()
        rows = [{"stage": k, **v} for k, v in stage_rows.items()
                if not (k == "dedup" and not (exact or near)) and not (k == "decontam" and not decon)
                and not (k == "normalize" and not cfg.normalize) and not (k == "ocr_debris" and cfg.ocr_debris is None)]
        for row in rows:
            if row["stage"] == "dedup":
                row["clusters"] = clusters["clusters"]
        return {
            "config": cfg.to_dict(),
            "val_fraction": plan.val_fraction,
            "sources": sources,
            "decontam": summary,
            # every training document sharing an n-gram with validation text was removed
            "validation_decontaminated": bool(decon and cfg.decontam.against_validation and cfg.decontam.mode == "drop"),
            "stages": rows,
            "pieces": {s.name: plan.ranks_of(i) for i, s in enumerate(plan.sources)},
        }


def _add(row: dict, into: tuple[int, int], out: tuple[int, int], *steps) -> None:
    row["docs_in"] += into[0]
    row["chars_in"] += into[1]
    row["docs_out"] += out[0]
    row["chars_out"] += out[1]
    row["seconds"] += sum(st["_seconds"].total for st in steps if st)


class TrainTokenizer(PipelineStep):
    """One task: the plan's SentencePiece model, trained on the training split of the cleaned
    documents (:func:`train_plan_tokenizer`)."""

    type = "🔢 - TOKENIZER"
    name = "🔢 bnlit train tokenizer"

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.track_time():
            if not self.plan.tokenizer_path.is_file():
                train_plan_tokenizer(self.plan)


class MergeShards(PipelineStep):
    """One task: every source's per-task token files joined in order into the shard directory
    (:func:`bnlit.data.shards.merge_shards`); the per-task files are removed after."""

    type = "🔢 - TOKENIZER"
    name = "🧱 bnlit merge shards"

    def __init__(self, plan):
        super().__init__()
        self.plan = plan

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from bnlit.data.shards import merge_shards
        from bnlit.tokenizer import Tokenizer

        plan = self.plan
        with self.track_time():
            sources = [(s.name, s.language, plan.ranks_of(i)) for i, s in enumerate(plan.sources)]
            merge_shards(plan.shard_root, plan.tasks_dir, sources, plan.fingerprints, Tokenizer(plan.tokenizer_path),
                         plan.val_fraction)
            shutil.rmtree(plan.tasks_dir, ignore_errors=True)


def train_plan_tokenizer(plan: Plan) -> Path:
    """Train the plan's SentencePiece model on the training split of its documents, with
    ``tokenizer.lang_weights`` and the ``word_frequencies`` supplement; ``sources.json`` beside
    it names the sources."""
    from bnlit import progress
    from bnlit.data import embedded
    from bnlit.data.shards import is_validation
    from bnlit.tokenizer import sample_by_language, train_tokenizer, training_lines

    cfg = plan.tokenizer_cfg
    lang_weights = dict(cfg["lang_weights"]) if cfg.get("lang_weights") else None
    word_freq = {k: float(v) for k, v in (cfg.get("word_frequencies") or {}).items() if v}
    with progress.Timer() as timer:
        docs = (d for i in range(len(plan.sources)) for d in plan.documents(i) if not is_validation(d, plan.val_fraction))
        if lang_weights or word_freq:
            by_lang: dict[str, list[str]] = {}
            for i, s in enumerate(plan.sources):
                by_lang.setdefault(s.language, []).extend(
                    training_lines(d for d in plan.documents(i) if not is_validation(d, plan.val_fraction)))
            for lang, ratio in word_freq.items():
                if by_lang.get(lang):  # a supplement to a language the sources have
                    chars = int(ratio * sum(map(len, by_lang[lang])))
                    by_lang[lang] += embedded.word_lines(lang, chars, seed=plan.seed)
            if lang_weights and set(lang_weights) - set(by_lang):
                log.info("tokenizer.lang_weights: data.sources have no %s text; weighting %s only",
                         sorted(set(lang_weights) - set(by_lang)), sorted(set(lang_weights) & set(by_lang)))
                lang_weights = {k: v for k, v in lang_weights.items() if k in by_lang}
            docs = sample_by_language(by_lang, lang_weights if len(lang_weights or ()) > 1 else None, seed=plan.seed)
        # sources.json first: the model's presence is what marks this tokenizer finished
        storage.write_text(plan.tokenizer_path.parent / "sources.json",
                           json.dumps([s.to_dict() for s in plan.sources], indent=2))
        train_tokenizer(docs, plan.tokenizer_path, vocab_size=cfg["vocab_size"], model_type=cfg.get("model_type", "bpe"),
                        character_coverage=cfg.get("character_coverage", 0.9999),
                        normalization=cfg.get("normalization") or "nfc", split_digits=bool(cfg.get("split_digits", True)))
    progress.stage_summary("tokenizer", f"trained: {cfg['vocab_size']} {cfg.get('model_type', 'bpe')} pieces", timer.seconds)
    return plan.tokenizer_path


def remove_intermediates(clean_dir: Path) -> None:
    """What only the cleaning stages read (filtered and deduplicated copies, signatures)."""
    for sub in ("filtered", "deduped", "val", "exact", "minhash"):
        shutil.rmtree(clean_dir / sub, ignore_errors=True)
