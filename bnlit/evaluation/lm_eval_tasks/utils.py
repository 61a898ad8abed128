"""bnlit's held-out text and multiple-choice items as lm-evaluation-harness tasks (used with
``lm_eval --include_path``; docs/evaluation.md "lm-evaluation-harness"). The files are read by bnlit's own readers,
so a file means the same documents or items here as in ``scripts/evaluate.py``.

A bnlit document is scored after the token that opens it in training, the end-of-document token
``</s>`` (``bnlit.document_masking``), which the exported tokenizer names as its BOS:

- ``bnlit_bits_per_char`` (``loglikelihood_rolling``): lm-eval prefixes each document with the
  BOS (its ``prefix_token_id``); the scored string is the document followed by ``</s>``, which the
  Hugging Face tokenizer turns into the end-of-document token, so every document token and one
  end-of-document token per document are predicted, as ``scripts/evaluate.py`` counts them. Bits
  are divided by the characters and UTF-8 bytes of the documents' text.
- ``bnlit.evaluation.multiple_choice`` (``multiple_choice``): the context is ``</s>`` + context (lm-eval
  tokenizes a context without a BOS otherwise), each choice follows with no delimiter, as
  ``bnlit.evaluation.multiple_choice`` scores it; ``acc_norm`` divides by the choice's characters.
"""

from __future__ import annotations

import datasets

EOS_TEXT = "</s>"  # the exported tokenizer's eos (and BOS) token, typed as text


def _need(value, key: str, what: str) -> str:
    if not value:
        raise ValueError(f"bnlit lm-eval task: name the {what} file with --metadata {key}=FILE "
                         "(merged with --model_args; bnlit/evaluation/lm_eval_tasks/utils.py)")
    return str(value)


def held_out_text(text: str | None = None, **_) -> datasets.DatasetDict:
    """``--metadata text=FILE``: ``.jsonl`` (a ``text`` field per line) or plain text (one document
    per blank-line separated paragraph), read by ``bnlit.evaluation.heldout.read_documents``."""
    from bnlit.evaluation.heldout import read_documents

    docs = read_documents(_need(text, "text", "held-out text"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": docs})})


def document(doc: dict) -> str:
    """The scored string: the document, then its end-of-document token."""
    return doc["text"] + EOS_TEXT


def bits_per_char_results(doc: dict, results) -> dict:
    """Per document: its log-likelihood with the characters and UTF-8 bytes of its text (the
    ``bits_per_byte`` aggregation is -sum(ll) / sum(count) / ln 2 for either)."""
    (loglikelihood,) = results
    text = doc["text"]
    return {"bits_per_char": (loglikelihood, len(text)), "bits_per_byte": (loglikelihood, len(text.encode("utf-8")))}


def multiple_choice_items(multiple_choice: str | None = None, **_) -> datasets.DatasetDict:
    """``--metadata multiple_choice=FILE``: bnlit's ``{"context", "choices", "label"}`` JSONL, read
    (and checked) by ``bnlit.evaluation.multiple_choice.load_items``."""
    from bnlit.evaluation.multiple_choice import load_items

    items = load_items(_need(multiple_choice, "multiple_choice", "multiple-choice JSONL"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({
        "context": [it.context for it in items], "choices": [list(it.choices) for it in items],
        "label": [it.label for it in items]})})


def context(doc: dict) -> str:
    """The item's context after the token that opens a document."""
    return EOS_TEXT + doc["context"]
