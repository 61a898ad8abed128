"""What a run reports when it ends (what it logs while it trains is :mod:`bnlit.loggers`):

- :func:`write_summary`: ``<run dir>/summary.md`` with the final value of every metric, the tables,
  and PNG plots of loss, MFU, fertility and the random-twin gap from ``<run dir>/csv/metrics.csv``;
- :func:`print_report`: the console lines at the end of ``bnlit.train``, saying where everything went.

``python -m bnlit.run_report RUN_DIR`` rewrites the summary of a finished run."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from bnlit import storage

# -- the summary and the final report -------------------------------------------------------------

# plot name -> predicate on a metric key
PLOTS = {
    "loss": lambda k: k == "train/loss" or (k.startswith("val/") and k.endswith("loss")),
    "mfu": lambda k: k == "throughput/mfu",
    "fertility": lambda k: k.startswith("tok/") and k.endswith("chars_per_token"),
    "twin_gap": lambda k: k.startswith("twin/") and "gap" in k,
    # bigram minus trained bits/char per language: above zero once the model beats the bigram
    "learned_context": lambda k: k.startswith("learned_context/"),
}
# plot name -> (title, y-axis label with its unit); the x axis of every curve is the CSV's step:
# optimizer steps completed before the value was measured (Lightning's logging step)
# plots whose sign means something: a line at zero (above it the model beats the bigram)
ZERO_LINE = {"learned_context"}
PLOT_AXES = {
    "loss": ("loss", "cross-entropy (nats/token)"),
    "mfu": ("model FLOPs utilisation", "MFU (% of peak FLOP/s)"),
    "fertility": ("tokenizer fertility on the held-out slice (higher is better)", "characters per token"),
    "twin_gap": ("trained model vs its random twin", "NLL gap (nats/token)"),
    "learned_context": ("trained model vs the bigram (above 0: it beats the bigram)",
                        "bigram minus trained (bits/char)"),
}
STEP_LABEL = "optimizer step"


def read_metrics(csv_path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` from a Lightning CSVLogger file; a step logged twice (a
    resumed run re-logs the steps after its checkpoint) keeps its last value."""
    series: dict[str, dict[int, float]] = {}
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for k, v in row.items():
                if k in ("step", "epoch") or v in ("", None):
                    continue
                try:
                    series.setdefault(k, {})[step] = float(v)
                except ValueError:
                    continue
    return {k: sorted(d.items()) for k, d in series.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(series: dict[str, list[tuple[int, float]]], keys: list[str], title: str, path: Path,
         ylabel: str = "value", zero_line: bool = False) -> Path:
    """Curves of ``keys`` against the optimizer step, with the axes labelled; ``zero_line`` draws
    y = 0 and keeps it in view."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if zero_line:
        ax.axhline(0.0, color="black", linewidth=0.8, zorder=1)
    for k in keys:
        pts = [(s, v) for s, v in series[k] if math.isfinite(v)]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 50 else None, label=k)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    steps = {s for k in keys for s, _ in series[k]}
    if len(steps) == 1:  # a single step: centre it instead of an axis of -0.04..0.04
        ax.set_xlim(min(steps) - 1, min(steps) + 1)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fertility_floors(run_dir: Path) -> dict[str, float]:
    """``callbacks.fertility.floors`` of the run's composed config (empty when it has none)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()) or {}
        return {str(k): float(v) for k, v in (((cfg.get("callbacks") or {}).get("fertility") or {}).get("floors") or {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def plot_fertility(values: dict[str, float], floors: dict[str, float], path: Path) -> Path:
    """One bar per language (characters per token, measured once at fit start), each language's
    floor drawn across its bar, the value printed on it."""
    plt = _pyplot()
    title, ylabel = PLOT_AXES["fertility"]
    langs = sorted(values)
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(langs) + 2), 4))
    bars = ax.bar(langs, [values[lang] for lang in langs], color="tab:blue", width=0.6)
    ax.bar_label(bars, labels=[f"{values[lang]:.2f}" for lang in langs], padding=2)
    for i, lang in enumerate(langs):
        if lang in floors:
            ax.hlines(floors[lang], i - 0.4, i + 0.4, colors="tab:red", linestyles="--",
                      label="floor (callbacks.fertility.floors)" if i == langs.index(next(l for l in langs if l in floors)) else None)
            # beside the bar, clear of its edge (the bar spans i +- 0.3)
            ax.annotate(f"floor {floors[lang]:g}", (i + 0.45, floors[lang]), xytext=(4, 0), textcoords="offset points",
                        va="center", ha="left", fontsize=8, color="tab:red")
    top = max([*values.values(), *floors.values()])
    ax.set_ylim(0, top * 1.2)
    ax.set_xlim(-0.6, len(langs) - 0.4 + 0.7)
    ax.set_xlabel("language")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if floors:
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_value(key: str, v: Any) -> str:
    """One format for a metric everywhere (summary.md and the console line): 4 decimals
    (``9.0170``), thousands grouped from 1000 (``12,345``), scientific below 0.001
    (``3.000e-05``), 2 decimals for sizes in GiB (``1.27``)."""
    if not isinstance(v, float) or not math.isfinite(v):
        return str(v)
    if key.endswith("_gib"):
        return f"{v:.2f}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 1e-3 or v == 0:
        return f"{v:.4f}"
    return f"{v:.3e}"


def _fmt(v: Any, key: str = "") -> str:
    return format_value(key, v)


def proof_of_learning(tables: Path) -> list[str]:
    """Plain sentences from the random-twin table: per language, whether the trained model beat
    the twin, the unigram and the bigram (``callbacks/random_twin.py``)."""
    path = tables / "twin_table.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    cols = data.get("columns", [])
    out = ["## Proof of learning", "",
           f"Held-out bits/char at step {data.get('step', '?')} against each baseline (lower is better):", ""]
    for row in data.get("rows", []):
        r = dict(zip(cols, row))
        parts = []
        for name in ("twin", "unigram", "bigram"):
            if r.get(f"beat_{name}") is not None and r.get(f"{name}_bits_per_char") is not None:
                verdict = "beat" if r[f"beat_{name}"] else "**did not beat**"
                parts.append(f"{verdict} the {name} ({r[f'{name}_bits_per_char']:.3f})")
        if parts:
            out.append(f"- {r['language']}: trained {r['trained_bits_per_char']:.3f} bits/char; " + ", ".join(parts))
    return out + [""] if len(out) > 4 else []


def write_summary(run_dir: str | os.PathLike, metrics: Mapping[str, float] | None = None,
                  fast_path: str | None = None, notes: Sequence[str | None] = ()) -> Path:
    """Write ``summary.md`` and ``plots/*.png`` into ``run_dir``; returns the summary path.
    ``fast_path``: the run's ``fast path: ...`` line (:mod:`bnlit.speed.fast_path`), and ``notes`` (the
    compile count, where the time went; None entries skipped), kept under the title."""
    run_dir = Path(run_dir)
    csv_path = run_dir / "csv" / "metrics.csv"
    series = read_metrics(csv_path) if csv_path.is_file() else {}
    final = {k: v[-1][1] for k, v in series.items() if v}
    final.update(metrics or {})
    lines = [f"# Run summary: {run_dir.name}", "", f"run dir: `{run_dir}`", ""]
    for line in (fast_path, *notes):
        if line:
            lines += [f"{line}", ""]
    if final:
        headline = {k: v for k, v in final.items() if k in ("throughput/tokens_per_s", "val/loss")
                    or any(wanted(k) for wanted in PLOTS.values())}
        # the step each value was logged at: a metric logged every N steps (grad/*) shows its last
        step = {k: v[-1][0] for k, v in series.items() if v}
        row = lambda k, v: f"| `{k}` | {_fmt(v, k)} | {step.get(k, 'end')} |"  # noqa: E731
        lines += ["## Headline", "", "| metric | final value | at step |", "|---|---|---|"]
        lines += [row(k, v) for k, v in sorted(headline.items())]
        lines += ["", "<details><summary>all final metrics</summary>", "",
                  "| metric | value | at step |", "|---|---|---|"]
        lines += [row(k, v) for k, v in sorted(final.items())]
        lines += ["", "</details>", ""]
    lines += proof_of_learning(run_dir / "tables")
    plots = []
    for name, wanted in PLOTS.items():
        keys = sorted(k for k in series if wanted(k))
        if not keys:
            continue
        (run_dir / "plots").mkdir(exist_ok=True)
        path = run_dir / "plots" / f"{name}.png"
        if name == "fertility":  # one value per language: bars against the floors, not a curve
            values = {k.removeprefix("tok/").removesuffix("_chars_per_token"): series[k][-1][1] for k in keys}
            plots.append(plot_fertility(values, fertility_floors(run_dir), path))
        else:
            title, ylabel = PLOT_AXES[name]
            plots.append(plot(series, keys, title, path, ylabel, zero_line=name in ZERO_LINE))
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    elif not csv_path.is_file():
        lines += ["No `csv/metrics.csv` in this run (add `logger=csv` or `logger=wandb`, which writes it too).", ""]
    for table in sorted((run_dir / "tables").glob("*.json")):
        data = json.loads(table.read_text())
        cols, rows = data.get("columns", []), data.get("rows", [])
        lines += [f"## Table `{table.stem}` (step {data.get('step', '?')})", "",
                  "| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(v, str(c)) for c, v in zip(cols, r)) + " |" for r in rows]
        lines.append("")
    return storage.write_text(run_dir / "summary.md", "\n".join(lines))


def print_report(cfg: DictConfig, metrics: Mapping[str, float], loggers: Sequence, timing: Mapping | None = None) -> None:
    """The last lines of a run on the console: the final losses (as ``summary.md`` writes them),
    where every output went and, with ``timing``, the wall time, threads and load average."""
    out = Path(cfg.paths.output_dir)
    fmt = lambda k: format_value(k, metrics[k]) if k in metrics else "n/a"  # noqa: E731
    lines = [
        f"train/loss {fmt('train/loss')}  val/loss {fmt('val/loss')}",
        f"run dir     {out}",
        f"config      {out / '.hydra' / 'config.yaml'}",
        f"tokenizer   {out / 'tokenizer.model'}",
        f"checkpoints {cfg.paths.checkpoint_dir} (last.ckpt)",
    ]
    for lg in loggers:
        where = getattr(lg, "log_dir", None) or getattr(lg, "save_dir", None)
        lines.append(f"metrics     {type(lg).__name__}: {where}")
    if timing:
        load = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
        n, n_end = timing["threads"], timing.get("threads_end", timing["threads"])
        # callbacks.threads may have changed the count during the run
        threads = f"{n} thread{'s' * (n != 1)}" if n_end == n else f"threads {n} at start, {n_end} at end"
        lines.append(f"wall time   {format_duration(timing['wall_s'])} ({threads}; load average "
                     f"{load(timing['load_start'])} at start, {load(timing['load_end'])} at end)")
    print("\n".join(lines), flush=True)


def format_duration(seconds: float) -> str:
    """3725.4 -> '1h 02m 05s'; 95 -> '1m 35s'; 4.2 -> '4.2 s'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


# -- names that moved to bnlit.loggers ------------------------------------------------------------
# kept for code written before the move; their home is bnlit.loggers
_MOVED = ('SECRET_KEY', 'SECRET_ENV', 'REDACTED', 'log_metrics', 'run_dir', 'write_json_atomic', 'log_table', 'run_tags', 'sweep_group', 'redact')


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module("bnlit.loggers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bnlit.run_report RUN_DIR")
    print(write_summary(sys.argv[1]))
