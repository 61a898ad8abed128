"""GGUF export: the file's metadata and vocabulary (fast, ``gguf`` only), and the file run in a real
llama.cpp (``slow``, llama-cpp-python of the ``serve`` extra): tokenization, logits and greedy
generation against bnlit's own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bnlit.data.normalize import ZWJ, ZWNJ
from bnlit.errors import CheckpointError
from bnlit.export import export_gguf, gguf_tensors, gguf_text, llama_cpp_rope_order
from bnlit.generation import generate
from bnlit.model import ModelConfig, Transformer, apply_rope, rope_cache
from bnlit.tokenizer import EOS_ID, Tokenizer, train_tokenizer
from test_tokenizer import TRICKY

gguf = pytest.importorskip("gguf")

# NFC Bangla and English with the danda and double danda, ZWNJ (visible hasanta) and ZWJ (ya-phala
# after ra), Bangla and ASCII digits, a run of spaces, a newline and a character outside the
# vocabulary (byte fallback)
TEXTS = [
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। ধন ধান্য পুষ্প ভরা॥",
    f"ক্{ZWNJ}ষ আর ক্ষ এক নয়; র{ZWJ}্যাব আর র্যাব।",
    "২০২৪ সালে 2024 সালে ১২৩৪৫৬৭৮৯০ and 1234567890.",
    "To keep milk fresh,   put it in the refrigerator.\nThe   end ",
    "  leading spaces and a snowman ☃ and an emoji 😀",
    TRICKY,
]
PROMPT = "আমার সোনার বাংলা, আমি তোমায়"
# max |logit difference| / max |logit| allowed for each file type against bnlit's fp32 logits.
# f32 is float32 rounding; f16 and q8_0 are weight rounding (f16: 11-bit mantissa; q8_0: 8-bit
# integers with one scale per 32 values, up to half a step, 1/254 of a block's largest weight).
# Measured on the trained tiny models below: f32 4e-7, f16 6e-4, bf16 2.4-3.5e-3, q8_0 0.9-1.1e-2
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2, "q8_0": 2e-2}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    texts = ["আমি বাংলায় গান গাই। আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।", "২০২৪ সালে ১২৩৪৫৬৭৮৯০ ক খ গ ঘ ঙ য় ড় ঢ়",
             "To keep milk fresh, put it in the refrigerator. The year 2024 was long.",
             "ধন ধান্য পুষ্প ভরা আমাদের এই বসুন্ধরা॥ তাহার মাঝে আছে দেশ এক সকল দেশের সেরা।"] * 30
    return Tokenizer(train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=512, num_threads=1))


def tiny(tie: bool = False, n_kv: int = 2, vocab: int = 544) -> ModelConfig:
    # vocab above the tokenizer's 512: the GGUF pads the vocabulary with unused rows
    return ModelConfig(name="t", vocab_size=vocab, dim=64, n_layer=2, n_head=4, n_kv_heads=n_kv, multiple_of=32,
                       max_seq_len=64, rope_theta=50000.0, tie_embeddings=tie)


def trained(cfg: ModelConfig, tokenizer: Tokenizer, steps: int = 50) -> Transformer:
    """A few AdamW steps on the fixture's text, so the logits are far from uniform and greedy
    generation is not a chain of near-ties."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine under load: two threads are 5-20x slower here
    stream = torch.tensor(sum((tokenizer.encode(t) + [EOS_ID] for t in TEXTS * 4), []))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = (len(stream) - 1) // cfg.max_seq_len * cfg.max_seq_len
    x, y = stream[:n].view(-1, cfg.max_seq_len), stream[1:n + 1].view(-1, cfg.max_seq_len)
    try:
        for _ in range(steps):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():  # non-trivial norms, so a swapped norm tensor would show
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def test_rope_order_turns_half_split_rope_into_interleaved_rope():
    """llama.cpp rotates pairs (2i, 2i+1); bnlit rotates (i, i + hd/2). The permuted projection
    under interleaved RoPE gives the permuted rotated query: the same attention scores."""
    n_head, hd, dim, T = 3, 8, 16, 5
    torch.manual_seed(0)
    w = torch.randn(n_head * hd, dim)
    x = torch.randn(T, dim)
    cos, sin = rope_cache(T, hd, 10000.0)
    q = (x @ w.T).view(T, n_head, hd).transpose(0, 1)  # (H, T, hd)
    ref = apply_rope(q, cos, sin)
    qi = (x @ llama_cpp_rope_order(w, n_head).T).view(T, n_head, hd).transpose(0, 1)
    c, s = cos[:, : hd // 2], sin[:, : hd // 2]
    even, odd = qi[..., 0::2], qi[..., 1::2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)  # interleaved RoPE
    perm = llama_cpp_rope_order(torch.arange(n_head * hd).view(-1, 1), n_head).view(n_head, hd) % hd
    torch.testing.assert_close(rotated, ref[..., perm[0]])
    torch.testing.assert_close(rotated @ rotated.transpose(-1, -2), ref @ ref.transpose(-1, -2))


def test_gguf_file_carries_architecture_vocabulary_and_notes(tokenizer, tmp_path):
    cfg = tiny(tie=True)
    model = Transformer(cfg)
    out = export_gguf(model, tokenizer, tmp_path / "m.gguf")
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "llama" and f["general.file_type"] == 0
    assert (f["llama.block_count"], f["llama.embedding_length"], f["llama.feed_forward_length"]) == (2, 64, cfg.ffn_hidden)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"], f["llama.context_length"]) == (4, 2, 64)
    assert f["llama.rope.freq_base"] == 50000.0 and f["llama.rope.dimension_count"] == 16
    assert math.isclose(f["llama.attention.layer_norm_rms_epsilon"], cfg.norm_eps, rel_tol=1e-6)
    assert f["tokenizer.ggml.model"] == "llama" and len(f["tokenizer.ggml.tokens"]) == cfg.vocab_size == 544
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    sp = tokenizer.sp
    assert tokens[:512] == [sp.id_to_piece(i) for i in range(512)] and tokens[512:] == [f"[PAD{i}]" for i in range(32)]
    T = gguf.TokenType
    assert types[0] == types[2] == types[3] == T.CONTROL and types[1] == T.UNKNOWN
    assert [types[i] for i in range(512) if sp.is_byte(i)] == [T.BYTE] * 256
    assert types[sp.piece_to_id("২")] == T.NORMAL  # user-defined in SentencePiece: see bnlit/export.py
    assert set(types[512:]) == {T.UNUSED}
    assert f["tokenizer.ggml.scores"][:512] == pytest.approx([sp.get_score(i) for i in range(512)])
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (2, 3)
    assert f["tokenizer.ggml.add_bos_token"] is False and f["tokenizer.ggml.add_space_prefix"] is True
    assert "bnlit.tokenizer.normalize" in f["bnlit.normalization"]
    assert json.loads(f["bnlit.model_config"]) == cfg.to_dict()
    names = {t.name for t in r.tensors}
    assert "output.weight" not in names and "token_embd.weight" in names  # tied: llama.cpp reuses token_embd
    assert len(names) == len({id(p) for p in model.parameters()})


def test_q8_0_quantizes_matrices_and_keeps_norms_f32(tokenizer, tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny())
    r = gguf.GGUFReader(export_gguf(model, tokenizer, tmp_path / "q.gguf", type="q8_0"))
    kinds = {t.name: t.tensor_type.name for t in r.tensors}
    assert kinds["blk.0.attn_q.weight"] == kinds["output.weight"] == kinds["token_embd.weight"] == "Q8_0"
    assert kinds["blk.1.ffn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    got = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q8_0)
    want = gguf_tensors(model)["blk.0.ffn_down.weight"].numpy()
    # a step d is 1/127 of a block's largest weight: rounding costs up to d/2, and d stored in f16
    # (11-bit mantissa) up to 127 * d * 2^-11 more
    assert np.abs(got - want).max() <= np.abs(want).max() / 127 * (0.5 + 127 / 2**11)
    assert np.abs(got - want).max() > 0  # it was quantized


def test_gguf_export_is_atomic_and_refuses_bad_input(tokenizer, tmp_path, monkeypatch):
    model = Transformer(tiny())
    out = export_gguf(model, tokenizer, tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match="already exists"):
        export_gguf(model, tokenizer, out)
    with pytest.raises(CheckpointError, match="--type 'q4'"):
        export_gguf(model, tokenizer, tmp_path / "x.gguf", type="q4")
    with pytest.raises(CheckpointError, match="not from the same run"):
        export_gguf(Transformer(tiny(vocab=300)), tokenizer, tmp_path / "x.gguf")

    def disk_full(self):
        raise OSError("disk full")

    before = out.read_bytes()
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", lambda self, **kw: disk_full(self))
    with pytest.raises(OSError, match="disk full"):
        export_gguf(Transformer(tiny(tie=True)), tokenizer, out, overwrite=True)
    assert out.read_bytes() == before, "a failed overwrite must keep the old file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"], "a temporary file was left behind"


def test_gguf_text_is_normalize_plus_sentencepiece_whitespace(tokenizer):
    assert gguf_text("  a   b  ") == "a b"
    assert gguf_text("\u09df  x\n  y") == "য\u09bc x\n y"  # newlines are not SentencePiece whitespace
    for text in TEXTS:
        assert tokenizer.sp.encode(gguf_text(text)) == tokenizer.encode(text)


# -- in llama.cpp -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python, or a skip (a failure under CI=true, where ``.ci/run`` installs the serve extra)."""
    try:
        import llama_cpp
    except ImportError:
        pytest.skip('llama-cpp-python is not installed: pip install -e ".[serve]"')
    return llama_cpp


@pytest.mark.slow
def test_llama_cpp_tokenizes_like_bnlit(tokenizer, tmp_path, llama_cpp):
    from bnlit.serving import LlamaCppLM

    out = export_gguf(Transformer(tiny()), tokenizer, tmp_path / "m.gguf")
    with LlamaCppLM(out) as lm:
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert lm.encode(text) == ids, text
            assert lm.decode(ids) == tokenizer.decode(ids)
        assert any(tokenizer.is_byte(i) for i in tokenizer.encode(TEXTS[4]))  # byte fallback was exercised
        # the pre-call is needed: llama.cpp does not strip or collapse spaces as SentencePiece does
        raw = lm.llm.tokenize(TEXTS[3].encode(), add_bos=False, special=False)
        assert raw != tokenizer.encode(TEXTS[3])


@pytest.mark.slow
@pytest.mark.parametrize("tie,n_kv", [(False, 2), (True, 4), (False, 1)], ids=["untied-gqa", "tied-mha", "untied-mqa"])
def test_llama_cpp_logits_and_greedy_generation_match_bnlit(tokenizer, tmp_path, llama_cpp, tie, n_kv):
    from bnlit.serving import LlamaCppLM

    cfg = tiny(tie=tie, n_kv=n_kv)
    model = trained(cfg, tokenizer)
    ids = tokenizer.encode(PROMPT)
    x = torch.tensor([ids + tokenizer.encode(" To keep milk fresh")])
    with torch.no_grad():
        ref = model(x)[0]
    scale = ref.abs().max().item()
    other = Transformer(cfg).eval()  # the comparison can fail: another init's logits differ
    with torch.no_grad():
        assert (other(x)[0] - ref).abs().max().item() / scale > 10 * TOLERANCE["q8_0"]
    for kind in (("f32", "f16", "bf16", "q8_0") if not tie else ("f32",)):
        with LlamaCppLM(export_gguf(model, tokenizer, tmp_path / f"{kind}.gguf", type=kind)) as lm:
            got = lm(x)[0]
            rel = (got - ref).abs().max().item() / scale
            print(f"{cfg.n_kv_heads=} tie={tie} {kind}: max |logit diff| / max |logit| = {rel:.2e}")
            assert rel <= TOLERANCE[kind], kind
            if kind == "f32":
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale)
                want = generate(model, ids, 16, temperature=0.0)
                assert lm.generate_greedy(ids, 16) == want
                assert len(set(want)) > 1, "a degenerate continuation would not test much"


@pytest.mark.slow
def test_a_runs_checkpoint_exports_and_scores_the_same_in_llama_cpp(make_cfg, tmp_path, capsys, llama_cpp):
    """The real pipeline (tokenizer trained on the embedded corpus, a few steps of the tiny
    preset): the CLI's GGUF tokenizes the run's held-out text as bnlit does, generates the same
    greedy tokens (f32), and ``evaluate.py --gguf`` scores f32 like the checkpoint and q8_0 within 1%."""
    from test_export import script

    from bnlit.checkpointing import load_model
    from bnlit.serving import LlamaCppLM
    from bnlit.train import train

    cfg = make_cfg("callbacks.random_twin.max_tokens=400")
    train(cfg)
    ckpt = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    model, tok, _ = load_model(ckpt)
    files = {kind: tmp_path / f"run.{kind}.gguf" for kind in ("f32", "q8_0")}
    for kind, out in files.items():
        assert script("export_gguf").main(["--checkpoint", str(ckpt), "--out", str(out), "--type", kind]) == 0
    capsys.readouterr()
    with LlamaCppLM(files["f32"]) as lm:
        ids = tok.encode(PROMPT)
        assert lm.generate_greedy(ids, 16) == generate(model, ids, 16, temperature=0.0)
    assert script("export_gguf").main(["--checkpoint", str(ckpt), "--out", str(files["f32"])]) == 2
    assert "already exists" in capsys.readouterr().err

    args = ["--checkpoint", str(ckpt), "--held-out", "bn", "--no-twin", "--no-contamination", "--json"]
    assert script("evaluate").main([*args, "--gguf", str(files["f32"]), "--gguf", str(files["q8_0"])]) == 0
    bn = json.loads(capsys.readouterr().out)["bn"]
    assert bn["documents"] > 0 and bn["tokens"] > 1000
    f32, q8 = bn["gguf"][str(files["f32"])], bn["gguf"][str(files["q8_0"])]
    assert f32["same_tokens"] and q8["same_tokens"] and f32["type"] == "f32" and q8["type"] == "q8_0"
    assert abs(f32["bits_per_char_vs_trained"]) < 1e-5
    assert abs(q8["bits_per_char_vs_trained"]) < 0.01
    assert script("evaluate").main([*args, "--gguf", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf: no such file" in capsys.readouterr().err
