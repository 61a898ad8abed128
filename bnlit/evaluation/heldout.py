"""Held-out evaluation: NLL per token, perplexity, bits per character and bits per byte, and the
randomly initialised twin every trained model is compared against.

NLL per token depends on the tokenizer (a tokenizer with longer pieces has fewer, harder tokens),
so runs with different tokenizers are compared by **bits per character** or **bits per byte**:
the text's total NLL in bits divided by its characters or UTF-8 bytes (Gao et al. 2020, The Pile,
section 5). A freshly initialised model with small logits predicts nearly uniformly, so its NLL
per token sits near ln(V); the twin's distance from ln(V) is a check of the initialisation.

Text is scored as one token stream ``[eos] doc_1 [eos] doc_2 [eos] ...``, the layout of the
training shards, so every document token and every end-of-document token is predicted exactly
once, the first token of a document after an ``eos`` as in training. Whole documents are packed
into windows of at most ``seq_len`` predictions; a window cuts a document only when it is longer
than that, and then as lm-evaluation-harness's rolling windows do (:func:`windows`). Windows can
be split across ranks; the sums are ``torchmetrics`` states, reduced by sum.

**Attention as in training.** A window holds several documents. A model trained with the document
mask (``module.document_masking``, the default) is scored with it: a token attends only to its
own document, so a document scores the same alone or packed after others
(``tests/evaluation/test_heldout.py``), which is also what a tool that scores one document at a time sees
(Hugging Face, lm-evaluation-harness's ``loglikelihood_rolling``, llama.cpp). A model trained
without the mask is scored with plain causal attention over the packed window. Multiple-choice items and generation run one document
per forward pass, where the two are the same.

**The random twin** answers two questions a loss curve alone does not: did the model learn
anything (the trained NLL must fall below the twin's), and is the initialisation sane (the twin's
NLL sits near ln(V)). A twin alone flatters: a model that learned only token frequencies beats it by far, so the trained model is
also compared with the add-one unigram and Kneser-Ney bigram of the training shards
(:mod:`bnlit.evaluation.ngram`; ``learned_context/<lang>`` is the bigram's bits/char minus the trained
model's). Scoring touches no training RNG stream (the twin has its own generator, and
:func:`score_slices` runs inside ``fork_rng`` all the same) and leaves the model in its mode.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import Metric

from bnlit.document_masking import document_mask
from bnlit.errors import ConfigError
from bnlit.loss import IGNORE_INDEX
from bnlit.model import ModelConfig, Transformer, rope_cache

LN2 = math.log(2.0)


@dataclass
class EvalResult:
    """Totals of one evaluation. ``chars``/``bytes`` are of the text the tokens encode."""

    nll_sum: float  # nats, summed over every scored token
    tokens: int
    chars: int
    bytes: int

    @property
    def nll_per_token(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_per_token) if self.tokens else float("nan")

    @property
    def bits_per_char(self) -> float:
        return self.nll_sum / LN2 / self.chars if self.chars else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll_sum / LN2 / self.bytes if self.bytes else float("nan")

    def to_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        d.update(nll_per_token=self.nll_per_token, perplexity=self.perplexity,
                 bits_per_char=self.bits_per_char, bits_per_byte=self.bits_per_byte)
        return d


class NLLSum(Metric):
    """Running sum of token NLL (fp64) and of scored tokens, summed across processes."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, token_nll: torch.Tensor, tokens: int | None = None) -> None:
        """Each token's NLL, or with ``tokens`` the NLL summed over that many tokens."""
        self.nll += token_nll.detach().double().sum()
        self.tokens += token_nll.numel() if tokens is None else tokens

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.nll, self.tokens


def token_stream(docs: Iterable[Sequence[int]], eos_id: int) -> np.ndarray:
    """``[eos] doc_1 [eos] doc_2 [eos] ...`` as int64: what :func:`evaluate_stream` scores."""
    parts = [np.asarray([eos_id], dtype=np.int64)]
    for d in docs:
        parts.append(np.asarray(d, dtype=np.int64))
        parts.append(np.asarray([eos_id], dtype=np.int64))
    return np.concatenate(parts)


def windows(stream: np.ndarray, eos_id: int, seq_len: int) -> list[tuple[int, int, int]]:
    """``(start, length, skip)`` of the windows that score ``stream``: inputs
    ``stream[start:start+length]``, targets ``stream[start+1:start+length+1]``, of which the first
    ``skip`` are not scored. Every target is scored exactly once.

    A document (an ``eos`` and the tokens up to the next one, which is its last target; the
    stream's first token opens one too) is never cut by a window when it fits in one: whole
    documents are packed into windows of at most ``seq_len`` predictions. A longer document gets
    lm-evaluation-harness's rolling windows (``get_rolling_token_windows`` with one token of
    context): disjoint chunks of ``seq_len`` targets, the last one read with the longest context
    that fits. Under the document mask a document therefore scores exactly as it does alone, and as
    lm-eval's ``loglikelihood_rolling`` scores it, whatever its neighbours and the window size."""
    stream = np.asarray(stream)
    n_targets = len(stream) - 1
    if n_targets < 1:
        return []
    starts = [0] + [int(i) for i in np.flatnonzero(stream[1:n_targets] == eos_id) + 1]
    bounds = list(zip(starts, starts[1:] + [n_targets]))
    out: list[tuple[int, int, int]] = []
    open_at = None  # start of the window being packed
    for a, b in bounds:
        if open_at is not None and b - open_at > seq_len:
            out.append((open_at, a - open_at, 0))
            open_at = None
        if b - a <= seq_len:
            open_at = a if open_at is None else open_at
            continue
        out.append((a, seq_len, 0))  # a long document: lm-eval's rolling windows
        done = seq_len
        while done < b - a:
            pred = min(b - a - done, seq_len)
            end = a + done + pred  # the stream index of this window's last target
            out.append((end - seq_len, seq_len, seq_len - pred))
            done += pred
    if open_at is not None:
        out.append((open_at, n_targets - open_at, 0))
    return out


@torch.no_grad()
def evaluate_stream(
    model: nn.Module,
    stream: np.ndarray | torch.Tensor,
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    rank: int = 0,
    world_size: int = 1,
    metric: NLLSum | None = None,
    *,
    eos_id: int,
    document_masking: bool,
) -> tuple[float, int]:
    """Summed NLL (nats) and number of scored tokens of ``stream`` under ``model``, in the
    document-aligned :func:`windows` of ``seq_len`` predictions.

    ``eos_id``: the token that opens each document. ``document_masking``: attention stops at every
    document boundary inside a window (:func:`bnlit.document_masking.document_mask`,
    ``model(idx, mask=...)``), as training does with ``module.document_masking``; False: plain
    causal attention over the window (``model(idx)``), for a model trained without the mask. Both
    are required so that no caller forgets them. ``model`` returns logits ``(B, T, V)``; a
    :class:`~bnlit.model.Transformer` is scored through its own loss instead,
    ``model(idx, targets, mask=...)`` with the targets that are not scored ignored: validation's
    graph when compiled, and no (B, T, V) logits in eager code. Windows of a batch are padded on
    the right (after every real token, so nothing real attends to the padding). This rank scores
    windows ``rank::world_size``; pass a shared ``metric`` to accumulate across calls, and its
    ``compute()`` sums over ranks. The caller sets eval mode and any autocast; gradients are off
    here."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    stream = torch.as_tensor(np.asarray(stream, dtype=np.int64))
    metric = metric if metric is not None else NLLSum()
    metric = metric.to(device)
    every = sorted(windows(stream.numpy(), eos_id, seq_len), key=lambda w: -w[1])  # similar lengths batch together
    own_loss = isinstance(model, Transformer)
    mine = every[rank::world_size]
    pad = 0 if eos_id != 0 else 1  # any token but eos: padding joins the last document, opens none
    # under FSDP every forward is a collective (it gathers the shards): each rank makes as many
    # calls as the busiest rank, a rank with nothing left scores a spare window and drops it
    most = -(-len(every[0::world_size]) // batch_size) if every else 0
    for i in range(most):
        chunk = mine[i * batch_size:(i + 1) * batch_size]
        rows = chunk or every[:1]
        # every forward at one shape, (batch_size, seq_len): a compiled model reuses one graph for the
        # short last batch and short windows too (padding rows and columns are not scored)
        x = torch.full((batch_size, max(seq_len, *(n for _, n, _ in rows))), pad, dtype=torch.long)
        for r, (s, n, _) in enumerate(rows):
            x[r, :n] = stream[s:s + n]
        x = x.to(device)
        mask = document_mask(x, eos_id) if document_masking else None
        if own_loss:
            y = torch.full_like(x, IGNORE_INDEX)
            for r, (s, n, k) in enumerate(chunk):
                y[r, k:n] = stream[s + 1 + k:s + n + 1]
            mean = model(x, y.to(device), mask=mask)  # a rank with nothing left: all ignored, unused
            if chunk:
                scored = sum(n - k for _, n, k in chunk)
                metric.update(mean.double() * scored, scored)
            continue
        logits = model(x, mask=mask) if document_masking else model(x)
        if chunk:
            logp = logits.float()
            nll = [F.cross_entropy(logp[r, k:n], stream[s + 1 + k:s + n + 1].to(device), reduction="none")
                   for r, (s, n, k) in enumerate(chunk)]
            metric.update(torch.cat(nll))
    nll, tokens = metric.compute()
    return float(nll), int(tokens)


def evaluate_documents(
    model: nn.Module,
    tokenizer,
    docs: Sequence[str],
    seq_len: int,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    document_masking: bool = True,
) -> EvalResult:
    """Score whole documents: tokens include one ``eos`` per document; characters and bytes are
    of the documents' text (the convention of the shard index). ``document_masking``: as the
    model was trained (:func:`evaluate_stream`)."""
    stream = token_stream(tokenizer.encode_batch(list(docs)), tokenizer.eos_id)
    nll, tokens = evaluate_stream(model, stream, seq_len, batch_size, device, eos_id=tokenizer.eos_id,
                                  document_masking=document_masking)
    return EvalResult(nll, tokens, sum(len(d) for d in docs), sum(len(d.encode("utf-8")) for d in docs))


def uniform_nll(vocab_size: int) -> float:
    """NLL per token of the uniform predictor: ln(V)."""
    return math.log(vocab_size)


def empty_transformer(cfg: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """A :class:`Transformer` with uninitialised weights, built on the meta device so that no
    random number is drawn and no time is spent on an init that is about to be overwritten."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    return model


def twin_model(model_or_cfg: nn.Module | ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> Transformer:
    """A freshly initialised model of the same architecture, its weights a function of ``seed``
    alone (a private generator: the global RNG streams are neither read nor advanced).

    The init is drawn on the CPU and moved to ``device``, so the twin is the same on any machine.
    """
    cfg = model_or_cfg if isinstance(model_or_cfg, ModelConfig) else model_or_cfg.config
    cfg = ModelConfig(**cfg.to_dict())
    twin = empty_transformer(cfg, "cpu")
    twin.reset_parameters(generator=torch.Generator(device="cpu").manual_seed(seed))
    twin.requires_grad_(False)
    return twin.to(device).eval()


# -- the random twin: slices, verdicts, metrics and table (bnlit.callbacks.random_twin is the adapter)

def documents_prefix(tokens: np.ndarray, eos_id: int, max_tokens: int | None) -> tuple[np.ndarray, bool]:
    """The longest run of whole documents (each ending in ``eos``) within ``max_tokens`` of a
    held-out stream, and whether that is the whole stream. When even the first document is
    longer, its first ``max_tokens`` tokens."""
    tokens = np.asarray(tokens)
    if max_tokens is None or len(tokens) <= max_tokens:
        return tokens, True
    ends = np.flatnonzero(tokens[:max_tokens] == eos_id)
    cut = int(ends[-1]) + 1 if ends.size else max_tokens
    return tokens[:cut], False


def text_size(tokens: np.ndarray, tokenizer, eos_id: int) -> tuple[int, int]:
    """Characters and UTF-8 bytes of the text that ``tokens`` decode to (documents split at eos)."""
    ids = np.asarray(tokens).tolist()
    chars = nbytes = 0
    start = 0
    for i, t in enumerate(ids + [eos_id]):
        if t == eos_id:
            if i > start:
                text = tokenizer.decode(ids[start:i])
                chars, nbytes = chars + len(text), nbytes + len(text.encode("utf-8"))
            start = i + 1
    return chars, nbytes


@dataclass
class TwinSettings:
    """What :class:`bnlit.callbacks.random_twin.RandomTwinNLL` scores, and when.

    Args:
        max_tokens: per-language budget of held-out tokens scored (whole documents up to it);
            ``None`` scores the whole slice. The default, 262,144, is the whole held-out slice of
            the default run (60,146 bn and 79,869 en tokens; a budget of 16,384 scored the start
            of the first books only, and disagreed with the whole slice on which side of the
            bigram the model was), and a bounded cost per validation at scale.
        every_n_validations: score the trained model at every n-th validation (0: only at the end).
        seed: the twin's init seed.
        batch_size: windows per forward; None: the data module's micro-batch (every forward is
            padded to it and the sequence length: a compiled model reuses validation's graph).
        init_tolerance: warn when the twin's NLL is further than this (relative) from ln(V).
        learning_after_steps: from this step on, warn when the trained model is not below its twin or
            its unigram (the default run is at the unigram's level at step 100: 3.534 vs 3.525 bits/char).
        languages: the languages to score (default: every validation language).
        baselines: also count and score the unigram and bigram baselines of the training shards.
        baseline_max_tokens: count the baselines from at most this many training tokens per language
            (None: all of them).
    """

    max_tokens: int | None = 262_144
    every_n_validations: int = 1
    seed: int = 1234
    batch_size: int | None = None
    init_tolerance: float = 0.15
    learning_after_steps: int = 200
    languages: Sequence[str] | None = None
    baselines: bool = True
    baseline_max_tokens: int | None = 50_000_000

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ConfigError(f"callbacks.random_twin.max_tokens={self.max_tokens}: must be >= 2 or null (whole slice)")
        if self.every_n_validations < 0 or (self.batch_size or 1) < 1 or self.init_tolerance <= 0:
            raise ConfigError("callbacks.random_twin: every_n_validations must be >= 0, batch_size >= 1 or null "
                              "and init_tolerance > 0")
        self.languages = list(self.languages) if self.languages else None

    def due(self, validations: int) -> bool:
        """Whether the n-th validation of a fit scores the trained model."""
        return bool(self.every_n_validations) and validations % self.every_n_validations == 0


def twin_slices(dm, languages: Sequence[str] | None, max_tokens: int | None) -> dict[str, tuple[np.ndarray, int, int]]:
    """Per language of the data module ``dm``'s validation split: the held-out stream
    ``[eos] + documents`` (whole documents within ``max_tokens``), its characters and UTF-8 bytes."""
    tok, eos = dm.tokenizer, dm.tokenizer.eos_id
    stats = dm.split_stats("val")
    langs = languages or dm.val_languages
    unknown = sorted(set(langs) - set(dm.val_languages))
    if unknown:
        raise ConfigError(f"callbacks.random_twin.languages: {unknown} have no validation slice (have {dm.val_languages})")
    slices = {}
    for lang in langs:
        tokens, whole = documents_prefix(dm.val_tokens(lang), eos, max_tokens)
        if whole:  # the index counts the source text itself
            chars = sum(s["chars"] for s in stats.values() if s["language"] == lang)
            nbytes = sum(s["bytes"] for s in stats.values() if s["language"] == lang)
        else:
            chars, nbytes = text_size(tokens, tok, eos)
        slices[lang] = (np.concatenate([np.asarray([eos], dtype=np.int64), tokens.astype(np.int64)]), chars, nbytes)
    return slices


def score_slices(model: nn.Module, slices: dict[str, tuple[np.ndarray, int, int]], seq_len: int, batch_size: int,
                 rank: int = 0, world_size: int = 1, context=None, *, eos_id: int,
                 document_masking: bool) -> dict[str, EvalResult]:
    """:class:`EvalResult` per slice of :func:`twin_slices`, in eval mode under ``context`` (e.g.
    the precision plugin's autocast), without touching the RNG streams; the model's mode is kept.
    ``document_masking``: as the model trained (:func:`evaluate_stream`)."""
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []), torch.no_grad(), \
                (context or contextlib.nullcontext()):
            out = {}
            for lang, (stream, chars, nbytes) in slices.items():
                nll, tokens = evaluate_stream(model, stream, seq_len, batch_size, device, rank=rank,
                                              world_size=world_size, metric=NLLSum(), eos_id=eos_id,
                                              document_masking=document_masking)
                out[lang] = EvalResult(nll, tokens, chars, nbytes)
    finally:
        model.train(was_training)
    return out


def twin_verdicts(results: dict[str, dict[str, EvalResult]], vocab_size: int, step: int,
                  init_tolerance: float, learning_after_steps: int) -> list[str]:
    """Warnings: a twin further than ``init_tolerance`` (relative) from ln(V), and a trained model
    not below its twin once ``step >= learning_after_steps``."""
    out, ln_v = [], uniform_nll(vocab_size)
    for lang, r in results.items():
        twin = r["twin"].nll_per_token
        if abs(twin / ln_v - 1.0) > init_tolerance:
            out.append(f"twin/{lang}: the randomly initialised twin has NLL {twin:.3f}/token, "
                       f"{twin / ln_v:.2f}x ln(V)={ln_v:.3f} (tolerance {init_tolerance:.0%}); the init is "
                       "not near-uniform: check model.config.init_std and the residual scaling")
        trained = r.get("trained")
        if trained is not None and step >= learning_after_steps and not trained.nll_per_token < twin:
            out.append(f"twin/{lang}: after {step} steps the trained model's NLL {trained.nll_per_token:.3f}/token "
                       f"is not below its random twin's {twin:.3f}; the run is not learning "
                       "(check optimizer.lr, the data and grad/ metrics)")
    return out


def format_twin_table(results: dict[str, dict[str, EvalResult]], vocab_size: int, step: int) -> str:
    """The trained-vs-twin table as fixed-width text."""
    head = (f"{'lang':<6}{'tokens':>9}{'chars':>10}{'trained nll/tok':>17}{'twin nll/tok':>14}"
            f"{'gap':>8}{'trained bits/char':>19}{'twin bits/char':>16}")
    lines = [f"random twin (step {step}, vocab {vocab_size}, ln(V)={uniform_nll(vocab_size):.3f}):", head]
    for lang, r in results.items():
        t, w = r["trained"], r["twin"]
        lines.append(f"{lang:<6}{t.tokens:>9}{t.chars:>10}{t.nll_per_token:>17.4f}{w.nll_per_token:>14.4f}"
                     f"{w.nll_per_token - t.nll_per_token:>8.3f}{t.bits_per_char:>19.4f}{w.bits_per_char:>16.4f}")
    return "\n".join(lines)


def twin_metrics(results: dict[str, dict[str, EvalResult]], vocab_size: int) -> dict[str, float]:
    """The ``twin/`` metrics of trained-vs-twin results (``{lang: {"trained", "twin"}}``); NaNs
    (a slice without bytes or characters) are left out."""
    ln_v = uniform_nll(vocab_size)
    out = {}
    for lang, r in results.items():
        t, w = r["trained"], r["twin"]
        out.update({
            f"twin/{lang}_nll": w.nll_per_token,
            f"twin/{lang}_bits_per_char": w.bits_per_char,
            f"twin/{lang}_bits_per_byte": w.bits_per_byte,
            f"twin/{lang}_nll_over_ln_vocab": w.nll_per_token / ln_v,
            f"twin/{lang}_trained_nll": t.nll_per_token,
            f"twin/{lang}_trained_bits_per_char": t.bits_per_char,
            f"twin/{lang}_trained_bits_per_byte": t.bits_per_byte,
            f"twin/{lang}_nll_gap": w.nll_per_token - t.nll_per_token,
        })
    return {k: v for k, v in out.items() if not math.isnan(v)}


def read_documents(path) -> list[str]:
    """Documents of a held-out file: ``.jsonl`` (its ``text`` field per line) or plain text (one
    document per blank-line separated paragraph, as ``data=files`` reads ``.txt``)."""
    import json
    from pathlib import Path

    from bnlit.errors import DataError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file {path} does not exist; pass --text LANG=FILE with an existing file")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"text file {path} is not UTF-8 (byte {e.start}); convert it with iconv -t UTF-8") from None
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    docs.append(str(json.loads(line)["text"]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{path}:{n}: not a JSON object with a \"text\" field ({e})") from None
    else:
        docs = [p.strip("\n") for p in raw.replace("\r\n", "\n").split("\n\n")]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"text file {path} holds no text")
    return docs
