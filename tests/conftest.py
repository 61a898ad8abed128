"""Shared fixtures: one cache dir per test session (tokenizers and shards are built once) and a
helper that composes the real Hydra config with tiny CPU overrides; and, under ``CI=true``
(``.ci/run``), a skip that is not about the machine fails instead."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR

try:
    import bnlit.callbacks  # noqa: F401  (top-level callbacks/, installed as bnlit.callbacks)
except ModuleNotFoundError:
    pytest.exit("bnlit.callbacks is not importable: an editable install made before callbacks/ became "
                "bnlit.callbacks; rerun `pip install --no-deps -e .`", returncode=4)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# tiny, fast and still real: the embedded corpus cut to a few hundred thousand characters
TINY = [
    "model=tiny",
    "model.config.dim=64",  # the default run's 128 learns more per token; the tests need no more
    "model.config.vocab_size=1024",
    "+data.sources.0.max_docs=20",
    "data.val_fraction=0.2",
    "+data.sources.1.max_docs=40",
    "data.seq_len=64",
    "data.batch_size=4",
    "data.num_proc=1",
    "trainer.precision=32-true",  # trainer=cpu picks bf16-mixed on a CPU with native bf16
    "module.compile=false",  # hardware=cpu compiles where a C++ compiler is found (~20 s per run)
    # a handful of steps: the default run's lr 1e-2 with warmup-stable-decay is tuned for 800 steps
    "optimizer.lr=3e-3",
    "scheduler=cosine",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "~callbacks.progress_bar",
    "logger=csv",
    # a 1024-token tokenizer trained on 15 books gives Bangla ~1.8 chars/token (8192: ~2.8); the
    # default floor of 2.5 is for real vocabularies (tests/checks/test_fertility.py checks it at 8192)
    "callbacks.fertility.floors.bn=1.5",
    # one torch thread: threads=auto picks the count from the load average at start, and a run with
    # 2 threads sums in another order than one with 1, so two runs compared bit for bit (a resume
    # against the uninterrupted run) must not depend on the load (a SLURM requeue test failed so)
    "threads=1",
]


# Under CI=true, .ci/run has installed every dependency a test can ask for (the dev and serve
# extras, SLURM): a test that skips anyway (an import that broke, a cluster that did not start)
# fails instead. A skip CI accepts names what the machine lacks, not what pip or apt installs: its
# reason starts with MACHINE ("machine: no CUDA device").
CI = os.environ.get("CI", "").lower() == "true"
MACHINE = "machine: "


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def fail_skip_under_ci(report, what: str) -> None:
    if CI and report.skipped and not hasattr(report, "wasxfail") and not skip_reason(report).startswith(MACHINE):
        report.outcome = "failed"
        report.longrepr = (f"{what} skipped under CI=true, where .ci/run installs every dependency: "
                           f"{skip_reason(report)} (only a skip whose reason starts with {MACHINE!r} passes in CI)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_skip_under_ci(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level pytest.importorskip skips the whole file at collection
    fail_skip_under_ci(outcome.get_result(), collector.nodeid)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bnlit_cache")
    os.environ["BNLIT_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-node SLURM cluster (tests/slurm_cluster.py). Skipped where it cannot start
    (a failure under CI=true: see ``fail_skip_under_ci``)."""
    from slurm_cluster import ClusterError, SlurmCluster

    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (ClusterError, OSError, subprocess.SubprocessError) as e:
        cluster.stop()
        pytest.skip(f"no SLURM test cluster: {e}")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    cluster.stop()
    os.environ.pop("SLURM_CONF", None)


@pytest.fixture
def make_cfg(cache_dir, tmp_path):
    """``make_cfg(*overrides)`` -> the composed ``train`` config writing into ``tmp_path/run``."""

    def _make(*overrides: str, run_dir: Path | None = None, tiny: bool = True) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*(TINY if tiny else []), *overrides])
        with open_dict(cfg):
            cfg.paths.output_dir = str(run_dir or tmp_path / "run")
            cfg.paths.cache_dir = str(cache_dir)
        return cfg

    return _make


@pytest.fixture(autouse=True)
def _keep_omp_num_threads():
    """A run in this process sets OMP_NUM_THREADS when it is unset (``bnlit.speed.threads.set_threads``);
    unset it again, so the processes later tests start choose their own thread count as before."""
    before = os.environ.get("OMP_NUM_THREADS")
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before
