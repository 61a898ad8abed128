"""Progress the user can trust: the training bar counts the run's optimizer steps across epochs,
the data build shows its stages, and the thread count follows the load."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bnlit import progress
from bnlit.speed.threads import choose_threads, idle_cores, rechoose_threads
from bnlit.callbacks.progress_bar import RunProgressBar
from bnlit.progress import run_total_steps
from bnlit.callbacks.threads import ThreadsFollowLoad
from bnlit.errors import ConfigError


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Spy(RunProgressBar):
    def __init__(self):
        super().__init__(refresh_rate=1)
        self.seen: list[tuple[int, int, int | None]] = []  # (epoch, bar.n, bar.total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        self.seen.append((trainer.current_epoch, bar.n, bar.total))


def test_bar_counts_optimizer_steps_across_epochs(tmp_path):
    """5 batches an epoch, 2 batches an optimizer step, 7 steps: the bar goes 1..7 of 7 over
    three epochs, never back to 0 at an epoch boundary."""
    data = DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=2)
    spy = Spy()
    trainer = L.Trainer(max_steps=7, accumulate_grad_batches=2, callbacks=[spy], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Tiny(), data)
    assert trainer.global_step == 7
    assert {total for _, _, total in spy.seen} == {7}
    shown = [n for _, n, _ in spy.seen]
    assert shown == sorted(shown) and shown[-1] == 7 and set(shown) == set(range(8)) - {0} | ({0} & set(shown))
    assert {epoch for epoch, _, _ in spy.seen} == {0, 1, 2}  # it crossed two epoch boundaries


def test_run_total_steps_from_epochs(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=2)  # 6 batches an epoch
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(Tiny(), data)
    assert run_total_steps(trainer) == 4 == trainer.global_step


@pytest.mark.parametrize("cpus,load,want", [(2, 0.1, 2), (2, 0.6, 1), (2, 0.4, 2), (2, 20.0, 1), (16, 3.2, 13),
                                            (4, None, 4), (1, 0.0, 1)])
def test_auto_threads_take_the_idle_cores(cpus, load, want):
    n, why = choose_threads("auto", cpus, load)
    assert n == want
    assert why.startswith(f"auto: {cpus} cores, load average ")


@pytest.mark.parametrize("cpus,load,idle,want", [
    (2, 0.9, 1.96, 2),  # the README's pip install just ended: its share of the load average is history
    (2, 0.1, 0.8, 1),   # another job took a core a moment ago: the average has not seen it yet
    (2, 0.0, 0.0, 1), (16, 3.0, 15.2, 15), (4, None, 3.7, 4)])
def test_auto_threads_take_the_cores_measured_idle_at_start(cpus, load, idle, want):
    n, why = choose_threads("auto", cpus, load, idle)
    assert n == want
    assert why.startswith(f"auto: {cpus} cores, {idle:.1f} idle over 0.5 s")


def test_idle_cores_sees_a_busy_process_on_one_of_this_process_cores():
    mine = sorted(os.sched_getaffinity(0))
    quiet = idle_cores()
    assert quiet is not None and 0 <= quiet <= len(mine) + 0.01
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{mine[0]}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        assert idle_cores() <= len(mine) - 0.7  # that core is busy, whatever else the machine does
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize("cpus,load,current,want", [
    (2, 2.1, 2, 2),    # a quiet machine: the load is the run's own two threads
    (2, 7.0, 2, 1),    # five other jobs arrived: drop to one
    (2, 1.1, 1, 2),    # they left: the run's one thread is the whole load, take both
    (2, 1.8, 1, 1),    # about one other job: one core is idle
    (16, 16.0, 16, 16), (16, 20.0, 12, 8)])
def test_running_auto_threads_discount_their_own_load(cpus, load, current, want):
    assert rechoose_threads(cpus, load, current)[0] == want


def test_threads_follow_the_load_during_a_run(tmp_path, monkeypatch):
    import bnlit.callbacks.threads as cb

    loads = iter([7.0, 7.0, 1.1])  # others arrive, stay, leave
    monkeypatch.setattr(cb, "load_average", lambda: next(loads))
    monkeypatch.setattr(cb, "available_cpus", lambda: 2)
    before = torch.get_num_threads()
    follow = ThreadsFollowLoad("auto", every_n_steps=2)
    pinned = ThreadsFollowLoad(1, every_n_steps=2)
    data = DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=1)
    try:
        torch.set_num_threads(2)
        trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_model_summary=False,
                            enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[follow, pinned])
        trainer.fit(Tiny(), data)
    finally:
        torch.set_num_threads(before)
    assert follow.changes == [(2, 2, 1), (6, 1, 2)]  # looked at steps 2, 4, 6
    assert pinned.changes == []
    with pytest.raises(ConfigError, match="every_n_steps=0"):
        ThreadsFollowLoad("auto", every_n_steps=0)


def test_pinned_threads():
    assert choose_threads(3, 2, 50.0) == (3, "set by threads")


def test_data_stages_show_progress_and_a_summary(tmp_path, capsys, caplog, monkeypatch):
    """Tokenizer training on a small corpus: a bar on stdout that reaches its merges total, and
    SentencePiece's own log lines do not leak to stderr. The bar redraws on every update here
    (as on a slow, loaded machine), which once fed SentencePiece tqdm's return value."""
    from bnlit.tokenizer import train_tokenizer

    real_bar = progress.bar

    def eager_bar(*args, **kwargs):
        b = real_bar(*args, **kwargs)
        b.mininterval, b.miniters = 0, 1
        return b

    monkeypatch.setattr(progress, "bar", eager_bar)

    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    docs = [" ".join(rng.choice(words) for _ in range(30)) + " এটি বাংলা বাক্য।" for _ in range(1500)]
    progress.ENABLED = True
    try:
        train_tokenizer(docs, tmp_path / "t.model", vocab_size=1000)
    finally:
        progress.ENABLED = True
    out, err = capsys.readouterr()
    frames = out.replace("\r", "\n")
    assert "tokenizer: reading" in frames
    merges = [line for line in frames.splitlines() if line.startswith("tokenizer: bpe merges")]
    assert merges and "100%" in merges[-1]
    assert "trainer_interface" not in err and "bpe_model_trainer" not in err
    with caplog.at_level(logging.INFO, logger="bnlit"):
        progress.stage_summary("shards", "4.2M training tokens", 12.34)
    assert caplog.records[-1].getMessage() == "data: shards 4.2M training tokens in 12.3 s"


def test_human_counts():
    assert [progress.human(x) for x in (999, 4_200_000, 61_500, 2.5e9)] == ["999", "4.2M", "61.5k", "2.5G"]


class SetsThreads(L.Callback):
    """Planted: changes torch's thread count when it is built (as a module's import can), and records
    the count the fit runs with."""

    seen: list[int] = []  # the counts of every fit, kept on the class: the run builds its own instance

    def __init__(self, n: int):
        torch.set_num_threads(n)

    def on_train_start(self, trainer, pl_module):
        SetsThreads.seen.append(torch.get_num_threads())


def test_the_runs_thread_count_holds_when_a_callback_changes_it(make_cfg, caplog):
    from bnlit.train import train

    before = torch.get_num_threads()
    SetsThreads.seen.clear()
    cfg = make_cfg("trainer.max_steps=2", "+callbacks.sets_threads._target_=test_progress.SetsThreads",
                   "+callbacks.sets_threads.n=2")  # TINY pins threads=1
    caplog.set_level("WARNING", logger="bnlit")
    try:
        train(cfg)
    finally:
        torch.set_num_threads(before)
    assert SetsThreads.seen == [1]
    assert "threads: 1 again (torch was set to 2 " in caplog.text
