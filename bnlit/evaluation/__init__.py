"""Held-out evaluation and the proof of learning: bits per character against a random twin
(:mod:`~bnlit.evaluation.heldout`), count-based n-gram baselines (:mod:`~bnlit.evaluation.ngram`)
and multiple-choice scoring (:mod:`~bnlit.evaluation.multiple_choice`)."""

import importlib

SUBMODULES = ("heldout", "ngram", "multiple_choice")


def __getattr__(name: str):
    # ``bnlit.evaluation`` was one module before it became this package: its names still resolve
    # here, for code written before the move, from their home, :mod:`bnlit.evaluation.heldout`
    if name not in SUBMODULES and not name.startswith("__"):
        heldout = importlib.import_module("bnlit.evaluation.heldout")
        if hasattr(heldout, name):
            return getattr(heldout, name)
    raise AttributeError(f"module 'bnlit.evaluation' has no attribute {name!r}")
