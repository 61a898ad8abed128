"""The data build as datatrove pipelines: sources -> normalise -> OCR debris -> filter ->
deduplicate (exact, near; across sources) -> decontaminate -> tokenizer -> token shards.

:func:`plan_data` fixes what is built and where (cache keys from the inputs, one task per
contiguous piece of a source); :func:`stages` turns the plan into datatrove pipelines, one per
stage, each stage ``depends`` on the one before: the stages that need a global view (the
duplicate finders and first-seen clustering, the decontamination index, the statistics,
tokenizer training, the shard merge) run after every task of the stage before has finished.
:func:`run_local` runs them with ``LocalPipelineExecutor`` (in this process when one worker),
:func:`launch_slurm` submits them as SLURM job arrays chained by dependencies
(``python -m bnlit.prepare data/executor=slurm``). Either way a relaunch skips the finished
tasks (datatrove's completion markers), and the output equals an uninterrupted run's.

Stages and folders under ``<cache>/clean/<key>/`` (a stage is left out when its switch is off):

=================  =======  ===========================================================
stage              tasks    steps
=================  =======  ===========================================================
``read``           pieces   source reader, normalise, OCR debris, bnlit filters, JSONL writer
                            (``filtered/``), exact-dedup and MinHash signatures
``dedup_find``     bands    datatrove ``ExactFindDedups`` + ``MinhashDedupBuckets``
``dedup_cluster``  1        :class:`~bnlit.data.steps.FirstSeenCluster`
``dedup``          pieces   datatrove ``ExactDedupFilter`` + ``MinhashDedupFilter``
``decontam_index`` 1        evaluation n-gram index (validation documents, eval files)
``decontam``       pieces   drop or flag contaminated training documents -> ``docs/``
``clean_stats``    1        ``stats.json`` (what the data report shows), intermediates removed
``tokenizer``      1        train the SentencePiece model (unless ``tokenizer.path``)
``tokenize``       pieces   tokens per task
``shards``         1        tasks joined per source into ``<cache>/shards/<key>/``
=================  =======  ===========================================================

The validation split is the content hash of the normalised text
(:func:`bnlit.data.shards.is_validation`), so dedup before the split means no near-copy
straddles train and validation; training documents are checked against the evaluation sets (the
validation slices, one per language, and the user's benchmark files) and dropped or flagged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bnlit.data import filters as F
from bnlit.data.decontam import DecontamConfig
from bnlit.data.dedup import DedupConfig, lsh_bands
from bnlit.data.ocr_debris import OcrDebrisConfig
from bnlit.data.sources import Piece, Source, iter_documents
from bnlit.data.steps import STATS_FILE  # noqa: F401 (the cleaning's "finished" mark, written by CleanStats)
from bnlit.errors import ConfigError

log = logging.getLogger(__name__)
DOCS = "docs"


@dataclass
class CleanConfig:
    """``data.clean``: which stages run and their settings (``ocr_debris: null`` and ``filters:
    null`` switch those steps off; ``dedup.exact/near: false`` and ``decontam.enabled: false``
    switch those off)."""

    enabled: bool = True
    normalize: bool = True
    ocr_debris: OcrDebrisConfig | None = field(default_factory=OcrDebrisConfig)
    filters: F.FilterConfig | None = field(default_factory=F.FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)

    @classmethod
    def from_dict(cls, d) -> "CleanConfig":
        if d is None:
            return cls(enabled=False)
        d = dict(d)
        known = {"enabled", "normalize", "ocr_debris", "filters", "dedup", "decontam"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"data.clean: unknown keys {unknown}; known: {sorted(known)}")
        return cls(enabled=d.get("enabled", True), normalize=d.get("normalize", True),
                   ocr_debris=None if "ocr_debris" in d and d["ocr_debris"] is None
                   else OcrDebrisConfig.from_dict(d.get("ocr_debris")),
                   filters=None if "filters" in d and d["filters"] is None else F.FilterConfig.from_dict(d.get("filters")),
                   dedup=DedupConfig.from_dict(d.get("dedup")),
                   decontam=DecontamConfig.from_dict(d.get("decontam")))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "normalize": self.normalize,
                "ocr_debris": self.ocr_debris.to_dict() if self.ocr_debris else None,
                "filters": self.filters.to_dict() if self.filters else None,
                "dedup": self.dedup.to_dict(), "decontam": self.decontam.to_dict()}


@dataclass
class Plan:
    """What a data build makes and where; everything a stage's steps need (picklable, for SLURM).

    ``pieces[rank]`` is the share of a source that task ``rank`` of every parallel stage reads.
    ``fingerprints`` identify the documents the tokenizer and shards are made of (the sources'
    own, with the cleaning key when cleaning)."""

    sources: list[Source]
    paths: list[Path | None]
    pieces: list[Piece]
    fingerprints: list[str]
    clean: CleanConfig
    val_fraction: float
    cache_dir: Path
    clean_dir: Path | None
    eval_sources: list = field(default_factory=list)  # (set name, (Source, Path))
    tokenizer_cfg: dict = field(default_factory=dict)
    tokenizer_path: Path | None = None
    tokenizer_given: bool = False
    seed: int = 0
    work_key: str = ""

    @property
    def hf_cache(self) -> str:
        return str(self.cache_dir / "hf")

    @property
    def shard_root(self) -> Path:
        return self.cache_dir / "shards"

    @property
    def tasks_dir(self) -> Path:
        return self.shard_root / f".tasks-{self.work_key}"

    @property
    def shard_logs(self) -> Path:
        return self.shard_root / f".logs-{self.work_key}"

    def ranks_of(self, i: int) -> list[int]:
        return [r for r, p in enumerate(self.pieces) if p.source_index == i]

    @property
    def language_of(self) -> list[str]:
        return [p.source.language for p in self.pieces]

    def documents(self, i: int) -> Iterator[str]:
        """Source ``i``'s documents as the tokenizer and shards see them: cleaned, or as read."""
        if self.clean_dir is not None:
            yield from read_clean(self.clean_dir, self.sources[i].name)
            return
        for p in self.pieces:
            if p.source_index == i:
                yield from iter_documents(p.source, p.path, cache_dir=self.hf_cache, piece=p.index, pieces=p.of)

    def clean_done(self) -> bool:
        return self.clean_dir is None or load_stats(self.clean_dir) is not None

    def shard_dir(self) -> Path | None:
        """The finished shard directory, or None while the tokenizer or the shards are missing."""
        from bnlit.data.shards import INDEX_FILE, shard_key
        from bnlit.tokenizer import Tokenizer

        if not self.tokenizer_path.is_file():
            return None
        d = self.shard_root / shard_key(self.fingerprints, Tokenizer(self.tokenizer_path).sha256, self.val_fraction)
        return d if (d / INDEX_FILE).is_file() else None


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def plan_data(sources: list[Source], paths: list[Path | None], fingerprints: list[str], clean: CleanConfig,
              val_fraction: float, cache_dir: Path, tokenizer_cfg: dict, seed: int = 0, tasks: int = 1,
              eval_sources: list | None = None) -> Plan:
    """The build for these inputs: ``tasks`` contiguous pieces per source (fewer for a source
    that cannot be split, :func:`bnlit.data.sources.source_pieces`); cache keys from the inputs
    only, so the task count changes nothing that is built."""
    from bnlit.data.sources import fingerprint, source_pieces

    if tasks < 1:
        raise ConfigError(f"data.executor.tasks={tasks}: must be >= 1")
    cache_dir = Path(cache_dir)
    hf = str(cache_dir / "hf")
    pieces = [Piece(s, p, i, j, n) for i, (s, p) in enumerate(zip(sources, paths))
              for n in [source_pieces(s, p, hf, tasks)] for j in range(n)]
    clean_dir = None
    evals = []
    if clean.enabled:
        for src, path in eval_sources or []:
            evals.append((f"eval/{src.name}", (src, path), fingerprint(src, path)))
        key = _key(fingerprints, clean.to_dict(), val_fraction, [e[2] for e in evals])
        clean_dir = cache_dir / "clean" / key
        fingerprints = [f"{fp}:clean:{key}" for fp in fingerprints]
    plan = Plan(sources, paths, pieces, fingerprints, clean, val_fraction, cache_dir, clean_dir,
                [(name, sp) for name, sp, _ in evals], dict(tokenizer_cfg), seed=seed)
    if tokenizer_cfg.get("path"):
        plan.tokenizer_path, plan.tokenizer_given = Path(tokenizer_cfg["path"]).expanduser(), True
        identity = hashlib.sha256(plan.tokenizer_path.read_bytes()).hexdigest()
    else:
        identity = tokenizer_key(tokenizer_cfg, fingerprints, val_fraction)
        plan.tokenizer_path = cache_dir / "tokenizers" / identity / "tokenizer.model"
    plan.work_key = _key(fingerprints, identity, val_fraction)
    return plan


def tokenizer_key(cfg: dict, fingerprints: list[str], val_fraction: float) -> str:
    from bnlit.tokenizer import RECIPE_VERSION

    spec = {**{k: cfg.get(k) for k in ("vocab_size", "model_type", "character_coverage")},
            "lang_weights": dict(cfg["lang_weights"]) if cfg.get("lang_weights") else None,
            "normalization": cfg.get("normalization") or "nfc", "split_digits": bool(cfg.get("split_digits", True)),
            "word_frequencies": {k: float(v) for k, v in (cfg.get("word_frequencies") or {}).items() if v},
            "recipe": RECIPE_VERSION}
    return _key(spec, fingerprints, val_fraction)


# ---- the stages ----------------------------------------------------------------------------
@dataclass
class Stage:
    name: str
    pipeline: list
    tasks: int
    logging_dir: Path
    group: str  # clean, tokenizer or shards: what the progress summary calls it


def stages(plan: Plan) -> list[Stage]:
    """The datatrove pipelines still to run for ``plan``, in order (finished parts left out)."""
    out: list[Stage] = []
    if not plan.clean_done():
        out += _clean_stages(plan)
    if not plan.tokenizer_path.is_file():
        from bnlit.data.steps import TrainTokenizer

        out.append(Stage("tokenizer", [TrainTokenizer(plan)], 1, plan.shard_logs / "tokenizer", "tokenizer"))
    if plan.tokenizer_path.is_file() and plan.shard_dir() is not None:
        return out
    from bnlit.data.steps import MergeShards, RankReader, SourceReader, Tokenize

    reader = RankReader(str(plan.clean_dir / DOCS)) if plan.clean_dir else SourceReader(plan.pieces, plan.hf_cache)
    out.append(Stage("tokenize", [reader, Tokenize(str(plan.tasks_dir), str(plan.tokenizer_path), plan.val_fraction)],
                     len(plan.pieces), plan.shard_logs / "tokenize", "shards"))
    out.append(Stage("shards", [MergeShards(plan)], 1, plan.shard_logs / "shards", "shards"))
    return out


def _clean_stages(plan: Plan) -> list[Stage]:
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter, ExactFindDedups
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupFilter
    from datatrove.pipeline.writers.jsonl import JsonlWriter

    from bnlit.data import steps as S

    cfg, W = plan.clean, plan.clean_dir
    logs = W / "logs"
    P = len(plan.pieces)
    exact, near, decon = cfg.dedup.exact, cfg.dedup.near, cfg.decontam.enabled
    dedup = exact or near
    bands = lsh_bands(cfg.dedup)[0] if near else 1

    def writer(folder: str):
        return JsonlWriter(str(W / folder), output_filename="${rank}.jsonl", compression=None, adapter=S.text_only)

    first_out = "filtered" if dedup else ("deduped" if decon else DOCS)
    read = [S.SourceReader(plan.pieces, plan.hf_cache)] + ([S.Normalize()] if cfg.normalize else [])
    read += [S.OcrDebris(cfg.ocr_debris)] if cfg.ocr_debris is not None else []
    read += [S.QualityFilter(cfg.filters)]
    val_copy = [S.ValidationCopy(str(W / "val"), plan.val_fraction)] if decon else []
    read += (val_copy if not dedup else []) + [writer(first_out)]
    if exact:
        read.append(S.ExactSignature(str(W / "exact/sigs"), finder_workers=bands))
    if near:
        read.append(S.MinhashSignature(str(W / "minhash/sigs"), cfg.dedup))
    out = [Stage("read", read, P, logs / "read", "clean")]
    if dedup:
        find = ([ExactFindDedups(str(W / "exact/sigs"), str(W / "exact/dups"), config=S.exact_config())] if exact else [])
        if near:
            find.append(MinhashDedupBuckets(str(W / "minhash/sigs"), str(W / "minhash/buckets"),
                                            config=S.minhash_config(cfg.dedup)))
        out.append(Stage("dedup_find", find, bands, logs / "dedup_find", "clean"))
        if near:
            cluster = S.FirstSeenCluster(str(W / "minhash/buckets"), str(W / "minhash/remove"), bands, P,
                                         [p.source_index for p in plan.pieces], str(W / "exact/dups") if exact else None)
            out.append(Stage("dedup_cluster", [cluster], 1, logs / "dedup_cluster", "clean"))
        filt = [S.RankReader(str(W / "filtered"))]
        if exact:
            filt.append(ExactDedupFilter(str(W / "exact/dups"), config=S.exact_config()))
        if near:
            filt.append(MinhashDedupFilter(str(W / "minhash/remove")))
        filt += val_copy + [writer("deduped" if decon else DOCS)]
        out.append(Stage("dedup", filt, P, logs / "dedup", "clean"))
    if decon:
        index = str(W / "decontam/index.npz")
        out.append(Stage("decontam_index", [S.DecontamIndex(str(W / "val"), plan.language_of, index, cfg.decontam,
                                                            plan.val_fraction, plan.eval_sources, cfg.normalize,
                                                            plan.hf_cache)], 1, logs / "decontam_index", "clean"))
        out.append(Stage("decontam", [S.RankReader(str(W / "deduped"), plan.language_of),
                                      S.Decontaminate(index, str(W / "decontam/counts"), cfg.decontam, plan.val_fraction),
                                      writer(DOCS)], P, logs / "decontam", "clean"))
    out.append(Stage("clean_stats", [S.CleanStats(plan)], 1, logs / "clean_stats", "clean"))
    return out


def workers(num_proc) -> int:
    """``data.num_proc``: how many tasks run at once, an integer or ``auto`` (this machine's cores)."""
    if num_proc == "auto":
        return os.cpu_count() or 1
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ConfigError(f"data.num_proc={num_proc!r}: use a positive integer or auto")
    return num_proc


# ---- running them ----------------------------------------------------------------------------
_NULL: list = []  # one devnull stream, never closed: a handler a library binds to it while quiet stays valid


@contextlib.contextmanager
def _quiet_datatrove(quiet: bool) -> Iterator[None]:
    """datatrove logs every task to stderr (loguru) besides its own log files; a training run
    keeps the console to its own summaries."""
    if not quiet:
        yield
        return
    import datasets.utils.logging
    from loguru import logger

    datasets.utils.logging.get_logger("datasets")  # its handler is made once: on the real stderr, not devnull
    if not _NULL:
        _NULL.append(open(os.devnull, "w"))
    logger.remove()  # the handler datatrove adds at import holds the real stderr
    with contextlib.redirect_stderr(_NULL[0]):
        try:
            yield
        finally:
            logger.remove()
    logger.add(sys.stderr, level="WARNING")


@contextlib.contextmanager
def _lock(plan: Plan) -> Iterator[None]:
    """One builder of a plan at a time on this machine; a second waits, then finds it done.

    A POSIX record lock (``lockf``), not ``flock``: it belongs to this process, so it goes when
    this process dies, even if a process it forked lives on. A ``flock`` is shared with every
    forked child: datatrove's ``multiprocess.Manager`` server outlived a builder killed with
    SIGKILL and held the lock, and every later run of the plan waited for it forever."""
    path = plan.cache_dir / "locks" / f"{plan.work_key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        yield


_BUILDER: list[int] = []  # the pid of this process while run_local builds


def _end_with_the_builder() -> None:
    """In a process forked during a build (datatrove's ``Manager`` server and pool workers):
    end when the builder ends, by SIGKILL too; the server otherwise serves forever, orphaned."""
    if not _BUILDER or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _BUILDER[0]:  # the builder died before the line above
        os._exit(1)


os.register_at_fork(after_in_child=_end_with_the_builder)


@contextlib.contextmanager
def _ending_with_this_process() -> Iterator[None]:
    _BUILDER.append(os.getpid())
    try:
        yield
    finally:
        _BUILDER.pop()


def run_local(plan: Plan, workers: int = 1, quiet: bool = False,
              on_group: Callable[[str, float], None] | None = None,
              on_stage: Callable[[str, float], None] | None = None) -> None:
    """Run what is missing of ``plan`` with datatrove's ``LocalPipelineExecutor``: ``workers``
    tasks at a time (1: in this process). ``on_group(group, seconds)`` is called as the clean,
    tokenizer and shard groups finish, ``on_stage(name, seconds)`` as each stage does."""
    import time

    from datatrove.executor.local import LocalPipelineExecutor

    with _lock(plan), _ending_with_this_process(), _quiet_datatrove(quiet):
        todo = stages(plan)
        prev = None
        timing: dict[str, float] = {}
        for i, st in enumerate(todo):
            t = time.perf_counter()
            ex = LocalPipelineExecutor(st.pipeline, tasks=st.tasks, workers=max(1, min(workers, st.tasks)),
                                       logging_dir=str(st.logging_dir), depends=prev)
            ex.run()
            prev = ex
            seconds = time.perf_counter() - t
            timing[st.group] = timing.get(st.group, 0.0) + seconds
            if on_stage is not None:
                on_stage(st.name, seconds)
            if on_group is not None and (i + 1 == len(todo) or todo[i + 1].group != st.group):
                on_group(st.group, timing[st.group])


def launch_slurm(plan: Plan, cfg: dict) -> list[tuple[str, str, int]]:
    """Submit what is missing of ``plan`` as SLURM job arrays (datatrove's
    ``SlurmPipelineExecutor``), each stage's job depending on the one before (``afterok``).
    ``cfg``: ``data.executor``. Returns (stage, job id, tasks) per submitted stage (job id
    ``-1``: every task of that stage had already finished)."""
    from datatrove.executor.slurm import SlurmPipelineExecutor

    todo = stages(plan)
    venv = Path(sys.prefix) / "bin" / "activate"
    env_command = cfg.get("env_command") or (f"source {venv}" if venv.is_file() else None)
    executors = []
    prev = None
    for st in todo:
        ex = SlurmPipelineExecutor(
            st.pipeline, tasks=st.tasks, time=str(cfg["time"]), partition=cfg["partition"],
            cpus_per_task=int(cfg.get("cpus_per_task", 1)), mem_per_cpu_gb=int(cfg.get("mem_per_cpu_gb", 2)),
            job_name=f"{cfg.get('job_name', 'bnlit')}-{st.name}", qos=cfg.get("qos") or "",
            env_command=env_command, logging_dir=str(st.logging_dir), depends=prev,
            sbatch_args=dict(cfg.get("sbatch_args") or {}), max_array_size=int(cfg.get("max_array_size", 1001)),
            workers=int(cfg.get("workers") or -1), mail_user=cfg.get("mail_user"))
        executors.append((st, ex))
        prev = ex
    if executors:
        try:
            executors[-1][1].run()  # launches its dependencies first
        except subprocess.CalledProcessError as e:
            raise ConfigError(f"sbatch refused a job of the data build (exit {e.returncode}; its message is above); "
                              "check data.executor.partition, time, mem_per_cpu_gb and sbatch_args") from None
    return [(st.name, str(ex.job_id), st.tasks) for st, ex in executors]


# ---- reading the results ---------------------------------------------------------------------
def load_stats(out_dir: str | os.PathLike) -> dict | None:
    path = Path(out_dir) / STATS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def read_clean(out_dir: str | os.PathLike, name: str) -> Iterator[str]:
    """The kept documents of source ``name`` from a finished cleaning directory, in order."""
    import orjson

    stats = load_stats(out_dir)
    if stats is None or name not in stats["pieces"]:
        raise FileNotFoundError(f"{out_dir}: no finished cleaning of source {name!r}")
    for rank in stats["pieces"][name]:
        path = Path(out_dir) / DOCS / f"{rank:05d}.jsonl"
        if path.is_file():
            with path.open("rb") as f:
                for line in f:
                    yield orjson.loads(line)["text"]
