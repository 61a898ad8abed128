"""The next-token loss of the output head: ``loss(h, weight, targets)`` for final hidden states
``h`` (B, T, D), the head's ``weight`` (V, D) and ``targets`` (B, T).

``module.loss_impl`` picks one of three, all the mean cross-entropy over every target token:

- ``plain``: ``h @ weight.T`` to full (B*T, V) logits, upcast to fp32, ``F.cross_entropy``.
- ``chunked``: the rows in chunks of ``CHUNK_ELEMENTS`` logits; each chunk's logits, fp32
  log-sum-exp and gradients are computed in the forward and freed, so the (B*T, V) logits (and
  their fp32 copy, log-softmax and gradient) never exist at once: the same scheme as Liger's
  kernel, in plain PyTorch, so it runs on CPU and CUDA and compiles. Loss and weight gradient
  accumulate in fp32.
- ``fused``: PyTorch's own ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` (torch
  >= 2.13; CPU and CUDA), the same chunked scheme as one library op. Accepted at fp32 precision
  only: in torch 2.13 its bf16/fp16 path accumulates the mean loss and the weight gradient across
  chunks in the input dtype (``FUSED_BF16_DEFECT``), so ``trainer.precision`` other than
  ``32-true``/``64-true`` is refused at start in one line, as is a torch without the op.

Every implementation ignores targets equal to ``IGNORE_INDEX`` (-100, ``F.cross_entropy``'s
default) and averages over the others. The parity of each with ``plain`` (loss and gradients,
fp32 and bf16, tied and untied heads, ignored targets) is in ``tests/test_loss.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bnlit.errors import ConfigError

LOSS_IMPLS = ("plain", "chunked", "fused")
IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing
# precisions at which torch's linear_cross_entropy is correct (tests/test_loss.py measures it)
FUSED_PRECISIONS = ("32-true", "32", "64-true", "64")
FUSED_BF16_DEFECT = ("torch's F.linear_cross_entropy accumulates the bf16 mean loss and weight gradient across chunks "
                     "in bf16 (measured at 2,048 rows: loss 0.19 nats off, weight gradient 3.2% off against 0.28% "
                     "for plain)")
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
        valid = targets != IGNORE_INDEX
        n = valid.sum()  # a device tensor: no host read
        need_grads = any(ctx.needs_input_grad[:2])  # no gradient work under torch.no_grad (validation)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads else None
        for start in range(0, h.shape[0], rows):
            hc, vc = h[start:start + rows], valid[start:start + rows, None]
            tc = targets[start:start + rows, None].where(vc, 0)
            logits = (hc @ weight.T).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + ((lse - logits.gather(1, tc)) * vc).sum()
            if need_grads:
                # d(mean CE)/d(logits) = (softmax - one_hot) / n on counted rows, 0 on ignored ones,
                # computed in place over the logits
                g = logits.sub_(lse).exp_().scatter_add_(1, tc, torch.full_like(lse, -1.0)).mul_(vc / n).to(h.dtype)
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


def fused_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.linear_cross_entropy`` on its chunked path (fp32 only: :func:`loss_fn` refuses other
    precisions). Under ``torch.compile`` the op is one opaque custom op; torch then needs
    ``allow_retain_graph=True`` and warns when it has to set it itself (a graph break)."""
    from torch.nn import LinearCrossEntropyOptions

    options = LinearCrossEntropyOptions(allow_retain_graph=torch.compiler.is_compiling())
    return F.linear_cross_entropy(h.flatten(0, 1), weight, targets.flatten(), ignore_index=IGNORE_INDEX,
                                  options=options)


def loss_fn(impl: str, device: torch.device | str, precision: str | int | None = None) -> LossFn:
    """The loss for ``module.loss_impl=impl`` on ``device`` at Lightning ``precision`` (None: not
    known yet); a bad name or an impossible combination (``fused`` on a torch without
    ``F.linear_cross_entropy`` or at a precision where it is wrong) is refused in one line."""
    if impl not in LOSS_IMPLS:
        raise ConfigError(f"module.loss_impl={impl!r}: use one of {list(LOSS_IMPLS)}")
    if impl == "plain":
        return plain_loss
    if impl == "chunked":
        return chunked_loss
    if not hasattr(F, "linear_cross_entropy"):
        raise ConfigError(f"module.loss_impl=fused needs torch.nn.functional.linear_cross_entropy (torch >= 2.13; "
                          f"this is {torch.__version__}): use module.loss_impl=chunked")
    if precision is not None and str(precision) not in FUSED_PRECISIONS:
        raise ConfigError(f"module.loss_impl=fused at trainer.precision={precision}: {FUSED_BF16_DEFECT}; use "
                          "module.loss_impl=chunked (fp32 accumulation) or trainer.precision=32-true")
    return fused_loss
