"""validate's recompute and compile rows, proved on every ring that runs on the CPU: each mutant
caught by its row and by no other, no row failing a correct ring, at ring sizes 2, 4 and 8, five
runs each, the later ones under a load of busy processes beside the rings. A benchmark: it
writes a report (reports/wrapped/README.md and wrapped.json) and never fails a test.

Each run is `ringcheck validate` of a small target (one scaled-down case at 2 tokens per rank,
the full length on 4 sampled rows) in the default embedding (two interleaved rings, cp=P,tp=2),
through the Python API on one set of local rings. The compile row (``--compile``: seconds of
dynamo per rank) runs once per ring and size in `--compile-sizes`; at 8 ranks and more only on
`LARGE_COMPILE` (our ring, the textbook ring and the compile mutant).

    python -m benchmarks.wrapped [--sizes 2,4,8] [--runs 5] [--loaded-runs 3] [--load 2]
                                 [--compile-sizes 2,4,8] [--out reports/wrapped]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

from ringcheck.commands.validate import Target, validate
from ringcheck.commands.validate.wrapped import COMPILE_ROW, RECOMPUTE_ROW
from ringcheck.launch import LocalRings, RingError
from ringcheck.launch.start import preload_in_workers

WRAPPED = "ringcheck.catalogue.wrapped_mutants"
SMALL = dict(heads=4, kv_heads=2, head_dim=32, dtype="bfloat16", causal=True, layout="zigzag", local_lengths=(2,),
             sample_rows=4, distributions=("normal",))
DETERMINISM = "determinism (two runs, same bits)"
STAND_IN = dict(flash_attn_stand_in=True)
# ring-attention-pytorch 0.5.20's dk and dv are wrong (docs/findings/peers.md): it fails the backward rows
KNOWN_BACKWARD = ("backward normal", "precision backward", "backward full length")
# name -> (the target's changes, the rows it must fail, by the start of their names: none for a correct ring)
RINGS = {
    "ringcheck": ({}, ()),
    "ringcheck.catalogue.mutants:textbook": ({}, ()),
    "torch_cp": ({}, ()),
    "ring_attention_pytorch": ({"layout": "striped", "dtype": "float32"}, KNOWN_BACKWARD),  # float32 only on CPU
    "ring_flash_attn:zigzag": (STAND_IN, ()),
    "ring_flash_attn:basic": ({**STAND_IN, "layout": "contiguous"}, ()),
    "yunchang:ring:zigzag": (STAND_IN, ()),
    f"{WRAPPED}:textbook_nondeterministic": ({"dtype": "float32"}, (DETERMINISM,)),
    f"{WRAPPED}:recompute_slot": ({}, (RECOMPUTE_ROW,)),
    f"{WRAPPED}:compile_path_mask": ({}, (COMPILE_ROW,)),
}
DETAIL_CHARS = 600  # of a row's words kept in wrapped.json
# the rings compiled at ring sizes of 8 and more (16 processes of dynamo: about 2 min a ring on 2 cores)
LARGE_COMPILE = ("ringcheck", "ringcheck.catalogue.mutants:textbook", f"{WRAPPED}:compile_path_mask")


def _busy(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def target(impl: str, size: int, compile_: bool) -> Target:
    changes, _ = RINGS[impl]
    return Target(**{**SMALL, "seq_len": 16 * size, "world_size": size, "impl": impl, "compile": compile_, **changes})


def as_expected(impl: str, failed: list[str], compile_: bool) -> bool:
    """Whether the rows that failed are exactly those the ring must fail (the compile row's only
    where it ran): each failing row starts with an expected name, and each expected name is met."""
    expected = [e for e in RINGS[impl][1] if e != COMPILE_ROW or compile_]
    return (all(any(f.startswith(e) for e in expected) for f in failed)
            and all(any(f.startswith(e) for f in failed) for e in expected))


def run_one(rings, impl: str, size: int, compile_: bool) -> dict:
    """One validate run: the rows that failed, the two rows' statuses and words, seconds."""
    start = time.perf_counter()
    try:
        rows = validate(target(impl, size, compile_), rings)
    except (RingError, ValueError, TypeError) as exc:  # no verdict: recorded, and the run goes on
        return {"impl": impl, "P": size, "compile": compile_, "seconds": round(time.perf_counter() - start, 2),
                "load_1": os.getloadavg()[0], "failed": [], "as_expected": False, "error": str(exc).splitlines()[0],
                **{row: {"status": "no verdict", "detail": str(exc).splitlines()[0], "figures": {}}
                   for row in ("recompute", "compile_row")}}
    took = time.perf_counter() - start
    by = {r.check: r for r in rows}
    failed = [r.check for r in rows if r.status == "fail"]
    return {"impl": impl, "P": size, "compile": compile_, "seconds": round(took, 2), "load_1": os.getloadavg()[0],
            "failed": failed, "as_expected": as_expected(impl, failed, compile_),
            "recompute": {"status": by[RECOMPUTE_ROW].status, "detail": by[RECOMPUTE_ROW].detail,
                          "figures": by[RECOMPUTE_ROW].figures},
            "compile_row": {"status": by[COMPILE_ROW].status, "detail": by[COMPILE_ROW].detail,
                            "figures": by[COMPILE_ROW].figures}}


def _cell(runs: list[dict]) -> str:
    if not runs:
        return ""
    good = sum(r["as_expected"] for r in runs)
    return f"{good}/{len(runs)}" + ("" if good == len(runs) else " (!)")


def _cut(text: str, chars: int) -> str:
    """`text` cut at the last space before `chars` characters, marked where it was."""
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " ..."


def _table(results: list[dict], row: str, words: int, seconds: bool) -> list[str]:
    """One line per ring: the rows it must fail, per ring size the runs as expected, (the seconds,)
    and the first `words` characters of `row` at the largest size."""
    sizes = sorted({r["P"] for r in results})
    lines = ["| ring | must fail | " + " | ".join(f"P={p}" for p in sizes) + (" | seconds" if seconds else "")
             + " | the row at the largest P |", "|---|---|" + "---|" * (len(sizes) + seconds) + "---|"]
    for impl, (_, expected) in RINGS.items():
        mine = [r for r in results if r["impl"] == impl]
        if mine:
            last = max(mine, key=lambda r: r["P"])
            must = [e for e in expected if e != COMPILE_ROW or mine[0]["compile"]]
            said = _cut(f"{last[row]['status']}: {last[row]['detail']}", words).replace("|", "/")
            lines.append(f"| `{impl}` | {', '.join(must) or 'nothing'} | "
                         + " | ".join(_cell([r for r in mine if r["P"] == p]) for p in sizes)
                         + (f" | {' / '.join(str(r['seconds']) for r in mine)}" if seconds else "") + f" | {said} |")
    return lines


def _run_flags(argv: list[str]) -> list[str]:
    """The flags of the run, without --report-only's (a report rewritten from its JSON)."""
    flags = list(argv)
    if "--report-only" in flags:
        at = flags.index("--report-only")
        del flags[at:at + 2]
    return flags


def report(results: list[dict], args) -> str:
    plain = [r for r in results if not r["compile"]]
    compiled = [r for r in results if r["compile"]]
    lines = ["# validate's recompute and compile rows on every CPU ring", "",
             f"Written by `python -m benchmarks.wrapped` ({' '.join(_run_flags(args.argv)) or 'its defaults'}). Each run "
             "is `ringcheck validate` "
             "of a small target (zig-zag causal bf16, 4/2 heads, d=32, one scaled-down case at 2 tokens per rank, the "
             "full length on 4 sampled rows) in the default embedding (cp=P,tp=2); peers built on flash-attn run on "
             "its CPU stand-in. A cell is the runs whose failing rows were exactly the expected ones (none for a "
             "correct ring) over the runs made; runs after the first "
             f"{args.runs - args.loaded_runs} had {args.load} busy processes beside the rings.", ""]
    if plain:
        lines += ["## Recompute, and every other row", "", *_table(plain, "recompute", 230, False), ""]
    if compiled:
        lines += ["## Compile (`--compile`, one run per ring and size)", "",
                  "At 8 ranks and more only " + ", ".join(f"`{r}`" for r in LARGE_COMPILE) + " (16 processes of dynamo "
                  "each).", "", *_table(compiled, "compile_row", 260, True), ""]
    lines += [f"Median seconds of a run without compile: {statistics.median(r['seconds'] for r in plain):.2f} (load "
              f"average {min(r['load_1'] for r in results):.1f} to {max(r['load_1'] for r in results):.1f} over the "
              "runs). Every run's failing rows, the two rows' words and figures are in wrapped.json.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wrapped", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8", help="ring sizes (default 2,4,8)")
    parser.add_argument("--runs", type=int, default=5, help="runs per ring and size (default 5)")
    parser.add_argument("--loaded-runs", type=int, default=3, help="of them, the last ones made under load (default 3)")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the rings then (default 2)")
    parser.add_argument("--compile-sizes", default="2,4,8", help="ring sizes of the compile runs (default 2,4,8; '' none)")
    parser.add_argument("--rings", default=",".join(RINGS), help="which rings (default: all)")
    parser.add_argument("--out", default="reports/wrapped", help="report folder (default reports/wrapped)")
    parser.add_argument("--report-only", metavar="JSON", help="run nothing: the report again from a wrapped.json")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.report_only:
        results = json.loads(Path(args.report_only).read_text())
        for r in results:
            r["as_expected"] = "error" not in r and as_expected(r["impl"], r["failed"], r["compile"])
        return _write(results, args)
    preload_in_workers("torch._dynamo")  # as `ringcheck validate` has its rings' fork server do
    chosen = [r for r in args.rings.split(",") if r]
    results = []
    with LocalRings(timeout=180) as rings:
        for size in (int(p) for p in args.sizes.split(",")):
            for run in range(args.runs):
                loaded = run >= args.runs - args.loaded_runs
                stop = multiprocessing.Event()
                burners = [multiprocessing.Process(target=_busy, args=(stop,)) for _ in range(args.load if loaded else 0)]
                for b in burners:
                    b.start()
                try:
                    for impl in chosen:
                        results.append({**run_one(rings, impl, size, False), "run": run, "loaded": loaded})
                        print(f"P={size} run {run}{' (loaded)' if loaded else ''} {impl}: failed "
                              f"{results[-1]['failed']} {'ok' if results[-1]['as_expected'] else 'UNEXPECTED'}",
                              flush=True)
                finally:
                    stop.set()
                    for b in burners:
                        b.join()
        for size in (int(p) for p in args.compile_sizes.split(",") if p):
            for impl in (i for i in chosen if size < 8 or i in LARGE_COMPILE):
                results.append({**run_one(rings, impl, size, True), "run": 0, "loaded": False})
                print(f"P={size} --compile {impl}: failed {results[-1]['failed']} "
                      f"{'ok' if results[-1]['as_expected'] else 'UNEXPECTED'} ({results[-1]['seconds']} s)", flush=True)
    return _write(results, args)


def _write(results: list[dict], args) -> int:
    for r in results:  # per run the row it is about, its words kept to a paragraph (the figures hold the rest)
        r.pop("recompute" if r["compile"] else "compile_row", None)
        for row in ("recompute", "compile_row"):
            if row in r:
                r[row]["detail"] = _cut(r[row]["detail"], DETAIL_CHARS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wrapped.json").write_text("[\n" + ",\n".join(json.dumps(r, default=str) for r in results) + "\n]\n")
    (out / "README.md").write_text(report(results, args))
    print(f"wrote {out / 'README.md'} and {out / 'wrapped.json'}")
    return 0 if all(r["as_expected"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
