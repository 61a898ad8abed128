"""The next-token loss of the output head: ``loss(h, weight, targets)`` for final hidden states
``h`` (B, T, D), the head's ``weight`` (V, D) and ``targets`` (B, T).

``module.loss_impl`` picks one of three, all the mean cross-entropy over every target token:

- ``plain``: ``h @ weight.T`` to full (B*T, V) logits, upcast to fp32, ``F.cross_entropy``.
- ``chunked``: the rows in chunks of ``CHUNK_ELEMENTS`` logits; each chunk's logits, fp32
  log-sum-exp and gradients are computed in the forward and freed, so the (B*T, V) logits (and
  their fp32 copy, log-softmax and gradient) never exist at once: the same scheme as Liger's
  kernel, in plain PyTorch, so it runs on CPU and CUDA and compiles. Loss and weight gradient
  accumulate in fp32.
- ``fused``: Liger's Triton ``LigerFusedLinearCrossEntropyLoss`` (CUDA, ``pip install liger-kernel``),
  refused at start when it is not there.

The parity of each with ``plain`` (loss and gradients, fp32 and bf16, tied and untied heads) is
in ``tests/test_loss.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bnlit.errors import ConfigError

LOSS_IMPLS = ("plain", "chunked", "fused")
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of full logits, in fp32 (bf16 logits lose too much precision in the
    log-sum-exp)."""
    return F.cross_entropy(F.linear(h, weight).float().flatten(0, 1), targets.flatten())


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``plain_loss`` for logits someone else computed (evaluation of an exported model)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# logits per chunk: 2**24 fp32 values are 64 MiB (524 rows at vocab 32k). Smaller chunks use less
# memory but add one read-modify-write of the fp32 weight gradient (V x D) each
CHUNK_ELEMENTS = 2**24


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T``; both gradients are computed in the forward, chunk
    by chunk, and the backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = h.shape[0]
        need_grads = any(ctx.needs_input_grad[:2])  # no gradient work under torch.no_grad (validation)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        for start in range(0, n, rows):
            hc, tc = h[start:start + rows], targets[start:start + rows, None]
            logits = (hc @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + (lse - logits.gather(1, tc)).sum()
            if need_grads:
                # d(mean CE)/d(logits) = (softmax - one_hot) / n, computed in place over the logits
                g = logits.sub_(lse).exp_().scatter_add_(1, tc, torch.full_like(lse, -1.0)).div_(n).to(h.dtype)
                grad_h[start:start + rows] = g @ weight
                grad_w.addmm_(g.T, hc) if g.dtype == grad_w.dtype else grad_w.add_(g.T @ hc)
        if need_grads:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None


def chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The mean cross-entropy of ``plain_loss`` without the full logits, ``chunk_elements`` logits
    at a time. Under autocast the head's matmuls run in the autocast dtype, as ``F.linear``'s do."""
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    h, weight = h.flatten(0, 1).to(dtype), weight.to(dtype)
    rows = max(1, chunk_elements // weight.shape[0])
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h, weight, targets.flatten(), rows)


def liger_loss() -> LossFn:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        raise ConfigError(f"module.loss_impl=fused needs liger-kernel ({e}); pip install liger-kernel on a CUDA "
                          "machine, or use module.loss_impl=chunked") from None
    fn = LigerFusedLinearCrossEntropyLoss()
    return lambda h, weight, targets: fn(weight.to(h.dtype), h.flatten(0, 1), targets.flatten())


def loss_fn(impl: str, device: torch.device | str) -> LossFn:
    """The loss for ``module.loss_impl=impl`` on ``device``; a bad name or an impossible
    combination (``fused`` without CUDA or Liger) is refused in one line."""
    if impl not in LOSS_IMPLS:
        raise ConfigError(f"module.loss_impl={impl!r}: use one of {list(LOSS_IMPLS)}")
    if impl == "plain":
        return plain_loss
    if impl == "chunked":
        return chunked_loss
    if torch.device(device).type != "cuda":
        raise ConfigError(f"module.loss_impl=fused runs Liger's Triton kernel on CUDA only (device: {device}); "
                          "use module.loss_impl=chunked")
    return liger_loss()
