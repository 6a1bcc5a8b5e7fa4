"""Mutant glues: ringcheck's own glue (`ringcheck.glues.ours`) with one semantic of the layers
lost, each the way a shipped glue lost it (issue 42's table), as user-contract glue objects:
`ringcheck step --model gpt_oss --glue ringcheck.catalogue.glue_mutants:sinks_dropped`.

Each changes one keyword of the ring call the correct glue decides in `ring_options`, so it
differs from the correct glue exactly where a model has the feature, and nowhere else (the
names are `ringcheck.models.semantics.LOSSES`):

| mutant | what it loses | as in |
|---|---|---|
| `window_dropped` | every sliding window: sliding layers train as full causal | prime-rl #2828 (`window_size_left` read, `sliding_window` passed) |
| `window_wider` | the window one token too wide: (W, 0) for transformers' W | flash-attention's (W, W) without transformers' -1 (ring-flash-attn's HF adapter) |
| `window_narrower` | one token too narrow: (W - 2, 0) | a -1 applied twice |
| `window_dropped_short_shard` | the window only where the shard is no longer than W | transformers' flash path tests the key length (a shard's, under CP) against W |
| `sinks_dropped` | gpt_oss's `s_aux` | prime-rl #3397 (swallowed by `**kwargs`) |
| `softcap_dropped` | gemma2's logit softcap | a generic glue without the keyword |
| `scale_default` | the layer's `scaling`, replaced by head_dim^-0.5 | prime-rl #2828 (`softmax_scale` not passed) |
| `documents_crossed` | the global document boundaries: attention across packed documents | axolotl #3608 |
| `mask_plain_causal` | every stricter mask (sliding and chunked) replaced by plain causal | accelerate #4177 (the CP hook's `is_causal=True`) |
| `chunk_dropped_short_shard` | llama4's chunks only where the shard is no longer than the chunk | the same local-length test, applied to `attention_chunk_size` |
"""

from __future__ import annotations

from ..glues.ours import RingcheckGlue, chunk_of, refuses, refuses_calls

LOSSES = ("window_dropped", "window_wider", "window_narrower", "window_dropped_short_shard", "sinks_dropped",
          "softcap_dropped", "scale_default", "documents_crossed", "mask_plain_causal", "chunk_dropped_short_shard")


class MutantGlue(RingcheckGlue):
    """ringcheck's glue with the semantic `loss` lost (contiguous shards)."""

    refuses = staticmethod(refuses)
    refuses_calls = staticmethod(refuses_calls)

    def __init__(self, loss: str):
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)}")
        super().__init__("contiguous", name=f"ringcheck_mutant_{loss}")
        self.loss = loss
        self.describe = f"ringcheck's glue with one semantic lost: {loss} (ringcheck.catalogue.glue_mutants)"

    def prepare(self, cu_seqlens, group) -> None:
        super().prepare(None if self.loss == "documents_crossed" else cu_seqlens, group)

    def ring_options(self, module, local_len: int, **semantics) -> dict:
        options = super().ring_options(module, local_len, **semantics)
        window, loss = options["window"], self.loss
        chunk = chunk_of(module)
        if loss == "mask_plain_causal":   # the documents stay (the hook keeps the batch's own mask)
            options["window"], options["cu_seqlens"] = None, self.cu_seqlens
        elif window is not None and loss == "window_dropped":
            options["window"] = None
        elif window is not None and loss == "window_wider":
            options["window"] = (window[0] + 1, 0)
        elif window is not None and loss == "window_narrower":
            options["window"] = (max(window[0] - 1, 0), 0)
        elif window is not None and loss == "window_dropped_short_shard" and local_len <= window[0] + 1:
            options["window"] = None
        elif chunk is not None and loss == "chunk_dropped_short_shard" and local_len <= chunk:
            options["cu_seqlens"] = self.cu_seqlens   # the documents' boundaries alone, no chunk's
        elif loss == "sinks_dropped":
            options["sinks"] = None
        elif loss == "softcap_dropped":
            options["softcap"] = None
        elif loss == "scale_default":
            options["softmax_scale"] = None
        return options


window_dropped = MutantGlue("window_dropped")
window_wider = MutantGlue("window_wider")
window_narrower = MutantGlue("window_narrower")
window_dropped_short_shard = MutantGlue("window_dropped_short_shard")
sinks_dropped = MutantGlue("sinks_dropped")
softcap_dropped = MutantGlue("softcap_dropped")
scale_default = MutantGlue("scale_default")
documents_crossed = MutantGlue("documents_crossed")
mask_plain_causal = MutantGlue("mask_plain_causal")
chunk_dropped_short_shard = MutantGlue("chunk_dropped_short_shard")

# the Ulysses mutants (one bug each, named by the diagnosis's Ulysses classes): their own module
from .ulysses_mutants import (  # noqa: E402, F401  (re-exported: ringcheck.catalogue.glue_mutants:ulysses_...)
    ULYSSES_BUGS,
    ulysses_documents_crossed,
    ulysses_gqa_regrouped,
    ulysses_heads_permuted,
    ulysses_labels_rolled,
    ulysses_rotary_local,
    ulysses_sinks_misrouted,
)
