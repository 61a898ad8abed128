"""The LightningDataModule: sources -> tokenizer (trained or reused) -> packed shards -> windows.

``prepare_data`` (one process per node) materialises the embedded corpus and runs the data build
(bnlit/data/pipeline.py: datatrove stages that clean, train or load the tokenizer and build the
shards), then checks the shards against their index's checksums; ``setup`` (every process) opens
them read-only. Everything built is cached under ``cache_dir`` by a hash of its inputs, so a second
run starts at once, a changed source or tokenizer rebuilds, and a build made beforehand by
``python -m bnlit.prepare`` (on a cluster) is found and read."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import random
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, DataLoader

from bnlit import progress as progress_bars
from bnlit.interrupt import WORKER_IGNORED_SIGNALS, seed_workers, worker_ignores_interrupts
from bnlit.data import embedded
from bnlit.data.dataset import MixtureSampler, PackedWindows, mixture_counts, resume_start
from bnlit.data.pipeline import CleanConfig, Plan, load_stats, plan_data, run_local, workers
from bnlit.data.report import build_report, log_report, write_report
from bnlit.data.shards import load_index, read_tokens
from bnlit.data.sources import Source, check_exists, fingerprint
from bnlit.errors import ConfigError, TokenizerError
from bnlit.checks.fertility import by_language, chars_per_token, effective_shares, token_weights_for_char_shares
from bnlit.tokenizer import Tokenizer

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.model"
WEIGHT_UNITS = ("tokens", "chars")


# Every rank's RNG states travel in the data module's checkpoint state (state_dict runs on every
# rank, so the all-gather below is collective), as plain tensors, ints and lists so the checkpoint
# still loads with torch.load(weights_only=True).

def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) in a ``weights_only``-loadable form."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective under torch.distributed)."""
    mine = rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# what a loader worker runs, imported once by the fork server instead of by every worker
WORKER_MODULES = ("torch", "numpy", "bnlit.data.dataset", "bnlit.interrupt", "lightning.fabric.utilities.seed")


def fork_server_preload() -> list[str]:
    """What the fork server imports before it forks any worker: ``WORKER_MODULES``, and this
    process's main module, which each worker imports again before it unpickles its work (as a
    spawned process does). ``python -m bnlit.train``'s main module imports Hydra and Lightning:
    ~5 s per worker here when the server has not imported it first, a few ms when it has."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return ["__main__", *WORKER_MODULES, *([main.name] if main is not None and main.name else [])]


def worker_context(method: str) -> multiprocessing.context.BaseContext:
    """The start method of loader workers. ``forkserver``: workers fork from a server process
    started once per trainer process, which imports ``WORKER_MODULES`` before any thread runs in it.
    A worker forked from the trainer itself (``fork``, Linux's default) inherits the trainer's
    memory with every lock as it was at that instant: a lock held by another thread (gloo's, a
    logger's, the C library's atexit list) stays held in the worker forever, and the worker hangs
    silently the first time it needs it (CI's SLURM sweep waited 15 minutes at its first batch;
    run here, 1 run in 20 hung with a worker stuck inside ``os.fork()``: docs/data.md, "Loader
    workers"; pytorch/pytorch#130610)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(fork_server_preload())  # no effect once this process's server runs
        start_fork_server()
    return ctx


def start_fork_server() -> None:
    """Start this process's fork server (once) ignoring the stop signals workers ignore
    (``bnlit.interrupt.WORKER_IGNORED_SIGNALS``): an ignored signal stays ignored across fork and
    exec, so SLURM's SIGTERM or ``--signal`` USR2, sent to every process of the job step, cannot kill
    the server (the trainer would then read every worker as dead). This process blocks them
    meanwhile, so one that arrives while the server starts waits, and reaches its handler after."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # signal handlers can only be changed in the main thread
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in WORKER_IGNORED_SIGNALS}
    try:
        forkserver.ensure_running()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class BnDataModule(L.LightningDataModule):
    """Args:
    sources: list of :class:`~bnlit.data.sources.Source` fields (dicts from the config).
    tokenizer: ``path`` (an existing SentencePiece model, or None to train one), ``vocab_size``,
        ``model_type``, ``character_coverage``.
    seq_len: tokens per training window.
    batch_size: windows per micro-batch per device.
    val_fraction: share of each source's documents held out (by content hash) for validation.
    cache_dir: where tokenizers and shards are cached.
    output_dir: the run directory; the tokenizer used is copied there.
    weight_unit: what ``sources[*].weight`` shares are of: ``tokens`` (sampled windows) or
        ``chars`` (text; converted at setup into the token weights that deliver those character
        shares, from each source's characters per token under the run's tokenizer).
    prefetch_factor: batches each loader worker prepares ahead (None: torch's default).
    multiprocessing_context: how loader workers start (``num_workers > 0``): ``forkserver`` (they fork
        from a server process that imported torch and the dataset code before any thread ran, see
        :func:`worker_context`), ``fork`` (from this process: faster, but a worker inherits every lock
        another thread of this process held at that instant, and can hang on it) or ``spawn``.
    progress: show progress bars while cleaning, training the tokenizer and building shards.
    executor: ``data.executor``: ``tasks`` (pieces each source is split into) and how
        ``python -m bnlit.prepare`` runs the stages (``kind: local`` or ``slurm``).
    """

    def __init__(
        self,
        sources: Sequence[Mapping[str, Any]],
        tokenizer: Mapping[str, Any],
        seq_len: int,
        batch_size: int,
        cache_dir: str,
        output_dir: str | None = None,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        pin_memory: bool = False,
        num_proc: int | str = 1,
        seed: int = 0,
        weight_unit: str = "tokens",
        prefetch_factor: int | None = None,
        multiprocessing_context: str = "forkserver",
        clean: Mapping[str, Any] | None = None,
        progress: bool = True,
        executor: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        progress_bars.ENABLED = progress
        if not sources:
            raise ConfigError("data.sources is empty; list at least one source")
        self.sources = [Source(**dict(s), field=f"data.sources[{i}]") for i, s in enumerate(sources)]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources: names must be unique, got {names}")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction}: must be in (0, 1)")
        if weight_unit not in WEIGHT_UNITS:
            raise ConfigError(f"data.weight_unit={weight_unit!r}: use one of {list(WEIGHT_UNITS)}")
        self.weight_unit = weight_unit
        self.tokenizer_cfg = dict(tokenizer)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.cache_dir = Path(cache_dir).expanduser()
        self.output_dir = Path(output_dir) if output_dir else None
        self.val_fraction, self.seed = val_fraction, seed
        self.num_workers, self.pin_memory, self.num_proc = num_workers, pin_memory, num_proc
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.tokenizer: Tokenizer | None = None
        self.index: dict | None = None
        self.shard_dir: Path | None = None
        self._resume: dict[str, int] | None = None  # sampler position from a checkpoint
        # normalise -> filter -> dedup -> decontaminate (bnlit/data/pipeline.py); None: off
        self.clean_cfg = CleanConfig.from_dict(clean)
        self.clean_dir: Path | None = None
        self.clean_stats: dict | None = None
        self.report: dict | None = None
        self._report_logged = False
        self._logged_mixture: dict | None = None
        # data.executor: how the build's datatrove stages run (conf/data/executor/); a training run
        # builds with LocalPipelineExecutor, num_proc tasks at a time
        self.executor = dict(executor or {"kind": "local", "tasks": 1})
        self._timing: dict[str, float] = {}

    # ---- building -------------------------------------------------------------------------
    def _resolve(self) -> list[tuple[Source, Path | None]]:
        resolved = []
        for s in self.sources:
            if s.is_embedded:
                files = embedded.materialize(self.cache_dir / "embedded")
                lang = s.path.split(":", 1)[1]
                if lang not in files:
                    raise ConfigError(f"{s.field}.path={s.path!r}: embedded languages are {sorted(files)}")
                resolved.append((s, files[lang]))
            elif s.path is not None:
                path = Path(s.path).expanduser()
                check_exists(path, f"{s.field}.path")
                resolved.append((s, path))
            else:
                resolved.append((s, None))
        return resolved

    def plan(self) -> Plan:
        """What the data build makes and where (bnlit/data/pipeline.py); checks the inputs it can
        before any work: the files exist, a given tokenizer has the model's vocabulary size."""
        cfg = self.tokenizer_cfg
        if cfg.get("path"):
            tok = Tokenizer(cfg["path"])
            if tok.vocab_size != cfg["vocab_size"]:
                raise TokenizerError(
                    f"tokenizer.path: {cfg['path']} has {tok.vocab_size} tokens but "
                    f"model.config.vocab_size={cfg['vocab_size']}; set model.config.vocab_size={tok.vocab_size} "
                    "or train a tokenizer of that size"
                )
        resolved = self._resolve()
        evals = []
        if self.clean_cfg.enabled:
            for i, item in enumerate(self.clean_cfg.decontam.eval_files):
                spec = {"path": item} if isinstance(item, str) else dict(item)
                path = Path(spec["path"]).expanduser()
                src = Source(name=spec.get("name") or path.stem, language="eval", path=str(path),
                             text_field=spec.get("text_field", "text"), sample_by=spec.get("sample_by", "line"),
                             field=f"data.clean.decontam.eval_files[{i}]")
                check_exists(path, f"{src.field}.path")
                evals.append((src, path))
        return plan_data([s for s, _ in resolved], [p for _, p in resolved], [fingerprint(s, p) for s, p in resolved],
                         self.clean_cfg, self.val_fraction, self.cache_dir, self.tokenizer_cfg, seed=self.seed,
                         tasks=int(self.executor.get("tasks", 1)), eval_sources=evals)

    def _build(self) -> None:
        if self.tokenizer is not None:
            return
        plan = self.plan()
        cached = plan.clean_done()
        run_local(plan, workers=workers(self.num_proc), quiet=True, on_group=lambda group, seconds: self._timing.update({group: seconds}))
        if plan.clean_dir is not None:
            self.clean_dir, self.clean_stats = plan.clean_dir, load_stats(plan.clean_dir)
            st = self.clean_stats["sources"].values()
            progress_bars.stage_summary(
                "clean", f"{'reused: ' if cached else ''}kept {sum(x['kept_docs'] for x in st)} of "
                f"{sum(x['input_docs'] for x in st)} documents ({progress_bars.human(sum(x['kept_chars'] for x in st))} of "
                f"{progress_bars.human(sum(x['input_chars'] for x in st))} characters) in {plan.clean_dir}",
                self._timing.get("clean", 0.0))
        if "tokenizer" not in self._timing:
            log.info("data: tokenizer %s %s", "given:" if plan.tokenizer_given else "reused from", plan.tokenizer_path)
        self.tokenizer = Tokenizer(plan.tokenizer_path)
        self.shard_dir = plan.shard_dir()
        # every block against the index's checksum, once per node (local rank zero), before training
        self.index = load_index(self.shard_dir, verify=self.trainer is None or self.trainer.local_rank == 0)
        tokens = {split: sum(e[split]["tokens"] for e in self.index["sources"].values()) for split in ("train", "val")}
        progress_bars.stage_summary("shards", f"{progress_bars.human(tokens['train'])} training and "
                                    f"{progress_bars.human(tokens['val'])} validation tokens in {self.shard_dir}",
                                    self._timing.get("shards", 0.0))
        self.report = build_report(self.index, self.clean_stats, self.shard_dir, self.clean_dir)

    def prepare_data(self) -> None:
        self._build()
        if self.output_dir is not None:
            self.tokenizer.save(self.output_dir / TOKENIZER_FILE)
            write_report(self.output_dir, self.report)

    def setup(self, stage: str | None = None) -> None:
        self._build()
        self.train_sets = [
            PackedWindows(read_tokens(self.shard_dir, self.index, s.name, "train"), self.seq_len)
            for s in self.sources
        ]
        empty = [s.name for s, d in zip(self.sources, self.train_sets) if len(d) == 0]
        if empty:
            raise ConfigError(f"data.sources: {empty} have fewer than data.seq_len={self.seq_len} + 1 "
                              "training tokens; add text or lower data.seq_len")
        self._set_mixture()
        if self.trainer is not None and not self._report_logged:
            log_report(self.trainer, self.report)
            self._report_logged = True
        self.val_sets = {}
        for lang in self.languages:
            parts = [PackedWindows(read_tokens(self.shard_dir, self.index, s.name, "val"), self.seq_len)
                     for s in self.sources if s.language == lang]
            parts = [p for p in parts if len(p)]
            if parts:
                self.val_sets[lang] = ConcatDataset(parts)
        missing = [lang for lang in self.languages if lang not in self.val_sets]
        if missing:
            raise ConfigError(f"data.val_fraction={self.val_fraction} holds out fewer than data.seq_len="
                              f"{self.seq_len} + 1 tokens of language {missing}; raise data.val_fraction or add documents")

    def _set_mixture(self) -> None:
        """Token sampling weights from the configured weights and ``weight_unit``, and the shares
        they deliver (``self.mixture``, per language, in characters and tokens)."""
        train = self.split_stats("train")
        cpt = {s.name: chars_per_token(train[s.name]["chars"], train[s.name]["tokens"], train[s.name]["docs"])
               for s in self.sources}
        configured = {s.name: s.weight for s in self.sources}
        if self.weight_unit == "chars":
            weights = token_weights_for_char_shares(configured, cpt)
        else:
            weights = configured
        self.sampling_weights = [weights[s.name] for s in self.sources]
        langs = {s.name: s.language for s in self.sources}
        counts = mixture_counts([len(d) for d in self.train_sets], self.sampling_weights,
                                sum(len(d) for d in self.train_sets))
        tokens, chars = effective_shares(dict(zip(configured, counts)), cpt)
        total = sum(configured.values())
        self.mixture = {
            "unit": self.weight_unit,
            "chars_per_token": cpt,
            "sampling_weights": weights,
            "intended": by_language({k: v / total for k, v in configured.items()}, langs),
            "tokens": by_language(tokens, langs),
            "chars": by_language(chars, langs),
        }
        if self.mixture == self._logged_mixture:  # setup runs for validate and again for fit: say it once
            return
        self._logged_mixture = self.mixture
        for lang, want in self.mixture["intended"].items():
            log.info("mixture %s: intended %.1f%% of %s; delivers %.1f%% of tokens, %.1f%% of characters",
                     lang, 100 * want, self.weight_unit, 100 * self.mixture["tokens"][lang], 100 * self.mixture["chars"][lang])

    # ---- introspection for callbacks -------------------------------------------------------
    @property
    def languages(self) -> list[str]:
        return list(dict.fromkeys(s.language for s in self.sources))

    @property
    def val_languages(self) -> list[str]:
        return list(self.val_sets)

    def split_stats(self, split: str) -> dict[str, dict[str, int]]:
        """Documents, characters, bytes and tokens of each source's ``split``."""
        return {name: dict(e[split], language=e["language"]) for name, e in self.index["sources"].items()}

    def val_tokens(self, language: str) -> np.ndarray:
        """All held-out tokens of one language, concatenated (for evaluation callbacks)."""
        arrays = [np.asarray(read_tokens(self.shard_dir, self.index, s.name, "val"))
                  for s in self.sources if s.language == language]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

    # ---- loaders ---------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        """This process's global rank and the world size (0, 1 without a trainer)."""
        return (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)

    def _loader(self, dataset, sampler=None, drop_last=False) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            # Ctrl-C and seeding: see bnlit.interrupt
            worker_init_fn=(partial(worker_ignores_interrupts, rank=self._rank_world()[0], seed=seed_workers())
                            if self.num_workers > 0 else None),
            # batches each worker keeps ready (torch's default, 2, when None); workers only
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            multiprocessing_context=worker_context(self.multiprocessing_context) if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        sampler = MixtureSampler(
            [len(d) for d in self.train_sets],
            self.sampling_weights,
            seed=self.seed,
            rank=rank,
            world_size=world,
        )
        if self._resume is not None:  # a checkpoint's position, resharded for this world size
            sampler.start = resume_start(self._resume, world, self.batch_size)
            if sampler.start >= len(sampler):  # saved right at the end of an epoch
                sampler.start = 0
            self._resume = None
        return self._loader(ConcatDataset(self.train_sets), sampler=sampler, drop_last=True)

    def val_dataloader(self) -> list[DataLoader]:
        return [self._loader(d) for d in self.val_sets.values()]

    def state_dict(self) -> dict[str, Any]:
        state = {"tokenizer_model": self.tokenizer.model_bytes, "tokenizer_sha256": self.tokenizer.sha256,
                 "val_languages": self.val_languages, "seq_len": self.seq_len}
        if self.trainer is not None:
            # Lightning counts the batches this rank consumed in the current epoch, restored ones
            # included; every rank consumed the same number, so rank zero's count speaks for all
            batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            state["position"] = {"epoch": self.trainer.current_epoch, "samples_per_rank": batches * self.batch_size,
                                 "world_size": self.trainer.world_size, "batch_size": self.batch_size}
            state["rng"] = gather_rng_states()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampler position and this rank's RNG states from a checkpoint."""
        if "position" not in state:
            return
        rank, world = self._rank_world()
        resume_start(state["position"], world, self.batch_size)  # refuse an unshardable resume now
        self._resume = dict(state["position"])
        rngs = state.get("rng") or []
        if len(rngs) == world:
            set_rng_state(rngs[rank])
