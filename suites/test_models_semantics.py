"""The native truth of `ringcheck step --model` (ringcheck/models/native.py) and the diagnosis by
semantics (ringcheck/models/semantics.py), on tiny transformers models built here from their
configs (float64, random weights, seeded).

Budgets: the float64 step budget of `ringcheck.step.verdict.budgets` (2 n K u, n the counted
targets, about 2e-13 for 63 targets), the one a `--model` verdict applies.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from ringcheck.models.native import (
    NATIVE,
    attention_implementation,
    float64_softmax,
    native_logits,
    native_step,
    run_documents,
)
from ringcheck.models.semantics import LayerSemantics, semantic_step
from ringcheck.step.verdict import budgets, relative

N = 64
DOCS = (0, 21, 45, 64)
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def _mistral(layers=2, window=12):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SMALL, num_hidden_layers=layers, sliding_window=window)).double()


def _batch(cu=DOCS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (1, N), generator=gen)
    labels = ids.clone()
    if cu is None:
        pos = torch.arange(N)[None]
    else:
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
        labels[:, list(cu[1:-1])] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu}


def _float64_budget(mbs) -> float:
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    return budgets(n, "float64", None)[1]


def _distance(a, b) -> tuple[float, float]:
    (_, ga, za), (_, gb, zb) = a, b
    return (max(relative(x, y) for x, y in zip(za, zb)), max(relative(ga[k], gb[k]) for k in gb))


# ---- the native truth


def test_the_truth_equals_a_float64_attention_and_eager_alone_does_not():
    """The truth (eager under float64_softmax) against the same model with every layer's attention
    computed in float64 from its semantics (reference.dense_attention): within the float64 budget
    (measured 3e-17 on the logits, 3e-16 on the gradients). transformers' eager as shipped
    (softmax in float32) is ~1e-8 away: the float32 softmax the budget would otherwise carry."""
    model, mbs = _mistral(), [_batch()]
    truth = native_step(model, mbs)
    exact = semantic_step(model, {i: LayerSemantics(scaling=8 ** -0.5, window=12) for i in range(2)}, mbs)
    budget = _float64_budget(mbs)
    logits, grads = _distance(truth, exact)
    assert logits <= budget and grads <= budget, (logits, grads, budget)
    with torch.no_grad(), attention_implementation(model, NATIVE):
        shipped = run_documents(model, mbs[0]["input_ids"], mbs[0]["position_ids"], DOCS)
    off = relative(shipped, truth[2][0])
    assert 1e-10 < off < 1e-5, off  # float32's softmax, not a semantic difference


def test_documents_are_kept_apart_whatever_the_mask():
    """Changing the first document's tokens leaves the other documents' logits bit-identical;
    the same packed sequence through transformers' eager as a user calls it (the cache on by
    default: no packing mask is built) attends across the boundaries, and differs there."""
    model, mb = _mistral(), _batch()
    with torch.no_grad():
        a = native_logits(model, mb["input_ids"], mb["position_ids"], DOCS)
        ids = mb["input_ids"].clone()
        ids[:, :DOCS[1]] = (ids[:, :DOCS[1]] + 1) % SMALL["vocab_size"]
        b = native_logits(model, ids, mb["position_ids"], DOCS)
        with attention_implementation(model, NATIVE), float64_softmax():
            whole = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
    assert torch.equal(a[:, DOCS[1]:], b[:, DOCS[1]:])
    assert not torch.equal(a[:, :DOCS[1]], b[:, :DOCS[1]])
    assert relative(whole[:, DOCS[1]:], a[:, DOCS[1]:]) > 1e-3


def test_the_truths_loss_is_float64_over_the_global_count():
    """Two micro-batches: the loss is the summed float64 cross-entropy of the shifted labels over
    the count of both (a hand computation, to 1e-15), not the mean of the two means, and not
    transformers' own loss (float32: ~1e-8 off)."""
    model = _mistral()
    a, b = _batch(None, 1), _batch(DOCS, 2)
    b["labels"][:, 5:30] = -100
    loss, _, logits = native_step(model, [a, b])
    terms, count = [], 0
    for z, mb in zip(logits, (a, b)):
        target = mb["labels"][0, 1:]
        keep = target != -100
        terms.append(-torch.log_softmax(z[0, :-1], -1)[keep].gather(1, target[keep, None]).sum())
        count += int(keep.sum())
    hand = sum(terms) / count
    assert loss.dtype == torch.float64 and abs(float(loss - hand)) <= 1e-15 * float(hand)
    halves = (terms[0] / int((a["labels"][0, 1:] != -100).sum()) + terms[1] / int((b["labels"][0, 1:] != -100).sum()))
    assert abs(float(loss - halves / 2)) > 1e-6
    with torch.no_grad(), float64_softmax(), attention_implementation(model, NATIVE):
        theirs = model(input_ids=a["input_ids"], labels=a["labels"], use_cache=False).loss
        ours = native_step(model, [a])[0]
    assert 1e-12 < abs(float(theirs - ours)) < 1e-6


def test_the_truth_leaves_the_model_as_it_found_it():
    model = _mistral()
    before = model.config._attn_implementation
    _, grads, _ = native_step(model, [_batch()])
    assert model.config._attn_implementation == before
    assert all(p.grad is None for p in model.parameters())
    assert set(grads) == {n for n, _ in model.named_parameters()}
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_the_truth_with_a_softcap_equals_the_float64_attention():
    """Gemma 2's eager caps the scores before its float32 softmax: under float64_softmax the truth
    still equals the float64 computation of the capped scores (cap scaled to 0.05 so that it bites on
    the scores of random weights, ~0.1): the
    logits to 3e-17 and every gradient but the norms' to 4e-16. Gemma's RMSNorm computes in
    float32 (`(1 + weight.float())`), so its weights' gradients are float32 sums over the tokens:
    they differ by ~1e-7 between two correct float64 attentions (measured 7e-8 .. 1.3e-7), within
    2 n u of float32, the budget any glue's gradients for them need."""
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, num_hidden_layers=2, sliding_window=12, attn_logit_softcapping=0.05,
                          final_logit_softcapping=None, query_pre_attn_scalar=8)
    model, mbs = Gemma2ForCausalLM(config).double(), [_batch()]
    truth = native_step(model, mbs)
    sem = {i: LayerSemantics(scaling=8 ** -0.5, window=12 if t == "sliding_attention" else None, softcap=0.05)
           for i, t in enumerate(config.layer_types)}
    exact = semantic_step(model, sem, mbs)
    budget = _float64_budget(mbs)
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    assert relative(exact[2][0], truth[2][0]) <= budget
    norms = {k for k in truth[1] if k.endswith("norm.weight")}
    assert len(norms) == 9
    assert max(relative(exact[1][k], truth[1][k]) for k in truth[1] if k not in norms) <= budget
    float32 = max(relative(exact[1][k], truth[1][k]) for k in norms)
    assert budget < float32 <= 2 * n * torch.finfo(torch.float32).eps / 2, float32
    uncapped = semantic_step(model, {i: replace_softcap(s) for i, s in sem.items()}, mbs)
    assert min(_distance(truth, uncapped)) > 1e-4


def replace_softcap(sem: LayerSemantics) -> LayerSemantics:
    return LayerSemantics(scaling=sem.scaling, window=sem.window, chunk=sem.chunk, sinks=sem.sinks, softcap=None)


@pytest.mark.parametrize("call, error", [
    (lambda m, mb: native_logits(m, mb["input_ids"], mb["position_ids"], (0, 30, 20, 64)), ValueError),
    (lambda m, mb: native_logits(torch.nn.Linear(2, 2), mb["input_ids"], mb["position_ids"], None), TypeError),
    (lambda m, mb: native_step(m, [{**mb, "labels": torch.full_like(mb["labels"], -100)}]), ValueError),
    (lambda m, mb: native_step(m, []), ValueError),
])
def test_the_truth_refuses_what_it_cannot_judge(call, error):
    with pytest.raises(error):
        call(_mistral(layers=1), _batch())
