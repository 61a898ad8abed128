"""``python -m bnlit.train [overrides]``: compose the config, build data, model, callbacks and
loggers, fit, and report where everything went. ``train(cfg)`` is the testable core; ``main`` is
a thin Hydra wrapper that turns :class:`~bnlit.errors.BnlitError` into one line and exit code 2."""

from __future__ import annotations

if __name__ == "__main__":  # first: a Ctrl-C during the imports below is held, not lost (the module says why)
    from bnlit import startup_signals

    startup_signals.hold()

import logging
import os
import signal
import sys
import time
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
from bnlit import lost_rank, quiet, run_dir, startup_signals
from bnlit.checkpointing import newest_checkpoint, newest_step, prepare_resume, remove_partial_writes
from bnlit.command_line import check_command_line
from bnlit.errors import BnlitError, ConfigError
from bnlit.interrupt import Interrupted, StopAtOnce, restore_handlers
from bnlit.loggers import finish_wandb_run, redact, run_tags, sweep_job
from bnlit.preflight import check_config, instantiate_checked
from bnlit.run_report import print_report, write_summary
from bnlit.speed import compile_ahead
from bnlit.speed.host_malloc import KEEP_BYTES, keep_freed_memory
from bnlit.speed.threads import hold_threads, load_average, set_threads
from bnlit.storage import is_storage_error, remove_stale_temp_files, storage_message

log = logging.getLogger("bnlit")


def instantiate_group(group: DictConfig | None, wandb_kwargs: dict | None = None) -> list:
    out = []
    for c in (group or {}).values():
        if c is None:
            continue
        extra = (wandb_kwargs or {}) if str(c.get("_target_", "")).endswith("WandbLogger") else {}
        out.append(instantiate_checked(c, **extra))
    return out


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the configured model; return the final ``trainer.callback_metrics`` as floats. The run
    dir's record (``.hydra/``, ``train.log``) is written once the checks pass; the job's W&B run is
    finished when it ends, so the next job of a sweep in this process starts its own."""
    quiet.install()  # third-party messages that tell the user nothing (bnlit/quiet.py says why, each)
    run_dir.hold_log()
    try:
        metrics = fit(cfg)
    except BaseException:
        finish_wandb_run(exit_code=1)
        raise
    finally:
        run_dir.close_log()
    finish_wandb_run(exit_code=0)
    return metrics


def fit(cfg: DictConfig) -> dict[str, float]:
    start = time.perf_counter()
    check_config(cfg)  # seconds, before anything is built or written
    threads = set_threads(cfg.get("threads", "auto"))
    if cfg.get("keep_freed_memory") and str(cfg.trainer.get("accelerator")) == "cpu" and keep_freed_memory():
        log.info("host memory: freed tensors kept for reuse (glibc mmap/trim thresholds %d MiB)", KEEP_BYTES >> 20)
    load_at_start = load_average()
    callbacks = instantiate_group(cfg.get("callbacks"))  # their own argument checks, also before the data build
    checkpoint_dir = Path(cfg.paths.checkpoint_dir)
    ckpt_path, ckpt_io = prepare_resume(cfg.get("ckpt_path"), checkpoint_dir, cfg.get("overwrite", False),
                                        instantiate(cfg.model.config), cfg.trainer.get("strategy"))
    run_dir.write_record(cfg)  # the run is accepted: from here on it may write into its run dir
    remove_partial_writes(checkpoint_dir)
    remove_stale_temp_files(Path(cfg.paths.output_dir))  # a killed run's tokenizer or record half-written
    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")

    if compile_ahead.wanted(cfg):
        compile_ahead.start(cfg)  # the graphs, while this process builds the data (bnlit/speed/compile_ahead.py)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    module = instantiate(cfg.module)(model=model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler)
    loggers = instantiate_group(cfg.get("logger"), {"tags": run_tags(cfg), **sweep_job()})
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                     plugins=[ckpt_io], **val_check_in_batches(cfg.trainer))
    for lg in loggers:
        lg.log_hyperparams(redact(OmegaConf.to_container(cfg, resolve=True)))

    hold_threads(threads)
    if cfg.get("validate_at_start") and ckpt_path is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = scalar_metrics(trainer)
    if needs_final_validation(trainer):  # every run ends with the final model's val/loss (sweeps read it)
        trainer.validate(module, datamodule=datamodule, verbose=False)
        metrics.update(scalar_metrics(trainer))
    compiled = None
    if module.compile_watch is not None:  # every compile of the run, the final validation's included
        module.log_compiles()
        compiled = module.compile_watch.summary()
        log.info("%s", compiled)
    if trainer.is_global_zero:
        for lg in loggers:
            lg.save()
        # the MFU alarm's "where the time went" line, when the floor fired (callbacks/throughput.py)
        where = next((w for c in callbacks if (w := getattr(c, "where_time_went", None))), None)
        write_summary(Path(cfg.paths.output_dir), metrics, notes=[getattr(module, "fast_path", None), compiled, where])
        timing = {"wall_s": time.perf_counter() - start, "threads": threads, "threads_end": torch.get_num_threads(),
                  "load_start": load_at_start, "load_end": load_average()}
        print_report(cfg, metrics, loggers, timing)
    return metrics


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The trainer's scalar callback metrics as floats, without the ``step`` the module logs as
    the loggers' x value (``LMModule.on_validation_epoch_end``)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1 and k != "step"}


def val_check_in_batches(trainer_cfg) -> dict[str, int]:
    """``trainer.val_check_interval`` counts optimizer steps (conf/trainer/default.yaml, the
    preflight rule); Lightning counts training batches, i.e. micro-batches: under accumulation the
    Trainer gets ``steps x accumulate_grad_batches`` (``trainer=h100``'s 250 steps would otherwise
    validate every 250 micro-batches, every ~16 steps). A fraction of an epoch is left alone."""
    interval, accumulate = trainer_cfg.get("val_check_interval"), trainer_cfg.get("accumulate_grad_batches") or 1
    if isinstance(interval, int) and not isinstance(interval, bool) and accumulate > 1:
        return {"val_check_interval": interval * accumulate}
    return {}


def needs_final_validation(trainer: L.Trainer) -> bool:
    """True when the fit ended on a step that was not validated (``max_steps`` is not a multiple
    of ``val_check_interval``, or below it) and no validation was switched off."""
    interval = trainer.val_check_interval
    if trainer.interrupted or not trainer.limit_val_batches:
        return False
    if not isinstance(interval, int):  # a fraction of an epoch: Lightning validated at the epoch end
        return False
    steps = max(1, interval // max(1, trainer.accumulate_grad_batches))  # val_check_in_batches
    return trainer.global_step > 0 and trainer.global_step % steps != 0


def main() -> None:
    """The command line is checked before Hydra makes a directory (bnlit/command_line.py)."""
    try:
        check_command_line(sys.argv[1:], CONF_DIR)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    run()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def run(cfg: DictConfig) -> float | None:
    stop = stop_at_once(cfg)
    before = {}
    try:
        before = take_over_signals(stop)
        metrics = train(cfg)
        return optimized(metrics, cfg.get("optimized_metric"))
    except Interrupted as e:
        if e.rank_zero:  # on a line of its own, not after a progress bar's last refresh
            print(f"\n{e.message(Path(cfg.paths.output_dir))}", file=sys.stderr, flush=True)
        if e.then is not None:
            e.then()  # requeue a SLURM job
        sys.exit(e.exit_code)
    except BnlitError as e:
        stop_if_a_rank_is_lost(e, cfg)  # a checkpoint save that failed because a peer died
        refuse(e, cfg)
    except InstantiationException as e:  # a constructor's BnlitError, wrapped by hydra.utils.instantiate
        if not isinstance(e.__cause__, BnlitError):
            raise
        refuse(e.__cause__, cfg)
    except OSError as e:
        if not is_storage_error(e):
            stop_if_a_rank_is_lost(e, cfg)
            raise
        print(f"error: {storage_message(e, cfg.paths.cache_dir, cfg.paths.output_dir)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as e:
        stop_if_a_rank_is_lost(e, cfg)
        raise
    finally:
        restore_handlers(before)  # a caller's own handlers again (a test, a notebook, a sweep's next job)


def take_over_signals(stop: StopAtOnce | None) -> dict:
    """``stop`` in place of the hold of the imports (:mod:`bnlit.startup_signals`), with the signals
    blocked in between; a signal held since then is raised again now. The handlers from before
    the hold, for :func:`~bnlit.interrupt.restore_handlers`."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, startup_signals.HELD)
    try:
        held = startup_signals.release()
        before = stop.install() if stop is not None else {}
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if held is not None:
        signal.raise_signal(held)  # to StopAtOnce (or, with callbacks.interrupt off, Python's default)
    return before


def stop_if_a_rank_is_lost(e: BaseException, cfg: DictConfig) -> None:
    """A collective that failed because a peer rank is gone (bnlit/lost_rank.py): one line naming
    the lost rank and the checkpoint to resume from, then exit at once (``os._exit``: no thread or
    process-group teardown that could wait on the dead rank)."""
    if not lost_rank.is_lost_peer_error(e):
        return
    newest = newest_checkpoint(Path(cfg.paths.checkpoint_dir))
    message = lost_rank.lost_rank_message(lost_rank.my_rank(), Path(cfg.paths.output_dir), newest)
    log.error("%s", message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(lost_rank.EXIT_CODE)


def stop_at_once(cfg: DictConfig) -> StopAtOnce | None:
    """The stop signals of ``callbacks.interrupt`` end the run at once outside the training loop
    (none when that callback is switched off)."""
    spec = (cfg.get("callbacks") or {}).get("interrupt")
    if spec is None:
        return None
    checkpoint_dir = Path(cfg.paths.checkpoint_dir)
    return StopAtOnce(spec.signals, lambda: newest_step(checkpoint_dir), spec.get("requeue_signals", ()))


def refuse(e: BnlitError, cfg: DictConfig) -> None:
    """One line and the error's exit code; the run dir Hydra made for this run goes if it is empty."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    run_dir.remove_if_new(cfg.paths.output_dir)
    sys.exit(e.exit_code)


def optimized(metrics: dict[str, float], name: str | None) -> float | None:
    """The value a sweeper (grid, Optuna) reads; a sweep whose metric was never logged is refused."""
    if name and name not in metrics and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError(f"optimized_metric={name} was not logged by this run; logged: {sorted(metrics)}")
    return metrics.get(name) if name else None


if __name__ == "__main__":
    main()
