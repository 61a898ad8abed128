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
and question as context, each answer as a continuation (:func:`belebele_item`)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from bnlit.document_masking import document_mask
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
    return continuation_logprobs(model, [(context_ids, continuation_ids)], eos_id, max_len, batch_size=1)[0]


@torch.no_grad()
def continuation_logprobs(model: nn.Module, pairs: list[tuple[list[int], list[int]]], eos_id: int, max_len: int,
                          batch_size: int = 8, masked: bool = False) -> list[float]:
    """:func:`continuation_logprob` of each ``(context_ids, continuation_ids)``, ``batch_size`` at a
    time, every forward exactly ``(batch_size, max_len)``: each row is padded on the right (causal
    attention never lets the scored positions see the padding) and a short batch with empty rows,
    so a compiled model reuses validation's graph instead of compiling one per length. ``masked``:
    pass the document mask as training does (``model(x, mask=...)``; one document per row, so the
    same scores as causal attention, through the same compiled graph as validation)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        x = torch.zeros(batch_size, max_len, dtype=torch.long)
        rows = []
        for j, (ctx, cont) in enumerate(chunk):
            ids = ([eos_id] + list(ctx) + list(cont))[-(max_len + 1):]
            x[j, :len(ids) - 1] = torch.tensor(ids[:-1])
            rows.append((len(ids) - 1, ids[-len(cont):] if cont else []))
        x = x.to(device)
        logits = model(x, mask=document_mask(x, eos_id)) if masked else model(x)
        for j, (n, targets) in enumerate(rows):
            if not targets:
                out.append(0.0)
                continue
            logp = F.log_softmax(logits[j, n - len(targets):n].float(), dim=-1)
            out.append(float(logp.gather(1, torch.tensor(targets, device=device)[:, None]).sum()))
    return out


def score_items(model: nn.Module, tokenizer, items: list[MultipleChoiceItem], max_len: int,
                batch_size: int = 8, masked: bool = False) -> dict:
    """``acc`` (sum log-likelihood), ``acc_norm`` (per character of the choice), ``chance`` (mean
    of 1/#choices) and the per-item predictions. The model's mode is restored afterwards; every
    forward is ``(batch_size, max_len)`` (:func:`continuation_logprobs`)."""
    was_training = model.training
    model.eval()
    pairs = [encode_pair(tokenizer, it.context, choice) for it in items for choice in it.choices]
    try:
        lls = continuation_logprobs(model, pairs, tokenizer.eos_id, max_len, batch_size, masked)
    finally:
        model.train(was_training)
    preds, preds_norm, k = [], [], 0
    for it in items:
        ll = lls[k:k + len(it.choices)]
        k += len(it.choices)
        norms = [v / len(choice) for v, choice in zip(ll, it.choices)]
        preds.append(max(range(len(ll)), key=ll.__getitem__))
        preds_norm.append(max(range(len(norms)), key=norms.__getitem__))
    n = len(items)
    return {
        "n": n,
        "acc": sum(p == it.label for p, it in zip(preds, items)) / n,
        "acc_norm": sum(p == it.label for p, it in zip(preds_norm, items)) / n,
        "chance": sum(1 / len(it.choices) for it in items) / n,
        "predictions": preds_norm,
    }


def score_tasks(model, tokenizer, tasks: dict[str, list], max_len: int, context=None,
                batch_size: int = 8, masked: bool = False) -> tuple[dict[str, dict], dict[str, float]]:
    """:func:`score_items` for each task (without predictions) and the ``multiple_choice/`` metrics,
    under ``context`` (e.g. the precision plugin's autocast) and ``fork_rng``: training is untouched."""
    device = next(model.parameters()).device
    results, metrics = {}, {}
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []), \
            (context or contextlib.nullcontext()):
        for name, items in tasks.items():
            r = score_items(model, tokenizer, items, max_len, batch_size, masked)
            r.pop("predictions")
            results[name] = r
            metrics |= {f"multiple_choice/{name}_{k}": r[k] for k in ("acc_norm", "acc", "chance")}
    return results, metrics
