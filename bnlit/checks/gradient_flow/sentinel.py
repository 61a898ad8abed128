"""The every-step pass between full checks: :class:`GradientSentinel` (one fused norm pass, no
host sync until :meth:`GradientSentinel.tripped`) and :func:`total_grad_norm` (``grad/norm`` when the
sentinel is off)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from bnlit.checks.gradient_flow.gradients import VANISHING_FACTOR
from bnlit.checks.gradient_flow.params import NamedParameters, Reduce, _local, _norms, _reduce, shard_layout, unique_trainable


class GradientSentinel:
    """The every-step check: one fused norm pass over the gradients, no host sync.

    :meth:`observe` (every optimizer step) turns the per-parameter L2 gradient norms into a code
    (1 non-finite, 2 zero, 3 vanishing against the weight norms of the last full check) and keeps
    the first step each parameter tripped, on the device; :meth:`tripped` is the one host sync
    (and, across ranks, the one all-reduce), done every step on CPU and on logging steps on CUDA.
    A missing gradient is known on the host at once. Under FSDP/HSDP (``sharded``) each rank sees
    only its shards, so :meth:`observe` all-reduces the per-parameter squared norms (one
    collective of two numbers per parameter, on the device, no host sync) and judges the full
    parameters: zero only when every shard is, vanishing on the full norm.
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
        self.replicas: torch.Tensor | None = None  # sharded: ranks holding each shard (HSDP: the nodes)

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

    def observe(self, named_parameters: NamedParameters, step: int, skipped: torch.Tensor | None = None,
                reduce: Reduce | None = None) -> torch.Tensor | None:
        """Record this step's faults; returns the total gradient norm (a device tensor) or None.
        ``skipped``: a device flag, nonzero when the optimizer will not apply this step (the NaN
        guard's verdict in fused AdamW's ``found_inf``); such a step records nothing. ``reduce``:
        used only when ``sharded``, and then by every rank at every call (a collective)."""
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
        if not grads and not (self.sharded and params):  # a rank with no shards still joins the collective
            return None
        device = grads[0].device if grads else _local(params[0][1]).device
        if names != self.names or self.first_step is None or self.first_step.device != device:
            self.names, self.inv_weight = names, None
            self.first_step = torch.full((len(names),), -1, dtype=torch.int64, device=device)
            self.first_code = torch.zeros(len(names), dtype=torch.int64, device=device)
            self.replicas = torch.tensor([float(shard_layout(p)[1]) for _, p in params], dtype=torch.float64,
                                         device=device) if self.sharded else None
        norms = torch.full((len(names),), math.nan, dtype=torch.float32, device=device)
        present = torch.zeros(len(names), dtype=torch.bool, device=device)
        if grads:
            norms[torch.tensor(idx, device=device)] = torch.stack([n.to(device) for n in _norms(grads, 2.0)])
            present[torch.tensor(idx, device=device)] = True
        if self.sharded:  # the full parameters: sum the shards' squared norms (NaN/Inf carry through)
            local = torch.cat([torch.where(present, norms.double().square(), 0.0), present.double()])
            total = _reduce(local, reduce, "sum")
            present = total[len(names):] > 0
            norms = (total[:len(names)] / self.replicas).sqrt().float()
        nonfinite = present & ~torch.isfinite(norms)
        code = nonfinite.long()
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


def total_grad_norm(named_parameters: NamedParameters, reduce: Reduce | None = None) -> torch.Tensor | None:
    """The global L2 gradient norm as a device tensor (no host sync), or None without gradients.
    ``reduce``: the parameters are FSDP/HSDP shards, and every rank calls this (a collective): the
    shards' squared norms are summed over ranks, each shard once."""
    params, _, _ = unique_trainable(named_parameters)
    held = [(p, g) for _, p in params if p.grad is not None and (g := _local(p.grad)).numel() > 0]
    if not held and (reduce is None or not params):
        return None
    if reduce is None:
        device = held[0][1].device
        return torch.stack([n.to(device) for n in _norms([g for _, g in held], 2.0)]).norm()
    device = _local(params[0][1]).device
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    if held:
        norms = torch.stack([n.to(device) for n in _norms([g for _, g in held], 2.0)]).double()
        replicas = torch.tensor([float(shard_layout(p)[1]) for p, _ in held], dtype=torch.float64, device=device)
        sq = (norms.square() / replicas).sum().reshape(1)
    return _reduce(sq, reduce, "sum").sqrt().reshape(())
