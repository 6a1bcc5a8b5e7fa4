"""How long `ringcheck step` takes, as a user sees it: the whole command (start-up, the local
rings, the CP=P run and the reference, every case, the report), timed from outside, several
times; the median is the figure (the issue's budgets on 2 cores at P=4: plain 15 s, hf_llama 30 s).

    python -m benchmarks.step_speed [--runs 3] [--recipes plain,hf_llama] [-- EXTRA FLAGS...]

Prints the load average before and after (other work on the machine slows the ranks: quote the
figure with it), each run's wall time and exit code, and the median per recipe. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from benchmarks.train_speed import time_runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--recipes", default="plain,hf_llama")
    parser.add_argument("extra", nargs="*", help="flags added to `ringcheck step -q --world-size 4`")
    args = parser.parse_args(argv)
    print(f"cores: {os.cpu_count()} | load before: {os.getloadavg()}")
    for recipe in args.recipes.split(","):
        command = [sys.executable, "-m", "ringcheck", "step", "-q", "--world-size", "4", "--recipe", recipe,
                   *args.extra]
        times = time_runs(command, args.runs, f"{recipe} ")
        print(f"{recipe}: median {statistics.median(times):.1f} s (min {min(times):.1f}, max {max(times):.1f}) over "
              f"{len(times)} runs of {' '.join(command[1:])}")
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
