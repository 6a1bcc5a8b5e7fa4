"""What each part of the embedded ring costs `ringcheck validate` at its default target: a benchmark
(it prints a table; it never fails on time).

Four runs of the same default target, each adding one part of the embedding to the one before:

- ``clean room``: the scaled-down cases at batch 1 on one ring that is the whole world, contiguous
  inputs only (what validate did before the embedding);
- ``+ batch 2``: the scaled-down cases at batch 2;
- ``+ mesh``: on two interleaved rings at once (cp=P,tp=2), each group judged;
- ``+ views, two calls`` (validate's default): each case also as two calls before one backward on
  views of fused projections.

Each run starts its own local rings (their start-up counts) and is timed as a whole, after one
untimed warm-up run of the default; the table gives each configuration's median wall seconds over
`--repeats` and its ratio to the clean room. The whole command against the one before the
embedding is measured from outside with farm-bench (see docs/explanation/embedding.md).

    python -m benchmarks.validate_cost [--repeats 3] [--json reports/bench/validate-cost.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from ringcheck.commands import validate as validate_module
from ringcheck.commands.validate import Target, steps, validate
from ringcheck.harness import Mesh
from ringcheck.launch import LocalRings

CONFIGS = ("clean room", "+ batch 2", "+ mesh", "+ views, two calls")  # each adds one part


def _contiguous_only(*args, **kwargs) -> steps.Run:
    run = steps.Run(*args, **kwargs)
    run.calls = (steps.CONTIGUOUS,)
    return run


def run_once(config: str) -> float:
    """One validate run of the default target under `config`, its wall seconds."""
    index = CONFIGS.index(config)
    saved = (validate_module.placement, validate_module.Run, Target.scaled_batch)
    try:
        if index < 1:  # batch 1: the target's own batch
            Target.scaled_batch = property(lambda self: self.batch)
        if index < 2:  # one ring, the whole world
            validate_module.placement = lambda target, world, world_only=None: validate_module.Placement(
                Mesh.ring(target.world_size), Mesh.ring(target.world_size))
        if index < 3:  # contiguous shards only
            validate_module.Run = _contiguous_only
        start = time.perf_counter()
        with LocalRings() as rings:
            rows = validate(Target(), rings)
        took = time.perf_counter() - start
    finally:
        validate_module.placement, validate_module.Run, Target.scaled_batch = saved
    if not all(r.passed for r in rows):
        raise RuntimeError(f"validate failed under {config!r}: {[r.check for r in rows if not r.passed]}")
    return took


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.validate_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the measurements to this file")
    args = parser.parse_args(argv)
    run_once(CONFIGS[-1])  # warm-up: imports, the kernels' first calls
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:  # interleaved, so a drift in the machine's speed touches every config alike
            times[config].append(run_once(config))
    base = statistics.median(times[CONFIGS[0]])
    print(f"{'configuration':<22} {'median s':>9} {'min s':>7} {'max s':>7} {'x clean room':>13}")
    for config in CONFIGS:
        t = times[config]
        print(f"{config:<22} {statistics.median(t):>9.2f} {min(t):>7.2f} {max(t):>7.2f} "
              f"{statistics.median(t) / base:>13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": args.repeats, "target": dataclasses.asdict(Target()),
                                               "seconds": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
