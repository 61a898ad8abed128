"""Exact and near-duplicate removal, within and across sources: what is compared (pure
functions); the datatrove steps that do it at scale are in :mod:`bnlit.data.steps`.

* **Exact**: a document whose canonical text (normalised, lower-cased, punctuation removed,
  whitespace collapsed: :func:`canonical_words`) hashes like an earlier one's is dropped
  (datatrove's exact-dedup stages).
* **Near**: MinHash values of word ``shingle``-grams (:func:`signature`), cut into the LSH bands
  datasketch's ``MinHashLSH`` picks for Jaccard ``threshold`` (:func:`lsh_bands`); a document
  that shares a band with an earlier *kept* document is dropped (datatrove's MinHash stages with
  bnlit's first-seen clustering; candidates are not re-verified: at threshold 0.8 with 128
  permutations the banding makes pairs below ~0.6 Jaccard unlikely to collide).

The first document seen wins, in source order then document order, so which copy survives is
deterministic and does not depend on how many tasks share the work.
"""

from __future__ import annotations

import unicodedata
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from bnlit.errors import ConfigError


def _punct_table() -> dict[int, str]:
    return {cp: " " for cp in range(0x10000) if unicodedata.category(chr(cp))[0] in "PS"}


_PUNCT = _punct_table()


def canonical_words(text: str) -> list[str]:
    """Lower-cased words with punctuation and symbols (danda included) turned into spaces; used
    by exact dedup, MinHash shingles and decontamination n-grams alike."""
    return text.lower().translate(_PUNCT).split()


def shingles(ws: list[str], n: int) -> list[bytes]:
    if len(ws) < n:
        return [" ".join(ws).encode()] if ws else []
    return [" ".join(ws[i:i + n]).encode() for i in range(len(ws) - n + 1)]


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"data.clean.dedup.threshold={self.threshold}: must be in (0, 1)")
        if self.num_perm < 16 or self.shingle < 1:
            raise ConfigError("data.clean.dedup: num_perm must be >= 16 and shingle >= 1")

    @classmethod
    def from_dict(cls, d: dict | None) -> "DedupConfig":
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"data.clean.dedup: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


SCHEME = "affine32"  # datasketch 2.x default: 32-bit hash values
_PERMUTATIONS: dict[int, tuple] = {}


def _permutations(num_perm: int):
    if num_perm not in _PERMUTATIONS:
        from datasketch import MinHash

        _PERMUTATIONS[num_perm] = MinHash(num_perm=num_perm, seed=1, scheme=SCHEME).permutations
    return _PERMUTATIONS[num_perm]


_FMIX32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)  # MurmurHash3's 32-bit finalizer


def minhash_values(shingle_hashes, num_perm: int) -> np.ndarray:
    """MinHash values (``num_perm`` uint32) of a document's shingle hashes (xxh32 of each
    shingle): datasketch's ``affine32`` scheme with seed 1 (each hash pre-mixed with the
    MurmurHash3 finalizer, then ``a * h + b`` mod 2**32, the minimum per permutation), computed
    on the whole array at once; tests/data/test_dedup.py checks it against datasketch's ``MinHash``."""
    a, b = (np.asarray(x, dtype=np.uint32) for x in _permutations(num_perm))
    hv = np.asarray(shingle_hashes, dtype=np.uint64).astype(np.uint32)
    if hv.size == 0:
        return np.full(num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
    s1, m1, s2, m2, s3 = _FMIX32
    with np.errstate(over="ignore"):
        hv = hv ^ (hv >> np.uint32(s1))
        hv = hv * np.uint32(m1)
        hv = hv ^ (hv >> np.uint32(s2))
        hv = hv * np.uint32(m2)
        hv = hv ^ (hv >> np.uint32(s3))
        return (hv[:, None] * a + b).min(axis=0)


def signature(ws: list[str], cfg: DedupConfig) -> np.ndarray:
    """MinHash values of the word shingles of ``ws`` (:func:`minhash_values`)."""
    return minhash_values([xxhash.xxh32_intdigest(s) for s in shingles(ws, cfg.shingle)], cfg.num_perm)


def lsh_bands(cfg: DedupConfig) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's ``MinHashLSH`` picks for ``cfg.threshold`` and
    ``cfg.num_perm`` (equal false-positive and false-negative weights): 9 x 13 at 0.8 / 128."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    return lsh.b, lsh.r
