"""Third-party messages that tell a bnlit user nothing, filtered out of the console; each entry says
why. Everything else stays, real warnings first among it. ``bnlit.train`` calls :func:`install`
before it builds anything; docs/getting-started.md lists the same table.

A filter matches one message by its text (and, for a warning, its category), never a whole
module or category, so a new warning from the same library still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# (regex on the message, warning category or None for a log record, the logger of a log record, why)
FILTERS: list[tuple[str, type[Warning] | None, str | None, str]] = [
    (r"The `srun` command is available on your system but is not used", Warning, None,
     "Lightning says it on every machine with SLURM installed (three times a run); bnlit runs on SLURM "
     "through hydra/launcher=slurm or srun, and a run without srun is not a mistake"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning, None,
     "a torch deprecation inside Lightning's own code (lightning/pytorch/utilities/_pytree.py); "
     "nothing in a bnlit config changes it"),
    (r"your dataloader is not resumable", Warning, None,
     "false for bnlit: the data module saves and restores the sampler's position, so a resumed run "
     "reads the batches it would have read (tests/test_resume.py)"),
    (r"does not have many workers which may be a bottleneck", Warning, None,
     "the default CPU run reads in-memory token windows, where loader workers cost more than they save; "
     "bnlit measures the loader's share of each step instead (throughput/data_wait_pct)"),
    (r"Precision bf16-mixed is not supported by the model summary", Warning, None,
     "under bf16-mixed the parameters are float32, so the summary's 32-bit size is the right one"),
    (r"^💡 Tip: ", None, "lightning.pytorch.utilities.rank_zero",
     "Lightning's advertisements for its cloud logger and model registry"),
]


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


_installed = False


def install() -> None:
    """Apply :data:`FILTERS` to Python's warnings and to the named loggers (once per process)."""
    global _installed
    if _installed:
        return
    by_logger: dict[str, list[str]] = {}
    for pattern, category, logger, _why in FILTERS:
        if category is not None:
            warnings.filterwarnings("ignore", message=f".*{pattern}", category=category)
        else:
            by_logger.setdefault(logger, []).append(pattern)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropMessages(patterns))
    _installed = True
