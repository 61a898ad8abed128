"""Atomic checkpoint files: serialize to a temporary file in the target directory, fsync, then
``os.replace`` it over the target and fsync the directory. A process killed or a disk that fills
up mid-save leaves the previous ``last.ckpt`` untouched; Lightning's own ``_atomic_save`` writes
into the final path and can leave a truncated file behind."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bnlit.checkpointing import tmp_name
from bnlit.errors import CheckpointError

log = logging.getLogger(__name__)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with write-then-rename saves and ``weights_only`` loads."""

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
        try:
            with open(tmp, "wb") as f:
                self._serialize(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            hint = "free disk space or point paths.checkpoint_dir elsewhere" if e.errno == errno.ENOSPC else "check the directory"
            raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}; {hint} "
                                  "(the previous checkpoint is intact)") from None
        _fsync_dir(path.parent)
        log.debug("saved checkpoint %s", path)

    def load_checkpoint(self, path, map_location: Callable | Any = None, weights_only: bool | None = True) -> dict[str, Any]:
        cached = self._preloaded.pop(str(path), None)
        if cached is not None:
            return cached
        return super().load_checkpoint(path, map_location=map_location or "cpu",
                                       weights_only=True if weights_only is None else weights_only)
