"""What a tiny model's layers hand an attention function, found by one forward on one device
before any rank starts, so that a glue's refusals are said then (exit 2) and not at the first
forward of a ring (an error on every rank).

`survey(tiny)` registers a recording attention, builds the model with it, runs one short
sequence and returns one record per layer call: the keywords, the module's causality and its
config's layer type. `call_refusals` holds them against what ringcheck's glue reads and against
`tiny.layers` (what decides each layer's attention in the native model): a window, sinks, a
softcap or chunks the layer has but does not hand over are refused, as is any keyword the glue
does not know.
"""

from __future__ import annotations

from typing import Any

import torch

from .reading import chunk_of, layer_type

SURVEY = "ringcheck_glue_survey"
_records: list[dict[str, Any]] = []


def _record(module, query, key, value, attention_mask, **kwargs):
    """Record the call; return zeros of the output's shape (only the calls matter)."""
    _records.append({"layer": getattr(module, "layer_idx", None), "keywords": dict(kwargs),
                     "is_causal": getattr(module, "is_causal", True), "module": module})
    b, _, s, _ = query.shape
    return query.new_zeros(b, s, query.shape[1], value.shape[-1]), None


def survey(tiny: Any, seq_len: int = 16) -> list[dict[str, Any]]:
    """One record per attention call of one forward of `tiny` (a `TinyModel`) on `seq_len` tokens."""
    from transformers import AttentionInterface  # transformers is the optional extra `hf`
    AttentionInterface.register(SURVEY, _record)
    model = tiny.build(SURVEY)
    _records.clear()
    try:
        with torch.no_grad():
            ids = torch.zeros(1, seq_len, dtype=torch.long)
            model(input_ids=ids, position_ids=torch.arange(seq_len)[None], use_cache=False)
    except Exception as exc:
        raise RuntimeError(f"{tiny.name}: the tiny model's forward on one device failed before any rank started, "
                           f"so no glue can be judged on it ({type(exc).__name__}: {exc})") from exc
    records = list(_records)
    _records.clear()
    return records


def call_refusals(tiny: Any, records: list[dict[str, Any]], known: frozenset, glue: str) -> list[str]:
    """Lines "layer i: ..." for what the calls hand (or fail to hand) that `glue` cannot carry."""
    layers = {layer.index: layer for layer in tiny.layers}
    lines: list[str] = []
    for rec in records:
        index, kw, module = rec["layer"], rec["keywords"], rec["module"]
        said = []
        unknown = sorted(k for k, value in kw.items() if k not in known and value is not None)
        if unknown:
            said.append(f"keyword(s) {', '.join(unknown)} handed to the attention, which {glue} does not know")
        if kw.get("dropout"):
            said.append(f"attention dropout {kw['dropout']} (the ring has none)")
        if kw.get("is_causal", rec["is_causal"]) is False:
            said.append("non-causal attention")
        layer = layers.get(index)
        if layer is not None:
            if layer.kind == "sliding" and kw.get("sliding_window") is None and layer_type(module) != "sliding_attention":
                said.append(f"a sliding window (W={layer.window}) the layer does not hand over (no sliding_window "
                            f"keyword, and config.layer_types does not say sliding_attention)")
            if layer.sinks and kw.get("s_aux") is None:
                said.append("sinks the layer does not hand over (no s_aux keyword)")
            if layer.softcap and kw.get("softcap") is None:
                said.append(f"a softcap ({layer.softcap}) the layer does not hand over (no softcap keyword)")
            if layer.kind == "chunked" and chunk_of(module) != layer.chunk:
                said.append(f"chunks of {layer.chunk} the glue cannot read from the layer (config.layer_types, "
                            f"config.attention_chunk_size)")
        lines.extend(f"layer {index}: {s}" for s in said)
    return list(dict.fromkeys(lines))
