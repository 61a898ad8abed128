"""A Llama-style decoder in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention`` (or ``flex_attention`` for a document mask), SwiGLU feed-forward,
optional tied embeddings, and the next-token loss inside ``forward`` so that ``torch.compile``
sees it. Parameter names follow Meta's Llama (``wq wk wv wo``, ``w1 w2 w3``, ``attention_norm``,
``ffn_norm``) so export to Hugging Face's ``LlamaForCausalLM`` is a rename table. Nothing here
knows of Lightning or Hydra.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from bnlit.errors import ConfigError
from bnlit.loss import LossFn, plain_loss


@dataclass
class ModelConfig:
    """Architecture hyperparameters. Presets live in ``conf/model/*.yaml``; derived sizes are
    properties so no number is written twice."""

    name: str = "custom"
    vocab_size: int = 32000
    dim: int = 512
    n_layer: int = 8
    n_head: int = 8
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads == n_head)
    ffn_multiplier: float = 1.0  # scales the Llama 8/3 * dim SwiGLU width
    multiple_of: int = 256  # FFN width is rounded up to this (tensor-core friendly)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        checks = [
            (self.vocab_size > 0, "vocab_size must be positive"),
            (self.dim > 0 and self.n_layer > 0 and self.n_head > 0, "dim, n_layer and n_head must be positive"),
            (self.dim % self.n_head == 0, f"n_head={self.n_head} must divide dim={self.dim}"),
            (self.n_kv_heads > 0 and self.n_head % self.n_kv_heads == 0,
             f"n_kv_heads={self.n_kv_heads} must divide n_head={self.n_head}"),
            ((self.dim // self.n_head) % 2 == 0, f"head_dim={self.dim // self.n_head} must be even for RoPE"),
            (self.max_seq_len > 0, "max_seq_len must be positive"),
            (self.multiple_of > 0 and self.ffn_multiplier > 0, "multiple_of and ffn_multiplier must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"model.config ({self.name}): {message}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def ffn_hidden(self) -> int:
        hidden = int(self.ffn_multiplier * 8 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 even under autocast: bf16 has too few mantissa bits for the mean square
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


def rope_cache(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) in the half-split layout Hugging Face uses."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation: each new token attends
    to them instead of recomputing the whole context (``bnlit.generation``). Filled from position 0
    by one prompt (any length), then one token at a time, up to ``max_len``."""

    def __init__(self, cfg: "ModelConfig", batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.n_layer, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens cached so far (the RoPE position of the next one)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (B, KV, T, hd) of positions ``pos..pos+T-1``; return all keys/values so far."""
        T = k.shape[2]
        if T > 1 and self.pos > 0:
            raise ValueError("KVCache: only the first call may add more than one token")
        end = self.pos + T
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = cfg.n_head, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)
        # the kernel of the training/evaluation forward; LMModule sets the one module.sdpa_backend names
        self.sdpa = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None, cache: tuple[KVCache, int] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_head
        if cache is not None:  # generation: the prompt from position 0 (causal), then one token (sees all)
            k, v = cache[0].update(cache[1], k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        elif isinstance(mask, BlockMask):  # document mask on CUDA (fast only when compiled)
            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:  # mask None: causal; a (B, 1, T, T) boolean tensor: True where attention is allowed
            y = self.sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None, cache: tuple[KVCache, int] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(config.max_seq_len, config.head_dim, config.rope_theta)
        # not persistent: derived from the config, so checkpoints and exports never carry them
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # the output head's loss (bnlit.loss); LMModule sets the configured module.loss_impl
        self.loss_fn: LossFn = plain_loss
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) everywhere; residual output projections scaled by 1/sqrt(2 n_layer)
        (GPT-2) so the residual stream's variance does not grow with depth."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, 0.0, residual_std, generator=generator)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)
        cos, sin = rope_cache(self.config.max_seq_len, self.config.head_dim, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                mask: torch.Tensor | BlockMask | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """idx: (B, T) token ids -> logits (B, T, vocab_size), or with ``targets`` (B, T) the mean
        next-token loss, computed by ``self.loss_fn`` without necessarily materialising the logits.
        ``mask``: None for causal attention, or a document mask from
        :func:`bnlit.document_masking.document_mask`. RoPE positions run 0..T-1 over the window
        either way: a document's attention scores depend only on distances inside it. ``cache``
        (generation): ``idx`` continues the tokens the cache holds, at positions from ``cache.pos``."""
        T = idx.shape[1]
        start = cache.pos if cache is not None else 0
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds model max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                x = layer(x, cos, sin, None, (cache, i))
            elif self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        if cache is not None:
            cache.pos += T
        x = self.norm(x)
        if targets is None:
            return self.output(x)
        return self.loss_fn(x, self.output.weight, targets)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). ``non_embedding`` drops the token
        embedding and the output head, the usual convention for scaling laws."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.output.weight.numel()
        return n
