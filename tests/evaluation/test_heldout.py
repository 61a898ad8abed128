"""bnlit.evaluation.heldout, bnlit.evaluation.multiple_choice and the RandomTwinNLL callback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from bnlit import CONF_DIR
from bnlit.evaluation.heldout import (EvalResult, NLLSum, documents_prefix, evaluate_documents, evaluate_stream, text_size,
                              token_stream, twin_model, twin_verdicts, uniform_nll, windows)
from bnlit.evaluation.multiple_choice import MultipleChoiceItem, continuation_logprob, encode_pair, load_items, score_items
from bnlit.model import ModelConfig, Transformer
from bnlit.run_report import read_metrics
from bnlit.train import train
from bnlit.callbacks.random_twin import RandomTwinNLL

FIXTURES = Path(__file__).parents[1] / "fixtures"
SMALL = ModelConfig(name="t", vocab_size=128, dim=32, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32,
                    max_seq_len=64, tie_embeddings=True)


class CharTokenizer:
    """One id per character (ids 4..127), eos 3: enough to test scoring without SentencePiece."""

    eos_id, vocab_size = 3, 128

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 124 for c in text]

    def encode_batch(self, texts, num_threads: int = 1):
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return "".join(chr(i - 4) for i in ids)


class Uniform(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the module a device

    def forward(self, idx, mask=None):
        return torch.zeros(*idx.shape, self.vocab_size) + 0 * self.anchor


class LogitsOnly(nn.Module):
    """``model`` seen as any logits model (not a bnlit Transformer): :func:`evaluate_stream` scores
    it through its logits, token by token."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, mask=None):
        return self.model(idx, mask=mask)


def preset(name: str) -> ModelConfig:
    c = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{name}.yaml").model.config)
    return ModelConfig(**{k: v for k, v in c.items() if k != "_target_"})


# ---- pure evaluation ----------------------------------------------------------------------
@pytest.mark.parametrize("lengths,seq", [([1], 4), ([3, 0, 2], 4), ([9], 4), ([2, 7, 1, 1, 15, 3], 4),
                                         ([5, 5, 5], 7), ([30, 2, 40], 7), ([], 4)])
def test_windows_score_every_target_once_and_cut_only_long_documents(lengths, seq):
    stream = token_stream([[5] * n for n in lengths], 3)
    spans = windows(stream, 3, seq)
    scored = [t for s, n, k in spans for t in range(s + 1 + k, s + n + 1)]
    assert scored == sorted(scored) and scored == list(range(1, len(stream)))
    assert all(0 < n <= seq and 0 <= k < n for _, n, k in spans)
    starts = np.flatnonzero(stream[:-1] == 3)
    for a, b in zip(starts, list(starts[1:]) + [len(stream) - 1]):
        inside = [(s, n) for s, n, _ in spans if s <= a < s + n]
        if b - a <= seq:  # a document that fits is never cut
            assert len(inside) == 1 and inside[0][0] + inside[0][1] >= b
    # a long document: lm-eval's rolling windows (the last one with the longest context)
    assert windows(token_stream([[5] * 9], 3), 3, 4) == [(0, 4, 0), (4, 4, 0), (6, 4, 2)]
    assert windows(np.array([7, 7, 7, 7, 7]), 3, 2) == [(0, 2, 0), (2, 2, 0)]  # no eos: one document


def test_evaluate_stream_matches_a_plain_loop_and_splits_over_ranks():
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    stream = np.random.default_rng(0).integers(4, SMALL.vocab_size, size=3 * 16 + 6)  # one document, 53 targets
    nll, tokens = evaluate_stream(model, stream, seq_len=16, batch_size=2, eos_id=3, document_masking=True)
    ref = 0.0
    with torch.no_grad():  # reference: lm-eval's rolling windows, the last reading 16 tokens of context
        for s, n, k in [(0, 16, 0), (16, 16, 0), (32, 16, 0), (37, 16, 11)]:
            x = torch.as_tensor(stream[s:s + n + 1])
            ref += F.cross_entropy(model(x[None, :-1])[0, k:], x[1 + k:], reduction="sum").item()
    assert tokens == len(stream) - 1
    assert nll == pytest.approx(ref, rel=1e-5)
    metric = NLLSum()  # ranks 0 and 1 of a world of 2, summed as an all-reduce would
    parts = [evaluate_stream(model, stream, 16, 2, rank=r, world_size=2, metric=NLLSum(), eos_id=3,
                             document_masking=True) for r in (0, 1)]
    assert sum(p[1] for p in parts) == tokens
    assert sum(p[0] for p in parts) == pytest.approx(nll, rel=1e-6)
    evaluate_stream(model, stream[:20], 16, metric=metric, eos_id=3, document_masking=True)
    evaluate_stream(model, stream[20:], 16, metric=metric, eos_id=3, document_masking=False)
    assert int(metric.compute()[1]) == len(stream) - 2  # running sums across calls


def test_evaluate_stream_makes_the_same_number_of_forward_calls_on_every_rank():
    """Under FSDP a forward gathers the shards (a collective): a rank that stops calling the model
    before the others hangs them. 5 windows over 2 ranks with batches of 2: rank 0 has 3, rank 1
    has 2; both must call the model twice (rank 1 scores a spare window and drops it)."""
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    stream = token_stream([[5] * 14] * 5, 3)  # five documents of 15 targets, one window each
    assert len(windows(stream, 3, 16)) == 5
    per_rank = []
    for r in (0, 1):
        calls.clear()
        per_rank.append((evaluate_stream(model, stream, 16, 2, rank=r, world_size=2, metric=NLLSum(), eos_id=3,
                                         document_masking=True), list(calls)))
    assert [len(c) for _, c in per_rank] == [2, 2]
    assert per_rank[0][0][1] + per_rank[1][0][1] == len(stream) - 1  # the spare call scored nothing


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("seq_len,batch_size", [(16, 1), (16, 3), (30, 2)])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_transformer_is_scored_through_its_loss_as_through_its_logits(masked, seq_len, batch_size, autocast):
    """A bnlit Transformer is scored through its own loss (the unscored targets ignored), the
    graph validation compiles; the totals are those of its logits scored token by token: packed
    documents, a document longer than a window (rolling windows, context not scored), a short last
    batch, with and without the mask, in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    rng = np.random.default_rng(2)
    stream = token_stream([rng.integers(4, SMALL.vocab_size, size=n).tolist() for n in (11, 40, 7, 3, 17)], 3)
    assert any(k for _, _, k in windows(stream, 3, seq_len)), "a window with context that is not scored"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        own = evaluate_stream(model, stream, seq_len, batch_size, eos_id=3, document_masking=masked)
        ref = evaluate_stream(LogitsOnly(model), stream, seq_len, batch_size, eos_id=3, document_masking=masked)
    assert own[1] == ref[1] == len(stream) - 1
    assert own[0] == pytest.approx(ref[0], rel=1e-5)


class TokenNLL(NLLSum):
    """:class:`NLLSum` that also keeps every token's NLL, in scoring order."""

    def __init__(self):
        super().__init__()
        self.per_token: list[float] = []

    def update(self, token_nll):
        super().update(token_nll)
        self.per_token += token_nll.flatten().tolist()


def test_a_document_scores_the_same_alone_or_packed_after_others():
    """The document mask in evaluation (issue 25): each document's per-token NLL is the same, to
    float tolerance, whether its ``[eos] doc [eos]`` is scored alone or packed after (and before)
    other documents in one window, because attention stops at every eos as in training. Without
    the mask (``eos_id=None``) the packed scores change: the check can fail."""
    torch.manual_seed(0)
    model = LogitsOnly(Transformer(SMALL).eval())  # every token's NLL (a Transformer is scored by sums)
    rng = np.random.default_rng(1)
    docs = [rng.integers(4, SMALL.vocab_size, size=n).tolist() for n in (11, 23, 7, 17)]
    alone = []
    for d in docs:
        metric = TokenNLL()
        evaluate_stream(model, token_stream([d], 3), seq_len=64, metric=metric, eos_id=3, document_masking=True)
        alone.append(metric.per_token)
    packed, causal = TokenNLL(), TokenNLL()
    stream = token_stream(docs, 3)
    assert len(stream) - 1 <= 64, "one window holds every document"
    evaluate_stream(model, stream, seq_len=64, metric=packed, eos_id=3, document_masking=True)
    evaluate_stream(model, stream, seq_len=64, metric=causal, eos_id=3, document_masking=False)
    torch.testing.assert_close(torch.tensor(packed.per_token), torch.tensor(sum(alone, [])), rtol=1e-5, atol=1e-5)
    several = TokenNLL()  # smaller windows: whole documents per window, none cut, the same scores
    evaluate_stream(model, stream, seq_len=30, metric=several, eos_id=3, document_masking=True, batch_size=1)
    assert len(windows(stream, 3, 30)) > 1
    # (longer windows are scored first: compare the scores in order of size)
    torch.testing.assert_close(torch.tensor(sorted(several.per_token)), torch.tensor(sorted(sum(alone, []))),
                               rtol=1e-5, atol=1e-5)
    first = len(docs[0]) + 1  # the first document has nothing before it: the same either way
    torch.testing.assert_close(torch.tensor(causal.per_token[:first]), torch.tensor(alone[0]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.tensor(causal.per_token[first:]), torch.tensor(sum(alone[1:], [])), atol=1e-3)


def test_scripts_and_callbacks_score_with_the_mask_the_model_trained_with(tmp_path):
    """evaluate_documents (scripts/evaluate.py's scoring) and score_slices (the random twin and the
    n-gram comparison) give a packed stream the sum of its documents scored one at a time."""
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    tok = CharTokenizer()
    docs = ["first document, short", "দ্বিতীয়টি একটু লম্বা", "third"]
    packed = evaluate_documents(model, tok, docs, seq_len=64)
    one_by_one = sum(evaluate_documents(model, tok, [d], seq_len=64).nll_sum for d in docs)
    assert packed.nll_sum == pytest.approx(one_by_one, rel=1e-5)
    assert evaluate_documents(model, tok, docs, seq_len=64, document_masking=False).nll_sum != \
        pytest.approx(one_by_one, rel=1e-4)
    from bnlit.evaluation.heldout import score_slices

    stream = token_stream(tok.encode_batch(docs), tok.eos_id)
    sliced = score_slices(model, {"x": (stream, 1, 1)}, 64, 2, eos_id=tok.eos_id, document_masking=True)["x"]
    assert sliced.nll_sum == pytest.approx(one_by_one, rel=1e-5)


def test_uniform_model_bits_per_char_is_log2_vocab_times_tokens_per_char():
    tok = CharTokenizer()
    docs = ["a short one.", "বাংলা লেখা, a mixed document", "x" * 150]
    r = evaluate_documents(Uniform(tok.vocab_size), tok, docs, seq_len=32)
    assert r.tokens == sum(len(d) + 1 for d in docs)  # every character and every eos, once
    assert r.chars == sum(len(d) for d in docs) and r.bytes == sum(len(d.encode()) for d in docs)
    # fp32 ln(V) per token, summed in fp64: equal to the closed form to float32 rounding
    assert r.nll_per_token == pytest.approx(math.log(tok.vocab_size), rel=1e-7)
    assert r.bits_per_char == pytest.approx(math.log2(tok.vocab_size) * r.tokens / r.chars, rel=1e-7)
    assert r.bits_per_byte == pytest.approx(math.log2(tok.vocab_size) * r.tokens / r.bytes, rel=1e-7)
    assert r.perplexity == pytest.approx(tok.vocab_size, rel=1e-6)


def test_token_stream_layout():
    assert token_stream([[5, 6], [7]], eos_id=3).tolist() == [3, 5, 6, 3, 7, 3]


def test_twin_is_seeded_privately_and_keeps_the_architecture():
    trained = Transformer(SMALL)
    cpu_state = torch.get_rng_state()
    a, b, c = twin_model(trained, seed=7), twin_model(SMALL, seed=7), twin_model(SMALL, seed=8)
    assert torch.equal(torch.get_rng_state(), cpu_state), "the twin drew from the global RNG"
    assert a.config == trained.config and not a.training
    assert a.output.weight is a.tok_embeddings.weight  # tying survives the meta-device build
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        assert p.ndim == 1 or not torch.equal(p, r), name
    wo = a.layers[0].attention.wo.weight
    assert wo.std().item() == pytest.approx(SMALL.init_std / math.sqrt(2 * SMALL.n_layer), rel=0.1)
    assert torch.equal(a.rope_cos, trained.rope_cos)


@pytest.mark.parametrize("name", ["tiny", "25m", "125m",
                                  pytest.param("400m", marks=pytest.mark.slow),
                                  pytest.param("1b", marks=pytest.mark.slow)])
def test_twin_nll_is_near_ln_vocab_for_every_preset(name):
    cfg = preset(name)
    twin = twin_model(cfg, seed=1234)
    stream = np.random.default_rng(0).integers(4, cfg.vocab_size, size=65)  # 64 predictions
    nll, tokens = evaluate_stream(twin, stream, seq_len=64, eos_id=3, document_masking=True)
    ratio = nll / tokens / uniform_nll(cfg.vocab_size)
    assert abs(ratio - 1) < 0.15, f"{name}: twin NLL is {ratio:.3f} x ln(V)"


def test_verdicts_flag_a_bad_init_and_a_run_that_does_not_learn():
    v = 1000
    ok = {"bn": {"twin": EvalResult(math.log(v) * 100, 100, 300, 900),
                 "trained": EvalResult(3.0 * 100, 100, 300, 900)}}
    assert twin_verdicts(ok, v, step=500, init_tolerance=0.15, learning_after_steps=100) == []
    hot = {"bn": {"twin": EvalResult(12.6 * 100, 100, 300, 900), "trained": ok["bn"]["trained"]}}
    (msg,) = twin_verdicts(hot, v, step=500, init_tolerance=0.15, learning_after_steps=100)
    assert "init" in msg and "1.82x" in msg
    stuck = {"bn": {"twin": ok["bn"]["twin"], "trained": EvalResult(7.0 * 100, 100, 300, 900)}}
    assert twin_verdicts(stuck, v, step=50, init_tolerance=0.15, learning_after_steps=100) == []
    (msg,) = twin_verdicts(stuck, v, step=100, init_tolerance=0.15, learning_after_steps=100)
    assert "not learning" in msg


def test_documents_prefix_cuts_at_a_document_boundary():
    toks = np.array([5, 6, 3, 7, 8, 9, 3, 4, 3])
    assert documents_prefix(toks, 3, None)[1] is True
    assert documents_prefix(toks, 3, 6)[0].tolist() == [5, 6, 3]
    assert documents_prefix(toks, 3, 7)[0].tolist() == [5, 6, 3, 7, 8, 9, 3]
    assert documents_prefix(toks, 3, 1)[0].tolist() == [5]
    assert text_size(np.array([4 + ord("a"), 4 + ord("b"), 3, 4 + ord("c")]), CharTokenizer(), 3) == (3, 3)


# ---- the callback in a real fit ---------------------------------------------------------------
class Recorder(L.Callback):
    """Every training batch and loss, and the mode the model is in when each batch starts."""

    def __init__(self):
        self.batches, self.losses, self.modes = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])
        self.modes.append(pl_module.training and pl_module.model.training)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def _fit_recording(make_cfg, tmp_path, monkeypatch, name, *overrides):
    from bnlit import train as train_mod

    rec = Recorder()
    real = train_mod.instantiate_group

    def with_recorder(group, *a, **k):  # the configured callbacks plus the recorder
        out = real(group, *a, **k)
        return out + [rec] if group is not None and "model_checkpoint" in group else out

    with monkeypatch.context() as m:
        m.setattr(train_mod, "instantiate_group", with_recorder)
        metrics = train(make_cfg(*overrides, run_dir=tmp_path / name))
    return rec, metrics


def test_callback_leaves_training_bit_identical_and_trained_beats_twin(make_cfg, tmp_path, monkeypatch):
    steps = ["trainer.max_steps=12", "trainer.val_check_interval=4", "callbacks.random_twin.max_tokens=600",
             "++callbacks.random_twin.learning_after_steps=8"]
    with_twin, metrics = _fit_recording(make_cfg, tmp_path, monkeypatch, "with", *steps)
    without, plain = _fit_recording(make_cfg, tmp_path, monkeypatch, "without", *steps, "~callbacks.random_twin")
    assert len(with_twin.batches) == len(without.batches) == 12
    for i, (a, b) in enumerate(zip(with_twin.batches, without.batches)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"batch {i} differs"
    for i, (a, b) in enumerate(zip(with_twin.losses, without.losses)):
        assert torch.equal(a, b), f"loss {i}: {a.item()} vs {b.item()}"
    assert all(with_twin.modes), "a training batch started with the model in eval mode"
    assert not any(k.startswith("twin/") for k in plain)

    ln_v = math.log(1024)
    for lang in ("bn", "en"):
        assert abs(metrics[f"twin/{lang}_nll"] / ln_v - 1) < 0.15
        assert metrics[f"twin/{lang}_nll_over_ln_vocab"] == pytest.approx(metrics[f"twin/{lang}_nll"] / ln_v)
        assert metrics[f"twin/{lang}_trained_nll"] < metrics[f"twin/{lang}_nll"]
        assert metrics[f"twin/{lang}_nll_gap"] > 0
        assert metrics[f"twin/{lang}_trained_bits_per_char"] < metrics[f"twin/{lang}_bits_per_char"]
    table = json.loads((tmp_path / "with" / "tables" / "twin_table.json").read_text())
    assert [r[0] for r in table["rows"]] == ["bn", "en"] and table["step"] == 12
    assert table["rows"][0][3] == pytest.approx(metrics["twin/bn_trained_nll"])
    csv = (next((tmp_path / "with").rglob("metrics.csv"))).read_text().splitlines()
    assert "twin/bn_nll_gap" in csv[0]
    # one step convention (optimizer steps completed): validation, twin and baselines after 4
    # steps are all at step 4 in the CSV, so plots and summary.md line them up
    series = read_metrics(next((tmp_path / "with").rglob("metrics.csv")))
    steps = lambda key: [s for s, _ in series[key]]  # noqa: E731
    assert steps("val/loss") == steps("val/bn_loss") == [0, 4, 8, 12]
    assert steps("twin/bn_trained_bits_per_char") == steps("learned_context/bn") == [4, 8, 12]
    assert "step" not in metrics


# ---- multiple choice ----------------------------------------------------------------------
def test_load_items_reads_the_fixture_and_rejects_a_bad_line(tmp_path):
    from bnlit.errors import DataError

    items = load_items(FIXTURES / "multiple_choice_small.jsonl")
    assert len(items) == 24 and all(0 <= it.label < len(it.choices) for it in items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "choices": ["b"], "label": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        load_items(bad)


def test_score_is_the_length_normalised_continuation_loglik():
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    ctx, cont = encode_pair(tok, "The cat ", "sat.")
    assert tok.decode(ctx) == "The cat" and tok.decode(cont) == " sat."  # trailing space moves
    ctx, cont = encode_pair(tok, "Question:\n", "yes")  # any trailing whitespace, as lm-eval moves it
    assert tok.decode(ctx) == "Question:" and tok.decode(cont) == "\nyes"
    ids = [tok.eos_id] + ctx + cont
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor(ids[:-1])[None])[0], -1)
    ref = sum(logp[len(ctx) + i, t].item() for i, t in enumerate(cont))
    assert continuation_logprob(model, ctx, cont, tok.eos_id, max_len=64) == pytest.approx(ref, rel=1e-5)
    item = MultipleChoiceItem("The cat ", ["sat.", "ran off to the garden.", "a"], 0)
    lls = [continuation_logprob(model, *encode_pair(tok, item.context, c), tok.eos_id, 64) for c in item.choices]
    norm = [ll / len(c) for ll, c in zip(lls, item.choices)]
    model.train()
    out = score_items(model, tok, [item], max_len=64)
    assert model.training, "score_items left the model in eval mode"
    assert out["predictions"] == [int(np.argmax(norm))]
    assert out["acc"] == float(np.argmax(lls) == 0) and out["acc_norm"] == float(np.argmax(norm) == 0)
    assert out["chance"] == pytest.approx(1 / 3) and out["n"] == 1


def _train_to_prefer(items, labels, steps=100):
    """A small model fitted to ``context + choices[label]`` of every item (one padded batch)."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(name="multiple_choice", vocab_size=128, dim=64, n_layer=2, n_head=4, multiple_of=32,
                                    max_seq_len=128, tie_embeddings=True))
    seqs = [torch.as_tensor(token_stream([tok.encode(it.context + it.choices[k])], tok.eos_id))
            for it, k in zip(items, labels)]
    width = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, tok


@pytest.mark.slow
def test_multiple_choice_scorer_picks_the_planted_answer():
    items = load_items(FIXTURES / "multiple_choice_small.jsonl")[:8]
    planted = [(it.label + 1) % len(it.choices) for it in items]  # the wrong answer, on purpose
    model, tok = _train_to_prefer(items, planted)
    out = score_items(model, tok, items, max_len=128)
    assert out["predictions"] == planted
    assert out["acc_norm"] == 0.0 and out["chance"] == pytest.approx(1 / 3)
    relabelled = [MultipleChoiceItem(it.context, it.choices, k) for it, k in zip(items, planted)]
    assert score_items(model, tok, relabelled, max_len=128)["acc_norm"] == 1.0


def test_callback_rejects_bad_settings():
    from bnlit.errors import ConfigError

    with pytest.raises(ConfigError, match="max_tokens"):
        RandomTwinNLL(max_tokens=1)
    with pytest.raises(ConfigError, match="every_n_validations"):
        RandomTwinNLL(every_n_validations=-1)


def test_held_out_documents_are_the_runs_validation_split(tmp_path):
    from bnlit.data.report import REPORT_JSON, held_out_documents
    from bnlit.data.shards import is_validation
    from bnlit.errors import DataError

    clean = tmp_path / "clean"  # a finished cleaning: each task's documents and stats.json naming them
    (clean / "docs").mkdir(parents=True)
    docs = {name: [f"{name} দলিল {i}" for i in range(40)] for name in ("bn_a", "bn_b", "en_a")}
    for rank, texts in enumerate(docs.values()):
        (clean / "docs" / f"{rank:05d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (clean / "stats.json").write_text(json.dumps({"pieces": {name: [rank] for rank, name in enumerate(docs)}}))
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(DataError, match="no data report"):
        held_out_documents(run, "bn")
    sources = {"bn_a": {"language": "bn"}, "bn_b": {"language": "bn"}, "en_a": {"language": "en"}}
    (run / REPORT_JSON).write_text(json.dumps({"clean_dir": str(clean), "val_fraction": 0.3, "sources": sources}))
    got = held_out_documents(run, "bn")
    want = [t for name in ("bn_a", "bn_b") for t in docs[name] if is_validation(t, 0.3)]
    assert got == want and 0 < len(got) < 80
    with pytest.raises(DataError, match="--held-out ta: the run has no ta source"):
        held_out_documents(run, "ta")
