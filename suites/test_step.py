"""`ringcheck step`: the user's training step at CP=P against the same step at CP=1, in float64.

The ring itself in float64 first (the step's exact arithmetic needs it), then the recipe
contract, the cases, the verdict and its budget, the diagnosis of every catalogue mutant, and
the command end to end.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ringcheck
from ringcheck.reference import dense_attention

# ---- the ring in float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("layout, variant", [
    ("contiguous", {}), ("zigzag", {}), ("striped", {}), ("zigzag", {"cu_seqlens": (0, 10, 27, 32)}),
    ("zigzag", {"window": (5, 0)}), ("zigzag", {"softcap": 3.0})])
def test_our_ring_in_float64_matches_the_dense_float64_reference(layout, variant):
    """float64 in, float64 throughout (merge, accumulators, block kernels), float64 out: forward
    and backward within a few float64 roundings of the dense float64 attention (a float32 step
    anywhere would leave errors near 1e-7)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    out = ringcheck.simulate_ring(q, k, v, world_size=4, causal=True, layout=layout, sinks=sinks, **variant)
    want = dense_attention(q, k, v, causal=True, sinks=sinks, **variant)
    assert out.dtype == torch.float64
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref = torch.autograd.grad(want, (q, k, v, sinks), dout)
    assert float((out - want).detach().abs().max()) < 1e-13
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert a.dtype == torch.float64 and float((a - b).abs().max()) < 1e-13, name


# ---- the contract, the cases, the budget --------------------------------------------------------

def test_a_shard_is_contiguous_and_packed_rows_give_their_documents():
    from ringcheck.step.contract import CP, documents_of

    cp = CP(rank=1, size=2, group=None, layout="contiguous", impl=None)
    x = torch.arange(16).view(2, 8)
    part = cp.shard(x)
    assert part.is_contiguous() and part.tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert part.view(-1).numel() == 8  # transformers' loss views the labels flat
    assert cp.pad(torch.ones(1, 7), 0).shape == (1, 8) and CP(0, 2, None, "zigzag", None).multiple == 4
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]] * 2)
    assert documents_of(pos) == (0, 3, 5, 8) and documents_of(torch.arange(8).view(1, 8)) is None
    with pytest.raises(ValueError, match="packed differently"):
        documents_of(torch.stack([pos[0], torch.arange(8)]))


def test_the_budget_follows_the_reordered_sums_and_the_loss_and_attention_dtypes():
    from ringcheck.commands.step import attention_dtype
    from ringcheck.step.run import StepConfig
    from ringcheck.step.verdict import K_COND, budgets

    u64, u32 = 2.0 ** -53, 2.0 ** -24
    assert budgets(64, "float64", None) == (2 * 64 * K_COND * u64, 2 * 64 * K_COND * u64)
    loss, grad = budgets(64, "float64", "float32")
    assert loss == 2 * 64 * u32 and grad == 2 * 64 * K_COND * u64
    assert budgets(64, "float64", None, "float32") == (2 * 64 * u32, 2 * 64 * u32)
    assert loss < 1e-4  # still below the smallest reported bug
    assert attention_dtype(StepConfig()) is None and attention_dtype(StepConfig(impl="torch_cp")) == "float32"


def test_a_recipe_that_breaks_the_contract_is_named_before_any_rank_starts(capsys):
    from ringcheck.cli import EXIT_USAGE, main

    assert main(["step", "--recipe", "ringcheck.catalogue.step_mutants:EXPECTED", "-q"]) == EXIT_USAGE
    assert "lacks model(), step();" in capsys.readouterr().err
    assert main(["step", "--cases", "one_sequence,no_such_case", "-q"]) == EXIT_USAGE
    assert "no_such_case" in capsys.readouterr().err
    assert main(["step", "--recipe", "plain", "--dtype", "float32", "--world-size", "3", "--layout", "contig"]) == 2
    assert "contig" in capsys.readouterr().err
    ring = "ringcheck.catalogue.mutants:textbook"  # a ring that takes no cu_seqlens: no packed case for it
    assert main(["step", "--impl", ring, "--cases", "packed", "-q"]) == EXIT_USAGE
    assert "takes no cu_seqlens" in capsys.readouterr().err


@pytest.mark.parametrize("mutant, words", [("model_not_a_module", "not a torch.nn.Module"),
                                            ("loss_not_a_scalar", "the contract is the loss the user would log")])
def test_a_step_that_breaks_the_contract_gets_no_verdict(ring_processes, mutant, words):
    from ringcheck.launch import RingError

    with pytest.raises(RingError, match=words):
        _step(ring_processes, recipe=f"{MUTANTS}:{mutant}", cases=("one_sequence",))


# ---- the verdict: correct recipes pass, every mutant fails with its diagnosis --------------------

MUTANTS = "ringcheck.catalogue.step_mutants"


def _step(processes, **settings):
    from ringcheck.commands.step import run_step
    from ringcheck.step.run import StepConfig

    config = StepConfig(**{"world_size": 2, **settings})
    if processes.size is not None and processes.size < config.mesh_spec.size:
        pytest.skip(f"the torchrun world has {processes.size} ranks, the mesh {config.mesh_spec.size}")
    return run_step(config, processes)


@pytest.mark.parametrize("settings", [dict(), dict(layout="contiguous", mesh="dp=2,cp=2",
                                                   cases=("batch2", "two_micro_batches", "not_divisible"))],
                         ids=["p2_zigzag_every_case", "dp2_cp2_contiguous"])
def test_the_plain_recipe_passes_every_case(ring_processes, settings):
    judged = _step(ring_processes, **settings)
    assert judged["verdict"] == "pass", judged["why"]
    for row in judged["cases"]:
        assert row["loss"]["error"] < 1e-14 and row["worst_gradient"] < 1e-14, row["case"]
    assert judged["convention"]["follows"] == "token_mean"
    assert judged["data"]["verdict"] == "pass", judged["data"]["words"]


def test_a_sampler_seeded_by_the_global_rank_fails_the_data_check(ring_processes):
    judged = _step(ring_processes, recipe=f"{MUTANTS}:sampler_seeded_by_global_rank", mesh="dp=2,cp=2",
                   cases=("one_sequence",))
    assert judged["verdict"] == "fail" and judged["cases"][0]["verdict"] == "pass"
    assert judged["data"]["verdict"] == "fail" and "CP group 0 got different batches" in judged["data"]["words"]


@pytest.mark.parametrize("mutant", sorted(__import__(MUTANTS, fromlist=["EXPECTED"]).EXPECTED))
def test_every_mutant_fails_with_its_diagnosis(ring_processes, mutant):
    from ringcheck.catalogue.step_mutants import EXPECTED

    case, diagnosis = EXPECTED[mutant]
    judged = _step(ring_processes, recipe=f"{MUTANTS}:{mutant}", cases=(case,))
    (row,) = judged["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"] is not None, row.get("candidates")
    assert row["diagnosis"]["name"] == diagnosis
    assert row["first_out"] is not None or row["loss"]["ratio"] > 1
    assert max(row["loss"]["ratio"], max(g["ratio"] for g in row["gradients"])) > 1e6  # far out, not a near miss


def test_micro_batches_weighed_equally_is_consistent_and_named_by_the_convention(ring_processes):
    judged = _step(ring_processes, recipe=f"{MUTANTS}:micro_batches_weighed_equally", cases=("two_micro_batches",))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["convention"]["follows"] == "micro_batches_weighed_equally"
    assert "#34191" in judged["convention"]["words"]


# ---- the hf_llama recipe (transformers: the optional extra `hf`) --------------------------------

def _transformers():
    pytest.importorskip("transformers", reason="the hf_llama recipe needs transformers (pip install ringcheck[hf])")


def test_the_hf_llama_recipe_passes(ring_processes):
    """Its loss is float32 (transformers casts the logits), its gradients float64: each within its
    budget (packed documents, accumulation and reentrant checkpointing here; every case, P = 2 and
    4, both layouts and a mesh in benchmarks/step_report.py, reports/step/)."""
    _transformers()
    judged = _step(ring_processes, recipe="hf_llama", cases=("packed", "two_micro_batches", "checkpoint_reentrant"))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["loss_dtype"] == "float32"
    for row in judged["cases"]:
        assert row["loss"]["error"] < 1e-6 and row["worst_gradient"] < 1e-14, row["case"]


def test_sharded_labels_handed_to_the_hf_model_are_named(ring_processes):
    _transformers()
    from ringcheck.catalogue.hf_step_mutants import EXPECTED

    case, diagnosis = EXPECTED["labels_sharded"]
    judged = _step(ring_processes, recipe="ringcheck.catalogue.hf_step_mutants:labels_sharded", cases=(case,))
    (row,) = judged["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == diagnosis, row.get("candidates")


def test_the_how_to_example_is_named_as_the_page_says(ring_processes):
    """docs/how-to/step.md's example step (examples/step_recipe.py): labels shifted by the model
    inside each shard, named to float32 precision (its loss is float32)."""
    _transformers()
    judged = _step(ring_processes, recipe="examples.step_recipe:recipe", cases=("one_sequence",))
    (row,) = judged["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == "labels_shifted_in_shards"
    assert row["worst_gradient"] > 0.1 and row["loss"]["error"] < 1e-3  # gradients far out, the loss barely


def test_a_ring_with_a_wrong_backward_fails_inside_the_step(ring_processes):
    """ring-attention-pytorch's dK/dV bug (docs/findings/peers.md) seen from the plain step: the
    loss agrees (its forward is right), the gradients do not, and no step bug is named. Its
    reference is our ring on one rank (it cannot run on a group of one itself)."""
    pytest.importorskip("ring_attention_pytorch", reason="the peer ring is the optional extra peers")
    world = ring_processes.size or 2  # it rings over the default group: under torchrun, the whole world
    judged = _step(ring_processes, impl="ring_attention_pytorch", layout="contiguous", world_size=world,
                   cases=("one_sequence",))
    (row,) = judged["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"] is None
    assert row["loss"]["ratio"] <= 1 and row["worst_gradient"] > 0.05


# ---- a ring that runs only narrower dtypes: flash-attn's, through the stand-in --------------------

def _ring_flash_attn():
    """Skip without ring-flash-attn (the extra peers); it imports only over the flash-attn stand-in."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("the peer ring is the optional extra peers (pip install ringcheck[peers])")


def test_a_flash_attn_ring_is_called_narrower_and_judged_within_the_measured_noise(ring_processes):
    """ring-flash-attn runs bf16 / fp16 only: the step stays float64, the ring is called in bf16
    (q, k, v cast in, out cast back), the reference's attention the same way, and the budget is
    K_NOISE x the noise runs' largest change (reports/step/noise.md: correct peers at most 1.35
    units of it). The correct step passes with room; a mean of rank means is still named."""
    _ring_flash_attn()
    from ringcheck.step.noise import K_NOISE

    settings = dict(impl="ring_flash_attn:zigzag", flash_attn_stand_in=True, attention_dtype="bfloat16")
    judged = _step(ring_processes, cases=("uneven",), **settings)
    assert judged["verdict"] == "pass", judged["why"]
    noise, (row,) = judged["noise"], judged["cases"]
    assert {r["run"] for r in noise["rows"]} == {"unrounded", "naive"} and noise["gradient"] > 1e-4
    assert row["gradient_budget"] == K_NOISE * noise["gradient"] and row["worst_gradient"] > 1e-4  # really bf16
    assert max(row["loss"]["ratio"], max(g["ratio"] for g in row["gradients"])) < 0.5
    bad = _step(ring_processes, recipe=f"{MUTANTS}:mean_of_rank_means", cases=("uneven",), **settings)
    (row,) = bad["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == "mean_of_rank_means", row.get("candidates")
    assert row["loss"]["ratio"] > 100


def test_the_command_narrows_a_ring_that_cannot_run_float64_and_says_so():
    _ring_flash_attn()
    from ringcheck.cli import build_parser
    from ringcheck.cli.step import step_config

    config = step_config(build_parser().parse_args(["step", "--impl", "ring_flash_attn:zigzag",
                                                    "--flash-attn-stand-in"]))
    assert config.attention_dtype == "bfloat16" and config.dtype == "float64"
    assert "packed" not in config.cases  # its varlen ring balances each document (--layout zigzag_docs)
    assert "--attention-dtype bfloat16 --flash-attn-stand-in" in " ".join(config.flags())
    contiguous = step_config(build_parser().parse_args(["step", "--impl", "ring_flash_attn:llama3", "--layout",
                                                        "contiguous", "--flash-attn-stand-in"]))
    assert "packed" in contiguous.cases


# ---- the logits hook: the contract's form and the older one -------------------------------------

def test_the_logits_hook_is_called_in_the_form_it_is_written_in():
    from ringcheck.step.contract import CP, active_cp, logits_form, logits_hook

    seen = []

    def contract(model, input_ids, position_ids):
        seen.append(("ids", input_ids.shape, active_cp().cu_seqlens))
        return input_ids

    def with_cp(model, input_ids, position_ids, *, cp=None):
        seen.append(("cp", cp.cu_seqlens, cp is active_cp()))
        return input_ids

    def older(model, batch, cp):
        seen.append(("batch", sorted(batch), cp.cu_seqlens))
        return batch["input_ids"]

    class Recipe:
        def logits(self, model, batch, cp):
            return older(model, batch, cp)

    assert [logits_form(f) for f in (contract, with_cp, older, Recipe().logits, lambda m, ids, pos: ids)] == [
        "ids", "ids", "batch", "batch", "ids"]
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.zeros(1, 8, dtype=torch.long),
             "labels": None, "cu_seqlens": (0, 3, 8)}
    cp = CP(rank=0, size=1, group=None, layout="zigzag", impl=None)
    for fn in (contract, with_cp, Recipe().logits):
        assert logits_hook(fn)(None, batch, cp) is batch["input_ids"]
    assert seen == [("ids", (1, 8), (0, 3, 8)), ("cp", (0, 3, 8), True),
                    ("batch", ["cu_seqlens", "input_ids", "labels", "position_ids"], (0, 3, 8))]
    assert active_cp() is None  # only while ringcheck calls a hook


def test_a_recipe_with_the_older_logits_form_is_still_diagnosed(ring_processes):
    judged = _step(ring_processes, recipe=f"{MUTANTS}:labels_shifted_older_logits", cases=("one_sequence",))
    (row,) = judged["cases"]
    assert row["diagnosis"]["name"] == "labels_shifted_in_shards", row.get("candidates")


# ---- DTensor parameters: FSDP2 over the CP group ------------------------------------------------

@pytest.mark.parametrize("recipe, mesh, diagnosis", [("fsdp_over_cp", "dp=2,cp=2", None),
                                                     ("fsdp_averaged_over_cp", None, "grads_over_p")])
def test_dtensor_gradients_are_gathered_to_full_and_judged(ring_processes, recipe, mesh, diagnosis):
    """Every parameter a Shard(0) DTensor over the CP ranks (fully_shard on gloo): ringcheck
    gathers each gradient to the full tensor; the correct step equals CP=1 to float64, FSDP's
    default average over the CP group is named."""
    judged = _step(ring_processes, recipe=f"ringcheck.catalogue.step_fsdp:{recipe}", mesh=mesh,
                   cases=("two_micro_batches",))
    (row,) = judged["cases"]
    if diagnosis is None:
        assert judged["verdict"] == "pass" and row["worst_gradient"] < 1e-14, judged["why"]
    else:
        assert row["diagnosis"]["name"] == diagnosis and abs(row["first_out"]["factor"] - 0.5) < 1e-12


# ---- the command ---------------------------------------------------------------------------------

def test_the_command_passes_plain_and_writes_its_report(tmp_path, capsys):
    from ringcheck.cli import EXIT_OK, main
    from ringcheck.documents import STEP_SCHEMA, load

    argv = ["step", "--world-size", "2", "--cases", "one_sequence,evaluation", "--report", str(tmp_path), "-q"]
    assert main(argv) == EXIT_OK
    assert "PASSED" in capsys.readouterr().out
    doc = load(tmp_path / "step.json", schema=STEP_SCHEMA)
    assert doc["passed"] and [c["case"] for c in doc["cases"]] == ["one_sequence", "evaluation"]
    assert "ringcheck step: PASSED" in (tmp_path / "step.md").read_text()


def test_the_command_fails_a_mutant_and_names_its_class(capsys):
    from ringcheck.cli import EXIT_FAILED, main

    argv = ["step", "--recipe", f"{MUTANTS}:labels_shifted_in_shards", "--world-size", "2", "--cases", "one_sequence"]
    assert main(argv) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "FAILED" in out and "labels shifted inside each shard" in out and "shift_labels" in out


def test_a_length_the_recipe_cannot_shard_is_not_run_and_alone_gets_no_verdict(capsys):
    """The case is reported not run, with what the step said and the fix; with no other case the
    run judged nothing (exit 2); beside a judged case the run keeps that case's verdict (exit 0)."""
    from ringcheck.cli import EXIT_OK, EXIT_USAGE, main

    argv = ["step", "--recipe", f"{MUTANTS}:no_padding", "--world-size", "2", "--cases", "not_divisible",
            "--timeout", "10"]
    assert main(argv) == EXIT_USAGE
    out = capsys.readouterr().out
    assert "not_divisible: not run" in out and "does not pad" in out and "cp.pad" in out and "NO VERDICT" in out
    assert main([*argv[:-3], "one_sequence,not_divisible", "-q"]) == EXIT_OK


# ---- the pytest plugin: --ring-recipe ------------------------------------------------------------

def _pytest_elsewhere(tmp_path, *args: str):
    """pytest in a subprocess from an empty directory, without the launcher's variables: its
    return code and the end of what it said."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT") and not k.startswith("TORCHELASTIC_")}
    argv = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "--noconftest"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    return result.returncode, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.cli
def test_the_plugin_runs_the_cases_on_a_recipe_and_names_a_failure(tmp_path, torchrun_world):
    """One run of a mutant's cases as tests: its one_sequence test fails at P=2 with the
    diagnosis, its loader test passes, and the test ids name the suite in the package."""
    if torchrun_world is not None:
        pytest.skip("a subprocess pytest per rank: the local run covers it")
    code, said = _pytest_elsewhere(tmp_path, "--ring-recipe", f"{MUTANTS}:grads_averaged", "-k",
                                   "P2 and (one_sequence or loader)")
    assert code == 1, said
    assert "1 failed, 1 passed" in said
    assert "ringcheck/testing/recipe_suite.py::test_the_step_at_cp_p_equals_cp_1[P2-one_sequence]" in said
    assert "grads_over_p" in said and "averaged over the CP group instead of summed" in said


@pytest.mark.cli
def test_the_plugin_runs_a_recipe_through_a_bf16_ring_and_skips_what_it_cannot_run(tmp_path, torchrun_world):
    """--ring-recipe-impl ring_flash_attn:zigzag on the stand-in: called in bf16 inside the float64
    step (as ringcheck step does); the packed case, which its zigzag ring cannot run, is skipped."""
    if torchrun_world is not None:
        pytest.skip("a subprocess pytest per rank: the local run covers it")
    _ring_flash_attn()
    code, said = _pytest_elsewhere(tmp_path, "--ring-recipe", "plain", "--ring-recipe-impl", "ring_flash_attn:zigzag",
                                   "--ring-flash-attn-stand-in", "-k", "P2 and (one_sequence or packed)", "-rs")
    assert code == 0, said
    assert "1 passed, 1 skipped" in said and "cannot run the packed case" in said


def test_a_reference_that_is_not_finite_gives_no_verdict():
    from ringcheck.step.verdict import judge_case

    ref = {"loss": float("nan"), "grads": {"w": torch.ones(3)}}
    ranks = [{"where": (0, 0), "loss": 1.0, "grads": {"w": torch.ones(3)}}]
    row = judge_case("one_sequence", ranks, ref, 64, "float64", None, False)
    assert row["verdict"] == "no verdict" and "not finite" in row["why"]
    good = judge_case("one_sequence", ranks, {"loss": 1.0, "grads": {"w": torch.ones(3)}}, 64, "float64", None, False)
    bad = judge_case("one_sequence", [{**ranks[0], "grads": {"w": torch.full((3,), float("nan"))}}],
                     {"loss": 1.0, "grads": {"w": torch.ones(3)}}, 64, "float64", None, False)
    assert good["verdict"] == "pass" and bad["verdict"] == "fail" and bad["first_out"]["name"] == "w"
    blind = judge_case("one_sequence", ranks, {"loss": 1.0, "grads": {"w": torch.ones(3)}}, 64, "float64", None,
                       False, floor=(float("nan"), {"w": 1e-3}))  # a noise run that was not finite: no budget
    assert blind["verdict"] == "no verdict" and "noise run" in blind["why"]


def _key_bias_case(seed: int = 0):
    """A reference with a weight and a key bias whose gradient cancels to float64 rounding."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    bias = 1e-17 * torch.randn(8, generator=gen, dtype=torch.float64)  # analytically zero: residue
    return gen, {"loss": 1.0, "grads": {"w": weight, "key.bias": bias}}


def test_a_narrowed_ring_is_judged_per_parameter_against_its_own_noise():
    """`noise_unit` keeps each parameter's own largest change over the noise runs, scaled as it is
    judged: the key bias (its reference the bfloat16 residue 1e-6, its unrounded run ~1e-17)
    against the whole gradient, not itself. One unit for all (its relative change, ~1) made every
    budget 4 and a halved weight passed; per parameter the weight's budget is 0.04 and the halved
    weight fails, the noise passes."""
    from ringcheck.step.noise import noise_unit
    from ringcheck.step.verdict import judge_case

    gen, exact = _key_bias_case()
    ref = {"loss": 1.0, "grads": {"w": exact["grads"]["w"] * (1 + 1e-3),
                                  "key.bias": 1e-6 * torch.randn(8, generator=gen, dtype=torch.float64)}}
    naive = {"loss": 1.0 + 1e-5, "grads": {"w": ref["grads"]["w"] * (1 + 0.01),
                                           "key.bias": 1e-6 * torch.randn(8, generator=gen, dtype=torch.float64)}}
    noise = noise_unit({"one_sequence": ref}, {"unrounded": {"one_sequence": exact}, "naive": {"one_sequence": naive}},
                       ("one_sequence",), {"one_sequence": 64}, "float64")
    assert noise["gradients"]["w"] == pytest.approx(0.01, rel=0.01) and noise["gradients"]["key.bias"] < 1e-6
    assert noise["gradient"] == noise["gradients"]["w"] and noise["finite"] and not noise["unbounded"]
    floor = (noise["k"] * noise["loss"], noise["floors"])
    ranks = [{"where": (0, 0), "loss": 1.0, "grads": {k: g * (1 + 1e-3) for k, g in ref["grads"].items()}}]
    row = judge_case("one_sequence", ranks, ref, 64, "float64", None, False, floor=floor,
                     exact=exact["grads"])
    assert row["verdict"] == "pass" and row["gradient_budget"] == pytest.approx(0.04, rel=0.01), row
    assert next(g for g in row["gradients"] if g["name"] == "key.bias")["against"].startswith("whole")
    halved = [{**ranks[0], "grads": {**ranks[0]["grads"], "w": 0.5 * ref["grads"]["w"]}}]
    row = judge_case("one_sequence", halved, ref, 64, "float64", None, False, floor=floor, exact=exact["grads"])
    assert row["verdict"] == "fail" and row["first_out"]["name"] == "w"
    assert row["first_out"]["factor"] == pytest.approx(0.5)


def test_a_gradient_that_cancels_to_rounding_is_judged_as_part_of_the_whole_and_no_bound_is_not_judged():
    """A key bias at float64: both runs' gradients are rounding residue, 1.1 apart relative to
    themselves (a correct step failed): judged as a part of the whole gradient, it passes. A
    measured budget of 1 or more (a gradient of zeros would pass) is not judged, said, and never
    widens another parameter's."""
    from ringcheck.step.verdict import judge_case

    gen, ref = _key_bias_case(1)
    ranks = [{"where": (0, 0), "loss": 1.0,
              "grads": {"w": ref["grads"]["w"].clone(), "key.bias": 1e-17 * torch.randn(8, generator=gen,
                                                                                        dtype=torch.float64)}}]
    row = judge_case("one_sequence", ranks, ref, 64, "float64", None, False)
    assert row["verdict"] == "pass", row["gradients"]
    bias = next(g for g in row["gradients"] if g["name"] == "key.bias")
    assert bias["against"].startswith("whole") and bias["error"] < 1e-15
    zeros = [{**ranks[0], "grads": {**ranks[0]["grads"], "w": torch.zeros(8, 8, dtype=torch.float64)}}]
    row = judge_case("one_sequence", zeros, ref, 64, "float64", None, False, floor=(1e-3, {"w": 1.5, "key.bias": 1e-3}))
    assert row["verdict"] == "pass" and [g["name"] for g in row["not_judged"]] == ["w"], row
    assert "a gradient of zeros would pass" in row["not_judged"][0]["why"] and row["gradient_budget"] < 1e-2


def test_pytorch_context_parallel_inside_the_step(ring_processes):
    """--impl torch_cp: not known to compute float64 throughout, so its attention is taken as
    float32 (the report says so); the plain step passes, a mutant still fails with its diagnosis."""
    judged = _step(ring_processes, impl="torch_cp", cases=("one_sequence", "checkpoint_reentrant"))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["attention_dtype"] == "float32"
    assert all(0 < r["worst_gradient"] < r["gradient_budget"] for r in judged["cases"])
    bad = _step(ring_processes, impl="torch_cp", recipe=f"{MUTANTS}:labels_shifted_in_shards", cases=("one_sequence",))
    assert bad["cases"][0]["diagnosis"]["name"] == "labels_shifted_in_shards"


@pytest.mark.cli
def test_under_torchrun_the_command_runs_on_the_world_and_rank_0_reports(torchrun_world, tmp_path):
    """torchrun -m ringcheck step: the ranks are the world's (a mesh dp=1,cp=2 of 2 ranks), every
    rank judges, rank 0 alone prints and writes the report; a failing step exits non-zero."""
    if torchrun_world is not None:
        pytest.skip("starts its own torchrun world: plain pytest")
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ringcheck.documents import STEP_SCHEMA, load

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    argv = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ringcheck",
            "step", "--recipe", f"{MUTANTS}:grads_averaged", "--cases", "one_sequence", "--report", str(tmp_path), "-q"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    assert done.stdout.count("report written to") == 1 and "grads_over_p" in done.stdout, done.stdout
    doc = load(tmp_path / "step.json", schema=STEP_SCHEMA)
    assert doc["verdict"] == "fail" and doc["command"].startswith(("cd ", "torchrun")) and "torchrun" in doc["command"]
