"""A tiny model of any transformers decoder: its attention semantics kept, everything else small.

A `--model` check judges the glue between a model's attention and a ring, so what must survive the
scaling is everything that decides attention (the pattern of layer types, windows and chunks that
bite at the check's sequence length, sinks, softcap, the scale, the GQA ratio, head dims, QK norms,
the rope variant), while widths, depth, vocab and experts shrink until a case runs in seconds on a
CPU. Every change is recorded (`kept`, `scaled`, `disabled`) so the report can say what was judged.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .scale import ModelRefused, kind_of, refuse_mixing_modules, scale_config

SINK_MEAN = 1.5   # exp(1.5) ~ 4.5 against at most a window's dozen keys: the sinks take a real share


@dataclass(frozen=True)
class LayerAttention:
    """What decides one layer's attention in the native model (read from the scaled config)."""

    index: int
    kind: str
    window: int | None
    chunk: int | None
    sinks: bool
    softcap: float | None
    scaling: float
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class TinyModel:
    name: str
    config: Any
    layers: tuple[LayerAttention, ...]
    kept: dict[str, Any]
    scaled: dict[str, tuple[Any, Any]]
    disabled: dict[str, str]
    vocab_size: int
    seq_len: int
    moe: bool

    def build(self, attn_implementation: str, *, dtype=torch.float64, seed: int = 0) -> torch.nn.Module:
        """A *ForCausalLM with random weights that depend on `seed` and each parameter's name only,
        so every attention implementation (the native truth and the glue under test) gets the same."""
        from transformers import AutoModelForCausalLM  # start-up time: transformers loads in ~3 s

        if not isinstance(attn_implementation, str) or not attn_implementation:
            raise TypeError(f"attn_implementation must be a name (eager, sdpa, or one registered with "
                            f"transformers' AttentionInterface), got {attn_implementation!r}")
        extra = {"experts_implementation": "eager"} if self.moe and _experts_settable(self.config) else {}
        torch.manual_seed(seed)  # transformers' own init of what we do not overwrite (buffers, rope)
        model = AutoModelForCausalLM.from_config(_copy(self.config), attn_implementation=attn_implementation,
                                                 dtype=dtype, **extra)
        _init_weights(model, seed)
        model.train()  # dropout is off in the config; train mode is what a step runs
        return model


def zoo_names() -> tuple[str, ...]:
    """Every causal-LM model_type transformers registers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # start-up time

    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(name_or_path: str, *, seq_len: int = 64) -> TinyModel:
    """The tiny model of `name_or_path`: a transformers model_type, or a path to a config.json."""
    if not isinstance(seq_len, int) or seq_len < 16:
        raise ValueError(f"seq_len must be an int >= 16 (windows are scaled to bite at it), got {seq_len!r}")
    original, name, scaled = _original_config(name_or_path)
    d = original.to_dict()
    kept, disabled, moe, added_head_dim = scale_config(name, d, seq_len, scaled)
    d.pop("transformers_version", None)
    config = type(original).from_dict(d)
    meta = _meta_model(config)
    if added_head_dim and not _honours_head_dim(meta, d["head_dim"]):
        kept.pop("head_dim")  # the model derives it from hidden/heads: it scales with them
        d.pop("head_dim")
        config = type(original).from_dict(d)
        meta = _meta_model(config)
        tiny_dim = _layers(config)[0].head_dim if _layers(config) else None
        scaled["head_dim"] = (added_head_dim, tiny_dim)
    refuse_mixing_modules(name, meta)
    layers = _layers(config)
    return TinyModel(name=name, config=config, layers=layers, kept=kept, scaled=scaled, disabled=disabled,
                     vocab_size=config.get_text_config().vocab_size, seq_len=seq_len, moe=moe)


# --- the original config ---------------------------------------------------------------------------------


def _original_config(name_or_path: str):
    from transformers import AutoConfig  # start-up time

    names = zoo_names()
    scaled: dict[str, tuple[Any, Any]] = {}
    if not isinstance(name_or_path, str):
        raise TypeError(f"--model takes a model_type or a path to config.json, got {name_or_path!r}")
    path = Path(name_or_path)
    if name_or_path in names:
        config = AutoConfig.for_model(name_or_path)
    elif path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--model {name_or_path}: no such file {file} (give a config.json or a model_type)")
        data = json.loads(file.read_text())
        if "model_type" not in data:
            raise ValueError(f"{file} has no model_type: it is not a transformers config.json")
        config = AutoConfig.for_model(data.pop("model_type"), **data)
    else:
        close = [n for n in names if n.replace("-", "_").startswith(name_or_path.replace("-", "_")[:4])]
        raise ValueError(f"--model {name_or_path!r} is neither a causal-LM model_type of transformers nor a "
                         f"config.json (close names: {', '.join(close[:8]) or 'none'}; all: zoo_names())")
    name = config.model_type
    text = config.get_text_config()
    if text is not config:  # a multimodal wrapper: its text model is the decoder under test
        if text.model_type not in names:
            raise ModelRefused(f"{name} wraps a {text.model_type} text model that is not a causal LM of its own")
        scaled["model_type"] = (name, text.model_type)
        config, name = text, text.model_type
    return config, name, scaled


def _meta_model(config) -> torch.nn.Module:
    """The tiny model on the meta device: its modules, no memory, no time."""
    from transformers import AutoModelForCausalLM  # start-up time

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_copy(config))


def _honours_head_dim(model: torch.nn.Module, head_dim: int) -> bool:
    dims = {m.head_dim for n, m in model.named_modules() if n.endswith(("attn", "attention")) and
            isinstance(getattr(m, "head_dim", None), int)}
    return dims == {head_dim}


# --- layers and weights -------------------------------------------------------------------------------------


def _layers(config) -> tuple[LayerAttention, ...]:
    c = config.get_text_config()
    n = int(getattr(c, "num_hidden_layers", 0) or 0)
    heads = int(getattr(c, "num_attention_heads", 0) or 0)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    qk_nope, qk_rope = getattr(c, "qk_nope_head_dim", None), getattr(c, "qk_rope_head_dim", None)
    mla = isinstance(qk_nope, int) and isinstance(qk_rope, int)
    head_dim = qk_nope + qk_rope if mla else int(getattr(c, "head_dim", None) or c.hidden_size // max(heads, 1))
    v_head_dim = int(getattr(c, "v_head_dim", None) or head_dim)
    if mla:
        kv = heads  # MLA expands its latent to every head
    types = getattr(c, "layer_types", None) or []
    window = getattr(c, "sliding_window", None)
    use_sw = getattr(c, "use_sliding_window", True)
    cap = getattr(c, "attn_logit_softcapping", None)
    out = []
    for i in range(n):
        kind = kind_of(types[i]) if i < len(types) else ("sliding" if window and use_sw else "full")
        out.append(LayerAttention(
            index=i, kind=kind or "full",
            window=window if kind == "sliding" else None,
            chunk=getattr(c, "attention_chunk_size", None) if kind == "chunked" else None,
            sinks=c.model_type in _SINKS, softcap=float(cap) if cap else None,
            scaling=_scaling(c, head_dim), heads=heads, kv_heads=kv, head_dim=head_dim, v_head_dim=v_head_dim))
    return tuple(out)


_SINKS = ("gpt_oss",)


def _scaling(c, head_dim: int) -> float:
    if getattr(c, "query_pre_attn_scalar", None):
        return float(c.query_pre_attn_scalar) ** -0.5
    if getattr(c, "attention_multiplier", None) is not None:
        return float(c.attention_multiplier)
    s = head_dim ** -0.5
    rope = getattr(c, "rope_parameters", None) or {}
    if getattr(c, "qk_rope_head_dim", None) and rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
        s *= m * m
    return s


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Each parameter from its own generator (seed, name): matrices N(0, 1/fan_in) so scores are O(1);
    vectors their transformers value plus N(0, 0.1^2); sinks N(1.5, 0.5^2) so they take a real share."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("sinks"):
                p.copy_(SINK_MEAN + 0.5 * noise)
            elif p.dim() >= 2:
                p.copy_(noise * p.shape[-1] ** -0.5)
            else:
                p.copy_(p.detach().double() + 0.1 * noise)


def _copy(config):
    return type(config).from_dict(config.to_dict())


def _experts_settable(config) -> bool:
    from transformers import AutoModelForCausalLM  # start-up time
    from transformers.models.auto.auto_factory import _get_model_class

    cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    return bool(getattr(cls, "_can_set_experts_implementation", lambda: False)())
