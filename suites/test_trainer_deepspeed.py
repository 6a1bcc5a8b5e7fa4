"""`--glue deepspeed_ulysses[:flash_attention_2]`: DeepSpeed 0.19.8's ALST as it ships (issue 61).

Without deepspeed (what `make install` gives): the glue says how to install it, what it refuses is
one line per cause, the flash core's shim is undone, and `ringcheck step --help` names every
built-in glue. With deepspeed (`.ci/run` installs it for its own stage): one tiny model (llama),
P=2, the cases that matter. Over sdpa the one-sequence case passes (no cry wolf) and packed
documents fail, named (DeepSpeed drops the mask: docs/findings/trainers.md); the patched copy of
the finding passes them; over the flash core (bf16, the stand-in) packed documents pass.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("transformers")

from ringcheck.cli import build_parser
from ringcheck.commands.step_model import run_model_step
from ringcheck.glues import BUILT_IN
from ringcheck.models.step import ModelStepConfig, glue_of
from ringcheck.thirdparty.transformers_private import FLASH_UTILS, TRANSFORMERS, causal_lm_class
from ringcheck.trainers import TRAINER_GLUES
from ringcheck.trainers.deepspeed_ulysses import DeepSpeedUlysses
from ringcheck.trainers.flash import FLASH_CORE, install_flash_core

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install deepspeed==0.19.8; .ci/run's "
                                            "DeepSpeed stage installs it)")
PATCHED = "benchmarks.findings.deepspeed_ulysses:sdpa_patched"


def _class(name: str) -> type:
    import transformers
    return causal_lm_class(getattr(transformers, name)())


def test_step_help_names_every_built_in_glue():
    step = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "step")[1]
    text = " ".join(step.format_help().split())
    missing = [g for g in (*BUILT_IN, *TRAINER_GLUES) if g not in text]
    assert not missing and "deepspeed_ulysses:flash_attention_2" in text, missing


@pytest.mark.parametrize("core", ["sdpa", "flash_attention_2"])
def test_a_model_the_core_cannot_run_is_refused_in_one_line_with_the_fix(core):
    """gpt_oss: transformers builds it with no sdpa, and with a hub kernel (sinks) for flash_attention_2."""
    (line,) = DeepSpeedUlysses(core).refuses_core(_class("GptOssConfig"))
    assert "\n" not in line and "GptOssForCausalLM" in line and "not judged here" in line, line
    assert ("_supports_sdpa = False" if core == "sdpa" else "vllm-flash-attn3") in line, line
    assert DeepSpeedUlysses(core).refuses_core(_class("LlamaConfig")) == []


def test_without_deepspeed_the_glue_says_how_to_install_it(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else found(name, *a))
    with pytest.raises(ImportError, match=r"pip install deepspeed==0\.19\.8"):
        glue_of(ModelStepConfig(model="llama", glue="deepspeed_ulysses:flash_attention_2", world_size=2))


def test_the_flash_cores_shim_answers_its_name_and_is_undone():
    own = TRANSFORMERS.reach(FLASH_UTILS, "_lazy_imports")
    undo = install_flash_core()
    try:
        import flash_attn
        answered = TRANSFORMERS.reach(FLASH_UTILS, "_lazy_imports")(FLASH_CORE)
        assert answered[:2] == (flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func)
    finally:
        undo()
    assert TRANSFORMERS.reach(FLASH_UTILS, "_lazy_imports") is own


def _judged(ring_processes, glue: str, cases: tuple[str, ...]) -> dict:
    judged = run_model_step(ModelStepConfig(model="llama", glue=glue, world_size=2, cases=cases), ring_processes)
    return {row["case"]: row for row in judged["cases"]} | {"glue": judged["glue"]}


@pytest.fixture(scope="module")
def shipped(ring_processes):
    return _judged(ring_processes, "deepspeed_ulysses", ("one_sequence", "packed"))


@needs_deepspeed
def test_over_sdpa_one_sequence_passes_and_packed_documents_fail_named(shipped):
    assert shipped["one_sequence"]["verdict"] == "pass", shipped["one_sequence"]
    packed = shipped["packed"]
    assert packed["verdict"] == "fail" and packed["logits"]["error"] > 1e4 * packed["logits"]["budget"], packed
    assert packed["diagnosis"]["loss"] == "documents_crossed", packed["diagnosis"]
    assert any("CP group" in s for s in shipped["glue"]["shims"]), shipped["glue"]


@needs_deepspeed
def test_the_patched_copy_carries_the_documents(ring_processes):
    """The finding's fix (DeepSpeed's core given the gathered sequence's mask) within the float64 budget."""
    row = _judged(ring_processes, PATCHED, ("packed",))["packed"]
    assert row["verdict"] == "pass" and row["logits"]["error"] <= row["logits"]["budget"], row


@needs_deepspeed
def test_over_the_flash_core_packed_documents_pass_in_bfloat16(ring_processes):
    judged = _judged(ring_processes, "deepspeed_ulysses:flash_attention_2", ("packed",))
    assert judged["packed"]["verdict"] == "pass", judged["packed"]
    assert any(FLASH_CORE in s for s in judged["glue"]["shims"]) and judged["glue"]["attn_implementation"] == FLASH_CORE


def test_a_bfloat16_glues_loss_is_taken_in_float64_as_the_truths():
    """A glue judged in bfloat16 (the flash core) rounds its logits, never the loss it is judged on:
    ringcheck's step sums the cross-entropy in float64, as the truth does (`causal_lm_loss`); summed
    in bfloat16 it was 2e-3 off on cohere2, four times the measured budget, with no semantic lost."""
    import torch

    from ringcheck.models.native import causal_lm_loss
    from ringcheck.models.step import CASES, Place, case_batches, correct_step
    from ringcheck.models.tiny import tiny_model

    tiny = tiny_model("llama")
    model = tiny.build("eager", dtype=torch.bfloat16, seed=0)
    batches = case_batches(ModelStepConfig(model="llama", world_size=1), tiny, CASES["one_sequence"], 1)
    got = correct_step(model, batches, Place(0, 1, "contiguous"), None, None, None, train=False, checkpoint=None)
    with torch.no_grad():
        logits = [model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits for mb in batches]
    want = float(causal_lm_loss(logits, [mb["labels"] for mb in batches]))
    assert abs(got["loss"] - want) <= 1e-12 * want, (got["loss"], want)


def test_a_cause_every_case_shares_is_said_once():
    """A glue that raises the same error in every case (a model it cannot build) reads one line, not ten."""
    from ringcheck.commands import step_model

    same = [{"case": c, "verdict": "not run", "why": "the run through --glue g raised: ValueError: no"}
            for c in ("one_sequence", "packed", "uneven")]
    assert step_model._why(same) == "no case could be judged: every case (3): the run through --glue g raised: " \
                                    "ValueError: no"
    other = [*same[:2], {**same[2], "why": "the truth raised: KeyError"}]
    assert step_model._why(other).count("raised") == 3


def test_a_build_lock_left_by_a_killed_build_is_named_not_waited_on(tmp_path):
    """DeepSpeed's comm op is built under torch's cpp_extension lock: a build killed midway leaves the
    lock, and every later run waits on it forever. A lock older than a build ever takes is an error
    naming the file and the fix; a fresh one (a build under way) and none are left alone."""
    from ringcheck.trainers.deepspeed_ulysses import STALE_LOCK_S, stale_build_lock

    assert stale_build_lock(tmp_path, now=1e9) is None
    lock = tmp_path / "lock"
    lock.write_text("")
    made = lock.stat().st_mtime
    assert stale_build_lock(tmp_path, now=made + 30) is None
    line = stale_build_lock(tmp_path, now=made + STALE_LOCK_S + 1200)
    assert line is not None and f"rm {lock}" in line and "30 min old" in line and "\n" not in line
