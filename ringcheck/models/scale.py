"""Scaling a transformers config down to a tiny model, and refusing what an attention glue cannot judge.

Every rule records what it changed (`scaled`), kept (`kept`) or switched off (`disabled`), so the report
of a `--model` check can say what was judged. The rules read attribute names, not architectures: a
config.json of an architecture never seen here scales by the same names.
"""

from __future__ import annotations

import re
from typing import Any

import torch

HIDDEN = 64
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
EXPERTS = 8
LORA_RANK = 32
VOCAB = 128
SOFTCAP = 2.0     # scores of the tiny model are O(1): a cap of 2 bends them (gemma2's 50 never would)

_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
          "attention": "full", "global": "full", "local": "sliding", "sliding": "sliding", "full": "full"}
# module class names (lower case) that mix tokens outside attention, and what they are
_MIXERS = (("mamba", "state-space (Mamba)"), ("ssm", "state-space"), ("shortconv", "short convolution"),
           ("gateddeltanet", "linear attention (gated delta net)"), ("deltanet", "linear attention (delta net)"),
           ("linearattention", "linear attention"), ("lightning", "linear attention (lightning)"),
           ("rwkv", "RWKV recurrence"), ("recurrent", "recurrence"), ("rglru", "recurrence (RG-LRU)"),
           ("lstm", "recurrence (xLSTM)"), ("retention", "retention"), ("hgrn", "recurrence"),
           ("conv", "short convolution"))
_SIZES = {  # attribute -> tiny value (widths); the depth, heads, experts and vocab are chosen below
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "dim": HIDDEN,
    "intermediate_size": INTERMEDIATE, "ffn_dim": INTERMEDIATE, "n_inner": INTERMEDIATE,
    "intermediate_size_mlp": INTERMEDIATE, "ffn_hidden_size": INTERMEDIATE, "decoder_ffn_dim": INTERMEDIATE,
    "moe_intermediate_size": EXPERT_INTERMEDIATE, "shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    "expert_intermediate_size": EXPERT_INTERMEDIATE, "shared_intermediate_size": EXPERT_INTERMEDIATE,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
    "kv_lora_rank": LORA_RANK, "q_lora_rank": LORA_RANK + 16, "o_lora_rank": LORA_RANK,
}
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "n_layers", "encoder_layers")
_HEADS = ("num_attention_heads", "n_head", "decoder_attention_heads", "n_heads", "encoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "n_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_selected_experts")
_NOISE = ("router_jitter_noise", "jitter_noise", "router_z_loss_coef")


class ModelRefused(ValueError):
    """The model cannot be judged by an attention glue alone (it names the layers and their kind)."""


def scaled_window(seq_len: int) -> int:
    """A window (and chunk) that bites at `seq_len` and crosses the shard boundaries of P = 2 and 4,
    contiguous and zigzag: about 3/16 of the sequence (12 at 64), never a divisor of it."""
    w = max(3, seq_len * 3 // 16)
    while seq_len % w == 0:
        w += 1
    return w


def _first(d: dict, keys) -> Any:
    return next((d[k] for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def kind_of(layer_type: str) -> str | None:
    return _KINDS.get(str(layer_type))


def _refuse_mixing_layer_types(name: str, d: dict) -> None:
    for key in ("layer_types", "layers_block_type"):
        types = d.get(key)
        if not isinstance(types, list):
            continue
        other = {}
        for i, t in enumerate(types):
            if kind_of(t) is None and t not in ("mlp", "moe", "dense"):
                other.setdefault(str(t), []).append(i)
        if other:
            said = "; ".join(f"layers {_listed(ix)} are {t} "
                             f"({_MIXING_TYPES.get(t, 'not a full, sliding or chunked attention ringcheck models')})"
                             for t, ix in other.items())
            raise ModelRefused(f"{name}: {said}: an attention glue alone does not make those layers "
                               f"context-parallel, so its shards cannot be judged right (exit 2)")


_MIXING_TYPES = {"linear_attention": "token-mixing: linear attention", "conv": "token-mixing: short convolution",
                 "mamba": "token-mixing: state-space", "mamba2": "token-mixing: state-space",
                 "hybrid": "token-mixing: a state-space block beside attention",
                 "indexed_attention": "sparse attention chosen by a learned indexer over all keys",
                 "compressed_sparse_attention": "sparse attention over compressed keys",
                 "heavily_compressed_attention": "attention over compressed keys"}


def _listed(indices: list[int]) -> str:
    return ",".join(map(str, indices[:12])) + (",..." if len(indices) > 12 else "")


def _words(cls: str) -> set[str]:
    """GptOssMLP -> gpt, oss, mlp, gptoss, ossmlp, ...: class-name words and their joins, so a key never
    matches across a word boundary by accident (gpt_OSS_Mlp is no SSM)."""
    w = [t.lower() for t in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+[0-9]*|[A-Z]+[0-9]*|[0-9]+", cls)]
    return {"".join(w[i:j]) for i in range(len(w)) for j in range(i + 1, min(len(w), i + 3) + 1)}


def refuse_mixing_modules(name: str, model: torch.nn.Module, *, which: str = "tiny") -> None:
    """Name every module of the model that mixes tokens outside attention (the mixers themselves: not
    the norms, MLPs or containers whose class names share the family's name)."""
    found: dict[str, set[int]] = {}
    for mname, module in model.named_modules():
        cls = type(module).__name__
        words = _words(cls)
        what = next((w for key, w in _MIXERS if any(x == key or x.startswith(key) and x[len(key):].isdigit()
                                                   for x in words)), None)
        if cls == "Conv1D" or words & {"norm", "rmsnorm", "layernorm", "mlp", "feedforward", "model", "causallm",
                                       "forcausallm", "embeddings", "backend"}:
            what = None  # transformers' Conv1D (gpt2) is a linear layer; the rest only share the name
        if isinstance(module, torch.nn.Conv1d) and max(module.kernel_size) > 1:
            what = "short convolution"
        if what:
            m = re.search(r"(?:layers?|blocks?|h)\.(\d+)", mname)
            found.setdefault(f"{what} ({cls})", set()).add(int(m.group(1)) if m else -1)
    if found:
        said = "; ".join(f"layers {_listed(sorted(i for i in ix if i >= 0)) or '?'} of the {which} model "
                         f"are {w}" for w, ix in sorted(found.items()))
        raise ModelRefused(f"{name}: {said}: those layers mix tokens outside attention, so an attention glue "
                           f"alone does not make the model context-parallel (exit 2)")


# --- scaling ------------------------------------------------------------------------------------------------


def _pick_layers(d: dict, n: int | None, keep_last: bool = False) -> list[int]:
    """Original layer indices to keep: each layer type's first layer, in order, then one more of the first
    type (sliding, full, sliding): the pattern's variety in 2-4 layers."""
    if not n:
        return []
    types = d.get("layer_types")
    if not isinstance(types, list) or len(types) != n or len({kind_of(t) for t in types}) < 2:
        return list(range(min(n, 2)))
    firsts = sorted({kind_of(t): i for i, t in reversed(list(enumerate(types)))}.values())
    extra = next((i for i in range(max(firsts) + 1, n) if kind_of(types[i]) == kind_of(types[firsts[0]])), None)
    picks = firsts + ([extra] if extra is not None else [])
    if keep_last and kind_of(types[picks[-1]]) != kind_of(types[-1]):  # gemma4 forces its last layer full
        picks.append(n - 1)
    return picks[:4]


def _scale_depth(d: dict, n: int | None, picks: list[int], scaled: dict) -> None:
    if not n:
        return
    for key in _LAYERS:  # an encoder-decoder's causal LM is its decoder: both stacks shrink alike
        if isinstance(d.get(key), int) and d[key] > len(picks):
            scaled[key] = (d[key], len(picks))
            d[key] = len(picks)
    scaled["layers kept (original indices)"] = (list(range(n)) if n < 8 else f"0..{n - 1}", picks)
    if isinstance(d.get("num_layers_per_stack"), int) and d["num_layers_per_stack"] > len(picks):
        # hrm_text: the stacks' real depth, from which the config derives num_hidden_layers (one cache slot per
        # recurrent call); unset, the config derives both again from the kept layers
        scaled["num_layers_per_stack"] = (d["num_layers_per_stack"], len(picks))
        d["num_layers_per_stack"] = None
    for key, value in list(d.items()):  # every per-layer list or pattern string takes the kept layers
        if _index_list(value, n) and "cycle" not in key:  # hrm_text's L_bp_cycles counts cycles, not layers
            new = [picks.index(i) for i in value if i in picks]
            scaled[key] = (f"{len(value)} layer indices", new)
            d[key] = new
        elif isinstance(value, (list, str)) and len(value) == n and n > 1 and key not in ("model_type",):
            new = [value[i] for i in picks]
            d[key] = "".join(new) if isinstance(value, str) else new
            if new != list(value)[:len(picks)]:
                scaled[key] = (f"{len(value)} entries", new)
    for key, value in list(d.items()):  # per-layer settings keyed by layer index (gemma4's per_layer_config)
        if ("layer" in key and isinstance(value, dict) and value
                and all(str(k).isdigit() and int(k) < n for k in value)):
            new = {str(picks.index(int(k))).zfill(len(str(k))) if isinstance(k, str) else picks.index(k): v
                   for k, v in value.items() if int(k) in picks}
            scaled[key] = (f"{len(value)} layers' settings", sorted(new))
            d[key] = new
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 1:
        scaled["first_k_dense_replace"] = (d["first_k_dense_replace"], 1)  # layer 0 dense, the rest MoE
        d["first_k_dense_replace"] = 1
    for key in ("max_window_layers",):
        if isinstance(d.get(key), int) and d[key] > len(picks):
            scaled[key] = (d[key], len(picks))
            d[key] = len(picks)


def _index_list(value, n: int) -> bool:
    """A list of layer indices (llama4's moe_layers, qwen's mlp_only_layers), not one flag per layer
    (llama4's no_rope_layers of 0/1): distinct ascending ints below n, some above 1 or all of 0..n-1."""
    if not (isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        return False
    ascending = all(a < b for a, b in zip(value, value[1:])) and value[-1] < n
    return ascending and (max(value) > 1 or value == list(range(n)))


def _scale_widths(d: dict, scaled: dict) -> None:
    heads = _first(d, _HEADS) or 1
    for key, tiny in _SIZES.items():
        if tiny == HIDDEN and HIDDEN % heads:  # some configs insist the width is a multiple of the heads
            tiny = heads * -(-HIDDEN // heads)
        if isinstance(d.get(key), int) and not isinstance(d[key], bool) and d[key] > tiny:
            scaled[key] = (d[key], tiny)
            d[key] = tiny


def _scale_heads(d: dict, scaled: dict, head_dim_settable: bool = True) -> int | None:
    """4 query heads with the GQA ratio kept (8 when the ratio is 8 or more: then the ratio is 8); the
    head dims are kept, so q.k and the default scale are the original's."""
    hkey = next((k for k in _HEADS if isinstance(d.get(k), int)), None)
    if hkey is None:
        return None
    heads = d[hkey]
    kvkey = next((k for k in _KV_HEADS if isinstance(d.get(k), int)), None)
    if kvkey is None and "num_key_value_heads" in d:  # None means one kv head per query head (nemotron
        kvkey = "num_key_value_heads"                   # reads it without the default)
        d[kvkey] = heads
    kv = d[kvkey] if kvkey else heads
    ratio = max(1, heads // max(kv, 1))
    tiny_kv = max(1, 4 // ratio) if ratio <= 4 else 1
    tiny_heads = tiny_kv * min(ratio, 8)
    hidden = _first(d, ("hidden_size", "n_embd", "d_model"))
    if (head_dim_settable and d.get("head_dim") is None and hidden and hidden % heads == 0
            and _first(d, ("qk_nope_head_dim",)) is None):
        d["head_dim"] = added = hidden // heads  # kept explicitly: with the width scaled it would shrink
    else:
        added = None
    for key, value in list(d.items()):  # per-layer head counts (laguna's num_attention_heads_per_layer)
        if "heads" in key and key.endswith("_per_layer") and isinstance(value, list) and value:
            d[key] = [max(1, v * tiny_heads // heads) if isinstance(v, int) else v for v in value]
            scaled[key] = (value, d[key])
    for keys, was, tiny in ((_HEADS, heads, tiny_heads), (_KV_HEADS, kv, tiny_kv)):
        for key in keys:  # every stack alike (an encoder-decoder's encoder and decoder)
            if d.get(key) == was and tiny != was:
                scaled[key] = (was, tiny)
                d[key] = tiny
    return added


def _scale_experts(d: dict, scaled: dict) -> bool:
    ekey = next((k for k in _EXPERTS if isinstance(d.get(k), int) and d[k] > 1), None)
    if ekey is None:
        return False
    experts = min(d[ekey], EXPERTS)
    if experts != d[ekey]:
        scaled[ekey] = (d[ekey], experts)
        d[ekey] = experts
    for key in _TOPK:
        if key in d and d[key] is None:  # deepseek_v2's default config leaves it unset: it cannot run so
            d[key] = max(1, experts // 2)
            scaled[key] = (None, d[key])
        if isinstance(d.get(key), int) and d[key] > max(1, experts // 2):
            scaled[key] = (d[key], max(1, experts // 2))
            d[key] = max(1, experts // 2)
    for key, tiny in (("n_group", 2), ("topk_group", 1), ("num_shared_experts", 1), ("n_shared_experts", 1)):
        if isinstance(d.get(key), int) and d[key] > tiny:
            scaled[key] = (d[key], tiny)
            d[key] = tiny
    return True


def _scale_attention(d: dict, seq_len: int, scaled: dict, kept: dict) -> None:
    w = scaled_window(seq_len)
    for key in ("sliding_window", "attention_chunk_size", "chunk_size", "local_window_size"):
        if isinstance(d.get(key), int) and not isinstance(d[key], bool) and d[key] > w:
            scaled[key] = (d[key], w)
            d[key] = w
    if isinstance(d.get("floor_scale"), int) and d["floor_scale"] > w:  # llama4's temperature tuning
        scaled["floor_scale"] = (d["floor_scale"], w)
        d["floor_scale"] = w
    cap = d.get("attn_logit_softcapping")
    if isinstance(cap, (int, float)) and cap > SOFTCAP:
        scaled["attn_logit_softcapping"] = (cap, SOFTCAP)
        d["attn_logit_softcapping"] = SOFTCAP


def _scale_vocab(d: dict, scaled: dict) -> None:
    """A vocab of 128 with every special id inside it: ids at or past it move to the top, distinct.
    A second vocab the config keeps at the first's size (marian's decoder_vocab_size, its decoder's
    embeddings and lm_head) shrinks with it: left at 58101, marian's logits were 450 times wider."""
    original = d.get("vocab_size")
    if isinstance(original, int) and original > VOCAB:
        for key, value in list(d.items()):
            if (key == "vocab_size" or key.endswith("_vocab_size")) and value == original:
                scaled[key] = (value, VOCAB)
                d[key] = VOCAB
    vocab = d.get("vocab_size", VOCAB)
    moved: dict[int, int] = {}
    free = iter(range(vocab - 1, -1, -1))

    def inside(i):
        if not isinstance(i, int) or isinstance(i, bool) or i < vocab:
            return i
        if i not in moved:
            moved[i] = next(j for j in free if j not in _special_ids(d))
        return moved[i]

    for key, value in list(d.items()):
        if key.endswith(("_token_id", "_token_ids", "_token_index")) and value is not None:
            new = [inside(i) for i in value] if isinstance(value, list) else inside(value)
            if new != value:
                scaled[key] = (value, new)
                d[key] = new


def _special_ids(d: dict) -> set[int]:
    ids = set()
    for key, value in d.items():
        if key.endswith(("_token_id", "_token_ids", "_token_index")):
            ids |= {i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)}
    return ids


def _switch_off(d: dict, disabled: dict) -> None:
    """What is random by design: dropout of every kind and router jitter."""
    for key, value in list(d.items()):
        if (("dropout" in key or "pdrop" in key or key in _NOISE or key == "layerdrop")
                and isinstance(value, float) and value != 0.0):
            disabled[key] = f"{value} -> 0.0: random by design, a check compares two runs of one step"
            d[key] = 0.0
    if d.get("use_cache"):
        disabled["use_cache"] = ("True -> False: transformers' eager keeps packed documents apart only "
                                 "without a cache, and a training step builds none")
        d["use_cache"] = False
    if d.get("is_decoder") is False and d.get("add_cross_attention") is not None:
        disabled["is_decoder"] = "False -> True: the causal-LM head of an encoder-style model"
        d["is_decoder"] = True


def scale_config(name: str, d: dict, seq_len: int, scaled: dict, *, head_dim_settable: bool = True,
                 keep_last: bool = False) -> tuple[dict, dict, bool, int | None]:
    """Scale the config dict `d` in place; -> (kept, disabled, moe, the head_dim made explicit or None)."""
    kept: dict[str, Any] = {}
    disabled: dict[str, str] = {}
    _refuse_mixing_layer_types(name, d)
    n_orig = _first(d, _LAYERS)
    picks = _pick_layers(d, n_orig, keep_last)
    _scale_depth(d, n_orig, picks, scaled)
    added_head_dim = _scale_heads(d, scaled, head_dim_settable)
    _scale_widths(d, scaled)
    moe = _scale_experts(d, scaled)
    _scale_attention(d, seq_len, scaled, kept)
    _scale_vocab(d, scaled)
    _switch_off(d, disabled)
    if added_head_dim:
        kept["head_dim"] = added_head_dim
    for key in _KEPT:
        if key in d and key not in scaled and d[key] is not None:
            kept[key] = d[key]
    return kept, disabled, moe, added_head_dim


_KEPT = ("rope_parameters", "rope_scaling", "partial_rotary_factor", "use_qk_norm", "qk_layernorm",
         "query_pre_attn_scalar", "attention_multiplier", "attn_logit_softcapping", "head_dim", "v_head_dim",
         "qk_nope_head_dim", "qk_rope_head_dim", "tie_word_embeddings", "rope_interleave", "final_logit_softcapping",
         "logit_scale", "embedding_multiplier", "residual_multiplier", "no_rope_layers", "attn_temperature_tuning")
