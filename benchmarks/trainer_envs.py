"""Each trainer's own environment, at the versions the trainer pins, with ringcheck installed into it.

    python -m benchmarks.trainer_envs [--env verl,oldest] [--rebuild] [--out reports/models/trainer_envs.md]
    make trainer-envs

A user installs ringcheck into the environment a trainer made, so ringcheck's `--model` path must
run under the transformers that trainer pins (verl 0.9.1: `>=5.5.3,<5.11`; LLaMA-Factory 0.9.5:
`<=5.6.0`; ms-swift 4.6.0: `<5.20`; OpenRLHF 0.11.2: `==5.15.0`). For each row of ENVS this builds a
virtual environment under .trainer-envs/NAME (git-ignored): torch 2.13's CPU wheel, the trainer's
transformers, the trainer's own package where it installs on Python 3.11 without a GPU (with
--no-deps where its declared dependencies pull a CUDA build or what its glue never imports), and
ringcheck (editable, with its test and peers extras). Then it runs the check there: the `--model` suites and
`ringcheck step --model llama --glue ringcheck -q`, and where the row names them, whether the
trainer's glue modules import (with the row's stubs, e.g. `ray`) and its glue suites. One line per environment: its
versions, its build time and size, and the check's result. An environment is built again only when
its row changes (or with --rebuild). Adding a trainer is one row of ENVS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".trainer-envs"
TORCH = "torch==2.13.0"  # the CPU wheel (never an unpinned torch: that is the multi-GB CUDA build)
RINGCHECK = ".[test,peers]"  # editable; peers: ring-flash-attn, whose Hugging Face adapter is a --glue
MODEL_SUITES = ("suites/test_step_model.py", "suites/test_models_tiny.py", "suites/test_models_semantics.py",
                "suites/test_model_regimes.py", "suites/test_glues.py", "suites/test_ulysses_glue.py")


@dataclass(frozen=True)
class TrainerEnv:
    """One trainer's environment: `transformers` is the trainer's own requirement (pip picks the newest
    version it allows), `packages` what pip installs with its dependencies, `no_deps` what it installs
    without them, `stubs` modules faked (empty, with the names given) when the glue modules are
    imported, `imports` the trainer's glue modules that must import there (`module:function`: a
    function of ringcheck's called, which imports them with ringcheck's own stubs, as its glue does)."""

    name: str
    transformers: str
    packages: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()
    stubs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    imports: tuple[str, ...] = ()
    suites: tuple[str, ...] = ()  # the trainer's glue suites, run there after the --model suites
    trainer: str = ""  # the distribution whose transformers pin is checked against what was installed
    note: str = ""


RAY = ("ray", ("ObjectRef",))  # verl imports ray at its package's import (protocol.py), for annotations
ENVS = (
    TrainerEnv("oldest", "transformers==5.6.0", note="the oldest transformers ringcheck supports (CI runs it)"),
    TrainerEnv("verl", "transformers>=5.5.3,<5.11",
               no_deps=("verl==0.9.1", "tensordict==0.10.0", "omegaconf", "antlr4-python3-runtime==4.9.3",
                        "cloudpickle", "orjson", "pyvers"),
               stubs=(RAY,), imports=("verl.utils.ulysses", "verl.models.transformers.monkey_patch"), trainer="verl",
               note="verl 0.9.1 (Ulysses over flash attention); ray stubbed, not installed"),
    TrainerEnv("llamafactory", "transformers<=5.6.0,>=5.6", no_deps=("llamafactory==0.9.5",),
               imports=("llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel",),
               trainer="llamafactory", note="LLaMA-Factory 0.9.5 (v1 ulysses plugin)"),
    TrainerEnv("ms-swift", "transformers<5.20", no_deps=("ms-swift==4.6.0", "accelerate==1.16.0", "peft==0.20.0"),
               imports=("ringcheck.trainers.ms_swift:swift",), suites=("suites/test_trainer_ms_swift.py",),
               trainer="ms-swift", note="ms-swift 4.6.0 as CI installs it (--no-deps, with accelerate and peft); its "
                                        "other module-level imports stubbed by its glue (ringcheck.trainers.stubs)"),
    TrainerEnv("openrlhf", "transformers==5.15.0", no_deps=("openrlhf==0.11.2",), trainer="openrlhf",
               note="OpenRLHF 0.11.2; flash-attn and deepspeed left out (CUDA builds)"),
)


def _digest(env: TrainerEnv) -> str:
    return hashlib.sha256(json.dumps([asdict(env), TORCH, RINGCHECK], sort_keys=True).encode()).hexdigest()[:16]


def _run(cmd: list[str], log, **kw) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, **kw).returncode


def build(env: TrainerEnv, python: str, rebuild: bool, log) -> tuple[Path, float | None]:
    """The environment's folder, and the seconds its build took (None: it was there, from the same row)."""
    where = HOME / env.name
    stamp = where / ".trainer-env"
    if not rebuild and stamp.is_file() and stamp.read_text() == _digest(env):
        return where, None
    shutil.rmtree(where, ignore_errors=True)
    start = time.perf_counter()
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [[python, "-m", "venv", str(where)],
             [*pip, TORCH, env.transformers, *env.packages, "-e", RINGCHECK]]
    if env.no_deps:
        steps.append([*pip, "--no-deps", *env.no_deps])
    for cmd in steps:
        if _run(cmd, log) != 0:
            raise RuntimeError(f"{env.name}: `{' '.join(cmd)}` failed (its output: {log.name})")
    stamp.write_text(_digest(env))
    return where, time.perf_counter() - start


# what runs inside the environment: the versions, the trainer's pin against them, its glue modules' import
PROBE = r"""
import importlib, importlib.metadata as md, json, sys, types
env = json.loads(sys.argv[1])
out = {p: md.version(p) for p in ("torch", "transformers")}
if env["trainer"]:
    out[env["trainer"]] = md.version(env["trainer"])
    from packaging.requirements import Requirement
    pins = [q for q in map(Requirement, md.requires(env["trainer"]) or []) if q.name == "transformers"]
    out["pin"] = ";".join(str(r.specifier) for r in pins if not r.marker and str(r.specifier)) or "any"
    out["pin_ok"] = all(r.specifier.contains(out["transformers"], prereleases=True) for r in pins if not r.marker)
for name, attrs in env["stubs"]:
    stub = sys.modules.setdefault(name, types.ModuleType(name))
    for attr in attrs:
        setattr(stub, attr, type(attr, (), {}))
failed = {}
for module in env["imports"]:
    try:
        name, _, call = module.partition(":")
        found = importlib.import_module(name)
        if call:
            getattr(found, call)()
    except Exception as e:
        failed[module] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
out["imports_failed"] = failed
print(json.dumps(out))
"""


def check(env: TrainerEnv, where: Path, log, workers: str) -> dict:
    """The check in the environment: versions, the --model suites, `ringcheck step --model llama`."""
    py = str(where / "bin" / "python")
    probe = subprocess.run([py, "-c", PROBE, json.dumps(asdict(env))], capture_output=True, text=True, cwd=ROOT)
    if probe.returncode != 0:
        raise RuntimeError(f"{env.name}: the environment's probe failed: {probe.stderr.strip().splitlines()[-1:]}")
    found = json.loads(probe.stdout)
    start = time.perf_counter()
    junit = where / "suites.xml"
    suites = _run([py, "-m", "pytest", *MODEL_SUITES, "-q", "-p", "no:cacheprovider", "-n", workers,
                   f"--junitxml={junit}"], log, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    found["suites"] = junit_counts(junit.read_text() if junit.is_file() else "")
    found["suites_ok"] = suites == 0
    if env.suites:
        own = where / "trainer-suites.xml"
        found["suites_ok"] &= _run([py, "-m", "pytest", *env.suites, "-q", "-p", "no:cacheprovider", "-n", workers,
                                    f"--junitxml={own}"], log) == 0
        found["trainer_suites"] = junit_counts(own.read_text() if own.is_file() else "")
    found["step_ok"] = _run([str(where / "bin" / "ringcheck"), "step", "--model", "llama", "--glue", "ringcheck",
                             "-q"], log) == 0
    found["check_s"] = time.perf_counter() - start
    return found


def junit_counts(junit: str) -> str:
    """`N passed, N failed, N skipped` from pytest's JUnit XML."""
    head = re.search(r"<testsuite [^>]*", junit)
    if not head:
        return "no result"
    n = {k: int(v) for k, v in re.findall(r'\b(tests|failures|errors|skipped)="(\d+)"', head.group(0))}
    bad = n.get("failures", 0) + n.get("errors", 0)
    return f"{n.get('tests', 0) - bad - n.get('skipped', 0)} passed, {bad} failed, {n.get('skipped', 0)} skipped"


def _size(where: Path) -> float:
    """GiB on disk (files, not following links)."""
    return sum(p.lstat().st_size for p in where.rglob("*") if p.is_file() and not p.is_symlink()) / 2 ** 30


def line(env: TrainerEnv, found: dict, built: float | None, size: float) -> str:
    versions = f"transformers {found['transformers']}, torch {found['torch']}"
    if env.trainer:
        ok = "within" if found["pin_ok"] else "OUTSIDE"
        versions += f", {env.trainer} {found[env.trainer]} (transformers {found['pin']}: {ok})"
    failed = found["imports_failed"]
    glue = (f"; glue modules import{' (stubs: ' + ', '.join(s for s, _ in env.stubs) + ')' if env.stubs else ''}"
            if env.imports and not failed else "")
    glue += "".join(f"; {m} does not import: {why}" for m, why in failed.items())
    ok = found["suites_ok"] and found["step_ok"] and not failed and (found.get("pin_ok", True))
    took = "present" if built is None else f"built in {built:.0f} s"
    own = f"; {', '.join(Path(s).name for s in env.suites)} {found['trainer_suites']}" if env.suites else ""
    return (f"{env.name}: {'pass' if ok else 'FAIL'}: {versions}; {took}, {size:.2f} GiB; --model suites "
            f"{found['suites']}{own}; step --model llama {'passed' if found['step_ok'] else 'FAILED'} "
            f"({found['check_s']:.0f} s){glue}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="", help=f"comma-separated names (default: all of {[e.name for e in ENVS]})")
    parser.add_argument("--rebuild", action="store_true", help="build again even where the row has not changed")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the environments are made from")
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers for the suites (default auto)")
    parser.add_argument("--out", default="", help="also write the lines to this Markdown file")
    args = parser.parse_args(argv)
    known = {e.name: e for e in ENVS}
    asked = [n for n in args.env.split(",") if n] or list(known)
    unknown = [n for n in asked if n not in known]
    if unknown:
        print(f"trainer_envs: no environment {unknown}; the rows are {list(known)}", file=sys.stderr)
        return 2
    HOME.mkdir(exist_ok=True)
    lines, ok = [], True
    for name in asked:
        env = known[name]
        with open(HOME / f"{name}.log", "w") as log:
            try:
                where, built = build(env, args.python, args.rebuild, log)
                said = line(env, check(env, where, log, args.workers), built, _size(where))
            except RuntimeError as e:
                said = f"{name}: FAIL: {e}"
        ok &= ": pass:" in said
        lines.append(said)
        print(said, flush=True)
    if args.out:
        Path(args.out).write_text("# ringcheck in each trainer's own environment\n\n" + "\n".join(
            f"- {x}" for x in lines) + f"\n\n`python -m benchmarks.trainer_envs` regenerates it ({os.cpu_count()} "
            f"cores, load {os.getloadavg()[0]:.1f}).\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
