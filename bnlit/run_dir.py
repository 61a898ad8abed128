"""The run directory's record, written only once a run is accepted.

Hydra writes ``.hydra/{config,hydra,overrides}.yaml`` and opens ``<job name>.log`` before it calls
the task function, so a run that bnlit then refuses (a bad value, a resume that does not fit the
checkpoints) would already have overwritten another run's provenance. ``conf/hydra/default.yaml``
turns both off (``output_subdir: null``, a console-only ``job_logging``) and ``bnlit.train``
writes them here instead, after its checks: :func:`hold_log` keeps the log records of the checks
in memory, :func:`write_record` writes the three YAML files exactly as Hydra does and the held
records into ``train.log``. A refused run writes nothing, and :func:`remove_if_new` takes away
the empty directory Hydra made for it.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

STARTED = time.time()  # a directory made after this, and empty at a refusal, is this run's
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job log format
_existed: dict[Path, bool] = {}


def note_existing(path: str | os.PathLike) -> None:
    """Remember which of ``path`` and its ancestors exist now (before Hydra makes the run dir), so
    :func:`remove_if_new` removes only what this run created."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        _existed[q] = q.exists()


def remove_if_new(path: str | os.PathLike) -> list[Path]:
    """Remove ``path`` and its ancestors while each is an empty directory this run created (per
    :func:`note_existing`, or else made after this process started); return what was removed."""
    removed = []
    p = Path(path).absolute()
    while p != p.parent:
        if p in _existed:
            created = not _existed[p]
        else:  # not noted (a job of a launcher's own process): only the run dir itself, by its age
            created = not removed and _made_since_start(p)
        if not (created and p.is_dir() and not any(p.iterdir())):
            break
        try:
            p.rmdir()
        except OSError:
            break
        removed.append(p)
        p = p.parent
    return removed


def _made_since_start(p: Path) -> bool:
    try:
        return p.stat().st_ctime >= STARTED - 1.0
    except OSError:
        return False


class RunLog(logging.FileHandler):
    """The run's log file. A write the storage refuses (a full disk, ``ulimit -f``) ends the run like
    any other refused write, in ``bnlit.train``'s one line naming this file, instead of logging's
    "--- Logging error ---" traceback on every record after it while the run goes on."""

    def handleError(self, record: logging.LogRecord) -> None:
        from bnlit.storage import is_storage_error

        e = sys.exc_info()[1]
        if not is_storage_error(e):
            super().handleError(record)
            return
        logging.getLogger().removeHandler(self)
        raise OSError(e.errno, e.strerror, self.baseFilename) from e


_held: logging.handlers.MemoryHandler | None = None
_log_file: logging.Handler | None = None


def hold_log() -> None:
    """Keep every log record from now on in memory, until :func:`write_record` writes them to the
    run's log file or :func:`close_log` drops them."""
    global _held
    close_log()
    _held = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    logging.getLogger().addHandler(_held)


def close_log() -> None:
    """Detach and close the held records and the log file (the end of a job)."""
    global _held, _log_file
    for handler in (_held, _log_file):
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            with contextlib.suppress(OSError):  # a full disk refuses the last flush too
                handler.close()
    _held = _log_file = None


def write_record(task_cfg: DictConfig) -> None:
    """Write Hydra's record of the run (on global rank zero) and start ``<run dir>/<job name>.log``
    with the records held since :func:`hold_log` (on every rank, as Hydra's file handler did).
    Outside a Hydra app (``train(cfg)`` called directly) there is no record to write."""
    global _held, _log_file
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg
    out = Path(hydra_cfg.hydra.runtime.output_dir)
    if rank_zero_only.rank == 0:
        record = out / ".hydra"
        record.mkdir(parents=True, exist_ok=True)
        for name, cfg in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg),
                          ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
            (record / name).write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    fmt = OmegaConf.select(hydra_cfg, "hydra.job_logging.formatters.simple.format", default=None) or LOG_FORMAT
    _log_file = RunLog(out / f"{hydra_cfg.hydra.job.name}.log", encoding="utf-8")
    _log_file.setFormatter(logging.Formatter(fmt))
    if _held is not None:
        for record in _held.buffer:
            _log_file.handle(record)
        logging.getLogger().removeHandler(_held)
        _held.close()
        _held = None
    logging.getLogger().addHandler(_log_file)
