"""The trainers' zoo: `ringcheck step --model` on every transformers architecture that builds tiny,
through one trainer's shipped glue (each core, each ring size); writes reports/models/NAME.md and
NAME.json, row by row (a run cut short keeps what it judged; --resume goes on from there).

    .venv/bin/python -m benchmarks.trainer_zoo --glue deepspeed_ulysses,deepspeed_ulysses:flash_attention_2 \\
        --sizes 2,4 --name trainers_deepspeed --speed        # reports/models/trainers_deepspeed.md

Per architecture and column: pass, fail (with the lost semantic the diagnosis names), or not run
and why (the model refused, the glue refused, every case raised), as `benchmarks.models_zoo_run`
records it (`run_one`, in one process on local gloo rings, as the command runs each case). The
speed (--speed): the command itself at P=4 over every case for a dense model, wall seconds with
start-up, median of --repeats; and the zoo's own wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.models_zoo_run import OUT, PROOF, ROOT, features_of, markdown, run_one

DENSE = "llama"


def zoo(models, glues, sizes, path, rows: list[dict], base: float = 0.0, timeout: float = 120.0) -> list[dict]:
    """Every (model, glue, size) not yet in `rows`, model by model, appended and written to `path`
    after each (a run cut short keeps whole rows)."""
    from ringcheck.launch import open_ring

    done = {(r["model"], r["glue"], r["P"]) for r in rows}
    t0 = time.perf_counter()
    ring = open_ring(timeout=timeout)
    try:
        for model in models:
            truths: dict = {}  # the model's truths, each computed once for the glues that share it
            for glue in glues:
                for size in sizes:
                    if (model, glue, size) in done:
                        continue
                    row = run_one(ring, model, glue, None, size, truths)
                    print(f"{model:16s} {glue:36s} P={size} {row['verdict']:9s} {row['seconds']:6.1f}s "
                          f"{row['why'][:150]}", flush=True)
                    rows.append(row)
                    path.write_text(json.dumps({"zoo": rows, "zoo_seconds": base + time.perf_counter() - t0},
                                               indent=1, default=str) + "\n")
    finally:
        ring.close()
    return rows


def speed(glues, repeats: int, size: int = 4) -> list[dict]:
    """One check of `DENSE` at P=`size` over every case, per glue: the command, median of `repeats`."""
    out = []
    for glue in glues:
        times, code = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "ringcheck", "step", "--model", DENSE, "--glue", glue,
                                   "--world-size", str(size), "-q"], cwd=ROOT, capture_output=True, text=True)
            times.append(round(time.perf_counter() - t0, 1))
            code = done.returncode
            print(f"speed {glue} {DENSE} P={size}: {times[-1]} s, exit {code}", flush=True)
        out.append({"glue": glue, "model": DENSE, "P": size, "seconds": times, "median": statistics.median(times),
                    "exit": code})
    return out


def environment() -> str:
    """The versions this report's runs were made with, and the environment (a trainer's own, of
    `benchmarks.trainer_envs`, or the checkout's)."""
    import torch
    import transformers

    where = Path(sys.prefix).resolve()
    name = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(where)
    return (f"Run with transformers {transformers.__version__} and torch {torch.__version__}, in the environment "
            f"{name}.")


def report(rows, speed_rows, zoo_seconds, command: str, glues, models=(), note: str = "") -> str:
    text = markdown(rows, [], [], command).replace("# ringcheck step --model: the zoo",
                                                   f"# The trainers' zoo: {', '.join(glues)}" + (f"\n\n{note}" if note else ""), 1)
    missing = [m for m in models if m not in {r["model"] for r in rows}]
    if missing:
        text += (f"Not reached by the runs above (go on with `--resume`): {len(missing)} architectures, "
                 f"{', '.join(missing)}.\n\n")
    judged = [r for r in rows if r["verdict"] in ("pass", "fail")]
    tail = ["## Counts and cost", "", f"- {environment()}",
            f"- {len(rows)} runs: {sum(r['verdict'] == 'pass' for r in rows)} pass, "
            f"{sum(r['verdict'] == 'fail' for r in rows)} fail, {len(rows) - len(judged)} not run or no verdict.",
            f"- The zoo's wall time: {zoo_seconds / 60:.1f} min (the last run; the sum of all its rows: "
            f"{sum(r['seconds'] for r in rows) / 60:.1f} min), on 2 CPU cores (the note at the top says what else ran)."]
    for r in speed_rows:
        tail.append(f"- One check of {r['model']} at P={r['P']} over every case through --glue {r['glue']} "
                    f"(the command, start-up included): {', '.join(map(str, r['seconds']))} s, median "
                    f"{r['median']} s (exit {r['exit']}).")
    return text + "\n".join(tail) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--glue", required=True, help="comma-separated glues (a trainer's, each core)")
    p.add_argument("--models", default="all", help="comma-separated model_types, or 'all' (zoo_names)")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--name", required=True, help="the report's file name under reports/models/ (NAME.md, NAME.json)")
    p.add_argument("--resume", action="store_true", help="keep the rows NAME.json holds and run the others")
    p.add_argument("--report-only", action="store_true", help="run no model: NAME.md from the rows NAME.json holds "
                                                              "(and the speed, with --speed)")
    p.add_argument("--speed", action="store_true", help="time one check of a dense model at P=4, every case")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--speed-glue", default=None, help="the glues --speed times (default: every --glue)")
    p.add_argument("--timeout", type=float, default=120.0, help="the rings' timeout, seconds (a glue that hangs "
                                                                 "waits it out, once per hanging case)")
    p.add_argument("--note", default="", help="a line under the report's title (e.g. the environment it ran in)")
    args = p.parse_args(argv)
    from ringcheck.models.tiny import zoo_names

    glues = args.glue.split(",")
    # all: issue 42's ten proof models first (a run cut short has judged those), then every other
    models = tuple(dict.fromkeys((*PROOF, *zoo_names()))) if args.models == "all" else tuple(args.models.split(","))
    sizes = tuple(int(s) for s in args.sizes.split(","))
    path = OUT / f"{args.name}.json"
    old = json.loads(path.read_text()) if args.resume and path.exists() else {}
    t0 = time.perf_counter()
    old = json.loads(path.read_text()) if args.report_only else old
    rows = list(old.get("zoo", [])) if args.report_only else zoo(models, glues, sizes, path, list(old.get("zoo", [])),
                                                                   old.get("zoo_seconds", 0.0), args.timeout)
    seconds = (0.0 if args.report_only else time.perf_counter() - t0) + old.get("zoo_seconds", 0.0)
    feats = {r["model"]: r["features"] for r in rows if "features" in r}  # a run's rows keep theirs
    for r in rows:
        if r["model"] not in feats:
            feats[r["model"]] = features_of(r["model"])
        r["features"] = feats[r["model"]]
    timed = (args.speed_glue or args.glue).split(",")
    speed_rows = speed(timed, args.repeats) if args.speed else old.get("speed", [])
    given = list(argv if argv is not None else sys.argv[1:])
    given = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
    command = "python -m benchmarks.trainer_zoo " + " ".join(a for a in given
                                                           if a not in ("--resume", "--report-only", "--speed"))
    path.write_text(json.dumps({"command": command, "zoo": rows, "zoo_seconds": seconds, "speed": speed_rows},
                               indent=1, default=str) + "\n")
    (OUT / f"{args.name}.md").write_text(report(rows, speed_rows, seconds, command, glues, models, args.note))
    print(f"wrote {OUT / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
