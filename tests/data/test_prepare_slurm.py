"""On a real local SLURM cluster (``tests/slurm_cluster.py``): ``python -m bnlit.prepare ...
data/executor=slurm`` submits the data build as job arrays (4 tasks: 2 sources x 2 pieces) chained
by dependencies; one array task is cancelled with ``scancel``, the stalled rest is cancelled, the
same command resubmits only what did not finish, and the shards it leaves equal a local build's
and train a tiny model with ``python -m bnlit.train`` (which only reads them)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bnlit.tokenizer import train_tokenizer
from conftest import TINY
from helpers_data import planted_corpus, write_sources

pytestmark = [pytest.mark.slurm]

TESTS = Path(__file__).parents[1]  # tests/, for helpers_data in the jobs


def run(cluster, *args: str, cwd: Path, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(cluster.env, BNLIT_CACHE=str(cache), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def queue(cluster) -> list[tuple[str, str, str]]:
    """(job id with array index, name, state) of every job in the queue."""
    out = cluster.run("squeue", "-h", "-r", "-o", "%i|%j|%T|%r").stdout
    return [tuple(line.split("|")[:3]) for line in out.splitlines() if line.strip()]


def wait_for(predicate, timeout: float, what: str, cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"{what} after {timeout:.0f}s; queue: {queue(cluster)}\n{cluster.logs()[-2000:]}")


def shard_files(cache: Path) -> dict[str, str]:
    (index,) = cache.glob("shards/*/index.json")
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(index.parent.iterdir())}


def test_prepare_on_slurm_survives_a_cancelled_array_task_and_its_shards_train(slurm_cluster, tmp_path):
    web, _, news = planted_corpus()
    sources = write_sources(tmp_path / "sources", [web, news])
    tok = train_tokenizer([d for _, _, docs in (web, news) for d in docs], tmp_path / "tok.model", vocab_size=600,
                          num_threads=1)
    cfg = [*(o for o in TINY if "max_docs" not in o and "val_fraction" not in o), "model.config.vocab_size=600", f"tokenizer.path={tok}",
           "data=files", f"data.sources.0.path={sources[0].path}", f"data.sources.1.path={sources[1].path}",
           "data.val_fraction=0.3",
           # equal character shares: the planted English is a fifth of the text, and a 600-piece
           # tokenizer would make a 0.8/0.2 mixture over-represent it in tokens (the fertility check)
           "data.sources.0.weight=0.5", "data.sources.1.weight=0.5"]
    slurm = ["data/executor=slurm", "data.executor.tasks=2", "data.executor.partition=debug",
             "data.executor.time=00:10:00", "data.executor.job_name=bt", "data.executor.workers=1"]
    cache = tmp_path / "cache"
    run(slurm_cluster, "bnlit.prepare", *cfg, *slurm, cwd=tmp_path, cache=cache)
    (logs,) = cache.glob("clean/*/logs/read")
    assert "#SBATCH --array=0-3%1" in (logs / "launch_script.slurm").read_text()  # 2 sources x 2 pieces, one at a time
    read = [j for j in queue(slurm_cluster) if j[1] == "bt-read"]
    array = str(min(int(j[0].split("_")[0]) for j in read))  # the later one is datatrove's merge_stats job
    assert (f"{array}_3", "bt-read", "PENDING") in read, read  # still waiting when it is cancelled
    slurm_cluster.run("scancel", f"{array}_3")
    wait_for(lambda: len(list((logs / "completions").glob("*"))) == 3, 300, "3 read tasks not finished", slurm_cluster)
    assert not (logs / "completions" / "00003").exists()
    wait_for(lambda: all(state == "PENDING" for _, _, state in queue(slurm_cluster)), 120,
             "stages still running", slurm_cluster)
    slurm_cluster.run("scancel", *sorted({job.split("_")[0] for job, _, _ in queue(slurm_cluster)}))  # the stalled stages
    finished = {p.name: p.stat().st_mtime_ns for p in (logs / "logs").glob("task_*.log")}

    out = run(slurm_cluster, "bnlit.prepare", *cfg, *slurm, cwd=tmp_path, cache=cache)
    assert "read" in out.stderr + out.stdout
    wait_for(lambda: not queue(slurm_cluster), 900, "the resubmitted build did not finish", slurm_cluster)
    for name, mtime in finished.items():  # the 3 finished tasks were not run again
        if name != "task_00003.log":
            assert (logs / "logs" / name).stat().st_mtime_ns == mtime
    assert len(list((logs / "completions").glob("*"))) == 4

    local = tmp_path / "local"
    run(slurm_cluster, "bnlit.prepare", *cfg, "data.executor.tasks=2", cwd=tmp_path, cache=local)
    assert shard_files(cache) == shard_files(local)  # the cluster built what one machine builds

    trained = run(slurm_cluster, "bnlit.train", *cfg, f"paths.output_dir={tmp_path / 'run'}",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, cache=cache)
    assert "reused" in trained.stdout + trained.stderr
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["shard_dir"].startswith(str(cache)) and report["stages"]
    assert (tmp_path / "run" / "checkpoints").exists()
