import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bnlit.data import shards
from bnlit.data.pipeline import CleanConfig, clean_sources, read_clean
from bnlit.data.shards import KILL_AFTER_ENV, build_shards, is_validation, load_index, read_tokens
from bnlit.tokenizer import Tokenizer, train_tokenizer
from helpers_data import document

HERE = Path(__file__).parent
CHUNK = 3000  # characters: each source is split into several chunks


def corpus():
    return [("bn", "bn", [document(i, "bn") for i in range(40)]), ("en", "en", [document(i, "en") for i in range(30)])]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    texts = [d for _, _, docs in corpus() for d in docs]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=512)


BUILD = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from helpers_data import document
from bnlit.data.shards import build_shards
from bnlit.tokenizer import Tokenizer
from test_shard_build import corpus, CHUNK
if __name__ == "__main__":
    build_shards({root!r}, corpus(), ["fa", "fb"], Tokenizer({tok!r}), 0.2, num_proc=2, chunk_chars=CHUNK)
"""


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".bin" or p.name == "index.json"}


def test_killed_build_resumes_to_byte_identical_shards(tok_path, tmp_path):
    tok = Tokenizer(tok_path)
    ref = build_shards(tmp_path / "ref", corpus(), ["fa", "fb"], tok, 0.2, num_proc=1, chunk_chars=CHUNK)
    total = json.loads((ref / "build.json").read_text())["chunks"]
    assert total >= 6
    script = tmp_path / "build.py"
    script.write_text(BUILD.format(here=str(HERE), tests=str(HERE.parent), root=str(tmp_path / "run"), tok=str(tok_path)))
    env = dict(os.environ, **{KILL_AFTER_ENV: "3"})
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    partial = next((tmp_path / "run").glob(".*.partial"))
    assert json.loads((partial / "progress.json").read_text())["sources"]["bn"]["chunks"] == 3
    out = build_shards(tmp_path / "run", corpus(), ["fa", "fb"], tok, 0.2, num_proc=2, chunk_chars=CHUNK)
    build = json.loads((out / "build.json").read_text())
    assert build["chunks_reused"] == 3 and build["chunks_tokenized"] == total - 3  # finished chunks not redone
    assert files(out) == files(ref)
    assert not partial.exists()


def test_writer_failure_mid_build_resumes_identically(tok_path, tmp_path, monkeypatch):
    tok = Tokenizer(tok_path)
    ref = build_shards(tmp_path / "ref", corpus(), ["fa", "fb"], tok, 0.2, chunk_chars=CHUNK)
    calls = {"n": 0}
    real = shards._write_json

    def failing(path, obj):
        if path.name == "progress.json":
            calls["n"] += 1
            if calls["n"] == 5:  # the en source is under way
                raise OSError("disk full")
        real(path, obj)

    monkeypatch.setattr(shards, "_write_json", failing)
    with pytest.raises(OSError, match="disk full"):
        build_shards(tmp_path / "run", corpus(), ["fa", "fb"], tok, 0.2, chunk_chars=CHUNK)
    monkeypatch.setattr(shards, "_write_json", real)
    out = build_shards(tmp_path / "run", corpus(), ["fa", "fb"], tok, 0.2, chunk_chars=CHUNK)
    assert json.loads((out / "build.json").read_text())["chunks_reused"] == 4
    assert files(out) == files(ref)


def test_multiprocess_shards_equal_the_tokenizer_output(tok_path, tmp_path):
    tok = Tokenizer(tok_path)
    out = build_shards(tmp_path, corpus(), ["fa", "fb"], tok, 0.2, num_proc=2, chunk_chars=CHUNK)
    index = load_index(out)
    for name, _, docs in corpus():
        for split in ("train", "val"):
            part = [d for d in docs if is_validation(d, 0.2) == (split == "val")]
            want = [t for d in part for t in tok.encode(d) + [tok.eos_id]]
            assert np.array_equal(np.asarray(read_tokens(out, index, name, split)), np.asarray(want, dtype=np.uint16))
            assert index["sources"][name][split]["docs"] == len(part)


def test_cleaning_pipeline_end_to_end_and_independent_of_process_count(tmp_path):
    bn = [document(i) for i in range(30)]
    val = [d for d in bn if is_validation(d, 0.2)]
    assert val
    eval_file = [document(950, "en"), document(951, "en")]

    def training_doc_quoting(text: str, language: str) -> str:  # lands on the training side
        return next(d for i in range(900, 999) if not is_validation(d := document(i, language) + "\n" + text, 0.2))

    leak = training_doc_quoting(" ".join(val[0].split()[:40]), "bn")  # quotes a validation passage
    sources = [("bn", "bn", bn + [bn[1], "ছোট।", leak]),
               ("en", "en", [document(i, "en") for i in range(10)] + [bn[2]])]  # a Bangla copy in the English source
    sources[1][2].append(training_doc_quoting(" ".join(eval_file[1].split()[:30]), "en"))
    one = clean_sources(tmp_path / "one", sources, CleanConfig(), 0.2, {"eval/bench": eval_file}, num_proc=1)
    two = clean_sources(tmp_path / "two", sources, CleanConfig(), 0.2, {"eval/bench": eval_file}, num_proc=2)
    assert one == two
    for name in ("bn", "en"):
        assert list(read_clean(tmp_path / "one", name)) == list(read_clean(tmp_path / "two", name))
    bn_s, en_s = one["sources"]["bn"], one["sources"]["en"]
    assert bn_s["dedup"]["exact"] == 1 and bn_s["filters"]["docs"] == {"length": 1}
    assert bn_s["decontam"]["by_set"] == {"val/bn": 1} and bn_s["kept_docs"] == 30
    assert en_s["filters"]["docs"] == {"script": 1}  # the Bangla copy is dropped by the English script check first
    assert en_s["decontam"]["by_set"] == {"eval/bench": 1} and en_s["kept_docs"] == 10
    assert one["decontam"]["eval/bench"]["eval_docs_contaminated"] == 1
    assert one["validation_decontaminated"] is True
    assert list(read_clean(tmp_path / "one", "bn")) == bn
