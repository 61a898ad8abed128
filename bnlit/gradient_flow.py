"""Gradient-flow checks: no trainable parameter may silently stop learning.

Three pure checks, each tested without a Trainer (``callbacks/gradient_flow.py`` decides when to
run them and what to do with a failure):

* :func:`gradient_flow_report` -- after backward, every trainable parameter has a gradient that is
  present, finite and not all zeros.
* :func:`param_group_report` and :func:`update_flow_report` -- every trainable parameter is in an
  optimizer param group with a non-zero learning rate, and the optimizer step changed it.
* :func:`fast_path_parity` -- on one probe batch the configured fast path (bf16 autocast,
  ``torch.compile``, fused kernels) gives per-parameter gradients with the direction (cosine
  similarity) and size (relative norm error) of a plain eager fp32 copy of the same model.

All three accept ``reduce(tensor, op) -> tensor`` (``op`` in ``"sum" | "min" | "max"``; an
all-reduce across ranks) so every rank reaches the same verdict, and the distributed callers fail
together instead of leaving one rank waiting in a collective. ``sharded=True`` (FSDP) means each
rank holds a shard of a parameter: a parameter is zero only when every shard is.

The exactness matters: one fused L2-norm pass finds the candidates, and a candidate is called zero
or non-finite only after an exact re-check -- the fp32 L2 norm underflows to 0 for gradients around
1e-23 and overflows to Inf above 1e19.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

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
        if not nonfinite[i] and not math.isfinite(l2[i]):
            l2[i] = float(torch.linalg.vector_norm(t, dtype=torch.float64))  # overflowed in fp32
    return l2, nonfinite, zero


# ----------------------------------------------------------------------------------------------
# 1. gradient flow


@dataclass
class GradientFlowReport:
    """Verdict on the gradients of one backward pass.

    ``names`` are the parameters checked (trainable, tied tensors once); ``norms`` their L2
    gradient norms (NaN where the gradient is missing or non-finite); ``ranks`` how many ranks saw
    each fault (1 on a single process)."""

    names: list[str]
    norms: dict[str, float]
    missing: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    zero: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)
    world_size: int = 1

    @property
    def ok(self) -> bool:
        return not (self.missing or self.nonfinite or self.zero)

    @property
    def num_ok(self) -> int:
        return len(self.names) - len(self.problems())

    @property
    def total_norm(self) -> float:
        return math.sqrt(sum(v * v for v in self.norms.values() if math.isfinite(v)))

    def problems(self) -> dict[str, str]:
        """``{name: what is wrong}`` in parameter order."""
        where = lambda n: f" (on {self.ranks[n]} of {self.world_size} ranks)" if self.world_size > 1 else ""  # noqa: E731
        found = {}
        for n in self.missing:
            found[n] = "gradient is None (no gradient reached it: detached, unused or outside the graph)" + where(n)
        for n in self.nonfinite:
            found[n] = "gradient has NaN/Inf values" + where(n)
        for n in self.zero:
            found[n] = "gradient is exactly zero everywhere (a zeroing kernel, a multiply by zero, a dead path)" + where(n)
        order = {n: i for i, n in enumerate(self.names)}
        return dict(sorted(found.items(), key=lambda kv: order[kv[0]]))

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "total_norm": self.total_norm,
                "problems": self.problems()}


def gradient_flow_report(
    named_parameters: NamedParameters, *, reduce: Reduce | None = None, sharded: bool = False,
    world_size: int = 1,
) -> GradientFlowReport:
    """Classify every trainable parameter's ``.grad`` as missing, non-finite, zero or ok.

    Call after backward (and after AMP unscaling). Frozen parameters are skipped and a tensor
    shared under several names (tied embeddings) is checked once. One host sync (two with
    ``reduce``).

    Args:
        named_parameters: e.g. ``model.named_parameters()``.
        reduce: all-reduce across ranks. Under DDP (``sharded=False``, gradients already
            averaged) a fault on any rank is a fault; under FSDP a parameter is zero only if all
            of its non-empty shards are.
        sharded: parameters are sharded across ranks (FSDP); check local shards.
        world_size: number of ranks, for the messages.
    """
    params, tied, frozen = unique_trainable(named_parameters)
    names = [n for n, _ in params]
    if not params:
        return GradientFlowReport(names=[], norms={}, tied=tied, frozen=frozen, world_size=world_size)
    device = params[0][1].device
    # columns: holds a shard, grad is None, non-finite, all zero, squared L2 norm (finite only)
    rows = [[0.0, 0.0, 0.0, 0.0, 0.0] for _ in params]
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
        for (i, _), n, bad, z in zip(with_grad, l2, nonfinite, zero):
            rows[i][2], rows[i][3], rows[i][4] = float(bad), float(z), 0.0 if bad else n * n
    stats = torch.tensor(rows, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
    stats = _reduce(stats, reduce, "sum").cpu().tolist()

    report = GradientFlowReport(names=names, norms={}, tied=tied, frozen=frozen, world_size=world_size)
    for name, (held, missing, nonfinite, zero, sumsq) in zip(names, stats):
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
        # DDP ranks hold the same averaged gradient: the root mean square over ranks is its norm
        report.norms[name] = math.nan if bad else math.sqrt(sumsq if sharded else sumsq / max(1, world_size))
    return report


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
    """Trainable parameters missing from every optimizer, and those whose group's base learning
    rate (``initial_lr`` when a scheduler is attached) is zero: ``{name: group label}``."""

    names: list[str]
    not_in_optimizer: list[str] = field(default_factory=list)
    zero_lr: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.not_in_optimizer or self.zero_lr)

    def problems(self) -> dict[str, str]:
        found = {n: "not in any optimizer param group (it gets gradients but is never updated)"
                 for n in self.not_in_optimizer}
        found |= {n: f"in param group {g!r} whose learning rate is 0" for n, g in self.zero_lr.items()}
        order = {n: i for i, n in enumerate(self.names)}
        return dict(sorted(found.items(), key=lambda kv: order[kv[0]]))

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "problems": self.problems()}


def param_group_report(named_parameters: NamedParameters,
                       optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> ParamGroupReport:
    """Check that every trainable parameter is in a param group with a non-zero base lr."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    params, _, _ = unique_trainable(named_parameters)
    groups = _group_of(optimizers)
    report = ParamGroupReport(names=[n for n, _ in params])
    for name, p in params:
        if id(p) not in groups:
            report.not_in_optimizer.append(name)
        elif _lr(groups[id(p)][1], initial=True) == 0.0:
            report.zero_lr[name] = groups[id(p)][0]
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


def eager_fp32_copy(model: nn.Module) -> nn.Module:
    """A plain eager fp32 copy of ``model`` with the same weights: ``torch.compile`` wrappers
    (``torch.compile(m)`` and ``m.compile()``) are dropped, parameters cast to fp32."""
    model = getattr(model, "_orig_mod", model)
    memo: dict[int, object] = {}
    for m in model.modules():
        compiled = m.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            memo[id(compiled)] = None
    ref = copy.deepcopy(model, memo)
    for p in ref.parameters():
        p.grad = None
    return ref.float()


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


def probe_gradients(model: nn.Module, batch, loss_fn: Callable[[nn.Module, object], torch.Tensor],
                    context: contextlib.AbstractContextManager | None = None, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Gradients of ``loss_fn(model, batch)`` w.r.t. the trainable parameters, via
    ``torch.autograd.grad`` (the parameters' ``.grad`` is left untouched). The RNG is seeded so a
    model with dropout draws the same masks on both paths."""
    params, _, _ = unique_trainable(model.named_parameters())
    device = params[0][1].device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with context if context is not None else contextlib.nullcontext():
            loss = loss_fn(model, batch)
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: (None if g is None else g.detach()) for (n, _), g in zip(params, grads)}


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

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "problems": self.problems()}


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
    model: nn.Module, batch, loss_fn: Callable[[nn.Module, object], torch.Tensor], *,
    fast_context: contextlib.AbstractContextManager | None = None, reference: nn.Module | None = None,
    min_cosine: float = 0.99, max_rel_norm_error: float = 0.05, reduce: Reduce | None = None,
) -> ParityReport:
    """Gradients of the fast path (``model`` as configured -- compiled or not -- under
    ``fast_context``, e.g. bf16 autocast) against a plain eager fp32 copy of the same weights on
    one probe ``batch``.

    Args:
        model: the training model (its ``.grad`` are not touched).
        batch: one probe batch, passed to ``loss_fn(model, batch) -> scalar loss``.
        fast_context: the training forward context (``trainer.precision_plugin.forward_context()``).
        reference: a prepared reference model (default: :func:`eager_fp32_copy` of ``model``).
        min_cosine, max_rel_norm_error: per-parameter tolerances; see the README for the bf16
            figures they were chosen from.
        reduce: all-reduce across ranks (each rank probes its own batch; the worst rank decides).
    """
    fast = probe_gradients(model, batch, loss_fn, fast_context)
    ref_model = reference if reference is not None else eager_fp32_copy(model)
    device = next(ref_model.parameters()).device
    with reference_context(device):
        ref = probe_gradients(ref_model, batch, loss_fn)
    fast = {n: (None if g is None else g.float()) for n, g in fast.items()}
    del ref_model
    return compare_gradients(fast, ref, min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error, reduce=reduce)
