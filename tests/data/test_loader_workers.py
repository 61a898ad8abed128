"""Loader workers (``data.num_workers > 0``) start from a fork server (``data.multiprocessing_context``,
:func:`bnlit.data.datamodule.worker_context`): a worker forked from the trainer itself inherits every
lock another of its threads holds at that instant, held forever; and the datasets they receive
travel as file paths, not as copies of the token arrays."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from bnlit.data.dataset import PackedWindows
from bnlit.data.datamodule import worker_context

LOCK = threading.Lock()  # held by another thread of the test process while the workers start


class NeedsTheLock(Dataset):
    """Each item takes ``LOCK``, as a worker's first call into a library takes that library's lock."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if not LOCK.acquire(timeout=3):
            raise RuntimeError("this worker inherited a lock that no thread of it will ever release")
        LOCK.release()
        return torch.tensor(i)


@pytest.fixture
def lock_held_by_another_thread():
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with LOCK:
            taken.set()
            done.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    taken.wait(10)
    yield
    done.set()
    thread.join(10)


def batches(method: str) -> list[int]:
    loader = DataLoader(NeedsTheLock(), batch_size=1, num_workers=1, multiprocessing_context=worker_context(method))
    return [int(b) for b in loader]


def test_a_forked_worker_inherits_the_held_lock(lock_held_by_another_thread):
    """The planted fault the default guards against: with ``fork`` the worker cannot take the lock."""
    with pytest.raises(RuntimeError, match="inherited a lock"):
        batches("fork")


def test_a_worker_from_the_fork_server_does_not(lock_held_by_another_thread):
    assert batches("forkserver") == [0, 1, 2, 3]


def test_the_datamodule_default_is_the_fork_server(make_cfg):
    from hydra.utils import instantiate

    dm = instantiate(make_cfg("data.num_workers=1").data)
    assert dm._loader(NeedsTheLock()).multiprocessing_context.get_start_method() == "forkserver"


def test_windows_over_a_token_file_pickle_as_its_path(tmp_path):
    tokens = np.arange(100_000, dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    windows = PackedWindows(np.memmap(path, dtype=np.uint16, mode="r"), seq_len=64)
    blob = pickle.dumps(windows)
    assert len(blob) < 1_000  # the path, not the 200 kB of tokens
    back = pickle.loads(blob)
    assert isinstance(back.tokens, np.memmap) and len(back) == len(windows)
    for i in (0, 7, len(windows) - 1):
        torch.testing.assert_close(back[i], windows[i])


def test_windows_over_an_array_or_a_slice_of_a_file_pickle_their_data(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1_000, dtype=np.uint16).tofile(path)
    for tokens in (np.arange(500, dtype=np.uint16), np.memmap(path, dtype=np.uint16, mode="r")[100:600]):
        windows = PackedWindows(tokens, seq_len=16)
        back = pickle.loads(pickle.dumps(windows))
        assert len(back) == len(windows)
        torch.testing.assert_close(back[3], windows[3])


class Draws(Dataset):
    """What each item's worker draws from torch, ``random`` and NumPy."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[float, float, float]:
        import random

        return torch.rand(()).item(), random.random(), float(np.random.rand())


def draws(rank: int) -> list[tuple[float, float, float]]:
    from functools import partial

    from bnlit.interrupt import seed_workers, worker_ignores_interrupts

    loader = DataLoader(Draws(), batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(0),
                        worker_init_fn=partial(worker_ignores_interrupts, rank=rank, seed=seed_workers()),
                        multiprocessing_context=worker_context("forkserver"))
    return [tuple(float(v) for v in d) for d in loader]  # items 0, 2 from worker 0; 1, 3 from worker 1


def test_each_worker_of_each_rank_draws_its_own_reproducible_stream(monkeypatch):
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # what seed_everything(workers=True) sets, here after the
    rank0, rank1 = draws(0), draws(1)  # fork server started (earlier tests): the trainer passes what it read
    assert draws(0) == rank0  # reproducible
    firsts = [rank0[0], rank0[1], rank1[0], rank1[1]]  # worker 0 and 1 of each rank, first draw
    for k in range(3):  # torch, random, numpy: four different streams each
        assert len({d[k] for d in firsts}) == 4, firsts


SURVIVES = """
import os, signal, time
from multiprocessing import forkserver
from torch.utils.data import DataLoader
from bnlit.data.datamodule import worker_context
from bnlit.interrupt import WORKER_IGNORED_SIGNALS

got = []
for s in WORKER_IGNORED_SIGNALS:
    signal.signal(s, lambda n, f: got.append(n))  # the trainer's own handlers
ctx = worker_context("forkserver")
server = forkserver._forkserver._forkserver_pid
for s in WORKER_IGNORED_SIGNALS:  # what SLURM sends to every process of the job step
    os.kill(server, s)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGUSR2)  # the trainer still gets its own
loader = DataLoader(list(range(6)), batch_size=2, num_workers=2, multiprocessing_context=ctx)
batches = [b.tolist() for b in loader]
state = open(f"/proc/{server}/status").read().split("State:")[1].split()[0]  # S: sleeping, alive
print(batches, state in "SR", got == [signal.SIGUSR2])
"""


def test_the_fork_server_survives_the_signals_slurm_sends_the_job_step():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SURVIVES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[[0,", "1],", "[2,", "3],", "[4,", "5]]", "True", "True"], out.stdout
