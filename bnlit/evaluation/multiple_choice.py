"""Multiple-choice scoring the way lm-eval-harness scores HellaSwag, PIQA and ARC.

Each choice is scored by the log-likelihood of its tokens given the context. ``acc`` picks the
highest sum; ``acc_norm`` divides each sum by the choice's length in characters first, so a long
choice is not penalised for having more tokens (lm-eval-harness ``acc_norm``; character length is
tokenizer-independent). The pair is tokenized as lm-eval does: the continuation's tokens are those
of ``context + choice`` after the tokens of ``context``, so a piece spanning the boundary is not
split differently from how the model saw such text. The stream starts with ``eos``, the token a
document follows in bnlit's training shards.

Input is a JSONL file of ``{"context": str, "choices": [str, ...], "label": int}``, or of
Belebele's own rows (``flores_passage``, ``question``, ``mc_answer1..4``, ``correct_answer_num``,
as in the ``facebook/belebele`` files such as ``ben_Beng.jsonl``), scored as a cloze: the passage
and question as context, each answer as a continuation (:func:`belebele_item`).

**The callback** (``bnlit.callbacks.multiple_choice``). ``MultipleChoiceEval``: multiple-choice accuracy during training, at a validation cadence,
logged next to its chance baseline.

Each task is a local JSONL file of ``{"context", "choices", "label"}`` (or Belebele's own fields,
see :func:`bnlit.evaluation.multiple_choice.load_items`), scored the way lm-eval-harness scores HellaSwag/PIQA/ARC
(:func:`bnlit.evaluation.multiple_choice.score_items`). Metrics: ``multiple_choice/<task>_acc_norm``, ``..._acc`` and
``..._chance``. Scoring runs on global rank zero under ``fork_rng`` and ``no_grad`` and restores
the model's mode, so training is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from bnlit.errors import DataError


@dataclass
class MultipleChoiceItem:
    context: str
    choices: list[str]
    label: int


def load_items(path: str | os.PathLike) -> list[MultipleChoiceItem]:
    """Read and validate a multiple-choice JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"multiple-choice file {path} does not exist; pass a JSONL of "
                        '{"context", "choices", "label"} lines')
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = belebele_item(row) if "flores_passage" in row else \
                MultipleChoiceItem(str(row["context"]), [str(c) for c in row["choices"]], int(row["label"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}:{n}: not a {{\"context\", \"choices\", \"label\"}} object ({e}); fix that line") from None
        if len(item.choices) < 2 or not 0 <= item.label < len(item.choices) or not all(item.choices):
            raise DataError(f"{path}:{n}: needs >= 2 non-empty choices and 0 <= label < {len(item.choices)}; "
                            f"got {len(item.choices)} choices, label {item.label}")
        items.append(item)
    if not items:
        raise DataError(f"multiple-choice file {path} has no items")
    return items


def belebele_item(row: dict) -> MultipleChoiceItem:
    """A Belebele row as a cloze item: ``{passage}\\nQuestion: {question}\\nAnswer:`` followed by
    each of the four answers (after a space); ``correct_answer_num`` counts from 1."""
    context = f"{row['flores_passage'].strip()}\nQuestion: {row['question'].strip()}\nAnswer:"
    choices = [" " + str(row[f"mc_answer{i}"]).strip() for i in range(1, 5)]
    return MultipleChoiceItem(context, choices, int(row["correct_answer_num"]) - 1)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval-harness ``_encode_pair``: trailing whitespace of the context (spaces, newlines,
    ``str.rstrip()``) moves to the continuation; the continuation's ids are
    ``encode(context + continuation)`` past ``encode(context)``."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    k = len(tokenizer.encode(context))
    return whole[:k], whole[k:]


@torch.no_grad()
def continuation_logprob(model: nn.Module, context_ids: list[int], continuation_ids: list[int],
                         eos_id: int, max_len: int) -> float:
    """Sum of log p(continuation | eos, context), the context cut from the left to fit ``max_len``."""
    if not continuation_ids:
        return 0.0
    ids = ([eos_id] + list(context_ids) + list(continuation_ids))[-(max_len + 1):]
    device = next(model.parameters()).device
    x = torch.tensor(ids[:-1], device=device)[None]
    logp = F.log_softmax(model(x)[0].float(), dim=-1)
    n = len(continuation_ids)
    targets = torch.tensor(ids[-n:], device=device)
    return float(logp[-n:].gather(1, targets[:, None]).sum())


def score_items(model: nn.Module, tokenizer, items: list[MultipleChoiceItem], max_len: int) -> dict:
    """``acc`` (sum log-likelihood), ``acc_norm`` (per character of the choice), ``chance`` (mean
    of 1/#choices) and the per-item predictions. The model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    preds, preds_norm = [], []
    try:
        for it in items:
            lls, norms = [], []
            for choice in it.choices:
                ctx, cont = encode_pair(tokenizer, it.context, choice)
                ll = continuation_logprob(model, ctx, cont, tokenizer.eos_id, max_len)
                lls.append(ll)
                norms.append(ll / len(choice))
            preds.append(max(range(len(lls)), key=lls.__getitem__))
            preds_norm.append(max(range(len(norms)), key=norms.__getitem__))
    finally:
        model.train(was_training)
    n = len(items)
    return {
        "n": n,
        "acc": sum(p == it.label for p, it in zip(preds, items)) / n,
        "acc_norm": sum(p == it.label for p, it in zip(preds_norm, items)) / n,
        "chance": sum(1 / len(it.choices) for it in items) / n,
        "predictions": preds_norm,
    }


def score_tasks(model, tokenizer, tasks: dict[str, list], max_len: int, context=None) -> tuple[dict[str, dict], dict[str, float]]:
    """:func:`score_items` for each task (without predictions) and the ``multiple_choice/`` metrics,
    under ``context`` (e.g. the precision plugin's autocast) and ``fork_rng``: training is untouched."""
    device = next(model.parameters()).device
    results, metrics = {}, {}
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []), \
            (context or contextlib.nullcontext()):
        for name, items in tasks.items():
            r = score_items(model, tokenizer, items, max_len)
            r.pop("predictions")
            results[name] = r
            metrics |= {f"multiple_choice/{name}_{k}": r[k] for k in ("acc_norm", "acc", "chance")}
    return results, metrics
