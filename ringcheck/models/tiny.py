"""A tiny model of any transformers decoder: its attention semantics kept, everything else small.

A `--model` check judges the glue between a model's attention and a ring, so what must survive the
scaling is everything that decides attention (the pattern of layer types, windows and chunks that
bite at the check's sequence length, sinks, softcap, the scale, the GQA ratio, head dims, QK norms,
the rope variant), while widths, depth, vocab and experts shrink until a case runs in seconds on a
CPU. Every change is recorded (`kept`, `scaled`, `disabled`) so the report can say what was judged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..launch.audit import on_the_host
from ..thirdparty.torch_private import in_a_torch_mode
from ..thirdparty.transformers_private import can_set_experts_implementation, causal_lm_class
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
        scope = _BUILT[-1] if _BUILT and not in_a_torch_mode() else None
        key = (id(self), attn_implementation, dtype, seed, torch.get_default_dtype())
        if scope is not None and key in scope:
            return copy.deepcopy(scope[key][1])
        extra = {"experts_implementation": "eager"} if _experts_settable(self.config) else {}
        with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
            torch.manual_seed(seed)  # transformers' own init of what we do not overwrite (buffers)
            model = AutoModelForCausalLM.from_config(_copy(self.config), attn_implementation=attn_implementation,
                                                     dtype=dtype, **extra)
        _init_weights(model, seed)
        model.train()  # dropout is off in the config; train mode is what a step runs
        if scope is not None:
            scope[key] = (self, copy.deepcopy(model))  # self kept: its id stays its own while the scope lasts
        return model

    def fresh(self) -> TinyModel:
        """A copy a caller may change (its config and its words) without changing this one."""
        return dataclasses.replace(self, config=copy.deepcopy(self.config), kept=dict(self.kept),
                                   scaled=dict(self.scaled), disabled=dict(self.disabled))


_BUILT: list[dict] = []  # the innermost `reused_builds` scope's models, by what built them


@contextmanager
def reused_builds():
    """Within it, `TinyModel.build` builds each (tiny model, attention, dtype, seed) once and hands
    out copies: a task's cases each ask for the same model (one build and copies, as a trainer
    builds its model once; building was half of a rank's time in a zoo row). A build under a torch
    function or dispatch mode (`step_noise.float64_throughout`) is made afresh: the mode may change
    what it makes, or count it."""
    _BUILT.append({})
    try:
        yield
    finally:
        _BUILT.pop()


def zoo_names() -> tuple[str, ...]:
    """Every causal-LM model_type transformers registers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # start-up time

    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_MADE: dict[tuple[str, int], TinyModel] = {}  # per process, by model_type: what tiny_model made


def tiny_model(name_or_path: str, *, seq_len: int = 64) -> TinyModel:
    """The tiny model of `name_or_path`: a transformers model_type, or a path to a config.json.
    A model_type's is made once per process (a fresh copy each call): every task of a `step
    --model` run (the ranks, the truth, the diagnoses) asks for it, and making it reads, scales and
    validates the config (a fifth of a zoo row's time when each call made it again)."""
    if not isinstance(seq_len, int) or seq_len < 16:
        raise ValueError(f"seq_len must be an int >= 16 (windows are scaled to bite at it), got {seq_len!r}")
    if not isinstance(name_or_path, str) or name_or_path not in zoo_names():  # a file may change: made each time
        return _make(name_or_path, seq_len)
    key = (name_or_path, seq_len)
    if key not in _MADE:
        _MADE[key] = _make(name_or_path, seq_len)
    return _MADE[key].fresh()


def _make(name_or_path: str, seq_len: int) -> TinyModel:
    original, name, scaled = _original_config(name_or_path)
    settable = not isinstance(getattr(type(original), "head_dim", None), property)  # falcon derives it
    said = dict(scaled)
    for keep_last in (False, True):
        d = original.to_dict()
        scaled = dict(said)
        kept, disabled, moe, added = scale_config(name, d, seq_len, scaled, head_dim_settable=settable,
                                                  keep_last=keep_last)
        d.pop("transformers_version", None)
        asked = list(d.get("layer_types") or [])  # a copy: the config may rewrite the list in place
        try:
            config = type(original).from_dict(d)
        except Exception as e:  # transformers' config validators raise several kinds
            if not keep_last:
                continue  # gemma4 refuses a pattern whose last layer is not full: keep the last layer's type
            refuse_mixing_modules(name, _meta_model(original), which="original")  # say why, if it is that
            raise RuntimeError(f"{name}: transformers refuses the scaled config ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[-1][:200]}); ringcheck cannot make it tiny") from e
        if list(getattr(config, "layer_types", None) or []) == asked:
            break  # else the config rewrote the pattern (forced its last layer's type): keep the last layer
    meta = _meta_model(config)
    refuse_mixing_modules(name, meta)  # first: a mamba has no attention to dispatch at all
    _refuse_outside_the_interface(name, meta)
    _check_size(name, meta)
    if "head_dim" in d and (added and not _honours_head_dim(meta, added) or not _forward_runs(config)):
        # the model derives head_dim from hidden / heads somewhere (gpt2's module, olmoe's q norm, helium's
        # o_proj): then it scales with them, and the report says so
        derived = {k: v for k, v in d.items() if k != "head_dim"}
        heads = derived.get("num_attention_heads")
        if not added and isinstance(heads, int) and isinstance(derived.get("hidden_size"), int):
            derived["head_dim"] = derived["hidden_size"] // heads
        try:
            alternative = type(original).from_dict(derived)
        except Exception:  # transformers' validators refuse it (an odd rotary dim): keep the kept head_dim
            alternative = None
        if alternative is not None and _forward_runs(alternative):
            kept.pop("head_dim", None)
            config, meta = alternative, _meta_model(alternative)
            scaled["head_dim"] = (added or d["head_dim"], _layers(config, meta)[0].head_dim)
    layers = _layers(config, meta)
    sinks = [x.index for x in layers if x.sinks]
    if sinks:
        kept["sinks"] = f"per head on layers {','.join(map(str, sinks))}, drawn N({SINK_MEAN}, 0.25) so they matter"
    if _experts_settable(config):
        disabled["experts_implementation"] = ("grouped_mm -> eager: grouped_mm refuses float64 (and rows not a "
                                              "multiple of 16 bytes); the same experts, computed one by one")
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
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--model {name_or_path}: {file} is not JSON ({e})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{file} has no model_type: it is not a transformers config.json")
        kind = data.pop("model_type")
        try:
            config = AutoConfig.for_model(kind, **data)
        except ValueError:
            import transformers  # its version, for the message (the module is loaded already: AutoConfig above)
            raise ValueError(f"--model {name_or_path}: its model_type {kind!r} is not one transformers "
                             f"{transformers.__version__} knows; upgrade transformers, or give a config whose "
                             f"model_type is one of its causal LMs (ringcheck.models.zoo_names())") from None
    else:
        close = [n for n in names if n.replace("-", "_").startswith(name_or_path.replace("-", "_")[:4])]
        raise ValueError(f"--model {name_or_path!r} is neither a causal-LM model_type of transformers nor a "
                         f"config.json (close names: {', '.join(close[:8]) or 'none'}; all: zoo_names())")
    name = config.model_type
    try:
        text = config.get_text_config()
    except ValueError as e:  # musicgen: a text encoder and a decoder
        raise ModelRefused(f"{name}: which of its text configs is the decoder is ambiguous ({e})") from e
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


def _refuse_outside_the_interface(name: str, model: torch.nn.Module) -> None:
    module = sys.modules.get(type(model).__module__)
    if module is not None and not hasattr(module, "ALL_ATTENTION_FUNCTIONS"):
        raise ModelRefused(f"{name}: its attention ({type(model).__module__}) is not dispatched through "
                           f"transformers' AttentionInterface, so no glue can be installed in it (exit 2)")


def _forward_runs(config) -> bool:
    """A float32 forward of 8 tokens (the meta device cannot run one: masks call .item())."""
    from transformers import AutoModelForCausalLM  # start-up time

    try:
        extra = {"experts_implementation": "eager"} if _experts_settable(config) else {}  # as build() runs
        # on the CPU by design, on a GPU machine too; a rank's task makes its tiny model (and so runs this) under
        # the device audit, where transformers' .to(x.device) of a host x would be taken for the rank's device
        with on_the_host():
            model = AutoModelForCausalLM.from_config(_copy(config), dtype=torch.float32, **extra)
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
        return True
    except Exception:  # any failure means "does not run": the caller compares two configs by it
        return False


def _attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each decoder layer's attention module, by its layer_idx."""
    found: dict[int, torch.nn.Module] = {}
    for _, m in model.named_modules():
        if "attention" in type(m).__name__.lower() and isinstance(getattr(m, "layer_idx", None), int):
            found.setdefault(m.layer_idx, m)
    return found


def _honours_head_dim(model: torch.nn.Module, head_dim: int) -> bool:
    dims = {m.head_dim for n, m in model.named_modules() if n.endswith(("attn", "attention")) and
            isinstance(getattr(m, "head_dim", None), int)}
    return dims == {head_dim}


# --- layers and weights -------------------------------------------------------------------------------------


def _layers(config, meta: torch.nn.Module) -> tuple[LayerAttention, ...]:
    c = config.get_text_config()
    attention = _attention_modules(meta)
    n = int(_get(c, None, "num_hidden_layers") or 0)
    types = _get(c, None, "layer_types") or []
    return tuple(_layer(c, i, kind_of(types[i]) if i < len(types) else None, attention.get(i)) for i in range(n))


def _get(c, i: int | None, name: str, default=None):
    """Layer i's value of a config attribute: its per-layer config's (gemma4's head_dim of 512 on the full
    layers), a per-layer list's entry (laguna's num_attention_heads_per_layer), else the global value."""
    try:
        layer_config = c.per_layer_config[i] if i is not None and getattr(c, "is_heterogeneous", False) else None
    except (KeyError, IndexError, TypeError):
        layer_config = None
    if layer_config is not None and getattr(layer_config, name, None) is not None:
        return getattr(layer_config, name)
    listed = getattr(c, f"{name}_per_layer", None) if i is not None else None
    if isinstance(listed, (list, tuple)) and i < len(listed):
        return listed[i]
    try:
        value = getattr(c, name, default)
    except Exception:  # a per-layer attribute read globally raises (transformers' AmbiguousGlobal... error)
        return default
    return default if value is None else value


def _layer(c, i: int, kind: str | None, module) -> LayerAttention:
    heads = int(_get(c, i, "num_attention_heads", 0))
    kv = int(_get(c, i, "num_key_value_heads", heads))
    qk_nope, qk_rope = _get(c, i, "qk_nope_head_dim"), _get(c, i, "qk_rope_head_dim")
    mla = isinstance(qk_nope, int) and isinstance(qk_rope, int)
    head_dim = qk_nope + qk_rope if mla else int(_get(c, i, "head_dim") or _get(c, i, "hidden_size") // max(heads, 1))
    window = _get(c, i, "sliding_window")
    if kind is None:
        kind = "sliding" if window and _get(c, i, "use_sliding_window", True) else "full"
    if kind == "full" and not getattr(c, "is_heterogeneous", False):
        head_dim, kv = _global_override(c, head_dim, kv)
    v_head_dim = int(_get(c, i, "v_head_dim") or head_dim)
    if mla:
        kv = heads  # MLA expands its latent to every head
    cap = _get(c, i, "attn_logit_softcapping")
    return LayerAttention(
        index=i, kind=kind, window=window if kind == "sliding" else None,
        chunk=_get(c, i, "attention_chunk_size") if kind == "chunked" else None,
        sinks=isinstance(getattr(module, "sinks", None), torch.nn.Parameter), softcap=float(cap) if cap else None,
        scaling=_scaling(c, i, head_dim, module), heads=heads, kv_heads=kv, head_dim=head_dim, v_head_dim=v_head_dim)


def _global_override(c, head_dim: int, kv: int) -> tuple[int, int]:
    """A full layer's head dim and kv heads where the config keeps them as `global_*` fields (gemma4 in
    transformers before its per_layer_config, e.g. 5.6: `global_head_dim`, and `num_global_key_value_heads`
    under `attention_k_eq_v`), as its attention module reads them."""
    if isinstance(getattr(c, "global_head_dim", None), int) and c.global_head_dim:
        head_dim = c.global_head_dim
    if getattr(c, "attention_k_eq_v", False) and isinstance(getattr(c, "num_global_key_value_heads", None), int):
        kv = c.num_global_key_value_heads
    return head_dim, kv


def _scaling(c, i: int, head_dim: int, module) -> float:
    """The module's own `scaling` where it keeps one (gemma4's 1.0 beside its QK norms), else the config's."""
    if isinstance(getattr(module, "scaling", None), (int, float)) and not isinstance(module.scaling, bool):
        return float(module.scaling)
    if _get(c, i, "query_pre_attn_scalar"):
        return float(_get(c, i, "query_pre_attn_scalar")) ** -0.5
    if _get(c, i, "attention_multiplier") is not None:
        return float(_get(c, i, "attention_multiplier"))
    s = head_dim ** -0.5
    rope = _get(c, i, "rope_parameters") or {}
    if _get(c, i, "qk_rope_head_dim") and rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
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


MAX_PARAMETERS = 8_000_000  # the ten named models are 0.1-1.0 M; above this a width was not scaled


def _check_size(name: str, meta: torch.nn.Module) -> None:
    total = sum(p.numel() for p in meta.parameters())
    if total > MAX_PARAMETERS:
        big = sorted(((p.numel(), n, tuple(p.shape)) for n, p in meta.named_parameters()), reverse=True)[:3]
        raise RuntimeError(f"{name}: the tiny model still has {total:,} parameters (largest: "
                           f"{', '.join(f'{n} {s}' for _, n, s in big)}): a width of its config is not one "
                           f"ringcheck scales; report it with the config")


def _copy(config):
    return type(config).from_dict(config.to_dict())


def _experts_settable(config) -> bool:
    return can_set_experts_implementation(causal_lm_class(config))  # private: transformers' door
