"""Sampling from a trained model: temperature, top-k and nucleus (top-p) filtering, a private
seeded generator (the same seed gives the same text on the same machine), stop at ``eos``.

With ``kv_cache`` (the default) the prompt is read once and each new token attends to the cached
keys and values (:class:`bnlit.model.KVCache`); once the text outgrows the model's context, each
step re-reads the last ``max_len`` tokens, as generation without a cache always does, so both
give the same tokens (``tests/test_generation.py`` checks it, greedy)."""

from __future__ import annotations

import torch
import torch.nn as nn


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the ``top_k`` largest and outside the smallest set whose
    probability reaches ``top_p`` (Holtzman et al. 2020); the most likely token always survives."""
    logits = logits.clone()
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches top_p
        drop[..., 0] = False
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, max_len: int | None = None, kv_cache: bool = True) -> list[int]:
    """Continue ``ids`` by up to ``max_new_tokens`` tokens; ``temperature=0`` is greedy.
    Returns the new tokens only (without a final ``eos``)."""
    from bnlit.model import KVCache

    param = next(model.parameters())
    max_len = min(max_len or model.config.max_seq_len, model.config.max_seq_len)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[int] = []
    cache = None
    try:
        for _ in range(max_new_tokens):
            ctx = (list(ids) + out)[-max_len:]
            if kv_cache and len(ids) + len(out) <= max_len:
                if cache is None:  # the prompt, once
                    cache = KVCache(model.config, 1, max_len, param.device, param.dtype)
                    step = ctx
                else:
                    step = ctx[-1:]
                logits = model(torch.tensor(step, device=param.device)[None], cache=cache)[0, -1].float().cpu()
            else:
                logits = model(torch.tensor(ctx, device=param.device)[None])[0, -1].float().cpu()
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            if eos_id is not None and nxt == eos_id:
                break
            out.append(nxt)
    finally:
        model.train(was_training)
    return out
