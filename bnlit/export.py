"""Export a bnlit checkpoint in the Hugging Face Llama layout, for ``transformers``, the llama.cpp
converters and Rust runtimes such as candle, or as one GGUF file for llama.cpp, ollama and
candle's quantized models (:func:`export_gguf`).

bnlit's model uses Meta's Llama parameter names and Hugging Face's half-split RoPE layout, so the
export is a rename table: no permutation of ``wq``/``wk`` is needed (the interleaved-RoPE
checkpoints of Meta's reference code need one; ours do not). A tied head is written once, as
``model.embed_tokens.weight``, with ``tie_word_embeddings: true``.

The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json`` (a ``tokenizers`` pipeline with bnlit's normalisation in its normalizer,
:mod:`bnlit.hf_tokenizer`: ``AutoTokenizer`` gives :meth:`Tokenizer.encode`'s ids on raw text),
``tokenizer_config.json``, ``special_tokens_map.json`` and the SentencePiece ``tokenizer.model``
(for SentencePiece users and llama.cpp's converter; SentencePiece itself does not apply bnlit's
normalisation: call :func:`normalize` first). A bnlit document starts after an end-of-document
token, never ``<s>`` (untrained), so the export names ``</s>`` as both BOS and EOS (as GPT-2 does
with ``<|endoftext|>``): tools that start a sequence with the BOS, such as lm-evaluation-harness's
rolling log-likelihood and ``generate`` without a prompt, give the model the context it trained on.
The tokenizer adds no special token when it encodes. It is written to a temporary sibling
directory and renamed into place, so an interrupted export leaves no half-written model behind.

**GGUF.** :func:`export_gguf` writes the same tensors, renamed from the Hugging Face names by the
``gguf`` package's own table, with the metadata and the Q/K row order llama.cpp's
``convert_hf_to_gguf.py`` gives a ``LlamaForCausalLM`` (llama.cpp rotates interleaved pairs, so
``wq``/``wk`` rows are permuted from the half-split layout), and the SentencePiece vocabulary as
llama.cpp's "llama" tokenizer: pieces, scores and token types. Two SentencePiece behaviours are not
in llama.cpp's tokenizer and are handled here:

- bnlit's Bangla digits are SentencePiece *user-defined* pieces (never merged). llama.cpp splits
  user-defined tokens out of the text before tokenizing and then puts a space prefix on the text
  after each one (``২০২৪ সাল`` would lose its leading ``▁`` and gain one before ``সাল``).
  They are written as normal pieces, as ``convert_hf_to_gguf.py`` does; since no other piece
  contains them (checked at export), llama.cpp's merges never join them either.
- SentencePiece strips and collapses runs of spaces (``remove_extra_whitespaces``); llama.cpp
  does not. :func:`gguf_text` is the pre-call: bnlit's normalisation and that whitespace rule.
  With it llama.cpp's ids equal :meth:`Tokenizer.encode`'s (``tests/test_gguf.py``).

llama.cpp applies no normalisation either, and raw text often spells a piece otherwise (most
keyboards type the precomposed য় ড় ঢ় that bnlit decomposes). The file therefore carries, after the
model's rows, a token for each other spelling of a piece, with the piece's embedding and output
rows (:mod:`bnlit.raw_spellings`, ``raw_spellings=``): llama.cpp fed raw text reads bnlit's pieces,
at the cost of the doubled output mass measured in docs/export.md "Raw text in llama.cpp".
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from bnlit.alias_logits import DEFAULT_OFFSET, MAX_SPREAD, alias_rows, offset_direction
from bnlit.errors import CheckpointError
from bnlit.model import ModelConfig, Transformer
from bnlit.raw_spellings import DEFAULT_KINDS, RAW_SPELLINGS
from bnlit.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, normalize

log = logging.getLogger("bnlit")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # --type of scripts/export_gguf.py
# GGUF keys: the first raw-spelling token's id, and the piece each one spells (bnlit/raw_spellings.py)
ALIAS_START_KEY, ALIAS_OF_KEY = "bnlit.raw_spellings.start", "bnlit.raw_spellings.alias_of"
# nats between a raw-spelling token's logit and its piece's, and how far the direction that
# carries them spreads (bnlit.alias_logits)
ALIAS_OFFSET_KEY, ALIAS_SPREAD_KEY = "bnlit.raw_spellings.logit_offset", "bnlit.raw_spellings.offset_spread"
NORMALIZATION_NOTE = ("call bnlit.tokenizer.normalize(text) before encoding (NFC with decomposed nukta letters, "
                      "khanda-ta, joiners, invisible controls; bnlit/data/normalize.py)")
TOKENIZER_JSON_NOTE = ("tokenizer.json's normalizer applies bnlit.tokenizer.normalize (bnlit/hf_tokenizer.py): encode raw "
                       "text; tokenizer.model (SentencePiece) does not: call bnlit.tokenizer.normalize(text) first")

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
        "bos_token_id": EOS_ID,  # a document opens with eos (module docstring)
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
        "bnlit_model_config": cfg.to_dict(),
    }


def tokenizer_files(tokenizer: Tokenizer, max_len: int) -> dict[str, dict]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for ``tokenizer.json``, loaded as
    is by the generic fast tokenizer (transformers 4 and 5). bnlit prepends no BOS and appends no EOS
    when it encodes; the BOS is the ``eos`` piece that opens every document (module docstring)."""
    piece = tokenizer.sp.id_to_piece
    special = {"bos_token": piece(EOS_ID), "eos_token": piece(EOS_ID), "unk_token": piece(UNK_ID),
               "pad_token": piece(PAD_ID)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "right",
        "bnlit_normalization": TOKENIZER_JSON_NOTE,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special}


def check_export(model: Transformer, tokenizer: Tokenizer, out: Path, overwrite: bool, what: str) -> None:
    """Refuse, before any work, an existing ``out`` (unless ``overwrite``) and a tokenizer that is
    not the model's."""
    if out.exists() and not overwrite:
        raise CheckpointError(f"{what} {out} already exists; pass --overwrite or choose another --out")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                              f"{model.config.vocab_size}; they are not from the same run")


def export_hf(model: Transformer, tokenizer: Tokenizer, out_dir: str | os.PathLike,
              dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` in the Hugging Face Llama layout."""
    from bnlit import hf_tokenizer

    out_dir = Path(out_dir)
    check_export(model, tokenizer, out_dir, overwrite, "export directory")
    fast = hf_tokenizer.build(tokenizer)  # refused here, before anything is written
    hf_tokenizer.verify(fast, tokenizer)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        save_file(hf_state_dict(model, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config
        files = {
            "config.json": hf_config(cfg, dtype),
            "generation_config.json": {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
                                       "do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95,
                                       "max_length": cfg.max_seq_len},
            **tokenizer_files(tokenizer, cfg.max_seq_len),
        }
        for name, payload in files.items():
            (tmp / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
        fast.save(str(tmp / "tokenizer.json"))
        tokenizer.save(tmp / "tokenizer.model")
        umask_modes(tmp)
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


def umask_modes(directory: Path) -> None:
    """Give ``directory`` and its files the modes a plain ``mkdir``/``open`` would (0777/0666 less
    the umask): ``mkdtemp`` makes 0700 and safetensors writes 0600, which another user or a serving
    container could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for p in directory.iterdir():
        os.chmod(p, 0o666 & ~umask)
    os.chmod(directory, 0o777 & ~umask)


# -- GGUF (llama.cpp) ---------------------------------------------------------------------------

_SPACES = re.compile(" {2,}")


def gguf_text(text: str, remove_extra_whitespaces: bool = True) -> str:
    """What to give llama.cpp's tokenizer so that its ids equal :meth:`Tokenizer.encode`'s: bnlit's
    :func:`normalize`, then SentencePiece's ``remove_extra_whitespaces`` (spaces at the ends
    stripped, runs of spaces collapsed to one), which llama.cpp does not apply."""
    text = normalize(text)
    return _SPACES.sub(" ", text).strip(" ") if remove_extra_whitespaces else text


def llama_cpp_rope_order(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a ``wq``/``wk`` weight from the half-split RoPE layout (bnlit, Hugging Face) to the
    interleaved one llama.cpp's Llama graph rotates (``LlamaModel.permute`` of
    ``convert_hf_to_gguf.py``): within each head, row ``i`` of the first half and row ``i`` of the
    second become rows ``2i`` and ``2i + 1``."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int, raw_spellings: Sequence[str] = DEFAULT_KINDS,
               ) -> tuple[list[bytes], list[float], list[int], list[int]]:
    """Pieces, scores and llama.cpp token types (``gguf.TokenType``: normal, unknown, control,
    user-defined, unused, byte), padded to the model's ``vocab_size`` with unused ``[PAD<i>]``
    rows, then the pieces' raw spellings of the kinds ``raw_spellings`` (:mod:`bnlit.raw_spellings`:
    ``nukta``, precomposed nukta letters; ``vowel_signs``, ো ৌ typed in two parts) as normal tokens
    from id ``vocab_size`` on; the fourth list gives, for
    each of those, the id of the piece it spells. SentencePiece's user-defined pieces become
    normal ones (module docstring)."""
    import gguf

    from bnlit.hf_tokenizer import check_user_defined
    from bnlit.raw_spellings import alias_score, spelling_aliases

    proto = tokenizer.proto()
    check_user_defined(proto)
    tokens, scores, types = [], [], []
    for p in proto.pieces:
        tokens.append(p.piece.encode("utf-8"))
        scores.append(p.score)
        types.append(gguf.TokenType.NORMAL if p.type == p.USER_DEFINED else int(p.type))
    for i in range(vocab_size - len(tokens)):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    pieces = [p.piece for p in proto.pieces]
    normal = [p.type in (p.NORMAL, p.USER_DEFINED) for p in proto.pieces]
    top = max(p.score for p in proto.pieces) + 1.0
    aliases = spelling_aliases(pieces, normal, raw_spellings)
    for text, of in aliases:
        tokens.append(text.encode("utf-8"))
        scores.append(alias_score(pieces[of], proto.pieces[of].score, top))
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types, [of for _, of in aliases]


def gguf_tensors(model: Transformer, alias_of: Sequence[int] = (),
                 alias_output: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The float32 weights under llama.cpp's tensor names (``token_embd.weight``,
    ``blk.0.attn_q.weight`` ...), from the Hugging Face names of :func:`hf_state_dict`; a tied
    head is left out (llama.cpp then uses ``token_embd``). ``alias_of``: the spelled piece of
    each raw-spelling token (:func:`gguf_vocab`), whose embedding rows are appended as copies of
    that piece's, and whose output rows are ``alias_output`` (:func:`bnlit.alias_logits.alias_rows`;
    None: copies too). Output rows that differ from the embedding's give a tied head a file
    ``output.weight`` of its own."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.n_layer)
    weights = hf_state_dict(model, torch.float32)
    if alias_output is not None and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    out = {}
    for name, t in weights.items():
        if name.endswith("q_proj.weight"):
            t = llama_cpp_rope_order(t, cfg.n_head)
        elif name.endswith("k_proj.weight"):
            t = llama_cpp_rope_order(t, cfg.n_kv_heads)
        elif name == "lm_head.weight" and alias_output is not None:
            t = torch.cat([t, alias_output.to(t.dtype)])
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and len(alias_of):
            t = torch.cat([t, t[list(alias_of)]])
        new = names.get_name(name, try_suffixes=(".weight",))
        if new is None:
            raise KeyError(f"no GGUF name for {name!r}")
        out[new] = t
    return out


def export_gguf(model: Transformer, tokenizer: Tokenizer, out_path: str | os.PathLike, type: str = "f32",
                overwrite: bool = False, raw_spellings: Sequence[str] = DEFAULT_KINDS,
                alias_logit_offset: float = DEFAULT_OFFSET) -> Path:
    """Write ``model`` and ``tokenizer`` as one GGUF file for llama.cpp's ``llama`` architecture.

    ``type``: ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the matrices (norms stay float32; a
    matrix whose rows do not split into q8_0's 32-value blocks falls back to f16), as
    ``convert_hf_to_gguf.py --outtype`` does. ``raw_spellings``: the kinds of raw-spelling tokens
    to add (:func:`gguf_vocab`; ``()`` for none). ``alias_logit_offset``: nats between a
    raw-spelling token's logit and its piece's (:mod:`bnlit.alias_logits`; 0 shares the piece's
    output row). Written to a temporary sibling and renamed into place.
    """
    import gguf

    if type not in GGUF_TYPES:
        raise CheckpointError(f"--type {type!r}: use one of {', '.join(GGUF_TYPES)}")
    if unknown := sorted(set(raw_spellings) - set(RAW_SPELLINGS)):
        raise CheckpointError(f"--raw-spellings {','.join(unknown)}: use any of {','.join(RAW_SPELLINGS)} or none")
    if not (math.isfinite(alias_logit_offset) and alias_logit_offset <= 0):
        raise CheckpointError(f"--alias-logit-offset {alias_logit_offset}: use a number of nats <= 0 "
                              f"(0 shares the piece's output row; default {DEFAULT_OFFSET})")
    out_path = Path(out_path)
    check_export(model, tokenizer, out_path, overwrite, "GGUF file")
    Q = gguf.GGMLQuantizationType
    matrix_type, file_type = {
        "f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
        "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    }[type]
    cfg = model.config
    spec = tokenizer.proto().normalizer_spec
    tokens, scores, types, alias_of = gguf_vocab(tokenizer, cfg.vocab_size, raw_spellings)
    alias_output, spread = None, 0.0
    if alias_of and alias_logit_offset:
        direction, spread = offset_direction(model, tokenizer)
        if spread <= MAX_SPREAD:
            alias_output = alias_rows(model.output.weight.detach().cpu().float(), alias_of, direction,
                                      alias_logit_offset)
        else:  # an untrained model: its final states have no mean to speak of
            log.warning(f"warning: --alias-logit-offset {alias_logit_offset} not applied: the model's final hidden "
                        f"states have no near-constant direction to carry it (relative spread {spread:.2f} > "
                        f"{MAX_SPREAD}), so raw-spelling tokens share their pieces' output rows (offset 0)")

    w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_name(f"bnlit {cfg.name}")
    w.add_description("exported by bnlit (scripts/export_gguf.py); for bnlit's exact ids tokenize "
                      + NORMALIZATION_NOTE.removeprefix("call ") + ", then SentencePiece's whitespace rule "
                      "(bnlit.export.gguf_text); raw text is read through the raw-spelling tokens from id "
                      f"{cfg.vocab_size} on (bnlit.raw_spellings.alias_of), except characters bnlit removes")
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(len(tokens))
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ffn_hidden)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)  # bnlit's documents start after an eos, never a bos
    w.add_add_eos_token(False)
    w.add_add_space_prefix(spec.add_dummy_prefix)
    w.add_remove_extra_whitespaces(spec.remove_extra_whitespaces)
    w.add_string("bnlit.normalization", NORMALIZATION_NOTE)
    w.add_string("bnlit.model_config", json.dumps(cfg.to_dict()))
    w.add_string("bnlit.tokenizer_sha256", tokenizer.sha256)
    w.add_uint32(ALIAS_START_KEY, cfg.vocab_size)
    w.add_array(ALIAS_OF_KEY, alias_of)
    if alias_of:
        w.add_float32(ALIAS_OFFSET_KEY, alias_logit_offset if alias_output is not None else 0.0)
        w.add_float32(ALIAS_SPREAD_KEY, spread)
    for name, t in gguf_tensors(model, alias_of, alias_output).items():
        data = t.numpy()
        qtype = Q.F32 if data.ndim == 1 else matrix_type
        try:
            data = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:
            qtype = Q.F16
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)  # a quantized (uint8) array's shape is converted there

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
