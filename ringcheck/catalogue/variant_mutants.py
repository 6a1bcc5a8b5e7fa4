"""A catalogue of ring attentions with the variants, each with one planted defect of the kind
reported against context-parallel rings with packed documents, windows, softcap and sinks.

Every public function takes the `--impl` contract with the variant keywords:

    fn(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None,
       window=None, softcap=None, sinks=None) -> (out, lse)

`textbook_varlen` (ringcheck.catalogue.variant_textbook) is a plain correct ring; every other
function is that ring with exactly one defect switched on. `VARIANT_MUTANTS` maps each name to
(function, the variant keywords a configuration needs to expose the defect, one line).
suites/test_variant_mutants.py runs them on local gloo rings and asserts that the budget rule
passes `textbook_varlen` everywhere and fails every mutant where its defect lives.
"""

from __future__ import annotations

from .variant_textbook import textbook_varlen, varlen_ring

__all__ = ["VARIANT_MUTANTS", "textbook_varlen"]  # and every mutant, made below from _CATALOGUE

# name -> (variant keywords that expose it, one line, the docstring: the defect and where it is reported)
_CATALOGUE = {
    "window_ignored": (
        ("window",), "the sliding window ignored: full (causal) attention",
        ("The window never reaches the mask: every query sees every earlier key, as when a ring passes "
         "window_size only to its local (diagonal) kernel, or drops it in the varlen path, and the "
         "other ranks' blocks are computed in full.")),
    "window_off_by_one": (
        ("window",), "the window's left bound off by one (left read as the window size)",
        ("`left` read as the window's size with the query included (j > i - left instead of "
         "j >= i - left), the sliding_window vs window_size=(w - 1, 0) confusion reported between "
         "eager, SDPA and flash-attention sliding-window paths: the oldest key of every full window "
         "is dropped.")),
    "docs_rank_local": (
        ("cu_seqlens",), "document boundaries applied to rank-local indices",
        ("The global cu_seqlens handed unchanged to each rank's local varlen kernel: documents are "
         "looked up by local row (0..local_seq-1) instead of global position, so boundaries fall in "
         "the wrong place on every rank but the first chunk, and padding is never recognised.")),
    "odd_doc_drops_last": (
        ("cu_seqlens",), "the last token of an odd-length document dropped",
        ("Each document's length rounded down to even (a per-document zig-zag split that halves "
         "length // 2): the last token of an odd-length document sees nothing and is seen by no "
         "query, as reported for packed-sequence context parallelism that needs lengths divisible "
         "by 2 x cp_size and silently truncates instead of refusing.")),
    "padding_attended": (
        ("cu_seqlens",), "tail padding attended (padding as one more document)",
        ("cu_seqlens closed with seq_len, so the padding tail becomes a document of its own: padding "
         "rows get an output, a finite lse and gradients that reach the padding keys.")),
    "padding_rank_nan": (
        ("cu_seqlens",), "a rank holding only padding returns NaN (0/0 normalisation)",
        ("The final normalisation is computed as exp(lse) / exp(lse_total), which is 0/0 on rows that "
         "see no key at all: a rank holding only padding (every row empty) returns NaN, the NaN loss "
         "reported when a context-parallel rank receives nothing but padding.")),
    "empty_block_lse_posinf": (
        (), "an empty block's lse of +inf instead of -inf",
        ("Rows with no visible key in a block get lse = +inf (flash-attention's forward writes "
         "INFINITY where the row sum is 0) instead of -inf, and the ring merges it: every row with an "
         "empty block (documents on other ranks, the causal future, padding) becomes NaN.")),
    "merge_nan": (
        ("cu_seqlens",), "two empty partials merged into NaN (merge without the -inf guard)",
        ("The online-softmax merge rescales by exp(lse - new_lse) without guarding new_lse = -inf: "
         "two empty partials (a padding row) give exp(-inf - -inf) = NaN.")),
    "sinks_dropped": (
        ("sinks",), "sinks dropped: never added to the denominator",
        ("The sink logits are accepted and ignored (a ring whose kernels take no sinks): out and lse "
         "are plain attention's and dsinks is zero.")),
    "sink_per_step": (
        ("sinks",), "the sink added once per ring step",
        ("The sink joins every block's partial softmax before the merge instead of the final one, so "
         "it is counted world_size times.")),
    "sinks_no_grad": (
        ("sinks",), "no gradient for sinks (sinks.grad stays None)",
        ("The autograd Function returns None for the sinks: the forward is right, sinks.grad stays "
         "None and the sinks never train.")),
    "dsinks_all_reduced": (
        ("sinks",), "dsinks all-reduced inside attention: under --sinks-grad partial the framework reduces it again",
        ("The sink gradient is all-reduced over the ring inside attention, so every rank holds the whole "
         "sequence's; a framework that reduces replicated gradients itself (Megatron-LM, torchtitan: the "
         "default --sinks-grad partial) sums it again and trains with P times the gradient.")),
    "softcap_before_scale": (
        ("softcap",), "softcap applied before scaling (softcap * tanh(q.k / softcap) * scale)",
        ("The cap is applied to the raw dot product and the scale after it, the order mixed up in "
         "ports of Gemma 2's logit softcapping; scores differ wherever tanh is not linear.")),
    "softcap_no_tanh_grad": (
        ("softcap",), "softcap's backward missing tanh' (1 - tanh^2)",
        ("The forward caps the scores but the backward treats the cap as the identity: dS is not "
         "multiplied by 1 - tanh^2, so dq and dk are wrong (out, lse and dv are right).")),
    "sinks_gqa_order": (
        ("sinks",), "per-head sinks in the wrong head order under grouped-query attention",
        ("The sinks indexed as if the query heads were laid out group-major, (g h), while the contract's "
         "are (h g) (head h belongs to K/V head h // group) - the head-order mix-up of GQA ports: head h "
         "uses sinks[(h % kv_heads) * group + h // kv_heads]. Invisible with MHA and with one K/V head.")),
}


def _mutant(bug: str, doc: str):
    def impl(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag", cu_seqlens=None, window=None,
             softcap=None, sinks=None):
        return varlen_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                           cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks, bugs={bug})
    impl.__name__ = impl.__qualname__ = bug
    impl.__module__ = __name__
    impl.__doc__ = doc
    return impl


VARIANT_MUTANTS = {}
for _name, (_keywords, _line, _doc) in _CATALOGUE.items():
    globals()[_name] = _mutant(_name, _doc)
    VARIANT_MUTANTS[_name] = (globals()[_name], _keywords, _line)
