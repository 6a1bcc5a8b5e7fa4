"""The tiny models (issue 42, item 1): every layer described as transformers really calls it, the
semantics that decide attention kept and biting, the same weights whatever the attention path, and
the models an attention glue cannot make context-parallel refused by name."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from ringcheck.models import ModelRefused, tiny_model, zoo_names
from ringcheck.models.zoo import PROBE, disagreements, expected_visibility, probe, register_probe

NAMED = ("llama", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "exaone4", "granite",
         "deepseek_v3", "llama4_text")
# what each must keep: (kinds in layer order, window, chunk, sinks, softcap, scaling, heads, kv, head_dim, v)
EXPECTED = {
    "llama": (("full", "full"), None, None, False, None, 128 ** -0.5, 4, 4, 128, 128),
    "qwen3": (("full", "full"), None, None, False, None, 128 ** -0.5, 4, 4, 128, 128),
    "mistral": (("sliding", "sliding"), 12, None, False, None, 128 ** -0.5, 4, 1, 128, 128),
    "gemma2": (("sliding", "full", "sliding"), 12, None, False, 2.0, 256 ** -0.5, 4, 2, 256, 256),
    "gemma3_text": (("sliding", "full", "sliding"), 12, None, False, None, 256 ** -0.5, 4, 2, 256, 256),
    "gpt_oss": (("sliding", "full", "sliding"), 12, None, True, None, 64 ** -0.5, 8, 1, 64, 64),
    "cohere2": (("sliding", "full", "sliding"), 12, None, False, None, 128 ** -0.5, 4, 4, 128, 128),
    "exaone4": (("sliding", "full", "sliding"), 12, None, False, None, 128 ** -0.5, 4, 4, 128, 128),
    "granite": (("full", "full"), None, None, False, None, 1.0, 4, 4, 128, 128),
    "deepseek_v3": (("full", "full"), None, None, False, None, 192 ** -0.5, 4, 4, 192, 128),
    "llama4_text": (("chunked", "full", "chunked"), None, 12, False, None, 128 ** -0.5, 5, 1, 128, 128),
}


def _known(name: str) -> str:
    """`name`, or a one-line skip where the installed transformers has no such model (ringcheck runs
    under every transformers from 5.6 on: docs/reference/models.md, "Which transformers")."""
    if name not in zoo_names():
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no model_type {name!r}")
    return name


@pytest.mark.parametrize("name", NAMED)
def test_the_layers_are_what_transformers_hands_the_attention(name):
    """A probe registered through AttentionInterface records every call (scaling, sliding_window, s_aux,
    softcap, shapes, the mask's visibility): it agrees with `layers`, and `layers` keeps the semantics."""
    tiny = tiny_model(_known(name))
    assert disagreements(tiny, probe(tiny)) == []
    kinds, window, chunk, sinks, softcap, scaling, heads, kv, hd, vd = EXPECTED[name]
    assert tuple(x.kind for x in tiny.layers) == kinds
    for x in tiny.layers:
        assert x.window == (window if x.kind == "sliding" else None)
        assert x.chunk == (chunk if x.kind == "chunked" else None)
        assert (x.sinks, x.softcap, x.heads, x.kv_heads, x.head_dim, x.v_head_dim) == (sinks, softcap, heads, kv,
                                                                                        hd, vd)
        assert x.scaling == pytest.approx(scaling, rel=1e-12)
    assert tiny.vocab_size == 128 and tiny.seq_len == 64


def test_the_probe_names_a_described_layer_that_is_wrong():
    """The check can fail: a window one wider, a lost sink, a default scale are each named."""
    import dataclasses

    tiny = tiny_model("gpt_oss")
    records = probe(tiny)
    wrong = dataclasses.replace(tiny.layers[0], window=13, sinks=False, scaling=1.0)
    bad = disagreements(dataclasses.replace(tiny, layers=(wrong, *tiny.layers[1:])), records)
    assert any("sliding_window 12 passed, 13 described" in b for b in bad)
    assert any("s_aux" in b for b in bad) and any("scaling" in b for b in bad)
    assert any("mask differs" in b for b in bad)
    assert expected_visibility(tiny.layers[0], 64)[40].nonzero().flatten().tolist() == list(range(29, 41))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name, paths", [("gemma3_text", ("eager", "sdpa", PROBE)), ("gpt_oss", ("eager", PROBE))])
def test_the_same_seed_gives_the_same_weights_whatever_the_attention(name, paths):
    """(gpt_oss and gemma2 refuse sdpa: transformers says so when asked.)"""
    register_probe()
    tiny = tiny_model(name)
    models = [tiny.build(path, seed=3) for path in paths]
    first, *rest = (dict(m.named_parameters()) for m in models)
    for other in rest:
        assert first.keys() == other.keys() and all(torch.equal(first[k], other[k]) for k in first)
    assert torch.equal(_logits(models[0], IDS), _logits(models[-1], IDS))  # the probe computes eager's attention
    a = first
    assert all(p.dtype == torch.float64 for p in a.values())
    other = dict(tiny.build("eager", seed=4).named_parameters())
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_sinks_and_softcap_bite():
    """Measured: dropping gpt_oss's sinks moves the logits by 38% (relative L2), dropping gemma2's
    scaled softcap by 22%; a cap of 50 on the default init moved nothing."""
    tiny = tiny_model("gpt_oss")
    model = tiny.build("eager")
    assert model.config._experts_implementation == "eager"  # grouped_mm refuses float64
    assert "grouped_mm -> eager" in tiny.disabled["experts_implementation"]
    assert tiny.kept["sinks"].startswith("per head on layers 0,1,2")
    a = _logits(model, IDS)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert (a - _logits(model, IDS)).norm() > 0.1 * a.norm()
    model = tiny_model("gemma2").build("eager")
    a = _logits(model, IDS)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (a - _logits(model, IDS)).norm() > 0.1 * a.norm()


def test_the_window_bites_and_crosses_every_shard_boundary():
    """W=12 at 64 tokens: shorter than a contiguous shard at P=4 (16), longer than a zigzag chunk at P=4 (8),
    no divisor of 64; dropping mistral's window moves its logits by 98% (relative L2)."""
    import dataclasses

    from ringcheck.models.scale import scaled_window

    w = scaled_window(64)
    assert w == 12 and 8 < w < 16 and 64 % w and all(n % scaled_window(n) for n in (32, 48, 96, 128))
    tiny = tiny_model("mistral")
    full = type(tiny.config).from_dict({**tiny.config.to_dict(), "sliding_window": None})
    a, b = _logits(tiny.build("eager"), IDS), _logits(dataclasses.replace(tiny, config=full).build("eager"), IDS)
    assert (a - b).norm() > 0.5 * a.norm()


def test_dropout_is_switched_off_and_said():
    tiny = tiny_model("seed_oss")
    assert tiny.config.attention_dropout == 0.0 and "attention_dropout" in tiny.disabled
    assert "0.1 -> 0.0" in tiny.disabled["attention_dropout"]
    model = tiny.build("eager")
    assert model.training
    assert torch.equal(_logits(model, IDS), _logits(model, IDS))


@pytest.mark.parametrize("name, said", [("qwen3_next", "linear_attention"), ("mamba", "state-space")])
def test_token_mixing_layers_are_refused_by_name(name, said):
    with pytest.raises(ModelRefused, match=f"layers 0,.*{said}"):
        tiny_model(name)


def test_a_users_config_json_with_special_ids_outside_the_vocab(tmp_path):
    """cohere2's eos 255001 and a made-up pad 200000 move inside the 128-token vocab, distinct, said."""
    from transformers import AutoConfig

    data = AutoConfig.for_model("cohere2").to_dict()
    data.update(pad_token_id=200000, sliding_window=512)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    tiny = tiny_model(str(path))
    c = tiny.config
    assert tiny.name == "cohere2" and tiny.scaled["eos_token_id"] == (255001, c.eos_token_id)
    assert tiny.scaled["pad_token_id"] == (200000, c.pad_token_id) and c.bos_token_id == 5
    assert {c.pad_token_id, c.eos_token_id} == {126, 127}
    assert tiny.scaled["sliding_window"] == (512, 12)
    with pytest.raises(ValueError, match="no such file"):
        tiny_model(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="close names: qwen2"):
        tiny_model("qwen2x")


def test_a_second_vocab_the_config_keeps_at_the_first_size_shrinks_with_it():
    """marian's decoder_vocab_size (its decoder's embeddings and lm_head) is vocab_size's 58101: left
    there, its tiny model's logits were 58101 wide and its zoo rows took 30-50 s."""
    tiny = tiny_model("marian")
    assert tiny.config.decoder_vocab_size == tiny.config.vocab_size == 128, tiny.config
    assert tiny.scaled["decoder_vocab_size"] == (58101, 128)
    assert tiny.build("eager").get_output_embeddings().out_features == 128


def test_the_zoo_is_every_causal_lm():
    names = zoo_names()
    assert len(names) > 150 and set(NAMED) <= set(names)


def test_per_layer_settings_follow_the_kept_layers():
    """gemma4's full layers have a head dim of 512 (its per_layer_config) and the config forces the last
    layer full; llama4's no-rope flags and MoE layer indices follow the kept layers."""
    tiny = tiny_model(_known("gemma4_text"))
    assert disagreements(tiny, probe(tiny)) == []
    assert [(x.kind, x.head_dim, x.scaling) for x in tiny.layers] == [
        ("sliding", 256, 1.0), ("full", 512, 1.0), ("sliding", 256, 1.0), ("full", 512, 1.0)]
    assert tiny.scaled["layers kept (original indices)"][1] == [0, 5, 6, 29]
    llama4 = tiny_model("llama4_text")
    assert llama4.config.no_rope_layers == [1, 0, 1] and llama4.config.moe_layers == [0, 1, 2]
    assert llama4.scaled["layers kept (original indices)"][1] == [0, 3, 4]


def test_a_recurrent_stack_is_as_deep_as_the_kept_layers():
    """hrm_text: each H/L stack's depth (num_layers_per_stack, 16) shrinks with the layers (to 2), and the
    config derives its cache slots from it again; L_bp_cycles counts cycles, not layers, and stays."""
    tiny = tiny_model(_known("hrm_text"))
    assert tiny.config.num_layers_per_stack == 2 and tiny.scaled["num_layers_per_stack"] == (16, 2)
    config = tiny.config
    assert config.num_hidden_layers == 2 * config.H_cycles * (config.L_cycles + 1)
    assert "L_bp_cycles" not in tiny.scaled and config.L_bp_cycles == [2]


def test_a_head_dim_the_model_derives_scales_and_is_said():
    """gpt2 computes its head dim from the width in the module: 64 -> 16, and the probe agrees."""
    tiny = tiny_model("gpt2")
    assert tiny.scaled["head_dim"] == (64, 16) and "head_dim" not in tiny.kept
    assert disagreements(tiny, probe(tiny)) == []


def test_a_model_outside_the_attention_interface_is_refused():
    with pytest.raises(ModelRefused, match="bloom: its attention .* not dispatched through transformers' Attention"):
        tiny_model("bloom")


def test_a_config_json_that_transformers_cannot_read_is_refused_in_one_line(tmp_path):
    """A user's config.json whose model_type this transformers does not know, or that is not JSON:
    a ValueError that names the file and the fix, not transformers' list of every model type."""
    unknown, broken = tmp_path / "unknown.json", tmp_path / "broken.json"
    unknown.write_text('{"model_type": "nosuch", "hidden_size": 64}')
    broken.write_text("{")
    with pytest.raises(ValueError, match="model_type 'nosuch' is not one transformers") as info:
        tiny_model(str(unknown))
    assert len(str(info.value)) < 400
    with pytest.raises(ValueError, match="is not JSON"):
        tiny_model(str(broken))


def test_a_model_type_is_made_once_and_each_caller_gets_its_own_copy():
    """Every task of a `step --model` run asks for the tiny model; a model_type's is made once per
    process, and what one caller changes (a glue's configure writes on the config) no other sees."""
    from ringcheck.models import tiny as tiny_module

    first = tiny_model("mistral")
    assert ("mistral", 64) in tiny_module._MADE
    first.config.sliding_window = 999
    first.kept["planted"] = True
    second = tiny_model("mistral")
    assert second is not first and second.config is not first.config
    assert second.config.sliding_window == 12 and "planted" not in second.kept
    assert second.config.to_dict() == tiny_module._MADE[("mistral", 64)].config.to_dict()
    torch.testing.assert_close(second.build("eager", seed=3).state_dict(),
                               tiny_module._make("mistral", 64).build("eager", seed=3).state_dict(), rtol=0, atol=0)


def test_a_task_builds_its_model_once_and_each_case_gets_a_pristine_copy():
    """`reused_builds`: one build per (model, attention, dtype, seed) in the scope, each caller a copy
    as built (what a case did to its model no later case sees); under a torch mode, a fresh build."""
    from torch.overrides import TorchFunctionMode

    from ringcheck.models import tiny as tiny_module

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    tiny = tiny_model("llama")
    alone = tiny.build("eager", seed=5).state_dict()
    with tiny_module.reused_builds():
        first = tiny.build("eager", seed=5)
        (key, (_, kept)), = tiny_module._BUILT[-1].items()
        with torch.no_grad():
            next(first.parameters()).add_(1.0)  # a case changes its model
        second = tiny.build("eager", seed=5)
        assert second is not first and second is not kept
        torch.testing.assert_close(second.state_dict(), alone, rtol=0, atol=0)
        assert tiny.build("eager", seed=6) is not None and len(tiny_module._BUILT[-1]) == 2
        with Passing():
            tiny.build("eager", seed=7)
        assert len(tiny_module._BUILT[-1]) == 2  # not kept: built under a mode
    assert not tiny_module._BUILT
