"""validate's ragged shards and calls that change length, proved: each length mutant of
`ringcheck.catalogue.length_mutants` failed by `ringcheck validate` at its defaults and by the
plugin at ``--profile ci``, naming the checks that catch it; every correct ring passing, with
the ragged rows' margins (worst error / budget) in every dtype. A benchmark: it writes a report
(reports/lengths/README.md and lengths.json) and never fails a test.

Each validate run is the command at its defaults (``--impl`` and the flags of the ring's row
only), in a subprocess, its report read back; each plugin run is ``pytest --ring-impl ...
--profile ci`` on the suite's two ragged-length tests (`test_budget_at_ragged_shards`,
`test_calls_that_change_length`), its JUnit XML read back.

    python -m benchmarks.lengths [--out reports/lengths] [--no-plugin] [--only NAME,...] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = "ringcheck.catalogue.length_mutants"
RAGGED, CHANGING = "ragged shards", "calls that change length"
STAND_IN = ["--flash-attn-stand-in"]
TRITON = {"TRITON_INTERPRET": "1"}
TRITON_SMALL = ["--distributions", "normal,outlier", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                "--seq-len", "512"]
# name -> (--impl, validate's extra flags, environment, must fail: the rows (by the start of their names))
RINGS = {
    "ringcheck bfloat16": ("ringcheck", [], {}, ()),
    "ringcheck float16": ("ringcheck", ["--dtype", "float16"], {}, ()),
    "ringcheck float32": ("ringcheck", ["--dtype", "float32"], {}, ()),
    "textbook": ("ringcheck.catalogue.mutants:textbook", [], {}, ()),
    "textbook float16": ("ringcheck.catalogue.mutants:textbook", ["--dtype", "float16"], {}, ()),
    "torch_cp": ("torch_cp", [], {}, ()),
    "ring_flash_attn:zigzag": ("ring_flash_attn:zigzag", STAND_IN, {}, ()),
    "yunchang:ring:zigzag": ("yunchang:ring:zigzag", STAND_IN, {}, ()),
    **{name: (f"{LENGTHS}:{name}", [], {}, (RAGGED,))
       for name in ("tail_keys_forward", "tail_dkdv_backward", "tail_query_rows")},
    "stale_workspace": (f"{LENGTHS}:stale_workspace", [], {}, (CHANGING,)),
    # every other case at one length in its processes (one distribution, one scaled length): the
    # length change alone shows the stale workspace
    "stale_workspace, one length elsewhere": (f"{LENGTHS}:stale_workspace", ["--distributions", "normal",
                                                                             "--local-lengths", "2"], {}, (CHANGING,)),
    # under Triton's interpreter every kernel program runs in Python: a smaller target (two
    # distributions, 2/1 heads of 32, 512 tokens), the ragged shards as at the defaults
    "ringcheck triton (interpreter)": ("ringcheck", ["--backend", "triton", *TRITON_SMALL], TRITON, ()),
}
PLUGIN_TESTS = ("test_budget_at_ragged_shards", "test_calls_that_change_length")
PLUGIN_RINGS = ("ringcheck", "ringcheck.catalogue.mutants:textbook",
                *(f"{LENGTHS}:{n}" for n in ("tail_keys_forward", "tail_dkdv_backward", "tail_query_rows",
                                             "stale_workspace")))
DETAIL_CHARS = 400


def _env(extra: dict) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run_validate(impl: str, flags: list[str], env: dict) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ringcheck", "validate", "--impl", impl, *flags, "--report", out],
                              cwd=ROOT, env=_env(env), capture_output=True, text=True)
        seconds = time.monotonic() - start
        report = Path(out, "validate.json")
        if not report.is_file():
            return {"exit": done.returncode, "seconds": seconds, "error": (done.stderr or done.stdout)[-DETAIL_CHARS:]}
        doc = json.loads(report.read_text())
    rows = {c["check"]: c for c in doc["checks"]}

    def ratio(row):  # the document writes an infinite error as a string
        return None if not row.get("budget") else float(row["error"]) / float(row["budget"])
    pick = {key: next((r for name, r in rows.items() if name.startswith(key)), None) for key in (RAGGED, CHANGING)}
    return {"exit": done.returncode, "seconds": round(seconds, 1),
            "failing": [name for name, r in rows.items() if r["status"] == "fail"],
            **{key: None if r is None else {"check": r["check"], "status": r["status"], "ratio": ratio(r),
                                             "tensors": {t: round(float(v["ratio"]), 3) for t, v in r["tensors"].items()},
                                             "detail": r["detail"][:DETAIL_CHARS]}
               for key, r in pick.items()}}


def run_plugin(impl: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        xml = Path(out, "junit.xml")
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ring-impl", impl,
                               "--ring-layout", "zigzag", "--profile", "ci", "-k", " or ".join(PLUGIN_TESTS),
                               f"--junitxml={xml}"], cwd=ROOT, env=_env({}), capture_output=True, text=True)
        seconds = time.monotonic() - start
        if not xml.is_file():
            return {"exit": done.returncode, "seconds": seconds, "error": done.stdout[-DETAIL_CHARS:]}
        cases = ET.parse(xml).getroot().iter("testcase")
        result = {}
        for case in cases:
            failed = case.find("failure")
            result[case.get("name")] = ("fail: " + (failed.get("message") or "")[:DETAIL_CHARS] if failed is not None
                                        else "skipped" if case.find("skipped") is not None else "pass")
    return {"exit": done.returncode, "seconds": round(seconds, 1), "tests": result}


def _cell(row) -> str:
    if row is None:
        return "(no row)"
    ratio = "" if row["ratio"] is None else f" {row['ratio']:.3g}"
    return f"{row['status']}{ratio}"


def write(out: Path, validate: dict, plugin: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "lengths.json").write_text(json.dumps({"validate": validate, "plugin": plugin}, indent=1) + "\n")
    lines = ["# validate's ragged shards and the calls that change length, on every CPU ring", "",
             "Written by `python -m benchmarks.lengths`. Each validate run is `ringcheck validate --impl RING` at its "
             "defaults (zig-zag causal bf16, 4 ranks, 2048 tokens; the ragged shards at 66 and 130 tokens per rank, "
             "run 130, 66, 130 in one process) with the ring's flags only; a cell is the row's verdict and its worst "
             "error / budget. Every row and every tensor's margin is in lengths.json.", "",
             "| ring | flags | must fail | exit | ragged shards (66, 130 tokens per rank) | calls that change length "
             "(130, 66, 130) | failing rows | as expected | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, got in validate.items():
        impl, flags, _, must = RINGS[name]
        if "error" in got:
            lines.append(f"| `{impl}` | {' '.join(flags)} | {', '.join(must) or 'nothing'} | {got['exit']} | "
                         f"could not run: {got['error']} | | | no | {got['seconds']} |")
            continue
        failing = got["failing"]
        expected = (all(any(f.startswith(m) for f in failing) for m in must) and got["exit"] == 1) if must else \
            (not failing and got["exit"] == 0)
        lines.append(f"| `{impl}` | {' '.join(flags)} | {', '.join(must) or 'nothing'} | {got['exit']} | "
                     f"{_cell(got[RAGGED])} | {_cell(got[CHANGING])} | {'; '.join(got['failing']) or 'none'} | "
                     f"{'yes' if expected else 'NO'} | {got['seconds']} |")
    if plugin:
        lines += ["", "## The plugin at `--profile ci`", "",
                  "`pytest --ring-impl RING --ring-layout zigzag --profile ci -k '" + " or ".join(PLUGIN_TESTS) + "'`"
                  " (4 examples each, above 64 tokens per rank, leaning to a tile +/- 3).", "",
                  "| ring | " + " | ".join(f"`{t}`" for t in PLUGIN_TESTS) + " | seconds |",
                  "|---|" + "---|" * len(PLUGIN_TESTS) + "---|"]
        for impl, got in plugin.items():
            tests = got.get("tests", {})
            cells = [tests.get(f"{t}[forward+backward]", "(not run)").split(":")[0] for t in PLUGIN_TESTS]
            lines.append(f"| `{impl}` | " + " | ".join(cells) + f" | {got['seconds']} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lengths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "reports" / "lengths"))
    parser.add_argument("--no-plugin", action="store_true", help="validate only")
    parser.add_argument("--only", default=None, help="comma-separated ring names of RINGS (default: all)")
    parser.add_argument("--resume", action="store_true", help="keep the rings already in OUT/lengths.json")
    args = parser.parse_args(argv)
    names = [n for n in RINGS if args.only is None or n in args.only.split(",")]
    out = Path(args.out)
    done = json.loads((out / "lengths.json").read_text()) if args.resume and (out / "lengths.json").is_file() else {}
    validate, plugin = done.get("validate", {}), done.get("plugin", {})
    for name in names:
        if name in validate:
            continue
        impl, flags, env, _ = RINGS[name]
        validate[name] = run_validate(impl, flags, env)
        print(name, validate[name].get("failing", validate[name].get("error")), validate[name]["seconds"], flush=True)
        write(out, validate, plugin)
    for impl in () if args.no_plugin else PLUGIN_RINGS:
        if impl not in plugin:
            plugin[impl] = run_plugin(impl)
            print(impl, plugin[impl].get("tests", plugin[impl].get("error")), flush=True)
            write(out, validate, plugin)
    write(out, validate, plugin)
    print(f"wrote {args.out}/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
