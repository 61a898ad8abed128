"""Packed token shards: each source's documents, tokenized and joined with EOS, as one flat
uint16/uint32 array per split, with a JSON index.

The datatrove step :class:`bnlit.data.steps.Tokenize` writes each task's tokens
(:func:`encode_documents`) and :func:`merge_shards` joins the tasks of every source in order
into ``root/<key>/`` (written in ``root/.<key>.partial/`` and renamed, so a reader never sees a
half-written shard set). The key is a hash of everything the tokens depend on
(:func:`shard_key`), so a changed source or tokenizer builds a new set and an unchanged one is
reused. A killed build resumes task by task (datatrove skips the tasks it finished); the result
is byte-identical to an uninterrupted build.

The index records an xxh3-64 checksum of every ``BLOCK_BYTES`` block of every data file
(:func:`block_checksums`); :func:`verify_index` rereads the files and names the first block whose
bytes changed (a bit flip on a network filesystem, a partial overwrite: the size check alone
catches only a file cut short). Blocks keep the index small for multi-GB files and say where the
damage is; the cost per GB is printed by ``scripts/bench_shard_check.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import xxhash

from bnlit.data.normalize import NORMALIZATION_VERSION
from bnlit.errors import DataError

FORMAT_VERSION = 2  # 2: per-block checksums in the index
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
STAT_KEYS = ("tokens", "docs", "chars", "bytes")
CHECKSUM = "xxh3_64"  # non-cryptographic: it guards against damage, not an adversary, at memory speed
BLOCK_BYTES = 64 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_validation(text: str, val_fraction: float) -> bool:
    """Deterministic, order-free split: identical documents always land on the same side, so an
    exact duplicate can never leak from train into validation."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h / 2**64 < val_fraction


def shard_key(fingerprints: list[str], tokenizer_sha256: str, val_fraction: float) -> str:
    # the encode-time normalisation is part of what the tokens mean (bnlit/data/normalize.py)
    payload = json.dumps([FORMAT_VERSION, fingerprints, tokenizer_sha256, val_fraction, NORMALIZATION_VERSION])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def encode_documents(texts: list[str], tokenizer, dtype: np.dtype, val_fraction: float) -> dict[str, tuple[np.ndarray, dict]]:
    """Per split: the documents' tokens, each followed by EOS, as one array, and their counts
    (``tokens``, ``docs``, ``chars``, UTF-8 ``bytes``)."""
    parts = {split: [] for split in SPLITS}
    for t in texts:
        parts["val" if is_validation(t, val_fraction) else "train"].append(t)
    out = {}
    for split, part in parts.items():
        ids = tokenizer.encode_batch(part) if part else []
        lengths = [len(x) + 1 for x in ids]
        arr = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for x, n in zip(ids, lengths):
            arr[pos:pos + n - 1] = x
            arr[pos + n - 1] = tokenizer.eos_id
            pos += n
        out[split] = (arr, {"tokens": int(arr.size), "docs": len(part), "chars": sum(len(t) for t in part),
                            "bytes": sum(len(t.encode("utf-8")) for t in part)})
    return out


def merge_shards(root: str | os.PathLike, tasks_dir: str | os.PathLike, sources: list[tuple[str, str, list[int]]],
                 fingerprints: list[str], tokenizer, val_fraction: float) -> Path:
    """Join the per-task files of :class:`bnlit.data.steps.Tokenize` in ``tasks_dir`` into
    ``root/<key>/`` (unless it exists): ``sources`` is (name, language, the ranks of its pieces
    in order). Returns the shard directory."""
    key = shard_key(fingerprints, tokenizer.sha256, val_fraction)
    root, tasks_dir = Path(root), Path(tasks_dir)
    final = root / key
    if (final / INDEX_FILE).is_file():
        return final
    work = root / f".{key}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    index = {"version": FORMAT_VERSION, "key": key, "dtype": dtype.name,
             "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
             "val_fraction": val_fraction, "checksum": {"algorithm": CHECKSUM, "block_bytes": BLOCK_BYTES},
             "sources": {}}
    for (name, language, ranks), fp in zip(sources, fingerprints):
        entry = index["sources"][name] = {"language": language, "fingerprint": fp}
        for split in SPLITS:
            stats = dict.fromkeys(STAT_KEYS, 0)
            with (work / f"{name}.{split}.bin").open("wb") as out:
                for r in ranks:
                    with (tasks_dir / f"{r:05d}.{split}.bin").open("rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                    task = json.loads((tasks_dir / f"{r:05d}.json").read_text())[split]
                    for k in STAT_KEYS:
                        stats[k] += task[k]
                out.flush()
                os.fsync(out.fileno())
            entry[split] = {"file": f"{name}.{split}.bin", **stats,
                            "blocks": block_checksums(work / f"{name}.{split}.bin", BLOCK_BYTES)}
    (work / INDEX_FILE).write_text(json.dumps(index, indent=2))
    os.replace(work, final)
    return final


def block_checksums(path: str | os.PathLike, block_bytes: int) -> list[str]:
    """The :data:`CHECKSUM` (hex) of each consecutive ``block_bytes`` of a file (the last block
    shorter); an empty file has none."""
    out = []
    buf = bytearray(min(block_bytes, max(os.path.getsize(path), 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            out.append(xxhash.xxh3_64_hexdigest(view[:n]))
    return out


def load_index(shard_dir: str | os.PathLike, verify: bool = False) -> dict:
    """Read and check a shard index: every data file must exist with exactly the size it declares
    and, with ``verify``, the checksum of every block (:func:`verify_index`)."""
    shard_dir = Path(shard_dir)
    path = shard_dir / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"shard index {path} is unreadable ({type(e).__name__}); delete {shard_dir} to rebuild") from None
    if index.get("version") != FORMAT_VERSION or "checksum" not in index:
        raise DataError(f"shard index {path} is format version {index.get('version')} (this bnlit reads "
                        f"{FORMAT_VERSION}, with block checksums); delete {shard_dir} to rebuild")
    itemsize = np.dtype(index["dtype"]).itemsize
    for name, entry in index["sources"].items():
        for split in SPLITS:
            f = shard_dir / entry[split]["file"]
            expected = entry[split]["tokens"] * itemsize
            actual = f.stat().st_size if f.is_file() else -1
            if actual != expected:
                raise DataError(f"shard {f} does not match its index ({actual} bytes, index says "
                                f"{expected}); delete {shard_dir} to rebuild")
    if verify:
        verify_index(shard_dir, index)
    return index


def verify_index(shard_dir: str | os.PathLike, index: dict) -> int:
    """Reread every data file of a shard set and compare each block with the checksum its index
    records; returns the bytes checked.

    Raises:
        DataError: one line naming the file, the first damaged block and its byte range, and the
            fix (delete the shard directory; the next run rebuilds it, deterministically).
    """
    shard_dir = Path(shard_dir)
    algorithm, block_bytes = index["checksum"]["algorithm"], int(index["checksum"]["block_bytes"])
    if algorithm != CHECKSUM:
        raise DataError(f"shard index {shard_dir / INDEX_FILE}: checksum {algorithm!r} is not {CHECKSUM!r}; "
                        f"delete {shard_dir} to rebuild")
    checked = 0
    for entry in index["sources"].values():
        for split in SPLITS:
            f = shard_dir / entry[split]["file"]
            want = entry[split]["blocks"]
            got = block_checksums(f, block_bytes)
            for i, (a, b) in enumerate(zip(got, want)):
                if a != b:
                    end = min((i + 1) * block_bytes, f.stat().st_size)
                    raise DataError(f"shard {f} is corrupt: block {i} (bytes {i * block_bytes}-{end}) does not "
                                    f"match its {CHECKSUM} in {shard_dir / INDEX_FILE}; delete {shard_dir} and "
                                    "rerun to rebuild it (or restore the file from a good copy)")
            if len(got) != len(want):
                raise DataError(f"shard {f} has {len(got)} blocks of {block_bytes} bytes, its index "
                                f"{len(want)}; delete {shard_dir} and rerun to rebuild it")
            checked += f.stat().st_size
    return checked


def read_tokens(shard_dir: str | os.PathLike, index: dict, name: str, split: str) -> np.memmap | np.ndarray:
    entry = index["sources"][name][split]
    dtype = np.dtype(index["dtype"])
    if entry["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(shard_dir) / entry["file"], dtype=dtype, mode="r")
