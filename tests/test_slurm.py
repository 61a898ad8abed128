"""On a real local SLURM cluster (``tests/slurm_cluster.py``): ``python -m bnlit.train -m
hydra/launcher=slurm trainer=multinode debug=rehearsal`` (the production profile on CPU: bf16-mixed
autocast, torch.compile, fused AdamW, loader workers, DDP over gloo) submits through submitit;
each job runs 2 tasks that Lightning's ``SLURMEnvironment`` turns into 2 DDP ranks; a 2-point
sweep runs both jobs; a job preempted with ``scontrol requeue`` saves the step it is in, is
requeued, and continues from that checkpoint to the end onto the same loss curve; a job that
reaches its time limit gets submitit's ``--signal=USR2@N`` first, saves the step it is in, is
requeued by submitit and continues from that checkpoint to the end. No manual step in either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bnlit.run_report import read_metrics
from conftest import TINY

pytestmark = [pytest.mark.slurm]

TESTS = Path(__file__).parent
SEEDS = (1337, 7)
# docs/production.md's recipe; debug=rehearsal makes it 1 node x 2 CPU processes; this cluster has no GPUs
# and 2 CPUs; the run is cut to the test corpus (TINY) and 6 steps
SLURM = [
    "hydra/launcher=slurm", "trainer=multinode", "debug=rehearsal",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=2",
    "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=15",
    "data.batch_size=2",
]


PACE = ["+callbacks.pace._target_=pace.Pace"]  # tests/pace.py


def submit(cluster, sweep_dir: Path, *overrides: str, wandb: bool = False) -> subprocess.Popen:
    """``wandb``: W&B (offline) instead of the CSV logger alone (W&B keeps a CSV logger beside it)."""
    env = dict(cluster.env, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",  # stacks on SIGABRT: see ``finish``
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    tiny = TINY
    if wandb:
        env |= {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        tiny = [o if o != "logger=csv" else "logger=wandb" for o in TINY]
    log = open(sweep_dir.parent / f"{sweep_dir.name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "bnlit.train", "-m", *tiny, *SLURM, f"hydra.sweep.dir={sweep_dir}",
                             *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=sweep_dir.parent)


def job_logs(sweep_dir: Path) -> dict[Path, str]:
    """Each task's stdout and stderr (every run of a requeued job appends to the same files)."""
    return {p: p.read_text(errors="replace") for p in sorted(sweep_dir.glob(".submitit/*/*_log.*"))}


def without_module_lists(text: str) -> str:
    """A log without the extension-module lists faulthandler prints after each stack (~4 kB each)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("Extension modules:") and "(total: " not in line)


def hung(cluster, proc: subprocess.Popen, sweep_dir: Path, timeout: float) -> str:
    """What a sweep that ran past ``timeout`` was doing: the queue, every Python stack of its jobs
    (SIGABRT to each process whose command line names ``sweep_dir``, which ``PYTHONFAULTHANDLER``
    turns into a dump in its task's log), each task's log and the controller's log."""
    queue = cluster.run("squeue", "-a", "-o", "%i %T %r %M %l %N", check=False).stdout
    jobs = cluster.run("scontrol", "show", "job", "-o", check=False).stdout
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        try:
            if pid != proc.pid and str(sweep_dir).encode() in cmdline.read_bytes():
                os.kill(pid, signal.SIGABRT)
        except OSError:
            pass  # it ended meanwhile
    time.sleep(3)
    proc.kill()
    sweep = (sweep_dir.parent / f"{sweep_dir.name}.log").read_text(errors="replace")
    tasks = "\n".join(f"--- {p.name}\n{without_module_lists(t)[-20000:]}" for p, t in job_logs(sweep_dir).items())
    ctld = (cluster.root / "slurmctld.log").read_text(errors="replace")
    return (f"the sweep did not end within {timeout:.0f} s\n--- squeue\n{queue}\n--- scontrol show job\n{jobs}\n"
            f"--- the sweep's log\n{sweep[-3000:]}\n{tasks}\n--- slurmctld.log\n{ctld[-3000:]}")


def finish(cluster, proc: subprocess.Popen, sweep_dir: Path, timeout: float = 900) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(hung(cluster, proc, sweep_dir, timeout), pytrace=False)
    out = (sweep_dir.parent / f"{sweep_dir.name}.log").read_text()
    logs = job_logs(sweep_dir)
    assert proc.returncode == 0, out[-3000:] + "\n" + "\n".join(t[-4000:] for t in logs.values())
    return "\n".join(logs.values())


def losses(job_dir: Path) -> dict[int, float]:
    return dict(read_metrics(job_dir / "csv" / "metrics.csv")["train/loss"])


@pytest.fixture(scope="module")
def sweep(slurm_cluster, tmp_path_factory, cache_dir) -> Path:
    sweep_dir = tmp_path_factory.mktemp("sweep") / "multirun"
    proc = submit(slurm_cluster, sweep_dir, f"seed={SEEDS[0]},{SEEDS[1]}", wandb=True)
    finish(slurm_cluster, proc, sweep_dir)
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


def test_each_slurm_job_is_its_own_wandb_run_and_the_sweep_ends_with_its_table(sweep):
    """Through submitit: one W&B run per job (rank zero's), named by the job's own override, grouped
    by the sweep, with its own seed and final val/loss (read by W&B's own reader); the submitting
    process writes the sweep's table."""
    import json

    wandb = Path(sys.executable).parent / "wandb"
    for job, seed in (("0", SEEDS[0]), ("1", SEEDS[1])):
        runs = list((sweep / job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        record = json.loads(subprocess.run([str(wandb), "leet", "inspect", "--summary", "--json", str(runs[0])],
                                           capture_output=True, text=True, timeout=120).stdout)
        assert record["name"] == f"{job}: seed={seed}" and record["config"]["seed"] == seed
        assert record["summary"]["val/loss"] == pytest.approx(read_metrics(sweep / job / "csv" / "metrics.csv")
                                                              ["val/loss"][-1][1], rel=1e-9, abs=0)
        raw = subprocess.run([str(wandb), "leet", "inspect", "--json", str(runs[0])], capture_output=True, text=True,
                             timeout=120).stdout.splitlines()
        assert next(json.loads(line)["run"] for line in raw if '"type":"run"' in line)["run_group"] == sweep.name
    table = json.loads((sweep / "sweep_summary.json").read_text())
    assert sorted(r["job"] for r in table["jobs"]) == ["0", "1"]
    assert sorted(r["overrides"] for r in table["jobs"]) == sorted([[f"seed={s}"] for s in SEEDS])


def test_scontrol_requeue_saves_requeues_and_continues_to_the_end(slurm_cluster, sweep, tmp_path):
    sweep_dir = tmp_path / "multirun"
    proc = submit(slurm_cluster, sweep_dir, f"seed={SEEDS[0]}", *PACE, "+callbacks.pace.seconds=1.5")
    ckpts = sweep_dir / "0" / "checkpoints"
    deadline = time.monotonic() + 600
    while not (ckpts / "step0000002.ckpt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the job never reached step 2"
        time.sleep(0.5)
    job = slurm_cluster.run("squeue", "-h", "-o", "%i").stdout.split()[0]
    slurm_cluster.run("scontrol", "requeue", job)  # what a preemption does: SIGTERM now, rerun later
    logs = finish(slurm_cluster, proc, sweep_dir)

    assert "interrupted at step " in logs and "saved checkpoints/step" in logs, logs
    step = int(logs.split("interrupted at step ")[1].split(":")[0])
    assert 2 <= step < 6
    assert "resuming from" in logs or "Restoring states from the checkpoint path" in logs, logs
    # the continued run is the uninterrupted one: same losses, bit for bit
    assert losses(sweep_dir / "0") == losses(sweep / "0")
    assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED"  # the batch script ends after the tasks
    assert "Restarts=1" in slurm_cluster.run("scontrol", "show", "job", job, "-o").stdout


def test_time_limit_signal_saves_requeues_and_continues_to_the_end(slurm_cluster, sweep, tmp_path):
    """A job whose steps would outlast its 5-minute limit: SLURM sends submitit's ``--signal=USR2@60``
    (``hydra.launcher.signal_delay_s``) 60 s before the limit, or up to a minute earlier (slurmctld
    checks time limits periodically; measured here 5-60 s early), so 180-240 s into the job, when it
    is training; the signal reaches every process of the step, loader workers included (they
    ignore it). The run saves the step it is in, submitit requeues the job (the ``checkpoint`` of
    Hydra's launcher), and the rerun resumes from that step's checkpoint by itself
    (``SLURM_RESTART_COUNT``) and trains to the last step at full speed, normally before its own signal.
    (After ``sweep``: its jobs built the tokenizer and shards this one reads.)"""
    sweep_dir = tmp_path / "multirun"
    steps = 30  # x 9 s of pace on the first run: longer than the time limit
    proc = submit(slurm_cluster, sweep_dir, f"seed={SEEDS[0]}", f"trainer.max_steps={steps}",
                  "trainer.val_check_interval=1000", "callbacks.model_checkpoint.every_n_train_steps=1000",
                  "hydra.launcher.timeout_min=5", "hydra.launcher.signal_delay_s=60",
                  *PACE, "+callbacks.pace.seconds=9",
                  "+callbacks.pace.first_run_only=true")
    logs = finish(slurm_cluster, proc, sweep_dir, timeout=900)
    run = sweep_dir / "0"

    assert "Caught signal SIGUSR2" in logs and "this job is timed-out" in logs, logs
    assert "interrupted at step " in logs, logs
    step = int(logs.split("interrupted at step ")[1].split(":")[0])
    assert 1 <= step < steps
    ckpt = run / "checkpoints" / f"step{step:07d}.ckpt"  # the interrupt's own checkpoint: the signal's step
    assert torch.load(ckpt, weights_only=True, mmap=True)["global_step"] == step
    assert "Requeued job" in logs, logs
    # the rerun resumed from a checkpoint of exactly that step, without being told to
    assert "requeued SLURM job (SLURM_RESTART_COUNT=1): resuming from" in logs, logs
    restored = Path(logs.split("Restoring states from the checkpoint path at ")[1].split()[0])
    assert torch.load(restored, weights_only=True, mmap=True)["global_step"] == step
    # the parity probe is on: it ran on the first run's step 1 and again at the resumed step (the
    # first check of each fit), and raised no alarm (issue 25 item 5: its bf16 rounding floor)
    assert logs.count("fast-path parity (") >= 2 and "[fast_path_parity]" not in logs, logs[-4000:]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert last["global_step"] == steps
    assert sorted(losses(run)) == list(range(steps))  # every step logged (a rerun step keeps the last value)
    dirs = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
    job = max(dirs, key=lambda name: "_" in name)  # an array task's dir ("3_0") or the job's own ("3")
    assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED"
    # a rerun slowed by a loaded host may reach its own signal too and be requeued again (the
    # same path); the first rerun is the one checked above
    restarts = slurm_cluster.run("scontrol", "show", "job", job, "-o").stdout.split("Restarts=")[1].split()[0]
    assert int(restarts) >= 1
