"""The docs cannot show a command that CI does not run after the README's quick-start install:
every ``python -m bnlit.*`` and ``python scripts/*.py`` in README.md and docs/ is covered by an
entry of ``.ci/documented_commands.py`` (by script, by module, or for ``bnlit.train`` by its
config-group choices), which ``.ci/quickstart`` runs in a fresh venv with that install only."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKER = runpy.run_path(str(REPO / ".ci" / "documented_commands.py"))


def test_every_documented_command_is_run_by_the_quickstart_step():
    commands = CHECKER["documented_commands"]()
    assert len(commands) > 30  # the extraction finds the docs' commands
    assert ("README.md", "-m bnlit.train") in commands
    assert CHECKER["uncovered"]() == []


def test_a_command_with_a_new_config_group_choice_is_uncovered():
    known = CHECKER["groups"]()
    keys = CHECKER["smoke_keys"](known)
    cover = lambda cmd: any(k == kind and key <= have for k, have in keys  # noqa: E731
                            for kind, key in [CHECKER["coverage_key"](cmd, known)])
    assert cover("-m bnlit.train model=400m trainer=h100")  # the production one-liner
    assert cover("-m bnlit.train model=1b trainer=h100")  # another preset is the same code
    assert not cover("-m bnlit.train logger=none")  # a choice no entry runs
    assert not cover("scripts/no_such_tool.py --help")


def test_the_install_is_the_readme_quick_start():
    assert CHECKER["install_line"](REPO / "README.md") == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e .")
