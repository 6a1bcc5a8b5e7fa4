"""Every built-in adapter through validate's `--quick` checks, in float32, bfloat16 and float16 at
P=2 and P=4 (causal, --seq-len 256, 4 heads / 2 K/V heads, head dim 64): the same targets and
`validate` as `ringcheck validate`, run on local gloo rings kept alive between
targets (a CLI run starts its own ring each time: the same checks, minutes slower). One JSON
report per target (`<adapter>_<dtype>_P<n>.json`, its "command" re-runs it with the CLI) and
`summary.json` (adapter, dtype, P, verdict, failing rows, or why it did not run).

    python benchmarks/peers/run.py [ADAPTER ...]        (from the repository root; default: all)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ringcheck.adapters import load_impl
from ringcheck.cli.validate import QUICK_LENGTHS, rerun_command, short_failures
from ringcheck.commands.validate import Target, check_variant_keywords, placement, report_dict, validate
from ringcheck.documents import meta, save
from ringcheck.flash_stand_in import install
from ringcheck.launch import LocalRings, RingError

REPORTS = Path(__file__).resolve().parents[2] / "reports" / "peers"  # where the reports go
ADAPTERS = ("ringcheck", "ring_attention_pytorch", "torch_cp", "ring_flash_attn:zigzag", "ring_flash_attn:basic",
            "ring_flash_attn:stripe", "ring_flash_attn:llama3", "yunchang:ulysses", "yunchang:usp",
            "yunchang:ring:basic", "yunchang:ring:zigzag", "yunchang:ring:stripe")
TIMEOUT = 120.0


def layout_of(impl: str) -> str:
    if impl in ("ringcheck", "torch_cp") or impl.endswith("zigzag"):
        return "zigzag"
    return "striped" if impl.endswith("stripe") else "contiguous"


def one(rings, impl: str, dtype: str, p: int) -> dict:
    stand_in = impl.startswith(("ring_flash_attn", "yunchang"))
    target = Target(impl=impl, layout=layout_of(impl), world_size=p, seq_len=256, dtype=dtype,
                    local_lengths=QUICK_LENGTHS, flash_attn_stand_in=stand_in)
    command = rerun_command(target, TIMEOUT)
    row = {"impl": impl, "dtype": dtype, "P": p, "command": command}
    start = time.perf_counter()
    try:  # what the CLI checks before any rank starts (exit 2)
        if stand_in:
            install()
        loaded = load_impl(impl, layout=target.layout)
        loaded.check_layout(target.layout, target.causal)
        check_variant_keywords(loaded, target)
    except (ValueError, TypeError, RuntimeError) as exc:
        return {**row, "verdict": "not run", "why": str(exc)}
    try:
        checks = validate(target, rings)
    except RingError as exc:
        return {**row, "verdict": "error", "why": short_failures(exc)}
    report = report_dict(target, checks, meta=meta(command, elapsed_s=time.perf_counter() - start),
                         where=placement(target, None, loaded.world_only))
    report["command"] = command
    save(report, REPORTS / f"{impl.replace(':', '_')}_{dtype}_P{p}.json")
    failing = [f"{c.check}: {c.detail}" for c in checks if not c.passed]
    return {**row, "verdict": "pass" if report["passed"] else "fail", "failing": failing}


def main(adapters) -> None:
    summary_path = REPORTS / "summary.json"
    done = {}
    if summary_path.exists():
        done = {(r["impl"], r["dtype"], r["P"]): r for r in json.loads(summary_path.read_text())}
    with LocalRings(timeout=TIMEOUT) as rings:
        for impl in adapters:
            for dtype in ("float32", "bfloat16", "float16"):
                for p in (2, 4):
                    row = one(rings, impl, dtype, p)
                    done[(impl, dtype, p)] = row
                    print(f"{impl:24} {dtype:9} P={p} {row['verdict']}", flush=True)
                    rows = sorted(done.values(), key=lambda r: (ADAPTERS.index(r["impl"]), r["dtype"], r["P"]))
                    summary_path.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ADAPTERS)
