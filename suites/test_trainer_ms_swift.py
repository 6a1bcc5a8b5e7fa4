"""`--glue ms_swift[:flash_attention_2]` and `ms_swift_ring` (issue 63): ms-swift 4.6.0's
`SequenceParallel.prepare`, its forward hook's sharding and its loss gather, as it ships.

A tiny llama at P=2 passes through its Ulysses over sdpa (one sequence, two rows), and the report
names its sharding and its shims; packed documents over sdpa are not run, with its own condition
(its padding_free needs flash attention); a planted bug in its sharding (the labels shifted inside
each rank's shard) fails, named; its ring over sdpa is refused before any rank starts (exit 2, one
line with the head count and P); a crash inside its code is one line with its file:line. A length its
pad fills with position id -1 on bert (its embeddings look the -1 up: one rank would crash, the other
wait in the all-to-all) is said in one line before the forward, and llama there runs and passes.

The zoo at P=2 and P=4 is reports/models/trainers_ms_swift.md.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if any(importlib.util.find_spec(p) is None for p in ("swift", "accelerate", "peft")):
    pytest.skip("ms-swift not installed: pip install --no-deps ms-swift==4.6.0 accelerate==1.16.0 peft==0.20.0",
                allow_module_level=True)
pytest.importorskip("transformers")

from ringcheck.commands.step_model import check_model_before_start, run_model_step
from ringcheck.glues import GlueRefused
from ringcheck.models.step import ModelStepConfig
from ringcheck.trainers.ms_swift import MsSwift, crash_line, ms_swift_glue, swift

ROOT = Path(__file__).resolve().parents[1]


class ShiftedInShard(MsSwift):
    """A planted bug in ms-swift's sharding: `pad_and_split_inputs` splits the labels first and shifts
    each rank's piece (the last token of every shard loses its target)."""

    def run_loss(self, model, batch, total, group):
        sp = swift().sp
        original = sp.pad_and_split_inputs

        def shifted_in_shard(input_ids, input_embeds, labels, *args, **kwargs):
            before = None if labels is None else torch.roll(labels, shifts=1, dims=-1)  # its roll undone
            out = list(original(input_ids, input_embeds, before, *args, **kwargs))
            if out[2] is not None:
                out[2] = torch.roll(out[2], shifts=-1, dims=-1)
                out[2][..., -1] = -100
            return tuple(out)

        sp.pad_and_split_inputs = shifted_in_shard
        try:
            return super().run_loss(model, batch, total, group)
        finally:
            del sp.pad_and_split_inputs  # the class's method again


planted = ms_swift_glue(adapter=ShiftedInShard())  # a Glue: the loader takes it as it is


def _judged(ring_processes, glue: str, cases: tuple[str, ...]) -> dict:
    judged = run_model_step(ModelStepConfig(model="llama", glue=glue, world_size=2, cases=cases), ring_processes)
    return {row["case"]: row for row in judged["cases"]} | {"glue": judged["glue"], "verdict": judged["verdict"]}


@pytest.fixture(scope="module")
def shipped(ring_processes):
    return _judged(ring_processes, "ms_swift", ("one_sequence", "batch2", "packed"))


def test_llama_passes_through_ms_swifts_ulysses(shipped):
    assert shipped["verdict"] == "pass", shipped
    for name in ("one_sequence", "batch2"):
        row = shipped[name]
        assert row["verdict"] == "pass" and row["logits"]["error"] <= row["logits"]["budget"], row
    assert "forward pre-hook" in shipped["glue"]["sharding"] and "GatherLoss" in shipped["glue"]["sharding"]
    shims = shipped["glue"]["shims"]
    assert any("device mesh" in s and "CP group" in s for s in shims) and any("RANK" in s for s in shims), shims
    assert any("model_info" in s for s in shims) and any("stubs" in s for s in shims), shims


def test_packed_documents_over_sdpa_are_not_run_with_ms_swifts_condition(shipped):
    row = shipped["packed"]
    assert row["verdict"] == "not run" and "padding_free, which needs flash attention" in row["why"], row
    assert "sft_args.py L186-197" in row["why"], row


def test_a_planted_bug_in_its_sharding_fails_named(ring_processes):
    row = _judged(ring_processes, "suites.test_trainer_ms_swift:planted", ("one_sequence",))["one_sequence"]
    assert row["verdict"] == "fail", row
    assert row["diagnosis"]["loss"] == "labels_shifted_in_shards", row["diagnosis"]


def test_its_ring_over_sdpa_is_refused_before_any_rank_starts():
    with pytest.raises(GlueRefused, match=r"1 K/V heads at P=2: .* gcd = 1 ranks and a zig-zag ring of 2 .*"
                                          r"NotImplementedError.*sequence_parallel.py L264\); run --glue ms_swift_ring"):
        check_model_before_start(ModelStepConfig(model="mistral", glue="ms_swift", world_size=2))


def test_its_ring_where_it_picks_none_is_refused():
    with pytest.raises(GlueRefused, match=r"4 K/V heads at P=2: .* no ring .* --glue ms_swift:flash_attention_2"):
        check_model_before_start(ModelStepConfig(model="llama", glue="ms_swift_ring", world_size=2))


def test_a_crash_inside_its_code_is_one_line_with_its_file_and_line():
    sp = swift().module
    try:
        sp.SequenceParallel().split(torch.zeros(1, 3), dim=1)  # no world size yet: its code raises inside
    except Exception as exc:
        line = crash_line(exc)
    assert "\n" not in line and "swift/sequence_parallel/sequence_parallel.py:" in line, line
    assert line.startswith("ms-swift 4.6.0 crashed on a configuration it accepts (a finding"), line


@pytest.mark.cli
def test_the_command_refuses_its_ring_over_sdpa_with_exit_2(tmp_path):
    command = [sys.executable, "-m", "ringcheck", "step", "--model", "mistral", "--glue", "ms_swift", "--world-size", "4"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("1 K/V heads at P=4") == 1 and "Traceback" not in out.stderr, out.stderr


def _one_case(ring_processes, model: str, glue: str, case: str) -> dict:
    judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=2, cases=(case,)), ring_processes)
    return judged["cases"][0]


def test_a_length_its_pad_fills_with_minus_one_on_bert_is_said_on_every_rank_before_the_forward(ring_processes):
    """bert over its flash Ulysses, 61 tokens at P=2: its pad gives the last rank position id -1, which
    bert's embeddings look up (the token_type_ids buffer gathered by position id): that rank would
    crash and the other wait in the all-to-all. The glue says it, one line, before the forward."""
    row = _one_case(ring_processes, "bert", "ms_swift:flash_attention_2", "not_divisible")
    assert row["verdict"] == "not run", row
    why = row["why"]
    assert "\n" not in why and "61 tokens pad to 62 with position id -1 (sequence_parallel.py L598)" in why, why
    assert re.search(r"which BertLMHeadModel reads as an index \(gather at "
                     r"transformers/models/bert/modeling_bert\.py:\d+\)", why), why
    assert why.endswith("the others wait in the all-to-all (ulysses.py L68)") and "gloo" not in why, why


def test_a_model_that_takes_position_id_minus_one_is_run_where_its_pad_fills(ring_processes):
    """llama (rotary positions) over the same glue and case: ms-swift runs it, and it passes."""
    row = _one_case(ring_processes, "llama", "ms_swift:flash_attention_2", "not_divisible")
    assert row["verdict"] == "pass", row


@pytest.mark.parametrize("model, where", [("bert", r"gather at transformers/models/bert/modeling_bert\.py:\d+"),
                                          ("gpt2", r"embedding at transformers/models/gpt2/modeling_gpt2\.py:\d+"),
                                          ("llama", None), ("biogpt", None)])
def test_the_probe_names_the_lookup_at_minus_one_and_passes_a_model_that_reaches_its_attention(model, where):
    """`negative_lookup` on one process: bert's buffer gather and gpt2's learned positions are named;
    llama (rotary) and biogpt (learned positions offset by 2: -1 reads row 1) reach their attention."""
    from ringcheck.models.tiny import tiny_model
    from ringcheck.trainers.lookup import negative_lookup

    tiny = tiny_model(model)
    ids, pos = torch.ones(1, 8, dtype=torch.long), torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1]])
    found = negative_lookup(tiny.build("sdpa", dtype=torch.float64), "sdpa", ids, pos)
    assert (found is None) if where is None else re.fullmatch(where, found or ""), found
