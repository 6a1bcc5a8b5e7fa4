"""`ringcheck train` across the catalogue: false alarms on correct rings, what the rings with
real backward bugs do, how TransformerEngine-style tolerances would have judged the same runs,
and whether the precision-class mutants change training (measured, not a gate).

Every case is one `ringcheck train` run (`ringcheck.commands.train.run_train`, the command's
own function) on local gloo rings kept alive for the sweep; single-device runs of equal
settings (same dtype, seed, model, data, variant) are shared between cases through the
command's cache, since they do not depend on the implementation or the ring's size. Each case's
row is appended to reports/train/sweep.jsonl as it finishes (a rerun skips the rows already
there: delete the file to start afresh); `--summary` writes reports/train/README.md from it.

    python benchmarks/train_sweep.py [--group correct|mutants|precision] [--seeds 0,1,2] [--summary]

The cases are the table `CASES` (group, name, settings); a case is one row per seed. The
Triton cases set TRITON_INTERPRET=1 for the sweep's processes (this script is the edge).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from ringcheck.catalogue.precision_mutants import NARROWER, PRECISION_MUTANTS
from ringcheck.commands.train import check_impl, impl_options, placement, run_train
from ringcheck.flash_stand_in import install
from ringcheck.launch import LocalRings, RingError
from ringcheck.train import K_GRAD, K_LOSS, TrainConfig

OUT = Path(__file__).resolve().parents[1] / "reports" / "train"
MUT, EMB, VAR, PREC = ("ringcheck.catalogue.mutants", "ringcheck.catalogue.embedded_mutants",
                       "ringcheck.catalogue.variant_textbook", "ringcheck.catalogue.precision_mutants")
DTYPES = ("float32", "bfloat16", "float16")
VARIANTS = dict(documents="random:3", pad=8, window=(48, 0), softcap=30.0, sinks=True)
MASKS = dict(documents="random:3", pad=8, window=(48, 0), sinks=True)  # no softcap: the fused noise runs take part
TRITON = dict(backend="triton", seq_len=32, layers=1, steps=10, dtype="float32")
PEERS = {  # the peers that passed validate at these dtypes (reports/peers/summary.json), with their layout
    "ring_flash_attn:zigzag": ("zigzag", ("bfloat16", "float16")), "ring_flash_attn:stripe": ("striped", DTYPES[1:]),
    "ring_flash_attn:llama3": ("contiguous", DTYPES[1:]), "ring_flash_attn:basic": ("contiguous", ("bfloat16",)),
    "yunchang:ulysses": ("contiguous", DTYPES[1:]), "yunchang:ring:zigzag": ("zigzag", DTYPES[1:]),
    "yunchang:ring:stripe": ("striped", DTYPES[1:]), "yunchang:usp": ("contiguous", ("bfloat16",)),
    "yunchang:ring:basic": ("contiguous", ("bfloat16",)),
}
# float16 runs of the flash-attn peers that validate's precision class fails (dq ~8x less precise than a flash kernel)
PEERS_FP16_PRECISION = ("ring_flash_attn:basic", "yunchang:usp", "yunchang:ring:basic")
BACKWARD_MUTANTS = ("block_lse_backward", "stale_kv_backward", "dkdv_not_home", "scale_twice_backward")
FORWARD_MUTANTS = ("merge_no_rescale", "merge_overflow", "diagonal_off_by_one", "contiguous_mask_on_zigzag",
                   "drops_remainder", "gqa_modulo", "low_precision_partial", "stale_receive_buffer")


def _cases() -> list[tuple[str, str, dict]]:
    """(group, name, settings) of every case, one row per seed each."""
    cases = []

    def add(group, name, **settings):
        cases.append((group, name, settings))
    for dtype in DTYPES:
        for p in (2, 4, 8):
            add("correct", f"ringcheck {dtype} P={p}", dtype=dtype, world_size=p)
        for p in (2, 4):
            add("correct", f"textbook {dtype} P={p}", impl=f"{MUT}:textbook", dtype=dtype, world_size=p)
            add("correct", f"torch_cp {dtype} P={p}", impl="torch_cp", dtype=dtype, world_size=p)
    add("correct", "ringcheck triton (interpreter) float32 P=2", world_size=2, **TRITON)
    for p in (2, 4):
        add("correct", f"textbook_varlen variants P={p}", impl=f"{VAR}:textbook_varlen", world_size=p, **VARIANTS)
        add("correct", f"ringcheck variants P={p}", world_size=p, **VARIANTS)
    add("correct", "ringcheck variants --sinks-grad reduced P=4", world_size=4, sinks_grad="reduced", **VARIANTS)
    add("correct", "ringcheck documents, window, sinks (no softcap) P=4", world_size=4, **MASKS)
    for mesh in ("cp=2,tp=2", "dp=2,cp=2"):
        add("correct", f"ringcheck mesh {mesh}", mesh=mesh, world_size=2)
    add("correct", "gather_textbook mesh cp=2,tp=2", impl=f"{EMB}:gather_textbook", mesh="cp=2,tp=2", world_size=2)
    for impl, (layout, dtypes) in PEERS.items():
        for dtype in dtypes:
            for p in (2, 4):
                add("correct", f"{impl} {dtype} P={p}", impl=impl, layout=layout, dtype=dtype, world_size=p,
                    flash_attn_stand_in=True)
    for p in (2, 4):
        for layout in ("contiguous", "striped"):
            add("mutants", f"ring_attention_pytorch float32 {layout} P={p}", impl="ring_attention_pytorch",
                layout=layout, dtype="float32", world_size=p)
    for name in BACKWARD_MUTANTS:
        add("mutants", f"{name} (backward)", impl=f"{MUT}:{name}")
    for name in ("default_group", "batch_one_gather", "rank_from_wrong_axis"):
        add("mutants", f"{name} mesh cp=2,tp=2", impl=f"{EMB}:{name}", mesh="cp=2,tp=2", world_size=2)
    add("mutants", "workspace_state (two layers)", impl=f"{EMB}:workspace_state")
    add("mutants", "sinks_all_reduced --sinks (partial)", impl=f"{EMB}:sinks_all_reduced", sinks=True)
    for name in FORWARD_MUTANTS:
        add("forward", f"{name} (forward)", impl=f"{MUT}:{name}")
    for name, (_, _tensor, narrow, _) in PRECISION_MUTANTS.items():
        for dtype, narrower in NARROWER.items():
            if narrow in narrower:
                add("precision", f"{name} {dtype}", impl=f"{PREC}:{name}", dtype=dtype)
    for impl in PEERS_FP16_PRECISION:
        add("precision", f"{impl} float16 P=4", impl=impl, layout=PEERS[impl][0], dtype="float16", world_size=4,
            flash_attn_stand_in=True)
    return cases


CASES = _cases()


def run_case(rings, cache, group: str, name: str, settings: dict, seed: int) -> dict:
    config = TrainConfig(seed=seed, **settings)
    row = {"group": group, "case": name, "seed": seed, "settings": settings}
    start = time.perf_counter()
    try:
        if config.flash_attn_stand_in:
            install()
        impl = impl_options(config).load()
        check_impl(impl, config)
        placement(config, None, impl.world_only)
    except (ValueError, TypeError, RuntimeError) as exc:
        return {**row, "verdict": "not run", "why": str(exc).splitlines()[0]}
    try:
        judged = run_train(config, rings, cache=cache)
    except RingError as exc:
        return {**row, "verdict": "error", "why": str(exc).splitlines()[0][:300]}
    s = judged["summary"]
    return {**row, "verdict": judged["verdict"], "why": judged["why"][:400], "grads_out": s["grads_out"],
            "left_band_at": s["left_band_at"], "worst_gradient": s["worst_gradient"],
            "worst_gradient_ratio": s["worst_gradient_ratio"], "worst_step_ratio": s["worst_step_ratio"],
            "te_passed": s["te_style"]["passed"], "te_trajectory_passed": s["te_style"]["trajectory_passed"],
            "te_step0_loss_relative": s["te_style"]["step0_loss_relative"],
            "te_grad_max_abs": s["te_style"]["grad_max_abs"], "last_relative_gap": s["last_step"]["relative_gap"],
            "resolution": s["last_step"]["resolution"],
            "leave_one_out": {n: max(v.values()) for n, v in s["leave_one_out"].items()},
            "loo_gradient": max((v["gradient_ratio"] for v in s["leave_one_out"].values()), default=None),
            "loo_loss": max((v["loss_ratio"] for v in s["leave_one_out"].values()), default=None),
            "seconds": round(time.perf_counter() - start, 1)}


def _done(path: Path) -> set[tuple[str, int]]:
    if not path.is_file():
        return set()
    return {(r["case"], r["seed"]) for r in map(json.loads, path.read_text().splitlines()) if r}


def sweep(groups: set[str], seeds: list[int], path: Path) -> None:
    done = _done(path)
    if any(s.get("backend") == "triton" for g, _, s in CASES if g in groups):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the sweep's processes start: they inherit it
    cache: dict = {}
    with LocalRings(timeout=120) as rings:
        for group, name, settings in CASES:
            if group not in groups:
                continue
            for seed in seeds if group in ("correct", "mutants") else seeds[:1 if group == "forward" else 2]:
                if (name, seed) in done:
                    continue
                row = run_case(rings, cache, group, name, settings, seed)
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{row['verdict']:10s} {name} seed {seed} ({row.get('seconds', 0)} s) {row['why'][:120]}",
                      flush=True)


# ---- the summary ---------------------------------------------------------------------------

def _num(x, fmt="{:.2f}") -> str:
    if x is None:
        return ""
    return "inf" if isinstance(x, float) and not math.isfinite(x) else fmt.format(x)


def _by_case(rows):
    cases = defaultdict(list)
    for r in rows:
        cases[(r["group"], r["case"])].append(r)
    return cases


def _verdicts(rs) -> str:
    return " ".join(r["verdict"] for r in sorted(rs, key=lambda r: r["seed"]))


def _worst(rs, key):
    values = [r[key] for r in rs if r.get(key) is not None]
    return max(values) if values else None


def write_summary(path: Path, out: Path, *, k_grad: float, k_loss: float) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cases = _by_case(rows)
    correct = [r for r in rows if r["group"] == "correct"]
    judged = [r for r in correct if r["verdict"] in ("pass", "fail")]
    alarms = [r for r in judged if r["verdict"] == "fail"]
    lines = ["# `ringcheck train` across the catalogue", "",
             "Written by `python benchmarks/train_sweep.py --summary` from `sweep.jsonl` (one row per case and seed; "
             "`python benchmarks/train_sweep.py` runs the cases missing from it). Defaults of `ringcheck train` "
             f"unless the case says otherwise (tiny model, 30 steps, bfloat16, P=4, zigzag); k_grad = {k_grad:g}, "
             f"k_loss = {k_loss:g}.", "",
             "## Correct rings: false alarms", "",
             f"**{len(alarms)} false alarms in {len(judged)} judged runs** of correct rings "
             f"({len(correct) - len(judged)} not run or no verdict: listed below).", "",
             "Worst ratios are the largest over the seeds (1.00 is the limit); leave-one-out is the largest ratio a "
             "noise run reaches judged against the others (what k must stand above).", "",
             "| case | seeds | verdicts | worst gradient / budget | worst loss gap / band | leave-one-out (grad, loss) |",
             "|---|---|---|---|---|---|"]
    for (group, name), rs in cases.items():
        if group != "correct":
            continue
        lines.append(f"| {name} | {len(rs)} | {_verdicts(rs)} | {_num(_worst(rs, 'worst_gradient_ratio'))} | "
                     f"{_num(_worst(rs, 'worst_step_ratio'))} | {_num(_worst(rs, 'loo_gradient'))}, "
                     f"{_num(_worst(rs, 'loo_loss'))} |")
    others = [r for r in correct if r["verdict"] not in ("pass", "fail")]
    if others:
        lines += ["", "Not judged:", ""] + [f"- {r['case']} seed {r['seed']}: {r['verdict']}: {r['why']}"
                                            for r in others]
    loo = [r for r in judged if r.get("loo_gradient") is not None]
    if loo:
        lines += ["", f"Leave-one-out over every judged correct run: gradients at most "
                      f"{max(r['loo_gradient'] for r in loo):.2f}, loss at most {max(r['loo_loss'] for r in loo):.2f} "
                      f"(of k = 1); the rings themselves at most {max(r['worst_gradient_ratio'] for r in judged):.2f} "
                      f"and {max(r['worst_step_ratio'] for r in judged):.2f} of their budgets."]
    for group, title in (("mutants", "Rings with real backward bugs (and the embedded-ring mutants)"),
                         ("forward", "Forward mutants (information)"),
                         ("precision", "Precision-class mutants: does training notice? (measured, not a gate)")):
        rs_all = [r for r in rows if r["group"] == group]
        if not rs_all:
            continue
        lines += ["", f"## {title}", "",
                  "| case | verdicts | parameters out at step 0 (first seed) | loss left the band at step | "
                  "worst gradient / budget | worst loss gap / band | TE-style (5% loss, 0.05 grad) |",
                  "|---|---|---|---|---|---|---|"]
        for (g, name), rs in cases.items():
            if g != group:
                continue
            first = sorted(rs, key=lambda r: r["seed"])[0]
            names = first.get("grads_out") or []
            te = " ".join("pass" if r.get("te_passed") else ("fail" if r.get("te_passed") is False else "-")
                          for r in sorted(rs, key=lambda r: r["seed"]))
            left = " ".join(str(r.get("left_band_at")) for r in sorted(rs, key=lambda r: r["seed"]))
            shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "") if names else "none"
            lines.append(f"| {name} | {_verdicts(rs)} | {shown if first['verdict'] in ('pass', 'fail') else first['why'][:120]} "
                         f"| {left} | {_num(_worst(rs, 'worst_gradient_ratio'), '{:.3g}')} | "
                         f"{_num(_worst(rs, 'worst_step_ratio'), '{:.3g}')} | {te} |")
        failing = [r for r in rs_all if r["verdict"] == "fail"]
        if failing and group == "mutants":
            let_through = [r for r in failing if r.get("te_passed")]
            lines += ["", f"TransformerEngine-style tolerances would have passed {len(let_through)} of the "
                          f"{len(failing)} failing runs above (step-0 loss within 5%, every gradient element within "
                          f"0.05); with the loss within 5% at every step instead, "
                          f"{sum(1 for r in failing if r.get('te_trajectory_passed'))}."]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", action="append", choices=["correct", "mutants", "forward", "precision"])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--summary", action="store_true", help="write reports/train/README.md from the rows")
    args = parser.parse_args(argv)
    path = OUT / "sweep.jsonl"
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.summary:
        sweep(set(args.group or ["correct", "mutants", "forward", "precision"]),
              [int(s) for s in args.seeds.split(",")], path)
    write_summary(path, OUT / "README.md", k_grad=K_GRAD, k_loss=K_LOSS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
