"""Reporting helpers shared by callbacks: tables to every logger that understands them (a
``wandb.Table`` for W&B) and to a JSON file in the run directory for users without W&B."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger


def run_dir(trainer: L.Trainer) -> Path:
    """The run's output directory (Hydra's run dir, which is ``trainer.default_root_dir``)."""
    return Path(trainer.default_root_dir)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)
    return path


def log_table(trainer: L.Trainer, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Log ``rows`` under ``key`` (e.g. ``tok/fertility``) as a W&B table where a WandbLogger is
    attached, and write ``<run dir>/tables/<key with / as _>.json`` on global rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_table(key=key, columns=list(columns), data=[list(r) for r in rows])
    name = key.replace("/", "_") + ".json"
    write_json_atomic(run_dir(trainer) / "tables" / name,
                      {"columns": list(columns), "rows": [list(r) for r in rows], "step": trainer.global_step})
