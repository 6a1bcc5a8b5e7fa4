"""What transformers actually hands a layer's attention, recorded, and the zoo surveyed with it.

`TinyModel.layers` is read from the scaled config; a probe registered through transformers'
`AttentionInterface` records what each layer's attention is really called with (scaling,
sliding_window, s_aux, softcap, the shapes, and the mask itself) so the description is checked
against the model instead of trusted. The survey runs that check over every causal-LM
architecture transformers registers.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from .tiny import LayerAttention, ModelRefused, TinyModel, tiny_model, zoo_names

PROBE = "ringcheck_probe"
_records: list[dict[str, Any]] = []


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Record the call, then compute what the model's own eager attention computes."""
    _records.append({
        "layer": getattr(module, "layer_idx", None), "scaling": kwargs.get("scaling"),
        "sliding_window": kwargs.get("sliding_window"), "softcap": kwargs.get("softcap"),
        "s_aux": None if kwargs.get("s_aux") is None else tuple(kwargs["s_aux"].shape),
        "query": tuple(query.shape), "key": tuple(key.shape), "value": tuple(value.shape),
        "mask": None if attention_mask is None else _visible(attention_mask)})
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward for the probe to call")
    return eager(module, query, key, value, attention_mask, **kwargs)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """The boolean (q, k) visibility of batch 0, head 0, from a boolean or additive mask."""
    m = mask[0, 0] if mask.dim() == 4 else mask[0]
    return m.detach().clone() if m.dtype == torch.bool else (m == 0).detach().clone()


def register_probe() -> str:
    """Register the probe, with eager's mask: a function registered alone is handed no mask at all
    (transformers' mask preparation exits early for a name it has no mask function for), so a
    chunked layer would reach it with nothing that says its chunks."""
    from transformers import AttentionInterface  # start-up time
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(PROBE, _probe_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, eager_mask)
    return PROBE


def probe(tiny: TinyModel, *, seed: int = 0, dtype=torch.float64) -> list[dict[str, Any]]:
    """One forward of the tiny model at its seq_len through the probe: one record per attention call."""
    model = tiny.build(register_probe(), dtype=dtype, seed=seed)
    ids = torch.randint(0, tiny.vocab_size, (1, tiny.seq_len), generator=torch.Generator().manual_seed(seed))
    _records.clear()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return list(_records)


def expected_visibility(layer: LayerAttention, n: int) -> torch.Tensor:
    """Key j visible to query i: causal, within the window (i - W < j), within the chunk (i // C == j // C)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    ok = j <= i
    if layer.window is not None:
        ok &= i - layer.window < j
    if layer.chunk is not None:
        ok &= i // layer.chunk == j // layer.chunk
    return ok


def disagreements(tiny: TinyModel, records: list[dict[str, Any]]) -> list[str]:
    """Where `tiny.layers` and what transformers passed differ (empty: they agree)."""
    out = []
    if len(records) != len(tiny.layers):
        return [f"{len(records)} attention calls for {len(tiny.layers)} described layers"]
    for pos, (layer, r) in enumerate(zip(tiny.layers, records)):
        i = layer.index if r["layer"] is None else r["layer"]
        said = f"layer {i}"
        if i != layer.index or pos != layer.index:
            out.append(f"{said}: called in position {pos}")
        if r["scaling"] is None or abs(r["scaling"] - layer.scaling) > 1e-12 * layer.scaling:
            out.append(f"{said}: scaling {r['scaling']} passed, {layer.scaling} described")
        if r["sliding_window"] not in (None, layer.window):
            out.append(f"{said}: sliding_window {r['sliding_window']} passed, {layer.window} described")
        if (r["s_aux"] is not None) != layer.sinks:
            out.append(f"{said}: s_aux {r['s_aux']} passed, sinks={layer.sinks} described")
        if (r["softcap"] or None) != layer.softcap:
            out.append(f"{said}: softcap {r['softcap']} passed, {layer.softcap} described")
        b, n = r["query"][0], r["query"][2]
        want = {"query": (b, layer.heads, n, layer.head_dim), "key": (b, layer.kv_heads, n, layer.head_dim),
                "value": (b, layer.kv_heads, n, layer.v_head_dim)}
        out += [f"{said}: {t} {r[t]} passed, {s} described" for t, s in want.items() if r[t] != s]
        if r["mask"] is None:
            if layer.window is not None or layer.chunk is not None:
                out.append(f"{said}: no mask passed for a {layer.kind} layer")
        elif not torch.equal(r["mask"][-n:, -n:], expected_visibility(layer, n)):
            diff = (r["mask"][-n:, -n:] != expected_visibility(layer, n)).nonzero()[:3].tolist()
            out.append(f"{said}: the mask differs from a {layer.kind} layer's (query, key) at {diff}")
    return out


def features(tiny: TinyModel) -> list[str]:
    """The attention features a tiny model uses, as the zoo table names them."""
    f = sorted({layer.kind for layer in tiny.layers})
    layers = tiny.layers
    if any(x.sinks for x in layers):
        f.append("sinks")
    if any(x.softcap for x in layers):
        f.append("softcap")
    if any(abs(x.scaling - x.head_dim ** -0.5) > 1e-12 for x in layers):
        f.append("scaling")
    if any(x.kv_heads != x.heads for x in layers):
        f.append("gqa")
    if any(x.v_head_dim != x.head_dim for x in layers):
        f.append("v_head_dim")
    if tiny.moe:
        f.append("moe")
    c = tiny.config
    if getattr(c, "use_qk_norm", False) or getattr(c, "qk_layernorm", False) or any(
            "q_norm" in n for n, _ in _meta_names(tiny)):
        f.append("qk_norm")
    if (getattr(c, "partial_rotary_factor", None) or 1.0) < 1.0:
        f.append("partial_rotary")
    if 0 in (getattr(c, "no_rope_layers", None) or []):
        f.append("no_rope_layers")
    rope = getattr(c, "rope_parameters", None) or {}
    types = {v.get("rope_type") for v in rope.values() if isinstance(v, dict)} | {rope.get("rope_type")}
    f += [f"rope:{t}" for t in sorted(t for t in types if t and t != "default")]
    return f


def _meta_names(tiny: TinyModel):
    from transformers import AutoModelForCausalLM  # start-up time

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(type(tiny.config).from_dict(tiny.config.to_dict()))
                    .named_modules())


def survey(names: tuple[str, ...] | None = None, *, seq_len: int = 64) -> list[dict[str, Any]]:
    """Per architecture: built tiny? a forward at seq_len ran? its features, the probe's agreement, or
    why it was refused or failed, and the seconds it took."""
    rows = []
    for name in names or zoo_names():
        t0 = time.perf_counter()
        row: dict[str, Any] = {"model": name, "builds": False, "features": [], "status": "", "detail": ""}
        try:
            tiny = tiny_model(name, seq_len=seq_len)
            row["features"] = features(tiny)
            row["layers"] = len(tiny.layers)
            records = probe(tiny)
            row["builds"] = True
            bad = disagreements(tiny, records)
            row["status"] = "ok" if not bad else "layers disagree"
            row["detail"] = "; ".join(bad[:3])
        except ModelRefused as e:
            row["status"], row["detail"] = "refused", str(e)
        except Exception as e:  # the survey records every failure, whatever its kind, and moves on
            row["status"], row["detail"] = "fails", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def survey_markdown(rows: list[dict[str, Any]]) -> str:
    """The survey as a Markdown table, with the counts above it."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [f"{len(rows)} causal-LM architectures of transformers: "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda x: -x[1])), "",
             "| model | builds tiny | layers | attention features | probe | seconds | why / detail |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        detail = r["detail"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['model']} | {'yes' if r['builds'] else 'no'} | {r.get('layers', '')} | "
                     f"{', '.join(r['features'])} | {r['status']} | {r['seconds']} | {detail[:300]} |")
    return "\n".join(lines) + "\n"
