"""The native truth of `ringcheck step --model` (ringcheck/models/native.py) and the diagnosis by
semantics (ringcheck/models/semantics.py), on tiny transformers models built here from their
configs (float64, random weights, seeded).

Budgets: the float64 step budget of `ringcheck.step.verdict.budgets` (2 n K u, n the counted
targets, about 2e-13 for 63 targets), the one a `--model` verdict applies.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
)

from ringcheck.models import tiny_model
from ringcheck.models.native import (
    NATIVE,
    attention_implementation,
    float64_softmax,
    native_logits,
    native_step,
    run_documents,
)
from ringcheck.models.semantics import (
    LOSSES,
    Diagnoser,
    LayerSemantics,
    candidates,
    diagnose,
    layer_semantics,
    local_key_length,
    semantic_step,
)
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
    equals the float64 computation of the capped scores (cap scaled to 0.05 so that it bites on
    the scores of random weights, ~0.1) within the float64 budget, logits and every gradient.
    The same computation in one forward over the packed batch (other matrix shapes, as a CP
    run's shards are) moves only the norms' weight gradients, by ~1e-7 (measured 7e-8 .. 1.3e-7):
    Gemma's RMSNorm computes them in float32 (`1 + weight.float()`), so any glue's gradients for
    them need float32's budget, 2 n u; every other figure stays within float64's."""
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, num_hidden_layers=2, sliding_window=12, attn_logit_softcapping=0.05,
                          final_logit_softcapping=None, query_pre_attn_scalar=8)
    model, mbs = Gemma2ForCausalLM(config).double(), [_batch()]
    truth = native_step(model, mbs)
    sem = {i: LayerSemantics(scaling=8 ** -0.5, window=12 if t == "sliding_attention" else None, softcap=0.05)
           for i, t in enumerate(config.layer_types)}
    budget = _float64_budget(mbs)
    assert max(_distance(truth, semantic_step(model, sem, mbs))) <= budget
    whole = semantic_step(model, sem, mbs, whole=True)
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    assert relative(whole[2][0], truth[2][0]) <= budget
    norms = {k for k in truth[1] if k.endswith("norm.weight")}
    assert len(norms) == 9
    assert max(relative(whole[1][k], truth[1][k]) for k in truth[1] if k not in norms) <= budget
    float32 = max(relative(whole[1][k], truth[1][k]) for k in norms)
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


# ---- the diagnosis by semantics
#
# The layers' semantics are given as TinyModel.layers would give them (index, kind, window,
# chunk, sinks, softcap, scaling, head_dim), for models built here from their configs.

HEAD_DIM = SMALL["head_dim"]


def _tiny(*layers):
    """A stand-in of TinyModel with `layers` (window, chunk, sinks, softcap, scaling) per layer."""
    return SimpleNamespace(layers=tuple(
        SimpleNamespace(index=i, kind="sliding" if w else "chunked" if c else "full", window=w, chunk=c, sinks=k,
                        softcap=cap, scaling=scale, head_dim=HEAD_DIM) for i, (w, c, k, cap, scale) in enumerate(layers)))


def _gemma3():
    """Sliding (W=12) and full layers alternating; the scale query_pre_attn_scalar^-0.5 = 0.25, not
    head_dim^-0.5."""
    torch.manual_seed(0)
    types = ["sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=4, sliding_window=12, layer_types=types,
                              query_pre_attn_scalar=16, final_logit_softcapping=None, attn_logit_softcapping=None)
    return Gemma3ForCausalLM(config).double(), _tiny(*[(12 if t == types[0] else None, None, False, None, 0.25)
                                                       for t in types])


def _gemma2():
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, num_hidden_layers=2, sliding_window=64, attn_logit_softcapping=0.05,
                          final_logit_softcapping=None, query_pre_attn_scalar=8)
    return Gemma2ForCausalLM(config).double(), _tiny(*[(64, None, False, 0.05, HEAD_DIM ** -0.5), (None, None, False,
                                                                                                   0.05, HEAD_DIM ** -0.5)])


def _gpt_oss():
    """Sinks on every layer, given values that take a real share of each softmax (exp(1.5))."""
    torch.manual_seed(0)
    config = GptOssConfig(**{**SMALL, "intermediate_size": 32}, num_hidden_layers=2, sliding_window=12,
                          num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = GptOssForCausalLM(config).double()
    model.set_experts_implementation("eager")  # grouped_mm refuses float64
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(1.5 + 0.5 * torch.randn(SMALL["num_attention_heads"]))
    return model, _tiny((12, None, True, None, HEAD_DIM ** -0.5), (None, None, True, None, HEAD_DIM ** -0.5))


def _llama4():
    """A chunked layer (chunk 12) and a full one."""
    torch.manual_seed(0)
    config = Llama4TextConfig(**{**SMALL, "intermediate_size": 32, "intermediate_size_mlp": 64}, num_hidden_layers=2,
                              attention_chunk_size=12, num_local_experts=2, num_experts_per_tok=1,
                              layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0])
    return Llama4ForCausalLM(config).double(), _tiny((None, 12, False, None, HEAD_DIM ** -0.5),
                                                     (None, None, False, None, HEAD_DIM ** -0.5))


MODELS = {"gemma3": _gemma3, "gemma2": _gemma2, "gpt_oss": _gpt_oss, "llama4": _llama4}
_DIAGNOSERS: dict = {}


def _diagnoser(name: str, world_size: int = 4) -> tuple:
    """(model, tiny, micro-batches, Diagnoser) of a model, made once per module run."""
    if (name, world_size) not in _DIAGNOSERS:
        model, tiny = MODELS[name]()
        mbs = [_batch()]
        _DIAGNOSERS[name, world_size] = (model, tiny, mbs, Diagnoser(model, tiny, mbs, world_size=world_size))
    return _DIAGNOSERS[name, world_size]


def _ring_like(figures, seed=3):
    """Figures as a correct float64 ring would hand them back: off by ~1e-15, relative."""
    gen = torch.Generator().manual_seed(seed)
    z, g = figures
    wobble = lambda t: t * (1 + 1e-15 * torch.randn(t.shape, generator=gen, dtype=t.dtype))  # noqa: E731
    return [wobble(x) for x in z], None if g is None else {k: wobble(v) for k, v in g.items()}


@pytest.mark.parametrize("name", MODELS)
def test_the_recomputation_without_a_loss_is_the_truth(name):
    """Every layer's attention from its semantics (window, chunk, sinks, softcap, scale) in float64
    reproduces the native truth (measured 0 to 4e-17 on the logits): the ground every candidate
    stands on."""
    *_, d = _diagnoser(name)
    assert d.reproducible and d.reproduced <= d.tolerance, d.reproduced


PLANTS = [("gemma3", "window_dropped", (0, 2)), ("gemma3", "window_dropped", (2,)),
          ("gemma3", "window_wider", (0, 2)), ("gemma3", "window_narrower", (0,)),
          ("gemma3", "scale_default", (0, 1, 2, 3)), ("gemma3", "scale_default", (3,)),
          ("gemma3", "documents_crossed", (0, 1, 2, 3)), ("gemma3", "documents_crossed", (1,)),
          ("gemma3", "mask_plain_causal", (0, 2)), ("gemma2", "softcap_dropped", (0, 1)),
          ("gemma2", "softcap_dropped", (0,)), ("gpt_oss", "sinks_dropped", (0, 1)),
          ("gpt_oss", "sinks_dropped", (1,)), ("llama4", "mask_plain_causal", (0,))]


@pytest.mark.parametrize("name, loss, layers", PLANTS, ids=[f"{n}-{x}-{'_'.join(map(str, y))}" for n, x, y in PLANTS])
def test_a_planted_loss_is_named_with_its_layers(name, loss, layers):
    """The figures of the model computed with the loss (wobbled by 1e-15, as a float64 ring's)
    are diagnosed as that loss on exactly those layers, to ~1e-15."""
    *_, d = _diagnoser(name)
    [planted] = [c for c in d.candidates if loss in c.losses and len(c.parts) == 1 and c.layers == layers]
    figures = d.figures(planted)
    out = d.diagnose(*_ring_like(figures))
    assert out.matches and out.matches[0].candidate is planted, out.summary()
    assert loss in out.matches[0].candidate.losses and out.layers == layers
    assert out.matches[0].logits <= 1e-14 and out.matches[0].grads <= 1e-13
    words = f"on layer {layers[0]}" if len(layers) == 1 else f"and {layers[-1]}"
    assert words in out.summary() and out.summary().startswith("your logits and gradients equal the model with")
    assert len(out.matches) == 1  # no other candidate is within the tolerance


def test_two_losses_at_once_are_named_together():
    """prime-rl PR #2828's glue lost the window and the scale at once: that pair, on all their
    layers, is a candidate of its own and is named with both parts and their layers."""
    *_, d = _diagnoser("gemma3")
    [planted] = [c for c in d.candidates if c.parts == ("window_dropped", "scale_default")]
    out = d.diagnose(*_ring_like(d.figures(planted)))
    assert out.matched == "window_dropped+scale_default" and out.layers == (0, 1, 2, 3) and len(out.matches) == 1
    assert ("the sliding windows removed on layers 0 and 2 and the scale head_dim^-0.5 (0.3536) instead of the "
            "layers' own (0.25) on layers 0, 1, 2 and 3") in out.summary()
    pairs = [c.parts for c in d.candidates if len(c.parts) == 2]
    assert ("window_wider", "window_dropped") not in pairs and ("window_dropped", "documents_crossed") in pairs


def test_the_window_dropped_only_on_short_shards_depends_on_the_ring():
    """W = 12 on 64 tokens: a rank's 16 keys at P=4 exceed it (a glue that passes the window only
    above its key length is right there: no such candidate), its 8 keys at P=8 do not (the
    window dropped on every sliding layer, named as such). Zigzag pads to 2P: 60 tokens are 15
    keys a rank contiguous, 16 zigzag."""
    assert (local_key_length(64, 4, "contiguous"), local_key_length(64, 8, "contiguous")) == (16, 8)
    assert (local_key_length(60, 4, "contiguous"), local_key_length(60, 4, "zigzag")) == (15, 16)
    native = {0: LayerSemantics(0.25, window=12), 1: LayerSemantics(0.25), 2: LayerSemantics(0.25, window=20)}
    dims = dict.fromkeys(native, HEAD_DIM)
    at4 = candidates(native, dims, seq_len=64, world_size=4, layout="contiguous", packed=False)
    [short] = [c for c in at4 if "window_dropped_short_shard" in c.losses and len(c.parts) == 1]
    assert short.layers == (2,) and dict(short.semantics)[2].window is None and dict(short.semantics)[0].window == 12
    at2 = candidates(native, dims, seq_len=64, world_size=2, layout="contiguous", packed=False)
    assert not [c for c in at2 if "window_dropped_short_shard" in c.losses]
    model, tiny, mbs, d = _diagnoser("gemma3", world_size=8)
    [planted] = [c for c in d.candidates if c.parts == ("window_dropped",) and c.layers == (0, 2)]
    figures = d.figures(planted)
    out = d.diagnose(*_ring_like(figures))
    assert out.matches[0].candidate is planted and "window_dropped_short_shard" in planted.losses
    assert "8 keys per rank at P=8" in out.summary()
    assert not [c for c in _diagnoser("gemma3")[3].candidates if "window_dropped_short_shard" in c.losses]


def test_a_correct_observation_needs_no_loss():
    """The truth as a float64 ring hands it back, and the exact recomputation (another correct
    computation): "no semantic is lost", nothing tried."""
    model, tiny, mbs, d = _diagnoser("gemma3")
    _, grads, logits = semantic_step(model, layer_semantics(tiny), mbs, whole=True)
    for figures in (_ring_like(d.truth), (logits, grads)):
        out = d.diagnose(*figures)
        assert out.matched == "none" and out.truth.within and not out.tried
        assert out.summary().endswith("no semantic is lost")


@pytest.mark.parametrize("perturbation", ["logits_and_grads_scaled", "weights_moved", "grads_of_one_logits_of_other"])
def test_an_unrelated_error_matches_nothing(perturbation):
    """A wrong computation that is no loss of semantics is named as none of them, with the nearest
    said: figures scaled by 1 + 1e-3; the truth of a model whose layer-1 q_proj moved by 1e-3; the
    logits of the truth with the gradients of a dropped window."""
    model, tiny, mbs, d = _diagnoser("gemma3")
    z, g = d.truth
    if perturbation == "logits_and_grads_scaled":
        figures = [x * 1.001 for x in z], {k: v * 1.001 for k, v in g.items()}
    elif perturbation == "weights_moved":
        moved, _ = _gemma3()
        with torch.no_grad():
            moved.model.layers[1].self_attn.q_proj.weight.mul_(1.001)
        _, grads, logits = native_step(moved, mbs)
        figures = logits, grads
    else:
        dropped = d.figures(next(c for c in d.candidates if c.losses[0] == "window_dropped"))
        figures = z, dropped[1]
    out = d.diagnose(*figures)
    assert out.matched is None and not out.matches and out.nearest is not None
    assert "match none of the known losses" in out.summary() and "the nearest is" in out.summary()


def test_an_evaluation_is_diagnosed_from_its_logits_alone():
    model, tiny, mbs, _ = _diagnoser("gemma2")
    native = {0: LayerSemantics(HEAD_DIM ** -0.5, window=64, softcap=0.05), 1: LayerSemantics(HEAD_DIM ** -0.5)}
    with torch.no_grad():
        _, _, logits = semantic_step(model, native, mbs)
    out = diagnose(model, tiny, mbs, logits[0], None, world_size=2)
    assert out.matched == "softcap_dropped" and out.layers == (1,) and out.truth.grads is None
    assert out.summary().startswith("your logits equal the model with the attention logit softcap dropped on layer 1")
    assert out.to_dict()["matched"] == "softcap_dropped"


def test_the_diagnosis_refuses_figures_it_cannot_compare():
    model, tiny, mbs, d = _diagnoser("gemma2")
    z, g = d.truth
    with pytest.raises(ValueError, match="cannot be compared"):
        d.diagnose([x[:, :-1] for x in z], g)
    with pytest.raises(ValueError, match="lack"):
        d.diagnose(z, {k: v for k, v in list(g.items())[1:]})
    with pytest.raises(ValueError, match="gradients=True"):
        d.diagnose(z, None)
    assert set(LOSSES) == {"window_dropped", "window_wider", "window_narrower", "window_dropped_short_shard",
                           "sinks_dropped", "softcap_dropped", "scale_default", "documents_crossed",
                           "mask_plain_causal", "chunk_dropped_short_shard"}


def _tiny_diagnoser(name: str, cu=DOCS):
    """A Diagnoser of models-tiny's TinyModel (its layers' semantics, its build) at P=4."""
    tiny = tiny_model(name)
    model, mb = tiny.build("eager"), _batch(cu)
    mb["input_ids"] %= tiny.vocab_size
    return model, tiny, [mb], Diagnoser(model, tiny, [mb], world_size=4)


def test_a_tiny_models_layers_reproduce_it_and_name_its_losses():
    """gpt_oss as tiny_model scales it (3 layers, sliding and full, sinks on every layer, MoE):
    the recomputation from TinyModel.layers is the truth, and sinks dropped on layer 1 alone (a
    glue that swallows s_aux on the full layers) is named as such."""
    model, tiny, mbs, d = _tiny_diagnoser("gpt_oss")
    assert d.reproducible and d.reproduced <= d.tolerance
    [planted] = [c for c in d.candidates if c.losses == ("sinks_dropped",) and c.layers == (1,)]
    figures = d.figures(planted)
    out = d.diagnose(*_ring_like(figures))
    assert out.matched == "sinks_dropped" and out.layers == (1,) and out.matches[0].candidate is planted
    assert "the attention sinks (s_aux) dropped on layer 1" in out.summary()


def test_a_model_that_reads_the_forwards_own_index_is_said():
    """llama4's attention temperature (on its no-rope layers) reads the token's index in the
    forward, not position_ids: a document of 16 tokens put before the sequence in the same forward
    moves the sequence's logits (1.3e-2, tiny_model's floor_scale 12), as a CP rank's shard does.
    An attention function alone cannot carry that; the diagnosis says so instead of widening its
    tolerance to it. gemma3_text's figures do not move at all."""
    assert _tiny_diagnoser("gemma3_text", None)[3].shape_dependence == 0.0
    model, tiny, mbs, d = _tiny_diagnoser("llama4_text", None)
    assert d.reproducible and d.shape_dependence > 1e-3 and d.tol_z <= d.tolerance
    z, g = d.truth
    out = d.diagnose([x * 1.001 for x in z], g)
    assert out.matched is None and "not from position_ids" in out.summary()


def test_a_loss_is_named_through_the_models_own_float32_noise():
    """An unpacked batch, the planted figures computed with every row twice (other matrix shapes,
    as a CP shard's): Gemma 2's norm-weight gradients then sit ~1e-7 off the candidate's own
    (float32 sums over the tokens), a thousand times the float64 budget; the diagnosis measured
    that noise, takes float32's budget, and still names the loss, and only it."""
    model, tiny = _gemma2()
    mbs = [_batch(None)]
    d = Diagnoser(model, tiny, mbs, world_size=2)
    float32 = 2 * 63 * torch.finfo(torch.float32).eps / 2  # 2 n u: the tolerance once float32 steps show
    assert _float64_budget(mbs) < d.noise[1] <= float32 and d.tolerance == pytest.approx(float32)
    [planted] = [c for c in d.candidates if c.losses == ("softcap_dropped",) and c.layers == (0, 1)]
    doubled = [{k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in mbs]
    _, grads, logits = semantic_step(model, dict(planted.semantics), doubled)
    out = d.diagnose([z[:1] for z in logits], grads)
    assert out.matched == "softcap_dropped" and out.layers == (0, 1) and len(out.matches) == 1, out.summary()
    assert _float64_budget(mbs) < out.matches[0].grads


def test_a_key_bias_gradient_is_measured_as_part_of_the_whole():
    """bert's key biases: their true gradient is float64 residue (~1e-17, analytically zero). A
    bfloat16 glue's sits ~1e-3 of the whole gradient off it; relative to the residue that printed
    "gradients to 2.7e+14" (every figure the same, whatever the glue did). Measured as a part of
    the whole gradient (as the verdict judges it), the distance is the glue's 1e-3."""
    model, tiny, mbs, d = _tiny_diagnoser("bert")
    z, g = d.truth
    whole = sum(float(v.norm()) ** 2 for v in g.values() if v is not None) ** 0.5
    gen = torch.Generator().manual_seed(0)
    biases = [k for k, v in g.items() if k.endswith("key.bias")]
    assert biases and all(float(g[k].norm()) < 1e-12 * whole for k in biases)
    observed = {k: v + 1e-3 * (whole if k in biases else float(v.norm())) / v.numel() ** 0.5
                * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in g.items()}
    out = d.diagnose(z, observed)
    assert 5e-4 < out.truth.grads < 2e-3, out.truth.distance()


@pytest.mark.parametrize("layers, words", [
    (((12, None, False, None, HEAD_DIM ** -0.5),), "the recomputation fails (RuntimeError: attention "),
    (((12, None, False, None, HEAD_DIM ** -0.5), (None, None, False, None, HEAD_DIM ** -0.5)), "off it"),
])
def test_semantics_that_do_not_reproduce_the_model_diagnose_nothing(layers, words):
    """Layers that miss one of the model's attention modules, or say the wrong thing of one (a
    Mistral's layer 1 has a window too): no candidate is tried, and the summary says why."""
    model, mbs = _mistral(), [_batch()]
    d = Diagnoser(model, _tiny(*layers), mbs, world_size=2)
    out = d.diagnose([z * 1.001 for z in d.truth[0]], d.truth[1])
    assert not d.reproducible and not d.candidates and out.matched is None
    assert out.summary().startswith("no diagnosis by semantics") and words in out.summary()


def test_a_kept_diagnoser_judges_another_glues_figures_within_their_own_tolerance(monkeypatch):
    """`diagnose(..., key=)`: the recomputations of a model and batch made once per process and
    kept; another glue's figures (another tolerance: a bf16 glue's budget) get the diagnosis a
    diagnoser of their own gives, and the first glue's again its own."""
    from ringcheck.models import semantics

    model, tiny, mbs, d = _diagnoser("gemma2")
    [planted] = [c for c in d.candidates if c.parts == ("softcap_dropped",) and c.layers == (0,)]
    figures = _ring_like(d.figures(planted))
    made = []
    real = semantics.Diagnoser.__init__
    monkeypatch.setattr(semantics.Diagnoser, "__init__", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    monkeypatch.setattr(semantics, "_MADE", {})
    key = ("gemma2", "a batch")
    runs = [(figures, None), (figures, 1e-3), (_ring_like(d.truth), 1e-3), (figures, None)]
    kept = [diagnose(model, tiny, mbs, *f, world_size=4, tolerance=t, key=key) for f, t in runs]
    assert len(made) == 1
    alone = [diagnose(model, tiny, mbs, *f, world_size=4, tolerance=t) for f, t in runs]
    assert [k.to_dict() for k in kept] == [a.to_dict() for a in alone]
    assert kept[0].matched == "softcap_dropped" and kept[2].matched == "none" and kept[1].tolerance == 1e-3
