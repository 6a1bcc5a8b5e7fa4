"""reports/step/: every recipe mutant's loss and gradient error and the diagnosis `ringcheck step`
gives, beside the correct recipes' errors on every case (plain at P = 2, 4, 8 and hf_llama at
P = 2, 4, contiguous and zigzag, a mesh dp=2,cp=2; our ring, PyTorch's context parallel and
ring-flash-attn through the flash-attn stand-in in bfloat16 as --impl; a recipe whose parameters
are DTensors), and the mutants again through ring-flash-attn (which of them a bf16 ring separates).

    python -m benchmarks.step_report [--out reports/step]

Writes README.md (the tables) and step_report.json (the rows). Not a test: the suites check
each mutant's diagnosis at P=2 (suites/test_step.py); this is the wider evidence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ringcheck.catalogue import step_mutants
from ringcheck.commands.step import default_cases, run_step
from ringcheck.harness.runner import loaded
from ringcheck.launch import LocalRings
from ringcheck.step.contract import load_recipe
from ringcheck.step.diagnosis import WORDS
from ringcheck.step.run import StepConfig

ROOT = Path(__file__).resolve().parents[1]
FSDP = "ringcheck.catalogue.step_fsdp:"
SPEED = "## Time of the command"
RFA = {"flash_attn_stand_in": True, "attention_dtype": "bfloat16"}  # flash-attn's rings: bf16, the stand-in
# (recipe, P, layout, mesh, --impl, other settings)
CORRECT = [*[("plain", p, layout, None, "ringcheck", {}) for p in (2, 4, 8) for layout in ("contiguous", "zigzag")],
           *[("hf_llama", p, layout, None, "ringcheck", {}) for p in (2, 4) for layout in ("contiguous", "zigzag")],
           *[(r, 2, layout, "dp=2,cp=2", "ringcheck", {}) for r in ("plain", "hf_llama")
             for layout in ("contiguous", "zigzag")],
           *[(r, p, "zigzag", None, "torch_cp", {}) for r in ("plain", "hf_llama") for p in (2, 4)],
           *[(r, p, "zigzag", None, "ring_flash_attn:zigzag", RFA) for r in ("plain", "hf_llama") for p in (2, 4)],
           ("plain", 8, "zigzag", None, "ring_flash_attn:zigzag", RFA),
           *[(r, p, "contiguous", None, "ring_flash_attn:llama3", RFA) for r in ("plain", "hf_llama") for p in (2, 4)],
           ("plain", 2, "zigzag", "dp=2,cp=2", "ring_flash_attn:zigzag", RFA),
           *[(FSDP + m, p, "zigzag", mesh, "ringcheck", {}) for m, p, mesh in
             (("fsdp_over_cp", 2, None), ("fsdp_over_cp", 4, None), ("fsdp_over_cp", 2, "dp=2,cp=2"))],
           ("plain", 2, "contiguous", None, "ring_attention_pytorch", {})]  # its dK/dV bug: docs/findings/peers.md
MUTANTS = {**{f"ringcheck.catalogue.step_mutants:{m}": c for m, c in step_mutants.EXPECTED.items()},
           "ringcheck.catalogue.hf_step_mutants:labels_sharded": ("one_sequence", "labels_shifted_in_shards"),
           "ringcheck.catalogue.step_mutants:labels_shifted_older_logits": ("one_sequence", "labels_shifted_in_shards"),
           FSDP + "fsdp_averaged_over_cp": ("one_sequence", "grads_over_p")}


def correct_rows(rings) -> list[dict]:
    rows = []
    for recipe, p, layout, mesh, impl, settings in CORRECT:
        start = time.perf_counter()
        config = StepConfig(recipe=recipe, world_size=p, layout=layout, mesh=mesh, impl=impl, **settings)
        config = replace(config, cases=default_cases(load_recipe(recipe), loaded(config.impl_options), config))
        judged = run_step(config, rings)
        cases = judged["cases"]
        rows.append({"recipe": recipe.removeprefix(FSDP), "impl": impl + (f" ({config.attention_dtype})"
                                                                          if config.attention_dtype else ""),
                     "P": p, "layout": layout, "mesh": mesh or f"cp={p}",
                     "verdict": judged["verdict"], "cases": len(cases),
                     "loss_error": max(c["loss"]["error"] for c in cases),
                     "gradient_error": max(c["worst_gradient"] for c in cases),
                     "worst_ratio": max(max(c["loss"]["ratio"], max((g["ratio"] for g in c["gradients"]), default=0))
                                        for c in cases),
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    return rows


def _out(c: dict) -> float:
    """How many budgets out a case is: the larger of the loss's and the worst gradient's ratio."""
    return max(c["loss"]["ratio"], max((g["ratio"] for g in c["gradients"]), default=0.0))


def mutant_rows(rings, ring: dict) -> list[dict]:
    """Every mutant on the case that shows it (P=4, zigzag), the ring of `ring` (--impl and its settings)."""
    rows = []
    for spec, (case, expected) in MUTANTS.items():
        judged = run_step(StepConfig(recipe=spec, world_size=4, layout="zigzag", cases=(case,), **ring), rings)
        (c,) = judged["cases"]
        d = c.get("diagnosis")
        rows.append({"mutant": spec.split(":")[1], "class": WORDS[expected][0], "reports": WORDS[expected][2],
                     "case": case, "verdict": c["verdict"], "loss_error": c["loss"]["error"],
                     "gradient_error": c["worst_gradient"], "first_out": c["first_out"], "budgets_out": _out(c),
                     "diagnosis": None if d is None else d["name"], "expected": expected,
                     "matched_loss": None if d is None else d["loss_error"],
                     "matched_gradient": None if d is None else d["gradient_error"]})
        print(rows[-1], flush=True)
    for spec, case, mesh in (("ringcheck.catalogue.step_mutants:micro_batches_weighed_equally", "two_micro_batches",
                              None), ("ringcheck.catalogue.step_mutants:sampler_seeded_by_global_rank", "one_sequence",
                                      "dp=2,cp=2")):
        judged = run_step(StepConfig(recipe=spec, world_size=2 if mesh else 4, mesh=mesh, cases=(case,), **ring),
                          rings)
        (c,) = judged["cases"]
        rows.append({"mutant": spec.split(":")[1], "case": case, "verdict": judged["verdict"],
                     "loss_error": c["loss"]["error"], "gradient_error": c["worst_gradient"],
                     "convention": (judged["convention"] or {}).get("follows"),
                     "data": (judged["data"] or {}).get("verdict")})
        print(rows[-1], flush=True)
    return rows


def matrix_rows(rings, ring: dict) -> list[dict]:
    """Every plain mutant on every case the ring runs (P=4, zigzag): the diagnosis per case, or
    pass, and how many budgets out."""
    rows = []
    for name, (_, expected) in step_mutants.EXPECTED.items():
        config = StepConfig(recipe=f"ringcheck.catalogue.step_mutants:{name}", world_size=4, **ring)
        config = replace(config, cases=default_cases(load_recipe(config.recipe), loaded(config.impl_options), config))
        judged = run_step(config, rings)
        cells = {c["case"]: ("pass" if c["verdict"] == "pass" else (c["diagnosis"] or {}).get("name", "none"))
                 for c in judged["cases"]}
        rows.append({"mutant": name, "expected": expected, "cases": cells,
                     "budgets_out": {c["case"]: _out(c) for c in judged["cases"]}})
        print(rows[-1], flush=True)
    return rows


def _g(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def matrix_markdown(matrix: list[dict], title: str, margins: bool = False) -> list[str]:
    cases = list(matrix[0]["cases"])
    out = ["", f"## {title}", "",
           "The expected diagnosis is written `=`; `pass`: the case cannot show the bug (a gradient bug in the "
           "evaluation case, padding where no case pads); `none`: failed, but no known transformation is defined "
           "there (local positions and local attention are not recomputed on packed documents)"
           + ("; the number: how many budgets out the case is (its loss or its worst gradient)." if margins else "."),
           "", "| mutant | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for r in matrix:
        cells = ["=" if r["cases"][c] == r["expected"] else r["cases"][c] for c in cases]
        if margins:
            cells = [f"{x} {r['budgets_out'][c]:.2g}" for x, c in zip(cells, cases)]
        out.append(f"| {r['mutant']} | " + " | ".join(cells) + " |")
    return out


def mutants_markdown(mutants: list[dict], title: str) -> list[str]:
    out = ["", f"## {title}", "",
           "| mutant | class | reported in | case | loss error | gradient error | budgets out | first parameter out "
           "| diagnosis | matched to (loss, gradients) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in mutants:
        if "expected" not in r:
            continue
        first = "-" if r["first_out"] is None else f"{r['first_out']['name']} x{r['first_out']['factor']:.3g}"
        ok = "" if r["diagnosis"] == r["expected"] else f" (expected {r['expected']})"
        out.append(f"| {r['mutant']} | {r['class']} | {r['reports']} | {r['case']} | {_g(r['loss_error'])} | "
                   f"{_g(r['gradient_error'])} | {_g(r['budgets_out'])} | {first} "
                   f"| {r['diagnosis']}{ok} | {_g(r['matched_loss'])}, {_g(r['matched_gradient'])} |")
    out += ["", "Named outside the per-case gate:", ""]
    for r in mutants:
        if "expected" in r:
            continue
        out.append(f"- {r['mutant']} ({r['case']}): verdict {r['verdict']}, loss error {_g(r['loss_error'])}, "
                   f"gradient error {_g(r['gradient_error'])}; convention {r['convention']}, data check {r['data']}")
    return out


def markdown(doc: dict) -> str:
    out = ["# ringcheck step: correct recipes against recipe mutants", "",
           "Generated by `python -m benchmarks.step_report` (float64 steps; relative errors of the CP=P step against "
           "the same step at CP=1; the worst over every case for the correct recipes). Rings that run only bf16 "
           "(ring-flash-attn, through the flash-attn stand-in) are called in bfloat16 inside the float64 step and "
           "judged within K_NOISE x the measured noise ([noise.md](noise.md)). The same under torchrun, 4 ranks: "
           "[torchrun.md](torchrun.md).", "",
           "## Correct recipes (every case the ring runs), on our ring and on peer rings", "",
           "ring_attention_pytorch fails inside the correct step: the loss agrees, the gradients do not (its known "
           "dK/dV bug, docs/findings/peers.md; no step bug is named). fsdp_over_cp: the plain step with every "
           "parameter a DTensor (FSDP2 over the CP group), its gradients gathered to full by ringcheck.", "",
           "| recipe | --impl | mesh | layout | cases | worst loss error | worst gradient error | worst / budget | "
           "verdict |", "|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['recipe']} | {r['impl']} | {r['mesh']} | {r['layout']} | {r['cases']} | {_g(r['loss_error'])} | "
            f"{_g(r['gradient_error'])} | {_g(r['worst_ratio'])} | {r['verdict']} |" for r in doc["correct"]]
    out += mutants_markdown(doc["mutants"], "Recipe mutants (P=4, zigzag, the case that shows each; our ring, float64)")
    out += mutants_markdown(doc["peer_mutants"], "The same mutants through ring-flash-attn zigzag in bfloat16 "
                                                 "(the stand-in; the budget K_NOISE x the noise)")
    out += matrix_markdown(doc["matrix"], "Every mutant on every case (P=4, zigzag, our ring, float64)")
    out += matrix_markdown(doc["peer_matrix"], "Every mutant on every case through ring-flash-attn zigzag in bfloat16 "
                                               "(P=4; no packed case: its varlen ring needs --layout zigzag_docs)",
                           margins=True)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "reports" / "step"))
    args = parser.parse_args(argv)
    peer = {"impl": "ring_flash_attn:zigzag", **RFA}
    with LocalRings(timeout=120) as rings:
        doc = {"correct": correct_rows(rings), "mutants": mutant_rows(rings, {}),
               "peer_mutants": mutant_rows(rings, peer), "matrix": matrix_rows(rings, {}),
               "peer_matrix": matrix_rows(rings, peer)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_report.json").write_text(json.dumps(doc, indent=1) + "\n")
    readme = out / "README.md"
    speed = readme.read_text().partition(SPEED)[2] if readme.exists() else ""  # kept: step_speed's figures
    readme.write_text(markdown(doc) + (f"\n{SPEED}{speed}" if speed else ""))
    print(f"wrote {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
