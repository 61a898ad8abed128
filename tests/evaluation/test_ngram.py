"""N-gram baselines (bnlit/evaluation/ngram.py) against a hand-computed example."""

import math

import numpy as np
import pytest

from bnlit.evaluation.ngram import NgramCounts, discount, load_baselines, save_baselines, training_streams

# V = 5, eos = 0: two documents "1 2" and "1 3", and token 4 never seen
STREAM = np.array([0, 1, 2, 0, 1, 3, 0])
V = 5


def test_counts_by_hand():
    c = NgramCounts.from_stream(STREAM, V)
    # targets 1 2 0 1 3 0
    assert c.unigram.tolist() == [2, 2, 1, 1, 0]
    assert c.tokens == 6
    pairs = {(int(k) // V, int(k) % V): int(n) for k, n in zip(c.bigram_keys, c.bigram_counts)}
    assert pairs == {(0, 1): 2, (1, 2): 1, (2, 0): 1, (1, 3): 1, (3, 0): 1}


def test_unigram_add_one_by_hand():
    c = NgramCounts.from_stream(STREAM, V)
    np.testing.assert_allclose(np.exp(c.unigram_logprob()), np.array([3, 3, 2, 2, 1]) / 11)


def test_kneser_ney_by_hand():
    c = NgramCounts.from_stream(STREAM, V)
    # bigram types: 4 singletons, 1 doubleton -> D = 4 / (4 + 2) = 2/3
    assert discount(c.bigram_counts) == pytest.approx(2 / 3)
    # N1+(. w) = [2, 1, 1, 1, 0] over 5 types; D1 = 3 / (3 + 2) = 3/5; uniform share 3/5 * 4/5 / 5
    u = 0.6 * 4 / 5 / 5
    p_cont = np.array([1.4 / 5 + u, 0.4 / 5 + u, 0.4 / 5 + u, 0.4 / 5 + u, u])
    np.testing.assert_allclose(c.continuation(), p_cont)
    assert p_cont.sum() == pytest.approx(1.0)
    d = 2 / 3
    expected = {
        (0, 1): (2 - d) / 2 + d * 1 / 2 * p_cont[1],  # c(0)=2, one distinct follower
        (1, 2): (1 - d) / 2 + d * 2 / 2 * p_cont[2],  # c(1)=2, two distinct followers
        (1, 0): d * 2 / 2 * p_cont[0],                # unseen pair, seen context
        (2, 4): d * 1 / 1 * p_cont[4],                # unseen pair, never-seen token
        (4, 4): p_cont[4],                            # unseen context: the lower order
    }
    prev, nxt = zip(*expected)
    np.testing.assert_allclose(np.exp(c.bigram_logprob(np.array(prev), np.array(nxt))), list(expected.values()))
    # every context is a distribution over the vocabulary
    for v in range(V):
        total = np.exp(c.bigram_logprob(np.full(V, v), np.arange(V))).sum()
        assert total == pytest.approx(1.0)


def test_scoring_a_stream_like_the_model():
    c = NgramCounts.from_stream(STREAM, V)
    held_out = np.array([0, 1, 2, 4])  # targets 1, 2, 4 given 0, 1, 2
    nll, n = c.nll(held_out, "bigram")
    assert n == 3
    lp = c.bigram_logprob(held_out[:-1], held_out[1:])
    assert nll == pytest.approx(-lp.sum())
    nll_u, _ = c.nll(held_out, "unigram")
    assert nll_u == pytest.approx(-math.log(3 / 11) - math.log(2 / 11) - math.log(1 / 11))
    r = c.evaluate(held_out, chars=6, nbytes=12)
    assert r["bigram"].bits_per_char == pytest.approx(nll / math.log(2) / 6)
    assert r["unigram"].bits_per_byte == pytest.approx(nll_u / math.log(2) / 12)


def test_bigram_learns_context_a_unigram_cannot():
    # a deterministic cycle 1 -> 2 -> 3 -> 1: the bigram is near-certain, the unigram is not
    stream = np.array([0] + [1, 2, 3] * 200)
    c = NgramCounts.from_stream(stream, 8)
    r = c.evaluate(np.array([0] + [1, 2, 3] * 10), chars=30, nbytes=30)
    assert r["bigram"].nll_per_token < 0.1 < math.log(3) - 0.1 < r["unigram"].nll_per_token


def test_save_load_and_shard_streams(tmp_path):
    c = NgramCounts.from_stream(STREAM, V)
    save_baselines(tmp_path, {"bn": c})
    back = load_baselines(tmp_path, ["bn", "en"])
    assert list(back) == ["bn"]
    for k in ("unigram", "bigram_keys", "bigram_counts"):
        np.testing.assert_array_equal(getattr(back["bn"], k), getattr(c, k))
    # two sources of one language: their train shards (doc eos doc eos) join behind one eos
    dtype = np.uint16
    (tmp_path / "a.train.bin").write_bytes(np.array([1, 2, 0], dtype=dtype).tobytes())
    (tmp_path / "b.train.bin").write_bytes(np.array([1, 3, 0], dtype=dtype).tobytes())
    (tmp_path / "c.train.bin").write_bytes(np.array([4, 0], dtype=dtype).tobytes())
    index = {"dtype": "uint16", "sources": {
        "a": {"language": "bn", "train": {"file": "a.train.bin", "tokens": 3}},
        "b": {"language": "bn", "train": {"file": "b.train.bin", "tokens": 3}},
        "c": {"language": "en", "train": {"file": "c.train.bin", "tokens": 2}}}}
    streams = training_streams(tmp_path, index, eos_id=0)
    assert streams["bn"].tolist() == STREAM.tolist()
    assert streams["en"].tolist() == [0, 4, 0]


def test_verdicts_and_summary_line():
    from bnlit.evaluation.heldout import EvalResult
    from bnlit.evaluation.ngram import baseline_verdicts, beaten, summary_line

    ln2 = math.log(2)
    bpc = lambda b: EvalResult(b * ln2 * 100, 50, 100, 300)  # noqa: E731  (b bits/char over 100 chars)
    base = {"twin": bpc(4.0), "unigram": bpc(3.2), "bigram": bpc(2.7)}
    assert beaten(bpc(3.0), base) == {"twin": True, "unigram": True, "bigram": False}
    assert summary_line("bn", bpc(3.0), base) == \
        "bn: trained 3.000 bits/char; beat twin (4.000) yes, unigram (3.200) yes, bigram (2.700) NO"
    only = {"bn": {"unigram": bpc(3.2), "bigram": bpc(2.7)}}
    assert baseline_verdicts({"bn": bpc(3.0)}, only, step=500, learning_after_steps=100) == []
    assert baseline_verdicts({"bn": bpc(3.5)}, only, step=50, learning_after_steps=100) == []
    (msg,) = baseline_verdicts({"bn": bpc(3.5)}, only, step=100, learning_after_steps=100)
    assert msg.startswith("baseline/bn: after 100 steps the trained model's 3.500 bits/char is not below "
                          "the add-one unigram's 3.200")


def test_chunked_shard_counts_equal_whole_stream_counts(tmp_path):
    from bnlit.evaluation.ngram import count_languages, count_shards

    rng = np.random.default_rng(0)
    index = {"dtype": "uint16", "sources": {}}
    for name, lang, n in (("a", "bn", 37), ("b", "bn", 23), ("c", "en", 11)):
        arr = rng.integers(0, 6, n).astype(np.uint16)
        arr[-1] = 0  # every shard ends a document
        (tmp_path / f"{name}.train.bin").write_bytes(arr.tobytes())
        index["sources"][name] = {"language": lang, "train": {"file": f"{name}.train.bin", "tokens": n}}
    whole = count_languages(training_streams(tmp_path, index, eos_id=0), 6)
    chunked = count_shards(tmp_path, index, eos_id=0, vocab_size=6, chunk_tokens=4)
    for lang in ("bn", "en"):
        for k in ("unigram", "bigram_keys", "bigram_counts"):
            np.testing.assert_array_equal(getattr(chunked[lang], k), getattr(whole[lang], k))
    capped = count_shards(tmp_path, index, eos_id=0, vocab_size=6, chunk_tokens=4, max_tokens=10)
    assert capped["bn"].tokens == 10 and capped["en"].tokens == 10


def test_no_singletons_still_leaves_mass_for_unseen_tokens():
    # every token has two distinct predecessors: N1+(. w) has no singleton, the estimate would be 0
    stream = np.array([0, 1, 2, 1, 0, 2, 0, 1, 0, 2, 1, 2])
    c = NgramCounts.from_stream(stream, 5)
    n_prev = np.bincount(c.bigram_keys % 5, minlength=5)
    assert not np.any(n_prev == 1)
    assert discount(n_prev[n_prev > 0]) == 0.5
    assert np.isfinite(c.bigram_logprob(np.array([1, 4]), np.array([4, 4]))).all()
