"""The per-build data report: what went into the shards and what was dropped on the way.

``build_report`` combines the shard index (documents, characters, tokens per source and split)
with the cleaning statistics of the data build (``stats.json`` of bnlit/data/pipeline.py: filters,
dedup, decontamination, and documents and characters into and out of each stage). ``write_report``
puts ``data_report.json`` and ``data_report.md`` in the run directory; ``log_report`` sends its
tables through :func:`bnlit.loggers.log_table` (W&B and
``<run dir>/tables/``). Evaluation tools read ``validation_decontaminated`` from the JSON: true
when every training document sharing enough n-grams with the validation text was removed.
"""

from __future__ import annotations

import os
from pathlib import Path

from bnlit import storage
from bnlit.checks.fertility import chars_per_token
from bnlit.loggers import write_json_atomic

REPORT_JSON = "data_report.json"
REPORT_MD = "data_report.md"
SPLITS = ("train", "val")


def build_report(index: dict, clean: dict | None, shard_dir: str | os.PathLike | None = None,
                 clean_dir: str | os.PathLike | None = None) -> dict:
    languages: dict[str, dict] = {}
    sources: dict[str, dict] = {}
    for name, entry in index["sources"].items():
        lang = entry["language"]
        src = sources[name] = {"language": lang}
        for split in SPLITS:
            e = entry[split]
            agg = languages.setdefault(lang, {}).setdefault(split, {"docs": 0, "chars": 0, "tokens": 0})
            for k in ("docs", "chars", "tokens"):
                agg[k] += e[k]
            src[split] = {k: e[k] for k in ("docs", "chars", "tokens")}
            src[split]["chars_per_token"] = chars_per_token(e["chars"], e["tokens"], e["docs"])
        if clean is not None and name in clean["sources"]:
            c = clean["sources"][name]
            src["input"] = {"docs": c["input_docs"], "chars": c["input_chars"]}
            src["normalized_changed"] = c["normalized_changed"]
            src["dropped"] = {
                "ocr_debris": c.get("ocr_debris"),
                "filters": c["filters"],
                "dedup": c["dedup"],
                "decontam": c["decontam"],
            }
    for splits in languages.values():
        for e in splits.values():
            e["chars_per_token"] = chars_per_token(e["chars"], e["tokens"], e["docs"])
    return {
        "shard_dir": str(shard_dir) if shard_dir else None,
        "clean_dir": str(clean_dir) if clean_dir else None,
        "tokenizer_sha256": index.get("tokenizer_sha256"),
        "val_fraction": index.get("val_fraction"),
        "cleaned": clean is not None,
        "clean_config": clean["config"] if clean else None,
        "languages": languages,
        "sources": sources,
        "decontam": clean["decontam"] if clean else {},
        "validation_decontaminated": bool(clean and clean.get("validation_decontaminated")),
        # documents and characters into and out of each cleaning stage (datatrove's statistics)
        "stages": clean.get("stages", []) if clean else [],
    }


def dropped_rows(report: dict) -> list[list]:
    """(source, stage, reason, documents, characters) for everything dropped or flagged."""
    rows = []
    for name, s in report["sources"].items():
        d = s.get("dropped")
        if not d:
            continue
        for reason, n in sorted(d["filters"]["details"].items()):
            rows.append([name, "filter", reason, n, None])
        for kind in ("exact", "near"):
            if d["dedup"].get(kind):
                cross = d["dedup"].get(f"{kind}_cross", 0)
                rows.append([name, "dedup", f"{kind} ({cross} of another source)", d["dedup"][kind], None])
        if d["dedup"].get("chars"):
            rows.append([name, "dedup", "characters", None, d["dedup"]["chars"]])
        mode = (report.get("clean_config") or {}).get("decontam", {}).get("mode", "drop")
        for set_name, n in sorted(d["decontam"]["by_set"].items()):
            rows.append([name, f"decontam ({mode})", set_name, n, None])
        if d["decontam"]["docs"]:
            rows.append([name, f"decontam ({mode})", "characters", None, d["decontam"]["chars"]])
        for reason, chars in sorted(d["filters"]["chars"].items()):
            rows.append([name, "filter", f"{reason} characters", None, chars])
    return rows


def ocr_debris_rows(report: dict) -> list[list]:
    """(source, pages, dropped pages, their characters, stripped tokens, their characters) per source
    the OCR debris step checked (bnlit/data/ocr_debris.py)."""
    rows = []
    for name, s in report["sources"].items():
        d = (s.get("dropped") or {}).get("ocr_debris")
        if d and d["pages"]:
            rows.append([name, d["pages"], d["dropped_pages"], d["dropped_chars"], d["stripped_tokens"],
                         d["stripped_chars"]])
    return rows


def stage_rows(report: dict) -> list[list]:
    return [[r["stage"], r["docs_in"], r["chars_in"], r["docs_out"], r["chars_out"], r.get("clusters"),
             round(r["seconds"], 2)] for r in report.get("stages", [])]


def language_rows(report: dict) -> list[list]:
    return [[lang, split, e["docs"], e["chars"], e["tokens"], round(e["chars_per_token"], 3)]
            for lang, splits in report["languages"].items() for split, e in splits.items()]


def decontam_rows(report: dict) -> list[list]:
    return [[name, s["docs"], s["too_short"], s["eval_docs_contaminated"], round(s["contamination_rate"], 4),
             s["eval_docs_touched"], s["train_docs_hit"], s["train_docs_touched"]]
            for name, s in report["decontam"].items()]


STAGE_COLUMNS = ["stage", "docs_in", "chars_in", "docs_out", "chars_out", "duplicate_clusters", "seconds"]
LANGUAGE_COLUMNS = ["language", "split", "docs", "chars", "tokens", "chars_per_token"]
OCR_DEBRIS_COLUMNS = ["source", "pages", "dropped_pages", "dropped_chars", "stripped_tokens", "stripped_chars"]
DROPPED_COLUMNS = ["source", "stage", "reason", "docs", "chars"]
DECONTAM_COLUMNS = ["eval_set", "docs", "too_short", "contaminated", "contamination_rate", "touched",
                    "train_docs_dropped", "train_docs_touched"]


def _md_table(columns: list[str], rows: list[list]) -> str:
    if not rows:
        return "(none)\n"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_markdown(report: dict) -> str:
    parts = ["# Data report\n",
             f"shards: `{report['shard_dir']}`; cleaned: {report['cleaned']}; validation decontaminated "
             f"against training: {report['validation_decontaminated']}\n",
             "## Kept, per language\n", _md_table(LANGUAGE_COLUMNS, language_rows(report)),
             "## Input and kept, per source\n",
             _md_table(["source", "input_docs", "input_chars", "train_docs", "val_docs", "kept_chars"],
                       [[n, s.get("input", {}).get("docs"), s.get("input", {}).get("chars"), s["train"]["docs"],
                         s["val"]["docs"], s["train"]["chars"] + s["val"]["chars"]] for n, s in report["sources"].items()]),
             "## Cleaning stages\n", _md_table(STAGE_COLUMNS, stage_rows(report)),
             "## OCR debris (pages = lines)\n", _md_table(OCR_DEBRIS_COLUMNS, ocr_debris_rows(report)),
             "## Dropped\n", _md_table(DROPPED_COLUMNS, dropped_rows(report)),
             "## Decontamination, per evaluation set\n", _md_table(DECONTAM_COLUMNS, decontam_rows(report))]
    return "\n".join(parts)


def write_report(run_dir: str | os.PathLike, report: dict) -> Path:
    run_dir = Path(run_dir)
    path = write_json_atomic(run_dir / REPORT_JSON, report)
    storage.write_text(run_dir / REPORT_MD, to_markdown(report))
    return path


def log_report(trainer, report: dict) -> None:
    from bnlit.loggers import log_table

    log_table(trainer, "data/languages", LANGUAGE_COLUMNS, language_rows(report))
    log_table(trainer, "data/dropped", DROPPED_COLUMNS, dropped_rows(report))
    if ocr_debris_rows(report):
        log_table(trainer, "data/ocr_debris", OCR_DEBRIS_COLUMNS, ocr_debris_rows(report))
    if report.get("stages"):
        log_table(trainer, "data/stages", STAGE_COLUMNS, stage_rows(report))
    if report["decontam"]:
        log_table(trainer, "data/decontam", DECONTAM_COLUMNS, decontam_rows(report))


def read_report(run_dir: str | os.PathLike) -> dict | None:
    path = Path(run_dir) / REPORT_JSON
    import json

    return json.loads(path.read_text()) if path.is_file() else None


def validation_decontaminated(run_dir: str | os.PathLike) -> bool | None:
    """What an evaluation output should state: True/False from the run's data report, None when
    the run has no report."""
    report = read_report(run_dir)
    return None if report is None else bool(report.get("validation_decontaminated"))


def check_against_training(eval_texts, run_dir: str | os.PathLike, ngram: int | None = None,
                           min_overlap: float | None = None, name: str = "eval") -> dict:
    """Contamination of an evaluation file's texts by the run's cleaned training documents (for
    an evaluation tool given a file after training): :meth:`bnlit.data.decontam.EvalSet.summary`
    plus ``checked_against``. Needs the run's cleaning cache (``clean_dir`` in the report)."""
    from bnlit.data.decontam import contamination
    from bnlit.data.normalize import normalize_text
    from bnlit.data.pipeline import read_clean
    from bnlit.data.shards import is_validation
    from bnlit.errors import DataError

    report = read_report(run_dir)
    if report is None or not report.get("clean_dir") or not Path(report["clean_dir"]).is_dir():
        raise DataError(f"{run_dir}: no data report with a cleaning cache to check against; "
                        "train with data.clean enabled, or keep paths.cache_dir")
    dc = (report.get("clean_config") or {}).get("decontam", {})
    frac = report["val_fraction"]
    train = (t for name_ in report["sources"] for t in read_clean(report["clean_dir"], name_)
             if not is_validation(t, frac))
    out = contamination((normalize_text(t) for t in eval_texts), train, ngram or dc.get("ngram", 13),
                        dc.get("min_overlap", 0.05) if min_overlap is None else min_overlap, name)
    return dict(out, checked_against=report["clean_dir"])


def held_out_documents(run_dir: str | os.PathLike, language: str) -> list[str]:
    """The run's validation documents of ``language`` (every source of it), read back from its
    cleaning cache: the text its ``val`` shards encode, in source order."""
    from bnlit.data.pipeline import read_clean
    from bnlit.data.shards import is_validation
    from bnlit.errors import DataError

    report = read_report(run_dir)
    if report is None or not report.get("clean_dir") or not Path(report["clean_dir"]).is_dir():
        raise DataError(f"{run_dir}: no data report with a cleaning cache to read the held-out text from; "
                        "pass the text with --text LANG=FILE instead")
    names = [n for n, s in report["sources"].items() if s.get("language") == language]
    if not names:
        langs = sorted({s.get("language") for s in report["sources"].values()})
        raise DataError(f"--held-out {language}: the run has no {language} source (it has {', '.join(langs)})")
    frac = report["val_fraction"]
    return [t for n in names for t in read_clean(report["clean_dir"], n) if is_validation(t, frac)]
