"""The zoo's run: `ringcheck step --model` on transformers architectures under each built-in glue, and
the catalogue's glue mutants on models that have their feature; writes reports/models/.

    .venv/bin/python -m benchmarks.models_zoo_run                         # the ten of issue 42's Proof, P=2,4
    .venv/bin/python -m benchmarks.models_zoo_run --models all --glues ringcheck,ringcheck:zigzag,ring_flash_attn \
        --sizes 4                                                          # every architecture that builds tiny
    .venv/bin/python -m benchmarks.models_zoo_run --mutants                # the mutants' table alone
    .venv/bin/python -m benchmarks.models_zoo_run --speed                  # one check at P=4, median of 3

Per architecture: the attention features of its tiny model (`ringcheck.models.zoo.features`), and
per glue and ring size pass / fail (with the lost semantic the diagnosis names) / not run (and
why: the model refused, the glue refused a feature, a case the glue raised in). A glue is
`NAME` or `NAME:LAYOUT` (ringcheck's glue in zigzag). Every run is every case of
`ringcheck.models.step.MODEL_CASES` on local gloo rings, as the command runs it. The speed: the
command itself (`python -m ringcheck step --model M --world-size 4`), wall seconds, start-up
included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "reports" / "models"
PROOF = ("llama", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "exaone4", "granite",
         "deepseek_v3")
# per mutant (ringcheck.catalogue.glue_mutants), models that have its feature; the short-shard losses bite at
# every P since the regime cases (ringcheck.models.regimes) put the shard on both sides of the window and chunk,
# and granite's scaling (its attention_multiplier) is the one of the ten that differs from head_dim^-0.5
MUTANT_MODELS = {"window_dropped": ("mistral", "gemma3_text"), "window_wider": ("mistral",),
                 "window_narrower": ("mistral",), "window_dropped_short_shard": ("mistral", "gemma3_text"),
                 "sinks_dropped": ("gpt_oss",), "softcap_dropped": ("gemma2",), "scale_default": ("granite",),
                 "documents_crossed": ("llama",), "mask_plain_causal": ("cohere2",),
                 "chunk_dropped_short_shard": ("llama4_text",)}
SPEED_MODELS = {"dense": "llama", "MoE": "deepseek_v3"}


def _glue(spec: str) -> tuple[str, str | None]:
    name, _, layout = spec.partition(":") if spec.count(":") == 1 and "." not in spec else (spec, "", "")
    return name, layout or None


def run_one(ring, model: str, glue: str, layout: str | None, size: int, truths: dict | None = None) -> dict:
    """One `step --model` run, summarised: verdict, the cases' verdicts, what was named or why not run.
    `truths`: kept by the caller across one model's runs (`run_model_step`: a truth computed once
    for the glues that share it)."""
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.models.step import ModelStepConfig

    t0 = time.perf_counter()
    row = {"model": model, "glue": glue + (f":{layout}" if layout else ""), "P": size}
    try:
        judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=size, layout=layout), ring,
                                truths=truths)
    except (ValueError, TypeError, ImportError) as exc:  # refused before any rank: the model or the glue
        row.update(verdict="not run", why=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    except Exception as exc:  # a run that did not complete: recorded, the zoo goes on
        row.update(verdict="not run", why=f"did not complete: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    else:
        cases = judged["cases"]
        named = sorted({(c.get("diagnosis") or {}).get("words", "") for c in cases if c["verdict"] == "fail"} - {""})
        row.update(verdict=judged["verdict"], cases={c["case"]: c["verdict"] for c in cases},
                   why=judged["why"][:600], named=named,
                   not_run={c["case"]: c["why"][:200] for c in cases if c["verdict"] == "not run"})
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def features_of(model: str) -> list[str]:
    from ringcheck.models.tiny import tiny_model
    from ringcheck.models.zoo import features

    try:
        return list(features(tiny_model(model)))
    except Exception as exc:  # the survey says why; here the features are only a column
        return [f"({type(exc).__name__})"]


def zoo(models, glues, sizes, out: Path) -> list[dict]:
    from ringcheck.launch import open_ring

    rows = []
    ring = open_ring(timeout=120)
    try:
        for model in models:
            truths: dict = {}  # the model's truths, each computed once for the glues that share it
            for spec in glues:
                name, layout = _glue(spec)
                for size in sizes:
                    row = run_one(ring, model, name, layout, size, truths)
                    print(f"{model:16s} {row['glue']:20s} P={size} {row['verdict']:9s} {row['seconds']:6.1f}s "
                          f"{row['why'][:150]}", flush=True)
                    rows.append(row)
    finally:
        ring.close()
    return rows


def mutants(sizes, out: Path) -> list[dict]:
    from ringcheck.launch import open_ring

    rows = []
    ring = open_ring(timeout=120)
    try:
        for mutant, models in MUTANT_MODELS.items():
            for model in models:
                for size in sizes:
                    row = run_one(ring, model, f"ringcheck.catalogue.glue_mutants:{mutant}", None, size)
                    row["mutant"] = mutant
                    print(f"{mutant:28s} {model:14s} P={size} {row['verdict']:9s} {row['named']!s:.150}", flush=True)
                    rows.append(row)
    finally:
        ring.close()
    return rows


def speed(repeats: int) -> list[dict]:
    rows = []
    for kind, model in SPEED_MODELS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "ringcheck", "step", "--model", model, "--world-size", "4",
                                   "-q"], cwd=ROOT, capture_output=True, text=True)
            times.append(round(time.perf_counter() - t0, 1))
            print(f"speed {kind} {model}: {times[-1]} s, exit {done.returncode}", flush=True)
        rows.append({"kind": kind, "model": model, "seconds": times, "median": statistics.median(times),
                     "exit": done.returncode, "target": 30 if kind == "dense" else 60})
    return rows


def _cell(rows, model, glue, size) -> str:
    r = next((x for x in rows if x["model"] == model and x["glue"] == glue and x["P"] == size), None)
    if r is None:
        return ""
    if r["verdict"] == "fail":
        return "**fail**: " + ("; ".join(r["named"]) or "no semantic named")[:160]
    if r["verdict"] == "not run":
        return f"not run: {r['why'][:160]}"
    extra = f" (not run: {', '.join(r['not_run'])})" if r.get("not_run") else ""
    return r["verdict"] + extra


def markdown(rows, mutant_rows, speed_rows, command: str) -> str:
    out = ["# ringcheck step --model: the zoo", "", f"Regenerate: `{command}`", ""]
    if rows:
        cols = list(dict.fromkeys((r["glue"], r["P"]) for r in rows))
        out += ["| model | attention features | " + " | ".join(f"{g} P={p}" for g, p in cols) + " |",
                "|---|---|" + "---|" * len(cols)]
        for model in dict.fromkeys(r["model"] for r in rows):
            feats = ", ".join(next(r for r in rows if r["model"] == model).get("features", []))
            out.append(f"| {model} | {feats} | " + " | ".join(_cell(rows, model, g, p).replace("|", "/")
                                                               for g, p in cols) + " |")
        out.append("")
    if mutant_rows:
        out += ["## The catalogue's glue mutants", "", "| mutant | model | P | verdict | the diagnosis names |",
                "|---|---|---|---|---|"]
        for r in mutant_rows:
            out.append(f"| {r['mutant']} | {r['model']} | {r['P']} | {r['verdict']} | "
                       f"{('; '.join(r.get('named') or []) or r.get('why', ''))[:300].replace('|', '/')} |")
        out.append("")
    if speed_rows:
        out += ["## Speed: one check at P=4, every case (the command, start-up included)", "",
                "| kind | model | runs (s) | median (s) | target (s) |", "|---|---|---|---|---|"]
        out += [f"| {r['kind']} | {r['model']} | {', '.join(map(str, r['seconds']))} | {r['median']} | "
                f"<= {r['target']} |" for r in speed_rows]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(PROOF), help="comma-separated model_types, or 'all' (zoo_names)")
    p.add_argument("--glues", default="ringcheck", help="comma-separated glues (NAME or NAME:LAYOUT)")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--mutants", action="store_true", help="run the glue mutants' table (P from --sizes)")
    p.add_argument("--no-zoo", action="store_true", help="skip the architectures (with --mutants or --speed)")
    p.add_argument("--speed", action="store_true", help="time one check at P=4 (median of --repeats)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="zoo", help="the report's file name under reports/models/ (NAME.md, NAME.json)")
    args = p.parse_args(argv)
    from ringcheck.models.tiny import zoo_names

    models = zoo_names() if args.models == "all" else tuple(args.models.split(","))
    sizes = tuple(int(s) for s in args.sizes.split(","))
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [] if args.no_zoo else zoo(models, args.glues.split(","), sizes, OUT)
    feats = {m: features_of(m) for m in dict.fromkeys(r["model"] for r in rows)}
    for r in rows:
        r["features"] = feats[r["model"]]
    mutant_rows = mutants(sizes, OUT) if args.mutants else []
    speed_rows = speed(args.repeats) if args.speed else []
    command = "python -m benchmarks.models_zoo_run " + " ".join(argv if argv is not None else sys.argv[1:])
    (OUT / f"{args.name}.json").write_text(json.dumps({"command": command, "zoo": rows, "mutants": mutant_rows,
                                                       "speed": speed_rows}, indent=1, default=str) + "\n")
    (OUT / f"{args.name}.md").write_text(markdown(rows, mutant_rows, speed_rows, command))
    print(f"wrote {OUT / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
