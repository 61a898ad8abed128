"""The gradient check after backward: every trainable parameter has a gradient that is present,
finite, not all zeros, not vanishing against its peers, and reaches at least half of a matrix's
output rows (:func:`gradient_flow_report`, :class:`GradientFlowReport`); the rows of an embedding
table that a batch never looked up are exempt (:func:`embedding_row_exempt`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection

from bnlit.checks.gradient_flow.params import (NamedParameters, Reduce, _classify, _local, _norms, _reduce, allowed, shard_layout,
                                               unique_trainable)

VANISHING_FACTOR = 1e6  # see GradientFlowReport: healthy spreads measured in docs/gradient-flow.md stay below 1e3
DEAD_ROW_SHARE = 0.5
CATEGORIES = ("missing", "nonfinite", "zero", "vanishing", "dead_rows", "frozen_in_optimizer")


def integer_tensors(batches: Iterable) -> list[torch.Tensor]:
    """The integer tensors of a list of batches (any nesting of tuples, lists and dicts)."""
    out: list[torch.Tensor] = []
    apply_to_collection(list(batches), torch.Tensor,
                        lambda t: out.append(t) if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) else None)
    return out


def embedding_row_exempt(module: nn.Module, batches: Sequence) -> dict[str, torch.Tensor | None]:
    """For every ``nn.Embedding`` weight of ``module``: a mask of the rows exempt from the
    dead-rows check -- tokens absent from ``batches`` (those rows get exactly zero gradient by
    design) and the padding row. The present tokens are the values of the batches' integer
    tensors (inputs, targets, masks: a superset of what reached the embedding, which only makes
    the check more lenient). ``None``: no integer tensor, exempt the whole table. Under FSDP the
    mask covers the whole (global) table; :func:`gradient_flow_report` takes each shard's rows."""
    tables = {id(m.weight): m for m in module.modules() if isinstance(m, nn.Embedding)}
    if not tables:
        return {}
    ids = integer_tensors(batches)
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        m = tables.get(id(p))
        if m is None or name in out:
            continue
        if not ids:
            out[name] = None
            continue
        present = torch.zeros(m.num_embeddings, dtype=torch.bool, device=p.device)
        for t in ids:
            v = t.reshape(-1).to(p.device)
            present[v[(v >= 0) & (v < m.num_embeddings)]] = True
        if m.padding_idx is not None:
            present[m.padding_idx] = False
        out[name] = ~present
    return out


@dataclass
class GradientFlowReport:
    """Verdict on the gradients of one backward pass.

    ``names`` are the parameters checked (trainable, tied tensors once); ``norms`` their L2
    gradient norms (NaN where the gradient is missing or non-finite); ``ranks`` how many ranks saw
    each fault (1 on a single process).

    ``vanishing``: ``{name: ratio / median}`` for a parameter whose gradient-to-weight norm ratio
    ``||g|| / ||w||`` is ``vanishing_factor`` (1e6) or more times below the median over all checked
    parameters (``vanishing_median``; parameters with a zero weight norm are not judged). Healthy
    models spread this ratio over < 1e3 (docs/gradient-flow.md); a gradient scaled down by a broken kernel or an
    underflowing cast is 1e6-1e12 below.

    ``dead_rows``: ``{name: share}`` for a matrix (``ndim >= 2``) in which ``dead_row_share``
    (50%) or more of its output rows (dim 0) get exactly zero gradient; rows of embedding tables
    for tokens absent from the batch are not counted (``row_exempt``); ``dead_row_ranges`` names
    the dead rows by global index (under FSDP too), as ``[first, last]`` runs.
    """

    names: list[str]
    norms: dict[str, float]
    missing: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    zero: list[str] = field(default_factory=list)
    vanishing: dict[str, float] = field(default_factory=dict)
    dead_rows: dict[str, float] = field(default_factory=dict)
    grad_to_weight: dict[str, float] = field(default_factory=dict)
    vanishing_median: float = math.nan
    vanishing_peers: int = 0
    vanishing_factor: float = VANISHING_FACTOR
    dead_row_share: float = DEAD_ROW_SHARE
    dead_row_counts: dict[str, list[int]] = field(default_factory=dict)  # {name: [zero rows, counted rows]}
    dead_row_ranges: dict[str, list[list[int]]] = field(default_factory=dict)  # {name: [[first, last] global row]}
    weight_norms: dict[str, float] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)
    world_size: int = 1

    @property
    def ok(self) -> bool:
        return not (self.missing or self.nonfinite or self.zero or self.vanishing or self.dead_rows)

    @property
    def num_ok(self) -> int:
        return len(self.names) - len(self.problems())

    @property
    def total_norm(self) -> float:
        return math.sqrt(sum(v * v for v in self.norms.values() if math.isfinite(v)))

    def findings(self) -> list[dict]:
        """One ``{category, parameter, figure, threshold, message}`` per fault, in parameter order."""
        where = lambda n: f" (on {self.ranks[n]} of {self.world_size} ranks)" if self.world_size > 1 and n in self.ranks else ""  # noqa: E731
        out = []
        for n in self.missing:
            out.append(dict(category="missing", parameter=n, figure=None, threshold=None, message=
                            "gradient is None (no gradient reached it: detached, unused or outside the graph)" + where(n)))
        for n in self.nonfinite:
            out.append(dict(category="nonfinite", parameter=n, figure=None, threshold=None,
                            message="gradient has NaN/Inf values" + where(n)))
        for n in self.zero:
            out.append(dict(category="zero", parameter=n, figure=0.0, threshold=None, message=
                            "gradient is exactly zero everywhere (a zeroing kernel, a multiply by zero, a dead path)" + where(n)))
        for n, rel in self.vanishing.items():
            out.append(dict(category="vanishing", parameter=n, figure=rel, threshold=1 / self.vanishing_factor, message=(
                f"vanishing gradient: gradient-to-weight norm ratio {self.grad_to_weight[n]:.3g} is {rel:.3g} x the "
                f"median {self.vanishing_median:.3g} of {self.vanishing_peers} parameters (threshold "
                f"{1 / self.vanishing_factor:g} x)")))
        for n, share in self.dead_rows.items():
            zero_rows, rows = self.dead_row_counts[n]
            out.append(dict(category="dead_rows", parameter=n, figure=share, threshold=self.dead_row_share, message=(
                f"dead rows: {zero_rows} of its {rows} output rows ({share:.0%}) got exactly zero gradient "
                f"(threshold {self.dead_row_share:.0%}): rows {_ranges_text(self.dead_row_ranges[n])}")))
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(out, key=lambda f: order.get(f["parameter"], len(order)))

    def problems(self) -> dict[str, str]:
        """``{name: what is wrong}`` in parameter order."""
        found: dict[str, str] = {}
        for f in self.findings():
            found[f["parameter"]] = f"{found[f['parameter']]}; {f['message']}" if f["parameter"] in found else f["message"]
        return found

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "total_norm": self.total_norm,
                "findings": self.findings(), "problems": self.problems()}


def _dead_rows(g: torch.Tensor, exempt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a matrix's gradient that are exactly zero and not exempt (a bool mask), and
    how many rows are counted (a 0-d tensor)."""
    dead = ~g.reshape(g.shape[0], -1).ne(0).any(1)
    if exempt is not None:
        dead &= ~exempt
        counted = exempt.numel() - exempt.sum()
    else:
        counted = torch.tensor(g.shape[0], device=g.device)
    return dead, counted


def row_ranges(rows: Sequence[int]) -> list[list[int]]:
    """Sorted row indices as ``[[first, last], ...]`` runs of consecutive rows."""
    out: list[list[int]] = []
    for r in rows:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _ranges_text(ranges: Sequence[Sequence[int]], most: int = 8) -> str:
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:most])
    return text + (f" and {len(ranges) - most} more runs" if len(ranges) > most else "")


def gradient_flow_report(
    named_parameters: NamedParameters, *, reduce: Reduce | None = None, sharded: bool = False,
    world_size: int = 1, vanishing_factor: float = VANISHING_FACTOR, dead_row_share: float = DEAD_ROW_SHARE,
    row_exempt: Mapping[str, torch.Tensor | None] | None = None, allow: Mapping[str, Sequence[str]] | None = None,
) -> GradientFlowReport:
    """Classify every trainable parameter's ``.grad`` as missing, non-finite, zero, vanishing,
    with dead rows, or ok.

    Call after backward (and after AMP unscaling). Frozen parameters are skipped and a tensor
    shared under several names (tied embeddings) is checked once. Two host syncs (three with
    ``reduce``) and, with ``reduce``, one collective: the per-parameter table and the dead-row
    flags of every matrix, all-reduced together.

    Args:
        named_parameters: e.g. ``model.named_parameters()``.
        reduce: all-reduce across ranks. Under DDP (``sharded=False``, gradients already
            averaged) a fault on any rank is a fault; under FSDP a parameter is zero only if all
            of its non-empty shards are.
        sharded: parameters are FSDP2 ``DTensor`` shards of dim 0 (FSDP, or HSDP: replicated
            over the mesh's other dim). Every verdict is then on the full parameter: squared norms
            are summed over the shards (each counted once: a sum over replicas is divided by their
            number), dead rows are counted and named by global row index (a local shard's rows
            are a contiguous block, at the offset its placement gives), embedding tables included.
        world_size: number of ranks, for the messages.
        vanishing_factor: flag a gradient-to-weight norm ratio this many times below the median.
        dead_row_share: flag a matrix with at least this share of exactly-zero gradient rows.
        row_exempt: ``{name: bool mask of rows not to count (global rows), or None for the whole
            tensor}`` (:func:`embedding_row_exempt`).
        allow: ``{category: [fnmatch patterns]}`` of parameters exempt from ``vanishing`` and
            ``dead_rows``.
    """
    allow, row_exempt = allow or {}, row_exempt or {}
    params, tied, frozen = unique_trainable(named_parameters)
    names = [n for n, _ in params]
    report = GradientFlowReport(names=names, norms={}, tied=tied, frozen=frozen, world_size=world_size,
                                vanishing_factor=vanishing_factor, dead_row_share=dead_row_share)
    if not params:
        return report
    device = _local(params[0][1]).device
    dtype = torch.float64 if device.type != "mps" else torch.float32
    layout = [shard_layout(p) for _, p in params]  # (row offset of the local shard, replicas)
    # every matrix's global rows get a slot in one flag vector, reduced with the table (one collective)
    row_base, total_rows = [], 0
    for _, p in params:
        row_base.append(total_rows)
        total_rows += p.shape[0] if p.ndim >= 2 else 0
    dead_flags = torch.zeros(total_rows, dtype=dtype, device=device)
    # columns: holds a shard, grad is None, non-finite, all zero, squared L2 norm of the gradient
    # (finite only), squared L2 norm of the weight, rows with a zero gradient, rows counted
    rows = [[0.0] * 8 for _ in params]
    with_grad = []
    for i, (_, p) in enumerate(params):
        if _local(p).numel() == 0:
            continue  # an FSDP rank may hold no shard of this parameter
        rows[i][0] = 1.0
        if p.grad is None:
            rows[i][1] = 1.0
        else:
            with_grad.append((i, _local(p.grad)))
    if with_grad:
        l2, nonfinite, zero = _classify([g for _, g in with_grad])
        w2 = torch.stack([n.to(device) for n in _norms([_local(params[i][1]).detach() for i, _ in with_grad], 2.0)])
        extra = torch.zeros(len(with_grad), 3, dtype=torch.float64, device=device)
        extra[:, 0] = w2.double()
        for j, ((i, g), bad, z) in enumerate(zip(with_grad, nonfinite, zero)):
            name, p = params[i]
            exempt = row_exempt.get(name, False)
            # a zero shard of a sharded parameter is all dead rows unless every shard is zero
            if (bad or (z and not sharded) or p.ndim < 2 or p.shape[0] < 2 or allowed(name, allow.get("dead_rows"))
                    or exempt is None):
                continue
            start = layout[i][0]
            if isinstance(exempt, torch.Tensor):
                exempt = exempt[start:start + g.shape[0]].to(g.device)
            dead, counted = _dead_rows(g, exempt if isinstance(exempt, torch.Tensor) else None)
            dead_flags[row_base[i] + start:row_base[i] + start + g.shape[0]] = dead.to(device, dtype)
            extra[j, 1:] = torch.stack([dead.sum(), counted]).to(device, torch.float64)
        extra = extra.cpu().tolist()
        for (i, _), n, bad, z, (wn, dead, counted) in zip(with_grad, l2, nonfinite, zero, extra):
            rows[i][2:8] = [float(bad), float(z), 0.0 if bad else n * n, wn * wn, dead, counted]
    table = torch.tensor(rows, dtype=dtype, device=device)
    reduced = _reduce(torch.cat([table.reshape(-1), dead_flags]), reduce, "sum").cpu()
    stats = reduced[:table.numel()].reshape(table.shape).tolist()
    dead_flags = reduced[table.numel():] > 0

    for i, (name, (held, missing, nonfinite, zero, gsq, wsq, dead, counted)) in enumerate(zip(names, stats)):
        # DDP ranks hold the same averaged gradient; FSDP ranks one shard each, HSDP replicas the same shard
        divide = layout[i][1] if sharded else max(1, world_size)
        if held == 0:
            report.norms[name] = 0.0
            continue
        if missing > 0:
            report.missing.append(name)
            report.ranks[name] = int(missing)
        elif nonfinite > 0:
            report.nonfinite.append(name)
            report.ranks[name] = int(nonfinite)
        elif (zero == held) if sharded else (zero > 0):
            report.zero.append(name)
            report.ranks[name] = int(zero)
        bad = missing > 0 or nonfinite > 0
        report.norms[name] = math.nan if bad else math.sqrt(gsq / divide)
        report.weight_norms[name] = math.sqrt(wsq / divide)
        if not bad and wsq > 0:
            report.grad_to_weight[name] = math.sqrt(gsq / wsq)
        if counted > 0 and not bad and name not in report.zero and dead / counted >= dead_row_share:
            report.dead_rows[name] = dead / counted
            report.dead_row_counts[name] = [round(dead / divide), round(counted / divide)]
            flags = dead_flags[row_base[i]:row_base[i] + params[i][1].shape[0]]
            report.dead_row_ranges[name] = row_ranges(flags.nonzero().flatten().tolist())
    peers = [r for n, r in report.grad_to_weight.items() if n not in report.zero]
    report.vanishing_peers = len(peers)
    if len(peers) >= 3:
        report.vanishing_median = statistics.median(peers)
        for name, r in report.grad_to_weight.items():
            if (name not in report.zero and r < report.vanishing_median / vanishing_factor
                    and not allowed(name, allow.get("vanishing"))):
                report.vanishing[name] = r / report.vanishing_median
    return report
