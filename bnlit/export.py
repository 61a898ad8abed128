"""Export a bnlit checkpoint in the Hugging Face Llama layout, for ``transformers``, the llama.cpp
converters and Rust runtimes such as candle.

bnlit's model uses Meta's Llama parameter names and Hugging Face's half-split RoPE layout, so the
export is a rename table: no permutation of ``wq``/``wk`` is needed (the interleaved-RoPE
checkpoints of Meta's reference code need one; ours do not). A tied head is written once, as
``model.embed_tokens.weight``, with ``tie_word_embeddings: true``.

The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the
SentencePiece ``tokenizer.model`` with ``tokenizer_config.json`` and ``special_tokens_map.json``.
It is written to a temporary sibling directory and renamed into place, so an interrupted export
leaves no half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bnlit.errors import CheckpointError
from bnlit.model import ModelConfig, Transformer
from bnlit.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

LAYER_RENAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_RENAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """bnlit parameter name -> Hugging Face Llama name."""
    if name in TOP_RENAMES:
        return TOP_RENAMES[name]
    parts = name.split(".", 2)  # layers.<i>.<rest>
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in LAYER_RENAMES:
        return f"model.layers.{parts[1]}.{LAYER_RENAMES[parts[2]]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def hf_state_dict(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The renamed weights (contiguous CPU copies; a tied head is left out)."""
    out = {}
    for name, p in model.state_dict().items():
        if name == "output.weight" and model.config.tie_embeddings:
            continue
        t = p.detach().to("cpu", dtype=dtype or p.dtype).contiguous().clone()
        out[hf_name(name)] = t
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` for ``LlamaForCausalLM``; RoPE is given in both the transformers 4
    (``rope_theta``) and 5 (``rope_parameters``) spellings."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
        "bnlit_model_config": cfg.to_dict(),
    }


def tokenizer_files(tokenizer: Tokenizer, max_len: int) -> dict[str, dict]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for the SentencePiece model.
    bnlit prepends no BOS and appends no EOS when it encodes (documents are separated by EOS)."""
    piece = tokenizer.sp.id_to_piece
    special = {"bos_token": piece(BOS_ID), "eos_token": piece(EOS_ID), "unk_token": piece(UNK_ID),
               "pad_token": piece(PAD_ID)}
    config = {
        "tokenizer_class": "LlamaTokenizer",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": True,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "right",
        # the SentencePiece model's own rule is identity: bnlit normalises before encoding
        "bnlit_normalization": "call bnlit.tokenizer.normalize(text) before encoding (NFC with decomposed "
                               "nukta letters, khanda-ta, joiners, invisible controls; bnlit/data/normalize.py)",
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special}


def export_hf(model: Transformer, tokenizer: Tokenizer, out_dir: str | os.PathLike,
              dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` in the Hugging Face Llama layout."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"export directory {out_dir} already exists; pass --overwrite or choose another --out")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                              f"{model.config.vocab_size}; they are not from the same run")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        save_file(hf_state_dict(model, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config
        files = {
            "config.json": hf_config(cfg, dtype),
            "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
                                       "do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95,
                                       "max_length": cfg.max_seq_len},
            **tokenizer_files(tokenizer, cfg.max_seq_len),
        }
        for name, payload in files.items():
            (tmp / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
        tokenizer.save(tmp / "tokenizer.model")
        if out_dir.exists():  # overwrite: move the old export aside, then drop it
            old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
