"""``LanguageStarvation``: with two or more languages, warn or stop when one language's held-out
loss has not improved over the last ``patience`` validations while another's has (a mixture
weight of 0.01, a tokenizer that inflates one language's token count).

The rule is :mod:`bnlit.checks.starvation`; this callback reads each language's ``val/<lang>_loss``
(NLL/token on the same held-out windows every time, so its trend is the trend of bits/char),
decides at every validation, and reports every language's trend at the end of training."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from bnlit.errors import ConfigError
from bnlit.loggers import log_metrics, log_table
from bnlit.checks.starvation import LanguageStarvationError, starvation_message, starvation_summary
from bnlit.checks.starvation import starvation_table, starved_languages

ON_STARVED = ("warn", "raise")

class LanguageStarvation(L.Callback):
    """Args:
    patience: validations over which a language must improve (K).
    min_delta: relative improvement that counts (0.001: the best of the last K validations must be
        0.1% below the best before them; a healthy language at 20% of a tiny run's mixture improves
        by less than 1% over two early validations).
    on_starved: ``warn`` or ``raise`` (stop the run with :class:`LanguageStarvationError`).
    """

    def __init__(self, patience: int = 3, min_delta: float = 0.001, on_starved: str = "warn"):
        if patience < 1 or min_delta < 0:
            raise ConfigError(f"callbacks.starvation: patience={patience} must be >= 1 and min_delta={min_delta} >= 0")
        if on_starved not in ON_STARVED:
            raise ConfigError(f"callbacks.starvation.on_starved={on_starved!r}: use one of {list(ON_STARVED)}")
        self.patience, self.min_delta, self.on_starved = patience, min_delta, on_starved
        self.history: dict[str, list[float]] = {}
        self.steps: list[int] = []
        self.starved: dict[str, int] = {}  # language -> step it was first found starved
        self._trends: dict = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        langs = getattr(trainer.datamodule, "val_languages", None) or []
        values = {lang: trainer.callback_metrics.get(f"val/{lang}_loss") for lang in langs}
        if len(langs) < 2 or any(v is None for v in values.values()):
            return
        self.steps.append(trainer.global_step)
        for lang, v in values.items():
            self.history.setdefault(lang, []).append(float(v))
        starved, self._trends = starved_languages(self.history, self.patience, self.min_delta)
        metrics = {f"starvation/{lang}": float(lang in starved) for lang in self._trends}
        log_metrics(trainer, metrics)
        for lang in starved:
            msg = starvation_message(lang, self._trends, self.patience, trainer.global_step)
            self.starved.setdefault(lang, trainer.global_step)
            if self.on_starved == "raise":  # every rank saw the same validation: all stop together
                raise LanguageStarvationError(msg)
            rank_zero_warn(msg)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.history:
            return
        log_table(trainer, "starvation/table", *starvation_table(self.history, self._trends, self.starved))
        rank_zero_info(starvation_summary(self.history, self.starved, self.patience))

    def state_dict(self) -> dict:
        return {"history": self.history, "steps": self.steps, "starved": self.starved}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}
        self.steps = list(state.get("steps", []))
        self.starved = dict(state.get("starved", {}))
