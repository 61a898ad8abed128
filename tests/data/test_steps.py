"""Each of bnlit's datatrove steps (bnlit/data/steps.py) on small inputs, outside an executor."""

import json
import struct

import numpy as np
import pytest
from datatrove.data import Document
from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter, ExactFindDedups

from bnlit.data import steps as S
from bnlit.data.decontam import DecontamConfig, Decontaminator
from bnlit.data.dedup import DedupConfig, canonical_words, signature
from bnlit.data.filters import FilterConfig
from bnlit.data.shards import is_validation
from bnlit.tokenizer import Tokenizer, train_tokenizer
from helpers_data import document, near_copy


def docs(*texts, language="bn"):
    return [Document(text=t, id=str(i), metadata={"language": language}) for i, t in enumerate(texts)]


def test_normalize_counts_the_documents_it_changed():
    step = S.Normalize()
    out = list(step.run(docs("a  b\r\nc", "plain")))
    assert [d.text for d in out] == ["a b\nc", "plain"] and step.stats["changed"].total == 1


def test_quality_filter_drops_with_a_reason_and_counts_characters():
    step = S.QualityFilter(FilterConfig())
    kept = list(step.run(docs(document(1), "ছোট।", "   ", document(2, "en"))))
    assert [d.text for d in kept] == [document(1)]
    assert step.stats["dropped_length:min_chars"].total == 1 and step.stats["dropped_length:empty"].total == 1
    assert step.stats["dropped_script:ratio"].total == 1
    assert step.stats["dropped_chars_length"].total == len("ছোট।") + 3
    no_filters = S.QualityFilter(None)  # only the empty document goes
    assert len(list(no_filters.run(docs("ছোট।", " ")))) == 1


def test_minhash_signature_is_the_datasketch_signature_cut_into_the_lsh_bands(tmp_path):
    step = S.MinhashSignature(str(tmp_path), DedupConfig())
    assert (step.config.num_buckets, step.config.hashes_per_bucket) == (9, 13)
    text = document(3)
    bands = step.get_signature(step.get_shingles(text))
    values = signature(canonical_words(text), DedupConfig())
    assert bands == [values[i * 13:(i + 1) * 13].tolist() for i in range(9)]
    near = step.get_signature(step.get_shingles(near_copy(text)))
    assert any(a == b for a, b in zip(bands, near))  # a near copy shares a band


def test_exact_signature_passes_every_document_on_and_the_first_copy_wins(tmp_path):
    a, b = document(1), document(2)
    for rank, texts in enumerate([(a, b, a.upper()), (b, document(3))]):  # copies within and across tasks
        passed = list(S.ExactSignature(str(tmp_path / "sigs")).run(docs(*texts), rank=rank, world_size=2))
        assert [d.text for d in passed] == list(texts)
    ExactFindDedups(str(tmp_path / "sigs"), str(tmp_path / "dups"), config=S.exact_config()).run(None, 0, 1)
    kept = [[d.text for d in ExactDedupFilter(str(tmp_path / "dups"), config=S.exact_config()).run(
        docs(*texts), rank=rank, world_size=2)] for rank, texts in enumerate([(a, b, a.upper()), (b, document(3))])]
    assert kept == [[a, b], [document(3)]]


def write_pairs(folder, bucket: int, pairs) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{bucket:05d}_00.dups", "wb") as f:
        for p in pairs:
            f.write(struct.pack("<4I", *p))


def test_first_seen_cluster_drops_only_what_shares_a_bucket_with_a_kept_document(tmp_path):
    # task 0 doc 1 ~ task 0 doc 5 (bucket 0); task 0 doc 5 ~ task 1 doc 2 (bucket 1): a chain A~B~C
    write_pairs(tmp_path / "buckets", 0, [(0, 1, 0, 5)])
    write_pairs(tmp_path / "buckets", 1, [(0, 5, 1, 2)])
    step = S.FirstSeenCluster(str(tmp_path / "buckets"), str(tmp_path / "remove"), 2, 2, [0, 1])
    step.run(None, 0, 1)
    removed = {r: np.fromfile(tmp_path / "remove" / f"{r:06d}.remove", dtype="<u4").tolist() for r in (0, 1)}
    assert removed == {0: [5], 1: []}  # B goes; C shares a bucket only with the dropped B and stays
    clusters = json.loads((tmp_path / "remove" / "clusters.json").read_text())
    assert clusters["clusters"] == 2 and clusters["tasks"]["0"]["near"] == 1


def test_first_seen_cluster_counts_indices_after_exact_dedup_and_names_cross_source_copies(tmp_path):
    # task 0: doc 0 is kept, doc 2 an exact copy of doc 0 (dropped by the exact filter), doc 3 a near
    # copy of doc 0; task 1 (another source): doc 0 a near copy of task 0's doc 0
    write_pairs(tmp_path / "buckets", 0, [(0, 0, 0, 2), (0, 2, 0, 3), (0, 3, 1, 0)])
    (tmp_path / "dups" / "00000").mkdir(parents=True)
    np.array([2], dtype="<u4").tofile(tmp_path / "dups" / "00000" / "00000.c4_dup")
    S.FirstSeenCluster(str(tmp_path / "buckets"), str(tmp_path / "remove"), 1, 2, [0, 1],
                       str(tmp_path / "dups")).run(None, 0, 1)
    assert np.fromfile(tmp_path / "remove" / "000000.remove", dtype="<u4").tolist() == [2]  # doc 3, index 2 after exact
    assert np.fromfile(tmp_path / "remove" / "000001.remove", dtype="<u4").tolist() == [0]
    tasks = json.loads((tmp_path / "remove" / "clusters.json").read_text())["tasks"]
    assert tasks["0"] == {"near": 1, "near_cross": 0, "exact_cross": 0} and tasks["1"]["near_cross"] == 1


@pytest.mark.parametrize("mode", ["drop", "flag"])
def test_decontaminate_drops_or_flags_training_documents_that_quote_an_evaluation_set(tmp_path, mode):
    cfg = DecontamConfig(mode=mode)
    bench = document(50)
    d = Decontaminator(cfg.ngram, cfg.min_overlap)
    d.add("eval/bench", bench)
    d.freeze().save(tmp_path / "index.npz")
    quote = next(t for i in range(100) if not is_validation(t := document(i) + "\n" + " ".join(bench.split()[:30]), 0.05))
    step = S.Decontaminate(str(tmp_path / "index.npz"), str(tmp_path / "counts"), cfg, 0.05)
    kept = [x.text for x in step.run(docs(document(60), quote), rank=0)]
    assert kept == ([document(60)] if mode == "drop" else [document(60), quote])
    assert step.stats["contaminated"].total == 1 and step.stats["set_eval/bench"].total == 1
    merged = Decontaminator.load(tmp_path / "index.npz")
    merged.merge_counts(tmp_path / "counts" / "00000.npz")
    assert merged.summary()["eval/bench"]["eval_docs_contaminated"] == 1


def test_tokenize_writes_each_documents_tokens_and_eos_per_split(tmp_path):
    texts = [document(i) for i in range(8)]
    tok = Tokenizer(train_tokenizer(texts, tmp_path / "t.model", vocab_size=400, num_threads=1))
    S.Tokenize(str(tmp_path / "out"), str(tok.path), 0.3, chunk_chars=2000).run(iter(docs(*texts)), rank=3)
    stats = json.loads((tmp_path / "out" / "00003.json").read_text())
    for split in ("train", "val"):
        part = [t for t in texts if is_validation(t, 0.3) == (split == "val")]
        want = [i for t in part for i in tok.encode(t) + [tok.eos_id]]
        got = np.fromfile(tmp_path / "out" / f"00003.{split}.bin", dtype=np.uint16).tolist()
        assert got == want and stats[split]["docs"] == len(part)
