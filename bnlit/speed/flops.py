"""FLOPs and memory accounting from the model config alone (no weights, no device).

Two conventions, both logged (``bnlit.speed.throughput``):

- **MFU, PaLM's convention** (:func:`flops_per_token`; Chowdhery et al. 2022, appendix B): 6 FLOPs
  per matmul parameter per token for forward+backward, plus 12 * n_layer * n_head * head_dim *
  seq_len for the attention scores and the weighted sum. Like PaLM and ``torch.utils.flop_counter``
  it counts the full T x T score matrix, causal mask or not, so MFU figures compare with
  published ones.
- **HFU, what the hardware computes** (:func:`hardware_flops`): the attention term counts only the
  query-key pairs the causal and document masks let through (:func:`attended_pairs`: T(T+1)/2 per
  window for causal attention, the sum of d(d+1)/2 over its documents with the document mask), and
  activation checkpointing's recomputed forward of every block is added. Causal attention alone
  roughly halves the attention term; short documents cut it further.
"""

from __future__ import annotations

import torch

from bnlit.model import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every projection plus the output head
    (the input embedding is a lookup, norms are negligible)."""
    attn = cfg.dim * cfg.n_head * cfg.head_dim * 2 + cfg.dim * cfg.n_kv_heads * cfg.head_dim * 2
    ffn = 3 * cfg.dim * cfg.ffn_hidden
    return cfg.n_layer * (attn + ffn) + cfg.dim * cfg.vocab_size


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Unique parameter counts without building the model."""
    per_layer = matmul_params(cfg) - cfg.dim * cfg.vocab_size
    non_embedding = per_layer + cfg.n_layer * 2 * cfg.dim + cfg.dim  # + RMSNorm weights
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return {"n_params": non_embedding + embeddings, "n_params_non_embedding": non_embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at context length ``seq_len``."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len


def attended_pairs(idx: torch.Tensor, eos_id: int | None = None) -> torch.Tensor:
    """The (query, key) pairs attention computes for the windows ``idx`` (B, T): each query sees
    the keys from its document's start (an ``eos`` opens a document, :mod:`bnlit.document_masking`)
    or, with ``eos_id`` None, from the window's start, up to itself. A 0-dim tensor on ``idx``'s
    device: accumulating it costs no host read."""
    T = idx.shape[1]
    pos = torch.arange(T, device=idx.device)
    if eos_id is None:
        return torch.tensor(idx.shape[0] * T * (T + 1) // 2, device=idx.device)
    starts = torch.where(idx == eos_id, pos, 0).cummax(dim=1).values
    return (pos - starts + 1).sum()


def hardware_flops(cfg: ModelConfig, tokens: int, pairs: float, activation_checkpointing: bool = False) -> float:
    """Training FLOPs the hardware does for ``tokens`` tokens whose attention computes ``pairs``
    (query, key) pairs (:func:`attended_pairs`): 6 per matmul parameter per token, 12 * n_layer *
    head_dim * n_head per pair, and with activation checkpointing the blocks' forward again (2 per
    block matmul parameter per token, 4 * n_layer * n_head * head_dim per pair)."""
    attention = cfg.n_layer * cfg.n_head * cfg.head_dim
    recompute = 2 * (matmul_params(cfg) - cfg.dim * cfg.vocab_size) * tokens + 4 * attention * pairs
    return 6 * matmul_params(cfg) * tokens + 12 * attention * pairs + (recompute if activation_checkpointing else 0)


def training_memory_bytes(
    cfg: ModelConfig, seq_len: int, micro_batch: int, activation_checkpointing: bool = False
) -> dict[str, int]:
    """Rough peak memory of one device for bf16-mixed AdamW training with flash attention.

    Weights, gradients and AdamW moments in fp32 take 16 bytes per parameter. Activations follow
    Korthikanti et al. 2022 (34 * dim bytes per token per layer in 16-bit, without the attention
    score term that flash attention avoids); with activation checkpointing only the layer inputs
    (2 * dim bytes) are kept. Logits cost 2 (bf16) + 4 (fp32 upcast) + 4 (grad) bytes per vocab
    entry per token. An estimate for sizing runs, not a measurement.
    """
    n = param_counts(cfg)["n_params"]
    tokens = seq_len * micro_batch
    per_layer = (2 if activation_checkpointing else 34) * cfg.dim * tokens
    states = 16 * n
    activations = cfg.n_layer * per_layer
    logits = 10 * cfg.vocab_size * tokens
    return {
        "weights_grads_optimizer": states,
        "activations": activations,
        "logits": logits,
        "total": states + activations + logits,
    }


def parity_probe_memory_bytes(cfg: ModelConfig, probe_samples: int, probe_seq_len: int,
                              micro_batch: int | None = None, seq_len: int | None = None,
                              activation_checkpointing: bool = False) -> dict[str, int]:
    """An upper bound on one device's peak memory while the gradient-flow arbiter's fast-path
    parity probe runs (``bnlit.checks.gradient_flow.fast_path_parity``), for sizing
    ``callbacks.gradient_flow.probe_*``.

    The probe runs after the training backward (its activations are freed) and before the
    optimizer step, in two passes. The reference pass, eager fp32 on ``probe_samples`` sequences of
    ``probe_seq_len`` tokens: the fp32 weights, gradients and AdamW moments stay (16 bytes per
    parameter); the fast path's and the reference's gradients are kept for the comparison (8 bytes
    per parameter); math attention stores the ``n_head x T x T`` softmax per layer (the term flash
    attention avoids) -- per token and layer at most ``4 * (10 * dim + 4 * ffn_hidden + 2 * n_head
    * T)`` bytes, plus fp32 logits, log-softmax and their gradient (12 bytes per vocab entry per
    token); the comparison upcasts one parameter pair to fp64 at a time (16 bytes per element of
    the largest). Checked against a tensor-by-tensor count of the probe (real tensors at a small
    size, ``FakeTensorMode`` at ``400m``) in ``tests/checks/test_gradient_flow_categories.py``.

    The fast pass runs the training micro-batch (``micro_batch x seq_len``, the slice's targets
    only counted: the compiled graph of the steps, no recompile): a training step's memory
    (:func:`training_memory_bytes`, an estimate) plus its own copy of the gradients (4 bytes per
    parameter). Without ``micro_batch`` it runs the slice and stays inside the reference's bound.
    ``total`` is the larger pass.
    """
    n = param_counts(cfg)["n_params"]
    tokens = probe_samples * probe_seq_len
    per_layer = 4 * (10 * cfg.dim + 4 * cfg.ffn_hidden + 2 * cfg.n_head * probe_seq_len)
    states = 16 * n
    grads = 8 * n
    activations = cfg.n_layer * per_layer * tokens
    logits = 12 * cfg.vocab_size * tokens
    compare = 16 * max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_hidden)
    reference = states + grads + activations + logits + compare
    fast = 0
    if micro_batch:
        fast = training_memory_bytes(cfg, seq_len or probe_seq_len, micro_batch, activation_checkpointing)["total"] + 4 * n
    return {
        "weights_grads_optimizer": states,
        "probe_gradients": grads,
        "activations": activations,
        "logits": logits,
        "compare": compare,
        "reference_pass": reference,
        "fast_pass": fast,
        "total": max(reference, fast),
    }
