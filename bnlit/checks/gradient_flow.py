"""Gradient-flow checks: no trainable parameter may silently stop learning.

Pure checks, each tested without a Trainer (``bnlit.callbacks.gradient_flow`` decides when to run
them and what to do with a failure):

* :func:`gradient_flow_report` -- after backward, every trainable parameter has a gradient that is
  present, finite, not all zeros, not vanishing against its peers, and reaches at least half of
  a matrix's output rows.
* :class:`GradientSentinel` -- the same verdicts but exact-zero rows, from one fused norm pass per
  step with no host sync; when it trips the full report runs.
* :func:`param_group_report` and :func:`update_flow_report` -- optimizer membership both ways
  (every trainable parameter in a group with a non-zero learning rate, no frozen parameter in a
  group), and the optimizer step changed every parameter.
* :func:`fast_path_parity` -- on one probe batch the configured fast path (bf16 autocast,
  ``torch.compile``, fused kernels) gives per-parameter gradients with the direction (cosine
  similarity) and size (relative norm error) of the same module run eagerly in fp32.

All of them accept ``reduce(tensor, op) -> tensor`` (``op`` in ``"sum" | "min" | "max"``; an
all-reduce across ranks) so every rank reaches the same verdict, and the distributed callers fail
together instead of leaving one rank waiting in a collective. ``sharded=True`` (FSDP) means each
rank holds a shard of a parameter: a parameter is zero only when every shard is.

The exactness matters: one fused L2-norm pass finds the candidates, and a candidate is called zero
or non-finite only after an exact re-check -- the fp32 L2 norm underflows to 0 for gradients around
1e-23 and overflows to Inf above 1e19.

**The callback** (``bnlit.callbacks.gradient_flow``). ``GradientFlowArbiter``: turn a parameter that silently stops learning into a named error.

A thin adapter over :mod:`bnlit.checks.gradient_flow` (the checks, their settings and the report). At fit
start it checks optimizer membership. Every optimizer step (``on_before_optimizer_step``: after the
last micro-batch, after AMP unscaling, before clipping) the sentinel takes one fused norm pass,
read every step on CPU and on logging steps on CUDA (the only host sync). At the first step, every
``every_n_steps``, the last step and at once when the sentinel trips, the full check runs:
gradients, membership, the fast path against the eager fp32 reference (first check) and, after
the step, that each parameter changed. Every verdict is all-reduced, so under DDP/FSDP all ranks
fail together. ``<checkpoint dir>/gradient_flow.json`` is written only when a check fails.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection

from bnlit.errors import BnlitError, ConfigError

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


# ----------------------------------------------------------------------------------------------
# 1. gradient flow

VANISHING_FACTOR = 1e6  # see GradientFlowReport: healthy spreads measured in docs/gradient-flow.md stay below 1e3
DEAD_ROW_SHARE = 0.5
CATEGORIES = ("missing", "nonfinite", "zero", "vanishing", "dead_rows", "frozen_in_optimizer")


def allowed(name: str, patterns: Iterable[str] | None) -> bool:
    """Whether ``name`` matches one of the ``fnmatch`` patterns (``"model.layers.*.moe.*"``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())


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
    the check more lenient). ``None``: no integer tensor, exempt the whole table."""
    tables = {id(m.weight): m for m in module.modules() if isinstance(m, nn.Embedding)}
    if not tables:
        return {}
    ids = integer_tensors(batches)
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        m = tables.get(id(p))
        if m is None or name in out:
            continue
        if not ids or hasattr(p, "to_local"):
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
    for tokens absent from the batch are not counted (``row_exempt``).
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
                f"(threshold {self.dead_row_share:.0%})")))
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


def _dead_rows(g: torch.Tensor, exempt: torch.Tensor | None) -> torch.Tensor:
    """``[rows with an exactly zero gradient, rows counted]`` of a matrix's gradient (device, fp64)."""
    dead = ~g.reshape(g.shape[0], -1).ne(0).any(1)
    if exempt is not None:
        dead &= ~exempt
        counted = exempt.numel() - exempt.sum()
    else:
        counted = torch.tensor(g.shape[0], device=g.device)
    return torch.stack([dead.sum(), counted]).double()


def gradient_flow_report(
    named_parameters: NamedParameters, *, reduce: Reduce | None = None, sharded: bool = False,
    world_size: int = 1, vanishing_factor: float = VANISHING_FACTOR, dead_row_share: float = DEAD_ROW_SHARE,
    row_exempt: Mapping[str, torch.Tensor | None] | None = None, allow: Mapping[str, Sequence[str]] | None = None,
) -> GradientFlowReport:
    """Classify every trainable parameter's ``.grad`` as missing, non-finite, zero, vanishing,
    with dead rows, or ok.

    Call after backward (and after AMP unscaling). Frozen parameters are skipped and a tensor
    shared under several names (tied embeddings) is checked once. Two host syncs (three with
    ``reduce``).

    Args:
        named_parameters: e.g. ``model.named_parameters()``.
        reduce: all-reduce across ranks. Under DDP (``sharded=False``, gradients already
            averaged) a fault on any rank is a fault; under FSDP a parameter is zero only if all
            of its non-empty shards are.
        sharded: parameters are sharded across ranks (FSDP); check local shards. Embedding
            tables are then left out of the dead-rows check (their shards' rows are not mapped
            to tokens).
        world_size: number of ranks, for the messages.
        vanishing_factor: flag a gradient-to-weight norm ratio this many times below the median.
        dead_row_share: flag a matrix with at least this share of exactly-zero gradient rows.
        row_exempt: ``{name: bool mask of rows not to count, or None for the whole tensor}``
            (:func:`embedding_row_exempt`).
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
    device = params[0][1].device
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
            name = names[i]
            exempt = row_exempt.get(name, False)
            if (bad or z or g.ndim < 2 or g.shape[0] < 2 or allowed(name, allow.get("dead_rows"))
                    or exempt is None or (sharded and name in row_exempt)):
                continue
            extra[j, 1:] = _dead_rows(g, exempt if isinstance(exempt, torch.Tensor) else None).to(device)
        extra = extra.cpu().tolist()
        for (i, _), n, bad, z, (wn, dead, counted) in zip(with_grad, l2, nonfinite, zero, extra):
            rows[i][2:8] = [float(bad), float(z), 0.0 if bad else n * n, wn * wn, dead, counted]
    stats = torch.tensor(rows, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
    stats = _reduce(stats, reduce, "sum").cpu().tolist()

    divide = 1 if sharded else max(1, world_size)  # DDP ranks hold the same averaged gradient
    for name, (held, missing, nonfinite, zero, gsq, wsq, dead, counted) in zip(names, stats):
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
            report.dead_row_counts[name] = [int(dead / divide), int(counted / divide)]
    peers = [r for n, r in report.grad_to_weight.items() if n not in report.zero]
    report.vanishing_peers = len(peers)
    if len(peers) >= 3:
        report.vanishing_median = statistics.median(peers)
        for name, r in report.grad_to_weight.items():
            if (name not in report.zero and r < report.vanishing_median / vanishing_factor
                    and not allowed(name, allow.get("vanishing"))):
                report.vanishing[name] = r / report.vanishing_median
    return report


class GradientSentinel:
    """The every-step check: one fused norm pass over the gradients, no host sync.

    :meth:`observe` (every optimizer step) turns the per-parameter L2 gradient norms into a code
    (1 non-finite, 2 zero, 3 vanishing against the weight norms of the last full check) and keeps
    the first step each parameter tripped, on the device; :meth:`tripped` is the one host sync
    (and, across ranks, the one all-reduce), done every step on CPU and on logging steps on CUDA.
    A missing gradient is known on the host at once. Under FSDP (``sharded``) only non-finite and
    missing gradients are judged here: a zero local shard is legitimate and norms are local.
    """

    CODES = {1: "nonfinite", 2: "zero", 3: "vanishing"}

    def __init__(self, vanishing_factor: float = VANISHING_FACTOR, sharded: bool = False):
        self.vanishing_factor, self.sharded = vanishing_factor, sharded
        self.names: list[str] = []
        self.first_step: torch.Tensor | None = None
        self.first_code: torch.Tensor | None = None
        self.inv_weight: torch.Tensor | None = None
        self.missing: dict[str, int] = {}
        self._weight_norms: dict[str, float] = {}

    def set_weight_norms(self, weight_norms: Mapping[str, float], exempt: Iterable[str] = ()) -> None:
        """Weight norms from the last full check (they move slowly); ``exempt``: not judged."""
        skip = set(exempt)
        self._weight_norms = {n: w for n, w in weight_norms.items() if n not in skip}
        self.inv_weight = None  # rebuilt on the device at the next observe

    def _inverse_weight_norms(self, device: torch.device) -> torch.Tensor | None:
        if self.inv_weight is None and self._weight_norms:
            inv = [1.0 / w if w > 0 else math.nan for w in (self._weight_norms.get(n, 0.0) for n in self.names)]
            self.inv_weight = torch.tensor(inv, dtype=torch.float32, device=device)
        return self.inv_weight

    def reset(self) -> None:
        if self.first_step is not None:
            self.first_step.fill_(-1)
        self.missing.clear()

    def observe(self, named_parameters: NamedParameters, step: int,
                skipped: torch.Tensor | None = None) -> torch.Tensor | None:
        """Record this step's faults; returns the total gradient norm (a device tensor) or None.
        ``skipped``: a device flag, nonzero when the optimizer will not apply this step (the NaN
        guard's verdict in fused AdamW's ``found_inf``); such a step records nothing."""
        params, _, _ = unique_trainable(named_parameters)
        names = [n for n, _ in params]
        grads, idx = [], []
        for i, (n, p) in enumerate(params):
            if p.grad is None:
                if _local(p).numel() > 0:
                    self.missing.setdefault(n, step)
                continue
            g = _local(p.grad)
            if g.numel() > 0:
                grads.append(g)
                idx.append(i)
        if not grads:
            return None
        device = grads[0].device
        if names != self.names or self.first_step is None or self.first_step.device != device:
            self.names, self.inv_weight = names, None
            self.first_step = torch.full((len(names),), -1, dtype=torch.int64, device=device)
            self.first_code = torch.zeros(len(names), dtype=torch.int64, device=device)
        norms = torch.full((len(names),), math.nan, dtype=torch.float32, device=device)
        norms[torch.tensor(idx, device=device)] = torch.stack([n.to(device) for n in _norms(grads, 2.0)])
        present = torch.zeros(len(names), dtype=torch.bool, device=device)
        present[torch.tensor(idx, device=device)] = True
        nonfinite = present & ~torch.isfinite(norms)
        code = nonfinite.long()
        if not self.sharded:
            zero = present & (norms == 0)
            code = torch.where(zero, 2, code)
            inv_weight = self._inverse_weight_norms(device)
            if inv_weight is not None:
                ratio = torch.where(present & (norms > 0), norms * inv_weight, math.nan)
                peers = torch.isfinite(ratio)
                median = torch.nanmedian(ratio)
                vanishing = peers & (ratio < median / self.vanishing_factor) & (peers.sum() >= 3)
                code = torch.where(vanishing & (code == 0), 3, code)
        if skipped is not None:
            code = torch.where(skipped.to(device) > 0, 0, code)
        new = (code > 0) & (self.first_step < 0)
        self.first_step = torch.where(new, step, self.first_step)
        self.first_code = torch.where(new, code, self.first_code)
        return torch.where(present, norms, 0.0).norm()

    def tripped(self, reduce: Reduce | None = None, extra: bool = False) -> bool:
        """Whether any parameter tripped since the last :meth:`reset` (on any rank); host sync."""
        if self.first_step is None:
            flag = torch.tensor([float(bool(self.missing) or extra)])
        else:
            flag = ((self.first_step >= 0).any() | bool(self.missing) | extra).float().reshape(1)
        return bool(_reduce(flag, reduce, "max").item() > 0)

    def findings(self, reduce: Reduce | None = None) -> dict[str, tuple[str, int]]:
        """``{name: (category, first step)}`` since the last reset, agreed over ranks."""
        out: dict[str, tuple[str, int]] = {}
        if self.first_step is not None:
            first = torch.where(self.first_step >= 0, self.first_step.double(), math.inf)
            first = _reduce(first, reduce, "min").cpu().tolist()
            code = _reduce(self.first_code.clone(), reduce, "max").cpu().tolist()
            out = {n: (self.CODES[c], int(s)) for n, s, c in zip(self.names, first, code) if math.isfinite(s) and c}
        for n, s in self.missing.items():
            out[n] = ("missing", s)
        return out


def total_grad_norm(named_parameters: NamedParameters) -> torch.Tensor | None:
    """The global L2 gradient norm as a device tensor (no host sync), or None without gradients."""
    params, _, _ = unique_trainable(named_parameters)
    grads = [_local(p.grad) for _, p in params if p.grad is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return None
    device = grads[0].device
    return torch.stack([n.to(device) for n in _norms(grads, 2.0)]).norm()


# ----------------------------------------------------------------------------------------------
# 2. param groups and update flow


def _group_label(i: int, group: Mapping) -> str:
    return str(group.get("name", f"group {i}"))


def _group_of(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, tuple[str, Mapping]]:
    out = {}
    for k, opt in enumerate(optimizers):
        for i, g in enumerate(opt.param_groups):
            label = _group_label(i, g) if len(optimizers) == 1 else f"optimizer {k} {_group_label(i, g)}"
            for p in g["params"]:
                out[id(p)] = (label, g)
    return out


def _lr(group: Mapping, initial: bool) -> float:
    lr = group.get("initial_lr", group.get("lr", 0.0)) if initial else group.get("lr", 0.0)
    return float(lr)


@dataclass
class ParamGroupReport:
    """Optimizer membership, both ways: trainable parameters missing from every optimizer
    (``not_in_optimizer``), those whose group's base learning rate (``initial_lr`` when a scheduler
    is attached) is zero (``zero_lr``: ``{name: group label}``), and parameters with
    ``requires_grad=False`` that sit in an optimizer group (``frozen_in_optimizer``: frozen after
    the optimizer was built, so it never learns again -- unless allow-listed)."""

    names: list[str]
    not_in_optimizer: list[str] = field(default_factory=list)
    zero_lr: dict[str, str] = field(default_factory=dict)
    frozen_in_optimizer: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.not_in_optimizer or self.zero_lr or self.frozen_in_optimizer)

    def findings(self) -> list[dict]:
        out = [dict(category="not_in_optimizer", parameter=n, figure=None, threshold=None,
                    message="not in any optimizer param group (it gets gradients but is never updated)")
               for n in self.not_in_optimizer]
        out += [dict(category="zero_lr", parameter=n, figure=0.0, threshold=None,
                     message=f"in param group {g!r} whose learning rate is 0") for n, g in self.zero_lr.items()]
        out += [dict(category="frozen_in_optimizer", parameter=n, figure=None, threshold=None, message=(
            f"requires_grad=False but still in optimizer param group {g!r} (frozen after the optimizer was "
            f"built: it never learns again; allow-list it under allow.frozen_in_optimizer if intended)"))
            for n, g in self.frozen_in_optimizer.items()]
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(out, key=lambda f: order.get(f["parameter"], len(order)))

    def problems(self) -> dict[str, str]:
        return {f["parameter"]: f["message"] for f in self.findings()}

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "findings": self.findings(), "problems": self.problems()}


def param_group_report(named_parameters: NamedParameters,
                       optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                       allow: Mapping[str, Sequence[str]] | None = None) -> ParamGroupReport:
    """Check that every trainable parameter is in a param group with a non-zero base lr, and that
    no frozen parameter is in one (``allow["frozen_in_optimizer"]``: fnmatch patterns exempt)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    named = list(named_parameters)
    params, _, _ = unique_trainable(named)
    groups = _group_of(optimizers)
    seen: set[int] = set()
    report = ParamGroupReport(names=[n for n, _ in named if not (id(_) in seen or seen.add(id(_)))])
    for name, p in params:
        if id(p) not in groups:
            report.not_in_optimizer.append(name)
        elif _lr(groups[id(p)][1], initial=True) == 0.0:
            report.zero_lr[name] = groups[id(p)][0]
    seen = set()
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.requires_grad and id(p) in groups and not allowed(name, (allow or {}).get("frozen_in_optimizer")):
            report.frozen_in_optimizer[name] = groups[id(p)][0]
    return report


@dataclass
class ParameterSnapshot:
    """Copies of the trainable parameters (rank-local shards) taken before an optimizer step,
    with the learning rate each one's group will step with."""

    names: list[str]
    tensors: list[torch.Tensor]
    lrs: dict[str, float]
    initial_lrs: dict[str, float]
    groups: dict[str, str]


def snapshot_parameters(named_parameters: NamedParameters,
                        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
                        reuse: ParameterSnapshot | None = None) -> ParameterSnapshot:
    """Copy every trainable parameter (call right before ``optimizer.step()``).

    ``reuse``: an earlier snapshot whose buffers are refilled in place when the shapes match --
    no allocation per check (a CUDA caching allocator would keep that memory reserved anyway; on
    CPU fresh buffers cost page faults that dwarf the copy)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    params, _, _ = unique_trainable(named_parameters)
    groups = _group_of(optimizers)
    local = [_local(p).detach() for _, p in params]
    snap = ParameterSnapshot(names=[n for n, _ in params], tensors=[], lrs={}, initial_lrs={}, groups={})
    with torch.no_grad():
        if reuse is not None and [(t.shape, t.dtype, t.device) for t in reuse.tensors] == [
                (t.shape, t.dtype, t.device) for t in local]:
            snap.tensors = reuse.tensors
            torch._foreach_copy_(snap.tensors, local)
        else:
            snap.tensors = [t.clone() for t in local]
    for name, p in params:
        if id(p) in groups:
            label, g = groups[id(p)]
            snap.groups[name] = label
            snap.lrs[name] = _lr(g, initial=False)
            snap.initial_lrs[name] = _lr(g, initial=True)
    return snap


@dataclass
class UpdateFlowReport:
    """Verdict on one optimizer step. ``unchanged``: ``{name: why}`` for parameters whose update
    was exactly zero; ``nonfinite``: parameters that are NaN/Inf after the step; ``skipped``:
    parameters whose group's lr is 0 this step by the schedule (base lr > 0), not judged;
    ``update_ratio``: ``||delta||/||p||`` per parameter."""

    names: list[str]
    unchanged: dict[str, str] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    update_ratio: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    world_size: int = 1

    @property
    def ok(self) -> bool:
        return not (self.unchanged or self.nonfinite)

    @property
    def num_ok(self) -> int:
        return len(self.names) - len(self.skipped) - len(self.problems())

    def problems(self) -> dict[str, str]:
        where = lambda n: f" (on {self.ranks[n]} of {self.world_size} ranks)" if self.world_size > 1 else ""  # noqa: E731
        found = {n: why + where(n) for n, why in self.unchanged.items()}
        for n in self.nonfinite:
            found[n] = "parameter is NaN/Inf after the optimizer step" + where(n)
        order = {n: i for i, n in enumerate(self.names)}
        return dict(sorted(found.items(), key=lambda kv: order[kv[0]]))

    def findings(self, step: int) -> list[dict]:
        return [dict(category="update", parameter=n, figure=self.update_ratio.get(n), threshold=None, step=step,
                     message=why) for n, why in self.problems().items()]

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "problems": self.problems()}


def update_flow_report(
    before: ParameterSnapshot, named_parameters: NamedParameters, *, reduce: Reduce | None = None,
    sharded: bool = False, world_size: int = 1,
) -> UpdateFlowReport:
    """Compare the parameters after the optimizer step with ``before``; name every one whose
    update is exactly zero, saying why when the cause is visible (not in any param group, lr 0).
    The snapshot's buffers are overwritten with the update (pass it as ``reuse`` next time)."""
    current = dict(unique_trainable(named_parameters)[0])
    names = [n for n in before.names if n in current]
    report = UpdateFlowReport(names=names, world_size=world_size)
    if not names:
        return report
    after = [_local(current[n]).detach() for n in names]
    delta = [before.tensors[before.names.index(n)] for n in names]
    device = after[0].device
    rows = [[0.0] * 5 for _ in names]  # holds a shard, update zero, non-finite, ||delta||^2, ||p||^2
    keep = [i for i, t in enumerate(after) if t.numel() > 0]
    if keep:
        a, d = [after[i] for i in keep], [delta[i] for i in keep]
        with torch.no_grad():
            torch._foreach_sub_(d, a)  # d = before - after = -update (before - before is exactly 0)
        dn, _, dzero = _classify(d)
        pn, pbad, _ = _classify(a)
        for i, n_d, z, n_p, bad in zip(keep, dn, dzero, pn, pbad):
            rows[i] = [1.0, float(z), float(bad), 0.0 if bad else n_d * n_d, 0.0 if bad else n_p * n_p]
    stats = _reduce(torch.tensor(rows, dtype=torch.float64, device=device), reduce, "sum").cpu().tolist()
    for name, (held, zero, nonfinite, dsq, psq) in zip(names, stats):
        if held == 0:
            continue
        lr, base = before.lrs.get(name), before.initial_lrs.get(name)
        if nonfinite > 0:
            report.nonfinite.append(name)
            report.ranks[name] = int(nonfinite)
            continue
        report.update_ratio[name] = math.sqrt(dsq / psq) if psq > 0 else (0.0 if dsq == 0 else INF)
        if not ((zero == held) if sharded else (zero > 0)):
            continue
        if lr == 0.0 and base not in (None, 0.0):
            report.skipped.append(name)  # warmup from / decay to lr 0: the schedule's doing
            continue
        if name not in before.groups:
            why = "update is exactly zero: not in any optimizer param group"
        elif lr == 0.0:
            why = f"update is exactly zero: its param group {before.groups[name]!r} has lr 0"
        else:
            why = f"update is exactly zero although its param group {before.groups[name]!r} has lr {lr:g}"
        report.unchanged[name] = why
        report.ranks[name] = int(zero)
    return report


# ----------------------------------------------------------------------------------------------
# 3. fast-path parity


def slice_batch(batch, samples: int | None = None, seq_len: int | None = None):
    """The probe batch: the first ``samples`` rows (dim 0) of every tensor in ``batch`` (any
    nesting of tuples, lists and dicts) and, with ``seq_len``, the first ``seq_len`` positions of
    dim 1 of tensors with two or more dims (token sequences: inputs, targets and masks alike)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.ndim >= 1 and samples:
            t = t[:samples]
        if t.ndim >= 2 and seq_len:
            t = t[:, :seq_len]
        return t

    return apply_to_collection(batch, torch.Tensor, cut)


def ignore_outside(batch, samples: int | None = None, seq_len: int | None = None):
    """The probe at the training shape: an ``(x, y)`` batch of token windows, whole, with every
    target outside :func:`slice_batch`'s ``samples x seq_len`` set to ``IGNORE_INDEX`` -- the same
    mean loss and gradients as the slice (causal attention: no position sees a later one), through
    the compiled graph the training steps use rather than a recompile at the slice's shape. None
    for any other batch (the fast path then runs the slice)."""
    from bnlit.loss import IGNORE_INDEX

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        return None
    x, y = batch
    if y.is_floating_point() or y.ndim != 2 or x.shape[:2] != y.shape:
        return None
    keep = torch.zeros_like(y, dtype=torch.bool)
    keep[:samples or None, :seq_len or None] = True
    return type(batch)((x, y.masked_fill(~keep, IGNORE_INDEX))) if isinstance(batch, tuple) else \
        [x, y.masked_fill(~keep, IGNORE_INDEX)]


@contextlib.contextmanager
def eager_fp32(module: nn.Module):
    """``module`` as the reference runs it: ``torch.compile`` off (``force_eager``) and fp32
    parameters and buffers. Parameters that are fp32 already are used as they are (no copy: the
    reference costs no weight memory under mixed precision); others (bf16-true) are swapped for
    fp32 copies for the duration. Yields ``{name: tensor}`` of the trainable parameters to
    differentiate."""
    from torch.nn.utils.stateless import _reparametrize_module

    params, _, _ = unique_trainable(module.named_parameters())
    swap: dict[str, torch.Tensor] = {}
    for n, p in module.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            swap[n] = p.detach().float().requires_grad_(p.requires_grad)
    for n, b in module.named_buffers():
        if b.is_floating_point() and b.dtype != torch.float32:
            swap[n] = b.float()
    with torch.compiler.set_stance("force_eager"):
        if not swap:
            yield dict(params)
            return
        with _reparametrize_module(module, swap, tie_weights=True):
            yield {n: swap.get(n, p) for n, p in params}


@contextlib.contextmanager
def reference_context(device: torch.device):
    """No autocast, the math SDPA kernel, full-precision fp32 matmuls (no TF32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device.type, enabled=False), sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def probe_gradients(params: Mapping[str, torch.Tensor], loss: Callable[[], torch.Tensor],
                    context: contextlib.AbstractContextManager | None = None, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Gradients of ``loss()`` w.r.t. ``params`` via ``torch.autograd.grad`` (the parameters'
    ``.grad`` is left untouched). The RNG is seeded so a model with dropout draws the same masks
    on both paths."""
    tensors = list(params.values())
    device = tensors[0].device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with context if context is not None else contextlib.nullcontext():
            value = loss()
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            raise TypeError(f"the probe loss must be a scalar tensor that requires grad, got "
                            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        grads = torch.autograd.grad(value.reshape(()), tensors, allow_unused=True)
    return {n: (None if g is None else g.detach()) for n, g in zip(params, grads)}


@dataclass
class ParityReport:
    """Per-parameter agreement of the fast path's gradients with the eager fp32 reference:
    ``cosine`` similarity and ``rel_norm_error`` = ``| ||g_fast|| - ||g_ref|| | / ||g_ref||``."""

    names: list[str]
    cosine: dict[str, float]
    rel_norm_error: dict[str, float]
    failed: dict[str, str] = field(default_factory=dict)
    min_cosine: float = 0.0
    max_rel_norm_error: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def num_ok(self) -> int:
        return len(self.names) - len(self.failed)

    @property
    def worst_cosine(self) -> float:
        return min(self.cosine.values(), default=1.0)

    @property
    def worst_rel_norm_error(self) -> float:
        return max(self.rel_norm_error.values(), default=0.0)

    def problems(self) -> dict[str, str]:
        return dict(self.failed)

    def findings(self, step: int) -> list[dict]:
        return [dict(category="fast_path_parity", parameter=n, figure=self.cosine.get(n), threshold=self.min_cosine,
                     step=step, message=why) for n, why in self.problems().items()]

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "problems": self.problems()}

    def summary(self, precision: str, compiled: bool) -> str:
        return (f"fast-path parity ({precision}{', compiled' if compiled else ''}): {self.num_ok}/{len(self.names)} "
                f"parameters within tolerance (min cosine {self.worst_cosine:.5f}, max relative norm error "
                f"{self.worst_rel_norm_error:.4f})")


def compare_gradients(
    fast: Mapping[str, torch.Tensor | None], ref: Mapping[str, torch.Tensor | None], *,
    min_cosine: float, max_rel_norm_error: float, reduce: Reduce | None = None,
) -> ParityReport:
    """Compare two ``{name: gradient}`` maps parameter by parameter (in fp64, one host sync).
    Under ``reduce`` the worst value over ranks decides (min cosine, max error)."""
    names = [n for n in ref if not (ref[n] is None and fast.get(n) is None)]
    if not names:
        return ParityReport([], {}, {}, min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error)
    device = next(g for g in ref.values() if g is not None).device
    cos = torch.ones(len(names), dtype=torch.float64, device=device)
    err = torch.zeros(len(names), dtype=torch.float64, device=device)
    for i, n in enumerate(names):
        f, r = fast.get(n), ref[n]
        if f is None or r is None:
            cos[i], err[i] = 0.0, INF
            continue
        f, r = _local(f).double().flatten(), _local(r).double().flatten()
        nf, nr = f.norm(), r.norm()
        c = torch.dot(f, r) / (nf * nr)
        # both zero: agree; exactly one zero: orthogonal; NaN/Inf in either: as bad as it gets
        c = torch.where((nf == 0) | (nr == 0), torch.where((nf == 0) & (nr == 0), 1.0, 0.0), c)
        cos[i] = torch.nan_to_num(c, nan=-1.0, posinf=-1.0, neginf=-1.0)
        e = (nf - nr).abs() / nr
        err[i] = torch.where(nr == 0, torch.where(nf == 0, 0.0, INF), torch.nan_to_num(e, nan=INF))
    cos = _reduce(cos, reduce, "min").cpu().tolist()
    err = _reduce(err, reduce, "max").cpu().tolist()
    report = ParityReport(names, dict(zip(names, cos)), dict(zip(names, err)),
                          min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error)
    for n, c, e in zip(names, cos, err):
        if fast.get(n) is None or ref[n] is None:
            side = "fast path" if fast.get(n) is None else "reference"
            report.failed[n] = f"fast-path parity: no gradient on the {side}"
        elif c < min_cosine or e > max_rel_norm_error:
            report.failed[n] = (f"fast-path gradient disagrees with the eager fp32 reference: cosine {c:.4f} "
                                f"(min {min_cosine}), relative norm error {e:.4f} (max {max_rel_norm_error})")
    return report


def fast_path_parity(
    module: nn.Module, batch, loss_fn: Callable[[object], torch.Tensor], *,
    fast_context: contextlib.AbstractContextManager | None = None,
    min_cosine: float = 0.99, max_rel_norm_error: float = 0.05, reduce: Reduce | None = None,
    fast_batch=None,
) -> ParityReport:
    """Gradients of the fast path (``module`` as configured -- compiled or not -- under
    ``fast_context``, e.g. bf16 autocast) against the same module run eagerly in fp32 (math SDPA,
    no autocast, no TF32; :func:`eager_fp32`) on one probe ``batch``.

    Args:
        module: the module whose trainable parameters are compared (their ``.grad`` is not
            touched), e.g. the LightningModule.
        batch: the probe batch, passed to ``loss_fn(batch) -> scalar loss`` -- the module's own
            training loss (``pl_module.loss_for_batch``); :func:`slice_batch` cuts it down.
        fast_context: the training forward context (``trainer.precision_plugin.forward_context()``).
        min_cosine, max_rel_norm_error: per-parameter tolerances; see docs/gradient-flow.md for the bf16
            figures they were chosen from.
        reduce: all-reduce across ranks (each rank probes its own batch; the worst rank decides).
        fast_batch: what the fast path runs instead of ``batch`` (the same loss at another shape:
            :func:`ignore_outside`); default ``batch``.
    """
    params = dict(unique_trainable(module.named_parameters())[0])
    fast_batch = batch if fast_batch is None else fast_batch
    fast = probe_gradients(params, lambda: loss_fn(fast_batch), fast_context)
    fast = {n: (None if g is None else g.float()) for n, g in fast.items()}
    with eager_fp32(module) as ref_params, reference_context(next(iter(params.values())).device):
        ref = probe_gradients(ref_params, lambda: loss_fn(batch))
    return compare_gradients(fast, ref, min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error, reduce=reduce)


# -- the arbiter's settings and verdicts (bnlit.callbacks.gradient_flow chooses when to run them) --

REPORT_NAME = "gradient_flow.json"  # in the checkpoint directory, written only when a check fails
MAX_DEFERRED = 10  # consecutive fp16 overflow steps tolerated before non-finite gradients fail
PROBE_HOOK = "loss_for_batch"
ALLOW_CATEGORIES = ("vanishing", "dead_rows", "frozen_in_optimizer")


class GradientFlowError(BnlitError):
    """A trainable parameter gets no gradient, a non-finite, all-zero, vanishing or partly dead
    one, no update, sits frozen in an optimizer group, or gets a fast-path gradient that disagrees
    with the eager fp32 reference."""


@dataclass
class ArbiterSettings:
    """The arbiter's settings (``callbacks.gradient_flow.*``), validated on construction.

    every_n_steps: the full check at optimizer step 1, then every this many steps, at the run's
        last step (so the final ``grad/*`` values are the final step's), and at once whenever the
        every-step sentinel trips.
    on_fail: ``"raise"`` a :class:`GradientFlowError` (after writing the report) or ``"warn"``.
    check_updates: snapshot the parameters on check steps and verify the optimizer changed each.
    fast_path_parity: compare the configured fast path (precision plugin's autocast, compiled
        model, fused kernels) with the eager fp32 reference on the first check step's batch,
        through ``pl_module.loss_for_batch(batch) -> scalar loss``; a module without that hook
        gets the probe skipped with one log line.
    parity_every_n_steps: repeat the parity check this often (None: first check only; it costs
        two extra forward/backward passes of the probe batch).
    min_cosine, max_rel_norm_error: per-parameter parity tolerances.
    probe_samples: the probe uses the first this many sequences of the step's last micro-batch.
    probe_seq_len: and the first this many positions of each (dim 1 of 2+-dim tensors; None:
        all). The eager fp32 reference with math attention is quadratic in it. The fast path
        runs the whole micro-batch with the other targets ignored (:func:`ignore_outside`: the
        compiled graph the steps use, no recompile), a training step's memory plus one gradient
        copy; the bound is ``bnlit.speed.flops.parity_probe_memory_bytes`` (``python -m bnlit.info``).
    log_param_norms: log ``grad/<parameter>`` norms on check steps (``grad/norm`` is logged on
        every logging step either way).
    sentinel: run the every-step sentinel (missing, non-finite, zero and vanishing gradients,
        frozen parameters in an optimizer group) between full checks.
    vanishing_factor: a gradient-to-weight norm ratio this many times below the median of all
        parameters is ``vanishing``.
    dead_row_share: a matrix with at least this share of exactly-zero gradient rows is ``dead_rows``.
    allow: ``{category: [fnmatch patterns of parameter names]}`` exempt from ``vanishing``,
        ``dead_rows`` or ``frozen_in_optimizer`` (names as ``pl_module.named_parameters()``).
    """

    every_n_steps: int = 50
    on_fail: str = "raise"
    check_updates: bool = True
    fast_path_parity: bool = True
    parity_every_n_steps: int | None = None
    min_cosine: float = 0.99
    max_rel_norm_error: float = 0.05
    probe_samples: int | None = 4
    probe_seq_len: int | None = None
    log_param_norms: bool = True
    sentinel: bool = True
    vanishing_factor: float = VANISHING_FACTOR
    dead_row_share: float = DEAD_ROW_SHARE
    allow: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        where = "callbacks.gradient_flow"
        if self.every_n_steps < 1:
            raise ConfigError(f"{where}.every_n_steps={self.every_n_steps}: must be >= 1")
        if self.on_fail not in ("raise", "warn"):
            raise ConfigError(f"{where}.on_fail={self.on_fail!r}: use 'raise' or 'warn'")
        if self.parity_every_n_steps is not None and self.parity_every_n_steps < 1:
            raise ConfigError(f"{where}.parity_every_n_steps={self.parity_every_n_steps}: must be >= 1 or null")
        if not self.vanishing_factor > 1:
            raise ConfigError(f"{where}.vanishing_factor={self.vanishing_factor}: must be > 1 "
                              f"(the default is {VANISHING_FACTOR:g})")
        if not 0 < self.dead_row_share <= 1:
            raise ConfigError(f"{where}.dead_row_share={self.dead_row_share}: must be in (0, 1] "
                              f"(the default is {DEAD_ROW_SHARE})")
        for key in ("probe_samples", "probe_seq_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{key}={value}: must be >= 1 or null (all)")
        self.allow = {k: list(v or []) for k, v in dict(self.allow or {}).items()}
        unknown = sorted(set(self.allow) - set(ALLOW_CATEGORIES))
        if unknown:
            raise ConfigError(f"{where}.allow has unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}: "
                              f"use {list(ALLOW_CATEGORIES)}")


def sentinel_findings(seen: Mapping[str, tuple[str, int]], named: set[str], step: int) -> list[dict]:
    """Findings for what the every-step sentinel saw (``{name: (category, first step)}``) before
    the full check at ``step`` and that check no longer names (``named``)."""
    return [dict(category=category, parameter=name, figure=None, threshold=None, step=first, message=(
                f"{category} gradient at step {first}, seen by the every-step sentinel (gone by the full check "
                f"at step {step})"))
            for name, (category, first) in seen.items() if first < step and name not in named and category in CATEGORIES]


def failure_report(check: str, step: int, findings: list[dict], payload: dict, path) -> tuple[dict, str]:
    """The failed check's report (``payload`` with the findings and ``{parameter: problems}``) and
    its one-paragraph message naming every parameter and the report's ``path``."""
    problems: dict[str, str] = {}
    for f in findings:
        line = f"[{f['category']}] {f['message']}"
        problems[f["parameter"]] = f"{problems[f['parameter']]}; {line}" if f["parameter"] in problems else line
    report = {**payload, "step": step, "check": check, "ok": False, "findings": findings, "problems": problems}
    lines = "; ".join(f"{name} {why}" for name, why in problems.items())
    return report, (f"{check} failed at step {step} for {len(problems)} parameter(s): {lines}. Full report: {path}"
                    f"{parity_alarm_hint(findings)}")


PARITY_OFF = "callbacks.gradient_flow.fast_path_parity=false"


def parity_alarm_hint(findings: Sequence[Mapping]) -> str:
    """The line a failure adds when the fast-path parity probe is its only finding: every other
    gradient check passed that step, so the disagreement may be the probe's own false alarm (bf16
    rounding on small gradients, e.g. the first check after a resume; docs/gradient-flow.md) rather
    than a broken fast path. Empty when any other check failed too."""
    if not findings or any(f.get("category") != "fast_path_parity" for f in findings):
        return ""
    return (". Every other gradient check passed at this step, so this may be a false alarm of the parity probe "
            f"(bf16 rounding of small gradients; docs/gradient-flow.md): rerun with {PARITY_OFF} to switch it off.")


def parity_probe(module: nn.Module, batch, settings: ArbiterSettings, fast_context, reduce: Reduce | None,
                 step: int, precision: str) -> tuple[dict, ParityReport | None]:
    """:func:`fast_path_parity` on the first ``probe_samples`` x ``probe_seq_len`` of ``batch``
    through ``module.loss_for_batch``, and its report entry. A probe that cannot run (no hook, no
    batch, or the hook raised) gives ``{"step", "skipped": why}`` and None, never an exception:
    a diagnostic must not take the run down, nor hide the gradient check's verdict."""
    hook = getattr(module, PROBE_HOOK, None)
    if not callable(hook) or batch is None:
        return {"step": step, "skipped": f"no {PROBE_HOOK}(batch) hook" if not callable(hook) else "no batch"}, None
    probe = slice_batch(batch, settings.probe_samples, settings.probe_seq_len)
    # the fast path at the training shape (no recompile of a compiled model), the reference on the slice
    whole = ignore_outside(batch, settings.probe_samples, settings.probe_seq_len)
    was_training = module.training
    try:
        parity = fast_path_parity(module, probe, hook, fast_context=fast_context, min_cosine=settings.min_cosine,
                                  max_rel_norm_error=settings.max_rel_norm_error, reduce=reduce, fast_batch=whole)
    except Exception as e:  # noqa: BLE001
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return {"step": step, "skipped": reason}, None
    finally:
        module.train(was_training)
    return {"step": step, "precision": precision, **parity.to_dict()}, parity


def membership_verdict(named_parameters: NamedParameters, optimizers: Sequence[torch.optim.Optimizer],
                       allow: Mapping[str, list[str]], reduce: Reduce | None,
                       device: torch.device | str = "cpu") -> tuple[list[dict], dict]:
    """The fit-start optimizer-membership check (:func:`param_group_report`) as (findings, report
    payload), empty when it passes on every rank. Under ``reduce`` a rank whose own optimizer is
    fine fails too when another's is mis-built, so no rank waits for it in a collective."""
    report = param_group_report(named_parameters, optimizers, allow)
    if reduce is not None:
        bad = reduce(torch.tensor([0.0 if report.ok else 1.0], device=device), "sum").item()
        if bad > 0 and report.ok:
            return [dict(category="not_in_optimizer", parameter="(all parameters)", figure=None, threshold=None,
                         message=f"the optimizer is mis-built on {int(bad)} other rank(s)")], {}
    return ([], {}) if report.ok else (report.findings(), {"param_groups": report.to_dict()})


def full_check(named: list[tuple[str, torch.Tensor]], optimizers: Sequence[torch.optim.Optimizer],
               settings: ArbiterSettings, row_exempt: Mapping, seen: Mapping[str, tuple[str, int]], step: int, *,
               reduce: Reduce | None, sharded: bool, world_size: int) -> tuple[GradientFlowReport, list[dict], dict]:
    """The full check at ``step``: gradients and optimizer membership, plus what the sentinel saw
    since the last one. Returns the gradient report, the findings and the report payload."""
    membership = param_group_report(named, optimizers, settings.allow)
    report = gradient_flow_report(named, reduce=reduce, sharded=sharded, world_size=world_size,
                                  vanishing_factor=settings.vanishing_factor, dead_row_share=settings.dead_row_share,
                                  row_exempt=row_exempt, allow=settings.allow)
    findings = [{**f, "step": step} for f in membership.findings() + report.findings()]
    findings += sentinel_findings(seen, {f["parameter"] for f in findings}, step)
    payload = {"step": step, "gradients": report.to_dict(), "param_groups": membership.to_dict(),
               "sentinel": {n: {"category": c, "first_step": f} for n, (c, f) in seen.items()}}
    return report, findings, payload


class ArbiterState:
    """The arbiter's per-step bookkeeping, apart from Lightning: which optimizer step is new, when a
    full check is due, which steps are skipped or deferred, and the counters a run reports."""

    def __init__(self, settings: ArbiterSettings, sharded: bool = False):
        self.settings, self.sharded = settings, sharded
        self.checks = 0  # full checks run in this fit
        self.sentinel_trips = 0  # full checks the sentinel asked for
        self.sentinel_seconds, self.sentinel_steps = 0.0, 0  # its own cost, for scripts/bench.py
        self.skipped_steps = 0  # steps with no gradient at all (dropped by the NaN guard): not judged
        self.seen_step, self.deferred, self.pending, self.parity_done = -1, 0, False, False
        self.sentinel = GradientSentinel(settings.vanishing_factor, sharded=sharded)

    def new_step(self, step: int) -> bool:
        """False for a second optimizer of the same step."""
        new, self.seen_step = step != self.seen_step, step
        return new

    def due(self, step: int, last_step: int | None) -> bool:
        """The first step of every fit (a resumed one too), a deferred check, the cadence, and the
        run's last step (so the grad/* values a summary calls final are the final step's)."""
        return (self.checks == 0 or self.deferred > 0 or self.pending
                or step % self.settings.every_n_steps == 0 or step == last_step)

    def skip(self, due: bool) -> None:
        """A step dropped by design (the NaN guard's skip policy sets every .grad to None): nothing to
        judge, a due check runs next step."""
        self.pending, self.skipped_steps = self.pending or due, self.skipped_steps + 1

    def run_check(self, due: bool, tripped: bool) -> bool:
        self.pending = False
        if tripped and not due:
            self.sentinel_trips += 1
        return due or tripped

    def sentinel_tripped(self, frozen: bool, single: bool, sync_now: bool, reduce: Reduce | None) -> bool:
        if not self.settings.sentinel:
            return False
        if single and (frozen or self.sentinel.missing):
            return True  # known on the host: no sync needed
        return sync_now and self.sentinel.tripped(reduce, extra=frozen)

    def defer(self, step: int, nonfinite: bool, fp16: bool, guard_skips: Callable[[], bool]) -> str | None:
        """Non-finite gradients that are not (yet) a fault, as the warning to log: the NaN guard's
        on-device skip, or an fp16 loss-scale overflow the GradScaler skips (up to ``MAX_DEFERRED``
        in a row). None: judge the step."""
        if nonfinite and not fp16 and guard_skips():
            return f"gradient flow: non-finite gradients at step {step}; the NaN guard skips this step"
        if nonfinite and fp16 and self.deferred < MAX_DEFERRED:
            self.deferred += 1
            return (f"gradient flow: non-finite fp16 gradients at step {step} (loss-scale overflow "
                    f"{self.deferred}/{MAX_DEFERRED}); the scaler skips this step, checking again at step {step + 1}")
        self.deferred = 0
        return None

    def parity_due(self, step: int) -> bool:
        s = self.settings
        if not s.fast_path_parity or self.sharded:
            return False  # FSDP: the eager reference would need the whole unsharded model
        return not self.parity_done or (s.parity_every_n_steps is not None and step % s.parity_every_n_steps == 0)
