"""Lightning's ``CSVLogger`` with a resumable ``metrics.csv``. Lightning deletes the file when a
logger opens a directory that holds one, so a resumed run lost every row of the run before
the interruption. This one keeps them and drops only a row torn by a kill mid-write. Steps after
the checkpoint are logged again by the resumed run; ``bnlit.run_report.read_metrics`` keeps the last
value of a step."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


def read_whole_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the complete rows of a CSV file: a last line without its newline, or a row
    with a missing or extra field, was torn by a kill and is dropped."""
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    reader = csv.DictReader(io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
    header = list(reader.fieldnames or [])
    rows = [r for r in reader if None not in r and None not in r.values()]
    return header, rows


def write_rows(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    """Write-then-rename: a kill during the rewrite leaves the old file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


class ResumableExperimentWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file():
            header, rows = read_whole_rows(path)
            self.metrics_keys = sorted(k for k in header if k)
            write_rows(path, self.metrics_keys, rows)


class CSVLogger(_CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to the metrics of the run it resumes."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self.logger_rank_zero():
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumableExperimentWriter(log_dir=self.log_dir)
        return super().experiment

    @staticmethod
    def logger_rank_zero() -> bool:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        return getattr(rank_zero_only, "rank", 0) == 0
