"""Packed token shards: each source's documents are tokenized in worker processes, joined with
EOS and written as one flat uint16/uint32 array per split, with a JSON index.

The build is chunked and resumable. Documents are read in chunks of about ``chunk_chars``
characters; worker processes tokenize chunks in parallel (a bounded number in flight, so memory
stays flat however large the corpus) and the main process appends each finished chunk, in order,
to the split files of ``root/.<key>.partial/``, fsyncs them and records the committed lengths and
counts in ``progress.json``. A build that is killed resumes from the last committed chunk: the
files are truncated to their committed lengths, the finished chunks' documents are skipped
without tokenizing them, and the result is byte-identical to an uninterrupted build. The finished
directory is renamed to ``root/<key>/`` (a reader never sees a half-written shard set); the key is
a hash of everything the tokens depend on, so a changed source or tokenizer builds a new set and
an unchanged one is reused. A lock file serialises concurrent builders of the same key.

The index records an xxh3-64 checksum of every ``BLOCK_BYTES`` block of every data file
(:func:`block_checksums`); :func:`verify_index` rereads the files and names the first block whose
bytes changed (a bit flip on a network filesystem, a partial overwrite: the size check alone
catches only a file cut short). Blocks keep the index small for multi-GB files and say where the
damage is; the cost per GB is printed by ``scripts/bench_shard_check.py``.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from bnlit.data.normalize import NORMALIZATION_VERSION
from bnlit.errors import DataError
from bnlit.progress import bar as progress_bar
from bnlit.tokenizer import Tokenizer

FORMAT_VERSION = 2  # 2: per-block checksums in the index
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.json"
BUILD_FILE = "build.json"
SPLITS = ("train", "val")
CHUNK_CHARS = 1_000_000
KILL_AFTER_ENV = "BNLIT_SHARDS_KILL_AFTER"  # test hook: SIGKILL this process after N committed chunks
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


@dataclass
class SplitStats:
    tokens: int = 0
    docs: int = 0
    chars: int = 0
    bytes: int = 0

    def add(self, other: "SplitStats") -> None:
        for k in ("tokens", "docs", "chars", "bytes"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


# ---- parallel map with bounded memory ------------------------------------------------------
def ordered_map(fn: Callable, items: Iterable, pool=None, inflight: int = 0) -> Iterator:
    """``map(fn, items)`` on ``pool`` (or inline), in order, with at most ``inflight`` tasks
    submitted ahead: unlike ``Pool.imap`` it never reads the whole input into memory."""
    if pool is None:
        yield from map(fn, items)
        return
    inflight = inflight or 2 * pool._processes
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= inflight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def char_chunks(docs: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    """Consecutive lists of documents holding at least ``chunk_chars`` characters (the last one
    fewer); deterministic for a given document stream."""
    chunk, size = [], 0
    for d in docs:
        chunk.append(d)
        size += len(d)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker: dict = {}


def _init_encoder(model_bytes: bytes, dtype: str, val_fraction: float) -> None:
    _worker.update(tokenizer=Tokenizer(model_bytes), dtype=np.dtype(dtype), val_fraction=val_fraction)


def _encode_chunk(texts: list[str]) -> tuple[dict[str, bytes], dict[str, SplitStats]]:
    tok, dtype, frac = _worker["tokenizer"], _worker["dtype"], _worker["val_fraction"]
    parts = {split: [] for split in SPLITS}
    for t in texts:
        parts["val" if is_validation(t, frac) else "train"].append(t)
    out, stats = {}, {}
    for split, part in parts.items():
        ids = tok.encode_batch(part) if part else []
        lengths = [len(x) + 1 for x in ids]
        arr = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for x, n in zip(ids, lengths):
            arr[pos:pos + n - 1] = x
            arr[pos + n - 1] = tok.eos_id
            pos += n
        out[split] = arr.tobytes()
        stats[split] = SplitStats(tokens=arr.size, docs=len(part), chars=sum(len(t) for t in part),
                                  bytes=sum(len(t.encode("utf-8")) for t in part))
    return out, stats


# ---- the build -------------------------------------------------------------------------------
def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _kill_hook(committed: int) -> None:
    limit = os.environ.get(KILL_AFTER_ENV)
    if limit is not None and committed >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


def _build_source(work: Path, name: str, docs: Iterable[str], state: dict, pool, chunk_chars: int,
                  on_chunk: Callable[[int], None]) -> None:
    """Append ``docs``' chunks after the ``state["chunks"]`` already committed."""
    files = {}
    try:
        for split in SPLITS:
            path = work / f"{name}.{split}.bin"
            path.touch()
            f = path.open("r+b")
            f.truncate(state[split]["file_bytes"])  # drop a chunk that was written but not committed
            f.seek(0, os.SEEK_END)
            files[split] = f
        chunks = char_chunks(docs, chunk_chars)
        skip = state["chunks"]
        todo = (c for i, c in enumerate(chunks) if i >= skip)  # finished chunks are read, not tokenized
        for data, stats in ordered_map(_encode_chunk, todo, pool):
            for split in SPLITS:
                files[split].write(data[split])
                files[split].flush()
                os.fsync(files[split].fileno())
                st = SplitStats(**{k: state[split][k] for k in ("tokens", "docs", "chars", "bytes")})
                st.add(stats[split])
                state[split].update(st.__dict__, file_bytes=state[split]["file_bytes"] + len(data[split]))
            state["chunks"] += 1
            on_chunk(sum(stats[split].chars for split in SPLITS))
        state["done"] = True
    finally:
        for f in files.values():
            f.close()


def build_shards(
    root: str | os.PathLike,
    sources: list[tuple[str, str, Iterable[str]]],
    fingerprints: list[str],
    tokenizer: Tokenizer,
    val_fraction: float,
    num_proc: int = 1,
    chunk_chars: int = CHUNK_CHARS,
    total_chars: int | None = None,
) -> Path:
    """Tokenize ``sources`` (name, language, documents) into ``root/<key>/`` unless it exists.

    Returns the shard directory. An interrupted build of the same key resumes (see the module
    docstring); ``root/<key>/build.json`` records how many chunks were tokenized and reused.
    ``total_chars``: the characters of all sources, if known, for the progress bar's ETA.
    """
    key = shard_key(fingerprints, tokenizer.sha256, val_fraction)
    root = Path(root)
    final = root / key
    if (final / INDEX_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder of this key finishes first
        if (final / INDEX_FILE).is_file():
            return final
        return _build_locked(root, key, sources, fingerprints, tokenizer, val_fraction, num_proc, chunk_chars,
                             total_chars)


def _build_locked(root, key, sources, fingerprints, tokenizer, val_fraction, num_proc, chunk_chars,
                  total_chars=None) -> Path:
    final = root / key
    work = root / f".{key}.partial"
    work.mkdir(exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    blank = {"key": key, "sources": {}}
    try:
        progress = json.loads((work / PROGRESS_FILE).read_text())
        if progress.get("key") != key:
            progress = blank
    except (OSError, json.JSONDecodeError):
        progress = blank
    resumed = sum(st["chunks"] for st in progress["sources"].values())
    committed = [0]
    bar = progress_bar("shards: tokenize", total=total_chars, unit="char", unit_scale=True)
    bar.update(sum(st[split]["chars"] for st in progress["sources"].values() for split in SPLITS))  # resumed

    def on_chunk(chars: int) -> None:
        bar.update(chars)
        _write_json(work / PROGRESS_FILE, progress)
        committed[0] += 1
        _kill_hook(committed[0])

    pool = None
    initargs = (tokenizer.model_bytes, dtype.name, val_fraction)
    if num_proc > 1:
        pool = mp.get_context("spawn").Pool(num_proc, initializer=_init_encoder, initargs=initargs)
    else:
        _init_encoder(*initargs)
    try:
        for (name, language, docs), fp in zip(sources, fingerprints):
            state = progress["sources"].setdefault(name, {
                "chunks": 0, "done": False, "language": language, "fingerprint": fp,
                **{split: {"tokens": 0, "docs": 0, "chars": 0, "bytes": 0, "file_bytes": 0} for split in SPLITS}})
            if not state["done"]:
                _build_source(work, name, docs, state, pool, chunk_chars, on_chunk)
                _write_json(work / PROGRESS_FILE, progress)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    index = {"version": FORMAT_VERSION, "key": key, "dtype": dtype.name,
             "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
             "val_fraction": val_fraction, "checksum": {"algorithm": CHECKSUM, "block_bytes": BLOCK_BYTES},
             "sources": {}}
    for (name, language, _), fp in zip(sources, fingerprints):
        st = progress["sources"][name]
        index["sources"][name] = {"language": language, "fingerprint": fp, **{
            split: {"file": f"{name}.{split}.bin", **{k: st[split][k] for k in ("tokens", "docs", "chars", "bytes")},
                    "blocks": block_checksums(work / f"{name}.{split}.bin", BLOCK_BYTES)}
            for split in SPLITS}}
    (work / INDEX_FILE).write_text(json.dumps(index, indent=2))
    total = sum(st["chunks"] for st in progress["sources"].values())
    (work / BUILD_FILE).write_text(json.dumps({"chunks": total, "chunks_reused": resumed,
                                               "chunks_tokenized": total - resumed, "chunk_chars": chunk_chars,
                                               "num_proc": num_proc}, indent=2))
    (work / PROGRESS_FILE).unlink()
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
