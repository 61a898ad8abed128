"""Hugging Face export parity, checkpoint loading, and the evaluate/generate/export CLIs."""

from __future__ import annotations

import importlib.util
import json
import math
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bnlit.checkpointing import load_model, read_checkpoint
from bnlit.errors import CheckpointError
from bnlit.export import export_hf, hf_name
from bnlit.generation import filter_logits, generate
from bnlit.model import ModelConfig, Transformer
from bnlit.tokenizer import Tokenizer, train_tokenizer
from bnlit.train import train

transformers = pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE = "To keep milk fresh, put it in the refrigerator. আমার সোনার বাংলা, আমি তোমায় ভালোবাসি ১২৩৪ 5678।"


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"bnlit_script_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    items = [json.loads(line) for line in (FIXTURES / "multiple_choice_small.jsonl").read_text().splitlines()]
    texts = [it["context"] + c for it in items for c in it["choices"]] * 3
    texts += ["আমি বাংলায় গান গাই। আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।", "১২৩৪৫৬৭৮৯০ ক খ গ ঘ ঙ য় ড় ঢ়"] * 20
    return Tokenizer(train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=512, num_threads=1))


def hf_logits(out_dir: Path, x: torch.Tensor) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


@pytest.mark.parametrize("tie,n_kv", [(True, 2), (False, 4), (False, 1)], ids=["tied-gqa", "untied-mha", "untied-mqa"])
def test_export_logits_match_llama_for_causal_lm(tokenizer, tmp_path, tie, n_kv):
    cfg = ModelConfig(name="t", vocab_size=512, dim=64, n_layer=2, n_head=4, n_kv_heads=n_kv, multiple_of=32,
                      max_seq_len=64, rope_theta=50000.0, tie_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm name would show
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    out = export_hf(model, tokenizer, tmp_path / "hf")
    x = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    got = hf_logits(out, x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    other = Transformer(cfg).eval()  # the comparison can fail: another init's logits differ
    with torch.no_grad():
        assert not torch.allclose(other(x), got, atol=1e-3)
    weights = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in weights) is not tie
    assert len(weights) == len({id(p) for p in model.parameters()})
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == n_kv and config["tie_word_embeddings"] is tie
    assert config["intermediate_size"] == cfg.ffn_hidden
    assert {"generation_config.json", "tokenizer.model", "tokenizer_config.json"} <= {f.name for f in out.iterdir()}


def test_exported_tokenizer_loads_in_transformers_and_agrees(tokenizer, tmp_path):
    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=32))
    out = export_hf(model, tokenizer, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = unicodedata.normalize("NFC", SAMPLE)
    assert hf_tok.encode(text) == tokenizer.encode(text)
    # a document opens with eos: the export's BOS is that token (bnlit/export.py)
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == tokenizer.eos_id
    assert hf_tok.decode(tokenizer.encode(text)) == text


def test_exported_tokenizer_needs_no_bnlit_call_on_raw_text(tokenizer, tmp_path):
    """The exported tokenizer.json normalises as bnlit does: raw text that NFC alone does not fix
    gets training's ids with no ``bnlit.tokenizer.normalize`` first (tests/test_hf_tokenizer.py
    covers every character)."""
    from test_tokenizer import TRICKY

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=32))
    out = export_hf(model, tokenizer, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in (TRICKY, SAMPLE, "বছর ২০২৪ সালে 2024"):
        assert hf_tok.encode(text) == tokenizer.encode(text), text
    assert tokenizer.sp.encode(unicodedata.normalize("NFC", TRICKY)) != tokenizer.encode(TRICKY)  # NFC alone is not enough
    assert "tokenizer.json" in json.loads((out / "tokenizer_config.json").read_text())["bnlit_normalization"]


def test_export_is_atomic_and_refuses_to_overwrite(tokenizer, tmp_path, monkeypatch):
    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=32))
    out = export_hf(model, tokenizer, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(model, tokenizer, out)

    def broken_save(self, path):
        raise OSError("disk full")

    monkeypatch.setattr(Tokenizer, "save", broken_save)
    with pytest.raises(OSError):
        export_hf(model, tokenizer, tmp_path / "fresh")
    with pytest.raises(OSError):
        export_hf(model, tokenizer, out, overwrite=True)
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "a temporary directory was left behind"
    assert (out / "model.safetensors").is_file()  # the old export survives a failed overwrite


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_modes_follow_the_umask(tokenizer, tmp_path, umask):
    """Not mkdtemp's 0700 and safetensors' 0600: with umask 022 another user (a serving container)
    can read the export; with 077 only its owner."""
    import os
    import stat

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=32))
    old = os.umask(umask)
    try:
        out = export_hf(model, tokenizer, tmp_path / "hf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        p.name: 0o666 & ~umask for p in out.iterdir()}
    assert "model.safetensors" in {p.name for p in out.iterdir()}


def test_every_parameter_has_a_hugging_face_name():
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layer=3, n_head=2, multiple_of=32, max_seq_len=16))
    names = {hf_name(n) for n in model.state_dict()}
    assert len(names) == len(model.state_dict())
    assert "model.layers.2.mlp.down_proj.weight" in names and "lm_head.weight" in names
    with pytest.raises(KeyError):
        hf_name("layers.0.attention.wx.weight")


# ---- sampling ---------------------------------------------------------------------------------
def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_p=0.85)).tolist() == [False, False, False, True]
    assert torch.isinf(filter_logits(logits, top_p=0.01)).tolist() == [False, True, True, True]
    assert not torch.isinf(filter_logits(logits)).any()


def test_generate_greedy_is_the_argmax_chain_and_sampling_is_seeded():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layer=2, n_head=2, multiple_of=32, max_seq_len=16))
    ids = [3, 10, 11]
    greedy = generate(model, ids, 20, temperature=0)
    ctx = list(ids)
    with torch.no_grad():
        for _ in range(20):
            ctx.append(int(model(torch.tensor(ctx[-16:])[None])[0, -1].argmax()))
    assert greedy == ctx[len(ids):]
    state = torch.get_rng_state()
    a, b = generate(model, ids, 20, 1.0, 10, 0.9, seed=5), generate(model, ids, 20, 1.0, 10, 0.9, seed=5)
    assert a == b and a != generate(model, ids, 20, 1.0, 10, 0.9, seed=6)
    assert torch.equal(state, torch.get_rng_state())


# ---- a real checkpoint through the CLIs --------------------------------------------------
def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.ckpt")
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match=r"foreign.ckpt is not a bnlit training checkpoint"):
        read_checkpoint(foreign)
    good = tmp_path / "good.ckpt"
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=16))
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "model_config": model.config.to_dict()}, good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"truncated.ckpt is truncated or corrupt") as e:
        read_checkpoint(truncated)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="carries no tokenizer"):
        load_model(good)


def test_clis_on_a_trained_checkpoint(make_cfg, tmp_path, capsys):
    cfg = make_cfg("callbacks.random_twin.max_tokens=400")
    train(cfg)
    capsys.readouterr()  # the run's own report
    ckpt = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    model, tok, raw = load_model(ckpt)
    assert raw["global_step"] == 4 and model.config.vocab_size == 1024 and not model.training

    bn, en = tmp_path / "bn.txt", tmp_path / "en.jsonl"
    bn.write_text("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।\n\nচিরদিন তোমার আকাশ, তোমার বাতাস।\n", encoding="utf-8")
    en.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog."}) + "\n")
    assert script("evaluate").main(["--checkpoint", str(ckpt), "--text", f"bn={bn}", "--text", f"en={en}",
                                    "--multiple-choice", str(FIXTURES / "multiple_choice_small.jsonl"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["vocab_size"] == 1024 and res["bn"]["documents"] == 2 and res["en"]["documents"] == 1
    docs = ["আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।", "চিরদিন তোমার আকাশ, তোমার বাতাস।"]
    assert res["bn"]["chars"] == sum(map(len, docs))
    assert res["bn"]["tokens"] == sum(len(tok.encode(d)) + 1 for d in docs)
    for lang in ("bn", "en"):
        r = res[lang]
        assert r["bits_per_char"] == pytest.approx(r["nll_per_token"] * r["tokens"] / r["chars"] / math.log(2))
        # 4 steps are too few to beat the twin on two short documents (the twin test trains 12 steps)
        assert r["nll_gap"] == pytest.approx(r["twin_nll_per_token"] - r["nll_per_token"])
        assert abs(r["twin_nll_per_token"] / math.log(1024) - 1) < 0.15
    assert res["en"]["bits_per_byte"] == res["en"]["bits_per_char"]  # ASCII: one byte per character
    assert res["bn"]["bits_per_byte"] < res["bn"]["bits_per_char"] / 2.5  # Bangla: three bytes per letter
    assert res["multiple_choice"]["n"] == 24 and 0 <= res["multiple_choice"]["acc_norm"] <= 1 and res["multiple_choice"]["chance"] == pytest.approx(1 / 3)
    assert script("evaluate").main(["--checkpoint", str(ckpt), "--text", f"bn={bn}", "--no-twin"]) == 0
    text = capsys.readouterr().out
    assert "bits/char" in text and "twin" not in text.splitlines()[1]
    assert script("evaluate").main(["--checkpoint", str(tmp_path / "nope.ckpt"), "--text", f"bn={bn}"]) == 2
    assert "nope.ckpt does not exist" in capsys.readouterr().err

    out = tmp_path / "hf"
    assert script("export_hf").main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    x = torch.tensor([tok.encode("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।")])
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, x), model(x), rtol=1e-5, atol=1e-5)

    gen = script("generate")
    args = ["--checkpoint", str(ckpt), "--prompt", "আমার", "--max-new-tokens", "12", "--seed", "3"]
    assert gen.main(args) == 0 and gen.main(args) == 0
    first, second = capsys.readouterr().out.strip().splitlines()[-2:]
    assert first == second and first.startswith("আমার")


def test_sharded_checkpoint_reads_consolidates_and_refuses_incomplete(tokenizer, tmp_path, capsys):
    """A DCP directory laid out as Lightning's ModelParallelStrategy(save_distributed_checkpoint=True)
    writes it (written here by dcp.save in one process) loads like a full file, the one command
    turns it into a full .ckpt, and a directory missing either completion file is refused."""
    import torch.distributed.checkpoint as dcp

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layer=1, n_head=2, multiple_of=32, max_seq_len=16))
    sd = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    sharded = tmp_path / "last.ckpt"
    dcp.save({"state_dict": sd}, checkpoint_id=sharded)
    (tmp_path / "partial").mkdir()
    for f in sharded.iterdir():  # the shards without meta.pt: an interrupted save
        (tmp_path / "partial" / f.name).write_bytes(f.read_bytes())
    torch.save({"model_config": model.config.to_dict(), "global_step": 7,
                "BnDataModule": {"tokenizer_model": tokenizer.model_bytes}}, sharded / "meta.pt")
    ckpt = read_checkpoint(sharded)
    assert ckpt["global_step"] == 7
    for k, v in sd.items():
        torch.testing.assert_close(ckpt["state_dict"][k], v, rtol=0, atol=0)
    loaded, _, _ = load_model(sharded)  # what export_hf.py / export_gguf.py call
    assert loaded.state_dict().keys() == model.state_dict().keys()
    torch.testing.assert_close(loaded.state_dict()["tok_embeddings.weight"] if "tok_embeddings.weight" in sd else
                               next(iter(loaded.state_dict().values())), next(iter(model.state_dict().values())))
    with pytest.raises(CheckpointError, match=r"partial is a directory but not a complete sharded checkpoint \(no meta.pt"):
        read_checkpoint(tmp_path / "partial")
    full = tmp_path / "full.ckpt"
    assert script("consolidate_checkpoint").main([str(sharded), str(full)]) == 0
    again = read_checkpoint(full)
    assert again["global_step"] == 7 and again["state_dict"].keys() == sd.keys()
    assert script("consolidate_checkpoint").main([str(tmp_path / "partial"), str(tmp_path / "p.ckpt")]) == 2
    assert "not a complete sharded checkpoint" in capsys.readouterr().err
