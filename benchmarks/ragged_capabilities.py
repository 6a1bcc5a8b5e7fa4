"""validate's ragged rows under every CPU kernel PyTorch offers this machine (issue 58): the same
exit code under each value of ATEN_CPU_CAPABILITY, and the length mutants failing under each.

    .venv/bin/python -m benchmarks.ragged_capabilities                      # the committed report
    .venv/bin/python -m benchmarks.ragged_capabilities --capabilities default,avx2 --out /tmp/rc

For each capability (`all`, the default: every one this CPU has, up to the one PyTorch picks),
each implementation (`IMPLS`), each layout (contiguous bidirectional, zig-zag causal) and each
input dtype, it runs `ringcheck validate --impl IMPL --only ragged` (the ragged shards and the
calls that change length, at their defaults: 66 and 130 tokens per rank on 4 ranks, every
distribution) as a process of its own with ATEN_CPU_CAPABILITY set (PyTorch reads it when it
loads), and records the exit code and the worst error / budget over the two ragged rows' tensors.
A configuration an implementation refuses (its layouts, its dtypes) exits 2 before any rank
starts, under every capability alike. Then each length mutant of
`ringcheck.catalogue.length_mutants` at `MUTANT_FLAGS`: each must exit 1 under each capability.

Writes `<out>/capabilities.json` and `<out>/capabilities.md` (the command in its first lines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringcheck.catalogue.length_mutants import LENGTH_MUTANTS

from .precision_class import available_capabilities

CAPABILITIES = ("default", "avx2", "avx512")
IMPLS = ("torch_cp", "ring_flash_attn:zigzag", "yunchang:ulysses", "ringcheck")
STAND_IN = ("ring_flash_attn:zigzag", "yunchang:ulysses")  # flash-attn's API: the CPU stand-in
LAYOUTS = (("contiguous", "--no-causal"), ("zigzag", "--causal"))
DTYPES = ("float16", "bfloat16", "float32")
MUTANT_FLAGS = (("--dtype", "float16", "--layout", "contiguous", "--no-causal"),
                ("--dtype", "bfloat16", "--layout", "zigzag", "--causal"))
ROWS = ("ragged shards", "calls that change length")


def run_one(impl: str, flags: tuple[str, ...], capability: str) -> dict:
    """One `validate --only ragged` under `capability`: exit code, worst ratio and its tensor, seconds."""
    with tempfile.TemporaryDirectory() as report:
        cmd = [sys.executable, "-m", "ringcheck", "validate", "--impl", impl, *flags, "--only", "ragged", "-q",
               "--report", report, *(("--flash-attn-stand-in",) if impl in STAND_IN else ())]
        start = time.perf_counter()
        done = subprocess.run(cmd, env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, capture_output=True,
                              text=True, timeout=900)
        seconds = time.perf_counter() - start
        path = Path(report) / "validate.json"
        doc = json.loads(path.read_text()) if path.is_file() else None
    result = {"exit": done.returncode, "seconds": round(seconds, 1), "ratio": None, "tensor": None, "said": ""}
    if doc is None:  # refused before any rank started: the first line of what it said
        said = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        result["said"] = said[-1].strip() if said else ""
        return result
    for check in doc["checks"]:
        if check["check"].startswith(ROWS):
            for tensor, s in check["tensors"].items():  # strict JSON spells inf and nan as strings
                if result["ratio"] is None or float(s["ratio"]) > result["ratio"]:
                    result["ratio"], result["tensor"] = float(s["ratio"]), tensor
    result["failing"] = [c["check"] for c in doc["checks"] if c["status"] == "fail"]
    return result


def cell(r: dict) -> str:
    if r["ratio"] is None:
        return f"{r['exit']} (refused)"
    return f"{r['exit']} ({r['tensor']} {r['ratio']:.3g})"


def markdown(doc: dict) -> str:
    caps = doc["capabilities"]
    lines = ["# validate's ragged rows under every CPU capability (issue 58)", "",
             f"Written by `{doc['command']}` on {doc['cpu']} (torch {doc['torch']}); best capability "
             f"`{doc['best']}`. Each cell: the exit code of `ringcheck validate --impl IMPL --only ragged` "
             f"with `ATEN_CPU_CAPABILITY` set, and the worst error / budget over the ragged rows' tensors "
             f"(the tensor named). Exit 2 (refused): the implementation does not run that layout or dtype, "
             f"said before any rank starts. Per-run seconds and refusals: capabilities.json.", "",
             "| implementation | layout | dtype | " + " | ".join(caps) + " | same exit |",
             "|---|---|---|" + "---|" * len(caps) + "---|"]
    for row in doc["configurations"]:
        exits = {row["runs"][c]["exit"] for c in caps}
        lines.append(f"| `{row['impl']}` | {row['layout']} | {row['dtype']} | "
                     + " | ".join(cell(row["runs"][c]) for c in caps) + f" | {'yes' if len(exits) == 1 else 'NO'} |")
    lines += ["", "## The length mutants (each must exit 1 under each capability)", "",
              "| mutant | flags | " + " | ".join(caps) + " | fails under each |", "|---|---|" + "---|" * len(caps) + "---|"]
    for row in doc["mutants"]:
        ok = all(row["runs"][c]["exit"] == 1 for c in caps)
        lines.append(f"| `{row['impl'].split(':')[-1]}` | {' '.join(row['flags'])} | "
                     + " | ".join(cell(row["runs"][c]) for c in caps) + f" | {'yes' if ok else 'NO'} |")
    refusals = sorted({f"`{r['impl']}` {r['layout']} {r['dtype']}: {run['said']}" for r in doc["configurations"]
                       for run in r["runs"].values() if run["ratio"] is None and run["said"]})
    if refusals:
        lines += ["", "## What the refusals said", "", *(f"- {said}" for said in refusals)]
    same = all(len({r["runs"][c]["exit"] for c in caps}) == 1 for r in doc["configurations"])
    caught = all(r["runs"][c]["exit"] == 1 for r in doc["mutants"] for c in caps)
    lines += ["", f"Every exit code the same across capabilities: {'yes' if same else 'NO'}. "
                  f"Every length mutant fails under each: {'yes' if caught else 'NO'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capabilities", default="all", help="comma-separated, or all (default)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--no-mutants", action="store_true")
    p.add_argument("--out", default="reports/ragged")
    p.add_argument("--resume", action="store_true", help="keep the runs already in <out>/capabilities.json")
    args = p.parse_args(argv)
    caps = available_capabilities() if args.capabilities == "all" else args.capabilities.split(",")
    import torch  # start-up time: the parent needs torch only for its version

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = json.loads((out / "capabilities.json").read_text()) if args.resume else {}
    kept = {(r["impl"], tuple(r["flags"])): r for r in done.get("configurations", []) + done.get("mutants", [])}
    doc = {"command": " ".join(["python -m benchmarks.ragged_capabilities",
                                *(a for a in (argv or sys.argv[1:]) if a != "--resume")]),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "best": available_capabilities()[-1], "capabilities": caps, "configurations": [], "mutants": []}

    def record(part: str, impl: str, flags: tuple[str, ...], extra: dict) -> None:
        row = kept.get((impl, flags))
        if row is None or set(row["runs"]) != set(caps):
            row = {"impl": impl, "flags": flags, **extra, "runs": {c: run_one(impl, flags, c) for c in caps}}
        print(impl, " ".join(flags), {c: cell(r) for c, r in row["runs"].items()}, flush=True)
        doc[part].append(row)
        (out / "capabilities.json").write_text(json.dumps(doc, indent=1) + "\n")  # after every row: resumable

    for name in () if args.no_mutants else LENGTH_MUTANTS:  # the proof that matters most, first
        for flags in MUTANT_FLAGS:
            record("mutants", f"ringcheck.catalogue.length_mutants:{name}", flags, {})
    for impl in args.impls.split(","):
        for layout, causal in LAYOUTS:
            for dtype in args.dtypes.split(","):
                record("configurations", impl, ("--dtype", dtype, "--layout", layout, causal),
                       {"layout": f"{layout} {causal[2:]}", "dtype": dtype})
    (out / "capabilities.md").write_text(markdown(doc))
    print(f"wrote {out / 'capabilities.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
