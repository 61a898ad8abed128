"""Count-based baselines on the run's own tokenizer and training text: an add-one unigram and an
interpolated Kneser-Ney bigram, per language, counted from the training shards.

A randomly initialised twin is the weakest possible baseline: a model that has learned only token
frequencies already beats it by a wide margin. These tables answer the next two questions: has the
model learned more than frequencies (below the unigram), and has it learned context (below the
bigram)? Both are scored exactly like the model (:func:`bnlit.evaluation.heldout.evaluate_stream`): the
stream ``[eos] doc_1 [eos] doc_2 [eos] ...``, every token after the first predicted once, so their
NLL/token, bits/char and bits/byte sit in the same table as the trained model's.

- **unigram**, add-one (Laplace): ``p(w) = (c(w) + 1) / (N + V)``.
- **bigram**, interpolated Kneser-Ney (Kneser & Ney 1995; Chen & Goodman 1998, eq. 26)::

      p(w | v) = max(c(v, w) - D, 0) / c(v) + D * N1+(v .) / c(v) * p_cont(w)
      p_cont(w) = max(N1+(. w) - D1, 0) / N1+(. .) + D1 * |{w : N1+(. w) > 0}| / N1+(. .) / V

  with ``p(w | v) = p_cont(w)`` for a context never seen, and each order's discount from its own
  counts of counts, ``D = n1 / (n1 + 2 n2)`` (Ney, Essen & Kneser 1994). The continuation
  unigram is interpolated with the uniform distribution, so no token gets probability zero.

Counts are small (a sorted array of the distinct bigrams seen), saved with the run as
``<run dir>/baselines/ngram_<lang>.npz`` and reloaded by ``scripts/evaluate.py``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bnlit.evaluation.heldout import EvalResult

BASELINES = ("unigram", "bigram")
BASELINE_DIR = "baselines"


def discount(counts: np.ndarray) -> float:
    """Ney et al.'s absolute discount ``n1 / (n1 + 2 n2)`` from the counts of counts; 0.5 when
    there is no singleton (the estimate would be 0 and leave nothing for unseen events)."""
    n1, n2 = int(np.sum(counts == 1)), int(np.sum(counts == 2))
    return n1 / (n1 + 2 * n2) if n1 else 0.5


@dataclass
class NgramCounts:
    """Unigram and bigram counts of one language's training stream.

    ``unigram[w]``: times ``w`` was predicted (every stream position after the first);
    ``bigram_keys``: the distinct pairs ``v * V + w`` in increasing order, ``bigram_counts`` their counts.
    """

    vocab_size: int
    unigram: np.ndarray
    bigram_keys: np.ndarray
    bigram_counts: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.unigram.sum())

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def from_stream(cls, stream: np.ndarray, vocab_size: int) -> "NgramCounts":
        """Counts of one token stream laid out as ``[eos] doc [eos] doc [eos] ...``."""
        s = np.asarray(stream, dtype=np.int64)
        if s.size and (s.min() < 0 or s.max() >= vocab_size):
            raise ValueError(f"token ids outside [0, {vocab_size}) in the n-gram stream")
        unigram = np.bincount(s[1:], minlength=vocab_size).astype(np.int64)
        keys, counts = np.unique(s[:-1] * vocab_size + s[1:], return_counts=True)
        return cls(vocab_size, unigram, keys, counts.astype(np.int64))

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
        np.savez_compressed(tmp, vocab_size=np.int64(self.vocab_size), unigram=self.unigram,
                            bigram_keys=self.bigram_keys, bigram_counts=self.bigram_counts)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NgramCounts":
        with np.load(path) as z:
            return cls(int(z["vocab_size"]), z["unigram"], z["bigram_keys"], z["bigram_counts"])

    # ---- probabilities -------------------------------------------------------------------
    def unigram_logprob(self) -> np.ndarray:
        """ln p(w) of the add-one unigram, for every token id."""
        return np.log((self.unigram + 1.0) / (self.tokens + self.vocab_size))

    def continuation(self) -> np.ndarray:
        """``p_cont(w)``: the Kneser-Ney lower order, interpolated with uniform."""
        V = self.vocab_size
        n_prev = np.bincount(self.bigram_keys % V, minlength=V).astype(np.float64)  # N1+(. w)
        types = n_prev.sum()  # N1+(. .)
        if types == 0:
            return np.full(V, 1.0 / V)
        d1 = discount(n_prev[n_prev > 0])
        return np.maximum(n_prev - d1, 0.0) / types + d1 * np.count_nonzero(n_prev) / types / V

    def bigram_logprob(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """ln p(nxt | prev) of the interpolated Kneser-Ney bigram, elementwise."""
        V = self.vocab_size
        prev, nxt = np.asarray(prev, dtype=np.int64), np.asarray(nxt, dtype=np.int64)
        d = discount(self.bigram_counts)
        ctx = self.bigram_keys // V
        c_ctx = np.bincount(ctx, weights=self.bigram_counts, minlength=V)  # c(v)
        n_follow = np.bincount(ctx, minlength=V).astype(np.float64)  # N1+(v .)
        p_cont = self.continuation()
        keys = prev * V + nxt
        c_vw = np.zeros(keys.shape, dtype=np.float64)
        if len(self.bigram_keys):
            pos = np.minimum(np.searchsorted(self.bigram_keys, keys), len(self.bigram_keys) - 1)
            found = self.bigram_keys[pos] == keys
            c_vw[found] = self.bigram_counts[pos[found]]
        cv = c_ctx[prev]
        seen = cv > 0
        safe = np.where(seen, cv, 1.0)
        p = np.where(seen, (np.maximum(c_vw - d, 0.0) + d * n_follow[prev] * p_cont[nxt]) / safe, p_cont[nxt])
        return np.log(p)

    # ---- scoring ---------------------------------------------------------------------------
    def nll(self, stream: np.ndarray, order: str) -> tuple[float, int]:
        """Summed NLL (nats) and number of scored tokens of ``stream`` (every token after the
        first, as :func:`bnlit.evaluation.heldout.evaluate_stream` scores a model)."""
        s = np.asarray(stream, dtype=np.int64)
        if s.size < 2:
            return 0.0, 0
        if order == "unigram":
            lp = self.unigram_logprob()[s[1:]]
        elif order == "bigram":
            lp = self.bigram_logprob(s[:-1], s[1:])
        else:
            raise ValueError(f"n-gram order {order!r}: use one of {BASELINES}")
        return float(-lp.sum()), int(s.size - 1)

    def evaluate(self, stream: np.ndarray, chars: int, nbytes: int) -> dict[str, EvalResult]:
        """``{"unigram": EvalResult, "bigram": EvalResult}`` of ``stream``, whose text has
        ``chars`` characters and ``nbytes`` UTF-8 bytes."""
        return {order: EvalResult(*self.nll(stream, order), chars, nbytes) for order in BASELINES}


def training_streams(shard_dir: str | os.PathLike, index: dict, eos_id: int) -> dict[str, np.ndarray]:
    """Each language's training tokens as one stream ``[eos] doc [eos] ...`` (its sources' train
    shards, which end every document with ``eos``, concatenated in index order)."""
    from bnlit.data.shards import read_tokens

    parts: dict[str, list[np.ndarray]] = {}
    for name, entry in index["sources"].items():
        parts.setdefault(entry["language"], []).append(np.asarray(read_tokens(shard_dir, index, name, "train")))
    head = np.asarray([eos_id], dtype=np.int64)
    return {lang: np.concatenate([head] + [a.astype(np.int64) for a in arrays]) for lang, arrays in parts.items()}


def count_languages(streams: dict[str, np.ndarray], vocab_size: int) -> dict[str, NgramCounts]:
    return {lang: NgramCounts.from_stream(s, vocab_size) for lang, s in streams.items()}


def _merge(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, dtype=np.int64)
    return keys[starts], np.add.reduceat(counts, starts) if keys.size else counts


def count_shards(shard_dir: str | os.PathLike, index: dict, eos_id: int, vocab_size: int,
                 chunk_tokens: int = 1 << 24, max_tokens: int | None = None) -> dict[str, NgramCounts]:
    """:func:`count_languages` of :func:`training_streams` without holding a language's stream in
    memory: the memory-mapped shards are read in chunks of ``chunk_tokens`` (each chunk's first
    pair joins it to the previous token) and the distinct pairs are merged as they come. With
    ``max_tokens``, each language counts only its first ``max_tokens`` training tokens."""
    from bnlit.data.shards import read_tokens

    V = vocab_size
    out: dict[str, NgramCounts] = {}
    state: dict[str, dict] = {}
    for name, entry in index["sources"].items():
        lang = entry["language"]
        st = state.setdefault(lang, {"prev": eos_id, "seen": 0, "uni": np.zeros(V, dtype=np.int64),
                                     "keys": np.zeros(0, dtype=np.int64), "counts": np.zeros(0, dtype=np.int64)})
        tokens = read_tokens(shard_dir, index, name, "train")
        for start in range(0, len(tokens), chunk_tokens):
            left = None if max_tokens is None else max_tokens - st["seen"]
            if left is not None and left <= 0:
                break
            chunk = np.asarray(tokens[start:start + (chunk_tokens if left is None else min(chunk_tokens, left))],
                               dtype=np.int64)
            s = np.concatenate([[st["prev"]], chunk])
            st["uni"] += np.bincount(chunk, minlength=V)
            k, c = np.unique(s[:-1] * V + s[1:], return_counts=True)
            st["keys"], st["counts"] = _merge(np.concatenate([st["keys"], k]), np.concatenate([st["counts"], c]))
            st["prev"], st["seen"] = int(chunk[-1]), st["seen"] + chunk.size
    for lang, st in state.items():
        out[lang] = NgramCounts(V, st["uni"], st["keys"], st["counts"].astype(np.int64))
    return out


def baseline_path(run_dir: str | os.PathLike, lang: str) -> Path:
    return Path(run_dir) / BASELINE_DIR / f"ngram_{lang}.npz"


def save_baselines(run_dir: str | os.PathLike, counts: dict[str, NgramCounts]) -> list[Path]:
    return [c.save(baseline_path(run_dir, lang)) for lang, c in counts.items()]


def load_baselines(run_dir: str | os.PathLike, languages: Iterable[str]) -> dict[str, NgramCounts]:
    """The saved counts of each of ``languages`` that the run has (missing ones are left out)."""
    out = {}
    for lang in languages:
        p = baseline_path(run_dir, lang)
        if p.is_file():
            out[lang] = NgramCounts.load(p)
    return out


# ---- verdicts: did the trained model beat each baseline --------------------------------------
def beaten(trained: EvalResult, baselines: dict[str, EvalResult]) -> dict[str, bool]:
    """Per baseline (``twin``, ``unigram``, ``bigram``...): whether the trained model's bits/char
    is below it (NLL/token would do as well: both are scored on the same stream)."""
    return {name: trained.bits_per_char < b.bits_per_char for name, b in baselines.items()}


def baseline_verdicts(trained: dict[str, EvalResult], baselines: dict[str, dict[str, EvalResult]], step: int,
                      learning_after_steps: int) -> list[str]:
    """Warnings: from ``learning_after_steps`` on, a language whose trained model is not below its
    unigram baseline has learned less than token frequencies."""
    out = []
    if step < learning_after_steps:
        return out
    for lang, t in trained.items():
        u = baselines.get(lang, {}).get("unigram")
        if u is not None and not t.bits_per_char < u.bits_per_char:
            out.append(f"baseline/{lang}: after {step} steps the trained model's {t.bits_per_char:.3f} bits/char is "
                       f"not below the add-one unigram's {u.bits_per_char:.3f} (counted from the training shards): "
                       "so far it has learned no more than token frequencies; if this persists, check "
                       "optimizer.lr, the data and the grad/ metrics")
    return out


def summary_line(lang: str, trained: EvalResult, baselines: dict[str, EvalResult]) -> str:
    """``bn: trained 3.04 bits/char; beat twin (4.07) yes, unigram (3.22) yes, bigram (2.73) NO``."""
    wins = beaten(trained, baselines)
    parts = [f"{name} ({b.bits_per_char:.3f}) {'yes' if wins[name] else 'NO'}" for name, b in baselines.items()]
    return f"{lang}: trained {trained.bits_per_char:.3f} bits/char; beat " + ", ".join(parts)


def baseline_metrics(trained: dict[str, EvalResult], baselines: dict[str, dict[str, EvalResult]]) -> dict[str, float]:
    """The ``baseline/`` metrics of each language's n-gram baselines, and ``learned_context/<lang>``:
    the bigram's bits/char minus the trained model's (positive when the model beats the bigram).
    NaNs (a slice without bytes or characters) are left out."""
    out = {}
    for lang, t in trained.items():
        for order, b in baselines.get(lang, {}).items():
            out.update({f"baseline/{lang}_{order}_nll": b.nll_per_token,
                        f"baseline/{lang}_{order}_bits_per_char": b.bits_per_char,
                        f"baseline/{lang}_{order}_bits_per_byte": b.bits_per_byte})
        if "bigram" in baselines.get(lang, {}):
            out[f"learned_context/{lang}"] = baselines[lang]["bigram"].bits_per_char - t.bits_per_char
    return {k: v for k, v in out.items() if not math.isnan(v)}


def comparison_table(results: dict[str, dict[str, EvalResult]],
                     baselines: dict[str, dict[str, EvalResult]]) -> tuple[list[str], list[list]]:
    """Columns and rows of ``twin/table``: per language the trained model against its twin
    (``results[lang] = {"trained", "twin"}``) and its n-gram baselines, and which it beat."""
    columns = ["language", "tokens", "chars", "trained_nll_per_token", "twin_nll_per_token", "nll_gap",
               "trained_bits_per_char", "twin_bits_per_char", "trained_bits_per_byte", "twin_bits_per_byte"]
    orders = [o for o in BASELINES if any(o in b for b in baselines.values())]
    columns += [f"{o}_bits_per_char" for o in orders] + [f"beat_{o}" for o in ("twin", *orders)]
    rows = []
    for lang, r in results.items():
        t, w, base = r["trained"], r["twin"], baselines.get(lang, {})
        wins = beaten(t, {"twin": w, **base})
        rows.append([lang, t.tokens, t.chars, t.nll_per_token, w.nll_per_token, w.nll_per_token - t.nll_per_token,
                     t.bits_per_char, w.bits_per_char, t.bits_per_byte, w.bits_per_byte]
                    + [base[o].bits_per_char if o in base else None for o in orders]
                    + [wins.get(o) for o in ("twin", *orders)])
    return columns, rows
