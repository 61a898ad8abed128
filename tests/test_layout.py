"""The package's shape: no import circle between bnlit's modules (imports inside functions count:
a deferred import hides a circle, it does not remove it), the old paths of moved modules still
import as the same module, and the project's own code uses the new paths."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from bnlit.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the installed package (``callbacks/`` installs as
    ``bnlit.callbacks``)."""
    out = {}
    for path in sorted((ROOT / "bnlit").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "callbacks").glob("*.py")):
        name = "bnlit.callbacks" if path.stem == "__init__" else f"bnlit.callbacks.{path.stem}"
        out[name] = path
    return out


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file imports, anywhere in it (top level or in a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}  # `from bnlit import progress`
            found.update(subs & known)
            if not subs <= known:  # a name defined in ``base`` itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(path, name, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 40 and graph["bnlit.train"], "the graph was not read"
    assert circles(graph) == []


def test_the_circle_finder_finds_a_planted_circle():
    graph = import_graph()
    # the circle this layout removed: the data module took its worker signal mask from checkpointing
    graph["bnlit.data.datamodule"] = graph["bnlit.data.datamodule"] | {"bnlit.checkpointing"}
    assert ["bnlit.checkpointing", "bnlit.data.datamodule"] in circles(graph)


def test_deferred_and_relative_imports_are_read(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from bnlit import progress\n    from .loss import loss_fn\n")
    assert imported_modules(f, "bnlit.x", {"bnlit.progress", "bnlit.loss"}) == {"bnlit.progress", "bnlit.loss"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_moved_module_itself(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_the_project_imports_moved_modules_by_their_new_path():
    """The old paths are for configs and code outside this repository: inside it, every import
    and every ``_target_`` names the module where it lives."""
    files = [*ROOT.joinpath("bnlit").rglob("*.py"), *ROOT.joinpath("callbacks").glob("*.py"),
             *ROOT.joinpath("scripts").glob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]
    old = set(MOVED)
    offenders = []
    for path in files:
        if path.name in ("moved.py", "test_layout.py"):
            continue
        for m in imported_modules(path, "", old | {"bnlit.evaluation"}):
            if m in old:
                offenders.append(f"{path.relative_to(ROOT)} imports {m}: use {MOVED[m]}")
    for path in ROOT.joinpath("conf").rglob("*.yaml"):
        for line in path.read_text().splitlines():
            target = line.partition("_target_:")[2].strip()
            if target.rpartition(".")[0] in old:
                offenders.append(f"{path.relative_to(ROOT)}: _target_ {target}")
    assert offenders == []


def test_the_gradient_flow_package_exports_every_public_name_of_its_modules():
    """``bnlit.checks.gradient_flow`` is a package of one-job modules; every public name of each is
    importable from the package, as it was when the package was one module (configs, the callback
    and user code import ``from bnlit.checks.gradient_flow import X``)."""
    import bnlit.checks.gradient_flow as gf

    package = ROOT / "bnlit" / "checks" / "gradient_flow"
    missing = []
    for path in sorted(package.glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"bnlit.checks.gradient_flow.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                     [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)])
            for name in names:
                if not name.startswith("_") and getattr(gf, name, None) is not getattr(module, name):
                    missing.append(f"{path.stem}.{name}")
    assert missing == [] and set(gf.__all__) == {n for n in dir(gf) if not n.startswith("_") and n not in
                                                 ("annotations", *(p.stem for p in package.glob("*.py")))}


def test_live_logging_and_the_end_of_run_report_are_apart():
    """What a run logs while it trains is ``bnlit.loggers``; ``bnlit.run_report`` is what it reports
    at the end: no callback imports the report, the report does not import the loggers, and the
    names that moved keep their old path as the same objects."""
    import bnlit.loggers
    import bnlit.run_report

    graph = import_graph()
    callbacks = sorted(m for m in graph if m.startswith("bnlit.callbacks") and "bnlit.run_report" in graph[m])
    assert callbacks == [] and "bnlit.loggers" not in graph["bnlit.run_report"]
    for name in bnlit.run_report._MOVED:
        assert getattr(bnlit.run_report, name) is getattr(bnlit.loggers, name)
