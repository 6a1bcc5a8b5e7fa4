"""`ringcheck step --model NAME [--glue GLUE]`: a transformers decoder under CP, judged against
the model's own attention.

`run_model_step` drives one run from one process (the CLI, or every rank of a torchrun world)
on process groups of `ringcheck.launch`:

1. before any rank starts (`check_model_before_start`): the tiny model (`tiny_model`: a
   `ModelRefused` names the layers a glue alone cannot make context-parallel), the glue
   (`load_glue`) and what of the model's attention it cannot carry (`refusals` -> `GlueRefused`,
   naming the layer and the feature);
2. the run under test: every rank of every CP group of the mesh installs the glue and runs
   ringcheck's own correct step around the model (`ringcheck.models.step.model_step_task`);
   the truth on one rank: `native_step`, the same weights with transformers' eager attention at
   CP=1 on whole sequences, packed documents kept apart;
3. per case the verdict: the loss, the logits (the ranks' pieces put back into whole
   sequences) and every parameter's gradient within the budget (`model_budgets`); a failed
   case is diagnosed by semantics (`diagnose`: the lost semantic and the layers); a case that
   could not run is "not run" with the reason;
4. the document (schema "ringcheck.step", with the model and the glue).
"""

from __future__ import annotations

import math
from typing import Any

from ..documents import STEP_SCHEMA, header
from ..harness.settings import torch_threads
from ..launch.audit import check_own_code
from ..models.budgets import gradient_budget, narrow_unit
from ..models.regimes import model_case, regime_reading, shape_words
from ..models.shares import diagnoses_task, merged_truth, placed_shares, reference_shares_task, shares_of, shares_plan
from ..models.step import (
    MODEL_CASES,
    NOT_RUN_AFTER,
    OPTIONAL_CASES,
    ModelStepConfig,
    assemble_logits,
    error_words,
    glue_of,
    model_step_task,
    run_dtype,
    tiny_of,
)
from ..models.step_noise import K_NOISE
from ..step.cases import CASES, Case
from ..step.scales import UNBOUNDED, against_whole, judged_scale, not_judged, scaled, whole_norm
from ..step.verdict import K_COND, budgets, gradient_rows, relative, unit_roundoff

EXIT_OF = {"pass": 0, "fail": 1, "no verdict": 2}


def truth_dtype(config: ModelStepConfig, float32_steps: int = 0) -> str:
    """The dtype the truth is exact to. Its attention is the step's: transformers' eager computes
    its softmax in float32 even in a float64 model, but the truth runs it under
    `native.float64_softmax` (docs/explanation/native-truth.md: the truth then equals a float64
    attention computed from the layers' semantics to about 1e-16). The rest of the model is the
    authors' code: where its forward casts to float32 (`float32_steps` > 0: Llama's RMSNorm,
    Gemma's norms, a MoE router), the model is exact to float32 only."""
    if config.dtype == "float64" and float32_steps:
        return "float32"
    return config.dtype


def model_budgets(n: int, config: ModelStepConfig, truth: str | None = None) -> tuple[float, float]:
    """(loss budget, logits-and-gradients budget), relative, of a case of `n` target positions:
    step's derived budgets (`ringcheck.step.verdict.budgets`: 2 n K_COND u), floored at 2 n u of
    the dtype the truth is exact to (`truth_dtype`), as step floors a ring not known to compute
    float64 throughout; the logits' sums are no longer than the gradients'."""
    return budgets(n, config.dtype, None, truth or config.dtype)


class CheckedModel:
    """What `check_model_before_start` found: the tiny model and the glue (for the report)."""

    def __init__(self, tiny, glue):
        self.tiny, self.glue = tiny, glue


def check_model_before_start(config: ModelStepConfig) -> CheckedModel:
    """The model, the glue and the glue's refusals of the model's features, before any rank
    starts: `ModelRefused` / `GlueRefused` (both ValueError) naming the layers and the feature."""
    # start-up time: the model, the glue and the truth import transformers, only for a --model run
    from ..glues import GlueRefused, refusals

    tiny = tiny_of(config)
    glue = glue_of(config)
    refused = list(refusals(glue, tiny))
    if glue.refuses_ring is not None:  # what the glue cannot run at this ring size (heads not divisible by P)
        refused += [f"{line} (refused by glue {glue.name!r} at P={config.world_size})"
                    for line in glue.refuses_ring(tiny, config.world_size)]
    if refused:
        raise GlueRefused(f"--glue {config.glue} cannot carry what --model {config.model} hands its attention: "
                          + "; ".join(refused))
    multiple = 2 * config.world_size if glue.layout == "zigzag" else config.world_size
    if tiny.seq_len % multiple:
        raise ValueError(f"--model {config.model}: its tiny sequence of {tiny.seq_len} tokens is no multiple of "
                         f"{multiple} ({glue.layout} on {config.world_size} ranks); pass a --world-size that divides "
                         f"it")
    return CheckedModel(tiny, glue)


def _targets(case: Case, rings: int) -> int:
    return case.micro * case.rows * rings * case.seq_len


def _failed_cases(groups: list[list[dict]]) -> dict[str, str]:
    """The cases some rank could not run, with the first rank's reason."""
    out: dict[str, str] = {}
    for group in groups:
        for r in group:
            for name, why in r.get("errors", {}).items():
                out.setdefault(name, why)
    check_own_code(out.values())   # under RINGCHECK_DEVICE_AUDIT: ringcheck's defect, never a case not run
    return out


def judge_model_case(name: str, groups: list[list[dict]], ref: dict, n: int, config: ModelStepConfig,
                     floor: dict | None = None, truth: str | None = None, case: Case | None = None) -> dict:
    """One case: every rank's loss and gradients, and the assembled logits, against the truth;
    `floor`: the measured budgets of a narrowed glue (`ringcheck.models.budgets.narrow_unit`: the
    loss's, the logits' and each parameter's own), where wider than derived; a gradient whose
    budget is no bound is not judged (`ringcheck.models.budgets`); `case`: the case as it ran
    (default step's of that name)."""
    case = case or CASES[name]
    loss_budget, budget = model_budgets(n, config, truth)
    logits_budget = budget
    if floor is not None:
        loss_budget, logits_budget = max(loss_budget, floor["loss"]), max(budget, floor["logits"])
    ranks = [{"where": (g, r["cp_rank"]), "loss": r["cases"][name]["loss"], "grads": r["cases"][name]["grads"]}
             for g, group in enumerate(groups) for r in group]
    logits = assemble_logits(groups, name)
    want = ref["logits"]
    shapes_agree = len(logits) == len(want) and all(a.shape == b.shape for a, b in zip(logits, want))
    logits_err = max((relative(a, b) for a, b in zip(logits, want)), default=0.0) if shapes_agree else math.inf
    loss_err = max(relative(r["loss"], ref["loss"]) for r in ranks)
    if not (math.isfinite(loss_budget) and math.isfinite(logits_budget)):
        return _no_budget(name, case, n, floor)
    grads, floored = _gradient_rows(ranks, ref, n, config, budget, floor, truth, case.evaluate)
    judged = [g for g in grads if g.get("judged", True)]
    out = [g for g in judged if not g["ratio"] <= 1]
    passed = loss_err <= loss_budget and logits_err <= logits_budget and not out
    first = out[0] if out else None
    return {"case": name, "words": case.words, "verdict": "pass" if passed else "fail", "targets": n,
            "loss": {"ring": ranks[0]["loss"], "reference": ref["loss"], "error": loss_err, "budget": loss_budget,
                     "ratio": loss_err / loss_budget},
            "logits": {"error": logits_err, "budget": logits_budget, "ratio": logits_err / logits_budget},
            "gradient_budget": max((g["budget"] for g in judged), default=budget),
            "gradient_budgets": [min((g["budget"] for g in judged), default=budget),
                                 max((g["budget"] for g in judged), default=budget)],
            "worst_gradient": max((g["error"] for g in judged), default=0.0),
            "noise_floored": floored, "not_judged": [{k: g[k] for k in ("name", "budget", "why")}
                                                     for g in grads if not g.get("judged", True)],
            "first_out": None if first is None else {k: first[k] for k in ("name", "error", "ratio", "factor", "rank")},
            "gradients": grads}


def _gradient_rows(ranks: list[dict], ref: dict, n: int, config: ModelStepConfig, budget: float, floor: dict | None,
                   truth: str | None, evaluate: bool) -> tuple[list[dict], list[dict]]:
    """Every parameter's row, against its own budget (`gradient_budget`), and the parameters whose
    budget the truth's own rounding widened."""
    grads, floored = [], []
    wanted = {} if evaluate else ref["grads"]
    whole = whole_norm(wanted)
    for pname, want in wanted.items():
        if want is None:
            continue
        scale, against = judged_scale(want, whole, n, truth or config.dtype)
        own = scaled(ref.get("noise", {}).get(pname, 0.0), scale)  # the truth's own rounding (step_noise)
        if K_NOISE * own > budget:
            floored.append({"name": pname, "noise": own, "budget": K_NOISE * own})
        mine = gradient_budget(pname, budget, own, floor)
        row = gradient_rows(ranks, {pname: want}, mine)[0]
        if against:
            row = against_whole(row, ranks, pname, want, whole)
        if not mine < UNBOUNDED:
            row = not_judged(row, scale, against, mine / K_NOISE)
        grads.append(row)
    return grads, floored


def _no_budget(name: str, case: Case, n: int, floor: dict) -> dict:
    """A narrowed glue's case with no measured budget (no noise run ran): no verdict, said."""
    return {"case": name, "words": case.words, "verdict": "no verdict", "targets": n,
            "why": f"no noise run gave a finite change of the loss and the logits (loss {floor['loss']:.2g}, logits "
                   f"{floor['logits']:.2g}): there is no budget to judge the glue's {case.name} by"}


def not_run(name: str, why: str, case: Case | None = None) -> dict[str, Any]:
    return {"case": name, "words": (case or CASES[name]).words, "verdict": "not run", "why": why}


def run_model_step(config: ModelStepConfig, processes, checked: CheckedModel | None = None,
                   truths: dict | None = None) -> dict[str, Any]:
    """The run under test and the truth on `processes` (`LocalRings` or the `TorchrunWorld`
    whose every rank calls this), judged and, where a case failed, diagnosed by semantics. One
    intra-op thread while it judges, as validate: its tensors are a tiny model's, and a second
    thread only spins against the ranks' processes (a dot product of a gradient took 10-20 ms
    with two threads on a busy 2-core machine, 0.01 ms with one: 2.2 of a zoo row's 7.5 s).
    `truths`: a dict the caller keeps across runs (a zoo's glues on one model); a truth is
    computed once for everything it depends on (`truth_key`), and the next glue judged against it."""
    with torch_threads(1):
        return _run_and_judge(config, processes, checked or check_model_before_start(config), truths)


def truth_key(config: ModelStepConfig, layout: str) -> tuple:
    """What the truth depends on (`reference_task`): the model, the dtype, the seed, the ring's size
    and its replicas, the cases, the layout the noise splits the targets by; not the glue (a glue's
    narrow dtype adds its noise runs on top)."""
    return (config.model, config.dtype, config.seed, config.world_size, config.mesh_spec.rings, tuple(config.cases),
            layout)


CASE_TRUTHS = "by case"  # the key in a caller's `truths` under which each case's own is kept (`case_truth_key`)


def case_truth_key(config: ModelStepConfig, case) -> tuple:
    """What a case's truth, the model's own rounding and a glue's noise runs depend on: the model,
    the dtype, the seed, the replicas and the case as it runs (its batch: a regime case's is made
    for the ring); not the ring's size or layout, which only the split sums depend on."""
    return ("case", config.model, config.dtype, config.seed, config.mesh_spec.rings, case)


def _known_cases(config: ModelStepConfig, shares: tuple, cases: dict, narrow: str | None,
                 truths: dict | None) -> tuple[dict, ...] | None:
    """Per share, what runs of the same cases found (`case_truth_key`; a glue's noise runs: its own)."""
    if truths is None:
        return None
    kept, out = truths.get(CASE_TRUTHS, {}), []
    for share in shares:
        known = {}
        for name in share:
            key = case_truth_key(config, cases[name])
            was = dict(kept.get(key, {}))
            if narrow is not None and (key, narrow, config.glue) in kept:
                was["narrow"] = kept[(key, narrow, config.glue)]
            if was:
                known[name] = was
        out.append(known)
    return tuple(out) if any(out) else None


def _keep_cases(config: ModelStepConfig, ref: dict, cases: dict, narrow: str | None, truths: dict | None) -> None:
    """Each case's truth, own rounding and noise runs kept for another ring size (`_known_cases`),
    in `truths[CASE_TRUTHS]`."""
    if truths is None:
        return
    kept = truths.setdefault(CASE_TRUTHS, {})
    for name, c in ref["cases"].items():
        key = case_truth_key(config, cases[name])
        kept[key] = {**kept.get(key, {}), **{k: c[k] for k in ("loss", "logits", "grads", "own") if k in c}}
        if narrow is not None and "narrow" in c:
            kept[(key, narrow, config.glue)] = c["narrow"]


def _truth(config: ModelStepConfig, processes, first: int, layout: str, narrow: str | None, ring_errors: dict,
           truths: dict | None, kw: dict, cases: dict) -> dict[str, Any]:
    """Every case's truth (`reference_task`, the cases shared among the ranks). With `truths`, the
    one computed for another glue where it depends on nothing that differs (`truth_key`), and for a
    glue run in a narrow dtype only its noise runs computed on top of it; a case's truth, own
    rounding and noise runs found at another ring size are taken, not computed again (`cases`: each
    case as it runs, `case_truth_key`)."""
    names, mesh = config.cases, config.mesh_spec
    key = truth_key(config, layout)
    known = None if truths is None else truths.get(key)
    if known is None and all(name in ring_errors for name in names):
        return {"cases": {}, "errors": {}, "float32_steps": 0}  # every case raised: nothing to judge
    shares = shares_of(names, mesh.size)

    def run(only_narrow: bool) -> dict[str, Any]:
        plan = shares_plan(first, shares, "the truth: transformers' eager attention at CP=1")
        out = merged_truth(processes.run_groups(plan, reference_shares_task, config, shares, mesh.rings, layout, narrow,
                                                only_narrow, _known_cases(config, shares, cases, narrow, truths),
                                                **kw), names)
        _keep_cases(config, out, cases, narrow, truths)
        return out

    if known is None:
        ref = run(False)
        if truths is not None:  # kept without a glue's narrow runs: another glue's are its own
            truths[key] = {**ref, "cases": {n: {k: v for k, v in c.items() if k != "narrow"}
                                            for n, c in ref["cases"].items()}}
        return ref
    if narrow is None:
        return known
    extra = run(True)["cases"]
    return {**known, "cases": {n: {**c, **({"narrow": extra[n]["narrow"]} if n in extra else {})}
                               for n, c in known["cases"].items()}}


def _run_and_judge(config: ModelStepConfig, processes, checked: CheckedModel, truths: dict | None) -> dict[str, Any]:
    mesh = config.mesh_spec
    first = 0 if processes.size is None else processes.size - mesh.size
    names = config.cases
    kw = {} if getattr(processes, "is_torchrun", False) else {"deadline": processes.timeout * (10 + len(names))}
    ring = processes.run_groups(mesh.plan(first, families=True), model_step_task, config, names, **kw)
    narrow = run_dtype(config, checked.glue)
    narrow = None if narrow == config.dtype else narrow
    ring_errors = _failed_cases(ring)
    layout = checked.glue.layout
    cases = {name: model_case(name, checked.tiny, config.world_size, layout) for name in names}
    ref = _truth(config, processes, first, layout, narrow, ring_errors, truths, kw, cases)
    truth = truth_dtype(config, ref.get("float32_steps", 0))
    noise = None if narrow is None or not ref["cases"] else narrow_unit(
        ref["cases"], narrow, {n: _targets(cases[n], mesh.rings) for n in ref["cases"]}, truth)
    rows = []
    for name in names:
        if name in ring_errors:
            why = ring_errors[name]
            row = not_run(name, why if why.startswith(NOT_RUN_AFTER) else
                          f"the run through --glue {config.glue} raised: {why}", cases[name])
        elif name in ref.get("errors", {}):
            row = not_run(name, f"the truth (native_step) raised: {ref['errors'][name]}", cases[name])
        else:
            row = judge_model_case(name, ring, ref["cases"][name], _targets(cases[name], mesh.rings), config,
                                   None if noise is None else noise["floor"], truth, cases[name])
        rows.append({**row, "shape": shape_words(cases[name], checked.tiny, config.world_size, layout)})
    _diagnose(rows, config, processes, first, ring, not (noise is None and truth == config.dtype), kw)
    if any(r.get("spoiled") for group in ring for r in group) and hasattr(processes, "retire"):
        processes.retire(mesh.size)  # a rank's groups are unusable (`_cases_task`): the next run on fresh processes
    regime_reading(rows, checked.tiny)  # a window kept on long shards and lost on short ones, named so
    judged = [r for r in rows if r["verdict"] in ("pass", "fail")]
    verdict = ("no verdict" if not judged else "fail" if any(r["verdict"] == "fail" for r in judged) else "pass")
    attn = ring[0][0].get("attn_implementation")
    return {"verdict": verdict, "cases": rows, "mesh": mesh, "why": _why(rows), "model": model_words(checked.tiny),
            "glue": {"spec": config.glue, "name": checked.glue.name, "layout": checked.glue.layout,
                     "describe": checked.glue.describe if checked.glue.describe_for is None
                     else checked.glue.describe_for(checked.tiny, config.world_size), "attn_implementation": attn,
                     "prepare": checked.glue.prepare is not None, "sharding": checked.glue.sharding,
                     "shims": list(checked.glue.shims)},
            "truth_dtype": truth, "float32_steps": ref.get("float32_steps", 0), "noise": noise}


def _diagnose(rows: list[dict], config: ModelStepConfig, processes, first: int, ring: list[list[dict]],
              within_budget: bool, kw: dict) -> None:
    """A diagnosis by semantics for every failed row, the failed cases shared among the ranks.
    `within_budget`: match within the logits budget the verdict grants (a glue run in bfloat16
    sits its noise away from every candidate, and a model with float32 steps of its own, llama4's,
    sits a correct glue's float32 noise away from the truth; the gradients' budget may be wide
    enough to hold the truth itself); else within the diagnosis's own float64 tolerance."""
    failed = [row for row in rows if row["verdict"] == "fail"]
    if not failed:
        return
    jobs = [(row["case"], assemble_logits(ring, row["case"]), ring[0][0]["cases"][row["case"]]["grads"],
             row["logits"]["budget"] if within_budget else None) for row in failed]
    held, shares = placed_shares(jobs, [config.cases.index(row["case"]) for row in failed], config.mesh_spec.size)
    try:
        found = {}
        for group in processes.run_groups(shares_plan(first, shares, "diagnosis by semantics", held), diagnoses_task,
                                          config, shares, config.mesh_spec.rings, **kw):
            found.update(group[0])
    except Exception as exc:  # the verdicts stand; the report says the diagnosis could not be made
        found = {row["case"]: {"matched": False, "words": f"the diagnosis could not run: {error_words(exc)}"}
                 for row in failed}
    for row in failed:
        row["diagnosis"] = found.get(row["case"], {"matched": False, "words": "no diagnosis"})


def model_words(tiny) -> dict[str, Any]:
    """The tiny model for the report: what was scaled, kept and switched off, and its layers'
    attention (the features a glue must carry)."""
    def plain(v):
        return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
    layers = []
    for layer in tiny.layers:
        features = [layer.kind] + ([f"window {layer.window}"] if layer.window else []) + (
            [f"chunk {layer.chunk}"] if layer.chunk else []) + (["sinks"] if layer.sinks else []) + (
            [f"softcap {layer.softcap:g}"] if layer.softcap else []) + [f"scaling {layer.scaling:.4g}"]
        if layer.v_head_dim != layer.head_dim:
            features.append(f"v_head_dim {layer.v_head_dim}")
        layers.append({"index": layer.index, "features": features, "heads": layer.heads, "kv_heads": layer.kv_heads,
                       "head_dim": layer.head_dim})
    return {"name": tiny.name, "moe": tiny.moe, "vocab_size": tiny.vocab_size, "seq_len": tiny.seq_len,
            "scaled": {k: [plain(a), plain(b)] for k, (a, b) in tiny.scaled.items()},
            "kept": {k: plain(v) for k, v in tiny.kept.items()},
            "disabled": {k: plain(v) for k, v in tiny.disabled.items()}, "layers": layers}


def _why(rows: list[dict]) -> str:
    bad = [r for r in rows if r["verdict"] == "fail"]
    skipped = [r for r in rows if r["verdict"] in ("not run", "no verdict")]
    judged = [r for r in rows if r["verdict"] == "pass"]
    tail = f"; not run: {', '.join(r['case'] for r in skipped)}" if skipped else ""
    unjudged = {g["name"]: g["why"] for r in rows for g in r.get("not_judged", [])}
    if unjudged:
        name = next(iter(unjudged))
        tail += (f"; {len(unjudged)} parameter(s)' gradients not judged, their measured noise no bound (e.g. "
                 f"{name}: {unjudged[name]})")
    if not bad and not judged:
        reasons = list(dict.fromkeys(r["why"] for r in skipped))
        if len(reasons) == 1:  # one cause, said once (a model the glue cannot build raises in every case)
            return f"no case could be judged: every case ({len(skipped)}): {reasons[0]}"
        return "no case could be judged: " + "; ".join(f"{r['case']}: {r['why']}" for r in skipped)
    if not bad:
        worst = max(max(r["loss"]["ratio"], r["logits"]["ratio"], max((g["ratio"] for g in r["gradients"]
                                                                       if g.get("judged", True)), default=0))
                    for r in judged)
        return (f"every judged case's loss, logits and gradients at CP=P equal the model's own attention at CP=1 "
                f"within the budget (worst {worst:.2g} of it){tail}")
    parts = []
    for r in bad:
        d = r.get("diagnosis") or {}
        what = d.get("words") if d.get("matched") else "no lost semantic matched" + (
            f" ({d['words']})" if d.get("words") else "")
        first = r.get("first_out")
        grad = "" if first is None else (f", gradient of {first['name']} {first['error']:.2g} off (budget "
                                         f"{first['error'] / first['ratio']:.2g}, x{first['factor']:.4g})")
        parts.append(f"{r['case']}: logits {r['logits']['error']:.2g} off (budget {r['logits']['budget']:.2g}), "
                     f"loss {r['loss']['error']:.2g}{grad}; {what}")
    return "; ".join(parts) + tail


def model_rule_words(config: ModelStepConfig, truth: str, float32_steps: int = 0) -> dict[str, Any]:
    return {"float32_steps": float32_steps,
            "precision": (f"the model's forward casts float64 to float32 {float32_steps} times (its norms' or router's "
                          f"own code): it is exact to float32 there, and the budgets take float32's unit roundoff"
                          if float32_steps and truth == "float32" else f"the model computes in {truth} throughout"),"k_cond": K_COND, "unit_roundoff": unit_roundoff(config.dtype), "truth_dtype": truth,
            "truth": "the same weights with transformers' eager attention at CP=1 on whole sequences, packed documents "
                     "kept apart (ringcheck.models.native.native_step)",
            "loss": "|L_P - L_1| <= 2 n max(K_COND u, u_truth) |L_1|, n the case's target positions",
            "logits": "||z_P - z_1|| <= 2 n max(K_COND u, u_truth) ||z_1||, every micro-batch",
            "gradients": "per parameter, every rank: ||g_P - g_1|| <= max(2 n max(K_COND u, u_truth), K_NOISE x noise, "
                         "K_NOISE x narrow) ||g_1||, noise the parameter's relative change when the truth's loss is "
                         "summed over the ranks' targets part by part (the model's own float32 steps, e.g. Gemma's "
                         "norms), narrow its own largest relative change over a narrowed glue's noise runs; ||g_1|| "
                         "the whole gradient's norm where the parameter's cancels to rounding (n u_truth ||g||: a key "
                         "bias); a budget of 1 or more admits a gradient of zeros: that parameter is not judged",
            "k_noise": K_NOISE}


def model_report_dict(config: ModelStepConfig, judged: dict[str, Any], command: str,
                      meta: dict | None = None) -> dict[str, Any]:
    """The document (schema "ringcheck.step", with `model` and `glue`)."""
    return {**header(STEP_SCHEMA), "verdict": judged["verdict"], "passed": judged["verdict"] == "pass",
            "why": judged["why"], "command": command,
            "config": {**config.__dict__, "cases": list(config.cases)}, "mesh": judged["mesh"].to_json(),
            "model": judged["model"], "glue": judged["glue"], "noise": judged.get("noise"),
            "rule": model_rule_words(config, judged["truth_dtype"], judged.get("float32_steps", 0)), "cases": judged["cases"], "meta": meta or {}}


def default_model_cases(text: str | None) -> tuple[str, ...]:
    """`--cases` for a model (default `MODEL_CASES`)."""
    if text is None:
        return MODEL_CASES
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    known = (*MODEL_CASES, *OPTIONAL_CASES)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--cases {text!r}: unknown case(s) {bad} for --model; choose from {', '.join(known)}")
    return names
