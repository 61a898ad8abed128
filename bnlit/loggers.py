"""What a run sends to its loggers while it trains, and the loggers themselves:

- :func:`log_metrics` and :func:`log_table`: what a callback sends to every attached logger (a
  table also goes to ``<run dir>/tables/<key>.json`` for users without W&B);
- :func:`run_tags`, :func:`sweep_group` and :func:`redact`: the W&B tags and group of a run, and
  the config dump handed to loggers with secrets (W&B/HF keys, tokens, passwords) removed;
- :class:`CSVLogger`: Lightning's ``CSVLogger`` with a resumable ``metrics.csv``. Lightning deletes
  the file when a logger opens a directory that holds one, so a resumed run lost every row of the
  run before the interruption. This one keeps them and drops only a row torn by a kill mid-write.
  Steps after the checkpoint are logged again by the resumed run;
  :func:`bnlit.run_report.read_metrics` keeps the last value of a step.

The end-of-run summary, plots and console lines are :mod:`bnlit.run_report`."""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig

SECRET_KEY = re.compile(r"(api_?key|token|secret|password|passwd)$", re.IGNORECASE)
SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
REDACTED = "<redacted>"


def log_metrics(trainer: L.Trainer, metrics: Mapping[str, float], callback_metrics: bool = False) -> None:
    """Send ``metrics`` to every attached logger at the current step, from global rank zero; with
    ``callback_metrics``, also publish them in ``trainer.callback_metrics`` on every rank (what
    ``train()`` returns and the final report prints).

    For values computed outside a logging step (a check that runs every n optimizer steps, a
    fit-start measurement): ``LightningModule.log`` would hold them until the next logging step."""
    if callback_metrics:
        for k, v in metrics.items():
            trainer.callback_metrics[k] = torch.tensor(float(v))
    if trainer.is_global_zero and metrics:
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=trainer.global_step)


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


def run_tags(cfg: DictConfig) -> list[str]:
    """W&B tags: the model preset, the hardware config, the data mixture, then ``cfg.tags``."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    trainer = choices.get("trainer") or f"{cfg.trainer.accelerator}x{cfg.trainer.devices}"
    sources = cfg.data.get("sources") or []
    total = sum(float(s.get("weight", 1.0)) for s in sources) or 1.0
    mix = "+".join(f"{s.name}{round(100 * float(s.get('weight', 1.0)) / total)}" for s in sources)
    return [f"model:{cfg.model.config.name}", f"trainer:{trainer}", f"data:{mix}", *map(str, cfg.get("tags") or [])]


def sweep_group() -> str | None:
    """Runs of one Hydra multirun share a W&B group: the sweep directory's name."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().sweep.dir).name
    return None


def redact(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts/lists) with secret-looking keys and any value equal to a
    secret environment variable replaced by ``<redacted>``."""
    secrets = {os.environ[v] for v in SECRET_ENV if os.environ.get(v)}
    # a key such as tokenizer.path or token counts is not a secret: only string leaves are checked
    def walk(x: Any, key: str = "") -> Any:
        if isinstance(x, Mapping):
            return {k: walk(v, str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, key) for v in x]
        if isinstance(x, str) and (x in secrets or (SECRET_KEY.search(key) and x)):
            return REDACTED
        return x

    return walk(obj)


# -- the CSV logger -------------------------------------------------------------------------------

def read_whole_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the complete rows of a CSV file: a last line without its newline, or a row
    with a missing or extra field, was torn by a kill and is dropped."""
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    reader = csv.DictReader(io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
    header = list(reader.fieldnames or [])
    rows = [r for r in reader if None not in r and None not in r.values()]
    return header, rows


def write_rows(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    """Write-then-rename: a kill during the rewrite leaves the old file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


class ResumableExperimentWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file():
            header, rows = read_whole_rows(path)
            self.metrics_keys = sorted(k for k in header if k)
            write_rows(path, self.metrics_keys, rows)


class CSVLogger(_CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to the metrics of the run it resumes."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self.logger_rank_zero():
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumableExperimentWriter(log_dir=self.log_dir)
        return super().experiment

    @staticmethod
    def logger_rank_zero() -> bool:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        return getattr(rank_zero_only, "rank", 0) == 0
