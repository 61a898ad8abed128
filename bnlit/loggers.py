"""What a run sends to its loggers while it trains, and the loggers themselves:

- :func:`log_metrics` and :func:`log_table`: what a callback sends to every attached logger (a
  table also goes to ``<run dir>/tables/<key>.json`` for users without W&B);
- :func:`run_tags`, :func:`sweep_job` and :func:`redact`: the W&B tags, and the group and name of
  a sweep's job, and the config dump handed to loggers with secrets (W&B/HF keys, tokens,
  passwords) removed; :func:`finish_wandb_run` ends a job's W&B run;
- :class:`WandbLogger`: Lightning's, without a W&B deprecation warning on every run;
- :class:`CSVLogger`: Lightning's ``CSVLogger`` with a resumable ``metrics.csv``. Lightning deletes
  the file when a logger opens a directory that holds one, so a resumed run lost every row of the
  run before the interruption. This one keeps them and drops only a row torn by a kill mid-write.
  Steps after the checkpoint are logged again by the resumed run;
  :func:`bnlit.run_report.read_metrics` keeps the last value of a step. A checkpoint carries its
  own step's row (:func:`checkpointed_row`), which Lightning logs only after the checkpoint is on
  disk; a run resumed from it writes the row if a kill in between lost it (:func:`restore_checkpointed_row`).

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
from lightning.pytorch.loggers import WandbLogger as _WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig

from bnlit import storage

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
    return storage.write_text(path, json.dumps(payload, indent=2, default=str))


def log_table(trainer: L.Trainer, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Log ``rows`` under ``key`` (e.g. ``tok/fertility``) as a W&B table where a WandbLogger is
    attached, and write ``<run dir>/tables/<key with / as _>.json`` on global rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, _WandbLogger):
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


def sweep_overrides(job_overrides: Sequence[str], given: Sequence[str]) -> list[str]:
    """The overrides that make one job of a sweep what it is: those of ``job_overrides`` whose key
    is swept on the multirun's command line (``given``: ``optimizer.lr=1e-3,3e-3`` gives the job
    ``optimizer.lr=0.001``) or is not on it at all (the parameters Optuna chose)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed = {o.get_key_element() for o in parser.parse_overrides(list(given)) if not o.is_sweep_override()}
    return [line for line, o in zip(job_overrides, parser.parse_overrides(list(job_overrides)))
            if o.get_key_element() not in fixed]


def sweep_job() -> dict[str, str]:
    """The W&B ``group`` and ``name`` of a job of a Hydra multirun (empty outside one): the sweep
    directory's name, and the job's own overrides, e.g. ``optimizer.lr=0.001`` (the whole command
    line's overrides when the sweep's own record, ``multirun.yaml``, is not there)."""
    group = sweep_group()
    if group is None:
        return {}
    hc = HydraConfig.get()
    job = list(hc.overrides.task)
    record = Path(hc.sweep.dir) / "multirun.yaml"
    try:
        import yaml

        given = yaml.safe_load(record.read_text())["hydra"]["overrides"]["task"]
    except (OSError, KeyError, TypeError, ValueError):
        given = []
    own = sweep_overrides(job, given) if given else job
    return {"group": group, "name": f"{hc.job.num}: {','.join(own) or hc.job.override_dirname or 'defaults'}"}


def finish_wandb_run(exit_code: int = 0) -> None:
    """Finish this process's W&B run, if one is active: Lightning's ``WandbLogger`` never finishes
    it, and reuses an active run, so without this every later job of a sweep in the same process
    would log into the first job's run."""
    import sys

    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        run.finish(exit_code=exit_code)


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
    """Write-then-rename: a kill or a full disk during the rewrite leaves the old file."""
    with storage.replacing(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)


class ResumableExperimentWriter(ExperimentWriter):
    """Keeps the rows of the run it resumes; a new metric's column rewrites the file
    write-then-rename (Lightning truncates it in place, so a full disk mid-rewrite lost every row);
    a refused append (full disk, file-size limit) names ``metrics.csv`` and leaves only a torn last
    row, which the resumed run drops."""

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file():
            header, rows = read_whole_rows(path)
            self.metrics_keys = sorted(k for k in header if k)
            write_rows(path, self.metrics_keys, rows)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        write_rows(path, fieldnames, read_whole_rows(path)[1])

    def save(self) -> None:
        try:
            super().save()
        except OSError as e:
            if e.filename:
                raise
            raise OSError(e.errno, e.strerror or str(e), self.metrics_file_path) from e


def checkpointed_row(trainer: L.Trainer) -> dict | None:
    """The metrics row Lightning will log for this optimizer step, when a checkpoint is saved in
    ``on_train_batch_end`` (the step's metrics are logged after those hooks, so a kill right after
    the checkpoint's rename lost the row); None elsewhere or when this step logs nothing. The
    step and values as ``_LoggerConnector.log_metrics`` computes them."""
    from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

    connector = trainer._logger_connector
    if not trainer.training or connector._first_loop_iter is None or not connector.should_update_logs:
        return None
    if trainer.fit_loop._should_accumulate():
        return None
    metrics = convert_tensors_to_scalars(dict(connector.metrics["log"]))
    if not metrics:
        return None
    step = metrics.pop("step", None)
    if step is None:
        metrics.setdefault("epoch", trainer.current_epoch)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
    return {"step": int(step), "metrics": metrics}


def restore_checkpointed_row(trainer: L.Trainer, row: dict | None) -> bool:
    """Write a checkpoint's own step row (:func:`checkpointed_row`) to the CSV logs that lack it;
    True if one did."""
    if not row or not trainer.is_global_zero:
        return False
    wrote = False
    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger) or logger.experiment is None:
            continue
        path = Path(logger.experiment.metrics_file_path)
        rows = read_whole_rows(path)[1] if path.is_file() else []
        have = {k for r in rows if r.get("step") == str(row["step"]) for k, v in r.items() if v not in (None, "")}
        if not set(row["metrics"]) <= have:
            logger.log_metrics(dict(row["metrics"]), step=row["step"])
            logger.save()
            wrote = True
    return wrote


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


class WandbLogger(_WandbLogger):
    """Lightning's ``WandbLogger`` without the ``anonymous=None`` it always passes to ``wandb.init``:
    W&B 0.31 deprecated that setting and warns on every run about a value nobody set. One W&B run
    per job (finished at the job's end) is :func:`finish_wandb_run`, called by ``bnlit.train``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
