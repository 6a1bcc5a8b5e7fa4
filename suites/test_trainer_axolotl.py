"""`--glue axolotl[:flash_attention_2]` (issue 63, item 3): axolotl 0.21's context parallelism,
axolotl-ringmaster 0.2.7's `setup` and `shard_batch`, with its own choice of Ulysses, ring or both
by the K/V heads. A tiny llama at P=2 passes through it (Ulysses, said in the report, the shims
listed); a planted bug (rotary positions local to each shard) fails, named; what ringmaster would
raise at P is refused before any rank, in one line with the numbers; `axolotl@0.19` exits 2 in
one line. The zoo at P=2 and P=4 is reports/models/trainers_axolotl.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("ringmaster") is None:
    pytest.skip("axolotl-ringmaster not installed: pip install --no-deps axolotl-ringmaster==0.2.7",
                allow_module_level=True)
pytest.importorskip("transformers")

from ringcheck.commands.step_model import run_model_step
from ringcheck.models.step import ModelStepConfig
from ringcheck.trainers.axolotl import Ringmaster, strategy

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "benchmarks.findings.axolotl:planted_local_positions"


def _judged(ring_processes, glue: str, cases: tuple[str, ...]) -> dict:
    judged = run_model_step(ModelStepConfig(model="llama", glue=glue, world_size=2, cases=cases), ring_processes)
    return {row["case"]: row for row in judged["cases"]} | {"glue": judged["glue"], "verdict": judged["verdict"]}


def test_llama_passes_and_the_report_says_which_strategy_ringmaster_chose(ring_processes):
    judged = _judged(ring_processes, "axolotl", ("one_sequence", "packed"))
    assert judged["verdict"] == "pass", judged
    assert "it chose Ulysses over all 2 ranks (auto_select for 4 K/V heads at P=2)" in judged["glue"]["describe"]
    assert "shard_batch" in judged["glue"]["sharding"]
    shims = judged["glue"]["shims"]
    assert len(shims) == 3 and any("intra_node_size" in s for s in shims) and any("math_block" in s for s in shims)


def test_a_planted_bug_fails_named(ring_processes):
    row = _judged(ring_processes, PLANTED, ("one_sequence",))["one_sequence"]
    assert row["verdict"] == "fail" and row["logits"]["error"] > 10 * row["logits"]["budget"], row
    assert row["diagnosis"]["loss"] == "local_positions", row["diagnosis"]


@pytest.mark.parametrize(("kv", "world", "want"), [(4, 4, (4, 1)), (1, 4, (1, 4)), (2, 4, (2, 2)), (3, 2, (1, 2))])
def test_ringmasters_own_choice_by_the_heads(kv, world, want):
    u, r, words = strategy(kv, world)
    assert (u, r) == want and f"{kv} K/V heads at P={world}" in words, words


def test_heads_the_chosen_ulysses_degree_does_not_divide_are_refused_in_one_line():
    from transformers import LlamaConfig

    tiny = SimpleNamespace(config=LlamaConfig(num_attention_heads=4, num_key_value_heads=4),
                           layers=[SimpleNamespace(index=0, heads=4, kv_heads=4), SimpleNamespace(index=1, heads=6,
                                                                                                   kv_heads=2)])
    (line,) = Ringmaster().refuses_ring(tiny, 4)
    assert "Ulysses degree 4" in line and "1 (6 query / 2 K/V heads)" in line and "ulysses.py L144-149" in line, line
    assert Ringmaster().refuses_ring(SimpleNamespace(config=tiny.config, layers=tiny.layers[:1]), 4) == []


@pytest.mark.cli
def test_axolotl_019_exits_2_in_one_line(tmp_path):
    command = [sys.executable, "-m", "ringcheck", "step", "--model", "llama", "--glue", "axolotl@0.19", "--world-size",
               "2"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("transformers 5.16.1") == 1 and "Traceback" not in out.stderr, out.stderr
