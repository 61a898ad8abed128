"""Every measured figure in README.md and docs/ names the command that prints it, the date and the
load average (STYLE.md habit 10: "a figure that no command reproduces is a rumour").

A paragraph, list or table is a measurement when it says so (``measured``, a load average, a
wall time like ``4m 26s``, a rate in steps/s or tokens/s, a step-time ratio) and holds a figure.
It then carries, itself or together with the paragraph that introduces it (a table or a fenced
output and the paragraph right above it share what they name; a table's load column counts):

- a date (``2026-12-03``; where the run's own date is not known, the date of the commit that
  recorded the figure, said as such),
- the load average (``load average 1.3 at start, 2.0 at end``, ``load ~2``), or
  ``load average not recorded``,
- the command, in backticks or in a fenced ``bash`` block.

A figure that could not be traced says ``not re-measured since <date>`` and needs nothing else. A
statement that something is not measured (``not yet measured``) is not a measurement.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# "measured" as a claim; not "is measured against", "a measured matmul", "logged as measured", "measured
# figures" (what a page holds), "measured below" (a pointer)
MEASURED = re.compile(r"(?<![\w_])(?<!as )(?<!a )(?<!else )[Mm]easured\b(?!\s+(?:against|below|as\s+above|figures?|at\)|\(cpu))|"
                      r"load average|\bload [~<]?\d|\d+m \d\d?s\b|\d steps/s|"
                      r"\d tokens/s|step[- ]time ratio|x the step time")
NOT_A_MEASUREMENT = re.compile(r"not yet measured|[Nn]o GPU figure has been measured|not measured")
FIGURE = re.compile(r"\d")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LOAD = re.compile(r"load(?:\s+average)?s?\s+(?:of\s+|at\s+start\s+|was\s+|from\s+|between\s+)?[~<]?\s?\d|"
                  r"load\s+average\s+not\s+recorded")
COMMAND = re.compile(r"`(?:[A-Z_]+=\S* )*(?:python3?|pytest|bash|torchrun|srun|sbatch|llama-[\w-]+)\b[^`]*`|```bash")
UNTRACED = re.compile(r"not\s+re-measured\s+since\s+20\d\d-\d\d-\d\d")


def blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of each block between blank lines (a fenced block is one block)."""
    out, cur, start, fence = [], [], 1, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if not line.strip() and not fence:
            if cur:
                out.append((start, "\n".join(cur)))
            cur = []
        else:
            if not cur:
                start = i
            cur.append(line)
    if cur:
        out.append((start, "\n".join(cur)))
    return out


def provenance(text: str) -> set[str]:
    """What of date, load and command ``text`` names (all three when it says it is untraced); a
    table with a load column names the load of each row."""
    if UNTRACED.search(text):
        return {"date", "load average", "command"}
    have = {name for name, rx in (("date", DATE), ("load average", LOAD), ("command", COMMAND)) if rx.search(text)}
    if text.startswith("|") and "load" in text.splitlines()[0].lower():
        have.add("load average")
    return have


def shown(text: str) -> bool:
    """A table or a fenced output: the paragraph that introduces it may carry its provenance."""
    return text.startswith(("|", "```"))


def is_measurement(text: str) -> bool:
    prose = re.sub(r"\b20\d\d-\d\d-\d\d\b", "", text)
    return (not text.startswith("#") and MEASURED.search(text) is not None and FIGURE.search(prose) is not None
            and NOT_A_MEASUREMENT.search(text) is None)


def missing_provenance(pages: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for page in pages:
        parts = blocks(page.read_text())
        intro = ""  # the last paragraph before the current table or output
        for i, (line, text) in enumerate(parts):
            if not shown(text):
                intro = text
            if not is_measurement(text):
                continue
            have = provenance(text)
            if shown(text):
                have |= provenance(intro)
            # an introduction and the tables and outputs right after it share what they name
            for _, after in itertools.takewhile(lambda b: shown(b[1]), parts[i + 1:]):
                have |= provenance(after)
            lacking = [k for k in ("command", "date", "load average") if k not in have]
            if lacking:
                first = text.splitlines()[0][:80]
                out.append(f"{page.relative_to(root)}:{line}: a measurement without its {', '.join(lacking)}: {first}")
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_measured_figure_names_its_command_date_and_load():
    assert missing_provenance(pages()) == []


def test_a_figure_without_provenance_is_caught(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Speed\n\n"
        "The default run took 4m 26s here.\n\n"  # 3: nothing
        "Measured 2026-12-03 at load average 1.3: `python -m bnlit.train` took 4m 26s.\n\n"  # 5: all three
        "Measured with `python scripts/bench.py`, load ~2: 0.64x the step time.\n\n"  # 7: no date
        "`python scripts/bench_threads.py` (2026-12-03, load average 6.9, 7.3) prints:\n\n"  # 9: the table's intro
        "| threads | step time |\n|---|---|\n| 1 | 1.80 |\n\n"
        "| measured | load average |\n|---|---|\n| 2.03 | 21.7 |\n\n"  # 15: a table after a table
        "The 3.386 bits/char was measured at step 500 (not re-measured since 2026-12-03).\n\n"  # 19: untraced
        "Tokens/s on an H100 is not yet measured.\n")
    assert missing_provenance([page], root=tmp_path) == [
        "docs/page.md:3: a measurement without its command, date, load average: The default run took 4m 26s here.",
        "docs/page.md:7: a measurement without its date: Measured with `python scripts/bench.py`, load ~2: 0.64x the step time.",
    ]
