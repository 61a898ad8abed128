"""Attention that stops at document boundaries in packed windows (Llama 3, OLMo).

Shards are ``doc eos doc eos ...`` (``bnlit.data.shards``), cut into fixed windows. Each ``eos``
*opens* the next document, the role ``<bos>`` plays elsewhere: the document after it is
``[eos] text ...``, exactly the context that scoring and generation give one document at a time
(multiple-choice scoring prepends ``eos``), and the first token of a document is predicted from
the ``eos`` alone rather than from the unrelated text before it. A token attends to earlier
tokens of its own document only, in training, in ``val/loss`` and in every held-out score that
packs documents into windows (``bnlit.evaluation.evaluate_stream``: the random twin, the n-gram
comparison, ``scripts/evaluate.py``, llama.cpp through ``bnlit.serving``).

RoPE positions are *not* restarted per document: with the mask, every attention score is between
two tokens of one document, and RoPE makes a score depend only on their distance, so restarting
would change rounding and nothing else (``tests/test_document_masking.py`` checks both claims,
and that a document scored inside a packed window equals the same document scored alone, which is
what Hugging Face Llama sees after export).

CUDA: a ``flex_attention`` ``BlockMask`` (the model runs flex attention; fast when compiled, as on
``trainer=h100``: fully masked 128x128 blocks are skipped). CPU: a boolean ``(B, 1, T, T)`` mask for
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def document_ids(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) index of each token's document within its window; an ``eos`` starts a new one."""
    return torch.cumsum(idx == eos_id, dim=1)


def document_mask(idx: torch.Tensor, eos_id: int, flex: bool | None = None) -> torch.Tensor | BlockMask:
    """Causal attention within documents for the windows ``idx`` (B, T). ``flex`` (default: on
    CUDA) returns a ``BlockMask`` for ``flex_attention``; otherwise a boolean ``(B, 1, T, T)``
    tensor, True where a query may attend to a key."""
    doc = document_ids(idx, eos_id)
    B, T = idx.shape
    if flex is None:
        flex = idx.is_cuda
    if flex:
        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (doc[b, q] == doc[b, kv])

        return create_block_mask(same_document_causal, B, None, T, T, device=idx.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


@torch.no_grad()
def leakage(model: nn.Module, eos_id: int, seq_len: int, masked: bool = True, seed: int = 0) -> float:
    """Largest change of any logit after a document boundary when every token before it changes:
    0 (to rounding) with the document mask, clearly positive without it. Two random windows share
    the tokens from an ``eos`` at the middle on; ``model.forward(idx, mask=...)`` runs eagerly."""
    p = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    a = torch.randint(0, vocab, (2, seq_len), generator=gen)
    a[a == eos_id] = (eos_id + 1) % vocab
    boundary = seq_len // 2
    a[:, boundary] = eos_id
    a[1, boundary:] = a[0, boundary:]  # the same document from the boundary on; different text before
    a = a.to(p.device)
    mask = document_mask(a, eos_id) if masked else None
    logits = model.forward(a, mask=mask).float()
    return float((logits[0, boundary:] - logits[1, boundary:]).abs().max())


def leakage_probe(config, eos_id: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> float:
    """:func:`leakage` of a fresh 2-layer model of this architecture (heads, head size, RoPE) on
    ``device``: the run's mask and attention kernel without touching the training model (which
    may be compiled for other shapes or sharded)."""
    from bnlit.model import ModelConfig, Transformer

    small = ModelConfig(**{**config.to_dict(), "n_layer": 2, "vocab_size": min(config.vocab_size, 1024),
                           "name": f"{config.name}-probe"})
    with torch.device(device):
        model = Transformer(small).to(dtype)
    return leakage(model, eos_id, min(small.max_seq_len, 64))
