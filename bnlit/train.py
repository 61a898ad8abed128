"""``python -m bnlit.train [overrides]``: compose the config, build data, model, callbacks and
loggers, fit, and report where everything went. ``train(cfg)`` is the testable core; ``main`` is
a thin Hydra wrapper that turns :class:`~bnlit.errors.BnlitError` into one line and exit code 2."""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import bnlit.resolvers  # noqa: F401  (registers ${bnlit.*} resolvers)
from bnlit import CONF_DIR
from bnlit.checkpointing import prepare_resume
from bnlit.errors import BnlitError, ConfigError
from bnlit.run_report import print_report, redact, run_tags, sweep_group, write_summary

log = logging.getLogger("bnlit")


def check_config(cfg: DictConfig) -> None:
    """Cross-field checks that no single constructor can make."""
    max_len = cfg.model.config.max_seq_len
    if cfg.data.seq_len > max_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.config.max_seq_len={max_len} "
                          f"of preset {cfg.model.config.name}; lower data.seq_len or raise max_seq_len")


def instantiate_group(group: DictConfig | None, wandb_kwargs: dict | None = None) -> list:
    out = []
    for c in (group or {}).values():
        if c is None:
            continue
        extra = (wandb_kwargs or {}) if str(c.get("_target_", "")).endswith("WandbLogger") else {}
        out.append(instantiate(c, **extra))
    return out


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the configured model; return the final ``trainer.callback_metrics`` as floats."""
    check_config(cfg)
    ckpt_path, ckpt_io = prepare_resume(cfg.get("ckpt_path"), Path(cfg.paths.checkpoint_dir), cfg.get("overwrite", False),
                                        instantiate(cfg.model.config), cfg.trainer.get("strategy"))
    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    module = instantiate(cfg.module)(model=model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler)
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"), {"tags": run_tags(cfg), "group": sweep_group()})
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                     plugins=[ckpt_io])
    for lg in loggers:
        lg.log_hyperparams(redact(OmegaConf.to_container(cfg, resolve=True)))

    if cfg.get("validate_at_start") and ckpt_path is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if trainer.is_global_zero:
        for lg in loggers:
            lg.save()
        write_summary(Path(cfg.paths.output_dir), metrics)
        print_report(cfg, metrics, loggers)
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
        return optimized(metrics, cfg.get("optimized_metric"))
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except InstantiationException as e:  # a constructor's BnlitError, wrapped by hydra.utils.instantiate
        cause = e.__cause__
        if not isinstance(cause, BnlitError):
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        sys.exit(cause.exit_code)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: {disk_full_message(e, cfg)}", file=sys.stderr, flush=True)
        sys.exit(2)


def optimized(metrics: dict[str, float], name: str | None) -> float | None:
    """The value a sweeper (grid, Optuna) reads; a sweep whose metric was never logged is refused."""
    if name and name not in metrics and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError(f"optimized_metric={name} was not logged by this run; logged: {sorted(metrics)}")
    return metrics.get(name) if name else None


def disk_full_message(e: OSError, cfg: DictConfig) -> str:
    where = f" writing {e.filename}" if e.filename else ""
    return (f"no space left on device{where}; free space under paths.cache_dir={cfg.paths.cache_dir} or "
            f"paths.output_dir={cfg.paths.output_dir} and rerun (shards and checkpoints are written to a "
            "temporary name and renamed, so earlier ones are intact)")


if __name__ == "__main__":
    main()
