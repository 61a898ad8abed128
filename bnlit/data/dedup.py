"""Exact and near-duplicate removal, within and across sources.

* **Exact**: a document whose canonical text (normalised, lower-cased, punctuation removed,
  whitespace collapsed: :func:`canonical_words`) hashes like an earlier one's is dropped.
* **Near**: MinHash signatures of word ``shingle``-grams, indexed by ``datasketch.MinHashLSH`` at
  Jaccard ``threshold``; a document whose signature collides with an earlier document's in any
  LSH band is dropped (candidates are not re-verified: at threshold 0.8 with 128 permutations the
  banding makes pairs below ~0.6 Jaccard unlikely to collide).

The first document seen wins, in source order then document order, so which copy survives is
deterministic. Signatures (:func:`signature`) are pure and computed in worker processes; only the
index lookups run in the main process.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field

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


def exact_key(ws: list[str]) -> int:
    """64-bit hash of a document's canonical words (:func:`canonical_words`)."""
    return int.from_bytes(hashlib.blake2b(" ".join(ws).encode(), digest_size=8).digest(), "little")


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


def _minhash(num_perm: int, hashvalues=None):
    from datasketch import MinHash

    return MinHash(num_perm=num_perm, seed=1, hashfunc=xxhash.xxh32_intdigest,
                   permutations=_permutations(num_perm), hashvalues=hashvalues, scheme=SCHEME)


def signature(ws: list[str], cfg: DedupConfig) -> np.ndarray:
    """MinHash hash values (``num_perm`` uint32) of the word shingles of ``ws``."""
    m = _minhash(cfg.num_perm)
    m.update_batch(shingles(ws, cfg.shingle))
    return m.hashvalues


@dataclass
class DedupStats:
    exact: Counter = field(default_factory=Counter)  # per source: documents dropped
    near: Counter = field(default_factory=Counter)
    exact_cross: Counter = field(default_factory=Counter)  # of those, whose kept copy is in another source
    near_cross: Counter = field(default_factory=Counter)
    chars: Counter = field(default_factory=Counter)  # per source: characters dropped

    def to_dict(self) -> dict:
        # not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs
        return {f: dict(getattr(self, f)) for f in self.__dataclass_fields__}


class Deduplicator:
    """Stateful first-seen-wins index over all sources of a build."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.stats = DedupStats()
        self._exact: dict[int, str] = {}
        self._owner: list[str] = []  # LSH key -> source name
        self._lsh = None
        if cfg.near:
            from datasketch import MinHashLSH

            self._lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)

    def check(self, source: str, key: int | None, sig: np.ndarray | None, n_chars: int) -> str | None:
        """Return ``"exact"``/``"near"`` for a duplicate (counted) or None after indexing it."""
        if self.cfg.exact and key is not None:
            owner = self._exact.get(key)
            if owner is not None:
                self._count("exact", source, owner, n_chars)
                return "exact"
        if self._lsh is not None and sig is not None:
            m = _minhash(self.cfg.num_perm, hashvalues=sig)
            hits = self._lsh.query(m)
            if hits:
                self._count("near", source, self._owner[min(hits)], n_chars)
                return "near"
            self._lsh.insert(len(self._owner), m, check_duplication=False)
            self._owner.append(source)
        if self.cfg.exact and key is not None:
            self._exact[key] = source
        return None

    def _count(self, kind: str, source: str, owner: str, n_chars: int) -> None:
        getattr(self.stats, kind)[source] += 1
        if owner != source:
            getattr(self.stats, f"{kind}_cross")[source] += 1
        self.stats.chars[source] += n_chars


def deduplicate(docs: list[tuple[str, str]], cfg: DedupConfig | None = None) -> tuple[list[tuple[str, str]], DedupStats]:
    """``(source, text)`` pairs without their exact and near duplicates (in-process helper)."""
    cfg = cfg or DedupConfig()
    d = Deduplicator(cfg)
    kept = []
    for source, text in docs:
        ws = canonical_words(text)
        key = exact_key(ws) if cfg.exact else None
        sig = signature(ws, cfg) if cfg.near else None
        if d.check(source, key, sig, len(text)) is None:
            kept.append((source, text))
    return kept, d.stats
