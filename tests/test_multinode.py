"""Two nodes on one machine through torchrun: two ``torchrun --nnodes=2 --node-rank=R`` launches
train one model together on CPU (gloo) with the ``trainer=multinode`` profile, into one run
directory with one checkpoint set, on the loss curve of one process with the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bnlit.run_report import read_metrics
from conftest import TINY

STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=3"]
# the production profile rehearsed on CPU: bf16-mixed autocast, torch.compile, fused AdamW, DDP over gloo
PROFILE = ["trainer=multinode", "debug=rehearsal"]


# bf16 autocast: a micro-batch of 2 sequences and one of 4 round their matmuls differently (max
# difference seen: 2.0e-4 over 6 steps; 1e-5 holds at 32-true, tests/test_distributed.py)
TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir: Path) -> dict[int, float]:
    return dict(read_metrics(run_dir / "csv" / "metrics.csv")["train/loss"])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_nodes_train_as_one_run(tmp_path, cache_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = tmp_path / "one"
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, *PROFILE, "trainer.num_nodes=1",
                          "trainer.devices=1", *STEPS, "data.batch_size=4", f"hydra.run.dir={one}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    run, port = tmp_path / "two", free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               f"--node-rank={r}", "--master-addr=127.0.0.1", f"--master-port={port}",
                               "-m", "bnlit.train", *TINY, *PROFILE, "trainer.num_nodes=2",
                               "trainer.devices=1", *STEPS, "data.batch_size=2", "trainer.limit_val_batches=4",
                               f"hydra.run.dir={run}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
             for r in (0, 1)]
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)

    ref, got = losses(one), losses(run)
    assert sorted(got) == sorted(ref) == list(range(6))
    diff = max(abs(got[s] - ref[s]) for s in ref)
    assert diff < TOLERANCE, (diff, ref, got)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] in (["one", "two"], ["two", "one"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if "ckpt" in p.name) == \
        ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    assert ckpt["BnDataModule"]["position"]["world_size"] == 2 and len(ckpt["BnDataModule"]["rng"]) == 2
