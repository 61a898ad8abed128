"""Launch a 2-rank worker script under ``torch.distributed.run`` (gloo on CPU) for the tests
that plant a fault on one rank and check that both ranks stop with the same error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def run_two_ranks(worker: str, tmp_path: Path, timeout: float, nproc: int = 2,
                  args: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, list[str | None]]:
    """Run ``worker`` (Python source) on 2 (``nproc``) local ranks with ``argv = [tmp_path, tests
    dir, *args]``; each rank writes ``rank<r>.txt`` in ``tmp_path``. Returns the process and what
    each rank wrote."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS / "checks"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={port}", str(script), str(tmp_path), str(TESTS), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    msgs = [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else None
            for r in range(nproc)]
    return proc, msgs


def run_train_cli(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m bnlit.train`` in a fresh process (so a test's callbacks in ``tests/`` resolve)
    with ``hydra.run.dir=run_dir``, from ``run_dir``'s parent."""
    # tests/checks: workers plant the faults test_gradient_flow defines
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS / "checks"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "bnlit.train", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=timeout)


def train_losses(run_dir: Path) -> dict[int, float]:
    """``{step: train/loss}`` of a run dir's CSV metrics."""
    from bnlit.run_report import read_metrics

    return dict(read_metrics(run_dir / "csv" / "metrics.csv")["train/loss"])


def fit_on_two_ranks(module, strategy, callbacks: list) -> None:
    """Inside a :func:`run_two_ranks` worker: fit ``module`` on random tokens for 3 steps on 2 CPU
    ranks and write what ended the run (the arbiter's error, or the last step) to ``rank<r>.txt``."""
    import lightning as L
    import torch

    from bnlit.callbacks.gradient_flow import GradientFlowError
    from test_gradient_flow import RandomTokens

    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=sys.argv[1], use_distributed_sampler=True, callbacks=callbacks)
    out = Path(sys.argv[1]) / f"rank{trainer.global_rank}.txt"
    try:
        trainer.fit(module, datamodule=RandomTokens())
        out.write_text(f"finished at step {trainer.global_step}")
    except GradientFlowError as e:
        out.write_text(str(e))
        sys.exit(3)


def same_error_on_both_ranks(proc: subprocess.CompletedProcess, msgs: list[str | None]) -> str:
    """Both ranks stopped, with the same message (returned)."""
    assert msgs[0] is not None and msgs[1] is not None, proc.stderr[-3000:]
    assert msgs[0] == msgs[1], msgs
    assert proc.returncode != 0
    return msgs[0]
