"""Nothing installed under a generic top-level name (issue 44, item 5), tried as a new user would.

The references are `ringcheck.reference`: the repository keeps them in its top-level reference/
folder, setup.py installs that folder inside the package, and a checkout finds it under the same
name (`ringcheck._ReferenceBeside`). Before, they installed as the top-level module `reference`,
and in a user's repository with a reference/ package of its own (a common name in ML code)
`python -m pytest --ring-impl ...` stopped at collection: `python -m` puts the user's directory
first on sys.path, so ringcheck's judge imported the user's package (`ImportError: cannot import
name 'dense_grads' from 'reference'`); the other way round, an installed `reference` hid the
user's package from the user's own code.

The user here keeps the ring under test in that package (`--impl reference:ring`), so each run
checks both directions at once: ringcheck judges with its own references, and the user's code
imports the user's. The plugin runs on the checkout under test (what failed), the command on
the wheel built from it, unpacked as an install puts it (the pin of the command puts a
checkout's root, with its reference/ folder, first on the path: the user's package is only
reachable beside an install).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ringcheck
import ringcheck.judge.check  # the judge imports the references: loaded as a run loads them
import ringcheck.reference
from ringcheck.cli.test import pytest_environ
from ringcheck.launch import CLAIMED_BY
from ringcheck.launch.start import worker_context
from ringcheck.pin import pin_directory

HOLDS = Path(ringcheck.__file__).resolve().parents[1]  # the folder that holds the package under test
USER_REFERENCE = '''"""The user's own package named reference (not ringcheck's)."""

from ringcheck.catalogue.mutants import textbook as ring  # the user's ring: a correct one
'''
# 2 derandomized examples a property, after the ringcheck plugin loaded its profile (tryfirst)
FEW = '''def pytest_configure(config):
    from hypothesis import settings

    settings.register_profile("few", settings.get_profile(settings.get_current_profile_name()),
                              max_examples=2, derandomize=True, database=None)
    settings.load_profile("few")
'''
# a user's repository whose packages are named like the folders beside ringcheck's package in a
# checkout (reference/, suites/, examples/, benchmarks/): its ring imports its own of each
USER_PACKAGES = {
    "reference/__init__.py": "",
    "reference/attn.py": '''"""The user's ring, in the user's own package named reference."""

from benchmarks.owner import OWNER as _b
from examples.owner import OWNER as _e
from suites.owner import OWNER as _s

assert (_b, _e, _s) == ("user",) * 3, "not the user's own packages"

from ringcheck.catalogue.mutants import textbook as ring_fn  # noqa: E402  (a correct ring)
''',
    **{f"{name}/{file}": text for name in ("suites", "examples", "benchmarks")
       for file, text in (("__init__.py", ""), ("owner.py", 'OWNER = "user"\n'))},
}
SMALL = ["--seq-len", "32", "--world-size", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
         "--distributions", "normal", "--sample-rows", "4"]


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("user_repo")
    (where / "reference").mkdir()
    (where / "reference" / "__init__.py").write_text(USER_REFERENCE)
    (where / "fewexamples.py").write_text(FEW)
    return where


@pytest.fixture(scope="module")
def users_packages(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("users_packages")
    for name, text in USER_PACKAGES.items():
        (where / name).parent.mkdir(exist_ok=True)
        (where / name).write_text(text)
    (where / "fewexamples.py").write_text(FEW)
    return where


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout under test, built from a copy of what it is built from."""
    if not (HOLDS / "setup.py").is_file():
        pytest.skip(f"ringcheck is imported from an install ({HOLDS}), not from a checkout to build")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here: the wheel is built without build isolation (no network)")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("ringcheck", "reference"):
        shutil.copytree(HOLDS / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(HOLDS / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return next(out.glob("ringcheck-*.whl"))


def _run(argv: list[str], where: Path, pythonpath: list[Path], *, python: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        CLAIMED_BY)}  # a user's plain run, also when this suite runs under torchrun
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([sys.executable, *argv] if python else argv, cwd=where, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _said(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


def test_the_references_are_ringchecks_own():
    assert ringcheck.reference.dense_grads.__module__ == "ringcheck.reference.dense"
    folder = Path(ringcheck.reference.__file__).resolve().parent
    assert folder in (HOLDS / "ringcheck" / "reference", HOLDS / "reference"), folder  # installed, or a checkout
    loaded = getattr(sys.modules.get("reference"), "__file__", None)
    assert loaded is None or Path(loaded).resolve().parent != folder, "ringcheck's references, imported as reference"


@pytest.mark.cli
def test_the_wheel_installs_only_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ringcheck", wheel.name.split("-py")[0] + ".dist-info"}, names
    assert {"ringcheck/reference/__init__.py", "ringcheck/reference/dense.py",
            "ringcheck/reference/mp.py"} <= set(names)
    top = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/top_level.txt")))
    assert top.decode().split() == ["ringcheck"]


@pytest.mark.cli
def test_the_plugin_in_a_repository_with_its_own_reference_package(user_repo, torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    done = _run(["-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-p", "fewexamples", "--ring-impl",
                 "reference:ring", "--ring-world-sizes", "1,2", "-k", "budget_against_float64 and not variant",
                 "-v"], user_repo, [HOLDS])
    assert done.returncode == 0, _said(done)
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert "ringcheck implementation under test: reference:ring" in done.stdout, _said(done)
    assert "test_budget_against_float64[forward+backward] PASSED" in done.stdout, _said(done)


@pytest.mark.cli
def test_a_command_in_a_repository_with_its_own_reference_package(user_repo, wheel, tmp_path, torchrun_world):
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    site = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)  # what pip puts in site-packages (the scripts aside)
    done = _run(["-m", "ringcheck", "validate", "--impl", "reference:ring", "--quick", *SMALL], user_repo,
                [site, user_repo])
    assert done.returncode == 0, _said(done)
    assert "PASSED" in done.stdout and "Traceback" not in done.stderr, _said(done)


def test_the_pin_holds_only_the_package():
    """What the command, its workers and `ringcheck test`'s pytest put first on the path is a
    directory whose only entry is the package (issue 60, item 1): before, the directory that
    holds it (a checkout's root, with its reference/, suites/, examples/, benchmarks/)."""
    pin = Path(pin_directory())
    assert pin != HOLDS and sorted(os.listdir(pin)) == ["ringcheck"], sorted(os.listdir(pin))
    assert set(os.listdir(pin / "ringcheck")) - {"__pycache__"} == {"__init__.py"}  # the stub that loads the package
    assert pytest_environ({"PYTHONPATH": "/x"})["PYTHONPATH"].split(os.pathsep) == [str(pin), "/x"]
    worker_context()  # pins the workers' PYTHONPATH (before their fork server starts)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(pin)


@pytest.mark.cli
def test_the_pin_loads_this_package():
    """A process that starts with only the pin on its path imports this package, under its own
    name and from its own files, and the references with it."""
    pin = Path(pin_directory())
    loads = subprocess.run([sys.executable, "-c", "import ringcheck, ringcheck.reference as r; "
                            "print(ringcheck.__file__); print(r.__name__)"], cwd=pin.parent,
                           env={"PYTHONPATH": str(pin), "PATH": os.environ.get("PATH", "")},
                           capture_output=True, text=True, timeout=60, check=False)
    assert loads.returncode == 0, loads.stderr
    assert loads.stdout.split() == [str(Path(ringcheck.__file__).resolve()), "ringcheck.reference"]


def _editable_install() -> None:
    """Skip unless this interpreter imports the checkout under test without PYTHONPATH (an
    editable install, as README's `pip install -e` makes)."""
    if not (HOLDS / "setup.py").is_file():
        pytest.skip(f"ringcheck is imported from an install ({HOLDS}), not from a checkout")
    found = subprocess.run([sys.executable, "-c", "import ringcheck; print(ringcheck.__file__)"], cwd="/",
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True,
                           text=True, timeout=60, check=False)
    if found.returncode or Path(found.stdout.strip()).resolve().parents[1] != HOLDS:
        pytest.skip(f"this interpreter does not import the checkout {HOLDS} by itself (not an editable install)")


@pytest.mark.cli
@pytest.mark.parametrize("install", ["editable", "wheel"])
@pytest.mark.parametrize("run", ["command", "plugin"])
def test_a_users_own_packages_stay_theirs(request, users_packages, tmp_path, torchrun_world, install, run):
    """README's `pip install -e /path/to/ringcheck`, or a wheel: in a user's repository with its own
    reference/, suites/, examples/ and benchmarks/ packages, `ringcheck validate --impl
    reference.attn:ring_fn` and `python -m pytest --ring-impl reference.attn:ring_fn` run the
    user's code (issue 60, item 1: from a checkout the command exited 2, "cannot import module
    'reference.attn'": its pin had put the checkout's root, with its reference/, first)."""
    if torchrun_world is not None:
        pytest.skip("starts its own local rings: run with plain pytest")
    if install == "editable":
        _editable_install()
        path = [users_packages]
    else:
        site = tmp_path / "site-packages"
        zipfile.ZipFile(request.getfixturevalue("wheel")).extractall(site)
        path = [site, users_packages]
    if run == "command":
        script = Path(sys.executable).parent / "ringcheck"
        start = [str(script)] if install == "editable" and script.is_file() else ["-m", "ringcheck"]
        argv = [*start, "validate", "--impl", "reference.attn:ring_fn", "--quick", *SMALL]
    else:
        argv = ["-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-p", "fewexamples", "--ring-impl",
                "reference.attn:ring_fn", "--ring-world-sizes", "2", "-k", "budget_against_float64 and not variant"]
    done = _run(argv, users_packages, path, python=not argv[0].endswith("ringcheck"))
    assert done.returncode == 0, _said(done)
    assert "Traceback" not in done.stderr and "INTERNALERROR" not in done.stdout, _said(done)
    assert ("PASSED" in done.stdout) if run == "command" else (" passed" in done.stdout), _said(done)
