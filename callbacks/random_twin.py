"""``RandomTwinNLL``: the trained model against a freshly initialised twin of the same architecture
and tokenizer, and against the unigram and bigram of the training shards, on each language's
held-out slice, in NLL per token, bits per character and bits per byte.

The twin is built and scored once (it never changes); the trained model is scored at every
``every_n_validations``-th validation and at the end of training, when the table is printed and
logged (``twin/table``). The maths and the reasons are in :mod:`bnlit.evaluation.heldout` (twin)
and :mod:`bnlit.evaluation.ngram` (baselines, saved as ``<run dir>/baselines/ngram_<lang>.npz``
for ``scripts/evaluate.py``); this callback picks the slices, chooses when to evaluate, logs and
warns."""

from __future__ import annotations

import logging
import lightning as L
import numpy as np
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.evaluation import heldout as ev
from bnlit.evaluation import ngram
from bnlit.loggers import log_metrics, log_table, run_dir

log = logging.getLogger(__name__)


class RandomTwinNLL(L.Callback):
    """Args: those of :class:`bnlit.evaluation.heldout.TwinSettings`, kept as ``self.settings``."""

    def __init__(self, **settings):
        self.settings = ev.TwinSettings(**settings)
        self._slices: dict[str, tuple[np.ndarray, int, int]] | None = None
        self._twin: dict[str, ev.EvalResult] = {}
        self._baselines: dict[str, dict[str, ev.EvalResult]] = {}  # lang -> unigram/bigram on the slice
        self._validations, self._last_step = 0, -1
        self.results: dict[str, dict[str, ev.EvalResult]] = {}
        self.verdicts: list[str] = []

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Build the slices and baselines and score the twin, once; False without a bnlit data module."""
        if self._slices is not None:
            return bool(self._slices)
        self._slices, dm = {}, trainer.datamodule
        if dm is None or not hasattr(dm, "val_tokens"):
            rank_zero_warn("RandomTwinNLL: no bnlit data module attached; the random twin is not evaluated")
            return False
        s = self.settings
        self._slices, self.seq_len = ev.twin_slices(dm, s.languages, s.max_tokens), dm.seq_len
        self.batch_size = s.batch_size or dm.batch_size  # validation's shape: a compiled model reuses its graph
        if s.baselines and getattr(dm, "shard_dir", None) is not None:
            counts = ngram.count_shards(dm.shard_dir, dm.index, dm.tokenizer.eos_id, dm.tokenizer.vocab_size,
                                        max_tokens=s.baseline_max_tokens)
            if trainer.is_global_zero:
                ngram.save_baselines(run_dir(trainer), counts)
            self._baselines = {lang: counts[lang].evaluate(*s) for lang, s in self._slices.items() if lang in counts}
        model = pl_module.model
        twin = ev.twin_model(model, s.seed).to(device=pl_module.device, dtype=next(model.parameters()).dtype)
        self.vocab_size = model.config.vocab_size
        self._twin = self._score(trainer, twin)
        return True

    def _score(self, trainer: L.Trainer, model) -> dict[str, ev.EvalResult]:
        # the attention the run trains with: the document mask unless module.document_masking=false
        masked = getattr(trainer.lightning_module, "document_masking", True)
        return ev.score_slices(model, self._slices, self.seq_len, self.batch_size, trainer.global_rank,
                               trainer.world_size, trainer.strategy.precision_plugin.forward_context(),
                               eos_id=trainer.datamodule.tokenizer.eos_id, document_masking=masked)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._validations += 1
        if self.settings.due(self._validations):
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_step != trainer.global_step:
            self._evaluate(trainer, pl_module)
        if not self.results:
            return
        if trainer.is_global_zero:
            log.info("%s", ev.format_twin_table(self.results, self.vocab_size, trainer.global_step))
            for lang, r in self.results.items():
                compared = {"twin": r["twin"], **self._baselines.get(lang, {})}
                log.info("proof of learning (step %d) %s", trainer.global_step,
                         ngram.summary_line(lang, r["trained"], compared))
        log_table(trainer, "twin/table", *ngram.comparison_table(self.results, self._baselines))

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._prepare(trainer, pl_module):
            return
        trained = self._score(trainer, pl_module.model)
        self.results = {lang: {"trained": trained[lang], "twin": self._twin[lang]} for lang in trained}
        self._last_step = step = trainer.global_step
        log_metrics(trainer, self.metrics(), callback_metrics=True)
        s = self.settings
        self.verdicts = ev.twin_verdicts(self.results, self.vocab_size, step, s.init_tolerance, s.learning_after_steps)
        self.verdicts += ngram.baseline_verdicts(trained, self._baselines, step, s.learning_after_steps)
        for v in self.verdicts:
            rank_zero_warn(v)

    def metrics(self) -> dict[str, float]:
        trained = {lang: r["trained"] for lang, r in self.results.items()}
        return {**ev.twin_metrics(self.results, self.vocab_size), **ngram.baseline_metrics(trained, self._baselines)}
