"""FLOPs and memory accounting from the model config alone (no weights, no device).

``flops_per_token`` follows PaLM (Chowdhery et al. 2022, appendix B): 6 FLOPs per matmul
parameter per token for forward+backward, plus 12 * n_layer * n_head * head_dim * seq_len for the
attention scores and the weighted sum. Like PaLM and ``torch.utils.flop_counter`` it counts the
full T x T score matrix, causal mask or not, so MFU figures compare with published ones.
"""

from __future__ import annotations

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


def parity_probe_memory_bytes(cfg: ModelConfig, probe_samples: int, probe_seq_len: int) -> dict[str, int]:
    """An upper bound on one device's peak memory while the gradient-flow arbiter's fast-path
    parity probe runs (``bnlit.checks.gradient_flow.fast_path_parity`` on ``probe_samples`` sequences of
    ``probe_seq_len`` tokens), for sizing ``callbacks.gradient_flow.probe_*``.

    The probe runs after the training backward (its activations are freed) and before the
    optimizer step: the fp32 weights, gradients and AdamW moments stay (16 bytes per parameter);
    the fast path's and the reference's gradients are kept for the comparison (8 bytes per
    parameter); the reference pass runs in fp32 with math attention, which stores the ``n_head x
    T x T`` softmax per layer (the term flash attention avoids) -- per token and layer at most
    ``4 * (10 * dim + 4 * ffn_hidden + 2 * n_head * T)`` bytes, plus fp32 logits, log-softmax and
    their gradient (12 bytes per vocab entry per token); the comparison upcasts one parameter pair
    to fp64 at a time (16 bytes per element of the largest). Checked against a tensor-by-tensor
    count of the probe (real tensors at a small size, ``FakeTensorMode`` at ``400m``) in
    ``tests/checks/test_gradient_flow_categories.py``.
    """
    n = param_counts(cfg)["n_params"]
    tokens = probe_samples * probe_seq_len
    per_layer = 4 * (10 * cfg.dim + 4 * cfg.ffn_hidden + 2 * cfg.n_head * probe_seq_len)
    states = 16 * n
    grads = 8 * n
    activations = cfg.n_layer * per_layer * tokens
    logits = 12 * cfg.vocab_size * tokens
    compare = 16 * max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_hidden)
    return {
        "weights_grads_optimizer": states,
        "probe_gradients": grads,
        "activations": activations,
        "logits": logits,
        "compare": compare,
        "total": states + grads + activations + logits + compare,
    }
