import json

import numpy as np
import pytest

from bnlit.data import embedded
from bnlit.data.dataset import MixtureSampler, PackedWindows, epoch_order, mixture_counts
from bnlit.data import shards
from bnlit.data.pipeline import run_local, stages
from bnlit.data.shards import is_validation, load_index, read_tokens, verify_index
from bnlit.data.sources import Source, check_text_file, iter_documents
from bnlit.errors import DataError
from bnlit.tokenizer import Tokenizer, train_tokenizer
from helpers_data import plan_build


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    docs = embedded.bangla_documents()[:8] + embedded.english_documents()[:20]
    return Tokenizer(train_tokenizer(docs, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=800))


def docs_of(n: int) -> list[str]:
    return embedded.bangla_documents()[:n]


def build(tmp_path, corpus, tok, val_fraction, **kw):
    plan = plan_build(tmp_path, corpus, tok.path, val_fraction, **kw)
    run_local(plan, quiet=True)
    return plan.shard_dir()


def test_shard_roundtrip_equals_tokenizer_output(tok, tmp_path):
    bn, en = docs_of(6), embedded.english_documents()[:15]
    out = build(tmp_path, [("bn", "bn", bn), ("en", "en", en)], tok, 0.2, tasks=2)
    index = load_index(out)
    for name, docs in (("bn", bn), ("en", en)):
        for split in ("train", "val"):
            part = [d for d in docs if is_validation(d, 0.2) == (split == "val")]
            expected = [t for d in part for t in tok.encode(d) + [tok.eos_id]]
            got = read_tokens(out, index, name, split)
            assert np.array_equal(np.asarray(got), np.asarray(expected, dtype=got.dtype)), (name, split)
            assert index["sources"][name][split]["chars"] == sum(len(d) for d in part)
    assert index["dtype"] == "uint16"


def test_shards_are_reused_and_rebuilt_when_inputs_change(tok, tmp_path):
    docs = docs_of(3)
    a = build(tmp_path, [("bn", "bn", docs)], tok, 0.1)
    mtime = (a / "index.json").stat().st_mtime_ns
    plan = plan_build(tmp_path, [("bn", "bn", docs)], tok.path, 0.1)
    assert stages(plan) == []  # nothing left to run: the cached shards are read
    assert build(tmp_path, [("bn", "bn", docs)], tok, 0.1) == a and (a / "index.json").stat().st_mtime_ns == mtime
    b = build(tmp_path, [("bn", "bn", docs[:2])], tok, 0.1)  # a changed file is a new fingerprint
    assert b != a


def test_index_that_does_not_match_its_data_file_is_refused(tok, tmp_path):
    out = build(tmp_path, [("bn", "bn", docs_of(2))], tok, 0.1)
    with open(out / "bn.train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="does not match its index"):
        load_index(out)


def test_index_records_block_checksums_and_a_changed_byte_is_named(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "BLOCK_BYTES", 1000)  # several blocks per file
    out = build(tmp_path, [("bn", "bn", docs_of(4))], tok, 0.1)
    index = load_index(out, verify=True)
    entry = index["sources"]["bn"]["train"]
    size = (out / "bn.train.bin").stat().st_size
    assert index["checksum"] == {"algorithm": "xxh3_64", "block_bytes": 1000}
    assert len(entry["blocks"]) == -(-size // 1000) >= 3
    assert verify_index(out, index) == size + (out / "bn.val.bin").stat().st_size
    with open(out / "bn.train.bin", "r+b") as f:  # one token changed in the third block, size unchanged
        f.seek(2500)
        old = f.read(2)
        f.seek(2500)
        f.write(bytes([old[0] ^ 1, old[1]]))
    load_index(out)  # the size check alone passes
    with pytest.raises(DataError, match=rf"shard {out}/bn.train.bin is corrupt: block 2 \(bytes 2000-3000\) does not "
                                        rf"match its xxh3_64 in {out}/index.json; delete {out} and rerun to rebuild it"):
        load_index(out, verify=True)


def test_index_without_checksums_is_refused_with_the_fix(tok, tmp_path):
    out = build(tmp_path, [("bn", "bn", docs_of(2))], tok, 0.1)
    index = json.loads((out / "index.json").read_text())
    del index["checksum"]
    index["version"] = 1
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=rf"shard index {out}/index.json is format version 1 \(this bnlit reads 2, "
                                        rf"with block checksums\); delete {out} to rebuild"):
        load_index(out)


def test_validation_split_is_by_content():
    assert is_validation("same text", 0.5) == is_validation("same text", 0.5)
    docs = [f"document {i}" for i in range(2000)]
    share = sum(is_validation(d, 0.1) for d in docs) / len(docs)
    assert 0.07 < share < 0.13


def test_packed_windows_shift_by_one():
    ds = PackedWindows(np.arange(21, dtype=np.uint16), seq_len=5)
    assert len(ds) == 4
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]


def test_mixture_counts_follow_weights_and_sum_exactly():
    counts = mixture_counts([100, 10], [0.8, 0.2], 1000)
    assert counts == [800, 200]
    assert sum(mixture_counts([7, 5, 3], [1, 1, 1], 10)) == 10
    assert mixture_counts([5, 0], [0.5, 0.5], 4) == [4, 0]


def test_epoch_order_is_seeded_and_repeats_small_sources_fairly():
    a = epoch_order([10, 4], [0.5, 0.5], 20, seed=1, epoch=0)
    assert np.array_equal(a, epoch_order([10, 4], [0.5, 0.5], 20, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_order([10, 4], [0.5, 0.5], 20, seed=1, epoch=1))
    small = np.sort(a[a >= 10]) - 10
    assert np.bincount(small, minlength=4).tolist() in ([3, 3, 2, 2], [2, 3, 3, 2], [3, 2, 3, 2], [2, 2, 3, 3],
                                                        [3, 2, 2, 3], [2, 3, 2, 3])


def test_sampler_ranks_are_disjoint_and_cover_the_epoch():
    sizes, weights = [50, 30], [0.6, 0.4]
    full = list(MixtureSampler(sizes, weights, seed=3))
    ranks = [list(MixtureSampler(sizes, weights, seed=3, rank=r, world_size=4)) for r in range(4)]
    assert all(len(r) == 20 for r in ranks)
    assert sorted(sum(ranks, [])) == sorted(full)
    assert ranks[1] == full[1::4]


def test_sampler_resumes_from_position():
    s = MixtureSampler([40], [1.0], seed=0)
    full = list(s)
    s.start = 13
    assert len(s) == 40 and list(s) == full[13:]  # len: the whole epoch (Lightning counts what is done)
    assert list(s) == full  # the offset applies once


def test_missing_empty_and_non_utf8_files_fail_with_the_field(tmp_path):
    with pytest.raises(DataError, match=r"data.sources\[0\].path: file .*nope.txt does not exist"):
        check_text_file(tmp_path / "nope.txt", "data.sources[0].path")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):
        check_text_file(empty, "f")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("ok text ".encode() + "café ok".encode("latin-1"))
    with pytest.raises(DataError, match=r"not valid UTF-8 \(byte 11\).*iconv"):
        check_text_file(latin, "f")


def test_reads_txt_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["প্রথম নথি", "second doc", "তৃতীয়"]
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs), encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    for fname, field in (("a.txt", "text"), ("a.jsonl", "body"), ("a.parquet", "text")):
        src = Source(name="s", language="bn", path=str(tmp_path / fname), text_field=field)
        got = [d.strip() for d in iter_documents(src, tmp_path / fname, cache_dir=str(tmp_path / "hf"))]
        assert got == docs, fname


def test_wrong_text_field_and_blank_file(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    src = Source(name="s", language="bn", path=str(tmp_path / "a.jsonl"))
    with pytest.raises(DataError, match="text_field='text': not a column"):
        list(iter_documents(src, tmp_path / "a.jsonl", cache_dir=str(tmp_path / "hf")))
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    src = Source(name="s", language="bn", path=str(tmp_path / "blank.txt"))
    with pytest.raises(DataError, match="holds only whitespace; point it at a file with text"):
        list(iter_documents(src, tmp_path / "blank.txt", cache_dir=str(tmp_path / "hf")))


def test_hub_dataset_without_network_fails_fast(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = Source(name="w", language="bn", hub_id="wikimedia/wikipedia", hub_config="20231101.bn")
    t = time.perf_counter()
    with pytest.raises(DataError, match=r"wikimedia/wikipedia \(20231101.bn\) is not cached.*pre-download"):
        list(iter_documents(src, None, cache_dir=str(tmp_path / "hf")))
    assert time.perf_counter() - t < 30
