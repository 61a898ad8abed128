"""Progress of the data build (cleaning, tokenizer training, shard building): tqdm bars, the
library Lightning's training bar uses, on stdout like it, and a one-line summary per stage.

:func:`bar` is the one constructor, so every stage looks alike (amount, rate, ETA when the total
is known); :data:`ENABLED` is switched by ``data.progress`` (``${trainer.enable_progress_bar}``).
:func:`stage_summary` logs the line a stage leaves behind. :func:`native_log_lines` turns the
log lines a C++ library writes to file descriptor 2 (SentencePiece's merge counter) into
progress, so tokenizer training is not a silent gap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

log = logging.getLogger("bnlit")
ENABLED = True
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
BAR_FORMAT_NO_TOTAL = None  # tqdm's own: "desc: 1234 doc [00:05, 246 doc/s]"


def bar(desc: str, total: float | None = None, unit: str = "doc", unit_scale: bool = False,
        enabled: bool | None = None) -> tqdm:
    """A progress bar for one data-build stage (disabled when ``data.progress`` is false)."""
    return tqdm(desc=desc, total=total, unit=unit, unit_scale=unit_scale, dynamic_ncols=True, file=sys.stdout,
                mininterval=0.5, smoothing=0.1, leave=False, disable=not (ENABLED if enabled is None else enabled),
                bar_format=BAR_FORMAT if total else BAR_FORMAT_NO_TOTAL)


class Timer:
    """Wall time of a stage: ``with Timer() as t: ...; t.seconds``."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *_) -> None:
        self.seconds = time.perf_counter() - self.start


def set_total(b: tqdm, total: float | None, desc: str | None = None, unit: str | None = None) -> None:
    """Restart ``b`` at 0 of ``total`` (a stage whose size became known), keeping its look."""
    if desc is not None:
        b.set_description(desc, refresh=False)
    if unit is not None:
        b.unit = unit
    b.bar_format = BAR_FORMAT if total else BAR_FORMAT_NO_TOTAL
    b.reset(total=total)


def stage_summary(stage: str, message: str, seconds: float) -> None:
    """The one line a finished stage leaves: ``data: <stage> <message> in <seconds> s``."""
    log.info("data: %s %s in %.1f s", stage, message, seconds)


def human(n: float) -> str:
    """4_200_000 -> '4.2M' (for summaries)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


@contextlib.contextmanager
def native_log_lines(on_line: Callable[[str], bool]) -> Iterator[None]:
    """Route what native code writes to file descriptor 2 through ``on_line`` for the duration;
    lines it does not consume (returns False) are passed on to the real stderr."""
    if not ENABLED:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump() -> None:
        with os.fdopen(read_fd, "r", errors="replace") as pipe:
            for line in pipe:
                if not on_line(line):
                    os.write(saved, line.encode("utf-8", "replace"))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees EOF
        thread.join(timeout=5)
        os.close(saved)


def run_total_steps(trainer) -> int | None:
    """Optimizer steps the run will take: ``max_steps``, or the epochs' worth when only
    ``max_epochs`` bounds it; None when neither does."""
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    batches = trainer.num_training_batches
    if trainer.max_epochs and trainer.max_epochs > 0 and batches != float("inf"):
        return trainer.max_epochs * max(1, int(batches) // trainer.accumulate_grad_batches)
    return None
