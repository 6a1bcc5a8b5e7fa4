"""The glues of `ringcheck step --model` (ringcheck.glues): ringcheck's own glue equals the dense
float64 reference per layer call (window, softcap, sinks, documents, chunks, a value head dim
of its own) at P = 2 and 4, zigzag and contiguous, and transformers' eager attention on tiny
models' layers; the refusal path; the user-contract loader's errors."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from reference.dense import dense_grads
from ringcheck.glues import Glue, GlueRefused, check_refusals, load_glue, refusals
from ringcheck.glues.ours import GlueCallError, chunked_boundaries
from ringcheck.ring.layouts import shard

SEQ = 32
BUDGET = 1e-12   # float64 ring vs float64 dense: both exact to ~1e-15 on O(1) values (measured <= 4e-16)

# (name, options of one layer call): transformers' keywords, documents, the module's config
CALLS = {
    "sliding": dict(sliding_window=7),
    "sliding_docs": dict(sliding_window=5, cu=[0, 11, 20, 30]),
    "sinks_sliding": dict(sliding_window=9, sinks=True),
    "softcap_scaling": dict(softcap=0.3, scaling=0.7),
    "chunked_docs": dict(chunk=6, cu=[0, 13, 32]),
    "value_dim": dict(dv=5, sinks=True),
}


def _module(opts, index=0):
    types = ["chunked_attention" if opts.get("chunk") else "full_attention"]
    config = SimpleNamespace(layer_types=types, attention_chunk_size=opts.get("chunk"), sliding_window=None)
    return SimpleNamespace(layer_idx=index, is_causal=True, config=config)


def _expected(opts, q, k, v, sinks):
    """The dense float64 reference in the ring's terms (the glue's translation is what is tested:
    W -> (W - 1, 0), chunks -> documents written out here by hand)."""
    cu = opts.get("cu")
    if opts.get("chunk"):
        cu = {6: {(0, 13, 32): [0, 6, 12, 13, 19, 25, 31, 32]}}[opts["chunk"]][tuple(cu)]
    w = opts.get("sliding_window")
    return dict(causal=True, softmax_scale=opts.get("scaling", 0.25), cu_seqlens=cu,
                window=None if w is None else (w - 1, 0), softcap=opts.get("softcap"), sinks=sinks)


def glue_call_task(member, layout, names):
    """Each call through the glue's registered function on this rank's shard; the max error of
    out, dq, dk, dv (this rank's rows) and dsinks (the sum of the ranks' partial shares) against
    the dense float64 reference."""
    glue = load_glue("ringcheck", layout=layout)
    impl = glue.install(member.group)
    from transformers import AttentionInterface
    fn = AttentionInterface()[impl]
    errors = {}
    for name in names:
        opts = CALLS[name]
        g = torch.Generator().manual_seed(len(name))
        b, h, kvh, d, dv = 2, 4, 2, 8, opts.get("dv", 8)
        q, k = (torch.randn(b, SEQ, n, d, generator=g, dtype=torch.float64) for n in (h, kvh))
        v = torch.randn(b, SEQ, kvh, dv, generator=g, dtype=torch.float64)
        dout = torch.randn(b, SEQ, h, dv, generator=g, dtype=torch.float64)
        sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2 if opts.get("sinks") else None
        want = dense_grads(q, k, v, dout, **_expected(opts, q, k, v, sinks))

        def cut(t):
            return shard(t, layout=layout, rank=member.rank, world_size=dist.get_world_size(member.group), dim=1)

        lq, lk, lv = (cut(t).transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
        ls = None if sinks is None else sinks.clone().requires_grad_(True)
        glue.prepare(opts.get("cu"), member.group)
        kw = {key: opts[key] for key in ("sliding_window", "softcap") if key in opts}
        if ls is not None:
            kw["s_aux"] = ls
        out, weights = fn(_module(opts), lq, lk, lv, None, scaling=opts.get("scaling", 0.25), dropout=0.0,
                          position_ids=None, **kw)
        leaves = [lq, lk, lv] + ([ls] if ls is not None else [])
        grads = torch.autograd.grad(out, leaves, cut(dout))
        err = max((out - cut(want[0])).abs().max().item(),
                  *((gr.transpose(1, 2) - cut(w)).abs().max().item() for gr, w in zip(grads[:3], want[2:5])))
        if ls is not None:
            total = grads[3].clone()
            dist.all_reduce(total, group=member.group)
            err = max(err, (total - want[5]).abs().max().item())
        errors[name] = (err, weights is None, tuple(out.shape))
    return errors


@pytest.mark.parametrize("world_size", [4, 2])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ringcheck_glue_calls_equal_dense_reference(run_on_ring, world_size, layout):
    for rank, errors in enumerate(run_on_ring(world_size, glue_call_task, layout, list(CALLS))):
        for name, (err, no_weights, shape) in errors.items():
            assert err <= BUDGET, f"rank {rank} {layout} P={world_size} {name}: max error {err:.3e} > {BUDGET}"
            assert no_weights, f"{name}: the glue returned attention weights (a ring never forms them)"
            assert shape[1] == SEQ // world_size and shape[2] == 4, f"{name}: output {shape} is not (b, s, h, dv)"


def test_chunked_boundaries_count_from_each_document():
    assert chunked_boundaries(None, 20, 8) == [0, 8, 16, 20]
    assert chunked_boundaries([0, 13, 32], 32, 6) == [0, 6, 12, 13, 19, 25, 31, 32]
    assert chunked_boundaries([0, 5, 10], 12, 8) == [0, 5, 10]     # the tail past 10 stays padding


def _bare_glue():
    glue = load_glue("ringcheck")
    from ringcheck.glues.ours import RingcheckGlue
    state = glue.install.__self__
    assert isinstance(state, RingcheckGlue)
    state.group = object()       # calls below fail before any exchange
    return state


@pytest.mark.parametrize("kwargs, match", [
    (dict(s_aux_typo=1), "s_aux_typo"),
    (dict(cu_seq_lens_q=torch.tensor([0, 4])), "prepare"),
    (dict(dropout=0.1), "dropout"),
    (dict(output_attentions=True), "output_attentions"),
    (dict(is_causal=False), "not causal"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_ringcheck_glue_call_errors_never_swallowed(kwargs, match):
    state = _bare_glue()
    q = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(GlueCallError, match=match):
        state.attention(_module({}), q, q, q, None, scaling=0.5, **kwargs)


def test_chunked_layer_without_a_size_is_an_error():
    state = _bare_glue()
    q = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    module = _module({"chunk": 4})
    module.config.attention_chunk_size = None
    with pytest.raises(GlueCallError, match="attention_chunk_size"):
        state.attention(module, q, q, q, None, scaling=0.5)


def _layer(index, kind="full", window=None, chunk=None, sinks=False, softcap=None):
    return SimpleNamespace(index=index, kind=kind, window=window, chunk=chunk, sinks=sinks, softcap=softcap,
                           scaling=0.25, heads=4, kv_heads=2, head_dim=8, v_head_dim=8)


def test_refusals_name_the_layer_and_the_feature():
    tiny = SimpleNamespace(name="toy", layers=(_layer(0, "sliding", window=8), _layer(1, "linear_attention"),
                                               _layer(2, "chunked", chunk=None)))
    glue = load_glue("ringcheck")
    lines = refusals(glue, tiny)
    assert lines == ["layer 1: attention kind 'linear_attention' (the glue carries full, sliding, chunked) not "
                     "carried by glue 'ringcheck'",
                     "layer 2: a chunked layer without a chunk size not carried by glue 'ringcheck'"]
    with pytest.raises(GlueRefused, match="layer 1: attention kind"):
        check_refusals(glue, tiny)
    fine = SimpleNamespace(name="ok", layers=(_layer(0, "sliding", window=8, sinks=True, softcap=3.0),
                                              _layer(1, "chunked", chunk=4)))
    assert refusals(glue, fine) == []
    check_refusals(glue, fine)
    assert refusals(Glue(name="silent", install=lambda g: "x"), tiny) == []   # a glue that does not say


# --- the user's glue: PKG.MOD:OBJ ----------------------------------------------------------

class GoodGlue:
    layout = "zigzag"
    describe = "a test glue"

    @staticmethod
    def install(group):
        return "eager"

    @staticmethod
    def prepare(cu_seqlens, group):
        return None


class NoInstall:
    layout = "contiguous"


class BadLayout:
    layout = "diagonal"
    install = staticmethod(lambda group: "eager")


class BadName:
    install = staticmethod(lambda group: None)


class BadPrepare:
    install = staticmethod(lambda group: "eager")
    prepare = 3


def test_user_glue_loads_its_contract():
    glue = load_glue(f"{__name__}:GoodGlue")
    assert (glue.layout, glue.describe, glue.install(None)) == ("zigzag", "a test glue", "eager")
    assert glue.prepare is GoodGlue.prepare


@pytest.mark.parametrize("spec, error, match", [
    ("my_glue", ValueError, "package.module:object"),
    ("no_such_pkg_xyz.mod:G", ValueError, "cannot import module 'no_such_pkg_xyz.mod'"),
    (f"{__name__}:Missing", ValueError, "has no attribute 'Missing'"),
    (f"{__name__}:NoInstall", TypeError, "no callable install"),
    (f"{__name__}:BadLayout", ValueError, "layout 'diagonal'"),
    (f"{__name__}:BadPrepare", TypeError, "prepare must be callable"),
    ("", TypeError, "non-empty str"),
])
def test_user_glue_loader_errors_say_the_fix(spec, error, match):
    with pytest.raises(error, match=match):
        load_glue(spec)


def test_user_glue_install_must_return_a_name():
    glue = load_glue(f"{__name__}:BadName")
    with pytest.raises(TypeError, match="attn_implementation name"):
        glue.install(None)


def test_layout_applies_to_ringcheck_glue_only():
    assert load_glue("ringcheck", layout="zigzag").layout == "zigzag"
    with pytest.raises(ValueError, match="applies only"):
        load_glue(f"{__name__}:GoodGlue", layout="contiguous")
    with pytest.raises(ValueError, match="layout='diagonal'"):
        load_glue("ringcheck", layout="diagonal")


# --- against transformers' eager attention on tiny models -----------------------------------

LOGITS_BUDGET = 1e-5  # eager's softmax runs in float32 even in a float64 model (measured: 8e-7 gemma2, 5e-8 mistral, llama; 1e-16 the float64 softmaxes of gpt_oss, llama4)
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, attention_dropout=0.0)
MODELS = {  # name -> (config class, options, documents); windows and chunks that cross the shards
    "mistral": ("MistralConfig", dict(sliding_window=5), None),
    "gemma2": ("Gemma2Config", dict(sliding_window=6, attn_logit_softcapping=0.5, query_pre_attn_scalar=20,
                                    initializer_range=0.2, layer_types=["sliding_attention", "full_attention"]),
               None),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=7, num_local_experts=2, num_experts_per_tok=1,
                                     layer_types=["sliding_attention", "full_attention"]), None),
    "llama4_text": ("Llama4TextConfig", dict(attention_chunk_size=6, intermediate_size_mlp=32, num_local_experts=2,
                                             layer_types=["chunked_attention", "full_attention"],
                                             no_rope_layers=[1, 0]), [0, 13, 32]),
    "llama_docs": ("LlamaConfig", {}, [0, 9, 20, 32]),
}


def tiny_transformers_model(name: str, attn_implementation: str):
    """A tiny random transformers model of MODELS (the same weights for any attention), float64,
    sinks set to values that matter."""
    import transformers
    cls_name, options, _ = MODELS[name]
    config = getattr(transformers, cls_name)(**SMALL, **options)
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if name in ("gpt_oss", "llama4_text") else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                          dtype=torch.float64, **extra)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data = torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel(), dtype=torch.float64)
    return model.eval()


def eager_logits(model, ids, cu):
    """The truth: one device, whole sequences, each document its own forward (positions from 0)."""
    bounds = [0, ids.shape[1]] if cu is None else cu
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[:, s:e], position_ids=torch.arange(e - s)[None], use_cache=False).logits
                          for s, e in zip(bounds, bounds[1:])], dim=1)


def positions(cu, seq):
    bounds = [0, seq] if cu is None else cu
    return torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])])[None]


def model_task(member, layout, names, glue_spec="ringcheck"):
    """Each tiny model through the glue at CP = the group's size (this rank's logits) against
    eager on one device (the same rows); the max difference per model."""
    world = dist.get_world_size(member.group)
    glue = load_glue(glue_spec, layout=layout if glue_spec == "ringcheck" else None)
    impl = glue.install(member.group)
    out = {}
    for name in names:
        cu = MODELS[name][2]
        ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(5))
        truth = eager_logits(tiny_transformers_model(name, "eager"), ids, cu)
        model = tiny_transformers_model(name, impl)
        if glue.prepare is not None:
            glue.prepare(cu, member.group)

        def cut(t):
            return shard(t, layout=glue.layout, rank=member.rank, world_size=world, dim=1)

        with torch.no_grad():
            got = model(input_ids=cut(ids), position_ids=cut(positions(cu, SEQ)), use_cache=False).logits
        out[name] = (got - cut(truth)).abs().max().item()
    return out


@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), (4, "contiguous")])
def test_ringcheck_glue_equals_eager_on_tiny_models(run_on_ring, world_size, layout):
    for rank, errors in enumerate(run_on_ring(world_size, model_task, layout, list(MODELS))):
        for name, err in errors.items():
            assert err <= LOGITS_BUDGET, f"rank {rank} {name} P={world_size} {layout}: logits {err:.3e} off eager"
