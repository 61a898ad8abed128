"""Old import paths of modules that moved, kept so that configs, checkpoints' ``_target_`` strings
and code written before the move keep working: ``import bnlit.throughput`` gives the module
object of ``bnlit.speed.throughput`` itself (so patching either name patches the same module).
New code imports the new path; ``tests/test_layout.py`` checks that the project's own code does."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "bnlit.gradient_flow": "bnlit.checks.gradient_flow",
    "bnlit.guard": "bnlit.checks.nan_guard",
    "bnlit.fertility": "bnlit.checks.fertility",
    "bnlit.starvation": "bnlit.checks.starvation",
    "bnlit.dead_vocabulary": "bnlit.checks.dead_vocabulary",
    "bnlit.ngram": "bnlit.evaluation.ngram",
    "bnlit.multiple_choice": "bnlit.evaluation.multiple_choice",
    "bnlit.throughput": "bnlit.speed.throughput",
    "bnlit.flops": "bnlit.speed.flops",
    "bnlit.fast_path": "bnlit.speed.fast_path",
    "bnlit.sdpa": "bnlit.speed.sdpa",
    "bnlit.threads": "bnlit.speed.threads",
    "bnlit.host_malloc": "bnlit.speed.host_malloc",
    "bnlit.validate": "bnlit.preflight",
    "bnlit.csv_logger": "bnlit.loggers",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path of :data:`MOVED` to the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
