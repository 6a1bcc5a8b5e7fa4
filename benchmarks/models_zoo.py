"""The zoo of issue 42: every causal-LM architecture transformers registers, tried tiny.

    python -m benchmarks.models_zoo --models-only [--names llama,gpt_oss] [--out reports/models/zoo_models.md]

`--models-only` (the model part): for each architecture, whether `tiny_model` builds it and a
forward at 64 tokens runs on the CPU, the attention features it uses, whether `TinyModel.layers`
agrees with what transformers hands a probe registered through `AttentionInterface`, or why it
is refused or fails, and the seconds each took. The glue runs at P=4 (the run part) are added
beside it. Not a test: the whole zoo takes minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-only", action="store_true", help="the tiny models alone, no glue runs")
    parser.add_argument("--names", default="", help="comma-separated model_types (default: the whole zoo)")
    parser.add_argument("--out", default="", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    if not args.models_only:
        print("only --models-only is built here: the glue runs are the model-step part of issue 42", file=sys.stderr)
        return 2
    from ringcheck.models.zoo import survey, survey_markdown  # start-up time: transformers loads in ~3 s

    warnings.filterwarnings("ignore")  # transformers' advice on every build (a tool's own output, not a test)
    logging.disable(logging.WARNING)
    names = tuple(n for n in args.names.split(",") if n) or None
    start = time.perf_counter()
    rows = survey(names)
    table = survey_markdown(rows)
    took = time.perf_counter() - start
    footer = (f"\n{took:.0f} s in all on {os.cpu_count()} cores (load {os.getloadavg()[0]:.1f}); "
              f"`python -m benchmarks.models_zoo --models-only` regenerates it.\n")
    print(table + footer)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# The zoo: which architectures build tiny\n\n" + table + footer)
    return 0 if any(r["builds"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
