"""`ringcheck step` on recipes a new user writes (suites/step_recipes/, outside the package): what
they hit before issue 42's item 7, each fixed. A correct step passes without declaring what
ringcheck can find out itself; a case the step cannot run is not run, the others keep their
verdicts; the diagnosis runs whatever the model's checkpointing; a buggy step is still named.
"""

from __future__ import annotations

import pytest

PLAIN = "suites.step_recipes.user_plain"
HF = "suites.step_recipes.user_hf"
MUTANTS = "ringcheck.catalogue.step_mutants"


def _step(processes, **settings):
    """`run_step` on a ring of 2 (skipped under a torchrun world of fewer ranks)."""
    from ringcheck.commands.step import run_step
    from ringcheck.step.run import StepConfig

    if processes.size is not None and processes.size < 2:
        pytest.skip(f"a ring of 2; the torchrun world has {processes.size} rank")
    return run_step(StepConfig(world_size=2, **settings), processes)


# ---- a. a case the step cannot run ---------------------------------------------------------------

def test_a_case_the_step_cannot_run_is_not_run_and_the_others_keep_their_verdicts(ring_processes):
    """The user's step does not pad (its loader does): not_divisible raises inside cp.shard. That
    case is reported not run, with what the step said and the fix; the other cases are judged and
    set the verdict (pass here); a bug in another case still fails the run."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:recipe", cases=("one_sequence", "not_divisible"))
    assert judged["verdict"] == "pass", judged["why"]
    good, skipped = judged["cases"]
    assert good["verdict"] == "pass" and good["worst_gradient"] < 1e-14
    assert skipped["verdict"] == "not run" and "not divisible" in skipped["why"] and "CP=2" in skipped["why"]
    assert "cp.pad" in skipped["fix"] and "not run: not_divisible" in judged["why"]
    bad = _step(ring_processes, recipe=f"{MUTANTS}:labels_shifted_in_shards", cases=("not_divisible", "one_sequence"))
    assert bad["verdict"] == "fail" and [r["verdict"] for r in bad["cases"]] == ["fail", "fail"]  # it pads


def test_a_run_whose_every_case_the_step_cannot_run_has_no_verdict(ring_processes):
    judged = _step(ring_processes, recipe=f"{MUTANTS}:no_padding", cases=("not_divisible",))
    assert judged["verdict"] == "no verdict" and judged["cases"][0]["verdict"] == "not run"
    assert "does not pad" in judged["cases"][0]["why"] and judged["why"].startswith("no case was judged")


def test_only_a_raise_inside_the_step_makes_a_case_not_run():
    """The message `run_case` gives a raise inside the recipe's step is what is parsed; any other
    failure (a hang, the contract) is not a case the step cannot run."""
    from ringcheck.step.run import CANNOT_RUN, cannot_run

    said = {0: "raised RuntimeError: --recipe x:y: " + CANNOT_RUN + " uneven at CP=4 (-100 spans: the shards hold "
               "very different counts (rank 0 almost none)): ValueError: no\nTraceback ...", 1: "stopped after"}
    assert cannot_run(said) == ("uneven", "at CP=4 the step raised ValueError: no")
    assert cannot_run({0: "timed out waiting for rank 1"}) is None


# ---- d. the diagnosis under the model's own reentrant checkpointing --------------------------------

def test_the_diagnosis_runs_through_a_model_that_checkpoints_reentrantly(ring_processes):
    """The model checkpoints every block with use_reentrant=True (its own choice): the correct
    step passes, and a buggy one is diagnosed through it (ringcheck's diagnosis pass called
    torch.autograd.grad, which reentrant checkpointing refuses: exit 2 before)."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:reentrant", cases=("uneven",))
    assert judged["verdict"] == "pass", judged["why"]
    bad = _step(ring_processes, recipe=f"{PLAIN}:labels_in_shards_reentrant", cases=("one_sequence",))
    (row,) = bad["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == "labels_shifted_in_shards", row.get("candidates")


# ---- e. vocab_size read from the model -----------------------------------------------------------

def test_a_recipe_without_vocab_size_draws_from_the_model_input_embeddings(ring_processes):
    """A step needs only model() and step(): the ids are drawn from the model's first
    nn.Embedding (the token one, 50 ids; not the positions' 128), and the report says so."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:no_vocab", cases=("one_sequence",))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["found"] == ["vocab_size 50, read from the model's input embeddings (the first nn.Embedding, "
                               "tokens): the recipe declares none"]


def test_the_vocabulary_comes_from_get_input_embeddings_and_a_model_without_one_is_refused():
    import torch

    from ringcheck.step.contract import load_recipe, vocab_of

    recipe = load_recipe(f"{PLAIN}:no_vocab")
    assert recipe.vocab_size is None and vocab_of(load_recipe(f"{PLAIN}:recipe"), None) == (50, None)

    class Tied(torch.nn.Module):  # a transformers-like model: its input embeddings are not its first Embedding
        def __init__(self):
            super().__init__()
            self.positions, self.words = torch.nn.Embedding(128, 4), torch.nn.Embedding(40, 4)

        def get_input_embeddings(self):
            return self.words

    assert vocab_of(recipe, Tied())[0] == 40 and "get_input_embeddings()" in vocab_of(recipe, Tied())[1]
    with pytest.raises(TypeError, match="has no vocab_size and its model .Linear. has no nn.Embedding"):
        vocab_of(recipe, torch.nn.Linear(2, 2))


# ---- b. the float32 rounding of a loss -----------------------------------------------------------

def test_a_loss_computed_in_float32_is_found_from_its_bits_and_never_fails_the_step(ring_processes):
    """A plain-torch step whose cross-entropy takes float32 logits, no loss_dtype: its logged
    losses at CP=1 carry at most 24 + a few significant bits (float64's carry 53), so the loss
    budget is float32's (the report says how it was found); the gradients keep float64's."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:float32_loss", cases=("one_sequence", "two_micro_batches"))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["loss_dtype"] == "float32" and "significant bits" in judged["found"][0]
    for row in judged["cases"]:
        assert 1e-12 < row["loss"]["error"] < row["loss"]["budget"] and row["worst_gradient"] < 1e-14, row["case"]
    exact = _step(ring_processes, recipe=f"{PLAIN}:recipe", cases=("one_sequence",))
    assert exact["loss_dtype"] == "float64" and exact["found"] == []  # a float64 loss keeps float64's budget


def test_the_significant_bits_of_a_loss_tell_its_dtype():
    import torch

    from ringcheck.step.verdict import loss_rounding, significant_bits

    g = torch.Generator().manual_seed(0)
    wide = torch.rand(20, generator=g, dtype=torch.float64).tolist()
    narrow = [float(torch.tensor(x, dtype=torch.float32)) for x in wide]
    assert min(map(significant_bits, wide)) > 40 and max(map(significant_bits, narrow)) <= 24
    assert significant_bits(0.75) == 2 and significant_bits(0.0) == 0
    assert loss_rounding(None, "float64", None, wide) == loss_rounding(None, "float64", None, [0.0]) == (None, None)
    assert loss_rounding(None, "float64", None, narrow)[0] == "float32"
    assert loss_rounding(None, "float64", None, [float(torch.tensor(x, dtype=torch.bfloat16)) for x in wide])[0] == \
        "bfloat16"
    assert loss_rounding(None, "float64", "LlamaForCausalLM", wide)[0] == "float32"  # transformers: always float32
    assert loss_rounding("float64", "float64", "LlamaForCausalLM", narrow) == ("float64", None)  # declared wins


def test_a_correct_transformers_step_passes_without_declaring_anything(ring_processes):
    """The user's LlamaForCausalLM step: no loss_dtype, no vocab_size, no padding. Its loss is
    float32 (ForCausalLMLoss), found from the model's class: it passes, every gradient to
    float64 precision; the vocabulary comes from get_input_embeddings(); not_divisible is not run."""
    pytest.importorskip("transformers", reason="the transformers recipe needs transformers (pip install ringcheck[hf])")
    judged = _step(ring_processes, recipe=f"{HF}:no_vocab", cases=("uneven", "not_divisible"))
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["loss_dtype"] == "float32" and [r["verdict"] for r in judged["cases"]] == ["pass", "not run"]
    vocab, loss, own = judged["found"]
    assert "no logits hook" in own
    assert "vocab_size 64" in vocab and "get_input_embeddings()" in vocab
    assert "transformers PreTrainedModel (LlamaForCausalLM)" in loss
    row = judged["cases"][0]
    assert 1e-12 < row["loss"]["error"] < row["loss"]["budget"] and row["worst_gradient"] < 1e-14


# ---- c. no logits hook: a transformers model is called by ringcheck itself ------------------------

def test_sharded_labels_handed_to_a_transformers_model_are_named_without_a_logits_hook(ring_processes):
    """The user hands the model its shard of the unshifted labels (it shifts inside each shard),
    has no logits hook, and the model checkpoints with use_reentrant=True: ringcheck calls the
    model itself on whole sequences (the report says so) and names the bug class, with the count
    the step divides by (the whole sequence's targets, as num_items_in_batch counted before
    sharding). Before: 'matches no known transformation' (only gradient-scale candidates)."""
    pytest.importorskip("transformers", reason="the transformers recipe needs transformers (pip install ringcheck[hf])")
    judged = _step(ring_processes, recipe=f"{HF}:sharded_reentrant", cases=("one_sequence",))
    (row,) = judged["cases"]
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == "labels_shifted_in_shards", row.get("candidates")
    assert judged["has_logits"] and any("call the transformers model (LlamaForCausalLM) itself" in line
                                        for line in judged["found"])
    assert row["diagnosis"]["loss_ratio"] <= 1 and row["diagnosis"]["gradient_ratio"] <= 1


def test_a_diagnosis_that_cannot_recompute_the_step_leaves_the_verdict_and_says_why(ring_processes):
    """The logits hook raises (as a transformers attention that takes its group only from the
    step's keyword does when ringcheck calls the model itself): the case still fails, with the
    gradient-scale candidates only, and the report says why the naming is missing (exit 1, not 2)."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:labels_in_shards_logits_raise", cases=("one_sequence",))
    assert judged["verdict"] == "fail" and judged["cases"][0]["diagnosis"] is None
    assert any("could not recompute the step" in line and "this model runs on shards only" in line
               for line in judged["found"]), judged["found"]


# ---- f. a parameter whose gradient is analytically zero: each gradient against its own noise -------

def test_a_key_bias_is_judged_as_part_of_the_whole_gradient_and_a_correct_step_passes(ring_processes):
    """The user's attention adds a key bias: its gradient is analytically zero (softmax ignores a
    per-row constant), float64 residue at CP=1 and CP=P alike. Judged relative to itself it read
    1.1 against a budget of 2.3e-13, a correct step failed (ringcheck's defect); judged as a part
    of the whole gradient it is ~1e-18 of it. The bug with the key biases is still named."""
    judged = _step(ring_processes, recipe=f"{PLAIN}:key_bias", cases=("one_sequence",))
    assert judged["verdict"] == "pass", judged["why"]
    rows = {g["name"]: g for g in judged["cases"][0]["gradients"]}
    for name in ("blocks.0.key_bias", "blocks.1.key_bias"):
        assert rows[name]["against"].startswith("whole gradient") and rows[name]["error"] < 1e-15, rows[name]
    bad = _step(ring_processes, recipe=f"{PLAIN}:key_bias_grads_averaged", cases=("one_sequence",))
    (row,) = bad["cases"]  # before: matches no known transformation (the key biases' residues never matched)
    assert row["verdict"] == "fail" and row["diagnosis"]["name"] == "grads_over_p", row.get("candidates")


def test_a_narrowed_ring_judges_each_gradient_against_its_own_noise(ring_processes):
    """Our ring called in bfloat16 (--attention-dtype): the budgets are measured from the noise
    runs. One unit for every parameter, the largest relative change of any, was the key bias's
    (2.7: its reference is its bfloat16 attention's residue, its unrounded run float64's), and
    every gradient was judged against 11: a step that averages one layer's gradients over the CP
    group (halved at CP=2, the loss right) passed (0.046 of it; ringcheck's defect). Per parameter,
    the key bias judged as a part of the whole gradient (its cancellation read on the unrounded
    run), every budget is a bound: the bug fails and the correct step passes."""
    settings = dict(attention_dtype="bfloat16", cases=("one_sequence",))
    judged = _step(ring_processes, recipe=f"{PLAIN}:key_bias", **settings)
    assert judged["verdict"] == "pass", judged["why"]
    (row,) = judged["cases"]
    assert row["gradient_budget"] < 0.1 and not row["not_judged"] and not judged["noise"]["unbounded"], row
    assert max(g["ratio"] for g in row["gradients"]) < 0.5 and judged["noise"]["gradient"] > 1e-4  # really bf16
    assert {g["name"] for g in row["gradients"] if g.get("against")} == {"blocks.0.key_bias", "blocks.1.key_bias"}
    bad = _step(ring_processes, recipe=f"{PLAIN}:key_bias_layer_averaged", **settings)
    (row,) = bad["cases"]
    assert bad["verdict"] == "fail" and row["first_out"]["name"].startswith("blocks.1."), bad["why"]
    assert row["first_out"]["factor"] == pytest.approx(0.5) and row["first_out"]["ratio"] > 10
    assert row["loss"]["ratio"] <= 1  # only the gradients tell
