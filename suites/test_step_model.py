"""`ringcheck step --model`: a tiny transformers model through a glue at CP=P against the model's own
eager attention at CP=1 (issue 42).

A correct glue (ringcheck's) passes on a model of full layers and on one of sliding layers, its
logits and gradients within the float64 budget; glues that lose one semantic each fail, their
diagnosis naming it; a model whose layers an attention glue cannot make context-parallel, and a
glue that refuses a layer's feature, are refused before any rank starts (exit 2). Every run here
is P=2 on the cases that matter for the glue (one sequence, packed documents), to stay fast.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ringcheck.commands.step_model import CASE_TRUTHS, check_model_before_start, model_report_dict, run_model_step
from ringcheck.glues import GlueRefused
from ringcheck.models.step import ModelStepConfig
from ringcheck.models.tiny import ModelRefused
from ringcheck.render.model_report import model_markdown

ROOT = Path(__file__).resolve().parents[1]
CASES = ("one_sequence", "packed")


def _run(ring_processes, model: str, glue: str = "ringcheck", **kw) -> dict:
    return run_model_step(ModelStepConfig(model=model, glue=glue, world_size=2, cases=CASES, **kw), ring_processes)


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_a_correct_glue_passes_against_the_models_own_attention(ring_processes, model):
    judged = _run(ring_processes, model)
    assert judged["verdict"] == "pass", judged["why"]
    for row in judged["cases"]:
        # the budget of the dtype the model is exact to: its attention float64, its norms' casts float32
        assert row["logits"]["error"] <= row["logits"]["budget"] <= 1e-5, row
        assert row["gradients"] and all(g["ratio"] <= 1 for g in row["gradients"])
    if model == "mistral":  # the sliding window is what a glue must carry here, and the report says it is kept
        assert any("window" in " ".join(layer["features"]) for layer in judged["model"]["layers"])


class _Spy:
    """The ring's processes, recording which tasks were run on them."""

    def __init__(self, processes):
        self.processes, self.tasks, self.args = processes, [], []

    def __getattr__(self, name):
        return getattr(self.processes, name)

    def run_groups(self, plan, task, *args, **kw):
        self.tasks.append(task.__name__)
        self.args.append(args)
        return self.processes.run_groups(plan, task, *args, **kw)


def _truths_by_run(truths: dict) -> dict:
    """A caller's `truths` without the cases' own (`CASE_TRUTHS`): one entry per truth computed."""
    return {k: v for k, v in truths.items() if k != CASE_TRUTHS}


def test_glues_that_share_a_truth_are_judged_against_one_computed_once(ring_processes):
    """A zoo's glues on one model (`truths` kept across runs): the truth is computed for the first,
    the second is judged against it, and a bug in the second is still caught and named."""
    truths: dict = {}
    first = run_model_step(ModelStepConfig(model="llama", world_size=2, cases=("packed",)), ring_processes, truths=truths)
    assert first["verdict"] == "pass" and len(_truths_by_run(truths)) == 1, first["why"]
    spy = _Spy(ring_processes)
    second = run_model_step(ModelStepConfig(model="llama", glue="ringcheck.catalogue.glue_mutants:documents_crossed",
                                            world_size=2, cases=("packed",)), spy, truths=truths)
    assert len(_truths_by_run(truths)) == 1 and "reference_shares_task" not in spy.tasks and "model_step_task" in spy.tasks
    assert second["verdict"] == "fail" and "documents" in second["why"], second["why"]
    alone = run_model_step(ModelStepConfig(model="llama", glue="ringcheck.catalogue.glue_mutants:documents_crossed",
                                           world_size=2, cases=("packed",)), ring_processes)
    assert alone["cases"][0]["logits"] == second["cases"][0]["logits"]  # the same judgement as with its own truth


def test_a_glue_run_narrower_adds_only_its_noise_runs_to_a_shared_truth(ring_processes):
    """ring-flash-attn's glue runs in bfloat16: on a truth shared from ringcheck's float64 glue, only
    its noise runs are computed (the truth task once more, the rest kept), and its verdict, its
    measured noise and its budgets are the ones it gets alone."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed (the extra `peers`)")
    truths: dict = {}
    config = ModelStepConfig(model="llama", world_size=2, cases=("one_sequence",))
    run_model_step(config, ring_processes, truths=truths)
    spy = _Spy(ring_processes)
    narrow = ModelStepConfig(model="llama", glue="ring_flash_attn", world_size=2, cases=("one_sequence",))
    shared = run_model_step(narrow, spy, truths=truths)
    assert spy.tasks.count("reference_shares_task") == 1 and len(_truths_by_run(truths)) == 1
    assert all("narrow" not in case for case in next(iter(_truths_by_run(truths).values()))["cases"].values())
    alone = run_model_step(narrow, ring_processes)
    assert shared["verdict"] == alone["verdict"] == "pass", shared["why"]
    assert shared["noise"] == alone["noise"] and shared["noise"] is not None
    assert shared["cases"][0]["logits"] == alone["cases"][0]["logits"]
    assert shared["cases"][0]["gradients"] == alone["cases"][0]["gradients"]


def test_a_cases_truth_found_on_another_ring_is_taken_and_only_the_split_sums_run_again(ring_processes):
    """A case's truth, and the model's own rounding (llama's norms cast to float32), depend on its
    batch, not on the ring: a run in another layout (or size) takes them from `truths` (each case's,
    `CASE_TRUTHS`), and its verdict and every figure are the ones it gets alone."""
    truths: dict = {}
    run_model_step(ModelStepConfig(model="llama", world_size=2, cases=("packed",)), ring_processes, truths=truths)
    spy = _Spy(ring_processes)
    zigzag = ModelStepConfig(model="llama", world_size=2, layout="zigzag", cases=("packed",))
    shared = run_model_step(zigzag, spy, truths=truths)
    known = [a[-1] for t, a in zip(spy.tasks, spy.args) if t == "reference_shares_task"]
    assert len(known) == 1 and known[0] is not None and {"loss", "logits", "grads", "own"} <= set(known[0][0]["packed"])
    alone = run_model_step(zigzag, ring_processes)
    assert shared["verdict"] == alone["verdict"] == "pass", shared["why"]
    assert shared["float32_steps"] == alone["float32_steps"] > 0
    assert shared["cases"][0]["logits"] == alone["cases"][0]["logits"]
    assert shared["cases"][0]["gradients"] == alone["cases"][0]["gradients"]
    assert shared["cases"][0]["noise_floored"] == alone["cases"][0]["noise_floored"]


def test_the_report_says_what_was_scaled_kept_and_switched_off(ring_processes):
    judged = _run(ring_processes, "llama", layout="zigzag")
    doc = model_report_dict(ModelStepConfig(model="llama", world_size=2, cases=CASES), judged, "ringcheck step")
    assert doc["model"]["scaled"] and doc["model"]["kept"] and doc["glue"]["layout"] == "zigzag"
    text = model_markdown(doc)
    assert "scaled:" in text and "kept:" in text and "switched off:" in text and "PASSED" in text


def test_a_model_an_attention_glue_cannot_make_context_parallel_is_refused_before_any_rank():
    with pytest.raises(ModelRefused, match="linear_attention"):
        check_model_before_start(ModelStepConfig(model="qwen3_next", world_size=2))


def test_a_glue_that_cannot_carry_a_layers_feature_is_refused_naming_the_layer(monkeypatch):
    from ringcheck.glues import load_glue

    glue = load_glue("ringcheck")

    def refuses(layer):
        return ["sliding window (test: a glue that says it cannot carry it)"] if layer.window else []
    monkeypatch.setattr("ringcheck.commands.step_model.glue_of", lambda config: type(glue)(
        **{**glue.__dict__, "refuses": refuses}))
    with pytest.raises(GlueRefused, match=r"layer 0: sliding window"):
        check_model_before_start(ModelStepConfig(model="mistral", world_size=2))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringcheck", "step", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.cli
def test_the_command_end_to_end_writes_its_report(tmp_path):
    out = _cli("--model", "llama", "--world-size", "2", "--cases", "one_sequence", "--report", str(tmp_path), "-q",
               cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["verdict"] == "pass" and doc["model"]["name"] == "llama" and doc["glue"]["spec"] == "ringcheck"
    assert "PASSED" in (tmp_path / "step.md").read_text()


@pytest.mark.cli
def test_the_command_refuses_a_model_with_exit_2_naming_the_layers(tmp_path):
    out = _cli("--model", "qwen3_next", "--world-size", "2", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "linear_attention" in out.stderr and "layers 0,1,2" in out.stderr
    out = _cli("--model", "llama", "--impl", "ring_flash_attn:zigzag", cwd=tmp_path)
    assert out.returncode == 2 and "--impl" in out.stderr, out.stderr


@pytest.mark.parametrize("model, mutant, case", [("mistral", "window_dropped", "one_sequence"),
                                                 ("llama", "documents_crossed", "packed")])
def test_a_glue_that_loses_a_semantic_fails_and_the_diagnosis_names_it(ring_processes, model, mutant, case):
    """The catalogue's mutant glues (ringcheck's glue with one semantic lost) on a model that has
    the feature: the logits leave the float64 budget by orders of magnitude, and the diagnosis by
    semantics names the loss and the layers it was lost on."""
    judged = run_model_step(ModelStepConfig(model=model, glue=f"ringcheck.catalogue.glue_mutants:{mutant}",
                                            world_size=2, cases=(case,)), ring_processes)
    (row,) = judged["cases"]
    assert judged["verdict"] == "fail" and row["verdict"] == "fail", judged["why"]
    assert row["logits"]["error"] > 1e4 * row["logits"]["budget"], row["logits"]
    assert row["diagnosis"]["matched"] and row["diagnosis"]["loss"] == mutant, row["diagnosis"]
    assert row["diagnosis"]["layers"], row["diagnosis"]


def _one_rank_case(grads: dict, logits: torch.Tensor) -> list[list[dict]]:
    piece = {"logits": logits, "length": logits.shape[1], "positions": torch.arange(logits.shape[1])}
    return [[{"cp_rank": 0, "dp_rank": 0,
              "cases": {"one_sequence": {"loss": 1.0, "grads": grads, "logits": [piece]}}}]]


@pytest.mark.parametrize("residue, verdict", [(3e-17, "pass"), (1e-9, "fail")])
def test_a_gradient_that_cancels_to_rounding_is_judged_as_part_of_the_whole(residue, verdict):
    """A key bias's true gradient is analytically zero (softmax is shift invariant): truth and glue
    both hold rounding residue, which a relative error compares with itself (roberta's key.bias read
    2.6 on a correct glue). Judged as a part of the whole gradient vector, residue passes, while an
    error far above rounding, on that same parameter, still fails."""
    from ringcheck.commands.step_model import judge_model_case

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    bias_truth = torch.full((8,), 1e-17, dtype=torch.float64)
    logits = torch.randn(1, 4, 5, generator=gen, dtype=torch.float64)
    ref = {"loss": 1.0, "logits": [logits], "grads": {"w": weight, "key.bias": bias_truth}}
    got = {"w": weight.clone(), "key.bias": bias_truth + residue * torch.randn(8, generator=gen, dtype=torch.float64)}
    config = ModelStepConfig(model="llama", world_size=2)
    judged = judge_model_case("one_sequence", _one_rank_case(got, logits), ref, 64, config, truth="float64")
    assert judged["verdict"] == verdict
    row = next(g for g in judged["gradients"] if g["name"] == "key.bias")
    assert row["against"].startswith("whole gradient")
    assert (row["ratio"] <= 1) == (verdict == "pass")


def _narrowed_case(glue_grads: dict, noise_diffs: dict, truth_grads: dict) -> dict:
    """`judge_model_case` on one rank of a narrowed glue, its budgets measured from one noise run
    (`noise_diffs`: ||g_noise - g_truth|| per parameter) by `narrow_unit`."""
    from ringcheck.commands.step_model import judge_model_case
    from ringcheck.models.budgets import narrow_unit

    logits = torch.ones(1, 4, 5, dtype=torch.float64)
    ref = {"loss": 1.0, "logits": [logits], "grads": truth_grads}
    noise = narrow_unit({"one_sequence": {**ref, "narrow": {"rows": [
        {"run": "eager", "loss": 1e-3, "logits": 1e-2, "diffs": noise_diffs}], "skipped": {}}}},
        "bfloat16", {"one_sequence": 64}, "float64")
    config = ModelStepConfig(model="llama", world_size=2)
    return judge_model_case("one_sequence", _one_rank_case(glue_grads, logits), ref, 64, config, noise["floor"],
                            "float64"), noise


def test_a_narrowed_glue_judges_each_gradient_against_its_own_noise():
    """One budget for every parameter, the largest relative change of any over the noise runs,
    made every budget the widest one's: a key bias's truth is ~1e-17 (analytically zero), its
    bfloat16 gradient the bfloat16 residue of the whole, and bert's every gradient was judged
    against 9e13 (ringcheck's defect). Per parameter, as it is judged (the key bias against the
    whole gradient), a weight's gradient halved is caught while the bfloat16 noise passes."""
    gen = torch.Generator().manual_seed(0)
    weight, other = (torch.randn(8, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    bias = torch.full((8,), 1e-17, dtype=torch.float64)
    truth = {"w": weight, "v": other, "key.bias": bias}
    diffs = {"w": 0.01 * float(weight.norm()), "v": 0.01 * float(other.norm()), "key.bias": 2e-4}
    noisy = {k: g + 0.005 * float(g.norm()) / 8 * torch.randn(g.shape, generator=gen, dtype=torch.float64)
             for k, g in truth.items()}
    judged, noise = _narrowed_case(noisy, diffs, truth)
    assert judged["verdict"] == "pass" and noise["unit"]["gradient"] == pytest.approx(0.01), judged["why"]
    assert all(g["budget"] < 0.05 for g in judged["gradients"]) and not judged["not_judged"]
    halved, _ = _narrowed_case({**noisy, "w": 0.5 * weight}, diffs, truth)
    assert halved["verdict"] == "fail" and halved["first_out"]["name"] == "w"
    assert halved["first_out"]["factor"] == pytest.approx(0.5), halved["first_out"]


def test_a_gradient_whose_measured_noise_is_no_bound_is_reported_not_judged():
    """A parameter whose true gradient is small against the narrow dtype's noise (a budget of 1 or
    more of it: a gradient of zeros would pass) is not judged, said with its numbers; it neither
    passes silently nor widens another parameter's budget."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    small = 1e-3 * torch.randn(8, generator=gen, dtype=torch.float64)  # far above float64 rounding of the whole
    truth = {"w": weight, "small": small}
    diffs = {"w": 0.01 * float(weight.norm()), "small": 0.5 * float(small.norm())}
    judged, noise = _narrowed_case({"w": weight.clone(), "small": torch.zeros(8, dtype=torch.float64)}, diffs, truth)
    assert judged["verdict"] == "pass" and [g["name"] for g in judged["not_judged"]] == ["small"], judged
    assert noise["unbounded"] == ["small"] and "not judged" in noise["words"]
    row = next(g for g in judged["gradients"] if g["name"] == "small")
    assert row["judged"] is False and "a gradient of zeros would pass" in row["why"]
    assert next(g for g in judged["gradients"] if g["name"] == "w")["budget"] == pytest.approx(0.04)


def test_a_bert_glue_that_halves_a_layers_gradient_fails_over_a_bf16_flash_core(ring_processes):
    """ring-flash-attn's adapter (bfloat16 on the flash stand-in) with layer 1's attention gradient
    halved (`ringcheck.catalogue.gradient_mutants`): its loss and logits are the correct glue's, and
    against bert's key biases' bfloat16 noise (a budget of 5.6e13) it passed. Each gradient against
    its own noise, it fails, and the correct adapter still passes, every budget a bound."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed (the extra `peers`)")
    cases = ("one_sequence",)
    correct = run_model_step(ModelStepConfig(model="bert", glue="ring_flash_attn", world_size=2, cases=cases),
                             ring_processes)
    assert correct["verdict"] == "pass", correct["why"]
    row = correct["cases"][0]
    assert row["gradient_budget"] < 0.2 and not row["not_judged"], row["gradient_budget"]
    assert all(g.get("judged", True) and g["ratio"] <= 1 for g in row["gradients"])
    planted = run_model_step(ModelStepConfig(model="bert", glue="ringcheck.catalogue.gradient_mutants:"
                                             "layer_gradient_halved", world_size=2, cases=cases), ring_processes)
    assert planted["verdict"] == "fail", planted["why"]
    assert planted["cases"][0]["logits"]["ratio"] <= 1 and "gradient of" in planted["why"]


def test_a_key_bias_is_judged_against_the_truths_own_rounding_of_the_whole(ring_processes):
    """The truth's own rounding (its loss summed part by part) floors a parameter's budget measured
    as the parameter is judged: bert's key biases, judged against the whole gradient, took a floor
    measured relative to their own ~1e-17 truth (0.94: a budget of 3.8 of the whole gradient).
    Now their budget is the derived float64 one, and ringcheck's glue passes it."""
    judged = _run(ring_processes, "bert")
    assert judged["verdict"] == "pass", judged["why"]
    for row in judged["cases"]:
        bias = [g for g in row["gradients"] if g["name"].endswith("key.bias")]
        assert bias and all(g["against"].startswith("whole") and g["budget"] < 1e-10 for g in bias), bias


@pytest.mark.cli
def test_the_plugin_runs_a_model_through_a_glue_and_names_the_lost_semantic(tmp_path, torchrun_world):
    """`pytest --ring-model mistral --ring-glue <window_dropped>` as a user's CI runs it: the cases
    fail with the diagnosis naming the layers; ringcheck's own glue passes the same cases."""
    if torchrun_world is not None:
        pytest.skip("a subprocess pytest per rank: the local run covers it")
    def plugin(*glue: str) -> tuple[int, str]:
        argv = [sys.executable, "-m", "pytest", "--ring-model", "mistral", *glue, "-k",
                "P2 and (one_sequence or packed)", "-p", "no:cacheprovider", "-q", "--noconftest"]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
        return done.returncode, done.stdout[-6000:] + done.stderr[-2000:]

    code, said = plugin("--ring-glue", "ringcheck.catalogue.glue_mutants:window_dropped")
    assert code == 1, said
    assert "2 failed" in said
    assert "test_the_model_through_the_glue_equals_its_own_attention[P2-one_sequence]" in said
    assert "the sliding windows removed on layers 0 and 1" in said
    code, said = plugin()
    assert code == 0 and "2 passed" in said, said


def test_the_models_own_float32_steps_run_in_float64_for_the_truths_own_rounding():
    """`float64_throughout`: a float64 tensor's casts to float32 (`.float()`, `.to(torch.float32)`,
    `.type(torch.float32)`) leave it float64, so the truth's distance to that run measures its own
    float32 rounding; other casts and other dtypes are untouched."""
    from ringcheck.models.step_noise import float64_throughout

    x = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    assert x.float().dtype == torch.float32 and float(x.float().double() - x) != 0.0
    with float64_throughout():
        for narrowed in (x.float(), x.to(torch.float32), x.to(dtype=torch.float32), x.type(torch.float32)):
            assert narrowed.dtype == torch.float64 and bool(narrowed == x)
        assert x.to(torch.float16).dtype == torch.float16
        assert torch.ones(2, dtype=torch.float32).double().dtype == torch.float64


def _counting_builds(monkeypatch) -> list:
    """Every model transformers makes from here on (a build; a copy of one is none)."""
    import transformers

    builds, real = [], transformers.AutoModelForCausalLM.from_config
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config",
                        lambda *a, **k: builds.append(a) or real(*a, **k))
    return builds


def test_the_model_of_the_own_rounding_is_built_once_a_task_with_the_same_figures(monkeypatch):
    """`own_rounding` with the task's `built`: the model built under `float64_throughout` once,
    each case a copy, and each case's figures those of a build of its own."""
    from ringcheck.harness.settings import default_dtype
    from ringcheck.models.native import NATIVE, native_step
    from ringcheck.models.regimes import model_case
    from ringcheck.models.step import case_batches, tiny_of
    from ringcheck.models.step_noise import own_rounding

    config = ModelStepConfig(model="llama", world_size=2)
    tiny = tiny_of(config)
    with default_dtype(torch.float64):
        truths = [(batches, native_step(tiny.build(NATIVE, dtype=torch.float64), batches)[1]) for batches in
                  (case_batches(config, tiny, model_case(n, tiny, 2, "contiguous"), 1) for n in ("one_sequence", "packed"))]
        builds, built = _counting_builds(monkeypatch), {}
        kept = [own_rounding(tiny, config, batches, grads, built) for batches, grads in truths]
        assert len(builds) == 1
        assert kept == [own_rounding(tiny, config, batches, grads) for batches, grads in truths] and all(kept)


def test_a_share_of_diagnoses_builds_the_model_once_with_the_same_diagnoses(monkeypatch):
    """`diagnoses_task`: one build for the rank's share (`reused_builds`), each case's diagnosis
    the one it gets with a build of its own."""
    from types import SimpleNamespace

    from ringcheck.harness.settings import default_dtype
    from ringcheck.models.native import NATIVE, native_step
    from ringcheck.models.regimes import model_case
    from ringcheck.models.shares import diagnoses_task
    from ringcheck.models.step import case_batches, diagnosis_task, tiny_of

    config = ModelStepConfig(model="llama", world_size=2, cases=("one_sequence", "batch2"))
    tiny = tiny_of(config)
    jobs = []
    with default_dtype(torch.float64):
        for name in config.cases:
            batches = case_batches(config, tiny, model_case(name, tiny, 2, "contiguous"), 1)
            _, grads, logits = native_step(tiny.build(NATIVE, dtype=torch.float64), batches)
            jobs.append((name, [z.detach() for z in logits] if isinstance(logits, list) else [logits.detach()],
                         {n: g.detach() for n, g in grads.items()}, None))
    member = SimpleNamespace(group_index=0)
    builds = _counting_builds(monkeypatch)
    shared = diagnoses_task(member, config, (tuple(jobs),), 1)
    assert len(builds) == 1 and set(shared) == set(config.cases)
    alone = {job[0]: diagnosis_task(member, config, *job[:1], 1, *job[1:]) for job in jobs}
    assert shared == alone and all("no semantic is lost" in d["words"] for d in shared.values()), shared
