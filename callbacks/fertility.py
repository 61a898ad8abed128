"""``FertilityCheck``: at the start of a run, each language's characters per token and the
mixture's delivered shares, checked against floors (:mod:`bnlit.fertility`); stops or warns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from bnlit import fertility
from bnlit.errors import ConfigError, TokenizerError
from bnlit.run_report import log_metrics, log_table

ON_FAIL = ("raise", "warn")


class FertilityCheck(L.Callback):
    """Args:
    floors: minimum characters per token per language (default ``{"bn": 2.5}``; UTF-8 bytes give
        Bangla ~0.37, a Bangla-aware 8k tokenizer ~3.4).
    max_factor: a language delivered more than this multiple of its intended share (in tokens or
        characters) fails the share check.
    check_shares: run the inverted/over-represented mixture checks.
    on_fail: ``raise`` (stop the run with a :class:`~bnlit.errors.TokenizerError`) or ``warn``.
    parallel: ``{lang: file}`` of line-aligned translations (for example FLORES-200 dev
        ``{bn: ben_Beng.dev, en: eng_Latn.dev}``); when given, the content-matched token premium
        (Petrov et al. 2023) is measured on it, logged and checked against ``premium_band``.
        ``None`` (the default): not measured.
    premium_band: ``[low, high]``; a premium outside it, in either direction, is warned about.
    """

    def __init__(self, floors: Mapping[str, float] | None = None, max_factor: float = fertility.DEFAULT_MAX_FACTOR,
                 check_shares: bool = True, on_fail: str = "raise", parallel: Mapping[str, str] | None = None,
                 premium_band: Sequence[float] = fertility.DEFAULT_PREMIUM_BAND):
        if on_fail not in ON_FAIL:
            raise ConfigError(f"callbacks.fertility.on_fail={on_fail!r}: use one of {list(ON_FAIL)}")
        if max_factor <= 1.0:
            raise ConfigError(f"callbacks.fertility.max_factor={max_factor}: must be > 1")
        band = list(premium_band)
        if len(band) != 2 or not 0 < band[0] <= 1 <= band[1]:
            raise ConfigError(f"callbacks.fertility.premium_band={band}: write [low, high] with 0 < low <= 1 <= high")
        self.premium_band = (float(band[0]), float(band[1]))
        # read now: a missing or misaligned file stops the run before any data is built
        self.parallel = dict(parallel) if parallel else None
        self.parallel_texts = (fertility.read_parallel(self.parallel, "callbacks.fertility.parallel")
                               if self.parallel else None)
        self.floors = dict(fertility.DEFAULT_FLOORS if floors is None else floors)
        self.max_factor, self.check_shares, self.on_fail = max_factor, check_shares, on_fail
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
        source = "parallel text " + ", ".join(f"{k}={v}" for k, v in (self.parallel or {}).items())
        self.result, self.problems, warnings = fertility.run_check(
            dm, self.floors, self.max_factor, self.check_shares, self.parallel_texts, source, self.premium_band)
        for w in warnings:
            rank_zero_warn(w)  # a premium off balance is a warning, never a stop
        problems, val = self.problems, self.result["validation"]
        self._log(trainer, val, self.result["mixture"], self.result["parallel"])
        if problems:
            if self.on_fail == "raise":
                raise TokenizerError(" | ".join(problems))
            for p in problems:
                rank_zero_warn(p)
        else:
            rank_zero_info("FertilityCheck: " + ", ".join(f"{k} {v['chars_per_token']:.2f} chars/token"
                                                          for k, v in val.items()))

    def _log(self, trainer: L.Trainer, val: dict, mixture: dict | None, parallel: dict | None = None) -> None:
        log_metrics(trainer, fertility.fertility_metrics(val, mixture, parallel))
        log_table(trainer, "tok/fertility", *fertility.fertility_table(val, mixture, parallel))
