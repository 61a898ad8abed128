"""On a real local SLURM cluster (``tests/slurm_cluster.py``): ``python -m bnlit.train -m
hydra/launcher=slurm`` submits through submitit; each job runs 2 tasks that Lightning's
``SLURMEnvironment`` turns into 2 DDP ranks; a 2-point sweep runs both jobs; a job preempted
with ``scontrol requeue`` saves the step it is in, is requeued, and continues from that
checkpoint to the end onto the same loss curve, with no manual step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from bnlit.run_report import read_metrics
from conftest import REHEARSAL, TINY

pytestmark = [pytest.mark.slurm]

TESTS = Path(__file__).parent
SEEDS = (1337, 7)
SLURM = [
    "hydra/launcher=slurm", "trainer=multinode", "trainer.num_nodes=1", "trainer.devices=2",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=2",
    "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=15",
    *REHEARSAL, "data.batch_size=2",
]


class Pace(L.Callback):
    """Test-only: slow each step down, so a preemption lands mid-run."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, *args, **kwargs):
        time.sleep(self.seconds)


def submit(cluster, sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    env = dict(cluster.env, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    log = open(sweep_dir.parent / f"{sweep_dir.name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "bnlit.train", "-m", *TINY, *SLURM, f"hydra.sweep.dir={sweep_dir}",
                             *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=sweep_dir.parent)


def finish(proc: subprocess.Popen, sweep_dir: Path, timeout: float = 900) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (sweep_dir.parent / f"{sweep_dir.name}.log").read_text()
    logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(sweep_dir.glob(".submitit/*/*_log.*")))
    assert proc.returncode == 0, out[-3000:] + "\n" + logs
    return logs


def losses(job_dir: Path) -> dict[int, float]:
    return dict(read_metrics(job_dir / "csv" / "metrics.csv")["train/loss"])


@pytest.fixture(scope="module")
def sweep(slurm_cluster, tmp_path_factory, cache_dir) -> Path:
    sweep_dir = tmp_path_factory.mktemp("sweep") / "multirun"
    proc = submit(slurm_cluster, sweep_dir, f"seed={SEEDS[0]},{SEEDS[1]}")
    finish(proc, sweep_dir)
    return sweep_dir


def test_a_two_point_sweep_runs_two_jobs_of_two_ranks(sweep):
    for job in ("0", "1"):
        d = sweep / job
        assert (d / ".hydra" / "config.yaml").is_file() and (d / "summary.md").is_file()
        assert sorted(losses(d)) == list(range(6))
        ckpt = torch.load(d / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
        assert ckpt["global_step"] == 6
        assert ckpt["BnDataModule"]["position"]["world_size"] == 2  # two SLURM tasks, one DDP run
        assert len(ckpt["BnDataModule"]["rng"]) == 2
    assert losses(sweep / "0") != losses(sweep / "1")  # two seeds, two runs
    submitit = sorted(p for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name)  # array tasks
    assert len(submitit) == 2, submitit  # one SLURM job (array task) per sweep point
    for d in submitit:  # each job ran 2 tasks, and both returned to submitit
        assert len(list(d.glob("*_result.pkl"))) == 2 and len(list(d.glob("*_log.err"))) == 2


def test_scontrol_requeue_saves_requeues_and_continues_to_the_end(slurm_cluster, sweep, tmp_path):
    sweep_dir = tmp_path / "multirun"
    proc = submit(slurm_cluster, sweep_dir, f"seed={SEEDS[0]}", "+callbacks.pace._target_=test_slurm.Pace",
                  "+callbacks.pace.seconds=1.5")
    ckpts = sweep_dir / "0" / "checkpoints"
    deadline = time.monotonic() + 600
    while not (ckpts / "step0000002.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the job never reached step 2"
        time.sleep(0.5)
    job = slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.split()[0]
    slurm_cluster.run("scontrol", "requeue", job)  # what a preemption does: SIGTERM now, rerun later
    # SLURM holds a requeued job for about two minutes (BeginTime); let it start now
    for _ in range(120):
        fields = slurm_cluster.run("scontrol", "show", "job", job, "-o").stdout
        if "JobState=PENDING" in fields:
            slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            break
        time.sleep(0.5)
    logs = finish(proc, sweep_dir)

    assert "interrupted at step " in logs and "saved checkpoints/step" in logs, logs
    step = int(logs.split("interrupted at step ")[1].split(":")[0])
    assert 2 <= step < 6
    assert "resuming from" in logs or "Restoring states from the checkpoint path" in logs, logs
    # the continued run is the uninterrupted one: same losses, bit for bit
    assert losses(sweep_dir / "0") == losses(sweep / "0")
    assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED"  # the batch script ends after the tasks
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job, "-o").stdout
