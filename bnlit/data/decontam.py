"""Evaluation decontamination: training documents that share a long word n-gram (default 13, as
in GPT-3, Brown et al. 2020, appendix C) with a registered evaluation set are dropped (``mode:
drop``) or counted and kept (``mode: flag``).

Evaluation sets are the run's validation slices (one set per language, registered by the data
pipeline), user-listed benchmark files (``data.clean.decontam.eval_files``) and any file an
evaluation tool checks with :func:`contamination` against the training text.

A training document *touches* an evaluation document when they share any n-gram (the GPT-3
rule); it is *contaminated* by it when the shared n-grams are at least ``min_overlap`` of the
evaluation document's distinct n-grams (``min_overlap: 0`` makes any shared n-gram
contaminating). The default 0.05 ignores the boilerplate that long documents share (a textbook
preface, a licence line: in the embedded Bangla books, at most 0.2% of a book's 13-grams) and
catches copied passages, sentences and short benchmark items (100%). Both counts are reported,
so a threshold that hides a leak is visible. Words are
:func:`bnlit.data.dedup.canonical_words` of the normalised text, so punctuation, case and
whitespace differences do not hide a copy. An evaluation document shorter than ``n`` words cannot
be checked and is counted as ``too_short``.

The index keeps one sorted ``uint64`` array of n-gram hashes per set (8 bytes per n-gram) with the
evaluation document each came from, so the report can say both how many training documents an
evaluation set contaminated and what share of that set's documents appear in training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import xxhash

from bnlit.data.dedup import canonical_words
from bnlit.errors import ConfigError

MODES = ("drop", "flag")


@dataclass
class DecontamConfig:
    enabled: bool = True
    ngram: int = 13
    min_overlap: float = 0.05
    mode: str = "drop"
    against_validation: bool = True
    eval_files: list = field(default_factory=list)  # paths or {path, name, text_field}

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"data.clean.decontam.mode={self.mode!r}: use one of {list(MODES)}")
        if not 0.0 <= self.min_overlap <= 1.0:
            raise ConfigError(f"data.clean.decontam.min_overlap={self.min_overlap}: must be in [0, 1]")
        if self.ngram < 3:
            raise ConfigError(f"data.clean.decontam.ngram={self.ngram}: use at least 3 words (13 is the default)")

    @classmethod
    def from_dict(cls, d: dict | None) -> "DecontamConfig":
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"data.clean.decontam: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        d["eval_files"] = [f if isinstance(f, str) else dict(f) for f in (d.get("eval_files") or [])]
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def ngram_hashes(ws: list[str], n: int) -> np.ndarray:
    """uint64 hashes of every word n-gram of ``ws`` (empty if fewer than ``n`` words)."""
    if len(ws) < n:
        return np.zeros(0, dtype=np.uint64)
    # hash each word once, then combine n consecutive word hashes with distinct odd multipliers
    wh = np.fromiter((xxhash.xxh64_intdigest(w.encode()) for w in ws), dtype=np.uint64, count=len(ws))
    mult = np.array([(0x9E3779B97F4A7C15 * (2 * i + 1)) & 0xFFFFFFFFFFFFFFFF for i in range(n)], dtype=np.uint64)
    m = len(ws) - n + 1
    out = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            out ^= wh[i:i + m] * mult[i]
            out = (out << np.uint64(13)) | (out >> np.uint64(51))
    return out


@dataclass
class EvalSet:
    name: str
    docs: int = 0
    too_short: int = 0
    hashes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    owners: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    doc_ngrams: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # distinct n-grams per document
    hit_docs: set = field(default_factory=set)  # evaluation documents contaminating training
    touched_docs: set = field(default_factory=set)  # evaluation documents sharing any n-gram
    train_docs_hit: int = 0  # training documents contaminated by this set
    train_chars_hit: int = 0
    train_docs_touched: int = 0  # training documents sharing any n-gram with this set
    found: list = field(default_factory=list)  # arrays of this set's n-gram hashes seen in training

    def ngrams_found(self) -> tuple[int, int]:
        """(distinct n-grams of this set found in training, distinct n-grams of this set)."""
        distinct = np.unique(self.hashes)
        if not self.found or distinct.size == 0:
            return 0, int(distinct.size)
        return int(np.isin(distinct, np.concatenate(self.found)).sum()), int(distinct.size)

    def summary(self) -> dict:
        checked = self.docs - self.too_short
        found, distinct = self.ngrams_found()
        return {"docs": self.docs, "too_short": self.too_short, "ngrams": int(self.hashes.size),
                "ngrams_in_training": found, "ngram_rate": found / distinct if distinct else 0.0,
                "eval_docs_contaminated": len(self.hit_docs),
                "contamination_rate": len(self.hit_docs) / checked if checked else 0.0,
                "eval_docs_touched": len(self.touched_docs),
                "touched_rate": len(self.touched_docs) / checked if checked else 0.0,
                "train_docs_hit": self.train_docs_hit, "train_chars_hit": self.train_chars_hit,
                "train_docs_touched": self.train_docs_touched}

    def record(self, any_owners: np.ndarray, hit_owners: np.ndarray, n_chars: int) -> None:
        self.train_docs_touched += 1
        self.touched_docs.update(any_owners.tolist())
        if hit_owners.size:
            self.train_docs_hit += 1
            self.train_chars_hit += n_chars
            self.hit_docs.update(hit_owners.tolist())


class _Builder:
    def __init__(self, name: str, n: int):
        self.set = EvalSet(name)
        self.n = n
        self._parts: list[np.ndarray] = []
        self._owners: list[np.ndarray] = []
        self._counts: list[int] = []

    def add(self, text: str) -> None:
        h = np.unique(ngram_hashes(canonical_words(text), self.n))
        if h.size == 0:
            self.set.too_short += 1
        self._counts.append(h.size)
        self._parts.append(h)
        self._owners.append(np.full(h.size, self.set.docs, dtype=np.int64))
        self.set.docs += 1

    def finish(self) -> EvalSet:
        if self._parts:
            h = np.concatenate(self._parts)
            o = np.concatenate(self._owners)
            order = np.argsort(h, kind="stable")
            self.set.hashes, self.set.owners = h[order], o[order]
            self.set.doc_ngrams = np.asarray(self._counts, dtype=np.int64)
        self._parts, self._owners, self._counts = [], [], []
        return self.set


class Decontaminator:
    """Register evaluation texts with :meth:`add`, then :meth:`freeze` and :meth:`check` training
    documents."""

    def __init__(self, ngram: int = 13, min_overlap: float = 0.05):
        self.n = ngram
        self.min_overlap = min_overlap
        self._builders: dict[str, _Builder] = {}
        self.sets: dict[str, EvalSet] = {}

    def add(self, set_name: str, text: str) -> None:
        if self.sets:
            raise RuntimeError("Decontaminator is frozen; register every evaluation text first")
        self._builders.setdefault(set_name, _Builder(set_name, self.n)).add(text)

    def freeze(self) -> "Decontaminator":
        self.sets = {name: b.finish() for name, b in self._builders.items()}
        return self

    def matches(self, ws: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per evaluation set, (indices of its documents sharing any n-gram with the training words
        ``ws``, indices of those reaching ``min_overlap``, the shared n-gram hashes); sets without
        a shared n-gram are left out."""
        h = ngram_hashes(ws, self.n)
        out = {}
        if h.size == 0:
            return out
        h = np.unique(h)
        for name, s in self.sets.items():
            if s.hashes.size == 0:
                continue
            lo = np.searchsorted(s.hashes, h, side="left")
            hi = np.searchsorted(s.hashes, h, side="right")
            hit = hi > lo
            if hit.any():
                owners = np.concatenate([s.owners[a:b] for a, b in zip(lo[hit], hi[hit])])
                docs, shared = np.unique(owners, return_counts=True)
                over = shared >= np.maximum(1, self.min_overlap * s.doc_ngrams[docs])
                out[name] = (docs, docs[over], h[hit])
        return out

    def record(self, found: dict, n_chars: int) -> list[str]:
        """Count one training document's :meth:`matches`; return the sets it is contaminated
        with."""
        for name, (any_owners, hit_owners, shared) in found.items():
            self.sets[name].record(any_owners, hit_owners, n_chars)
            self.sets[name].found.append(shared)
        return sorted(name for name, (_, hit, _) in found.items() if hit.size)

    def check(self, text: str, ws: list[str] | None = None) -> list[str]:
        """The evaluation sets ``text`` (a training document) is contaminated with; counted."""
        return self.record(self.matches(canonical_words(text) if ws is None else ws), len(text))

    def summary(self) -> dict[str, dict]:
        return {name: s.summary() for name, s in self.sets.items()}

    # ---- on disk, for tasks that share the work (bnlit.data.steps) ---------------------------
    def save(self, path: str | os.PathLike) -> None:
        """The frozen index: each set's n-gram hashes, owners and per-document n-gram counts."""
        arrays = {"meta": np.frombuffer(json.dumps({
            "ngram": self.n, "min_overlap": self.min_overlap,
            "sets": {name: {"docs": s.docs, "too_short": s.too_short} for name, s in self.sets.items()}}).encode(), np.uint8)}
        for i, s in enumerate(self.sets.values()):
            arrays.update({f"hashes{i}": s.hashes, f"owners{i}": s.owners, f"doc_ngrams{i}": s.doc_ngrams})
        _save_npz(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Decontaminator":
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes())
            d = cls(meta["ngram"], meta["min_overlap"])
            for i, (name, m) in enumerate(meta["sets"].items()):
                d.sets[name] = EvalSet(name, m["docs"], m["too_short"], z[f"hashes{i}"], z[f"owners{i}"],
                                       z[f"doc_ngrams{i}"])
        return d

    def save_counts(self, path: str | os.PathLike) -> None:
        """What :meth:`record` counted here, for :func:`merge_counts` (one task's share)."""
        arrays = {"meta": np.frombuffer(json.dumps({name: {k: getattr(s, k) for k in COUNTERS}
                                                    for name, s in self.sets.items()}).encode(), np.uint8)}
        for i, s in enumerate(self.sets.values()):
            arrays[f"hit{i}"] = np.fromiter(sorted(s.hit_docs), np.int64, len(s.hit_docs))
            arrays[f"touched{i}"] = np.fromiter(sorted(s.touched_docs), np.int64, len(s.touched_docs))
            arrays[f"found{i}"] = np.unique(np.concatenate(s.found)) if s.found else np.zeros(0, np.uint64)
        _save_npz(path, arrays)

    def merge_counts(self, path: str | os.PathLike) -> None:
        """Add one task's :meth:`save_counts` to this index's sets."""
        with np.load(path) as z:
            meta = json.loads(z["meta"].tobytes())
            for i, (name, counts) in enumerate(meta.items()):
                s = self.sets[name]
                for k in COUNTERS:
                    setattr(s, k, getattr(s, k) + counts[k])
                s.hit_docs.update(z[f"hit{i}"].tolist())
                s.touched_docs.update(z[f"touched{i}"].tolist())
                if z[f"found{i}"].size:
                    s.found.append(z[f"found{i}"])


COUNTERS = ("train_docs_hit", "train_chars_hit", "train_docs_touched")


def _save_npz(path: str | os.PathLike, arrays: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def contamination(eval_texts: Iterable[str], train_texts: Iterable[str], ngram: int = 13,
                  min_overlap: float = 0.05, name: str = "eval") -> dict:
    """Contamination of one evaluation set by a training text stream (for evaluation tools that
    get a file after the shards were built, e.g. with :func:`bnlit.data.pipeline.read_clean`):
    :meth:`EvalSet.summary`."""
    d = Decontaminator(ngram, min_overlap)
    for t in eval_texts:
        d.add(name, t)
    d.freeze()
    if name not in d.sets:
        return EvalSet(name).summary()
    for t in train_texts:
        d.check(t)
    return d.sets[name].summary()
