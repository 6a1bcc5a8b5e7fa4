"""ringcheck's Ulysses glue (`--glue ulysses`, ringcheck.glues.ulysses) and its catalogue mutants
(issue 61): the glue equals the dense float64 reference per layer call (windows, documents, chunks,
softcap, sinks, a value head dim of its own; K/V heads divisible by P, and fewer than P, replicated);
`step --model` passes through it; each mutant fails with its class named by the diagnosis on a model
having the feature; heads not divisible by P are refused with the numbers (exit 2).

The rings run once per module (`steps`, `calls`); every model x P sweep is
`python -m benchmarks.ulysses_glue` (reports/models/ulysses_glue.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from ringcheck.commands.step_model import check_model_before_start, run_model_step
from ringcheck.glues import GlueRefused, load_glue
from ringcheck.models.heads import head_variants
from ringcheck.models.step import ModelStepConfig
from ringcheck.reference.dense import dense_grads
from ringcheck.ring.layouts import shard

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32
BUDGET = 1e-12   # float64 glue vs float64 dense reference: both exact to ~1e-15 on O(1) values (measured <= 9e-16)
MUTANTS = "ringcheck.catalogue.glue_mutants:"

# (name, options of one layer call): K/V heads, transformers' keywords, documents, chunks, value head dim
CALLS = {
    "mha_window": dict(kv=4, sliding_window=7),
    "gqa_documents": dict(kv=2, sliding_window=5, cu=[0, 11, 20, 32]),
    "mqa_sinks": dict(kv=1, sinks=True, sliding_window=9),
    "gqa_softcap_scaling": dict(kv=2, softcap=0.3, scaling=0.7),
    "mqa_chunks_docs": dict(kv=1, chunk=6, cu=[0, 13, 32]),
    "mha_value_dim": dict(kv=4, dv=5, sinks=True),
}
CHUNKED = {(6, (0, 13, 32)): [0, 6, 12, 13, 19, 25, 31, 32]}   # chunks of 6 from each document's start, by hand


def _module(opts):
    types = ["chunked_attention" if opts.get("chunk") else "full_attention"]
    config = SimpleNamespace(layer_types=types, attention_chunk_size=opts.get("chunk"), sliding_window=None)
    return SimpleNamespace(layer_idx=0, is_causal=True, config=config)


def call_task(member, names):
    """Each call through the Ulysses glue's registered function on this rank's shard: the max error
    of out, dq, dk, dv (this rank's rows) and dsinks (the ranks' shares summed) against dense_grads."""
    glue = load_glue("ulysses")
    from transformers import AttentionInterface
    fn = AttentionInterface()[glue.install(member.group)]
    world = dist.get_world_size(member.group)
    errors = {}
    for name in names:
        opts = CALLS[name]
        g = torch.Generator().manual_seed(len(name))
        b, h, kvh, d, dv = 2, 4, opts["kv"], 8, opts.get("dv", 8)
        q, k = (torch.randn(b, SEQ, n, d, generator=g, dtype=torch.float64) for n in (h, kvh))
        v = torch.randn(b, SEQ, kvh, dv, generator=g, dtype=torch.float64)
        dout = torch.randn(b, SEQ, h, dv, generator=g, dtype=torch.float64)
        sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2 if opts.get("sinks") else None
        cu = opts.get("cu")
        w = opts.get("sliding_window")
        want = dense_grads(q, k, v, dout, causal=True, softmax_scale=opts.get("scaling", 0.25), sinks=sinks,
                           cu_seqlens=CHUNKED[(opts["chunk"], tuple(cu))] if opts.get("chunk") else cu,
                           window=None if w is None else (w - 1, 0), softcap=opts.get("softcap"))

        def cut(t):
            return shard(t, layout="contiguous", rank=member.rank, world_size=world, dim=1)

        lq, lk, lv = (cut(t).transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
        ls = None if sinks is None else sinks.clone().requires_grad_(True)
        glue.prepare(cu, member.group)
        kw = {key: opts[key] for key in ("sliding_window", "softcap") if key in opts}
        kw.update({} if ls is None else {"s_aux": ls})
        out, _ = fn(_module(opts), lq, lk, lv, None, scaling=opts.get("scaling", 0.25), dropout=0.0, **kw)
        grads = torch.autograd.grad(out, [lq, lk, lv] + ([ls] if ls is not None else []), cut(dout))
        err = max((out - cut(want[0])).abs().max().item(),
                  *((gr.transpose(1, 2) - cut(x)).abs().max().item() for gr, x in zip(grads[:3], want[2:5])))
        if ls is not None:
            total = grads[3].clone()
            dist.all_reduce(total, group=member.group)
            err = max(err, (total - want[5]).abs().max().item())
        errors[name] = (err, tuple(out.shape))
    return errors


@pytest.fixture(scope="module")
def calls(ring_processes):
    """Every call at P=4: K/V heads 4 split over the ranks, 2 and 1 replicated to them (P=2: `steps`)."""
    if (ring_processes.size or 4) < 4:
        pytest.skip(f"needs a ring of 4 ranks; the world has {ring_processes.size} (--nproc-per-node=4)")
    return {4: ring_processes.run(4, call_task, list(CALLS))}


def test_ulysses_glue_calls_equal_the_dense_reference(calls):
    for world, ranks in calls.items():
        for rank, errors in enumerate(ranks):
            for name, (err, shape) in errors.items():
                assert err <= BUDGET, f"P={world} rank {rank} {name}: max error {err:.3e} > {BUDGET}"
                assert shape[1] == SEQ // world and shape[2] == 4, f"{name}: output {shape} is not this shard's"


# (glue, model having the feature, case, the class the diagnosis must name; None: the glue must pass)
STEPS = {
    "ulysses": ("mistral", "packed", None),   # K/V heads 1 < P=2 (replicated), sliding windows, documents
    "ulysses_gqa_regrouped": ("gemma3_text", "one_sequence", "kv_heads_regrouped"),
    "ulysses_heads_permuted": ("llama", "one_sequence", "heads_permuted"),
    "ulysses_sinks_misrouted": ("gpt_oss", "one_sequence", "sinks_misrouted"),
    "ulysses_rotary_local": ("llama", "one_sequence", "local_positions"),
    "ulysses_documents_crossed": ("llama", "packed", "documents_crossed"),
    "ulysses_labels_rolled": ("llama", "one_sequence", "labels_rolled_in_shards"),
}


@pytest.fixture(scope="module")
def steps(ring_processes):
    out = {}
    for glue, (model, case, _) in STEPS.items():
        spec = glue if glue == "ulysses" else MUTANTS + glue
        out[glue] = run_model_step(ModelStepConfig(model=model, glue=spec, world_size=2, cases=(case,)),
                                   ring_processes)
    return out


def test_step_through_the_ulysses_glue_passes(steps):
    judged = steps["ulysses"]
    assert judged["verdict"] == "pass", judged["why"]
    (row,) = judged["cases"]
    assert row["logits"]["error"] <= row["logits"]["budget"] and all(g["ratio"] <= 1 for g in row["gradients"])


@pytest.mark.parametrize("mutant", [m for m, (_, _, c) in STEPS.items() if c])
def test_each_ulysses_mutant_fails_with_its_class_named(steps, mutant):
    from ringcheck.catalogue.glue_mutants import ULYSSES_BUGS
    assert set(ULYSSES_BUGS) == {m for m, (_, _, c) in STEPS.items() if c}   # every mutant is tested here
    judged, (_, _, named) = steps[mutant], STEPS[mutant]
    (row,) = judged["cases"]
    assert judged["verdict"] == "fail" and row["logits"]["error"] + row["loss"]["error"] > 0, judged["why"]
    assert row["diagnosis"]["matched"] and row["diagnosis"]["loss"] == named == ULYSSES_BUGS[mutant], row["diagnosis"]


def test_head_variants_are_those_of_a_ulysses_all_to_all():
    """Few candidates, each a layout the all-to-all makes: 4 query heads, 2 K/V heads, P=4."""
    kinds = {kind: m for m, kind, _ in head_variants("kv_heads_regrouped", 4, 2, 4)}
    assert kinds == {"tiled": (0, 1, 0, 1), "tiled_to_ranks": (0, 1, 0, 1)}
    assert head_variants("kv_heads_regrouped", 4, 4, 4) == [] == head_variants("kv_heads_regrouped", 8, 1, 4)
    assert [m for m, _, _ in head_variants("heads_permuted", 4, 4, 4)] == [(3, 0, 1, 2), (1, 2, 3, 0)]
    assert [m for m, _, _ in head_variants("heads_permuted", 4, 4, 2)] == [(2, 3, 0, 1)]   # +1 and -1 are one
    assert [m for m, _, _ in head_variants("sinks_misrouted", 8, 1, 2)] == [(0, 1, 2, 3, 0, 1, 2, 3),
                                                                          (4, 5, 6, 7, 0, 1, 2, 3)]


def test_labels_shifted_inside_the_shards_are_named_with_the_global_count():
    """The other labels class (the targets lost at each shard's end, not rolled), on one process: a
    step whose rank-0 shard's last token has no target, its loss still divided by the global count."""
    from ringcheck.models.native import NATIVE, native_logits, step_with
    from ringcheck.models.semantics import diagnose
    from ringcheck.models.tiny import tiny_model
    from ringcheck.step.cases import CASES, micro_batches
    from ringcheck.step.contract import IGNORE, shift_labels

    tiny = tiny_model("llama")
    model = tiny.build(NATIVE, dtype=torch.float64, seed=0)
    mbs = micro_batches(CASES["one_sequence"], vocab=tiny.vocab_size, seed=0, dp=1)
    targets = [shift_labels(mb["labels"]) for mb in mbs]
    for t in targets:   # P=2, contiguous: the first shard's last token (the second's is the sequence's last)
        t[:, t.shape[1] // 2 - 1] = IGNORE
    _, grads, logits = step_with(model, mbs, native_logits, targets)
    found = diagnose(model, tiny, mbs, logits, grads, world_size=2)
    assert found.matched == "labels_shifted_in_shards", found.summary()
    assert "loses its target" in found.summary()


def test_heads_not_divisible_by_p_are_refused_with_the_numbers():
    with pytest.raises(GlueRefused, match=r"layers 0, 1, 2: 5 query heads are not divisible by P=2"):
        check_model_before_start(ModelStepConfig(model="llama4_text", glue="ulysses", world_size=2))
    from ringcheck.glues.ulysses import refuses_ring
    layer = SimpleNamespace(index=1, heads=6, kv_heads=3)
    assert refuses_ring(SimpleNamespace(layers=(layer,)), 2) == [
        "layer 1: 3 K/V heads and P=2 divide neither way (Ulysses splits K/V heads over the ranks or replicates "
        "them P/K times); run a --world-size that 3 divides or that divides 3"]


@pytest.mark.cli
def test_the_command_refuses_heads_not_divisible_with_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ringcheck", "step", "--model", "llama4_text", "--glue", "ulysses",
                          "--world-size", "4"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "5 query heads are not divisible by P=4" in out.stderr and "Traceback" not in out.stderr
