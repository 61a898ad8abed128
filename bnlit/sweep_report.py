"""The answer at the end of a sweep: one table of every job, best first.

:class:`SweepReport` is a Hydra callback (``conf/hydra/default.yaml``) that runs in the process
that launched the multirun, whatever the sweeper (grid, Optuna) or launcher (in-process, submitit
on SLURM). When the sweep ends it reads each job's run dir (``.hydra/overrides.yaml``,
``csv/metrics.csv``, ``tables/twin_table.json``) and writes ``sweep_summary.md`` and
``sweep_summary.json`` into the sweep dir and prints the table: the job's own overrides, the final
``val/loss``, held-out bits/char per language and whether it beat the Kneser-Ney bigram there, and
tokens/s. An Optuna sweep adds its best parameters (``optimization_results.yaml``).

``python -m bnlit.sweep_report SWEEP_DIR`` writes and prints the table of a finished sweep.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SUMMARY = "sweep_summary"


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job run dirs (each has ``.hydra/overrides.yaml``), in job order."""
    dirs = [p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")]
    return sorted(dirs, key=lambda p: [int(s) if s.isdigit() else s for s in p.relative_to(sweep_dir).parts])


def _last(csv_path: Path, key: str) -> float | None:
    from bnlit.run_report import read_metrics

    series = read_metrics(csv_path).get(key) if csv_path.is_file() else None
    return series[-1][1] if series else None


def job_row(job: Path, sweep_dir: Path, given: list[str]) -> dict[str, Any]:
    """One job's line of the table (values ``None`` where the job did not log them)."""
    from bnlit.loggers import sweep_overrides

    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict[str, Any] = {"job": str(job.relative_to(sweep_dir)), "overrides": sweep_overrides(overrides, given),
                           "finished": (job / "summary.md").is_file()}
    csv_path = job / "csv" / "metrics.csv"
    row["val_loss"] = _last(csv_path, "val/loss")
    row["tokens_per_s"] = _last(csv_path, "throughput/tokens_per_s")
    langs: dict[str, dict[str, Any]] = {}
    twin = job / "tables" / "twin_table.json"
    if twin.is_file():
        data = json.loads(twin.read_text())
        for r in data.get("rows", []):
            r = dict(zip(data.get("columns", []), r))
            langs[r["language"]] = {"bits_per_char": r.get("trained_bits_per_char"),
                                    "bigram_bits_per_char": r.get("bigram_bits_per_char"),
                                    "beats_bigram": r.get("beat_bigram")}
    row["languages"] = langs
    return row


def _sort_key(row: dict[str, Any]) -> tuple:
    v = row["val_loss"]
    return (not row["finished"], v is None or not math.isfinite(v), v if v is not None else 0.0)


def sweep_table(sweep_dir: str | Path) -> dict[str, Any]:
    """Every job of the sweep in ``sweep_dir``, best (lowest final ``val/loss``) first, and the
    Optuna result where there is one."""
    sweep_dir = Path(sweep_dir)
    record = sweep_dir / "multirun.yaml"
    given = (yaml.safe_load(record.read_text()) or {}).get("hydra", {}).get("overrides", {}).get("task", []) \
        if record.is_file() else []
    rows = sorted((job_row(j, sweep_dir, given) for j in job_dirs(sweep_dir)), key=_sort_key)
    out: dict[str, Any] = {"sweep_dir": str(sweep_dir), "ranked_by": "val/loss (final, lower is better)", "jobs": rows}
    optuna = sweep_dir / "optimization_results.yaml"
    if optuna.is_file():
        result = yaml.safe_load(optuna.read_text()) or {}
        out["best_params"] = result.get("best_params")
        out["best_value"] = result.get("best_value")
    return out


def _num(v: Any, fmt: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def to_markdown(table: dict[str, Any]) -> str:
    langs = sorted({lang for r in table["jobs"] for lang in r["languages"]})
    head = ["rank", "job", "overrides", "val/loss", *[f"{lang} bits/char" for lang in langs],
            "beats the bigram", "tokens/s"]
    lines = [f"# Sweep summary: {Path(table['sweep_dir']).name}", "",
             f"{len(table['jobs'])} jobs, best first by final `val/loss` (held-out bits/char from the random-twin "
             "table; the bigram is the held-out Kneser-Ney bigram).", ""]
    if table.get("best_params") is not None:
        params = " ".join(f"{k}={v}" for k, v in table["best_params"].items())
        lines += [f"Optuna best: `{params}` (val/loss {_num(table.get('best_value'), '.4f')})", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, r in enumerate(table["jobs"], 1):
        verdict = ", ".join(f"{lang} {'yes' if r['languages'][lang]['beats_bigram'] else 'no'}"
                            for lang in langs if r["languages"].get(lang, {}).get("beats_bigram") is not None)
        cells = [str(rank), r["job"], " ".join(f"`{o}`" for o in r["overrides"]) or "(defaults)",
                 _num(r["val_loss"], ".4f") + ("" if r["finished"] else " (did not finish)"),
                 *[_num(r["languages"].get(lang, {}).get("bits_per_char"), ".3f") for lang in langs],
                 verdict or "n/a", _num(r["tokens_per_s"], ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep_summary(sweep_dir: str | Path) -> str:
    """Write ``sweep_summary.md`` and ``.json`` into ``sweep_dir``; return the markdown."""
    from bnlit.loggers import write_json_atomic

    sweep_dir = Path(sweep_dir)
    table = sweep_table(sweep_dir)
    text = to_markdown(table)
    write_json_atomic(sweep_dir / f"{SUMMARY}.json", table)
    (sweep_dir / f"{SUMMARY}.md").write_text(text, encoding="utf-8")
    return text


class SweepReport(Callback):
    """Hydra callback: the sweep's table when a multirun ends. It also keeps the multirun's command
    line in ``multirun.yaml`` where the launcher does not write it (submitit), so each job can tell
    its own overrides from the common ones (its W&B run name, :func:`bnlit.loggers.sweep_job`)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not (sweep_dir / "multirun.yaml").exists():
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(config, sweep_dir / "multirun.yaml")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        text = write_sweep_summary(sweep_dir)
        print(f"\n{text}\nsweep summary: {sweep_dir / (SUMMARY + '.md')} (and .json)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bnlit.sweep_report SWEEP_DIR")
    print(write_sweep_summary(sys.argv[1]))
