"""Checkpoint hygiene and interrupt-safe stops.

- ``ckpt_path=last`` resumes from the newest *complete* checkpoint by its ``global_step``, not by
  file name or mtime (:func:`newest_checkpoint`); a file that does not open is skipped.
- Temporary files of a write that was killed (:data:`TMP_MARK`) are removed at the next start
  (:func:`remove_partial_writes`).
- A resumed run keeps ``save_top_k`` step checkpoints across what the earlier process left
  (:func:`adopt_step_checkpoints`), and a SLURM job that was requeued resumes by itself
  (:func:`requeued_slurm_job`).
- SIGTERM, SIGUSR1/2 and Ctrl-C are latched (:class:`SignalLatch`): the run finishes the optimizer
  step it is in, every rank agrees on that step, a checkpoint is written atomically, and the run
  stops with :class:`Interrupted`. ``callbacks/interrupt.py`` is the Lightning adapter.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bnlit.errors import ConfigError

log = logging.getLogger("bnlit")

ABORT_AFTER = 3  # this many Ctrl-C stop a run that cannot reach the end of its step (a hang)
TMP_MARK = ".tmp"  # AtomicCheckpointIO writes ``.<name>.tmp<pid>`` next to ``<name>``
LAST = "last.ckpt"


def tmp_name(path: Path) -> Path:
    """Where :class:`~bnlit.ckpt_io.AtomicCheckpointIO` writes ``path`` before renaming it."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The ``global_step`` saved in a checkpoint, or ``None`` when the file is not a complete
    checkpoint. Tensors are memory-mapped, not read: this costs milliseconds even for a 1b model."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # truncated zip, foreign pickle, a directory, a vanished file: not complete
        return None
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    return int(step) if isinstance(step, int) else None


def checkpoint_steps(checkpoint_dir: Path) -> dict[Path, int]:
    """``{file: global_step}`` of the complete ``*.ckpt`` files in ``checkpoint_dir``."""
    if not checkpoint_dir.is_dir():
        return {}
    steps = {p: checkpoint_step(p) for p in sorted(checkpoint_dir.glob("*.ckpt")) if p.is_file()}
    return {p: s for p, s in steps.items() if s is not None}


def newest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The complete checkpoint with the highest ``global_step`` (a step file before ``last.ckpt``
    of the same step: it names the step in the resume line)."""
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        return None
    return max(steps, key=lambda p: (steps[p], p.name != LAST, p.name))


def remove_partial_writes(checkpoint_dir: Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that were killed; return what was removed."""
    if not checkpoint_dir.is_dir():
        return []
    gone = [p for p in checkpoint_dir.glob(f".*{TMP_MARK}*") if p.is_file()]
    for p in gone:
        p.unlink(missing_ok=True)
        log.info("removed %s: the partial write of a killed process", p)
    return gone


def requeued_slurm_job() -> bool:
    """True in a SLURM job that was requeued (preempted, or requeued before its time limit): it
    reruns the same command, which must continue from its checkpoints."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


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
            Path(p).unlink(missing_ok=True)
            log.info("save_top_k=%d: removed %s", callback.save_top_k, p)
    return drop


class Interrupted(BaseException):
    """Raised at the end of the optimizer step in which a stop signal arrived, after the
    checkpoint is written. A ``BaseException``, like ``KeyboardInterrupt``: nothing on the way
    out may swallow it."""

    def __init__(self, signum: int, step: int, path: Path | None, rank_zero: bool = True,
                 then: Callable[[], Any] | None = None):
        self.signum, self.step, self.path, self.rank_zero = signum, step, path, rank_zero
        self.then = then  # run after the message: requeue the SLURM job (rank zero)
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process killed by the signal

    def message(self, run_dir: Path) -> str:
        where = self.path
        if where is not None:
            try:
                where = where.resolve().relative_to(run_dir.resolve())
            except ValueError:
                pass
        saved = f"saved {where}" if where is not None else "no checkpoint saved"
        return (f"interrupted at step {self.step}: {saved}; resume with ckpt_path=last "
                f"hydra.run.dir={run_dir}")


def signal_number(name: str | int) -> int:
    """``"SIGTERM"``/``"TERM"``/``15`` -> 15, or a one-line error naming the setting."""
    try:
        if isinstance(name, int):
            return int(signal.Signals(name))
        key = str(name).upper()
        return int(getattr(signal.Signals, key if key.startswith("SIG") else f"SIG{key}"))
    except (AttributeError, ValueError):
        raise ConfigError(f"callbacks.interrupt.signals: {name!r} is not a signal; use names such as "
                              "SIGTERM, SIGINT, SIGUSR1") from None


class SignalLatch:
    """Catches stop signals and remembers the first; never raises inside a handler, so a signal
    that arrives during a checkpoint write (a second Ctrl-C) cannot tear it.

    ``install`` remembers the handlers it replaces: a handler that was there before the trainer
    started (submitit's requeue on its preemption signal) is called by :meth:`chain` once the
    checkpoint is on disk."""

    def __init__(self, signals: Iterable[str | int]):
        self.signums = [signal_number(s) for s in signals]
        self.received: int | None = None
        self.ctrl_c = 0
        self._installed: dict[int, Any] = {}
        self.outer: dict[int, Any] = {}

    def remember_outer(self) -> None:
        """Record the handlers of the program around the trainer (call before Lightning installs its own)."""
        self.outer = {s: signal.getsignal(s) for s in self.signums}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signums:
            self._installed[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._installed.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._installed = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.ctrl_c += signum == signal.SIGINT
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signum
            msg = f"{name} received: finishing this optimizer step, then saving a checkpoint and stopping"
        elif self.ctrl_c >= ABORT_AFTER:
            os.write(2, f"\n{name} received {self.ctrl_c} times: stopping without saving\n".encode())
            raise KeyboardInterrupt  # a write in progress leaves only its temporary file
        else:
            msg = (f"{name} received again: still saving; the checkpoint write is atomic "
                   f"(Ctrl-C {ABORT_AFTER} times stops without saving)")
        os.write(2, f"\n{msg}\n".encode())  # print() is not safe inside a signal handler

    def chain(self) -> bool:
        """Call the outer handler of the received signal, if it is a Python function (submitit's
        checkpoint-and-requeue); SIG_DFL, SIG_IGN and Python's KeyboardInterrupt are not chained."""
        h = self.outer.get(self.received) if self.received is not None else None
        if not callable(h) or h is signal.default_int_handler:
            return False
        h(self.received, None)
        return True


def worker_ignores_interrupts(worker_id: int) -> None:
    """``DataLoader(worker_init_fn=...)``: a Ctrl-C in a terminal reaches the data-loader workers
    too, and a worker that gets it exits, so the trainer's next batch fails before the interrupt
    checkpoint is written. Workers ignore SIGINT; the trainer decides. Keeps Lightning's worker
    seeding (``seed_everything(workers=True)``), which a custom ``worker_init_fn`` replaces."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id)


def agree(flag: int, strategy: Any) -> int:
    """The largest ``flag`` over all ranks (one small all-reduce under torch.distributed), so every
    rank stops after the same optimizer step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([flag], device=strategy.root_device, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def requeue_slurm_job(run: Callable[..., Any] = subprocess.call) -> bool:
    """``scontrol requeue`` this SLURM job (from rank zero); True when SLURM accepted it."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    ok = run(["scontrol", "requeue", job]) == 0
    log.info("scontrol requeue %s: %s", job, "requeued" if ok else "refused")
    return ok
