"""Everything about checkpoint files: what one holds, how it is written, read, validated and resumed.

A bnlit checkpoint is a Lightning checkpoint (weights, optimizer and scheduler states, loop
counters) plus two entries of our own:

- ``model_config``: the :class:`~bnlit.model.ModelConfig` fields, written by
  ``LMModule.on_save_checkpoint``; :func:`check_resume` compares every field with the configured
  model before a resume.
- the data module's state, which Lightning stores under the data module class's ``__qualname__``
  (:func:`datamodule_key`): the tokenizer's bytes, the sampler position and every rank's RNG
  states. ``BnDataModule.state_dict``/``load_state_dict`` write and restore it; the sampler maths
  lives with the sampler in :mod:`bnlit.data.dataset` (``resume_start``).

Writes are atomic (:class:`AtomicCheckpointIO`; an FSDP2 run's sharded, asynchronous saves:
:class:`ShardedWriter`); reads use ``weights_only=True`` and fail in one
line naming the file (:func:`read_checkpoint`, :func:`load_model`); the resume policy
(:func:`resolve_ckpt_path`, :func:`prepare_resume`) refuses a fresh run over old checkpoints,
a missing file or a model of another shape before anything expensive starts.

Hygiene:

- ``ckpt_path=last`` resumes from the newest *complete* checkpoint by its ``global_step``, not by
  file name or mtime (:func:`newest_checkpoint`); a file that does not open is skipped.
- Temporary files of a write that was killed (:data:`TMP_MARK`) are removed at the next start
  (:func:`remove_partial_writes`).
- A resumed run keeps ``save_top_k`` step checkpoints across what the earlier process left
  (:func:`adopt_step_checkpoints`), and a SLURM job that was requeued resumes from its newest
  checkpoint by itself (:func:`resolve_ckpt_path` with :func:`bnlit.interrupt.requeued_slurm_job`).

Signals, the stop latch and SLURM requeue are :mod:`bnlit.interrupt`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import pickle
import shutil
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy

from bnlit.data.datamodule import BnDataModule
from bnlit.errors import CheckpointError
from bnlit.evaluation.heldout import empty_transformer
from bnlit.interrupt import requeued_slurm_job
from bnlit.model import ModelConfig, Transformer
from bnlit.storage import storage_cause
from bnlit.strategy import strategy_class
from bnlit.tokenizer import Tokenizer

log = logging.getLogger("bnlit")

TMP_MARK = ".tmp"  # AtomicCheckpointIO writes ``.<name>.tmp<pid>`` next to ``<name>``
LAST = "last.ckpt"


def tmp_name(path: Path) -> Path:
    """Where :class:`AtomicCheckpointIO` writes ``path`` before renaming it."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The ``global_step`` saved in a checkpoint, or ``None`` when the file is not a complete
    checkpoint. Tensors are memory-mapped, not read: this costs milliseconds even for a 1b model.
    A sharded (DCP) directory counts only when complete (:func:`sharded_complete`); its step is
    read from rank 0's ``meta.pt``, not from the shards."""
    if Path(path).is_dir():
        if not sharded_complete(path):
            return None
        path = Path(path) / SHARDED_MARKERS[-1]
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # truncated zip, foreign pickle, a directory, a vanished file: not complete
        return None
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    return int(step) if isinstance(step, int) else None


def checkpoint_steps(checkpoint_dir: Path) -> dict[Path, int]:
    """``{path: global_step}`` of the complete ``*.ckpt`` files and sharded directories in ``checkpoint_dir``."""
    if not checkpoint_dir.is_dir():
        return {}
    steps = {p: checkpoint_step(p) for p in sorted(checkpoint_dir.glob("*.ckpt"))}
    return {p: s for p, s in steps.items() if s is not None}


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The complete checkpoint with the highest ``global_step`` (a step file before ``last.ckpt``
    of the same step: it names the step in the resume line)."""
    return newest_step(checkpoint_dir)[1]


def newest_step(checkpoint_dir: Path) -> tuple[int, Path | None]:
    """``(step, path)`` of :func:`newest_checkpoint`, from one look at the files; ``(0, None)``: none."""
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        return 0, None
    path = max(steps, key=lambda p: (steps[p], p.name != LAST, p.name))
    return steps[path], path


def earlier_checkpoint(checkpoint_dir: Path) -> str:
    """What a failed save left to resume from, for its error line: the newest complete checkpoint, or none."""
    step, path = newest_step(checkpoint_dir)
    if path is None:
        return "no earlier checkpoint exists: a rerun starts from step 0"
    return f"the newest earlier checkpoint, {path.name} at step {step}, is intact"


def remove_partial_writes(checkpoint_dir: Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that were killed; return what was removed."""
    if not checkpoint_dir.is_dir():
        return []
    gone = [p for p in checkpoint_dir.glob(f".*{TMP_MARK}*") if p.is_file() or p.is_dir()]
    gone += [p for p in checkpoint_dir.glob(".*.old*") if p.is_dir()]  # a sharded re-save's replaced directory
    for p in gone:
        _remove_checkpoint_path(p)
        log.info("removed %s: the partial write of a killed process", p)
    return gone


def newest_k(steps: dict[str, int], k: int) -> tuple[set[str], set[str]]:
    """Split ``{path: step}`` into the ``k`` highest steps (kept) and the rest (dropped);
    ``k < 0`` keeps everything."""
    order = sorted(steps, key=lambda p: (steps[p], p), reverse=True)
    keep = set(order if k < 0 else order[:k])
    return keep, set(order) - keep


def adopt_step_checkpoints(callback: Any, checkpoint_dir: Path, global_step: int, delete: bool) -> set[str]:
    """Make a ``ModelCheckpoint`` with ``monitor="step", mode="max"`` count the step files an
    earlier process of this run left (up to ``global_step``, the step resumed from) towards its
    ``save_top_k``, and drop the oldest beyond it now (``delete`` on rank zero only). Returns the
    dropped paths. Other monitors keep Lightning's own bookkeeping."""
    if callback.monitor != "step" or callback.mode != "max" or callback.save_top_k == 0 or not callback.dirpath:
        return set()
    if Path(callback.dirpath).resolve() != checkpoint_dir.resolve():
        return set()
    known = {str(p): float(v) for p, v in callback.best_k_models.items()}
    for p, s in checkpoint_steps(checkpoint_dir).items():
        if p.name != LAST and s <= global_step:
            known.setdefault(os.path.join(callback.dirpath, p.name), float(s))
    keep, drop = newest_k({p: int(s) for p, s in known.items()}, callback.save_top_k)
    callback.best_k_models = {p: torch.tensor(known[p]) for p in keep}
    if keep:
        oldest, newest = min(keep, key=known.get), max(keep, key=known.get)
        callback.kth_best_model_path, callback.kth_value = oldest, torch.tensor(known[oldest])
        callback.best_model_path, callback.best_model_score = newest, torch.tensor(known[newest])
    if delete:
        for p in drop:
            if Path(p).is_dir():  # a sharded checkpoint
                shutil.rmtree(p, ignore_errors=True)
            else:
                Path(p).unlink(missing_ok=True)
            log.info("save_top_k=%d: removed %s", callback.save_top_k, p)
    return drop


MODEL_PREFIX = "model."  # LMModule holds the transformer as self.model
# ModelConfig fields a resume may change: a label and an init-only scale; every other field
# (including ones added later) must match the checkpoint's
RESUME_MAY_DIFFER = frozenset({"name", "init_std"})


# -- writing ------------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with write-then-rename saves and ``weights_only`` loads.

    A save serializes to a temporary file in the target directory, fsyncs it, ``os.replace``-s it
    over the target and fsyncs the directory: a process killed or a disk that fills up mid-save
    leaves the previous ``last.ckpt`` untouched (Lightning's own ``_atomic_save`` writes into the
    final path and can leave a truncated file behind)."""

    def __init__(self):
        super().__init__()
        self._preloaded: dict[str, dict[str, Any]] = {}

    def preload(self, path, checkpoint: dict[str, Any]) -> None:
        """Hand over a checkpoint the caller already read (and validated): the next
        ``load_checkpoint(path)`` returns it, and drops it, instead of reading the file again."""
        self._preloaded[str(path)] = checkpoint

    def _serialize(self, checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        torch.save(checkpoint, f)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(path)
        start = time.perf_counter()
        try:
            with open(tmp, "wb") as f:
                self._serialize(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as failed:
            with contextlib.suppress(OSError):
                tmp.unlink()
            # a full disk inside torch.save surfaces as the zip writer's "unexpected pos" RuntimeError,
            # raised while the OSError that caused it is being handled
            e = failed if isinstance(failed, OSError) else storage_cause(failed)
            if e is None:
                raise
            hint = {errno.ENOSPC: "free disk space or point paths.checkpoint_dir elsewhere",
                    errno.EDQUOT: "free space in your quota or point paths.checkpoint_dir elsewhere",
                    errno.EFBIG: "raise this process's file-size limit (ulimit -f) or lower the model's size",
                    }.get(e.errno, "check the directory")
            raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}; {hint} "
                                  f"({earlier_checkpoint(path.parent)})") from None
        _fsync_dir(path.parent)
        # serialised, written and synced (scripts/gpu_check.py reads this line)
        log.info("checkpoint: saved %s (%.2f GiB) in %.1f s at step %s", path.name, path.stat().st_size / 2**30,
                 time.perf_counter() - start, checkpoint.get("global_step", "?"))

    def load_checkpoint(self, path, map_location: Callable | Any = None, weights_only: bool | None = True) -> dict[str, Any]:
        cached = self._preloaded.pop(str(path), None)
        if cached is not None:
            return cached
        return super().load_checkpoint(path, map_location=map_location or "cpu",
                                       weights_only=True if weights_only is None else weights_only)


# -- sharded (torch DCP) writes, asynchronous ------------------------------------------------------

class ShardedWriter:
    """The sharded checkpoints of an FSDP2 run (:class:`bnlit.fsdp.FSDP2Strategy`): every rank
    writes its own shard of the model and optimizer through torch Distributed Checkpoint, rank 0
    writes the rest of Lightning's checkpoint (step, loops, scheduler, callbacks, the data module's
    sampler position and every rank's RNG states) as ``meta.pt``; nothing is gathered.

    Asynchronous (``async_save``): :func:`torch.distributed.checkpoint.async_save` copies this rank's
    shards into host memory (the step loop waits for that copy only) and writes them from a
    background thread over a process group of its own (gloo), so its collectives never interleave
    with training's. The previous save is awaited before the next starts and at teardown (the end
    of fit, an exception, SIGTERM/Ctrl-C through :mod:`bnlit.interrupt`).

    Complete or absent: the shards go to ``.<name>.tmp<pid>``; when DCP's ``.metadata`` index is on
    disk (rank 0's save future resolves after every rank's shard is written), rank 0 writes
    ``meta.pt`` (atomically), then renames the directory to ``<name>``: the rename is the completion
    marker, and a save killed before it leaves only a temporary directory that ``ckpt_path=last``
    never sees and the next start removes (:func:`remove_partial_writes`). Removals that
    ``save_top_k`` asks for while a save is in flight wait for it, so a crash never leaves fewer
    complete checkpoints than before the save. A second save of the same step (``ModelCheckpoint``'s
    ``last.ckpt`` after ``step*.ckpt``) is a symlink to the first, not a second write."""

    def __init__(self, async_save: bool = True):
        self.async_save = async_save
        self.group = None  # the gloo group the background writes use
        self.pending: Any = None  # this rank's future of the save in flight
        self.error: tuple[BaseException, Path] | None = None  # a failed save and its path
        self.last: tuple[int, Path] | None = None  # (step, path) of the newest save
        self.blocked_s: list[float] = []  # how long each save held the caller (scripts/bench.py)
        self._lock = threading.Lock()
        self._in_flight: Path | None = None  # rank 0: the final path of the save in flight
        self._removals: list[Path] = []

    def setup(self) -> None:
        """Every rank, once the default process group exists (a collective)."""
        import torch.distributed as dist

        if self.async_save and dist.is_available() and dist.is_initialized() and self.group is None:
            self.group = dist.new_group(backend="gloo")

    def save(self, state: dict[str, Any], meta: dict[str, Any], path: Path, tmp: Path, rank: int) -> None:
        """Save ``state`` (``state_dict`` and ``optimizer_<i>``: sharded tensors) and ``meta``
        (rank 0's) as the sharded checkpoint ``path``; ``path`` and ``tmp`` are the same on every rank."""
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.wait()
        step = meta.get("global_step")
        if self.last is not None and self.last[0] == step and self.last[1] != path:
            if rank == 0:
                _replace_with_link(path, self.last[1])
            self.blocked_s.append(time.perf_counter() - start)
            return
        buf = io.BytesIO()  # meta is small: serialized now, so it is this step's whatever happens next
        torch.save(meta, buf)
        finish = (lambda: _finish_sharded(tmp, path, buf.getvalue())) if rank == 0 else (lambda: None)
        self.last = (step, path)
        with self._lock:
            self._in_flight = path
        if self.async_save:
            self.pending = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
            self.pending.add_done_callback(lambda f: self._done(f, finish, path))
        else:
            try:
                dcp.save(state, checkpoint_id=tmp)
                finish()
            finally:
                self._after(path)
        self.blocked_s.append(time.perf_counter() - start)

    def _done(self, future, finish: Callable[[], None], path: Path) -> None:
        """In the writer thread: mark the checkpoint complete (rank 0), then the waiting removals."""
        try:
            future.result()
            finish()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self.error = (e, path)
        finally:
            self._after(path)

    def _after(self, path: Path) -> None:
        with self._lock:
            self._in_flight = None
            removals, self._removals = self._removals, []
        for p in removals:
            if p != path:
                _remove_checkpoint_path(p)

    def remove(self, path: str | os.PathLike) -> None:
        """Rank 0: remove a checkpoint (``save_top_k``), after the save in flight completes."""
        path = Path(path)
        with self._lock:
            if self._in_flight is not None:
                if path != self._in_flight:
                    self._removals.append(path)
                return
        _remove_checkpoint_path(path)

    def wait(self) -> None:
        """Block until the save in flight is on disk and marked complete; re-raise its failure."""
        if self.pending is not None:
            with contextlib.suppress(BaseException):
                self.pending.result()
            self.pending = None
        # the done-callback may still be running (meta.pt, rename) right after result() returns
        while True:
            with self._lock:
                if self._in_flight is None:
                    break
            time.sleep(0.005)
        if self.error is not None:
            (e, path), self.error = self.error, None
            raise CheckpointError(f"sharded checkpoint save failed ({type(e).__name__}: "
                                  f"{(str(e).strip().splitlines() or [''])[0][:160]}); {earlier_checkpoint(path.parent)}") from e


def _finish_sharded(tmp: Path, path: Path, meta: bytes) -> None:
    """Rank 0, after every shard and DCP's ``.metadata``: ``meta.pt``, then the directory's name."""
    marker = tmp / SHARDED_MARKERS[-1]
    part = tmp_name(marker)
    with open(part, "wb") as f:
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, marker)
    _fsync_dir(tmp)
    old = None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():  # the same name saved again (a resumed run reaching the same step)
        old = path.with_name(f".{path.name}.old{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    log.debug("saved sharded checkpoint %s", path)


def _replace_with_link(path: Path, target: Path) -> None:
    """``path`` becomes a relative symlink to the checkpoint ``target`` (of the same step)."""
    _remove_checkpoint_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, path.parent), path)


def _remove_checkpoint_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


# -- reading and validating -----------------------------------------------------------------------

def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a bnlit/Lightning checkpoint on the CPU with ``weights_only=True``.

    Raises:
        CheckpointError: one line naming the file and the fix, when the file is missing,
            truncated or corrupt, or is not a bnlit checkpoint (no ``state_dict``/``model_config``).
    """
    path = Path(path)
    if path.is_dir():
        return _read_sharded(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the last.ckpt or step*.ckpt "
                              "of a bnlit.train run (paths.checkpoint_dir)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason[:120]}); "
                              "use an earlier step*.ckpt or retrain") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model_config" not in ckpt:
        have = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"checkpoint {path} is not a bnlit training checkpoint (no state_dict/"
                              f"model_config; has {have}); pass a last.ckpt or step*.ckpt written by bnlit.train")
    return ckpt


SHARDED_MARKERS = (".metadata", "meta.pt")  # DCP's index, then Lightning's meta.pt: written last


def sharded_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete sharded (torch DCP) checkpoint directory, as Lightning's
    ``ModelParallelStrategy(save_distributed_checkpoint=True)`` writes it: DCP writes its ``.metadata``
    index after every rank's shard, and rank 0 writes ``meta.pt`` (step, loops, data module, config)
    after that; a directory lacking either is an interrupted save."""
    path = Path(path)
    return path.is_dir() and all((path / m).is_file() for m in SHARDED_MARKERS)


def _read_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint gathered into one full checkpoint dict on the CPU (one process, no
    process group): the same keys a full-file ``last.ckpt`` has."""
    if not sharded_complete(path):
        missing = [m for m in SHARDED_MARKERS if not (path / m).is_file()]
        raise CheckpointError(f"checkpoint {path} is a directory but not a complete sharded checkpoint "
                              f"(no {', '.join(missing)}: an interrupted save); use an earlier step directory")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    try:
        ckpt = _load_distributed_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - DCP raises many types; one line naming the directory
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"sharded checkpoint {path} cannot be read ({reason[:120]})") from None
    if "state_dict" not in ckpt or "model_config" not in ckpt:
        raise CheckpointError(f"sharded checkpoint {path} is not a bnlit training checkpoint "
                              f"(no state_dict/model_config; has {sorted(ckpt)[:8]})")
    return ckpt


def consolidate(sharded: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a sharded checkpoint directory as one full ``.ckpt`` file (atomically), which every
    bnlit tool and a full-file resume read."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} exists; pass a new path")
    ckpt = _read_sharded(Path(sharded))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(out)
    torch.save(ckpt, tmp)
    os.replace(tmp, out)
    return out


def datamodule_key() -> str:
    """Where Lightning puts the data module's ``state_dict()``: its class's ``__qualname__``."""
    return BnDataModule.__qualname__


def datamodule_state(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The data module's entry of a checkpoint (empty when it has none)."""
    return ckpt.get(datamodule_key()) or {}


def model_state(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The transformer's weights: the ``model.``-prefixed entries of the Lightning ``state_dict``,
    with the prefix (and ``torch.compile``'s ``_orig_mod.``, if any) removed."""
    out = {}
    for k, v in ckpt["state_dict"].items():
        if k.startswith(MODEL_PREFIX):
            out[k[len(MODEL_PREFIX):].replace("_orig_mod.", "")] = v
    return out


def checkpoint_tokenizer(ckpt: dict[str, Any], path: str | os.PathLike = "<checkpoint>") -> Tokenizer:
    model_bytes = datamodule_state(ckpt).get("tokenizer_model")
    if not model_bytes:
        raise CheckpointError(f"checkpoint {path} carries no tokenizer ({datamodule_key()}.tokenizer_model); "
                              f"it was not written by a bnlit.train run with {datamodule_key()}")
    return Tokenizer(bytes(model_bytes))


def load_model(path: str | os.PathLike) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Rebuild the trained transformer (eval mode, fp32, CPU), its tokenizer and the raw checkpoint."""
    ckpt = read_checkpoint(path)
    try:
        cfg = ModelConfig(**ckpt["model_config"])
    except TypeError as e:
        raise CheckpointError(f"checkpoint {path}: model_config does not match this bnlit's ModelConfig ({e}); "
                              "use the bnlit version that wrote it") from None
    model = empty_transformer(cfg)  # no init drawn: every weight comes from the file
    missing, unexpected = model.load_state_dict(model_state(ckpt), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path}: weights do not fit model_config {cfg.name} "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]}); the file is not from this model")
    tokenizer = checkpoint_tokenizer(ckpt, path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"checkpoint {path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                              f"only {cfg.vocab_size}; the checkpoint's tokenizer and model disagree")
    model.float().eval()
    return model, tokenizer, ckpt


# -- the resume policy ------------------------------------------------------------------------------

def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: Path, overwrite: bool) -> str | None:
    """``None``: a fresh run, refused if the run dir already holds checkpoints (unless
    ``overwrite``), except in a requeued SLURM job, which resumes; ``"last"``: the complete
    checkpoint of this run dir with the highest step; else an existing file."""
    existing = sorted(checkpoint_dir.glob("*.ckpt")) if checkpoint_dir.is_dir() else []
    if ckpt_path is None and existing and requeued_slurm_job() and not overwrite:
        log.info("requeued SLURM job (SLURM_RESTART_COUNT=%s): resuming from %s",
                 os.environ.get("SLURM_RESTART_COUNT"), checkpoint_dir)
        ckpt_path = "last"
    if ckpt_path is None:
        if existing and not overwrite:
            raise CheckpointError(f"{checkpoint_dir} already holds checkpoints of another run; resume with "
                                  "ckpt_path=last, choose a new hydra.run.dir, or pass overwrite=true")
        return None
    if ckpt_path == "last":
        newest = newest_checkpoint(checkpoint_dir)
        if newest is not None:
            return str(newest)
        torn = f" ({len(existing)} .ckpt files do not open: truncated or corrupt)" if existing else ""
        raise CheckpointError(f"ckpt_path=last: no complete checkpoint in {checkpoint_dir}{torn}; "
                              "set hydra.run.dir to the run you want to resume")
    if Path(ckpt_path).is_dir() and not sharded_complete(ckpt_path):
        raise CheckpointError(f"ckpt_path={ckpt_path}: a directory but not a complete sharded checkpoint (an "
                              "interrupted save); pass an earlier step directory or ckpt_path=last")
    if not Path(ckpt_path).is_file() and not Path(ckpt_path).is_dir():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such file; pass an existing .ckpt or ckpt_path=last")
    return ckpt_path


def check_resume(model_config: ModelConfig, ckpt_path: str, checkpoint: dict) -> None:
    """Refuse, in one line, a checkpoint whose model differs from the configured one in any
    :class:`~bnlit.model.ModelConfig` field but those in :data:`RESUME_MAY_DIFFER`."""
    saved = checkpoint["model_config"]  # read_checkpoint made sure it is there
    want = model_config.to_dict()  # with the dataclass defaults filled in
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RESUME_MAY_DIFFER]
    diff = [f"{k}={saved.get(k)} (config: {want.get(k)})" for k in fields if saved.get(k) != want.get(k)]
    if diff:
        raise CheckpointError(f"ckpt_path={ckpt_path} holds a {saved.get('name')} model of another shape: "
                              f"{', '.join(diff)}; resume with model={saved.get('name')} or start a fresh run")


def step_checkpoint_path(checkpoint_callback: Any, dirpath: Path, step: int, epoch: int) -> Path:
    """The file a checkpoint of ``step`` goes to: the ModelCheckpoint's own name for it when one
    names the place (``step0000037.ckpt``), else ``dirpath/step<step:07d>.ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if isinstance(checkpoint_callback, ModelCheckpoint) and checkpoint_callback.dirpath:
        return Path(checkpoint_callback.format_checkpoint_name({"step": step, "epoch": epoch}))
    return Path(dirpath) / f"step{step:07d}.ckpt"


def trainer_checkpoint_dir(trainer: Any) -> Path:
    """Where a running Trainer's checkpoints go: its ModelCheckpoint's dirpath, else
    ``<default_root_dir>/checkpoints``."""
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def loads_through_checkpoint_io(strategy: Any) -> bool:
    """Whether the strategy reads a checkpoint file through its ``CheckpointIO`` (so a
    preloaded checkpoint is used), rather than its own ``load_checkpoint`` (FSDP, DeepSpeed)."""
    return strategy_class(strategy).load_checkpoint is Strategy.load_checkpoint


def prepare_resume(ckpt_path: str | None, checkpoint_dir: Path, overwrite: bool, model_config: ModelConfig,
                   strategy: Any) -> tuple[str | None, AtomicCheckpointIO]:
    """The resume policy, applied before any expensive work: the checkpoint to resume from (or
    ``None``), read and validated against ``model_config``, and the run's CheckpointIO. The
    checkpoint is handed to that CheckpointIO when the strategy loads through it, so Lightning
    reads the file once; otherwise (FSDP loads files itself) no reference to it is kept."""
    ckpt_path = resolve_ckpt_path(ckpt_path, checkpoint_dir, overwrite)
    ckpt_io = AtomicCheckpointIO()
    if ckpt_path is not None:
        if sharded_complete(ckpt_path):  # the model config is in meta.pt: do not gather the shards
            checkpoint = torch.load(Path(ckpt_path) / SHARDED_MARKERS[-1], map_location="cpu", weights_only=True)
            if not isinstance(checkpoint, dict) or "model_config" not in checkpoint:
                raise CheckpointError(f"sharded checkpoint {ckpt_path} is not a bnlit training checkpoint "
                                      "(its meta.pt has no model_config)")
        else:
            checkpoint = read_checkpoint(ckpt_path)
        check_resume(model_config, ckpt_path, checkpoint)
        if loads_through_checkpoint_io(strategy):
            ckpt_io.preload(ckpt_path, checkpoint)
    return ckpt_path, ckpt_io


# -- names that moved to bnlit.interrupt ---------------------------------------------------------
# kept for code written before the move; their home is bnlit.interrupt
_MOVED = ('ABORT_AFTER', 'Interrupted', 'signal_number', 'SignalLatch', 'WORKER_IGNORED_SIGNALS', 'worker_ignores_interrupts', 'agree', 'requeue_slurm_job')


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module("bnlit.interrupt"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
