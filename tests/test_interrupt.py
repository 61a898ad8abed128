"""Interrupt-safe runs and checkpoint hygiene: SIGTERM and Ctrl-C mid-run write a checkpoint of
that step and resume onto the uninterrupted curve, bit for bit; a second Ctrl-C during the save
corrupts nothing; ``ckpt_path=last`` takes the newest complete checkpoint by step; partial writes
are removed; ``save_top_k`` spans processes; no ``-v1`` copies; the metrics CSV keeps its rows."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from bnlit.checkpointing import (
    AtomicCheckpointIO, checkpoint_step, newest_checkpoint, newest_k, remove_partial_writes, resolve_ckpt_path, tmp_name,
)
from bnlit.interrupt import Interrupted, SignalLatch, StopAtOnce
from bnlit.loggers import read_whole_rows
from conftest import TINY
from helpers_dist import run_train_cli, train_losses as losses

TESTS = Path(__file__).parent
STEPS = ["trainer.max_steps=8", "callbacks.model_checkpoint.every_n_train_steps=3", "trainer.val_check_interval=4",
         "callbacks.model_checkpoint.save_top_k=2"]


class SignalAt(L.Callback):
    """Test-only: send this process ``signum`` as batch ``step`` starts (and, with ``again``, once
    more while the interrupt checkpoint is being written: a second Ctrl-C during the save)."""

    def __init__(self, step: int, signum: str = "SIGTERM", again: bool = False):
        self.step, self.signum, self.again = step, getattr(signal, signum), again

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.again and trainer.global_step == self.step + 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the checkpoint is being written


class SignalInLastValidation(L.Callback):
    """Test-only: SIGTERM as the validation after the last optimizer step starts: no step is left
    for the latch to finish, so the run must stop at the end of training, not run on to its reports."""

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step == trainer.max_steps:
            os.kill(os.getpid(), signal.SIGTERM)


def run_cli(run_dir: Path, *overrides: str):
    return run_train_cli(run_dir, *TINY, *STEPS, *overrides)



def ckpt_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if "ckpt" in p.name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference") / "run"
    out = run_cli(run)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ckpt_names(run) == ["last.ckpt", "step0000003.ckpt", "step0000006.ckpt"]
    return losses(run)


@pytest.mark.slow
def test_a_signal_after_the_last_step_stops_the_run_and_the_resume_finishes_it(reference, tmp_path):
    run = tmp_path / "run"
    out = run_cli(run, "+callbacks.signal._target_=test_interrupt.SignalInLastValidation")
    assert out.returncode == 128 + signal.SIGTERM, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("interrupted ")]
    # the steps after the last periodic checkpoint (step 6) are saved on the way out
    assert lines == [f"interrupted at step 8: saved checkpoints/step0000008.ckpt; resume with ckpt_path=last "
                     f"hydra.run.dir={run}"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    again = run_cli(run, "ckpt_path=last")
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(run) == reference


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_that_step_and_resumes_exactly(reference, tmp_path):
    """SIGTERM at step 4 and a Ctrl-C during the checkpoint write: the step in flight finishes,
    is saved, and the run stops with the resume line. Then the debris of a kill mid-write (a
    partial temporary file, a last.ckpt that lags behind, a torn CSV row) is planted: the restart
    with ``ckpt_path=last`` removes the partial file, resumes from the newest complete step, keeps
    the metrics rows and ends on the uninterrupted curve, bit for bit."""
    run = tmp_path / "run"
    out = run_cli(run, "+callbacks.signal._target_=test_interrupt.SignalAt", "+callbacks.signal.step=4",
                  "+callbacks.signal.again=true")
    assert out.returncode == 128 + signal.SIGTERM, out.stderr[-3000:]
    # the step in flight when the signal came (batch 4) finishes: 5 optimizer steps are saved
    line = f"interrupted at step 5: saved checkpoints/step0000005.ckpt; resume with ckpt_path=last hydra.run.dir={run}"
    assert line in out.stderr.splitlines(), out.stderr[-3000:]
    assert "SIGINT received again: still saving" in out.stderr
    assert ckpt_names(run) == ["last.ckpt", "step0000003.ckpt", "step0000005.ckpt"]
    assert checkpoint_step(run / "checkpoints" / "step0000005.ckpt") == 5
    assert sorted(losses(run)) == [0, 1, 2, 3, 4]  # this step's row too: logged before the stop

    ckpts = run / "checkpoints"
    partial = ckpts / ".step0000006.ckpt.tmp4242"
    partial.write_bytes((ckpts / "step0000005.ckpt").read_bytes()[:5000])
    assert checkpoint_step(ckpts / "last.ckpt") == 3  # last.ckpt lags behind step0000005.ckpt
    csv_path = run / "csv" / "metrics.csv"
    with csv_path.open("a") as f:
        f.write("0,1.23")  # a row torn by a kill
    resumed = run_cli(run, "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not partial.exists()
    assert losses(run) == reference  # the earlier rows kept, the later ones bit-identical
    assert csv_path.read_bytes().endswith(b"\n") and all(None not in r.values() for r in read_whole_rows(csv_path)[1])
    # save_top_k=2 across both processes: step 3 (the first process's) is pruned
    assert ckpt_names(run) == ["last.ckpt", "step0000005.ckpt", "step0000006.ckpt"]

    # resumed from an explicit earlier step, step 6 is written again: in place, not as a -v1 copy
    again = run_cli(run, f"ckpt_path={ckpts}/step0000005.ckpt", "trainer.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert ckpt_names(run) == ["last.ckpt", "step0000005.ckpt", "step0000006.ckpt"]
    assert losses(run) == reference


def save(path: Path, step: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "w": torch.ones(3)}, path)


def test_newest_checkpoint_is_chosen_by_step_and_must_be_complete(tmp_path):
    save(tmp_path / "last.ckpt", 10)
    save(tmp_path / "step0000020.ckpt", 20)
    save(tmp_path / "step0000100.ckpt", 9)  # a name that sorts last but holds an older step
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000020.ckpt"
    (tmp_path / "step0000030.ckpt").write_bytes((tmp_path / "step0000020.ckpt").read_bytes()[:-200])  # torn
    assert checkpoint_step(tmp_path / "step0000030.ckpt") is None
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000020.ckpt"
    save(tmp_path / "last.ckpt", 20)  # the same step: the step file names it
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000020.ckpt"
    assert newest_checkpoint(tmp_path / "missing") is None


def test_a_sharded_checkpoint_counts_only_when_complete(tmp_path):
    """A DCP directory (issue 28) is picked by step like a file, but not before rank 0's meta.pt
    (written after DCP's .metadata) exists: an interrupted sharded save is never ckpt_path=last."""
    import torch.distributed.checkpoint as dcp
    save(tmp_path / "last.ckpt", 10)
    for step in (40, 50):
        dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=tmp_path / f"step{step:07d}.ckpt")
    assert checkpoint_step(tmp_path / "step0000040.ckpt") is None  # shards and index, no meta.pt yet
    assert newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"
    torch.save({"global_step": 40}, tmp_path / "step0000040.ckpt" / "meta.pt")
    assert checkpoint_step(tmp_path / "step0000040.ckpt") == 40
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000040.ckpt"
    from bnlit.checkpointing import prepare_resume
    from bnlit.errors import CheckpointError
    from bnlit.model import ModelConfig
    with pytest.raises(CheckpointError, match="its meta.pt has no model_config"):
        prepare_resume("last", tmp_path, False, ModelConfig(), strategy=None)
    torch.save({"global_step": 40, "model_config": {**ModelConfig().to_dict(), "dim": 8}},
               tmp_path / "step0000040.ckpt" / "meta.pt")
    with pytest.raises(CheckpointError, match="of another shape"):  # checked from meta.pt alone
        prepare_resume("last", tmp_path, False, ModelConfig(), strategy=None)
    torch.save({"global_step": 50}, tmp_path / "step0000050.ckpt" / "meta.pt")
    (tmp_path / "step0000050.ckpt" / ".metadata").unlink()  # killed before DCP's index
    assert newest_checkpoint(tmp_path) == tmp_path / "step0000040.ckpt"


def test_resolve_last_names_a_dir_of_torn_files(tmp_path):
    from bnlit.errors import CheckpointError

    (tmp_path / "last.ckpt").write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointError, match=r"ckpt_path=last: no complete checkpoint in .* \(1 .ckpt files do not "
                                              r"open: truncated or corrupt\); set hydra.run.dir"):
        resolve_ckpt_path("last", tmp_path, overwrite=False)


def test_requeued_slurm_job_resumes_without_ckpt_path(tmp_path, monkeypatch):
    from bnlit.errors import CheckpointError

    save(tmp_path / "step0000004.ckpt", 4)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        resolve_ckpt_path(None, tmp_path, overwrite=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resolve_ckpt_path(None, tmp_path, overwrite=False) == str(tmp_path / "step0000004.ckpt")


def test_partial_writes_are_removed_and_only_they(tmp_path):
    save(tmp_path / "last.ckpt", 3)
    partial = tmp_name(tmp_path / "last.ckpt")
    partial.write_bytes(b"half")
    assert remove_partial_writes(tmp_path) == [partial]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_killed_writers_temp_files_in_the_run_dir_are_removed_and_a_live_ones_kept(tmp_path):
    import subprocess

    from bnlit.storage import remove_stale_temp_files

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that has exited
    (tmp_path / "csv").mkdir()
    stale = [tmp_path / f".tokenizer.model.tmp{dead.pid}", tmp_path / "csv" / f".metrics.csv.tmp{dead.pid}"]
    live = tmp_path / f".tokenizer.model.tmp{os.getpid()}"
    for p in [*stale, live, tmp_path / "notes.tmp1"]:
        p.write_text("x")
    assert sorted(remove_stale_temp_files(tmp_path)) == sorted(stale)
    assert live.exists() and (tmp_path / "notes.tmp1").exists()  # not a temporary name bnlit writes


def test_requeue_names_the_array_task(monkeypatch):
    from bnlit.interrupt import requeue_slurm_job

    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert requeue_slurm_job(lambda cmd: calls.append(cmd) or 0)
    assert calls == [["scontrol", "requeue", "10_2"]]


def test_newest_k_keeps_the_highest_steps():
    assert newest_k({"a": 3, "b": 9, "c": 6}, 2) == ({"b", "c"}, {"a"})
    assert newest_k({"a": 3}, -1) == ({"a"}, set())


def test_torn_csv_rows_are_dropped(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("epoch,step,train/loss\n0,0,7.5\n0,1,7.25\n0,2\n0,3,7.")
    header, rows = read_whole_rows(p)
    assert header == ["epoch", "step", "train/loss"]
    assert [r["step"] for r in rows] == ["0", "1"]


def test_a_second_signal_is_latched_not_raised_and_a_third_ctrl_c_aborts():
    latch = SignalLatch(["SIGUSR1", "SIGINT"])
    before = signal.getsignal(signal.SIGINT)
    latch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert latch.received == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):  # a hung step can still be stopped
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        latch.restore()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is before
    e = Interrupted(signal.SIGTERM, 37, Path("/r/checkpoints/step0000037.ckpt"))
    assert e.exit_code == 143
    assert e.message(Path("/r")) == ("interrupted at step 37: saved checkpoints/step0000037.ckpt; resume with "
                                     "ckpt_path=last hydra.run.dir=/r")


def test_outside_training_a_signal_stops_at_once_naming_the_newest_checkpoint(tmp_path):
    """Config checks, data build, set-up and the final report have no step to finish: the first
    signal raises at once with the documented code and one line; a second one, while that unwinds,
    ends the process outright; the training loop's latch never chains to this handler."""
    newest = [(0, None)]
    stop = StopAtOnce(["SIGTERM", "SIGINT"], lambda: newest[0])
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        replaced = stop.install()
        assert replaced == before
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.exit_code == 143 and e.value.path is None
        assert e.value.message(tmp_path) == ("interrupted before the first checkpoint: nothing to resume; rerun the same "
                                             f"command (hydra.run.dir={tmp_path} may be reused)")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        newest[0] = (12, tmp_path / "checkpoints" / "step0000012.ckpt")
        stop.install()
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)
        assert e.value.exit_code == 130
        assert e.value.message(tmp_path).startswith("interrupted at step 12: saved checkpoints/step0000012.ckpt; "
                                                    "resume with ckpt_path=last")
        stop.install()
        latch = SignalLatch(["SIGTERM"])
        latch.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert latch.received == signal.SIGTERM and latch.chain() is False  # the latch's stop is the step's
        latch.restore()
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_the_latch_chains_to_the_programs_handler_under_stop_at_once():
    """submitit installs its checkpoint-and-requeue handler before bnlit starts; ``bnlit.train``'s
    StopAtOnce replaces it for the whole run; the training loop's latch must still hand the signal
    to submitit's handler once the step's checkpoint is written (the SLURM time-limit test saw
    submitit's handler skipped and the job requeued by ``scontrol`` instead)."""
    called = []
    before = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, lambda signum, frame: called.append(signum))  # submitit's
        stop = StopAtOnce(["SIGUSR2"], lambda: (0, None))
        stop.install()
        latch = SignalLatch(["SIGUSR2"])
        latch.remember_outer()
        latch.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert latch.received == signal.SIGUSR2 and not called  # the step is finished and saved first
        assert latch.chain() is True and called == [signal.SIGUSR2]
        latch.restore()
        assert signal.getsignal(signal.SIGUSR2) is stop
    finally:
        signal.signal(signal.SIGUSR2, before)


def sigterm_on(run: Path, marker: str, *overrides: str) -> tuple[int, str]:
    """Start ``python -m bnlit.train`` and send it SIGTERM from outside when ``marker`` appears in
    its output (stderr and stdout together): the exit code and the whole output."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS / "checks"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-u", "-m", "bnlit.train", *TINY, *overrides, f"hydra.run.dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=run.parent)
    out, sent = [], False
    for raw in iter(proc.stdout.readline, b""):
        out.append(raw.decode("utf-8", "replace"))
        if not sent and marker in out[-1]:
            proc.send_signal(signal.SIGTERM)
            sent = True
    assert sent, "".join(out)[-2000:]
    return proc.wait(timeout=120), "".join(out)


@pytest.mark.slow
def test_sigterm_while_the_data_is_built_is_one_line_and_leaves_no_debris(tmp_path):
    """A signal from outside during the data build of a cold cache (before any checkpoint) ends in
    exit 143 and one line, with no traceback and no temporary file in the cache or the run dir;
    the same command then completes from that cache."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    rc, out = sigterm_on(run, "Seed set to", f"paths.cache_dir={cache}", "trainer.max_steps=2")
    lines = [ln for ln in out.splitlines() if ln.startswith("interrupted ")]
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert lines == [f"interrupted before the first checkpoint: nothing to resume; rerun the same command "
                     f"(hydra.run.dir={run} may be reused)"], out[-3000:]
    assert "Traceback" not in out
    assert not [p for d in (run, cache) for p in d.rglob("*") if ".tmp" in p.name or p.name.startswith("tmp")]
    again = run_train_cli(run, *TINY, f"paths.cache_dir={cache}", "trainer.max_steps=2")
    assert again.returncode == 0, again.stderr[-3000:]


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class SelfInterrupting(torch.utils.data.Dataset):
    """Item i sends its own worker the i-th signal, as a Ctrl-C in a terminal does (SIGINT), or
    SLURM to every process of a job step (SIGTERM on preemption, SIGUSR1/2 before the time limit)."""

    def __len__(self):
        return len(SIGNALS)

    def __getitem__(self, i):
        os.kill(os.getpid(), SIGNALS[i])
        return torch.tensor(i)


def test_data_loader_workers_survive_ctrl_c_and_slurm_signals():
    from bnlit.interrupt import worker_ignores_interrupts

    # the trainer's handlers at fork time: a worker must not run them (submitit would requeue the job)
    ran = []
    before = {s: signal.signal(s, lambda *a: ran.append(os.getpid())) for s in SIGNALS}
    try:
        loader = torch.utils.data.DataLoader(SelfInterrupting(), num_workers=1,
                                             worker_init_fn=worker_ignores_interrupts)
        assert [int(x) for x in loader] == list(range(len(SIGNALS)))
        # the comparison can fail: without it the worker dies of SIGTERM
        with pytest.raises(RuntimeError, match="DataLoader worker"):
            list(torch.utils.data.DataLoader(SelfInterrupting(), num_workers=1,
                                             worker_init_fn=lambda i: signal.signal(signal.SIGTERM, signal.SIG_DFL)))
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert ran == []
