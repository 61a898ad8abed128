"""Fixed-length windows over packed token arrays and a seeded, rank-aware mixture order.

The sample order follows OLMo: one global order per epoch computed from ``PCG64(seed + epoch)``,
sliced by rank; it does not depend on the number of data-loader workers, and the sampler can
start from any position (for resume)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from bnlit.errors import CheckpointError


class PackedWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: ``(input, target)`` shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict:
        """Tokens mapped from a whole file travel as its path (a loader worker that does not fork
        from this process maps the file again); any other array travels as its data."""
        state = dict(self.__dict__)
        t = self.tokens
        if isinstance(t, np.memmap) and t.filename and t.offset == 0 and t.ndim == 1 \
                and t.nbytes == os.path.getsize(t.filename):
            state["tokens"] = MappedFile(os.path.abspath(t.filename), t.dtype.str, len(t))
        return state

    def __setstate__(self, state: dict) -> None:
        t = state["tokens"]
        if isinstance(t, MappedFile):
            state["tokens"] = np.memmap(t.path, dtype=np.dtype(t.dtype), mode="r", shape=(t.length,))
        self.__dict__.update(state)


class MappedFile(NamedTuple):
    """A 1-D token file mapped read-only: what a pickled :class:`PackedWindows` holds."""

    path: str
    dtype: str
    length: int


def mixture_counts(sizes: Sequence[int], weights: Sequence[float], epoch_len: int) -> list[int]:
    """Samples drawn from each source per epoch so that their shares follow ``weights``
    (largest-remainder rounding, so the counts sum to ``epoch_len`` exactly)."""
    w = np.asarray(weights, dtype=np.float64) * (np.asarray(sizes) > 0)
    if w.sum() <= 0:
        raise ValueError("mixture has no source with both positive weight and data")
    exact = w / w.sum() * epoch_len
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: epoch_len - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def epoch_order(sizes: Sequence[int], weights: Sequence[float], epoch_len: int, seed: int, epoch: int) -> np.ndarray:
    """Global sample indices (into the concatenation of all sources) for one epoch. A source
    asked for more samples than it has is repeated, each pass in a fresh permutation."""
    rng = np.random.Generator(np.random.PCG64(seed + epoch))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parts = []
    for size, count, offset in zip(sizes, mixture_counts(sizes, weights, epoch_len), offsets):
        if count == 0:
            continue
        reps = -(-count // size)
        perm = np.concatenate([rng.permutation(size) for _ in range(reps)])[:count]
        parts.append(perm + offset)
    order = np.concatenate(parts)
    return order[rng.permutation(len(order))]


class MixtureSampler(Sampler[int]):
    """Yields this rank's slice of the epoch order, from ``start`` (samples already consumed by
    this rank in the current epoch).

    The global order does not depend on ``world_size``: it is computed for all ``epoch_len``
    samples and cut to a multiple of ``world_size``, so a run resumed on a different number of
    ranks continues the same order (see :func:`reshard_start`). ``len()`` is the whole epoch's
    share of this rank even after a resume, because Lightning counts the batches already done.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        epoch_len: int | None = None,
    ):
        self.sizes, self.weights = list(sizes), list(weights)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.total = epoch_len if epoch_len is not None else sum(self.sizes)
        self.epoch_len = self.total - self.total % world_size  # every rank gets the same number of samples
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.epoch_len // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.sizes, self.weights, self.total, self.seed, self.epoch)[: self.epoch_len]
        mine = order[self.rank :: self.world_size]
        start, self.start = self.start, 0  # a resumed position applies to one epoch only
        return iter(mine[start:].tolist())


def reshard_start(consumed_per_rank: int, old_world: int, new_world: int) -> int:
    """Per-rank start for ``new_world`` ranks after ``old_world`` ranks each consumed
    ``consumed_per_rank`` samples of an epoch. Rank ``r`` takes positions ``r, r+W, ...`` of the
    global order, so together the ranks consumed exactly its first ``consumed_per_rank * old_world``
    samples; the new ranks continue from there when that count divides evenly."""
    consumed = consumed_per_rank * old_world
    if consumed % new_world:
        raise ValueError(f"{consumed} samples consumed by {old_world} ranks cannot be split evenly over {new_world} ranks")
    return consumed // new_world


def resume_start(position: dict[str, int], world_size: int, batch_size: int) -> int:
    """Per-rank sampler start for a run of ``world_size`` ranks resuming from ``position`` (as
    saved by ``BnDataModule.state_dict``). The same world size continues where each rank
    stopped; another world size is resharded when the global batch is unchanged and the
    consumed samples split evenly, and refused otherwise."""
    old_world, old_batch = position["world_size"], position["batch_size"]
    consumed = position["samples_per_rank"]
    if old_world == world_size and old_batch == batch_size:
        return consumed
    if old_world * old_batch != world_size * batch_size:
        raise CheckpointError(
            f"checkpoint was written by {old_world} ranks x data.batch_size={old_batch}; this run has "
            f"{world_size} x {batch_size}; resume with the same global batch (ranks x data.batch_size = "
            f"{old_world * old_batch}) so the data order can be resharded")
    return reshard_start(consumed, old_world, world_size)
