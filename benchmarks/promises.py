"""The promise rows of validate (memory, communication, overlap) on correct rings and on the exact
mutants that break one promise each, at several ring sizes, several runs each, idle and under
load: no row flags a correct ring (or one says FLAG where the ring is off a promise by design,
with its reason), and each mutant is caught by its own row in every run, by no other.

    .venv/bin/python -m benchmarks.promises                                   # the committed report
    .venv/bin/python -m benchmarks.promises --runs 1 --ring-sizes 2 --loads 0 --out /tmp/promises
    .venv/bin/python -m benchmarks.promises --render                          # promises.md from its JSON

For every system, ring size, load and run it calls `ringcheck.commands.validate.promises.
promise_rows` (what `ringcheck validate --overlap` adds to its table) at validate's default shape
(batch 2, 4 heads over 2 K/V heads, head dim 64, zig-zag causal, local lengths 6 and 16) on local
gloo rings of at most 8 processes (the memory of a ring of 8 is compared on rings of 4 and 8). `--loads 0,2` runs each once idle and once beside 2 processes
that keep a core busy each (the machine's own load average is recorded beside: it is shared). Writes
`<out>/promises.json` (every row of every run) and `<out>/promises.md` (the tables).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ringcheck.commands.validate.promises import (
    HIDDEN_SHARE,
    MEMORY_BLOCKS,
    PROMISES,
    TRAFFIC_RATIO,
    promise_rows,
)
from ringcheck.commands.validate.target import Target
from ringcheck.harness import ImplOptions, Runner
from ringcheck.launch import LocalRings

MUTANTS = "ringcheck.catalogue.promise_mutants"
# name -> (impl, dtype, flash-attn stand-in, {promise: why it is known to be off it}, the row a mutant must FLAG)
SYSTEMS: dict[str, tuple[str, str, bool, dict[str, str], str | None]] = {
    "ringcheck": ("ringcheck", "bfloat16", False, {}, None),
    "textbook": ("ringcheck.catalogue.mutants:textbook", "bfloat16", False, {}, None),
    "torch_cp": ("torch_cp", "bfloat16", False,
                 {"memory": "all-gathers K/V (its default rotate method)",
                  "communication": "the adapter repeats K/V per query head: heads / kv_heads = 2x"}, None),
    "ring_flash_attn:zigzag": ("ring_flash_attn:zigzag", "bfloat16", True, {}, None),
    "ring_flash_attn:llama3": ("ring_flash_attn:llama3", "bfloat16", True,
                               {"memory": "Llama 3's context parallelism all-gathers K/V",
                                "overlap": "it all-gathers K/V before it computes"}, None),
    "ring_attention_pytorch": ("ring_attention_pytorch", "float32", False,
                               {"communication": "its backward moves 3(P - 1) + 1 blocks: 2.00x, FLAG at P = 2",
                                "overlap": "it waits for each transfer and a barrier before computing"}, None),
    "gather_textbook": ("ringcheck.catalogue.embedded_mutants:gather_textbook", "bfloat16", False,
                        {"memory": "an all-gather ring (the catalogue's correct one)",
                         "overlap": "it all-gathers K/V before it computes"}, None),
    "all_gather_kv": (f"{MUTANTS}:all_gather_kv", "bfloat16", False, {}, "memory"),
    "kv_twice": (f"{MUTANTS}:kv_twice", "bfloat16", False, {}, "communication"),
    "waits_each_transfer": (f"{MUTANTS}:waits_each_transfer", "bfloat16", False, {}, "overlap"),
}
LIMIT = 8  # processes: a ring of 8 measures its memory on rings of 7 and 8


def _burn(stop) -> None:
    while not stop.is_set():
        pass


def _measure(rings, name: str, p: int) -> dict[str, Any]:
    impl, dtype, stand_in, _, _ = SYSTEMS[name]
    target = Target(impl=impl, world_size=p, seq_len=16 * p, local_lengths=(6, 16), dtype=dtype, batch=2,
                    flash_attn_stand_in=stand_in)
    runner = Runner(rings, ImplOptions(impl, target.layout, stand_in=stand_in))
    t0 = time.perf_counter()
    rows = promise_rows(target, runner, PROMISES, limit=LIMIT)
    return {"seconds": round(time.perf_counter() - t0, 2),
            "rows": {r.promise: {"status": r.status, "value": r.error, "threshold": r.budget, "detail": r.detail}
                     for r in rows}}


def expected(name: str, promise: str, p: int) -> set[str]:
    """The statuses that keep the claims: a mutant's own row says FLAG and its others pass; a
    correct ring's rows pass, except where it is known to be off the promise (either is right:
    the row names the reason when it says FLAG)."""
    _, _, _, known, caught_by = SYSTEMS[name]
    if caught_by is not None:
        return {"flag"} if promise == caught_by else {"pass"}
    return {"pass", "flag"} if promise in known else {"pass"}


def run(systems, ring_sizes, runs: int, loads, out: Path) -> dict:
    found: list[dict] = []
    for load in loads:
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(load)]
        for b in burners:
            b.start()
        try:
            with LocalRings(timeout=120) as rings:
                for name in systems:
                    for p in ring_sizes:
                        for i in range(runs):
                            got = _measure(rings, name, p)
                            got.update(system=name, ring_size=p, run=i, load=load, loadavg=os.getloadavg()[0])
                            found.append(got)
                            said = " ".join(f"{k}={v['status']}({_value(v)})" for k, v in got["rows"].items())
                            print(f"load {load} {name} P={p} run {i}: {said} [{got['seconds']} s]", flush=True)
        finally:
            stop.set()
            for b in burners:
                b.join()
    doc = {"command": "python -m benchmarks.promises " + " ".join(
               [f"--runs {runs}", f"--ring-sizes {','.join(map(str, ring_sizes))}",
                f"--loads {','.join(map(str, loads))}"]),
           "thresholds": {"memory_blocks_per_rank": MEMORY_BLOCKS, "traffic_ratio": TRAFFIC_RATIO,
                          "hidden_share": HIDDEN_SHARE},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "systems": {n: {"impl": SYSTEMS[n][0], "dtype": SYSTEMS[n][1], "by_design": SYSTEMS[n][3],
                           "mutant_of": SYSTEMS[n][4]} for n in systems},
           "runs": found}
    out.mkdir(parents=True, exist_ok=True)
    (out / "promises.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "promises.md").write_text(markdown(doc))
    return doc


def _value(row: dict) -> str:
    return "-" if row["value"] is None else f"{row['value']:.2f}"


def _cell(runs: list[dict], promise: str) -> str:
    rows = [r["rows"][promise] for r in runs if promise in r["rows"]]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    values = [row["value"] for row in rows if row["value"] is not None]
    spread = "" if not values else (f" {min(values):.2f}" if min(values) == max(values) else
                                    f" {min(values):.2f}-{max(values):.2f}")
    return ", ".join(f"{s} {n}/{len(rows)}" for s, n in sorted(counts.items())) + spread


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    th = doc["thresholds"]
    lines = ["# The promise rows: correct rings and exact mutants", "",
             f"`{doc['command']}` on {doc['machine']['platform']}, {doc['machine']['cpus']} CPUs, torch "
             f"{doc['machine']['torch']}.", "",
             "Each cell: the row's status over the runs, then its figure (min-max): memory, the peak's growth in "
             f"K/V blocks per rank added to the ring (FLAG at {th['memory_blocks_per_rank']}); communication, the "
             f"busiest pass's bytes over the ring's minimum (FLAG at {th['traffic_ratio']}); overlap, the share "
             f"of the injected time NOT hidden at 0.5x a step's compute (FLAG above {1 - th['hidden_share']:.2f}, "
             f"i.e. hidden below {th['hidden_share']}).", ""]
    unexpected = [r for r in runs if any(row["status"] not in expected(r["system"], p, r["ring_size"])
                                         for p, row in r["rows"].items())]
    lines += [f"**{len(runs)} runs; {len(unexpected)} with a row off the claims**: every row of a correct ring "
              f"passes (a row where the ring is known to be off the promise may say FLAG, with the reason), and a "
              f"mutant's own row says FLAG while its other rows pass.", ""]
    for r in unexpected:
        lines.append(f"- unexpected: {r['system']} P={r['ring_size']} load {r['load']} run {r['run']}: " + "; ".join(
            f"{p} {row['status']}" for p, row in r["rows"].items()))
    for load in sorted({r["load"] for r in runs}):
        mine = [r for r in runs if r["load"] == load]
        avg = sum(r["loadavg"] for r in mine) / len(mine)
        said = "no load of ours" if load == 0 else f"{load} processes of ours keeping a core busy each"
        lines += ["", f"## {said} (the machine's 1-minute load average: {avg:.1f} on {doc['machine']['cpus']} CPUs)", "",
                  "| system | P | " + " | ".join(PROMISES) + " | known, or the mutant's row |", "|---|---|" + "---|" * len(PROMISES) +
                  "---|"]
        for name in doc["systems"]:
            for p in sorted({r["ring_size"] for r in mine}):
                cell = [r for r in mine if r["system"] == name and r["ring_size"] == p]
                if cell:
                    why = "; ".join(f"{k}: {v}" for k, v in doc["systems"][name]["by_design"].items())
                    mutant = doc["systems"][name]["mutant_of"]
                    lines.append(f"| {name} | {p} | " + " | ".join(_cell(cell, q) for q in PROMISES) + " | "
                                 + (f"mutant: {mutant}" if mutant else why) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ring-sizes", default="2,4,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--loads", default="0,2", help="busy processes beside each pass, comma-separated")
    ap.add_argument("--out", default="reports/promises")
    ap.add_argument("--render", action="store_true", help="only write <out>/promises.md again from its promises.json")
    args = ap.parse_args()
    if args.render:
        out = Path(args.out)
        (out / "promises.md").write_text(markdown(json.loads((out / "promises.json").read_text())))
        return
    run(args.systems.split(","), [int(x) for x in args.ring_sizes.split(",")], args.runs,
        [int(x) for x in args.loads.split(",")], Path(args.out))


if __name__ == "__main__":
    main()
