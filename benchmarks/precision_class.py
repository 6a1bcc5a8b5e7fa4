"""The precision-class sweep: correct rings never fail it, narrowing defects fail it by >= 3x,
on every CPU kernel PyTorch offers this machine.

    .venv/bin/python -m benchmarks.precision_class                       # the committed report
    .venv/bin/python -m benchmarks.precision_class --ring-sizes 2,4 --seeds 1 --out /tmp/pc
    .venv/bin/python -m benchmarks.precision_class --capabilities all    # each ATEN_CPU_CAPABILITY

`--capabilities default,avx2,...` (or `all`: every one this CPU has) runs the sweep once per
value of ATEN_CPU_CAPABILITY (PyTorch reads it when it loads, so each run is a process of its
own, writing `<out>/<capability>/`) and writes `<out>/README.md`, the verdicts side by side.

For every ring size, seed, input dtype, layout and registered distribution it runs our ring
(`ringcheck`), the plain textbook ring (`ringcheck.catalogue.variant_textbook:textbook_varlen`)
PyTorch's own ring (`torch_cp`, contiguous and zigzag layouts only) and ring-flash-attn's
zigzag and stripe rings through the CPU flash-attn stand-in, on local gloo rings, and judges each tensor with `ringcheck.judge.precision.judge_precision`. The narrowing
mutants (`ringcheck.catalogue.precision_mutants`) are the textbook ring with one delivered tensor
rounded through a narrower dtype; their tensors are exactly the textbook ring's, so they are
judged by rounding the textbook ring's tensors here (suites/test_precision_class.py checks
that a public mutant's tensors equal these bit for bit) and, like validate's precision rows,
by the worst ratio over the distributions of a (ring size, seed, dtype, layout). The real peer
finding, ring-flash-attn's basic ring returning dq through bfloat16 (docs/findings/peers.md),
must fail its float16 dq in every row.

Writes `<out>/precision_class.json` and `<out>/README.md` (a table per claim, the command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ringcheck.catalogue.precision_mutants import NARROWER, ring_results_task, whole_results
from ringcheck.judge.check import Case, Results, truth
from ringcheck.judge.distributions import DISTRIBUTIONS
from ringcheck.judge.inputs import make_inputs
from ringcheck.judge.precision import CLASS_K, judge_precision
from ringcheck.launch import LocalRings
from ringcheck.spec import DTYPES, AttentionSpec, RingSpec

# (name, causal, layout)
LAYOUTS = [("bidirectional", False, "contiguous"), ("causal", True, "contiguous"), ("zigzag", True, "zigzag"),
           ("striped", True, "striped")]
IMPLS = {"ringcheck": None, "ringcheck.catalogue.variant_textbook:textbook_varlen": None,
         "torch_cp": ("contiguous", "zigzag"), "ring_flash_attn:zigzag": ("zigzag",),
         "ring_flash_attn:stripe": ("striped",)}
STAND_IN = ("ring_flash_attn:zigzag", "ring_flash_attn:stripe", "ring_flash_attn:basic")
# a real finding (dq rounded through bfloat16; float16 inputs): its dq must fail every row
FINDING = ("ring_flash_attn:basic", ("contiguous",))
CAPABILITIES = ("default", "avx2", "avx512")
TEXTBOOK = "ringcheck.catalogue.variant_textbook:textbook_varlen"
TENSORS = ("out", "lse", "dq", "dk", "dv")


def _cases(world: int, seed: int, causal: bool, layout: str, local: int, heads: int, kv_heads: int,
           head_dim: int) -> list[Case]:
    return [Case(AttentionSpec(batch=1, heads=heads, kv_heads=kv_heads, seq_len=local * world, head_dim=head_dim,
                               dtype=dtype, causal=causal), RingSpec(world, layout), seed=seed, distribution=dist)
            for dtype, dist in itertools.product(DTYPES, DISTRIBUTIONS)]


def _narrowed(got: Results, tensor: str, narrow: torch.dtype) -> Results:
    values = {name: getattr(got, name) for name in ("out", "lse", "dq", "dk", "dv", "dsinks")}
    values[tensor] = values[tensor].to(narrow).to(values[tensor].dtype)
    return Results(**values)


def sweep(args, done=None) -> dict:
    """The sweep; `done(doc, seeds)` is called after each seed with the results so far."""
    correct: dict[str, dict] = {}  # impl -> {dtype/tensor: worst}
    mutants: dict[str, dict] = {}  # "dtype/narrow/tensor" -> {"min_row_ratio", "where"}
    finding: dict[str, Any] = {"impl": FINDING[0], "min_row_ratio": float("inf")}
    finished: list[int] = []
    with LocalRings(timeout=300) as rings:
        for seed, world, (mode, causal, layout) in itertools.product(args.seeds, args.ring_sizes, LAYOUTS):
            cases = _cases(world, seed, causal, layout, args.local, args.heads, args.kv_heads, args.head_dim)
            inputs = [make_inputs(c.spec, seed=c.seed, distribution=c.distribution, ring=c.ring) for c in cases]
            truths = [truth(c.spec, x) for c, x in zip(cases, inputs)]
            row_max: dict[tuple, float] = {}
            if layout in FINDING[1]:
                fp16 = [c for c in cases if c.spec.dtype == "float16"]
                parts = rings.run(world, ring_results_task, FINDING[0], layout, fp16, True)
                row = max(judge_precision(c, whole_results([p[i] for p in parts], c), truth(c.spec, x), x,
                                          tensors=("dq",))["dq"].ratio
                          for i, (c, x) in enumerate(zip(fp16, (make_inputs(c.spec, seed=c.seed,
                                                                            distribution=c.distribution, ring=c.ring)
                                                                for c in fp16))))
                if row < finding["min_row_ratio"]:
                    finding.update(min_row_ratio=row, where=f"P={world} {mode} seed={seed}")
            for impl, layouts in IMPLS.items():
                if layouts is not None and layout not in layouts:
                    continue
                started = time.time()
                # flash-attn (and its stand-in) runs float16 and bfloat16 only
                picked = [i for i, c in enumerate(cases) if impl not in STAND_IN or c.spec.dtype != "float32"]
                parts = rings.run(world, ring_results_task, impl, layout, [cases[i] for i in picked],
                                  impl in STAND_IN)
                for j, i in enumerate(picked):
                    case, x, true = cases[i], inputs[i], truths[i]
                    got = whole_results([p[j] for p in parts], case)
                    for t in judge_precision(case, got, true, x).tensors:
                        key = f"{case.spec.dtype}/{t.tensor}"
                        best = correct.setdefault(impl, {}).get(key)
                        if best is None or t.ratio > best["ratio"]:
                            correct[impl][key] = {"ratio": t.ratio, "units": t.units, "class_units": t.class_units,
                                                  "where": f"P={world} {mode} seed={seed} {case.distribution}"}
                    if impl != TEXTBOOK:
                        continue
                    for narrow_name in NARROWER[case.spec.dtype]:
                        for tensor in TENSORS:
                            bad = _narrowed(got, tensor, DTYPES[narrow_name])
                            ratio = judge_precision(case, bad, true, x, tensors=(tensor,))[tensor].ratio
                            key = (case.spec.dtype, narrow_name, tensor)
                            row_max[key] = max(row_max.get(key, 0.0), ratio)
                print(f"P={world} seed={seed} {mode:13s} {impl}: {time.time() - started:.1f} s", file=sys.stderr)
            for (dtype, narrow_name, tensor), ratio in row_max.items():
                m = mutants.setdefault(f"{dtype}/{narrow_name}/{tensor}", {"min_row_ratio": float("inf")})
                if ratio < m["min_row_ratio"]:
                    m.update(min_row_ratio=ratio, where=f"P={world} {mode} seed={seed}")
            if done is not None and world == args.ring_sizes[-1] and layout == LAYOUTS[-1][2]:
                finished.append(seed)
                done({"correct": correct, "mutants": mutants, "finding": finding}, finished)
    return {"correct": correct, "mutants": mutants, "finding": finding}


def markdown(doc: dict) -> str:
    lines = ["# Precision class: correct rings against narrowing defects", "",
             f"Command: `{doc['command']}`", "",
             f"{doc['host']}; {doc['elapsed_s']:.0f} s. Ring sizes {doc['ring_sizes']}, seeds {doc['seeds']}, "
             f"{doc['local']} tokens per rank, heads {doc['heads']}/{doc['kv_heads']}, head_dim {doc['head_dim']}; "
             f"every registered distribution, dtypes {list(DTYPES)}, layouts {[m for m, _, _ in LAYOUTS]} "
             "(torch_cp: contiguous and zigzag). k = " + ", ".join(f"{d}: {k:g}" for d, k in doc["k"].items()) + ".",
             "", "## Correct rings: the worst error / budget (must stay <= 1)", "",
             "| implementation | dtype/tensor | worst ratio | error (u) | class (u) | where |", "|---|---|---:|---:|---:|---|"]
    for impl, per in doc["correct"].items():
        for key, w in sorted(per.items()):
            lines.append(f"| {impl.split(':')[-1]} | {key} | {w['ratio']:.3f} | {w['units']:.2f} | "
                         f"{w['class_units']:.2f} | {w['where']} |")
    lines += ["", "## Narrowing mutants: the smallest row ratio over ring sizes, seeds and layouts", "",
              "Each must fail (ratio > 1); the target is >= 3 (see `CLASS_K` in `ringcheck/judge/precision.py`).",
              "",
              ("A row ratio is the worst error / budget over the distributions of one (ring size, seed, layout), "
               "as validate's precision rows report it."), "",
              "| input/narrow/tensor | min row ratio | where |", "|---|---:|---|"]
    for key, m in sorted(doc["mutants"].items()):
        lines.append(f"| {key} | {m['min_row_ratio']:.2f} | {m['where']} |")
    f = doc.get("finding")
    if f and f.get("where"):
        lines += ["", f"## The real finding: {f['impl']} (float16 dq through bfloat16)", "",
                  f"Its float16 dq row ratio at least {f['min_row_ratio']:.2f} ({f['where']}): must fail (> 1)."]
    return "\n".join(lines) + "\n"


def summary(out: Path, capabilities: list[str], command: str) -> str:
    """The per-capability runs side by side: the worst correct ratio per implementation, the
    least mutant row ratio, the finding's least row ratio."""
    docs = {c: json.loads((out / c / "precision_class.json").read_text()) for c in capabilities}
    impls = sorted({impl for d in docs.values() for impl in d["correct"]})
    lines = ["# Precision class on every CPU kernel of this machine", "", f"Command: `{command}`", "",
             "Each column is one value of `ATEN_CPU_CAPABILITY` (the CPU kernels PyTorch dispatches to), one "
             "process each; the per-capability tables are in the folders beside this file. A verdict that "
             "depends on the machine shows here as a column that differs.", "",
             "| | " + " | ".join(f"{c} ({docs[c]['capability']})" for c in capabilities) + " |",
             "|---|" + "---:|" * len(capabilities)]
    for impl in impls:
        cells = []
        for c in capabilities:
            per = docs[c]["correct"].get(impl, {})
            cells.append(f"{max(w['ratio'] for w in per.values()):.3f}" if per else "-")
        lines.append(f"| correct: {impl.split(':', 1)[-1] if 'textbook' in impl else impl}, worst error/budget "
                     f"(<= 1) | " + " | ".join(cells) + " |")
    lines.append("| narrowing mutants, least row ratio (>= 3) | " + " | ".join(
        f"{min(m['min_row_ratio'] for m in docs[c]['mutants'].values()):.2f}" for c in capabilities) + " |")
    lines.append("| ring_flash_attn:basic float16 dq, least row ratio (> 1) | " + " | ".join(
        f"{docs[c]['finding']['min_row_ratio']:.2f}" for c in capabilities) + " |")
    first = docs[capabilities[0]]
    lines += ["", f"{first['host']}; ring sizes {first['ring_sizes']}, seeds {first['seeds']}, "
              f"{first['local']} tokens per rank, heads {first['heads']}/{first['kv_heads']}, head_dim "
              f"{first['head_dim']}, every registered distribution and dtype."]
    return "\n".join(lines) + "\n"


def available_capabilities() -> list[str]:
    """The values of ATEN_CPU_CAPABILITY this CPU can run, up to the best PyTorch picks here."""
    best = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env={k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"},
                          capture_output=True, text=True, check=True).stdout.strip().lower()
    known = list(CAPABILITIES)
    return known[:known.index(best) + 1] if best in known else ["default", best]


def run_capabilities(args, argv: list[str]) -> int:
    capabilities = available_capabilities() if args.capabilities == "all" else args.capabilities.split(",")
    rest, skip = [], False
    for a in argv:  # the same sweep, without --capabilities and --out
        if skip:
            skip = False
        elif a in ("--capabilities", "--out"):
            skip = True
        elif not a.startswith(("--capabilities=", "--out=")):
            rest.append(a)
    out, status = Path(args.out), 0
    for c in capabilities:
        print(f"ATEN_CPU_CAPABILITY={c}", file=sys.stderr)
        status |= subprocess.run([sys.executable, "-m", "benchmarks.precision_class", *rest, "--out", str(out / c)],
                                 env={**os.environ, "ATEN_CPU_CAPABILITY": c}).returncode
    (out / "README.md").write_text(summary(out, capabilities, "python -m benchmarks.precision_class "
                                           + " ".join(argv)))
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ring-sizes", default="2,3,4,5,6,7,8")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--local", type=int, default=8, help="tokens per rank (even: zigzag)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default="reports/precision_class")
    parser.add_argument("--capabilities", default=None,
                        help="run once per ATEN_CPU_CAPABILITY (comma-separated, or 'all') and compare")
    args = parser.parse_args(argv)
    if args.capabilities:
        return run_capabilities(args, list(sys.argv[1:] if argv is None else argv))
    args.ring_sizes = [int(x) for x in args.ring_sizes.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    torch.set_num_threads(1)
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(doc, seeds):
        doc.update(command="python -m benchmarks.precision_class " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]),
                   host=f"{platform.machine()} {platform.python_version()} torch {torch.__version__}",
                   elapsed_s=time.time() - started, ring_sizes=args.ring_sizes, seeds=list(seeds), local=args.local,
                   heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                   k={str(d).removeprefix("torch."): k for d, k in CLASS_K.items()})
        (out / "precision_class.json").write_text(json.dumps(doc, indent=1, allow_nan=False, default=str))
        (out / "README.md").write_text(markdown(doc))

    doc = sweep(args, write)
    worst = max(w["ratio"] for per in doc["correct"].values() for w in per.values())
    least = min(m["min_row_ratio"] for m in doc["mutants"].values())
    found = doc["finding"]["min_row_ratio"]
    print(f"{torch.backends.cpu.get_cpu_capability()}: worst correct ratio {worst:.3f} (<= 1), least mutant row "
          f"ratio {least:.2f} (target >= 3), {FINDING[0]} float16 dq least row ratio {found:.2f} (> 1)")
    return 0 if worst <= 1 and least >= 3 and found > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
