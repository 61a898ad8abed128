"""The docs and comments cannot point at what does not exist: every repository path written in the
README, docs/, conf/ comments and the code (``bnlit/x.py``, ``conf/model/tiny.yaml``,
``tests/data/test_dedup.py``...) exists, and every ``docs/<page>.md "Section"`` citation names a
heading of that page. The config keys they name are checked in tests/test_docs_keys.py, the
commands they show in tests/test_documented_commands.py; links and anchors inside the site by
``mkdocs build --strict`` (mkdocs.yml ``validation.links``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w/.-])((?:bnlit|conf|scripts|tests|docs|callbacks|\.ci)/[\w./-]*\w\.(?:py|yaml|md|sh))")
# docs/page.md "Section" (a yaml or python comment may wrap the title over "# " line starts)
SECTION = re.compile(r'(docs/[\w-]+\.md|README\.md) "([^"]+)"')


def sources() -> list[Path]:
    return [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("conf/**/*.yaml"), *ROOT.glob("bnlit/**/*.py"),
            *ROOT.glob("callbacks/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob(".ci/*.py")]


def headings(page: Path) -> set[str]:
    return {re.sub(r"^#+\s*", "", line).strip() for line in page.read_text().splitlines() if line.startswith("#")}


def dangling(files: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for f in files:
        text = f.read_text()
        out += [f"{f.relative_to(root)}: {m.group(1)} does not exist" for m in PATH.finditer(text)
                if not (root / m.group(1)).exists()]
        for m in SECTION.finditer(text):
            title = re.sub(r"\s*\n\s*(#|//)?\s*", " ", m.group(2))
            page = root / m.group(1)
            if page.exists() and title not in headings(page):
                out.append(f'{f.relative_to(root)}: {m.group(1)} has no section "{title}"')
    return out


def test_every_path_and_section_the_docs_and_comments_cite_exists():
    assert dangling(sources()) == []


def test_a_planted_dangling_reference_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text('# A\n\n## Real\n\nsee docs/a.md "Real" and docs/a.md "Gone"\n')
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "x.yaml").write_text("# read bnlit/nowhere.py and docs/a.md \"Real\"\nk: 1\n")
    found = dangling([tmp_path / "docs" / "a.md", tmp_path / "conf" / "x.yaml"], root=tmp_path)
    assert found == ['docs/a.md: docs/a.md has no section "Gone"', "conf/x.yaml: bnlit/nowhere.py does not exist"]
