"""``MultipleChoiceEval``: multiple-choice accuracy during training, at a validation cadence,
logged next to its chance baseline.

Each task is a local JSONL file of ``{"context", "choices", "label"}`` (or Belebele's own fields,
see :func:`bnlit.evaluation.multiple_choice.load_items`), scored the way lm-eval-harness scores
HellaSwag/PIQA/ARC (:func:`bnlit.evaluation.multiple_choice.score_items`). Metrics:
``multiple_choice/<task>_acc_norm``, ``..._acc`` and ``..._chance``. Scoring runs on global rank
zero under ``fork_rng`` and ``no_grad`` and restores the model's mode, so training is untouched."""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from bnlit.errors import ConfigError
from bnlit.evaluation.multiple_choice import load_items, score_tasks
from bnlit.loggers import log_metrics


class MultipleChoiceEval(L.Callback):
    """Args:
    tasks: ``{name: path}`` of JSONL files (empty: the callback does nothing).
    every_n_validations: evaluate at every n-th validation (0: only at the end of training).
    max_items: score the first ``max_items`` items of each task (None: all).
    """

    def __init__(self, tasks: Mapping[str, str] | None = None, every_n_validations: int = 1,
                 max_items: int | None = None):
        if every_n_validations < 0 or (max_items is not None and max_items < 1):
            raise ConfigError("callbacks.multiple_choice: every_n_validations must be >= 0 and max_items >= 1 or null")
        # read and validate every file now, before any training step
        self.tasks = {str(name): load_items(path)[:max_items] for name, path in (tasks or {}).items()}
        self.every_n = every_n_validations
        self._validations = 0
        self._last_step = -1
        self.results: dict[str, dict] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.tasks or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._validations += 1
        if self.every_n and self._validations % self.every_n == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.tasks and self._last_step != trainer.global_step:
            self._evaluate(trainer, pl_module)
        for name, r in self.results.items():
            rank_zero_info(f"multiple choice {name}: {r['n']} items, acc_norm {r['acc_norm']:.3f}, "
                           f"acc {r['acc']:.3f}, chance {r['chance']:.3f} (step {trainer.global_step})")

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        if not trainer.is_global_zero:
            return
        model, dm = pl_module.model, trainer.datamodule
        max_len = getattr(dm, "seq_len", None) or model.config.max_seq_len
        # validation's shape (micro-batch x seq_len): a compiled model reuses its graph
        results, metrics = score_tasks(model, dm.tokenizer, self.tasks, max_len,
                                       trainer.strategy.precision_plugin.forward_context(),
                                       batch_size=getattr(dm, "batch_size", None) or 8,
                                       masked=getattr(pl_module, "document_masking", False))
        self.results.update(results)
        log_metrics(trainer, metrics, callback_metrics=True)
