"""``python -m bnlit.prepare``: the data build alone (clean, tokenizer, shards), with the same
Hydra config as ``python -m bnlit.train``, so a cluster prepares the data once and training runs
read it from ``paths.cache_dir``.

``data/executor=local`` (the default) runs the datatrove stages on this machine,
``data.num_proc`` tasks at a time; ``data/executor=slurm`` submits them as SLURM job arrays and
returns (``python -m bnlit.prepare data=bn_web data/executor=slurm data.executor.partition=cpu``).
Either way, running the same command again after an interruption finishes the job, redoing only
unfinished tasks (bnlit/data/pipeline.py)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

import bnlit.resolvers  # noqa: F401  (registers ${bnlit.*} resolvers)
from bnlit import CONF_DIR
from bnlit.errors import BnlitError, ConfigError

log = logging.getLogger("bnlit")


def prepare(cfg: DictConfig) -> dict:
    """Build (local) or submit (slurm) what is missing of ``cfg.data``'s build; returns what was
    done: ``{"kind", "shard_dir"}`` locally, ``{"kind", "jobs": [(stage, job id, tasks)]}`` on
    SLURM."""
    from bnlit.data.datamodule import BnDataModule
    from bnlit.data.pipeline import launch_slurm, load_stats, run_local, workers
    from bnlit.data.report import build_report, to_markdown, write_report
    from bnlit.data.shards import load_index
    from bnlit.preflight import instantiate_checked

    dm: BnDataModule = instantiate_checked(cfg.data, _recursive_=False)
    kind = dm.executor.get("kind", "local")
    if kind not in ("local", "slurm"):
        raise ConfigError(f"data.executor.kind={kind!r}: use data/executor=local or data/executor=slurm")
    if kind == "slurm" and not dm.executor.get("partition"):
        raise ConfigError("data.executor.partition is not set; name your cluster's partition (`sinfo -s`), "
                          "e.g. data.executor.partition=cpu")
    plan = dm.plan()
    if kind == "slurm":
        jobs = launch_slurm(plan, dm.executor)
        if not jobs:
            log.info("prepare: already built: %s", plan.shard_dir())
        for stage, job, tasks in jobs:
            log.info("prepare: %-15s %s", stage, "finished earlier" if job == "-1" else f"job {job} ({tasks} tasks)")
        if jobs:
            log.info("prepare: submitted; datatrove logs under %s and %s. Rerun this command to resubmit "
                     "unfinished tasks; `python -m bnlit.train` with the same config reads the result.",
                     plan.clean_dir / "logs" if plan.clean_dir else "-", plan.shard_logs)
        return {"kind": kind, "jobs": jobs}
    run_local(plan, workers=workers(dm.num_proc))
    shard_dir = plan.shard_dir()
    clean = load_stats(plan.clean_dir) if plan.clean_dir else None
    report = build_report(load_index(shard_dir), clean, shard_dir, plan.clean_dir)
    if cfg.paths.get("output_dir"):
        write_report(cfg.paths.output_dir, report)
    print(to_markdown(report), flush=True)
    log.info("prepare: shards in %s; tokenizer %s", shard_dir, plan.tokenizer_path)
    return {"kind": kind, "shard_dir": shard_dir}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    from hydra.errors import InstantiationException

    try:
        prepare(cfg)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except InstantiationException as e:
        if not isinstance(e.__cause__, BnlitError):
            raise
        print(f"error: {e.__cause__}", file=sys.stderr, flush=True)
        sys.exit(e.__cause__.exit_code)


if __name__ == "__main__":
    main()
