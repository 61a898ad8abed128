import pytest

from bnlit.data.decontam import DecontamConfig, Decontaminator, contamination, ngram_hashes
from bnlit.data.dedup import canonical_words
from bnlit.errors import ConfigError
from helpers_data import document

EVAL_SENTENCE = "আমাদের গ্রামের পাশের নদীটি বর্ষাকালে অনেক চওড়া হয়ে যায় এবং নৌকা চলে দিনরাত সারা বছর"


def test_a_planted_evaluation_sentence_inside_a_training_document_is_caught():
    train = [document(i) for i in range(30)]
    i = 17
    paragraphs = train[i].split("\n")
    train[i] = "\n".join(paragraphs[:2] + [EVAL_SENTENCE + "।"] + paragraphs[2:])  # buried in the middle
    d = Decontaminator(ngram=13)
    d.add("bench", EVAL_SENTENCE)
    d.add("bench", document(500))  # an evaluation item nobody copied
    d.freeze()
    hits = [j for j, t in enumerate(train) if d.check(t)]
    assert hits == [i]
    s = d.summary()["bench"]
    assert s["train_docs_hit"] == 1 and s["eval_docs_contaminated"] == 1 and s["contamination_rate"] == 0.5


def test_boilerplate_below_min_overlap_is_touched_but_not_contaminating():
    val = document(7, sentences=60)
    shared = " ".join(val.split()[:14])  # a 14-word line copied from a long validation document
    train = document(8) + "\n" + shared
    strict = Decontaminator(13, min_overlap=0.0)
    lenient = Decontaminator(13, min_overlap=0.05)
    for d in (strict, lenient):
        d.add("val/bn", val)
        d.freeze()
    assert strict.check(train) == ["val/bn"]
    assert lenient.check(train) == []
    assert lenient.summary()["val/bn"]["train_docs_touched"] == 1


def test_short_evaluation_items_are_counted_and_ngrams_are_punctuation_blind():
    assert ngram_hashes(canonical_words("too short"), 13).size == 0
    r = contamination(["too short", EVAL_SENTENCE], ["x " + EVAL_SENTENCE.replace(" ", ",  ") + " y"], ngram=13)
    assert r["too_short"] == 1 and r["eval_docs_contaminated"] == 1 and r["contamination_rate"] == 1.0


def test_config_is_validated():
    with pytest.raises(ConfigError, match="mode"):
        DecontamConfig(mode="delete")
    with pytest.raises(ConfigError, match="unknown keys"):
        DecontamConfig.from_dict({"ngrams": 13})


def test_share_of_ngrams_found_in_training():
    # the evaluation set: one sentence of 15 words (3 13-grams), copied in training up to word 14
    words = EVAL_SENTENCE.split()
    assert len(words) == 15
    r = contamination([EVAL_SENTENCE], [document(3) + " " + " ".join(words[:14])], ngram=13)
    assert r["ngrams_in_training"] == 2 and r["ngram_rate"] == pytest.approx(2 / 3)
    clean = contamination([EVAL_SENTENCE], [document(3)], ngram=13)
    assert (clean["ngrams_in_training"], clean["ngram_rate"]) == (0, 0.0)
