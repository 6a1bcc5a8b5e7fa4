"""The architecture the README draws, held by the tree: data flows one way, and each room
imports only what is upstream of it. A violation names the module, the line and the rule."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each folder of the library, and the name it is imported under: the repository's reference/ folder
# is ringcheck.reference (setup.py installs it there; ringcheck/__init__ finds it in a checkout)
PACKAGES = {"ringcheck": "ringcheck", "reference": "ringcheck.reference"}
MAX_LINES = 450
KERNELS = {"ringcheck/ring/backends/triton_fwd.py", "ringcheck/ring/backends/triton_bwd.py"}


def _modules():
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@functools.cache
def _parse(text: str, filename: str) -> ast.Module:
    """A module's tree, parsed once per worker (most tests here read every module)."""
    return ast.parse(text, filename=filename)


def _tree(path: Path) -> ast.Module:
    return _parse(path.read_text(), str(path))


def _name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGES[folder], *rest]).removesuffix(".__init__")


def _imports(path: Path):
    return _imports_of(path, _name(path))


def _imports_of(path: Path, name: str) -> tuple:
    """(line, imported module, at function level) for every import of a module, resolved."""
    return _resolved_imports(path.read_text(), str(path), name, path.name == "__init__.py")


@functools.cache
def _resolved_imports(text: str, filename: str, name: str, is_package: bool) -> tuple:
    return tuple(_each_import(_parse(text, filename), name.split(".") if is_package else name.split(".")[:-1]))


def _each_import(tree: ast.Module, package: list[str]):
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


# the commands that are packages: the entry in __init__.py, its parts beside it (issue 44)
COMMAND_PACKAGES = ("validate", "drift", "bench")
# (who, may not import, why)
RULES = [
    (("ringcheck",), ("suites", "benchmarks"), "the library never imports the suites or the tools"),
    (("ringcheck.reference",), ("ringcheck.ring", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                                "ringcheck.render", "ringcheck.launch", "ringcheck.documents", "ringcheck.cli"),
     "the references import nothing of ringcheck but its spec"),
    (("ringcheck.ring",), ("ringcheck.reference", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                           "ringcheck.render", "ringcheck.documents", "ringcheck.cli", "ringcheck.launch"),
     "the engine imports nothing downstream, and never a reference"),
    (("ringcheck.judge",), ("ringcheck.commands", "ringcheck.testing", "ringcheck.render", "ringcheck.documents",
                            "ringcheck.cli"), "judging imports nothing downstream"),
    (("ringcheck.documents",), ("ringcheck.commands", "ringcheck.render", "ringcheck.cli"),
     "documents are written below the commands that fill them"),
    (("ringcheck.spec",), ("ringcheck.ring", "ringcheck.judge", "ringcheck.commands", "ringcheck.testing",
                           "ringcheck.render", "ringcheck.launch", "ringcheck.reference"), "the spec is the root"),
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
    (("ringcheck.pin",), ("ringcheck", "torch"),
     "the pin is the standard library's alone: the entry and the launcher take it before anything else"),
    (("ringcheck.plan",), ("torch", "ringcheck.spec", "ringcheck.ring", "ringcheck.judge", "ringcheck.commands",
                           "ringcheck.testing", "ringcheck.render", "ringcheck.documents", "ringcheck.cli",
                           "ringcheck.launch", "ringcheck.harness", "ringcheck.adapters", "ringcheck.measure",
                           "ringcheck.reference"),
     "the plan's arithmetic is pure: no torch, nothing of the rest of ringcheck"),
    (("ringcheck.models",), ("ringcheck.commands", "ringcheck.cli", "ringcheck.render", "ringcheck.testing",
                             "ringcheck.documents"),
     "the tiny models and their native truth sit below the commands, the test kit and the reports that use them"),
    (("ringcheck.judge.results",), ("ringcheck.judge.check", "ringcheck.judge.conventions",
                                    "ringcheck.judge.scores", "ringcheck.judge.precision"),
     "what every judge shares sits below them all"),
    (("ringcheck.commands",), ("ringcheck.cli", "ringcheck.render", "ringcheck.testing"),
     "the commands compute below the CLI, the reports and the test kit that present and use them"),
    *((("ringcheck.commands." + me,), tuple(f"ringcheck.commands.{c}" for c in COMMAND_PACKAGES if c != me),
       "one command's package imports no other's: what two commands share moves below them")
      for me in COMMAND_PACKAGES),
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
    module.write_text("from ..judge.check import Case\nfrom ..reference import dense_grads\n"
                      "from rich.table import Table\n")
    found = _broken_rules("ringcheck.ring.bad", list(_imports_of(module, "ringcheck.ring.bad")))
    assert [b.split(": ", 1)[1] for b in found] == [
        "the engine imports nothing downstream, and never a reference",
        "the engine imports nothing downstream, and never a reference",
        "only render/ presents"]
    assert _broken_rules("ringcheck.reference.dense", [(1, "ringcheck.ring.api", False)])
    assert not _broken_rules("ringcheck.reference.dense", [(1, "ringcheck.spec", False)])
    assert _broken_rules("ringcheck.plan.ring", [(1, "torch", False)])  # the plan's arithmetic needs no torch
    assert not _broken_rules("ringcheck.plan.ring", [(1, "ringcheck.plan.hardware", False)])


def _top_level_reference_imports(path: Path) -> list[int]:
    """The lines that import a top-level module named `reference` (absolute imports only)."""
    tree = _tree(path)
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "reference" for a in node.names)
            or isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "reference"]


def test_nothing_imports_the_generic_top_level_name_reference(tmp_path):
    """The references are `ringcheck.reference` (issue 44): a top-level `reference` is a user's
    own package as often as not, and `python -m pytest` in the user's repository finds theirs
    first. Code merged from before the rename still says `from reference import ...` and would
    run from a checkout (its root on the path) but not from a wheel: every Python file of the
    repository is read. A planted import of each spelling is named; ours is not."""
    files = [*_modules(), *ROOT.glob("*.py"), *(p for d in ("suites", "benchmarks", "examples")
                                                for p in (ROOT / d).rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in _top_level_reference_imports(p)]
    assert not found, "import ringcheck.reference (or a relative form), never the top-level reference: " + \
        ", ".join(found)
    planted = tmp_path / "planted.py"
    planted.write_text("import reference\nimport reference.mp as mp\nfrom reference.dense import dense_grads\n"
                       "from reference import mp_attention\nfrom ringcheck.reference import dense_attention\n"
                       "from .reference import attention_mask\nimport ringcheck.reference.cache\n")
    assert _top_level_reference_imports(planted) == [1, 2, 3, 4]


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
        tree = _tree(path)
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


def _imports_of_the_entry(path: Path, name: str) -> list[str]:
    """The imports by a part of a command's package (`ringcheck.commands.validate.steps`) of the
    package's own entry, its __init__.py: the names it takes from the package itself rather than
    from a module beside it (`from . import Target`, `from ringcheck.commands.validate import
    validate`). The entry imports its parts, so a part that imported it would close a circle."""
    package = next((f"ringcheck.commands.{c}" for c in COMMAND_PACKAGES
                    if name.startswith(f"ringcheck.commands.{c}.")), None)
    if package is None:
        return []
    parts = {p.stem for p in (ROOT / "ringcheck" / "commands" / package.rsplit(".", 1)[1]).glob("*.py")}
    return [f"{name}:{line} imports {module}" for line, module, _ in _imports_of(path, name)
            if module == package or _under(module, package)
            and module[len(package) + 1:].split(".")[0] not in parts]


def test_the_parts_of_a_command_sit_below_its_entry(tmp_path):
    """Each command package's modules import modules beside them, never the package's entry;
    a planted part that does, in either spelling, is named, and one that imports a part is not."""
    found = [b for path in _modules() for b in _imports_of_the_entry(path, _name(path))]
    assert not found, "a part of a command imports its entry (move what both need into a part):\n" + \
        "\n".join(found)
    planted = tmp_path / "part.py"
    planted.write_text("from . import Target\nfrom ringcheck.commands.validate import validate\n"
                       "from .target import Target\nfrom . import rows\n")
    assert [b.split(":")[1] for b in _imports_of_the_entry(planted, "ringcheck.commands.validate.part")] == \
        ["1 imports ringcheck.commands.validate.Target", "2 imports ringcheck.commands.validate"]


def test_one_command_imports_no_other_commands_package():
    """drift taking validate's target (or bench validate's rows) would tie two commands' rooms:
    named. step, a flat module above validate, may use validate's `Target`."""
    assert _broken_rules("ringcheck.commands.drift", [(1, "ringcheck.commands.validate.target", False)])
    assert _broken_rules("ringcheck.commands.bench.tasks", [(1, "ringcheck.commands.drift", False)])
    assert _broken_rules("ringcheck.commands.validate.rows", [(1, "ringcheck.cli.common", False)])
    assert not _broken_rules("ringcheck.commands.step", [(1, "ringcheck.commands.validate.target", False)])
    assert not _broken_rules("ringcheck.commands.validate", [(1, "ringcheck.commands.validate.steps", False)])


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


# the dependencies whose private names ringcheck calls only through its doors (ringcheck/thirdparty/),
# with the names modules bind them to
DEPENDENCIES = ("torch", "transformers", "deepspeed", "flash_attn", "triton")
BOUND = {"dist": "torch.distributed", "F": "torch.nn.functional", "mpu": "deepspeed", "tl": "triton.language"}
DOORS = ("ringcheck.thirdparty", "ringcheck.flash_stand_in")  # the doors, and our own copy of flash-attn's API


def _private_reaches(path: Path) -> list[str]:
    """`module:line name` for every private name of a dependency that `path` imports or reaches
    as an attribute (torch.autograd._make_grads, dist.distributed_c10d._world)."""
    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))

    def chain(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        return ".".join([BOUND.get(node.id, node.id), *reversed(parts)])

    found = []
    for node in ast.walk(_tree(path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and private(node.attr):  # the first private step of a chain
            names = [c for c in [chain(node)] if c and not private(c.rsplit(".", 1)[0])]
        found += [f"{_name(path)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] in DEPENDENCIES and private(n)]
    return found


def test_third_party_private_names_go_through_their_door():
    """Each dependency's private surface is reached through one module of ringcheck/thirdparty/,
    which names the version and the fix where it has moved (issue 60, item 2)."""
    found = [f for p in _modules() if not _under(_name(p), *DOORS) for f in _private_reaches(p)]
    assert not found, "reach these through ringcheck/thirdparty/ (one door per dependency):\n" + "\n".join(found)


def test_the_doors_import_nothing_else_of_ringcheck():
    """Every floor uses the doors (launch/, adapters/, the ring's backends), so they stand below all."""
    up = [f"{_name(p)}:{line} imports {m}" for p in _modules() if _under(_name(p), "ringcheck.thirdparty")
          for line, m, _ in _imports(p) if _under(m, "ringcheck") and not _under(m, "ringcheck.thirdparty")]
    assert not up, "\n".join(up)


# ---- functions and names (issue 60 item 3) ----------------------------------------------------

MAX_FUNCTION_LINES = 80


def _long_functions(path: Path, name: str) -> list[str]:
    """Every function (a method, a nested one, a Triton kernel) longer than MAX_FUNCTION_LINES,
    counted from its `def` to its last line."""
    tree = _tree(path)
    return [f"{name}:{node.lineno} {node.name} is {n} lines" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]


def test_no_function_over_the_length_limit(tmp_path):
    """A function over 80 lines is split into named steps; a planted one is named."""
    long = [b for path in _modules() for b in _long_functions(path, _name(path))]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)
    planted = tmp_path / "long.py"
    planted.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert _long_functions(planted, "ringcheck.long") == [f"ringcheck.long:5 long is {MAX_FUNCTION_LINES + 1} lines"]


def _private_imports(path: Path, name: str) -> list[str]:
    """The private names (`_x`, not `__x__`) a module imports from another module of the library
    (ringcheck, or ringcheck.reference), at any level, in any spelling of the import: what two
    modules share is public in the module that defines it. A third-party private name (torch's,
    transformers') is not the library's to rename: its door is elsewhere."""
    tree = _tree(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            module = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if not _under(module, "ringcheck", "reference"):
            continue
        found += [f"{name}:{node.lineno} imports {module}.{a.name}: a private name imported across modules "
                  f"(make it public where it is defined)"
                  for a in node.names if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))]
    return found


def test_no_private_name_is_imported_across_modules(tmp_path):
    """`from .call import _Prepared` ties one module to another's inside: what is shared is public.
    A planted import of each spelling (relative, absolute, multi-line, inside a function) is named;
    a public name imported under a private alias, a dunder and a third-party private name are not."""
    found = [b for path in _modules() for b in _private_imports(path, _name(path))]
    assert not found, "\n".join(found)
    planted = tmp_path / "planted.py"
    planted.write_text("from .call import _Prepared, run_shards\n"
                       "from ringcheck.render.plots import (\n    FIGURE_DPI,\n    _pyplot,\n)\n"
                       "def f():\n    from ..testing.properties import _inputs\n"
                       "from .impl_draws import plain as _plain\n"
                       "from torch.distributed.tensor.experimental._attention import _cp_options\n"
                       "from . import __version__\n")
    assert [b.split(" imports ")[1].split(":")[0] for b in _private_imports(planted, "ringcheck.harness.planted")] == [
        "ringcheck.harness.call._Prepared", "ringcheck.render.plots._pyplot", "ringcheck.testing.properties._inputs"]


def _imports_of_the_trainers(path: Path, name: str) -> list[str]:
    """The imports of `ringcheck.trainers` (at module level or inside a function) by a module of
    `ringcheck.glues`."""
    if not _under(name, "ringcheck.glues"):
        return []
    return [f"{name}:{line} imports {module}: the trainers build on the glue contract, so glues/ imports no "
            f"trainer (a trainer's glue is named by the layer above both, ringcheck.models.step)"
            for line, module, _ in _imports_of(path, name) if _under(module, "ringcheck.trainers")]


def test_the_glues_import_no_trainer(tmp_path):
    """One direction between glues/ and trainers/: trainers/ imports `glues.contract`, so glues/
    never imports trainers/, not even inside a function (it once resolved `--glue
    deepspeed_ulysses` there). A planted lazy import is named."""
    found = [b for path in _modules() for b in _imports_of_the_trainers(path, _name(path))]
    assert not found, "\n".join(found)
    planted = tmp_path / "loader.py"
    planted.write_text("def load():\n    from ..trainers.deepspeed_ulysses import deepspeed_ulysses_glue  # lazy\n"
                       "from ..spec import LAYOUTS\n")
    assert [b.split(" imports ")[1].split(":")[0] for b in _imports_of_the_trainers(planted, "ringcheck.glues.loader")] \
        == ["ringcheck.trainers.deepspeed_ulysses"]
    assert not _imports_of_the_trainers(planted, "ringcheck.models.step")
