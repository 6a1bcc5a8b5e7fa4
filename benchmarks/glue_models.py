"""Tiny transformers models with the attention features the glues must carry, and the rank task
that runs one through a glue at CP = P against transformers' eager attention on one device.
Shared by suites/test_glues.py and benchmarks/glue_findings.py (until `ringcheck.models.tiny`
builds any architecture, these few configs are written out by hand)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringcheck.glues import load_glue
from ringcheck.ring.layouts import shard
from ringcheck.thirdparty.transformers_private import keep_attention_state

SEQ = 32
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
                                             no_rope_layers=[1, 0], floor_scale=4), [0, 13, 32]),  # temperature bites
    "llama_docs": ("LlamaConfig", {}, [0, 9, 20, 32]),
    "mistral_wide": ("MistralConfig", dict(sliding_window=10), None),  # wider than a shard at P=4, narrower than 32
    "llama4_wide": ("Llama4TextConfig", dict(attention_chunk_size=10, intermediate_size_mlp=32, num_local_experts=2,
                                             layer_types=["chunked_attention", "full_attention"],
                                             no_rope_layers=[1, 0], floor_scale=4), [0, 13, 32]),  # chunk > a P=4 shard
}
MOE_EAGER = ("GptOssConfig", "Llama4TextConfig")  # experts through grouped_mm refuse float64: eager experts


def tiny_transformers_model(spec: tuple, attn_implementation: str, dtype: torch.dtype = torch.float64):
    """A tiny random model of `spec` (config class, options, documents): the same weights for any
    attention and dtype (initialised in float64, then cast), sinks set to values that matter."""
    import transformers
    cls_name, options, _ = spec
    config = getattr(transformers, cls_name)(**SMALL, **options)
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if cls_name in MOE_EAGER else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                          dtype=torch.float64, **extra)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data = torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel(), dtype=torch.float64)
    return model.to(dtype).eval()


def positions(cu, seq: int) -> torch.Tensor:
    """position_ids (1, seq) restarting at every document boundary."""
    bounds = [0, seq] if cu is None else cu
    return torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])])[None]


def eager_logits(model, ids, cu):
    """The truth: one device, whole sequences, each document its own forward (positions from 0)."""
    bounds = [0, ids.shape[1]] if cu is None else cu
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[:, s:e], position_ids=torch.arange(e - s)[None], use_cache=False).logits
                          for s, e in zip(bounds, bounds[1:])], dim=1)


def glue_logits(member, glue_spec: str, layout: str | None, specs: dict, dtype: str = "float64",
                seq: int = SEQ) -> dict:
    """Each model of `specs` through the glue at CP = the group's size: {name: this rank's logits
    (float64) or, for a glue that fails loudly, the error's text}."""
    world = dist.get_world_size(member.group)
    glue = load_glue(glue_spec, layout=layout)
    restore = keep_attention_state()  # the process's transformers as it was, for the tasks that run next
    impl = glue.install(member.group)
    out = {}
    try:
        for name, spec in specs.items():
            cu = spec[2]
            model = tiny_transformers_model(spec, impl, getattr(torch, dtype))
            if glue.prepare is not None:
                glue.prepare([0, seq] if cu is None else cu, member.group)

            def cut(t):
                return shard(t, layout=glue.layout, rank=member.rank, world_size=world, dim=1)

            try:
                with torch.no_grad():
                    out[name] = model(input_ids=cut(token_ids(seq)), position_ids=cut(positions(cu, seq)),
                                      use_cache=False).logits.double()
            except Exception as exc:  # a glue that fails loudly: its message is the finding
                out[name] = f"{type(exc).__name__}: {exc}"
    finally:
        if glue.uninstall is not None:
            glue.uninstall()
        restore()
    return out


def token_ids(seq: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(5))


def model_task(member, glue_spec: str, layout: str | None, specs: dict, dtype: str = "float64", seq: int = SEQ):
    """Each model of `specs` through the glue at CP = the group's size against float64 eager on
    one device: {name: (max |logits - truth| on this rank's rows, max |truth|)} (or the error's text)."""
    got = glue_logits(member, glue_spec, layout, specs, dtype, seq)
    world = dist.get_world_size(member.group)
    layout = load_glue(glue_spec, layout=layout).layout
    out = {}
    for name, logits in got.items():
        if isinstance(logits, str):
            out[name] = logits
            continue
        truth = eager_logits(tiny_transformers_model(specs[name], "eager"), token_ids(seq), specs[name][2])
        mine = shard(truth, layout=layout, rank=member.rank, world_size=world, dim=1)
        out[name] = ((logits - mine).abs().max().item(), truth.abs().max().item())
    return out
