"""The optimizer's side of gradient flow: membership both ways (every trainable parameter in a
group with a non-zero learning rate, no frozen parameter in a group: :func:`param_group_report`)
and whether the optimizer step changed every parameter (:func:`snapshot_parameters` before the
step, :func:`update_flow_report` after it)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from bnlit.checks.gradient_flow.params import INF, NamedParameters, Reduce, _classify, _local, _reduce, allowed, unique_trainable


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
