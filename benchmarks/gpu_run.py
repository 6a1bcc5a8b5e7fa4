"""The GPU run, one command on a fresh GPU machine: ``python3 -m benchmarks.gpu_run`` from the
repository root (or ``benchmarks/gpu_run.sh``, which sets PYTHONPATH). Issue 64's stages in one go,
within a wall-clock budget (default 8 minutes).

1. The environment (`nvidia-smi -L`, Python, torch, CUDA, Triton, transformers) and the
   dependencies the suites and the CLI import (pytest, hypothesis, mpmath, numpy, rich). Missing
   ones are unpacked from the wheels in `benchmarks/gpu_wheels/` (git-ignored: carry it with the
   tree) into a folder of this run that joins PYTHONPATH; no pip, never an index.
   `python -m benchmarks.gpu_run --fetch-wheels` fills it on a machine with an index
   (`gpu_wheels.txt`: pinned, pure Python, about 4 MB). What is still missing is said, with the
   command that fixes it, and the stages that need it fail at once.
2. The device audit first: ``RINGCHECK_DEVICE_AUDIT=1 python -m ringcheck validate --quick``.
3. The first user's commands on CUDA: ``torchrun --nproc-per-node=1 -m ringcheck validate
   --quick``, and with ``--impl ringcheck --backend triton``.
4. The backend suites with the Triton kernels compiled (TRITON_INTERPRET unset), one stage each;
   the distributed suite under torchrun.
5. Probes of what only a GPU shows (`benchmarks.gpu_probes`): the ring on CUDA tensors against
   float64, a shard past 2^31 elements of row offset (issue 59, defect 11), the torch backend's
   peak against `plan --kernel torch-cuda` (defect 13).
6. The speed table (`benchmarks.gpu_check`), validate at 32K tokens, ``step --model llama``.

Every stage is a process of its own with a timeout (cut to what is left of the budget). Its
output goes to ``OUT/NN-name.log`` as it runs, and ``OUT/summary.json`` and ``summary.md`` are
rewritten after every stage, so a run that is cut short still leaves what finished. ``OUT`` is
``$OUT`` where it is set, else ``reports/gpu/``. Without CUDA the CUDA stages are skipped with
the reason (a CPU rehearsal); the exit status is 1 when a stage that ran failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "gpu_wheels"
WHEEL_PINS = REPO / "benchmarks" / "gpu_wheels.txt"
# module -> the distribution that provides it: what the suites, the plugin and the CLI import
REQUIRED = {"pytest": "pytest", "hypothesis": "hypothesis", "mpmath": "mpmath", "numpy": "numpy", "rich": "rich"}
OPTIONAL = {"matplotlib": "validate's HTML report draws its plots with it", "triton": "the Triton stages",
            "transformers": "step --model", "xdist": "pytest -n (the suites run in one process without it)"}
BUDGET_S = 480
RESERVE_S = 15  # kept for writing the summary after the last stage


@dataclass
class Stage:
    name: str
    command: list[str]
    timeout_s: int
    cuda: bool = False                      # skipped without a CUDA device
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()             # variables removed from the stage's environment
    needs: tuple[str, ...] = ()             # modules it imports (a missing one fails it up front)
    what: str = ""


def out_dir(environ=os.environ) -> Path:
    """Where results go: $OUT where set, else reports/gpu/."""
    return Path(environ["OUT"]) if environ.get("OUT") else REPO / "reports" / "gpu"


# -- dependencies -------------------------------------------------------------------------------

def missing_modules(modules, find_spec=importlib.util.find_spec) -> list[str]:
    return [m for m in modules if find_spec(m) is None]


# a wheel's distribution (its file name's first part, normalised) -> the module that shows it is importable
WHEEL_MODULES = {"pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "packaging": "packaging",
                 "pygments": "pygments", "hypothesis": "hypothesis", "sortedcontainers": "sortedcontainers",
                 "attrs": "attr", "mpmath": "mpmath", "rich": "rich", "markdown_it_py": "markdown_it",
                 "mdurl": "mdurl"}


def check_dependencies(*, find_spec=importlib.util.find_spec, wheels: Path = WHEELS, site: Path | None = None) -> dict:
    """Which required modules are missing; where some are and `wheels` holds wheels, every wheel
    whose module is not importable is unpacked into `site` (a wheel is a zip of its files; no pip,
    no index), which joins sys.path. Returns {"missing", "installed", "site", "advice",
    "optional_missing"}."""
    missing = missing_modules(REQUIRED, find_spec)
    installed: list[str] = []
    if missing and site is not None and wheels.is_dir() and any(wheels.glob("*.whl")):
        installed = unpack_wheels(wheels, site, find_spec)
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        missing = missing_modules(missing, find_spec)
    advice = ""
    if missing:
        names = " ".join(REQUIRED[m] for m in missing)
        advice = (f"missing: {names}. On a machine with a package index run `python -m benchmarks.gpu_run "
                  f"--fetch-wheels` (it fills benchmarks/{wheels.name}/ from {WHEEL_PINS.name}) and carry that "
                  f"folder with the tree; or `pip install --no-index --find-links <wheels> {names}`")
    optional = {m: why for m, why in OPTIONAL.items() if find_spec(m) is None}
    return {"missing": missing, "installed": installed, "site": str(site) if installed else None, "advice": advice,
            "optional_missing": optional}


def unpack_wheels(wheels: Path, site: Path, find_spec=importlib.util.find_spec) -> list[str]:
    """Unpack into `site` each wheel of `wheels` whose module is not importable; their names."""
    import zipfile  # start-up time: only where a dependency is missing

    site.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in sorted(wheels.glob("*.whl")):
        dist = wheel.name.split("-")[0].lower().replace("-", "_")
        module = WHEEL_MODULES.get(dist, dist)
        if find_spec(module) is None:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
            done.append(dist)
    return done


def fetch_wheels(wheels: Path = WHEELS) -> int:
    """Download the pinned pure-Python wheels (`gpu_wheels.txt`) for the GPU machine's Python 3.12."""
    pins = [line.split("#")[0].strip() for line in WHEEL_PINS.read_text().splitlines()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(wheels), *[p for p in pins if p]]
    return subprocess.run(cmd, check=False).returncode


# -- the record ---------------------------------------------------------------------------------

class Results:
    """summary.json and summary.md under `out`, rewritten after every record."""

    def __init__(self, out: Path, meta: dict):
        self.out = out
        self.meta = meta
        self.stages: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        self.write()

    def record(self, **row) -> dict:
        self.stages.append(row)
        self.write()
        return row

    def write(self) -> None:
        body = {"meta": self.meta, "stages": self.stages}
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(body, indent=1, default=str))
        tmp.replace(self.out / "summary.json")
        lines = ["# GPU run", ""] + [f"- {k}: {v}" for k, v in self.meta.items()]
        lines += ["", "| stage | status | seconds | detail |", "|---|---|---|---|"]
        for s in self.stages:
            lines.append(f"| {s['name']} | {s['status']} | {s.get('seconds', '')} | {s.get('detail', '')} |")
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")


# -- one stage ----------------------------------------------------------------------------------

def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " / ".join(line.strip() for line in text[-lines:])[-300:]


def run_stage(stage: Stage, index: int, results: Results, *, deadline: float, cuda: bool,
              missing: list[str] = (), environ=os.environ) -> dict:
    """Run one stage into OUT/NN-name.log and record it: passed, failed, timeout or skipped."""
    row = {"name": stage.name, "what": stage.what, "command": " ".join(stage.command)}
    if stage.cuda and not cuda:
        return results.record(**row, status="skipped", detail="no CUDA device (torch.cuda.is_available() is False)")
    lacking = [m for m in stage.needs if m in missing]
    if lacking:
        return results.record(**row, status="failed", detail=f"missing module(s): {', '.join(lacking)}")
    left = deadline - time.monotonic() - RESERVE_S
    if left < 10:
        return results.record(**row, status="skipped", detail="the run's time budget is spent")
    timeout = int(min(stage.timeout_s, left))
    env = {k: v for k, v in environ.items() if k not in stage.unset} | stage.env
    log = results.out / f"{index:02d}-{stage.name}.log"
    start = time.monotonic()
    with open(log, "w") as sink:
        sink.write(f"$ {row['command']}\n")
        sink.flush()
        proc = subprocess.Popen(stage.command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage's own process group: torchrun's ranks too
            proc.wait()
            rc = None
    seconds = round(time.monotonic() - start, 1)
    if rc is None:
        return results.record(**row, status="timeout", seconds=seconds, log=log.name,
                              detail=f"cut at {timeout} s; last: {_tail(log)}")
    return results.record(**row, status="passed" if rc == 0 else "failed", rc=rc, seconds=seconds, log=log.name,
                          detail=_tail(log))


# -- the stages ---------------------------------------------------------------------------------

def stages(out: Path, python: str = sys.executable) -> list[Stage]:
    """Issue 64's stages, most important first (the budget cuts the last ones)."""
    py, rc = [python], [python, "-m", "ringcheck"]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    compiled = ("TRITON_INTERPRET",)
    suite = [python, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-x"]
    test_kit = ("pytest", "hypothesis", "mpmath", "numpy")
    return [
        Stage("device-audit", [*rc, "validate", "--quick", "--report", str(out / "audit")], 120,
              env={"RINGCHECK_DEVICE_AUDIT": "1"}, needs=("mpmath", "numpy", "rich"),
              what="validate --quick under the device audit (local gloo rings)"),
        Stage("validate-cuda", [*torchrun, "-m", "ringcheck", "validate", "--quick", "--report",
                                str(out / "validate-cuda")], 120, cuda=True, needs=("mpmath", "numpy", "rich"),
              what="the first user's command: torchrun validate --quick on CUDA"),
        Stage("validate-cuda-triton", [*torchrun, "-m", "ringcheck", "validate", "--quick", "--impl", "ringcheck",
                                       "--backend", "triton", "--report", str(out / "validate-triton")], 120,
              cuda=True, unset=compiled, needs=("mpmath", "numpy", "rich", "triton"),
              what="the same with the Triton backend, compiled"),
        Stage("probe-long-shard", [*py, "-m", "benchmarks.gpu_probes", "long_shard", str(out)], 60, cuda=True,
              unset=compiled, needs=("triton",), what="a shard whose row offsets pass 2^31 (defect 11)"),
        Stage("probe-ring", [*py, "-m", "benchmarks.gpu_probes", "ring", str(out)], 90, cuda=True, unset=compiled,
              needs=("numpy",), what="simulate_ring P=1..8 on CUDA, torch and triton, against float64"),
        Stage("probe-torch-peak", [*py, "-m", "benchmarks.gpu_probes", "torch_peak", str(out)], 60, cuda=True,
              what="the torch backend's CUDA peak against plan --kernel torch-cuda (defect 13)"),
        Stage("suite-triton-backend", [*suite, "suites/test_triton_backend.py"], 180, cuda=True, unset=compiled,
              needs=test_kit, what="the Triton backend suite, kernels compiled"),
        Stage("suite-triton-variants", [*suite, "suites/test_triton_variants.py"], 150, cuda=True, unset=compiled,
              needs=test_kit, what="bands, softcap, d_v != d_qk, documents; compiled"),
        Stage("suite-distributed", [*torchrun, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "suites/test_distributed.py"], 120, cuda=True, needs=test_kit,
              what="distributed equals simulated on the torchrun world"),
        Stage("speed", [*py, "-m", "benchmarks.gpu_check", "--no-tests", "--rep-ms", "50"], 120, cuda=True,
              unset=compiled, needs=("triton",), what="Triton block kernels against SDPA, TFLOP/s"),
        Stage("validate-32k", [*torchrun, "-m", "ringcheck", "validate", "--seq-len", "32768", "--dtype", "bfloat16",
                               "--heads", "16", "--kv-heads", "4", "--head-dim", "128", "--layout", "zigzag",
                               "--causal", "--backend", "triton", "--report", str(out / "validate-32k")], 150,
              cuda=True, unset=compiled, needs=("mpmath", "numpy", "rich", "triton"),
              what="validate at 32K tokens, bf16, 16/4 heads of 128, zig-zag, causal"),
        Stage("step-model-llama", [*torchrun, "-m", "ringcheck", "step", "--model", "llama", "--report",
                                   str(out / "step-llama")], 120, cuda=True, needs=("transformers", "rich"),
              what="step --model llama with ringcheck's glue on CUDA"),
        Stage("step-model-ulysses", [*torchrun, "-m", "ringcheck", "step", "--model", "llama", "--glue",
                                     "deepspeed_ulysses", "--report", str(out / "step-ulysses")], 90, cuda=True,
              needs=("transformers", "rich", "deepspeed"), what="DeepSpeed's Ulysses glue (sdpa) on CUDA"),
    ]


def environment() -> dict:
    """The machine and the versions, for the summary's head."""
    import torch  # start-up time: the dependency check runs before torch is imported

    def version(dist):
        try:
            from importlib.metadata import version as v  # start-up time, as above
            return v(dist)
        except Exception:
            return "absent"

    smi = ""
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "no nvidia-smi"
    return {"nvidia-smi": smi, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "triton": version("triton"), "transformers": version("transformers")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=int, default=BUDGET_S, help="wall-clock budget of the whole run")
    parser.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    parser.add_argument("--skip", nargs="+", default=[], metavar="STAGE", help="leave these stages out")
    parser.add_argument("--list", action="store_true", help="print the stages and exit")
    parser.add_argument("--fetch-wheels", action="store_true", help=f"download {WHEEL_PINS.name} into {WHEELS.name}/")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.fetch_wheels:
        return fetch_wheels()
    out = out_dir()
    chosen = [s for s in stages(out) if (args.only is None or s.name in args.only) and s.name not in args.skip]
    if args.list:
        for s in chosen:
            print(f"{s.name:22} {s.timeout_s:>4} s  {'CUDA ' if s.cuda else 'any  '} {s.what}")
        return 0
    deps = check_dependencies(site=Path(os.environ.get("TMPDIR", "/tmp")) / "ringcheck-gpu-site")
    environ = dict(os.environ)
    paths = [p for p in (deps["site"], str(REPO), environ.get("PYTHONPATH")) if p]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    env = environment()
    results = Results(out, {**env, "budget s": args.budget_s, "dependencies": deps})
    print(f"gpu_run: {env['device']}, torch {env['torch']}; results in {out}", flush=True)
    if deps["advice"]:
        print(f"gpu_run: {deps['advice']}", flush=True)
    deadline = start + args.budget_s
    for index, stage in enumerate(chosen, 1):
        row = run_stage(stage, index, results, deadline=deadline, cuda=env["cuda available"],
                        missing=deps["missing"] + list(deps["optional_missing"]), environ=environ)
        print(f"gpu_run: [{time.monotonic() - start:5.0f} s] {stage.name:22} {row['status']:8} "
              f"{row.get('seconds', '')} {row.get('detail', '')[:150]}", flush=True)
    results.meta["wall s"] = round(time.monotonic() - start, 1)
    results.write()
    return 1 if any(s["status"] in ("failed", "timeout") for s in results.stages) else 0


if __name__ == "__main__":
    sys.exit(main())
