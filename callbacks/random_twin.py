"""``RandomTwinNLL``: the trained model against a freshly initialised twin of the same architecture
and tokenizer, and against an add-one unigram and a Kneser-Ney bigram counted from the run's
training shards (:mod:`bnlit.ngram`), on each language's held-out slice, in NLL per token, bits
per character and bits per byte.

The twin answers two questions a loss curve alone does not: did the model learn anything (the
trained NLL must fall below the twin's), and is the initialisation sane (a well-initialised model
predicts nearly uniformly, so the twin's NLL sits near ln(V)). The maths is :mod:`bnlit.evaluation`;
this callback picks the slice, chooses when to evaluate, logs and warns. The twin is built and
scored once (it never changes); the trained model is scored at every ``every_n_validations``-th
validation and at the end of training, when the table is printed and logged (``twin/table``).

A twin alone flatters: a model that has learned only token frequencies beats it by far. The
unigram says whether the model learned more than frequencies, the bigram whether it learned
context: ``learned_context/<lang>`` is the bigram's bits/char minus the trained model's (positive
when the model beats the bigram). The counts are saved as ``<run dir>/baselines/ngram_<lang>.npz``
for ``scripts/evaluate.py``.

Nothing here touches the training RNG streams (the twin has its own generator, evaluation draws
no random numbers and runs inside ``fork_rng`` all the same) or leaves the model in another mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.errors import ConfigError
from bnlit.evaluation import (
    EvalResult,
    NLLSum,
    documents_prefix,
    evaluate_stream,
    format_twin_table,
    text_size,
    twin_metrics,
    twin_model,
    twin_verdicts,
)
from bnlit.ngram import baseline_metrics, baseline_verdicts, comparison_table, count_shards, save_baselines, summary_line
from bnlit.run_report import log_metrics, log_table, run_dir

log = logging.getLogger(__name__)


class RandomTwinNLL(L.Callback):
    """Args:
    max_tokens: per-language budget of held-out tokens scored (whole documents up to it);
        ``None`` scores the whole slice.
    every_n_validations: score the trained model at every n-th validation (0: only at the end).
    seed: the twin's init seed.
    batch_size: windows per forward.
    init_tolerance: warn when the twin's NLL is further than this (relative) from ln(V).
    learning_after_steps: from this step on, warn when the trained model is not below its twin or
        its unigram (the default run is at the unigram's level at step 100: 3.534 vs 3.525 bits/char).
    languages: the languages to score (default: every validation language).
    baselines: also count and score the unigram and bigram baselines of the training shards.
    baseline_max_tokens: count the baselines from at most this many training tokens per language
        (None: all of them).
    """

    def __init__(self, max_tokens: int | None = 16384, every_n_validations: int = 1, seed: int = 1234,
                 batch_size: int = 8, init_tolerance: float = 0.15, learning_after_steps: int = 200,
                 languages: Sequence[str] | None = None, baselines: bool = True,
                 baseline_max_tokens: int | None = 50_000_000):
        if max_tokens is not None and max_tokens < 2:
            raise ConfigError(f"callbacks.random_twin.max_tokens={max_tokens}: must be >= 2 or null (whole slice)")
        if every_n_validations < 0 or batch_size < 1 or init_tolerance <= 0:
            raise ConfigError("callbacks.random_twin: every_n_validations must be >= 0, batch_size >= 1 "
                              "and init_tolerance > 0")
        self.max_tokens, self.every_n, self.seed = max_tokens, every_n_validations, seed
        self.batch_size, self.init_tolerance = batch_size, init_tolerance
        self.learning_after_steps = learning_after_steps
        self.languages = list(languages) if languages else None
        self._slices: dict[str, tuple[np.ndarray, int, int]] | None = None
        self._twin: dict[str, EvalResult] = {}
        self.baselines, self.baseline_max_tokens = baselines, baseline_max_tokens
        self._baselines: dict[str, dict[str, EvalResult]] = {}  # lang -> unigram/bigram on the slice
        self._validations = 0
        self._last_step = -1
        self.results: dict[str, dict[str, EvalResult]] = {}
        self.verdicts: list[str] = []

    # ---- building -------------------------------------------------------------------------
    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        if self._slices is not None:
            return bool(self._slices)
        self._slices = {}
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "val_tokens"):
            rank_zero_warn("RandomTwinNLL: no bnlit data module attached; the random twin is not evaluated")
            return False
        tok, eos = dm.tokenizer, dm.tokenizer.eos_id
        stats = dm.split_stats("val")
        langs = self.languages or dm.val_languages
        unknown = sorted(set(langs) - set(dm.val_languages))
        if unknown:
            raise ConfigError(f"callbacks.random_twin.languages: {unknown} have no validation slice "
                              f"(have {dm.val_languages})")
        for lang in langs:
            tokens, whole = documents_prefix(dm.val_tokens(lang), eos, self.max_tokens)
            if whole:  # the index counts the source text itself
                chars = sum(s["chars"] for s in stats.values() if s["language"] == lang)
                nbytes = sum(s["bytes"] for s in stats.values() if s["language"] == lang)
            else:
                chars, nbytes = text_size(tokens, tok, eos)
            stream = np.concatenate([np.asarray([eos], dtype=np.int64), tokens.astype(np.int64)])
            self._slices[lang] = (stream, chars, nbytes)
        self.seq_len = dm.seq_len
        if self.baselines and getattr(dm, "shard_dir", None) is not None:
            counts = count_shards(dm.shard_dir, dm.index, eos, tok.vocab_size, max_tokens=self.baseline_max_tokens)
            if trainer.is_global_zero:
                save_baselines(run_dir(trainer), counts)
            self._baselines = {lang: counts[lang].evaluate(*self._slices[lang])
                               for lang in self._slices if lang in counts}
        model = pl_module.model
        dtype = next(model.parameters()).dtype
        twin = twin_model(model, self.seed).to(device=pl_module.device, dtype=dtype)
        self.vocab_size = model.config.vocab_size
        self._twin = self._score(trainer, twin)
        del twin
        return True

    def _score(self, trainer: L.Trainer, model: torch.nn.Module) -> dict[str, EvalResult]:
        was_training = model.training
        devices = [model_device.index] if (model_device := next(model.parameters()).device).type == "cuda" else []
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), \
                    trainer.strategy.precision_plugin.forward_context():
                out = {}
                for lang, (stream, chars, nbytes) in self._slices.items():
                    nll, tokens = evaluate_stream(model, stream, self.seq_len, self.batch_size, model_device,
                                                  rank=trainer.global_rank, world_size=trainer.world_size,
                                                  metric=NLLSum())
                    out[lang] = EvalResult(nll, tokens, chars, nbytes)
        finally:
            model.train(was_training)
        return out

    # ---- hooks ------------------------------------------------------------------------------
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._validations += 1
        if self.every_n and self._validations % self.every_n == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_step != trainer.global_step:
            self._evaluate(trainer, pl_module)
        if not self.results:
            return
        if trainer.is_global_zero:
            log.info("%s", format_twin_table(self.results, self.vocab_size, trainer.global_step))
            for lang, r in self.results.items():
                log.info("proof of learning (step %d) %s", trainer.global_step,
                         summary_line(lang, r["trained"], self._compared(lang)))
        columns, rows = comparison_table(self.results, self._baselines)
        log_table(trainer, "twin/table", columns, rows)

    def _compared(self, lang: str) -> dict[str, EvalResult]:
        """The baselines the trained model of ``lang`` is compared with: twin, unigram, bigram."""
        return {"twin": self.results[lang]["twin"], **self._baselines.get(lang, {})}

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._prepare(trainer, pl_module):
            return
        trained = self._score(trainer, pl_module.model)
        self.results = {lang: {"trained": trained[lang], "twin": self._twin[lang]} for lang in trained}
        self._last_step = trainer.global_step
        metrics = self.metrics()
        log_metrics(trainer, metrics, callback_metrics=True)
        self.verdicts = twin_verdicts(self.results, self.vocab_size, trainer.global_step,
                                      self.init_tolerance, self.learning_after_steps)
        self.verdicts += baseline_verdicts({lang: r["trained"] for lang, r in self.results.items()},
                                           self._baselines, trainer.global_step, self.learning_after_steps)
        for v in self.verdicts:
            rank_zero_warn(v)

    def metrics(self) -> dict[str, float]:
        trained = {lang: r["trained"] for lang, r in self.results.items()}
        return {**twin_metrics(self.results, self.vocab_size), **baseline_metrics(trained, self._baselines)}
