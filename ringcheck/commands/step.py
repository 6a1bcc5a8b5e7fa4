"""`ringcheck step`: is the user's training step the same at CP=P as at CP=1?

`run_step` drives one run from one process (the CLI, or every rank of a torchrun world in
step) on process groups of `ringcheck.launch`:

1. the recipe and the implementation are loaded and checked before any rank starts;
2. the CP=P run: every rank of every CP group of the mesh runs the recipe's step on every case
   (`ringcheck.step.run.step_task`); then the reference, the same mesh with cp=1;
3. per case the verdict (`ringcheck.step.verdict.judge_case`); for a failed case the diagnosis's
   candidates on one rank (`diagnosis_task`) and the one the figures match; the convention of
   the reference's loss;
4. the document (`report_dict`, schema "ringcheck.step" of `ringcheck.documents`).
"""

from __future__ import annotations

from typing import Any

from ..adapters import accepted_keywords
from ..documents import STEP_SCHEMA, header
from ..launch import GroupPlan
from ..step.cases import CASES, case_names
from ..step.contract import load_recipe
from ..step.diagnosis import CONVENTIONS, TRANSFORMS, WORDS, convention, match
from ..step.run import StepConfig, diagnosis_task, ring_positions, step_task
from ..step.verdict import K_COND, budgets, data_row, judge_case, relative, unit_roundoff

EXIT_OF = {"pass": 0, "fail": 1, "no verdict": 2}
# rings known to compute float64 inputs in float64 throughout (ours on its torch backends)
EXACT_FLOAT64 = {("ringcheck", "torch"), ("ringcheck", "torch_plain")}


def attention_dtype(config: StepConfig) -> str | None:
    """The dtype the ring under test is taken to compute in: the step's for `EXACT_FLOAT64`,
    float32 for every other ring in a float64 step."""
    exact = (config.impl, config.backend) in EXACT_FLOAT64 or config.dtype != "float64"
    return None if exact else "float32"


def takes_documents(impl) -> bool:
    return bool(accepted_keywords(impl.fn, ("cu_seqlens",)))


def default_cases(recipe, impl) -> tuple[str, ...]:
    """Every case the recipe offers and the ring can run (packed documents need cu_seqlens)."""
    names = case_names(None, recipe.checkpointing, recipe.evaluate is not None)
    return tuple(n for n in names if takes_documents(impl) or not CASES[n].packed)


def check_before_start(config: StepConfig) -> None:
    """The recipe's hooks and the implementation's rules, before any rank starts (ValueError /
    TypeError naming the value and the fix)."""
    recipe = load_recipe(config.recipe)
    impl = config.impl_options.load()
    impl.check_layout(config.layout, True)
    if impl.dtypes is not None and config.dtype not in impl.dtypes:
        raise ValueError(f"--impl {impl.name} runs the dtypes {list(impl.dtypes)}, not {config.dtype}; pass --dtype "
                         f"{impl.dtypes[0]} (the budget follows it)")
    for name in config.cases:
        if CASES[name].packed and not takes_documents(impl):
            raise ValueError(f"--cases {name}: --impl {impl.name} takes no cu_seqlens, so it cannot attend within "
                             f"packed documents; drop the case")
        if CASES[name].checkpoint is not None and CASES[name].checkpoint not in recipe.checkpointing:
            raise ValueError(f"--cases {name}: --recipe {config.recipe} offers no {CASES[name].checkpoint} "
                             f"activation checkpointing (its checkpointing: {list(recipe.checkpointing)}); drop the "
                             f"case")
        if CASES[name].evaluate and recipe.evaluate is None:
            raise ValueError(f"--cases {name}: --recipe {config.recipe} has no evaluate(model, micro_batches, cp); "
                             f"drop the case or add the hook")


def _targets(name: str, rows: int) -> int:
    case = CASES[name]
    return case.micro * case.rows * rows * case.seq_len


def _ranks(groups, name: str) -> list[dict]:
    return [{"where": (g, r["cp_rank"]), "loss": r["cases"][name]["loss"], "grads": r["cases"][name]["grads"]}
            for g, group in enumerate(groups) for r in group]


def run_step(config: StepConfig, processes) -> dict[str, Any]:
    """The CP=P run and the reference on `processes` (`LocalRings` or the `TorchrunWorld` whose
    every rank calls this in step), judged and, where a case failed, diagnosed."""
    recipe = load_recipe(config.recipe)
    mesh, ref_mesh = config.mesh_spec, config.reference_mesh
    world_only = config.impl_options.load().world_only
    if world_only is not None and (mesh.rings > 1 or processes.size not in (None, mesh.size)):
        raise ValueError(f"--impl {config.impl}: {world_only}, so its ring must be the whole world: drop --mesh and "
                         f"pass --world-size {processes.size or mesh.cp}")
    first = 0 if processes.size is None else processes.size - mesh.size
    pos0 = ring_positions(config)
    names = config.cases
    kw = {} if getattr(processes, "is_torchrun", False) else {"deadline": processes.timeout * (10 + len(names))}
    ring = processes.run_groups(mesh.plan(first, families=True), step_task, config, names, pos0, **kw)
    ref = processes.run_groups(ref_mesh.plan(first, families=True), step_task, config, names, pos0, True, **kw)
    rows = []
    for name in names:
        n = _targets(name, mesh.rings)
        rows.append(judge_case(name, _ranks(ring, name), ref[0][0]["cases"][name], n, config.dtype,
                               recipe.loss_dtype, CASES[name].evaluate, attention_dtype(config)))
    failed = [r["case"] for r in rows if r["verdict"] == "fail"]
    conv_case = "two_micro_batches" if "two_micro_batches" in names else names[0]
    requests = [(c, config.world_size, TRANSFORMS) for c in failed] + [(conv_case, 1, CONVENTIONS)]
    cands = {}
    if recipe.logits is not None:
        cands = processes.run_groups(GroupPlan(((first,),), label="diagnosis"), diagnosis_task, config,
                                     tuple(requests), pos0, **kw)[0][0]
    attn = attention_dtype(config)
    diag_u = max(unit_roundoff(recipe.loss_dtype or config.dtype), unit_roundoff(attn or config.dtype))
    for row in rows:
        if row["verdict"] != "fail":
            continue
        n = row["targets"]
        loss_budget, _ = budgets(n, config.dtype, recipe.loss_dtype, attn)
        found = match(_ranks(ring, row["case"]), ref[0][0]["cases"][row["case"]],
                      cands.get(f"{row['case']}@{config.world_size}", {}), P=config.world_size,
                      loss_budget=loss_budget, grad_budget=2 * n * K_COND * diag_u,
                      evaluate=CASES[row["case"]].evaluate, relative=relative)
        row["candidates"] = found
        row["diagnosis"] = found[0] if found and found[0]["matches"] else None
    conv = None
    if f"{conv_case}@1" in cands:
        conv_budget = budgets(_targets(conv_case, mesh.rings), config.dtype, recipe.loss_dtype, attn)[0]
        conv = convention(ref[0][0]["cases"][conv_case], cands[f"{conv_case}@1"], loss_budget=conv_budget,
                          relative=relative)
        conv["case"] = conv_case
    data = data_row(ring)
    verdict = "fail" if failed or (data is not None and data["verdict"] == "fail") else (
        "no verdict" if any(r["verdict"] == "no verdict" for r in rows) else "pass")
    return {"verdict": verdict, "cases": rows, "convention": conv, "data": data, "mesh": mesh,
            "reference_mesh": ref_mesh, "loss_dtype": recipe.loss_dtype or config.dtype, "attention_dtype": attn,
            "has_logits": recipe.logits is not None,
            "why": _why(rows, data)}


def _why(rows, data=None) -> str:
    bad = [r for r in rows if r["verdict"] == "fail"]
    if data is not None and data["verdict"] == "fail":
        return f"data: {data['words']}" + ("; " + _why(rows) if bad else "")
    blind = [r["case"] for r in rows if r["verdict"] == "no verdict"]
    if blind and not bad:
        return f"no verdict: the step at CP=1 is not finite in {', '.join(blind)}"
    if not bad:
        worst = max(max(r["loss"]["ratio"], max((g["ratio"] for g in r["gradients"]), default=0)) for r in rows)
        return f"every case's loss and gradients at CP=P equal CP=1 within the budget (worst {worst:.2g} of it)"
    parts = []
    for r in bad:
        d = r.get("diagnosis")
        first = r["first_out"]
        where = (f"; first parameter out: {first['name']} ({first['error']:.2g}, x{first['factor']:.4g})"
                 if first else "")
        what = f"matches {d['name']} ({d['class']}): {d['words']}" if d else "matches no known transformation"
        parts.append(f"{r['case']}: loss {r['loss']['error']:.2g} off{where}; {what}")
    return "; ".join(parts)


def rule_words(config: StepConfig, loss_dtype: str, attention: str | None = None) -> dict[str, Any]:
    return {"k_cond": K_COND, "unit_roundoff": unit_roundoff(config.dtype), "loss_dtype": loss_dtype,
            "attention_dtype": attention or config.dtype,
            "attention": ("" if attention is None else f"--impl {config.impl} is not known to compute {config.dtype} "
                          f"throughout: its attention is taken as {attention}, which floors both budgets at 2 n u of "
                          f"it"),
            "loss": "|L_P - L_1| <= 2 n max(u_loss, K_COND u) |L_1|, n the case's target positions",
            "gradients": "per parameter, every rank: ||g_P - g_1|| <= 2 n K_COND u ||g_1||",
            "diagnosis": "the transformation whose loss and every gradient the CP=P run equals within the budgets "
                         "(u of the loss's dtype for the gradients)",
            "classes": {n: {"class": w[0], "reports": w[2]} for n, w in WORDS.items()}}


def report_dict(config: StepConfig, judged: dict[str, Any], command: str, meta: dict | None = None) -> dict[str, Any]:
    """The step document (schema "ringcheck.step", see `ringcheck.documents`)."""
    cases = [{k: v for k, v in r.items()} for r in judged["cases"]]
    return {**header(STEP_SCHEMA), "verdict": judged["verdict"], "passed": judged["verdict"] == "pass",
            "why": judged["why"], "command": command, "config": {**config.__dict__, "cases": list(config.cases)},
            "mesh": judged["mesh"].to_json(), "reference_mesh": judged["reference_mesh"].to_json(),
            "rule": rule_words(config, judged["loss_dtype"], judged.get("attention_dtype")),
            "convention": judged["convention"],
            "data": judged["data"], "has_logits": judged["has_logits"], "cases": cases,
            "meta": meta or {}}
