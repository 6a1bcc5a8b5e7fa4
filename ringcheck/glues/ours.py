"""ringcheck's own glue: every layer's attention, as transformers 5.23 hands it to a function
registered with `AttentionInterface`, through ringcheck's ring (`ringcheck.ring.api.ring_attention`).

What it carries, read from what transformers passes and from the layer module (never guessed):

- `scaling` (always passed: gemma3's 1/sqrt(query_pre_attn_scalar), granite's
  attention_multiplier) as the ring's `softmax_scale`;
- `sliding_window` W in transformers' convention: key j visible to query i iff i - W < j <= i
  (`masking_utils.sliding_window_overlay`), i.e. the ring's flash-convention window (W - 1, 0) on
  global positions, on every rank whatever its shard's length (transformers' own flash path passes
  (W - 1, W - 1) and only when the key length exceeds W: on a shard that is the local length, which
  is exactly the loss a glue must not copy). A layer whose `config.layer_types` says
  "sliding_attention" but which passes no `sliding_window` gets `config.sliding_window`;
- `s_aux` (gpt_oss's per-head sink logits) as the ring's `sinks` with `sinks_grad="partial"`: the
  sinks are a parameter replicated on every rank, and the step sums every gradient over the CP
  group, so each rank must hold only its own rows' share (the sum of the shares is the
  one-device gradient; "reduced" would give P times it);
- `softcap` (gemma2) as the ring's `softcap`, applied to the scaled scores as eager does;
- document boundaries: the global `cu_seqlens` that `prepare(cu_seqlens, group)` stores before
  every forward (None: one document per row);
- chunked attention (llama4's "chunked_attention" layers, `config.attention_chunk_size` C): key j
  visible to query i iff both are in the same chunk of C tokens counted from their document's
  start (transformers remaps packed positions the same way), expressed as the ring's document
  boundaries refined by the chunks;
- a value head dim of its own (the ring's v may differ from q and k);
- llama4's attention temperature tuning on its NoPE layers, which scales the queries by
  positions counted within the shard before the call: rescaled to the tokens' positions in
  their documents (`temperature_fix`).

What it cannot carry is an error, never swallowed: dropout above 0 (the ring has none), a
non-causal layer, the flash path's local varlen keywords (`cu_seq_lens_q`, ...: documents come
through `prepare`), `output_attentions=True`, and any keyword it does not know (prime-rl's
sinks bug was `s_aux` swallowed by `**kwargs`); an unknown keyword whose value is None hands
nothing over and is let through (a BERT-style decoder's `encoder_hidden_states=None`).
"""

from __future__ import annotations

import torch

from ..ring.api import ring_attention
from ..ring.layouts import positions as shard_positions
from ..spec import LAYOUTS
from .contract import Glue
from .reading import (  # noqa: F401  (GlueCallError and the readers are part of this module's interface)
    HANDLED,
    KINDS,
    LOCAL_VARLEN,
    NEUTRAL,
    GlueCallError,
    chunk_of,
    layer_type,
    window_of,
)


def chunked_boundaries(cu_seqlens, seq_len: int, chunk: int) -> list[int]:
    """Document boundaries refined by chunks of `chunk` tokens counted from each document's start
    (one document [0, seq_len) when `cu_seqlens` is None); the tail past the last boundary stays
    padding."""
    bounds = [0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    out = [bounds[0]]
    for start, end in zip(bounds, bounds[1:]):
        out.extend(range(start + chunk, end, chunk))
        out.append(end)
    return out


class RingcheckGlue:
    """The state of one installed glue on one rank: its CP group, layout and the documents of the
    next forward. `attention` is the function registered with transformers."""

    def __init__(self, layout: str, name: str | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"the ringcheck glue shards with one of {', '.join(LAYOUTS)}, got layout={layout!r}")
        self.layout = layout
        self.name = name or f"ringcheck_glue_{layout}"   # the attn_implementation name install registers
        self.group = None
        self.cu_seqlens = None

    def install(self, group) -> str:
        from transformers import AttentionInterface  # transformers is the optional extra `hf`
        self.group = group
        self.cu_seqlens = None
        AttentionInterface.register(self.name, self.attention)
        return self.name

    def prepare(self, cu_seqlens, group) -> None:
        """The global document boundaries of the next forward (None: none)."""
        self.cu_seqlens = None if cu_seqlens is None else [int(x) for x in cu_seqlens]

    def ring_options(self, module, local_len: int, *, scaling, sliding_window, s_aux, softcap) -> dict:
        """The layer's semantics as `ring_attention`'s keywords (the one place they are decided;
        the catalogue's mutant glues each change one of them)."""
        cu = self.cu_seqlens
        chunk = chunk_of(module)
        if chunk is not None:
            cu = chunked_boundaries(cu, local_len * torch.distributed.get_world_size(self.group), chunk)
        return dict(softmax_scale=scaling, window=window_of(module, sliding_window), cu_seqlens=cu, softcap=softcap,
                    sinks=s_aux)

    def temperature_fix(self, module, query):
        """llama4's attention temperature tuning, made global. Its NoPE layers scale each query by
        log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 with p = arange(the hidden states'
        length), before the attention call: under CP that is the shard's local index, not the
        token's position (and it ignores position_ids, so the truth, each document its own forward,
        counts from the document's start). The query rows are rescaled by global / local here."""
        if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
            return query
        world = torch.distributed.get_world_size(self.group)
        rank = torch.distributed.get_rank(self.group)
        local_len = query.shape[2]
        pos = shard_positions(layout=self.layout, rank=rank, world_size=world, seq_len=local_len * world)
        if self.cu_seqlens is not None:
            cu = torch.tensor(self.cu_seqlens)
            starts = cu[(torch.searchsorted(cu, pos, right=True) - 1).clamp(0, len(cu) - 1)]
            pos = pos - torch.minimum(starts, pos)   # the tail past the last boundary: padding, any scale

        def scale(p):
            return torch.log1p(torch.floor((p.to(torch.float64) + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

        ratio = scale(pos) / scale(torch.arange(local_len))
        return query * ratio.to(device=query.device, dtype=query.dtype).view(1, 1, local_len, 1)

    def attention(self, module, query, key, value, attention_mask, *, scaling, dropout=0.0, sliding_window=None,
                  s_aux=None, softcap=None, is_causal=None, output_attentions=False, **kwargs):
        """transformers' attention signature: (batch, heads, local_seq, dim) in, (batch, local_seq,
        heads, v_dim) out; the attention mask is ignored (transformers builds none for a registered
        name; a shard's mask would be local anyway): the layer's mask is rebuilt from its semantics."""
        where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
        if self.group is None:
            raise RuntimeError(f"glue {self.name}: {where} called before install(group)")
        unknown = sorted(k for k, value in kwargs.items() if k not in NEUTRAL and value is not None)
        if unknown:
            local = [k for k in unknown if k in LOCAL_VARLEN]
            hint = (" (the flash path's local varlen keywords: give ringcheck's glue the global document "
                    "boundaries through prepare(cu_seqlens, group) instead)" if local else
                    " (the glue does not know what it means for the attention, so it does not drop it)")
            raise GlueCallError(f"glue {self.name}: {where} was passed keyword(s) {', '.join(unknown)}{hint}")
        if dropout:
            raise GlueCallError(f"glue {self.name}: {where} has attention dropout {dropout}; the ring has no "
                                f"dropout (set config.attention_dropout=0.0 or call model.eval())")
        causal = module.is_causal if is_causal is None else is_causal
        if causal is False:
            raise GlueCallError(f"glue {self.name}: {where} is not causal; the glue carries causal decoder layers")
        if output_attentions:
            raise GlueCallError(f"glue {self.name}: {where}: output_attentions=True needs the attention weights, "
                                f"which a ring never forms; use attn_implementation='eager' for them")
        query = self.temperature_fix(module, query)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        options = self.ring_options(module, q.shape[1], scaling=scaling, sliding_window=sliding_window, s_aux=s_aux,
                                    softcap=softcap)
        return self.attend(q, k, v, options), None

    def attend(self, q, k, v, options: dict):
        """This rank's (batch, local_seq, heads, v_dim) output of the layer's attention over the CP
        group, its semantics `options` (`ring_options`): ringcheck's ring (a Ulysses glue overrides it)."""
        return ring_attention(q, k, v, causal=True, group=self.group, layout=self.layout, sinks_grad="partial",
                              **options)


def refuses(layer) -> list[str]:
    """What ringcheck's glue cannot carry of one `LayerAttention`: only what it does not know."""
    features = []
    if layer.kind not in KINDS:
        features.append(f"attention kind {layer.kind!r} (the glue carries {', '.join(KINDS)})")
    if layer.kind == "sliding" and not layer.window:
        features.append("a sliding layer without a window size")
    if layer.kind == "chunked" and not layer.chunk:
        features.append("a chunked layer without a chunk size")
    return features


def ringcheck_glue(layout: str = "contiguous") -> Glue:
    """ringcheck's glue sharding with `layout` (any layout of its ring but the per-document ones,
    whose shards would change with the chunks)."""
    state = RingcheckGlue(layout)
    return Glue(name="ringcheck", install=state.install, layout=layout, prepare=state.prepare,
                describe=(f"ringcheck's glue ({layout}): transformers' AttentionInterface -> ringcheck's ring, "
                          f"carrying scaling, sliding windows, sinks (partial gradients), softcap, documents, "
                          f"chunks and a value head dim of its own"),
                refuses=refuses, refuses_calls=refuses_calls)


def refuses_calls(tiny) -> list[str]:
    """What the tiny model's attention calls hand over that ringcheck's glue cannot carry (one
    forward on one device, `ringcheck.glues.survey`)."""
    from .survey import call_refusals, survey  # builds the model: only when refusals are asked for
    return call_refusals(tiny, survey(tiny), NEUTRAL | HANDLED, "ringcheck's glue")
