"""The parameters a gradient-flow check looks at, and their norms: each trainable tensor once
(tied embeddings under their first name), the rank-local part of an FSDP shard, names matched
against allow-list patterns, and per-tensor norms that are exact where the fp32 L2 norm is not.

The exactness matters: one fused L2-norm pass finds the candidates, and a candidate is called zero
or non-finite only after an exact re-check -- the fp32 L2 norm underflows to 0 for gradients around
1e-23 and overflows to Inf above 1e19 (:func:`_classify`)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence

import torch

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
NamedParameters = Iterable[tuple[str, torch.Tensor]]

INF = float("inf")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (possibly FSDP2 ``DTensor``) tensor, dense."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if t.is_sparse:
        t = t.coalesce().values()
    return t


def shard_layout(t: torch.Tensor) -> tuple[int, int]:
    """``(offset, replicas)`` of a (possibly FSDP2 ``DTensor``) tensor's local part: the global
    index of its first row (dim 0), and how many ranks hold a copy of it (the product of the mesh
    dims it is replicated over: the nodes under HSDP). A plain tensor: ``(0, 1)``."""
    if not hasattr(t, "device_mesh"):
        return 0, 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    replicas = math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_replicate())
    return (int(offset[0]) if len(offset) else 0), replicas


def unique_trainable(named_parameters: NamedParameters) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str], list[str]]:
    """Split ``named_parameters`` into the trainable parameters (each tensor once, under its first
    name), the aliases of tied tensors (``{alias: kept name}``) and the frozen names."""
    seen: dict[int, str] = {}
    params, tied, frozen = [], {}, []
    for name, p in named_parameters:
        if id(p) in seen:
            tied[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        if p.requires_grad:
            params.append((name, p))
        else:
            frozen.append(name)
    return params, tied, frozen


def _norms(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Per-tensor norms as fp32 0-d tensors, one fused kernel per (device, dtype) group."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for idx in groups.values():
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], ord)):
            out[i] = n.float()
    return out  # type: ignore[return-value]


def _reduce(t: torch.Tensor, reduce: Reduce | None, op: str) -> torch.Tensor:
    return reduce(t, op) if reduce is not None else t


def _classify(tensors: Sequence[torch.Tensor]) -> tuple[list[float], list[bool], list[bool]]:
    """L2 norms, non-finite flags and all-zero flags, exact, in one fused pass and one host sync.

    The L2 norm propagates NaN/Inf, and is 0 for an all-zero tensor; it can also overflow (|x| >
    1e19 in fp32) or underflow (|x| < 1e-23) -- so the few tensors it flags are re-checked
    exactly (``isfinite().all()``, ``any()``) before they are called non-finite or zero."""
    l2 = torch.stack([n.to(tensors[0].device) for n in _norms(tensors, 2.0)]).cpu().tolist()
    nonfinite = [not math.isfinite(n) for n in l2]
    zero = [n == 0.0 for n in l2]
    for i, t in enumerate(tensors):
        if nonfinite[i]:
            nonfinite[i] = not bool(torch.isfinite(t).all())
        elif zero[i]:
            zero[i] = not bool(t.any())
            if not zero[i]:
                l2[i] = float(torch.linalg.vector_norm(t, dtype=torch.float64))  # underflowed in fp32
        if not nonfinite[i] and not math.isfinite(l2[i]):
            l2[i] = float(torch.linalg.vector_norm(t, dtype=torch.float64))  # overflowed in fp32
    return l2, nonfinite, zero


def allowed(name: str, patterns: Iterable[str] | None) -> bool:
    """Whether ``name`` matches one of the ``fnmatch`` patterns (``"model.layers.*.moe.*"``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())
