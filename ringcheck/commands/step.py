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

import itertools
import math
from typing import Any

from ..adapters import accepted_keywords
from ..documents import STEP_SCHEMA, header
from ..harness.runner import loaded
from ..harness.settings import torch_threads
from ..launch import GroupPlan, RingError
from ..launch.audit import check_own_code
from ..spec import REFERENCE_DTYPES
from ..step.cases import CASES, DOCUMENTS, SEQ_LEN, case_names, fix_of
from ..step.contract import load_recipe, vocab_of
from ..step.diagnosis import CONVENTIONS, TRANSFORMS, WORDS, convention, match
from ..step.noise import NOISE_RUNS, narrowed_words, noise_cases, noise_unit
from ..step.run import StepConfig, build_model, cannot_run, diagnosis_task, ring_positions, step_task
from ..step.verdict import K_COND, budgets, data_row, judge_case, loss_rounding, relative, unit_roundoff
from .validate.target import Target

EXIT_OF = {"pass": 0, "fail": 1, "no verdict": 2}
# rings known to compute float64 inputs in float64 throughout (ours on its torch backends)
EXACT_FLOAT64 = {("ringcheck", "torch"), ("ringcheck", "torch_plain")}


def attention_dtype(config: StepConfig) -> str | None:
    """The dtype the ring under test is taken to compute in: the step's for `EXACT_FLOAT64`,
    float32 for every other ring in a float64 step."""
    exact = (config.impl, config.backend) in EXACT_FLOAT64 or config.dtype != "float64"
    return None if exact or config.narrow is not None else "float32"


def takes_documents(impl) -> bool:
    return bool(accepted_keywords(impl.fn, ("cu_seqlens",)))


def ring_dtype(config: StepConfig) -> str:
    """The dtype the ring under test is called in: --attention-dtype, else the step's."""
    return config.attention_dtype or config.dtype


def narrowed_for(impl, dtype: str) -> str | None:
    """The dtype to call `impl` in when it cannot run the step's `dtype` (the first it runs:
    bfloat16 for flash-attn's rings), None when it can."""
    return None if impl.dtypes is None or dtype in impl.dtypes else impl.dtypes[0]


def documents_refused(config: StepConfig, impl) -> str | None:
    """Why the ring cannot run the packed case (its documents) in this layout, or None."""
    if not takes_documents(impl):
        return f"--impl {impl.name} takes no cu_seqlens, so it cannot attend within packed documents"
    if impl.check_target is None:
        return None
    try:
        impl.check_target(Target(seq_len=SEQ_LEN, head_dim=8, dtype=ring_dtype(config), layout=config.layout,
                                 world_size=config.world_size, impl=config.impl,
                                 documents=",".join(str(b - a) for a, b in itertools.pairwise(DOCUMENTS))))
    except ValueError as exc:
        return str(exc)
    return None


def default_cases(recipe, impl, config: StepConfig | None = None) -> tuple[str, ...]:
    """Every case the recipe offers and the ring can run (packed documents need cu_seqlens, and
    a ring's own rules for them in `config`'s layout)."""
    names = case_names(None, recipe.checkpointing, recipe.evaluate is not None)
    packed = takes_documents(impl) if config is None else documents_refused(config, impl) is None
    return tuple(n for n in names if packed or not CASES[n].packed)


def check_before_start(config: StepConfig) -> None:
    """The recipe's hooks and the implementation's rules, before any rank starts (ValueError /
    TypeError naming the value and the fix)."""
    recipe = load_recipe(config.recipe)
    if recipe.vocab_size is None:  # read from the model's embeddings: one it cannot be read from is named now
        vocab_of(recipe, build_model(recipe, REFERENCE_DTYPES[config.dtype], config.seed))
    impl = loaded(config.impl_options)
    impl.check_layout(config.layout, True)
    if impl.dtypes is not None and ring_dtype(config) not in impl.dtypes:
        raise ValueError(f"--impl {impl.name} runs the dtypes {list(impl.dtypes)}, not {ring_dtype(config)}; pass "
                         f"--attention-dtype {impl.dtypes[0]} (the step stays in {config.dtype}, the ring's q, k, v "
                         f"are cast to it and its out back, and the budget is measured from noise runs)")
    for name in config.cases:
        refused = documents_refused(config, impl) if CASES[name].packed else None
        if refused:
            raise ValueError(f"--cases {name}: {refused}; drop the case")
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


def run_cases(processes, plan_of, first: int, config: StepConfig, names: tuple[str, ...], pos0, role: str, kw: dict,
              not_run: dict[str, str]) -> list[list[dict]] | None:
    """`step_task` of the run `role` on the rings of `plan_of(first)` for the cases `names` but
    those in `not_run`: a case the recipe's step raises in (`cannot_run`) is added to `not_run`
    (case -> why) and the others run again on fresh groups, so it takes no other case's verdict
    with it; None when no case is left. Any other failure (the contract, a hang) is raised."""
    left = tuple(n for n in names if n not in not_run)
    while left:
        try:
            return processes.run_groups(plan_of(first, families=True), step_task, config, left, pos0, role, **kw)
        except RingError as exc:
            found = cannot_run(exc.failures)
            check_own_code(exc.failures.values())   # under the device audit: ringcheck's defect, no verdict
            if found is None or found[0] not in left:
                raise
            not_run[found[0]] = found[1] + ("" if role == "ring" else f" (in the {role} run)")
            left = tuple(n for n in left if n != found[0])
    return None


def not_run_row(name: str, n: int, why: str) -> dict[str, Any]:
    """The row of a case the step could not run: why, and what makes it run (no figures)."""
    return {"case": name, "verdict": "not run", "targets": n, "why": why, "fix": fix_of(name), "loss": None,
            "gradient_budget": None, "worst_gradient": None, "first_out": None, "gradients": []}


def run_step(config: StepConfig, processes) -> dict[str, Any]:
    """The CP=P run and the reference on `processes` (`LocalRings` or the `TorchrunWorld` whose
    every rank calls this in step), judged and, where a case failed, diagnosed; with one intra-op
    thread, as validate and step --model (`step_model.run_model_step`)."""
    with torch_threads(1):
        return _run_and_judge(config, processes)


def _run_and_judge(config: StepConfig, processes) -> dict[str, Any]:
    recipe = load_recipe(config.recipe)
    mesh, ref_mesh = config.mesh_spec, config.reference_mesh
    world_only = loaded(config.impl_options).world_only
    if world_only is not None and (mesh.rings > 1 or processes.size not in (None, mesh.size)):
        raise ValueError(f"--impl {config.impl}: {world_only}, so its ring must be the whole world: drop --mesh and "
                         f"pass --world-size {processes.size or mesh.cp}")
    first = 0 if processes.size is None else processes.size - mesh.size
    pos0 = ring_positions(config)
    names = config.cases
    kw = {} if getattr(processes, "is_torchrun", False) else {"deadline": processes.timeout * (10 + len(names))}
    not_run: dict[str, str] = {}  # case -> why the step could not run it
    ring = run_cases(processes, mesh.plan, first, config, names, pos0, "ring", kw, not_run)
    pool = names if config.narrow is None else noise_cases(names)
    ref = run_cases(processes, ref_mesh.plan, first, config, pool, pos0, "reference", kw, not_run)
    noise, exact = None, {}
    if config.narrow is not None and ref is not None:  # the noise runs: the step at CP=1, other legitimate attentions
        runs = {role: run_cases(processes, ref_mesh.plan, first, config, pool, pos0, role, kw, not_run)
                for role in NOISE_RUNS}
        pool = tuple(n for n in pool if n not in not_run)
        runs = {role: r[0][0]["cases"] for role, r in runs.items() if r}
        noise = noise_unit(ref[0][0]["cases"], runs, pool, {n: _targets(n, mesh.rings) for n in pool}, config.dtype)
        exact = {n: c["grads"] for n, c in runs.get("unrounded", {}).items()}  # the step unrounded: a truth cancels
    floor = None if noise is None else (noise["k"] * noise["loss"], noise["floors"])
    loss_dtype, loss_found = loss_rounding(recipe.loss_dtype, config.dtype, _facts(ref).get("transformers"),
                                           [c["loss"] for c in (ref[0][0]["cases"].values() if ref else ())])
    rows = []
    for name in names:
        n = _targets(name, mesh.rings)
        if name in not_run:
            rows.append(not_run_row(name, n, not_run[name]))
            continue
        rows.append(judge_case(name, _ranks(ring, name), ref[0][0]["cases"][name], n, config.dtype,
                               loss_dtype, CASES[name].evaluate, attention_dtype(config), floor, exact.get(name)))
    names = tuple(n for n in names if n not in not_run)  # the cases judged
    failed = [r["case"] for r in rows if r["verdict"] == "fail"]
    conv_case = "two_micro_batches" if "two_micro_batches" in names else (names or (None,))[0]
    requests = [(c, config.world_size, TRANSFORMS) for c in failed] + [(conv_case, 1, CONVENTIONS)] * bool(names)
    model_logits = recipe.logits is None and _facts(ref).get("transformers") is not None
    cands, unable = {}, None
    if (recipe.logits is not None or model_logits) and requests:
        try:
            cands = processes.run_groups(GroupPlan(((first,),), label="diagnosis"), diagnosis_task, config,
                                         tuple(requests), pos0, **kw)[0][0]
        except RingError as exc:  # the verdicts stand; only the naming is lost, and the report says why
            said = next(iter(exc.failures.values()), str(exc))
            unable = (f"the diagnosis could not recompute the step on whole sequences ({str(said).splitlines()[0]}): "
                      f"only the gradient-scale candidates were tried")
    attn = attention_dtype(config)
    _diagnose(rows, ring, ref, cands, config, loss_dtype, attn, floor)
    conv = None
    if f"{conv_case}@1" in cands:
        conv_budget = budgets(_targets(conv_case, mesh.rings), config.dtype, loss_dtype, attn)[0]
        conv_budget = conv_budget if floor is None else max(conv_budget, floor[0])
        conv = convention(ref[0][0]["cases"][conv_case], cands[f"{conv_case}@1"], loss_budget=conv_budget,
                          relative=relative)
        conv["case"] = conv_case
    own = (f"the recipe has no logits hook: the diagnosis and the convention call the transformers model "
           f"({_facts(ref)['transformers']}) itself on whole sequences, model(input_ids, position_ids, "
           f"use_cache=False).logits") if model_logits else None
    found = [line for line in (_facts(ref).get("vocab"), loss_found, own, unable) if line]
    data = None if ring is None else data_row(ring)
    judged = [r for r in rows if r["verdict"] != "not run"]
    verdict = "fail" if failed or (data is not None and data["verdict"] == "fail") else (
        "no verdict" if not judged or any(r["verdict"] == "no verdict" for r in judged) else "pass")
    return {"verdict": verdict, "cases": rows, "convention": conv, "data": data, "mesh": mesh,
            "reference_mesh": ref_mesh, "loss_dtype": loss_dtype or config.dtype, "attention_dtype": attn,
            "has_logits": recipe.logits is not None or model_logits, "noise": noise, "found": found,
            "why": _why(rows, data)}


def _diagnose(rows: list[dict], ring, ref, cands: dict, config: StepConfig, loss_dtype, attn, floor) -> None:
    """Each failed row's candidate transformations (`match`) against the diagnosis run's
    recomputations `cands`, and its diagnosis where the first candidate matches, set in place."""
    diag_u = max(unit_roundoff(loss_dtype or config.dtype), unit_roundoff(attn or config.dtype))
    for row in rows:
        if row["verdict"] != "fail":
            continue
        n = row["targets"]
        loss_budget, grad_budget = budgets(n, config.dtype, loss_dtype, attn)[0], 2 * n * K_COND * diag_u
        if floor is not None:
            loss_budget = max(loss_budget, floor[0])
        per = {g["name"]: (max(grad_budget, floor[1].get(g["name"], math.inf) if floor else 0.0),
                           g["scale"] if g.get("against") else None) for g in row["gradients"] if g.get("judged", True)}
        found = match(_ranks(ring, row["case"]), ref[0][0]["cases"][row["case"]],
                      cands.get(f"{row['case']}@{config.world_size}", {}), P=config.world_size,
                      loss_budget=loss_budget, grad_budget=grad_budget,
                      evaluate=CASES[row["case"]].evaluate, relative=relative, per=per)
        row["candidates"] = found
        row["diagnosis"] = found[0] if found and found[0]["matches"] else None


def _facts(ref: list[list[dict]] | None) -> dict[str, Any]:
    """What the reference run found out about the recipe instead of asking it (`run_case`'s
    `found`: the vocabulary read from the model, a transformers model's class); {} without one."""
    if not ref or not ref[0][0]["cases"]:
        return {}
    return next(iter(ref[0][0]["cases"].values()))["found"]


def _why(rows, data=None) -> str:
    skipped = [r for r in rows if r["verdict"] == "not run"]
    rows = [r for r in rows if r["verdict"] != "not run"]
    tail = "" if not skipped else (f"; not run: {', '.join(r['case'] for r in skipped)} (the step raised in "
                                   f"{'them' if len(skipped) > 1 else 'it'}: why and the fix above)")
    unjudged = {g["name"]: g["why"] for r in rows for g in r.get("not_judged", [])}
    if unjudged:
        name = next(iter(unjudged))
        tail += (f"; {len(unjudged)} parameter(s)' gradients not judged, their measured noise no bound (e.g. {name}: "
                 f"{unjudged[name]})")
    if not rows:
        lost = f"data: {data['words']}; " if data is not None and data["verdict"] == "fail" else ""
        return lost + "no case was judged" + tail
    return _judged_why(rows, data) + tail


def _judged_why(rows, data=None) -> str:
    bad = [r for r in rows if r["verdict"] == "fail"]
    if data is not None and data["verdict"] == "fail":
        return f"data: {data['words']}" + ("; " + _judged_why(rows) if bad else "")
    blind = [r["case"] for r in rows if r["verdict"] == "no verdict"]
    if blind and not bad:
        return f"no verdict in {', '.join(blind)}: " + next(r["why"] for r in rows if r["verdict"] == "no verdict")
    if not bad:
        worst = max(max(r["loss"]["ratio"], max((g["ratio"] for g in r["gradients"] if g.get("judged", True)),
                                                default=0)) for r in rows)
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


def rule_words(config: StepConfig, loss_dtype: str, attention: str | None = None,
               noise: dict[str, Any] | None = None) -> dict[str, Any]:
    words = ""
    if noise is not None:
        words = narrowed_words(config.impl, config.dtype, ring_dtype(config), noise)
    elif attention is not None:
        words = (f"--impl {config.impl} is not known to compute {config.dtype} throughout: its attention is taken as "
                 f"{attention}, which floors both budgets at 2 n u of it")
    return {"k_cond": K_COND, "unit_roundoff": unit_roundoff(config.dtype), "loss_dtype": loss_dtype,
            "attention_dtype": attention or ring_dtype(config), "attention": words,
            "narrowed": noise is not None,
            "loss": "|L_P - L_1| <= 2 n max(u_loss, K_COND u) |L_1|, n the case's target positions",
            "gradients": "per parameter, every rank: ||g_P - g_1|| <= max(2 n K_COND u, K_NOISE x noise) ||g_1||, "
                         "noise (a narrowed ring's) the parameter's own largest change over the noise runs; ||g_1|| "
                         "the whole gradient's norm where the parameter's cancels to rounding (n u ||g||: a key "
                         "bias); a budget of 1 or more admits a gradient of zeros: that parameter is not judged",
            "diagnosis": "the transformation whose loss and every gradient the CP=P run equals within the budgets "
                         "(u of the loss's dtype for the gradients)",
            "classes": {n: {"class": w[0], "reports": w[2]} for n, w in WORDS.items()}}


def report_dict(config: StepConfig, judged: dict[str, Any], command: str, meta: dict | None = None) -> dict[str, Any]:
    """The step document (schema "ringcheck.step", see `ringcheck.documents`)."""
    cases = [{k: v for k, v in r.items()} for r in judged["cases"]]
    return {**header(STEP_SCHEMA), "verdict": judged["verdict"], "passed": judged["verdict"] == "pass",
            "why": judged["why"], "command": command, "config": {**config.__dict__, "cases": list(config.cases)},
            "mesh": judged["mesh"].to_json(), "reference_mesh": judged["reference_mesh"].to_json(),
            "rule": rule_words(config, judged["loss_dtype"], judged.get("attention_dtype"), judged.get("noise")),
            "noise": judged.get("noise"), "convention": judged["convention"],
            "data": judged["data"], "has_logits": judged["has_logits"], "found": judged.get("found", []),
            "cases": cases,
            "meta": meta or {}}
