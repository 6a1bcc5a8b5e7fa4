"""How ringcheck's glue reads a layer: the keywords transformers 5.23 hands an attention function
and the layer module's attributes (shared by the glue, `ours`, and the survey before any rank
starts, `survey`)."""

from __future__ import annotations

# keywords transformers 5.23 passes that carry no attention semantics (measured on the zoo's layers)
NEUTRAL = frozenset({"position_ids", "use_cache", "output_router_logits", "output_hidden_states", "cache_position",
                     "num_items_in_batch", "return_dict", "token_type_ids", "layer_idx", "past_key_values",
                     "past_key_value", "position_embeddings", "attn_implementation"})
HANDLED = frozenset({"scaling", "dropout", "sliding_window", "s_aux", "softcap", "is_causal", "output_attentions"})
LOCAL_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens_q", "cu_seqlens_k")
KINDS = ("full", "sliding", "chunked")


class GlueCallError(TypeError):
    """A call the glue cannot carry faithfully (an unknown keyword, dropout, a non-causal layer)."""


def layer_type(module) -> str | None:
    """The layer's entry of `config.layer_types` ("sliding_attention", "chunked_attention", ...) or None."""
    config = getattr(module, "config", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if types is None or index is None or not 0 <= index < len(types):
        return None
    return types[index]


def window_of(module, sliding_window) -> tuple[int, int] | None:
    """The ring's window (W - 1, 0) for transformers' W, or None (no window)."""
    if sliding_window is None and layer_type(module) == "sliding_attention":
        sliding_window = getattr(module.config, "sliding_window", None)
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise GlueCallError(f"layer {getattr(module, 'layer_idx', '?')}: sliding_window must be a positive int "
                            f"(transformers' W: key j visible to query i iff i - W < j <= i), got {sliding_window!r}")
    return (sliding_window - 1, 0)


def chunk_of(module) -> int | None:
    """llama4's attention chunk size C on its "chunked_attention" layers, else None."""
    if layer_type(module) != "chunked_attention":
        return None
    chunk = getattr(module.config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk < 1:
        raise GlueCallError(f"layer {getattr(module, 'layer_idx', '?')} is chunked_attention but "
                            f"config.attention_chunk_size is {chunk!r}; the glue needs the chunk size")
    return chunk
