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
``trainer=h100``: fully masked 128x128 blocks are skipped), built per block from the document ids
(:func:`document_block_mask`: no token-pair temporaries). CPU: a boolean ``(B, 1, T, T)`` mask for
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

BLOCK_SIZE = 128  # flex attention's tile: the unit a BlockMask skips


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
        return document_block_mask(doc)
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def document_block_mask(doc: torch.Tensor, block_size: int = BLOCK_SIZE) -> BlockMask:
    """The ``BlockMask`` of causal attention within documents, from the windows' document ids
    ``doc`` (B, T; :func:`document_ids`), worked out per 128 x 128 block instead of per token pair.

    ``create_block_mask`` evaluates the mask for every (query, key) pair of every window before it
    reduces them to blocks: at 16 x 2048 that is 67M pairs and ~1-2 GB of temporaries each
    micro-batch, run eagerly. Document ids never decrease along a window, so a block of queries
    ``i`` and one of keys ``j <= i`` share a document exactly when the keys' last document is the
    queries' first, and every pair is allowed exactly when both blocks lie in that one document
    and ``j < i`` (the diagonal block is causal, never full). That is B x (T/128)^2 comparisons of
    block boundary ids; the token-level ``mask_mod`` is left for the partial blocks, inside flex
    attention's kernel. Equal to ``create_block_mask``'s result (``tests/test_document_masking.py``);
    a window that is not a whole number of blocks goes through ``create_block_mask``."""
    B, T = doc.shape

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    if T % block_size:
        return create_block_mask(same_document_causal, B, None, T, T, device=doc.device, BLOCK_SIZE=block_size)
    blocks = doc.view(B, T // block_size, block_size)
    first, last = blocks[..., 0], blocks[..., -1]  # (B, n): each block's first and last document id
    n = T // block_size
    below = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()  # j <= i
    # key block j's last document is query block i's first; the diagonal always attends to itself
    touches = below & ((last[:, None, :] == first[:, :, None]) | torch.eye(n, dtype=torch.bool, device=doc.device))
    whole = touches & (first[:, None, :] == last[:, :, None]) & below.tril(-1)  # one document, j < i
    partial = touches & ~whole
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(whole)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=same_document_causal, seq_lengths=(T, T))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n, n) block flags -> ``BlockMask``'s (B, 1, n) counts and (B, 1, n, n) key-block indices,
    the flagged ones first in order (``create_block_mask``'s own layout)."""
    dense = dense[:, None].to(torch.int32)
    return dense.sum(-1).to(torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


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
