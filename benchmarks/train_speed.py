"""How long the default `ringcheck train` takes, as a user sees it: the whole command (start-up,
the local ring's processes, the ring's run, the single-device runs, the report), timed from
outside, several times; the median is the figure (the issue's budget: 60 s on 2 cores at P=4).

    python benchmarks/train_speed.py [--runs 5] [-- EXTRA FLAGS...]

Prints the load average before and after (other work on the machine slows the ranks: quote
the figure with it), each run's wall time and exit code, and the median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_runs(command: list[str], runs: int, label: str = "") -> list[float]:
    """Each run's wall time of `command` from the repository root, printed with its exit code."""
    times = []
    for i in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
        print(f"{label}run {i + 1}: {times[-1]:.1f} s, exit {done.returncode}", flush=True)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("extra", nargs="*", help="flags added to `ringcheck train -q`")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "ringcheck", "train", "-q", *args.extra]
    print("command:", " ".join(command[1:]), f"| cores: {os.cpu_count()}", f"| load before: {os.getloadavg()}")
    times = time_runs(command, args.runs)
    print(f"median {statistics.median(times):.1f} s (min {min(times):.1f}, max {max(times):.1f}) over {len(times)} "
          f"runs | load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
