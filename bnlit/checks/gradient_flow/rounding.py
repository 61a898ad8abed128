"""The fast path's rounding without its kernels: a ``TorchFunctionMode`` that runs a module in fp32
eager but rounds to the autocast dtype (bf16, fp16) where mixed precision rounds -- the inputs and
outputs of every matmul (``F.linear``, ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``@``),
values forward and gradients backward -- and computes attention the way FlashAttention-2 does,
with its rounding points (:class:`FlashRounding`).

The parity probe (:mod:`bnlit.checks.gradient_flow.parity`) uses it as its floor: how far a
*correct* implementation at that precision lands from the exact fp32 gradient on this batch, at
this state of training. The floor is large exactly where bf16 makes a gradient unreliable: the
query and key gradients are ``dS = P * (dP - D)`` summed over positions, with ``D = rowsum(dO *
O)`` taken from the output stored in bf16 (Dao 2023, FlashAttention-2, Algorithm 2); once
attention is sharp, ``dP`` and ``D`` nearly cancel and the rounding of ``O`` (relative 2^-9)
becomes a large share of a small ``dS`` (docs/gradient-flow.md has the derivation and the
measurements). Nothing here calls the fast path's kernels, so a fault in them (a fused kernel, a
compiled graph, a branch taken only under autocast) is not in the floor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class Round(torch.autograd.Function):
    """Round to ``dtype`` and back to fp32, forward (the stored value) and backward (the
    gradient a tensor of that dtype receives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.to(ctx.dtype).to(g.dtype), None


def rounded(t, dtype: torch.dtype):
    return Round.apply(t, dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class FlashRounding(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` computed in fp32 with FlashAttention-2's rounding
    points at ``dtype``: ``P`` enters the ``P v`` matmul rounded, the output is stored rounded; backward reads ``dO`` rounded, forms
    ``D = rowsum(dO * O)`` from the stored output, ``dS = P * (dO v^T - D)``, and feeds ``P`` and
    ``dS`` rounded to the ``dV``, ``dQ`` and ``dK`` matmuls. ``q``, ``k``, ``v``: (B, H, T, hd),
    (B, KV, S, hd), already rounded; ``allowed``: a boolean (.., T, S) mask or None."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale: float, dtype: torch.dtype):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # GQA
        s = (q @ k.transpose(-2, -1)) * scale
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing
        o = (p.to(dtype).float() @ v).to(dtype).float()
        ctx.save_for_backward(q, k, v, p, o)
        ctx.scale, ctx.dtype, ctx.rep = scale, dtype, rep
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o = ctx.saved_tensors
        r = ctx.dtype
        do = do.to(r).float()
        dv = p.to(r).float().transpose(-2, -1) @ do
        dp = do @ v.transpose(-2, -1)
        d = (do * o).sum(-1, keepdim=True)
        ds = (p * (dp - d)).to(r).float()
        dq = (ds @ k) * ctx.scale
        dk = (ds.transpose(-2, -1) @ q) * ctx.scale
        if ctx.rep > 1:  # sum the gradients of the heads that share a key/value head
            B, H, S, hd = dk.shape
            dk = dk.view(B, H // ctx.rep, ctx.rep, S, hd).sum(2)
            dv = dv.view(B, H // ctx.rep, ctx.rep, S, hd).sum(2)
        return dq, dk, dv, None, None, None


def flash_rounded_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False, *, dtype: torch.dtype):
    """``F.scaled_dot_product_attention``'s signature, through :class:`FlashRounding`."""
    if dropout_p:
        raise NotImplementedError("the rounding floor has no attention dropout")
    q, k, v = (rounded(t.float(), dtype) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    T, S = q.shape[-2], k.shape[-2]
    allowed = None
    if is_causal:
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise NotImplementedError("the rounding floor takes boolean attention masks only")
        allowed = attn_mask if allowed is None else attn_mask & allowed
    return FlashRounding.apply(q, k, v, allowed, scale, dtype)


MATMULS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
           torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm}


class RoundLikeAutocast(TorchFunctionMode):
    """Inside this mode (with autocast off and fp32 weights), every matmul rounds its inputs and
    output to ``dtype`` and attention goes through :func:`flash_rounded_attention`: the fast
    path's rounding, computed with fp32 eager kernels."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return flash_rounded_attention(*args, **kwargs, dtype=self.dtype)
        if func in MATMULS:
            args = tuple(rounded(a, self.dtype) for a in args)
            kwargs = {key: rounded(a, self.dtype) for key, a in kwargs.items()}
            return rounded(func(*args, **kwargs), self.dtype)
        return func(*args, **kwargs)
