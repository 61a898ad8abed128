"""Dead vocabulary: tokenizer pieces the model never trained on.

A piece that never occurs in the training shards has an embedding row that only ever moves by
weight decay and, through a tied output head, by being pushed down in every softmax: at inference
it is a random vector. A piece that occurs but never as an *input* (a row never looked up) gets
no input-side gradient at all (an embedding's backward adds the output gradient into the rows of
the ids that were looked up, and nothing else). Many such pieces mean the tokenizer was trained
on other text than the model, or a language's data never reached the model.

:func:`dead_vocabulary` lists both kinds with their count, share of the vocabulary, a sample, and
the language each piece belongs to by its script (Bengali block: ``bn``, Latin: ``en``, otherwise
``und``); byte-fallback and special pieces are counted apart, since most bytes never occur in
UTF-8 text of two scripts and ``<pad>``/``<s>`` are never used by design."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np

from bnlit.checks.fertility import detect_language

KINDS = ("piece", "byte", "special")


def piece_kind(sp, i: int) -> str:
    if sp.is_byte(i):
        return "byte"
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
        return "special"
    return "piece"


def piece_language(piece: str) -> str:
    """``bn``/``en``/``und`` by the script of the piece's letters (SentencePiece's ``▁`` is a space)."""
    return detect_language(piece.replace("\u2581", " "))


def _describe(sp, ids: np.ndarray, vocab_size: int, sample: int) -> dict:
    kinds = [piece_kind(sp, int(i)) for i in ids]
    pieces = [int(i) for i, k in zip(ids, kinds) if k == "piece"]
    langs = Counter(piece_language(sp.id_to_piece(i)) for i in pieces)
    return {
        "count": int(ids.size),
        "share": ids.size / vocab_size,
        "by_kind": {k: kinds.count(k) for k in KINDS},
        "pieces": len(pieces),
        "pieces_share": len(pieces) / vocab_size,
        "by_language": dict(sorted(langs.items())),
        "sample": [sp.id_to_piece(i) for i in pieces[:sample]],
        "ids": [int(i) for i in ids],
    }


def dead_vocabulary(tokenizer, train_counts: Mapping[str, np.ndarray], looked_up: np.ndarray | None = None,
                    sample: int = 20) -> dict:
    """The report of one run.

    Args:
        tokenizer: a :class:`bnlit.tokenizer.Tokenizer`.
        train_counts: per language, how often each token id occurs in the training shards
            (:attr:`bnlit.evaluation.ngram.NgramCounts.unigram`).
        looked_up: per token id, whether it was ever an input of a training batch (None: not tracked).
        sample: how many pieces to name in each list.

    Returns: ``never_in_training`` (and ``never_looked_up`` when tracked), each with ``count``,
    ``share``, ``by_kind``, ``pieces`` (ordinary pieces only), ``pieces_share``,
    ``by_language``, ``sample`` and every ``ids``; and ``by_training_language``: how many
    ordinary pieces each language's shards never use.
    """
    sp, V = tokenizer.sp, tokenizer.vocab_size
    total = np.zeros(V, dtype=np.int64)
    for c in train_counts.values():
        total += np.asarray(c[:V], dtype=np.int64)
    out = {"vocab_size": V, "never_in_training": _describe(sp, np.flatnonzero(total == 0), V, sample)}
    if looked_up is not None:
        out["never_looked_up"] = _describe(sp, np.flatnonzero(~np.asarray(looked_up[:V], dtype=bool)), V, sample)
    ordinary = np.array([piece_kind(sp, i) == "piece" for i in range(V)])
    out["by_training_language"] = {lang: int(np.sum(ordinary & (np.asarray(c[:V]) == 0)))
                                   for lang, c in train_counts.items()}
    return out


def format_report(report: dict) -> str:
    V = report["vocab_size"]
    lines = []
    for key, what in (("never_in_training", "never in the training shards"),
                      ("never_looked_up", "never an input in training (embedding row got no gradient)")):
        r = report.get(key)
        if r is None:
            continue
        langs = ", ".join(f"{k} {v}" for k, v in r["by_language"].items()) or "none"
        lines.append(f"dead vocabulary: {r['pieces']} of {V} pieces ({100 * r['pieces_share']:.1f}%) {what} "
                     f"[by script: {langs}; also {r['by_kind']['byte']} byte and {r['by_kind']['special']} "
                     f"special pieces]" + (f"; e.g. {' '.join(r['sample'][:10])}" if r["sample"] else ""))
    return "\n".join(lines)


def training_counts(datamodule, chunk_tokens: int = 1 << 24) -> dict[str, np.ndarray]:
    """Per language, how often each token id occurs in the training shards (read in chunks)."""
    from bnlit.data.shards import read_tokens

    V = datamodule.tokenizer.vocab_size
    out: dict[str, np.ndarray] = {}
    for name, entry in datamodule.index["sources"].items():
        counts = out.setdefault(entry["language"], np.zeros(V, dtype=np.int64))
        tokens = read_tokens(datamodule.shard_dir, datamodule.index, name, "train")
        for start in range(0, len(tokens), chunk_tokens):
            counts += np.bincount(np.asarray(tokens[start:start + chunk_tokens], dtype=np.int64), minlength=V)
    return out


LISTS = ("never_in_training", "never_looked_up")


def dead_vocabulary_metrics(report: Mapping) -> dict[str, float]:
    """The ``vocab/`` metrics of a :func:`dead_vocabulary` report: pieces and share per list."""
    out = {}
    for key in LISTS:
        if report.get(key) is not None:
            out |= {f"vocab/{key}": report[key]["pieces"], f"vocab/{key}_share": report[key]["pieces_share"]}
    return out


def dead_vocabulary_table(report: Mapping) -> tuple[list[str], list[list]]:
    """Columns and rows of ``vocab/dead``: one row per list."""
    columns = ["list", "pieces", "share", "byte_pieces", "special_pieces", "by_script", "sample"]
    rows = [[key, r["pieces"], r["pieces_share"], r["by_kind"]["byte"], r["by_kind"]["special"],
             ", ".join(f"{k} {v}" for k, v in r["by_language"].items()), " ".join(r["sample"])]
            for key in LISTS if (r := report.get(key)) is not None]
    return columns, rows
