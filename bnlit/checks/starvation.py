"""Language starvation: one language's held-out loss stops improving while another's still does.

A mixture that gives a language too little of the batch (a weight of 0.01, a tokenizer that
inflates another language's token count) does not fail: the total loss keeps falling, carried by
the well-fed language, while the starved one stalls. The per-language curves show it only to
someone who looks. :func:`starved_languages` looks at every validation.

A language has *improved* over the last ``patience`` validations when its best value among them
is below its best value before them by more than ``min_delta`` (relative). With two or more
languages, a language that has not improved while another has is starved. The series can be any
per-language held-out loss; NLL/token on a fixed slice and bits/char on it differ by a constant
factor (the slice's tokens per character / ln 2), so the verdict is the same for both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bnlit.errors import BnlitError


class LanguageStarvationError(BnlitError):
    """A language stopped learning while another did (``callbacks.starvation.on_starved=raise``)."""

    exit_code = 3


@dataclass
class LanguageTrend:
    first: float
    best_before: float  # best value before the window
    best_recent: float  # best value within the last ``patience`` validations
    last: float
    improved: bool

    @property
    def relative_change(self) -> float:
        """Relative improvement of the window's best over the best before it (positive: better)."""
        return (self.best_before - self.best_recent) / abs(self.best_before) if self.best_before else 0.0


def trend(series: Sequence[float], patience: int, min_delta: float) -> LanguageTrend | None:
    """The last ``patience`` values against everything before them; None until there are
    ``patience + 1`` values."""
    if len(series) <= patience:
        return None
    before, recent = series[:-patience], series[-patience:]
    best_before, best_recent = min(before), min(recent)
    return LanguageTrend(series[0], best_before, best_recent, series[-1],
                         best_recent < best_before * (1.0 - min_delta))


def starved_languages(history: Mapping[str, Sequence[float]], patience: int,
                      min_delta: float = 0.0) -> tuple[list[str], dict[str, LanguageTrend]]:
    """Languages whose held-out loss has not improved over the last ``patience`` validations
    while another language's has, and each language's trend (languages with too short a history
    are left out). Fewer than two languages can never be starved."""
    trends = {lang: t for lang, s in history.items() if (t := trend(list(s), patience, min_delta)) is not None}
    if len(trends) < 2 or not any(t.improved for t in trends.values()):
        return [], trends
    return sorted(lang for lang, t in trends.items() if not t.improved), trends


def starvation_message(lang: str, trends: Mapping[str, LanguageTrend], patience: int, step: int) -> str:
    t = trends[lang]
    fed = ", ".join(f"{other} {u.best_before:.3f} -> {u.best_recent:.3f}" for other, u in trends.items() if u.improved)
    return (f"language starvation: {lang}'s held-out loss has not improved over the last {patience} validations "
            f"(best {t.best_before:.3f} before, {t.best_recent:.3f} since; step {step}) while {fed} did; "
            f"raise data.sources' weight for {lang}, check its tokenizer fertility, or set "
            "callbacks.starvation.on_starved=warn")


def starvation_table(history: Mapping[str, Sequence[float]], trends: Mapping[str, LanguageTrend],
                     starved: Mapping[str, int]) -> tuple[list[str], list[list]]:
    """Columns and rows of ``starvation/table``: each language's first, best and last held-out
    loss, whether it improved in the last window, and the step it was first found starved."""
    columns = ["language", "first_val_loss", "best_before_window", "best_in_window", "last_val_loss",
               "improved", "starved_at_step"]
    rows = [[lang, series[0], t.best_before if t else None, t.best_recent if t else None, series[-1],
             t.improved if t else None, starved.get(lang)]
            for lang, series in history.items() for t in [trends.get(lang)]]
    return columns, rows


def starvation_summary(history: Mapping[str, Sequence[float]], starved: Mapping[str, int], patience: int) -> str:
    """The end-of-run line: each language ok or the step it was first found starved."""
    verdict = ", ".join(f"{lang} {'STARVED at step ' + str(starved[lang]) if lang in starved else 'ok'}"
                        for lang in history)
    return f"language starvation (patience {patience} validations): {verdict}"
