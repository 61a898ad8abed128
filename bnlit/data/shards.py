"""Packed token shards: each source's documents are tokenized (in parallel), joined with EOS and
written as one flat uint16/uint32 array per split, with a JSON index. A build goes to a temporary
directory that is renamed into place, so a reader never sees a half-written shard set; the
directory name is a hash of everything the tokens depend on, so a changed source or tokenizer
builds a new set and an unchanged one is reused."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from bnlit.errors import DataError
from bnlit.tokenizer import Tokenizer

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
CHUNK_DOCS = 64


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_validation(text: str, val_fraction: float) -> bool:
    """Deterministic, order-free split: identical documents always land on the same side, so an
    exact duplicate can never leak from train into validation."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h / 2**64 < val_fraction


def shard_key(fingerprints: list[str], tokenizer_sha256: str, val_fraction: float) -> str:
    payload = json.dumps([FORMAT_VERSION, fingerprints, tokenizer_sha256, val_fraction])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class SplitStats:
    tokens: int = 0
    docs: int = 0
    chars: int = 0
    bytes: int = 0


_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_bytes: bytes) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(model_bytes)


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer.encode_batch(texts)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while chunk := list(islice(it, size)):
        yield chunk


def _write_split(
    path: Path, docs: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, pool
) -> SplitStats:
    stats = SplitStats()
    chunks = list(_chunks(docs, CHUNK_DOCS))
    encoded = pool.imap(_encode_chunk, chunks) if pool is not None else map(_init_and_encode(tokenizer), chunks)
    with path.open("wb") as f:
        for texts, ids in zip(chunks, encoded):
            for text, doc in zip(texts, ids):
                arr = np.asarray(doc + [tokenizer.eos_id], dtype=dtype)
                f.write(arr.tobytes())
                stats.tokens += arr.size
                stats.docs += 1
                stats.chars += len(text)
                stats.bytes += len(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    return stats


def _init_and_encode(tokenizer: Tokenizer):
    return lambda texts: tokenizer.encode_batch(texts)


def build_shards(
    root: str | os.PathLike,
    sources: list[tuple[str, str, Iterable[str]]],
    fingerprints: list[str],
    tokenizer: Tokenizer,
    val_fraction: float,
    num_proc: int = 1,
) -> Path:
    """Tokenize ``sources`` (name, language, documents) into ``root/<key>/`` unless it exists.

    Returns the shard directory. Safe against concurrent builders: each writes its own temporary
    directory and the first rename wins.
    """
    key = shard_key(fingerprints, tokenizer.sha256, val_fraction)
    final = Path(root) / key
    if (final / INDEX_FILE).is_file():
        return final
    tmp = Path(root) / f".{key}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    index = {"version": FORMAT_VERSION, "key": key, "dtype": dtype.name,
             "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
             "val_fraction": val_fraction, "sources": {}}
    pool = None
    if num_proc > 1:
        pool = mp.get_context("spawn").Pool(num_proc, initializer=_init_worker, initargs=(tokenizer.model_bytes,))
    try:
        for (name, language, docs), fp in zip(sources, fingerprints):
            docs = list(docs)
            entry = {"language": language, "fingerprint": fp}
            for split in SPLITS:
                want_val = split == "val"
                part = [d for d in docs if is_validation(d, val_fraction) == want_val]
                stats = _write_split(tmp / f"{name}.{split}.bin", part, tokenizer, dtype, pool)
                entry[split] = {"file": f"{name}.{split}.bin", **stats.__dict__}
            index["sources"][name] = entry
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished first; keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_index(shard_dir: str | os.PathLike) -> dict:
    """Read and verify a shard index: every data file must exist with exactly the size it
    declares."""
    shard_dir = Path(shard_dir)
    path = shard_dir / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"shard index {path} is unreadable ({type(e).__name__}); delete {shard_dir} to rebuild") from None
    itemsize = np.dtype(index["dtype"]).itemsize
    for name, entry in index["sources"].items():
        for split in SPLITS:
            f = shard_dir / entry[split]["file"]
            expected = entry[split]["tokens"] * itemsize
            actual = f.stat().st_size if f.is_file() else -1
            if actual != expected:
                raise DataError(f"shard {f} does not match its index ({actual} bytes, index says "
                                f"{expected}); delete {shard_dir} to rebuild")
    return index


def read_tokens(shard_dir: str | os.PathLike, index: dict, name: str, split: str) -> np.memmap | np.ndarray:
    entry = index["sources"][name][split]
    dtype = np.dtype(index["dtype"])
    if entry["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(shard_dir) / entry["file"], dtype=dtype, mode="r")
