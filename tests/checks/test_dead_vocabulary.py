"""Dead-vocabulary report (bnlit/checks/dead_vocabulary.py): planted unused pieces are reported exactly."""

import numpy as np
import pytest

from bnlit.checks.dead_vocabulary import dead_vocabulary, format_report, piece_language
from bnlit.evaluation.ngram import NgramCounts
from bnlit.tokenizer import Tokenizer, train_tokenizer
from helpers_data import document

PLANTED = ["zorblaxquin", "vexmorthune", "কখগঘঙচছজ"]  # words only the tokenizer's training text has


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    shard_docs = [document(i, "bn") for i in range(30)] + [document(100 + i, "en") for i in range(30)]
    tok_text = shard_docs + [" ".join([w] * 20) for w in PLANTED for _ in range(30)]
    path = train_tokenizer(tok_text, tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=600)
    return Tokenizer(path), shard_docs


def test_planted_pieces_are_reported_exactly(planted):
    tok, docs = planted
    streams = {lang: np.concatenate([[tok.eos_id]] + [ids + [tok.eos_id] for ids in tok.encode_batch(part)])
               for lang, part in (("bn", docs[:30]), ("en", docs[30:]))}
    counts = {lang: NgramCounts.from_stream(s, tok.vocab_size).unigram for lang, s in streams.items()}
    report = dead_vocabulary(tok, counts)
    dead = report["never_in_training"]
    planted_ids = {tok.sp.piece_to_id("\u2581" + w) for w in PLANTED}
    assert 0 not in planted_ids  # each planted word became one piece
    # the reference: every id of the vocabulary that encoding the shard text never produces
    used = {i for d in docs for i in tok.encode(d)} | {tok.eos_id}
    assert set(dead["ids"]) == set(range(tok.vocab_size)) - used
    assert planted_ids <= set(dead["ids"])
    ordinary = [i for i in dead["ids"] if not tok.sp.is_byte(i) and not tok.sp.is_control(i) and not tok.sp.is_unknown(i)]
    assert dead["pieces"] == len(ordinary) and dead["count"] == len(dead["ids"])
    assert dead["share"] == pytest.approx(len(dead["ids"]) / tok.vocab_size)
    assert dead["by_kind"]["special"] == 3  # <pad> <unk> <s>; </s> ends every document
    assert dead["by_language"].get("bn", 0) >= 1 and dead["by_language"].get("en", 0) >= 2
    assert "\u2581zorblaxquin" in dead["sample"] or len(dead["sample"]) == 20
    assert "never in the training shards" in format_report(report)


def test_rows_never_looked_up(planted):
    tok, docs = planted
    counts = {"bn": np.ones(tok.vocab_size, dtype=np.int64)}  # every piece occurs...
    looked_up = np.ones(tok.vocab_size, dtype=bool)
    looked_up[[10, 11]] = False  # ...but two were never an input
    r = dead_vocabulary(tok, counts, looked_up)
    assert r["never_in_training"]["count"] == 0
    assert r["never_looked_up"]["ids"] == [10, 11]


def test_piece_language():
    assert piece_language("\u2581নদী") == "bn"
    assert piece_language("\u2581river") == "en"
    assert piece_language("\u2581123") == "und"
