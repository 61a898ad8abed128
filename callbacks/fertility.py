"""``FertilityCheck``: at the start of a run (the first ``fit``/``validate`` setup), measure each
language's characters per token on its held-out slice, log it with the mixture's intended and
delivered shares, and stop (or warn about) a run whose tokenizer starves a language or whose
mixture no longer says what the config asked for. With ``parallel`` text configured it also
measures the content-matched token premium and warns when it leaves ``premium_band``.

The maths is :mod:`bnlit.checks.fertility`; this callback only reads the data module's shard
statistics (``split_stats``, ``val_tokens``, ``mixture``), logs, and decides whether to stop."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from bnlit.checks import fertility
from bnlit.errors import TokenizerError
from bnlit.loggers import log_metrics, log_table

class FertilityCheck(L.Callback):
    """Args: those of :class:`bnlit.checks.fertility.FertilitySettings`, kept as ``self.settings``."""

    def __init__(self, **settings):
        self.settings = fertility.FertilitySettings(**settings)
        self.result: dict | None = None
        self.problems: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # after the data module's setup, before any batch: a run with validate_at_start fails
        # here instead of after a full validation pass
        if stage in ("fit", "validate") and self.result is None:
            self.check(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.result is None:
            self.check(trainer)

    def check(self, trainer: L.Trainer) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "split_stats"):
            rank_zero_warn("FertilityCheck: no bnlit data module attached; fertility not checked")
            return
        self.result, self.problems, warnings = fertility.run_check(dm, self.settings)
        for w in warnings:
            rank_zero_warn(w)  # a premium off balance is a warning, never a stop
        problems, val = self.problems, self.result["validation"]
        self._log(trainer, val, self.result["mixture"], self.result["parallel"])
        if problems:
            if self.settings.on_fail == "raise":
                raise TokenizerError(" | ".join(problems))
            for p in problems:
                rank_zero_warn(p)
        else:
            rank_zero_info("FertilityCheck: " + ", ".join(f"{k} {v['chars_per_token']:.2f} chars/token"
                                                          for k, v in val.items()))

    def _log(self, trainer: L.Trainer, val: dict, mixture: dict | None, parallel: dict | None = None) -> None:
        log_metrics(trainer, fertility.fertility_metrics(val, mixture, parallel))
        log_table(trainer, "tok/fertility", *fertility.fertility_table(val, mixture, parallel))
