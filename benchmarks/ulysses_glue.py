"""The Ulysses glue's sweep (issue 61): ringcheck's own Ulysses glue (`--glue ulysses`) through
`ringcheck step --model` on the proof models at P=2 and P=4 (every default case), and each
catalogue Ulysses mutant on every proof model having its feature at P=2 and P=4 (one case: the
packed one for the documents' mutant), each named or not by the diagnosis.

    python -m benchmarks.ulysses_glue [--out reports/models] [--worlds 2,4] [--models llama,...]

Writes ulysses_glue.md and ulysses_glue.json: per row the verdict, the class the diagnosis named,
and the seconds it took (local gloo rings on this machine's CPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROOF = ("llama", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "exaone4", "granite",
         "deepseek_v3", "llama4_text")
MUTANTS = "ringcheck.catalogue.glue_mutants:"


def has_feature(bug: str, tiny) -> bool:
    """Whether the tiny model has the feature the mutant `bug` breaks."""
    layers = tiny.layers
    return {"ulysses_gqa_regrouped": any(1 < x.kv_heads < x.heads for x in layers),
            "ulysses_sinks_misrouted": any(x.sinks for x in layers)}.get(bug, True)


def row_of(glue: str, model: str, world: int, judged: dict, seconds: float) -> dict:
    cases = judged["cases"]
    named = sorted({c["diagnosis"].get("loss") for c in cases if c.get("diagnosis", {}).get("matched")})
    failed = [c["case"] for c in cases if c["verdict"] == "fail"]
    return {"glue": glue, "model": model, "P": world, "verdict": judged["verdict"], "named": named,
            "failed": failed, "cases": len(cases), "seconds": round(seconds, 1),
            "why": judged["why"][:400]}


def refused_row(glue: str, model: str, world: int, why: str) -> dict:
    return {"glue": glue, "model": model, "P": world, "verdict": "refused (exit 2)", "named": [], "failed": [],
            "cases": 0, "seconds": 0.0, "why": why.splitlines()[0][:400]}


def sweep(models, worlds, rings) -> list[dict]:
    from ringcheck.catalogue.glue_mutants import ULYSSES_BUGS
    from ringcheck.commands.step_model import check_model_before_start, run_model_step
    from ringcheck.models.step import ModelStepConfig
    from ringcheck.models.tiny import tiny_model

    rows = []
    for world in worlds:
        for model in models:
            tiny = tiny_model(model)
            runs = [("ulysses", None)] + [(b, ("packed",) if b == "ulysses_documents_crossed" else ("one_sequence",))
                                          for b in ULYSSES_BUGS if has_feature(b, tiny)]
            for glue, cases in runs:
                spec = glue if glue == "ulysses" else MUTANTS + glue
                kw = {} if cases is None else {"cases": cases}
                config = ModelStepConfig(model=model, glue=spec, world_size=world, **kw)
                try:
                    checked = check_model_before_start(config)
                except ValueError as exc:   # the correct glue's refusal: the mutants would be refused alike
                    rows.append(refused_row(glue, model, world, str(exc)))
                    print(f"{glue} {model} P={world}: refused", flush=True)
                    break
                start = time.perf_counter()
                judged = run_model_step(config, rings, checked)
                rows.append(row_of(glue, model, world, judged, time.perf_counter() - start))
                print(f"{glue} {model} P={world}: {rows[-1]['verdict']} {rows[-1]['named']}", flush=True)
    return rows


def expected(row: dict) -> bool:
    """The row is what the issue asks: the correct glue passes (or is refused with its numbers);
    each mutant fails with its own class named."""
    from ringcheck.catalogue.glue_mutants import ULYSSES_BUGS

    if row["verdict"].startswith("refused"):
        return True
    if row["glue"] == "ulysses":
        return row["verdict"] == "pass"
    return row["verdict"] == "fail" and row["named"] == [ULYSSES_BUGS[row["glue"]]]


def markdown(rows: list[dict], command: str) -> str:
    good = sum(expected(r) for r in rows)
    lines = ["# ringcheck's Ulysses glue and its mutants through `ringcheck step --model`", "",
             f"Regenerate: `{command}`", "",
             "The correct glue (`--glue ulysses`) runs every default case; each mutant "
             "(`ringcheck.catalogue.glue_mutants:ulysses_*`) one case on every proof model having its feature. "
             f"As expected (correct: pass or refused with its numbers; mutant: fail, its class named): {good} of "
             f"{len(rows)} rows.", "",
             "| glue | model | P | verdict | class named | as expected | s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['glue']} | {r['model']} | {r['P']} | {r['verdict']} | {', '.join(r['named']) or '-'} | "
                     f"{'yes' if expected(r) else 'NO: ' + r['why']} | {r['seconds']} |")
    refused = [r for r in rows if r["verdict"].startswith("refused")]
    if refused:
        lines += ["", "Refused before any rank starts (exit 2):", ""]
        lines += [f"- {r['glue']} on {r['model']} at P={r['P']}: {r['why']}" for r in refused]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "reports" / "models"))
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default=",".join(PROOF))
    args = parser.parse_args(argv)
    from ringcheck.launch import LocalRings

    worlds = [int(x) for x in args.worlds.split(",")]
    models = [m for m in args.models.split(",") if m]
    with LocalRings() as rings:
        rows = sweep(models, worlds, rings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.ulysses_glue" + "".join(
        f" {flag} {value}" for flag, value, default in (("--worlds", args.worlds, "2,4"),
                                                        ("--models", args.models, ",".join(PROOF)))
        if value != default)
    (out / "ulysses_glue.md").write_text(markdown(rows, command))
    (out / "ulysses_glue.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    return 0 if all(expected(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
