"""What a checkpoint needs beyond Lightning's model/optimizer/scheduler/loop state for an exact
resume: every rank's RNG states (torch, CUDA, numpy, python) and the data sampler's position.

RNG states are stored as plain tensors, ints and lists so the checkpoint still loads with
``torch.load(weights_only=True)``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bnlit.data.dataset import reshard_start
from bnlit.errors import CheckpointError


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a ``weights_only``-loadable form."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective under torch.distributed)."""
    mine = rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


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
