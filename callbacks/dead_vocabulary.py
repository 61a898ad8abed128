"""``DeadVocabulary``: at the end of training, the tokenizer pieces the model never trained on.

Two lists (:mod:`bnlit.checks.dead_vocabulary`): pieces that never occur in the training shards, and
pieces whose embedding row was never looked up by a training batch, so never received an
input-side gradient (tracked here on the device, one scatter per batch, no host sync). The
report goes to the log, ``vocab/`` metrics, the table ``vocab/dead`` and
``<run dir>/dead_vocabulary.json`` (every id)."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from bnlit.checks import dead_vocabulary as dv
from bnlit.errors import ConfigError
from bnlit.loggers import log_metrics, log_table, run_dir, write_json_atomic

log = logging.getLogger(__name__)
REPORT_FILE = "dead_vocabulary.json"


class DeadVocabulary(L.Callback):
    """Args:
    sample: pieces named in the log and the table per list.
    track_inputs: also track which embedding rows training batches looked up.
    """

    def __init__(self, sample: int = 20, track_inputs: bool = True):
        if sample < 0:
            raise ConfigError(f"callbacks.dead_vocabulary.sample={sample}: must be >= 0")
        self.sample, self.track_inputs = sample, track_inputs
        self.looked_up: torch.Tensor | None = None
        self.report: dict | None = None
        self._trainer: L.Trainer | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        if self.track_inputs and (self.looked_up is None or self.looked_up.device != pl_module.device):
            V = pl_module.model.config.vocab_size
            prev = self.looked_up
            self.looked_up = torch.zeros(V, dtype=torch.bool, device=pl_module.device)
            if prev is not None:
                self.looked_up |= prev.to(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.looked_up is not None:
            self.looked_up[batch[0].reshape(-1)] = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dm = trainer.datamodule
        if dm is None or getattr(dm, "shard_dir", None) is None:
            return
        looked_up = self.every_ranks_lookups()
        if not trainer.is_global_zero:
            return
        counts = dv.training_counts(dm)
        seen = looked_up.cpu().numpy() if looked_up is not None else None
        self.report = dv.dead_vocabulary(dm.tokenizer, counts, seen, self.sample)
        rank_zero_info(dv.format_report(self.report))
        write_json_atomic(run_dir(trainer) / REPORT_FILE, self.report)
        log_metrics(trainer, dv.dead_vocabulary_metrics(self.report), callback_metrics=True)
        log_table(trainer, "vocab/dead", *dv.dead_vocabulary_table(self.report))

    def state_dict(self) -> dict:
        # Lightning writes rank zero's callback state only: save every rank's lookups (the union), or a
        # resumed multi-rank run forgets what the other ranks looked up before the checkpoint and
        # reports more dead pieces than the uninterrupted run (every rank saves: a collective is safe)
        looked_up = self.every_ranks_lookups()
        return {"looked_up": looked_up.cpu()} if looked_up is not None else {}

    def every_ranks_lookups(self) -> torch.Tensor | None:
        """The rows any rank looked up (a collective when there are several ranks: every rank calls it)."""
        if self.looked_up is None or self._trainer is None or self._trainer.world_size == 1:
            return self.looked_up
        return self._trainer.strategy.reduce(self.looked_up.to(torch.int32), reduce_op="sum") > 0

    def load_state_dict(self, state: dict) -> None:
        if "looked_up" in state:
            self.looked_up = state["looked_up"]
