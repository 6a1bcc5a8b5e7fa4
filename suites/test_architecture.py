"""The architecture the README draws, held by the tree: data flows one way, and each room
imports only what is upstream of it. A violation names the module, the line and the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ringcheck", "reference")
MAX_LINES = 450
KERNELS = {"ringcheck/ring/backends/triton_fwd.py", "ringcheck/ring/backends/triton_bwd.py"}


def _modules():
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path):
    return _imports_of(path, _name(path))


def _imports_of(path: Path, name: str):
    """(line, imported module, at function level) for every import of a module, resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in nested
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            for name in names:
                yield node.lineno, name, id(node) in nested


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# (who, may not import, why)
RULES = [
    (("ringcheck", "reference"), ("suites", "benchmarks"), "the library never imports the suites or the tools"),
    (("reference",), ("ringcheck.ring", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                      "ringcheck.render", "ringcheck.launch", "ringcheck.documents", "ringcheck.cli"),
     "the references import nothing of ringcheck but its spec"),
    (("ringcheck.ring",), ("reference", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                           "ringcheck.render", "ringcheck.documents", "ringcheck.cli", "ringcheck.launch"),
     "the engine imports nothing downstream, and never a reference"),
    (("ringcheck.judge",), ("ringcheck.commands", "ringcheck.testing", "ringcheck.render", "ringcheck.documents",
                            "ringcheck.cli"), "judging imports nothing downstream"),
    (("ringcheck.documents",), ("ringcheck.commands", "ringcheck.render", "ringcheck.cli"),
     "documents are written below the commands that fill them"),
    (("ringcheck.spec",), ("ringcheck.ring", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                           "ringcheck.render", "ringcheck.launch", "reference"), "the spec is the root"),
    (("ringcheck.launch", "ringcheck.harness"), ("ringcheck.entry", "ringcheck.cli", "ringcheck.commands",
                                                 "ringcheck.testing"),
     "process groups and the harness run below the commands (a worker's start is launch.start's)"),
    (("ringcheck.measure",), ("ringcheck.commands", "ringcheck.cli", "ringcheck.render", "ringcheck.testing",
                              "ringcheck.documents"),
     "measurements sit below the commands, the test kit and the reports that use them"),
    (("ringcheck.glues",), ("reference", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                            "ringcheck.render", "ringcheck.documents", "ringcheck.cli", "ringcheck.step",
                            "ringcheck.catalogue"),
     "a glue sits between a model and a ring: below the step, the commands and the catalogue that use it"),
    (("ringcheck",), ("ringcheck.entry",), "only the console script's own modules import the entry"),
    (("ringcheck.plan",), ("torch", "ringcheck.spec", "ringcheck.ring", "ringcheck.judge", "ringcheck.commands",
                           "ringcheck.testing", "ringcheck.render", "ringcheck.documents", "ringcheck.cli",
                           "ringcheck.launch", "ringcheck.harness", "ringcheck.adapters", "ringcheck.measure"),
     "the plan's arithmetic is pure: no torch, nothing of the rest of ringcheck"),
    (("ringcheck.models",), ("ringcheck.commands", "ringcheck.cli", "ringcheck.render", "ringcheck.testing",
                             "ringcheck.documents"),
     "the tiny models and their native truth sit below the commands, the test kit and the reports that use them"),
    (("ringcheck.judge.results",), ("ringcheck.judge.check", "ringcheck.judge.conventions",
                                    "ringcheck.judge.scores", "ringcheck.judge.precision"),
     "what every judge shares sits below them all"),
]
ENTRY_IMPORTERS = ("ringcheck.__main__",)  # `python -m ringcheck` is the entry too
PRESENTATION = ("rich", "matplotlib", "PIL")


def _broken_rules(me: str, imports) -> list[str]:
    broken = []
    for line, module, _ in imports:
        for who, banned, why in RULES:
            if _under(me, *who) and _under(module, *banned) and not (module == "ringcheck.entry" and
                                                                     (me in ENTRY_IMPORTERS or me == module)):
                broken.append(f"{me}:{line} imports {module}: {why}")
        if _under(module, *PRESENTATION) and not _under(me, "ringcheck.render"):
            broken.append(f"{me}:{line} imports {module}: only render/ presents")
    return broken


def test_data_flows_one_way():
    broken = [b for path in _modules() for b in _broken_rules(_name(path), _imports(path))]
    assert not broken, "\n".join(broken)


def test_the_rules_catch_a_planted_upstream_import(tmp_path):
    """A ring module that imports the judge, a reference that imports the ring, a command that
    prints with rich: each is named."""
    planted = tmp_path / "ringcheck" / "ring"
    planted.mkdir(parents=True)
    module = planted / "bad.py"
    module.write_text("from ..judge.check import Case\nimport reference\nfrom rich.table import Table\n")
    found = _broken_rules("ringcheck.ring.bad", list(_imports_of(module, "ringcheck.ring.bad")))
    assert [b.split(": ", 1)[1] for b in found] == [
        "the engine imports nothing downstream, and never a reference",
        "the engine imports nothing downstream, and never a reference",
        "only render/ presents"]
    assert _broken_rules("reference.dense", [(1, "ringcheck.ring.api", False)])
    assert not _broken_rules("reference.dense", [(1, "ringcheck.spec", False)])
    assert _broken_rules("ringcheck.plan.ring", [(1, "torch", False)])  # the plan's arithmetic needs no torch
    assert not _broken_rules("ringcheck.plan.ring", [(1, "ringcheck.plan.hardware", False)])


def test_no_module_over_the_size_limit():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
           if str(p.relative_to(ROOT)) not in KERNELS and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split them into named parts): {big}"


def test_function_level_imports_say_why():
    """Only where they guard an optional dependency or start-up time, with a comment saying which
    (on the import line or the line above it)."""
    def said(lines: list[str], line: int) -> bool:
        """A comment on the import, on another import of its group, or on the line above the group."""
        i = line - 1
        while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
            i -= 1
        group = lines[i:line]
        return any("#" in text for text in group) or lines[i - 1].strip().startswith("#")

    silent = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for line, module, nested in _imports(path):
            if nested and not said(lines, line):
                silent.append(f"{path.relative_to(ROOT)}:{line} imports {module} inside a function without a reason")
    assert not silent, "\n".join(silent)


def test_tests_and_tools_import_no_private_names():
    private = []
    for path in sorted([*(ROOT / "suites").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                private += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("suites"):
                private.append(f"{path.relative_to(ROOT)}:{node.lineno} imports a test module ({node.module})")
    assert not private, "\n".join(private)


@pytest.mark.parametrize("mutant", ["textbook", "diagonal_off_by_one"])
def test_the_mutant_catalogue_is_importable_from_the_package(mutant):
    from ringcheck.adapters import load_impl

    impl = load_impl(f"ringcheck.catalogue.mutants:{mutant}", layout="zigzag")
    assert callable(impl.fn)


def test_the_plugin_is_registered_under_pytest11():
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="pytest11")}
    assert "ringcheck.testing.plugin" in names
    # the suites load it (and their defaults) through pyproject's addopts; the root conftest.py names
    # no plugin (pytest refuses that above the root of another project's run, which an editable
    # install's in-package suite is: suites/test_ring_impl_plugin.py runs one)
    tree = ast.parse((ROOT / "conftest.py").read_text())
    assert not [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name) and t.id == "pytest_plugins"]
    assert "-p ringcheck.testing.plugin -p ringcheck.testing.suite_defaults" in (ROOT / "pyproject.toml").read_text()


def test_no_module_imports_upward_into_the_commands_or_the_entry():
    """A launcher module that takes its workers' start context from the command's entry (it once
    did: one circle of 24 files), and the entry imported by anything but `python -m ringcheck`,
    are named; the judges' shared results sit below them."""
    assert _broken_rules("ringcheck.launch.local", [(1, "ringcheck.entry", False)])
    assert _broken_rules("ringcheck.cli", [(1, "ringcheck.entry", False)])
    assert _broken_rules("ringcheck.judge.results", [(1, "ringcheck.judge.check", False)])
    assert _broken_rules("ringcheck.measure.memory", [(1, "ringcheck.commands.validate", False)])
    assert not _broken_rules("ringcheck.__main__", [(1, "ringcheck.entry", False)])
    assert not _broken_rules("ringcheck.entry", [(1, "ringcheck.launch.start", False)])


def _circles() -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (every import,
    function-level ones too: a lazy import is still an arrow), found with Tarjan's algorithm."""
    names = {_name(p): p for p in _modules()}
    edges = {me: sorted({m for _, m, _ in _imports(p) if m in names and m != me}) for me, p in names.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(names):
        if v not in index:
            visit(v)
    return found


def test_no_circle_of_imports():
    """No two modules import each other, directly or around a loop (issue 37: a 24-file circle
    through cli/, commands/, entry.py, harness/ and launch/, and check <-> conventions <-> scores)."""
    circles = _circles()
    assert not circles, "import circles (move what both need to a module below them): " + "; ".join(
        " <-> ".join(c) for c in circles)
