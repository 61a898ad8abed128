"""Interrupt-safe stops: SIGTERM, SIGUSR1/2 and Ctrl-C are latched (:class:`SignalLatch`), the run
finishes the optimizer step it is in, every rank agrees on that step (:func:`agree`), and the run
stops with :class:`Interrupted` once its checkpoint is written (by ``bnlit.callbacks.interrupt``,
through :mod:`bnlit.checkpointing`). A SLURM job stopped by a requeue signal is requeued
(:func:`requeue_slurm_job`), and a requeued job knows it is one (:func:`requeued_slurm_job`).
Data-loader workers ignore the stop signals (:func:`worker_ignores_interrupts`): the trainer decides.
Outside the training loop (config checks, data build, tokenizer, model set-up, the final
validation and report) there is no step to finish: :class:`StopAtOnce` stops the run at once, with
the same exit code and one line that says what to rerun.

Cost: nothing per step on one process; one all-reduce of an int under torch.distributed, so
that every rank stops after the same step (Lightning itself broadcasts a flag per step there).
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


def requeued_slurm_job() -> bool:
    """True in a SLURM job that was requeued (preempted, or requeued before its time limit): it
    reruns the same command, which must continue from its checkpoints."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


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
        if self.path is None:
            return (f"interrupted before the first checkpoint: nothing to resume; rerun the same command "
                    f"(hydra.run.dir={run_dir} may be reused)")
        where = self.path
        try:
            where = where.resolve().relative_to(run_dir.resolve())
        except ValueError:
            pass
        return (f"interrupted at step {self.step}: saved {where}; resume with ckpt_path=last "
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
        """Record the handlers of the program around the trainer (call before Lightning installs its own);
        bnlit's own :class:`StopAtOnce` is seen through, to the handler it replaced (submitit's)."""
        def outer(s: int) -> Any:
            h = signal.getsignal(s)
            return h.replaced.get(s) if isinstance(h, StopAtOnce) else h
        self.outer = {s: outer(s) for s in self.signums}

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
        if not callable(h) or h is signal.default_int_handler or isinstance(h, StopAtOnce):
            return False
        h(self.received, None)
        return True


class StopAtOnce:
    """The stop-signal handler outside the training loop: raises :class:`Interrupted` at once,
    naming the newest complete checkpoint (``newest()`` gives its step and path, or ``(0, None)``).
    Nothing there needs finishing: caches, shards, the tokenizer and checkpoints are written to a
    temporary name and renamed. ``bnlit.train`` installs it for the whole run; the
    :class:`SignalLatch` of ``bnlit.callbacks.interrupt`` replaces it during training and puts it
    back at teardown (and never chains to it). A requeue signal in a SLURM job requeues the job."""

    def __init__(self, signals: Iterable[str | int], newest: Callable[[], tuple[int, Path | None]],
                 requeue_signals: Iterable[str | int] = ()):
        self.signums = [signal_number(s) for s in signals]
        self.requeue = {signal_number(s) for s in requeue_signals}
        self.newest = newest
        self.replaced: dict[int, Any] = {}

    def install(self) -> dict[int, Any]:
        """Install for every stop signal; the handlers it replaced (for :func:`restore_handlers`, and
        for :meth:`SignalLatch.remember_outer`, which chains to them)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        self.replaced = {s: signal.signal(s, self) for s in self.signums}
        return dict(self.replaced)

    def __call__(self, signum: int, frame: Any) -> None:
        for s in self.signums:  # a second signal while this one unwinds stops the process outright
            signal.signal(s, signal.SIG_DFL)
        step, path = self.newest()
        then = requeue_slurm_job if signum in self.requeue and "SLURM_JOB_ID" in os.environ else None
        raise Interrupted(signum, step, path, then=then)


def restore_handlers(before: dict[int, Any]) -> None:
    """Put back handlers that :meth:`StopAtOnce.install` replaced (``None``: set outside Python)."""
    for s, h in before.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)


WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def worker_ignores_interrupts(worker_id: int, rank: int = 0, seed: bool | None = None) -> None:
    """``DataLoader(worker_init_fn=...)``: a Ctrl-C in a terminal reaches the data-loader workers
    too, and so do SLURM's signals (``scontrol requeue``'s SIGTERM, ``--signal``'s SIGUSR1/2 go to
    every process of the job step). A worker that gets one either exits (the trainer's next batch
    fails before the interrupt checkpoint is written) or runs the handler it inherited from the
    trainer (submitit's requeue: every worker of rank 0 would requeue the job). Workers ignore them;
    the trainer decides and shuts the workers down. Keeps Lightning's worker seeding
    (``seed_everything(workers=True)``), which a custom ``worker_init_fn`` replaces; ``rank`` is the
    trainer's global rank. ``seed``: whether to, as the trainer read it
    from ``PL_SEED_WORKERS`` (a worker started from a fork server sees the server's environment,
    not the trainer's); None reads the worker's own."""
    for sig in WORKER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if seed if seed is not None else seed_workers():
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank=rank)


def seed_workers() -> bool:
    """Whether ``seed_everything(workers=True)`` asked for seeded loader workers."""
    return os.environ.get("PL_SEED_WORKERS") == "1"


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
