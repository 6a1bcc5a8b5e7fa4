"""Findings on ring-flash-attn 0.1.8's shipped Hugging Face adapter (docs/findings/glues.md):
what it does with transformers 5.23 as shipped, and which attention semantics it loses once it
runs, each confirmed by a patched copy of the adapter's function and by the catalogue's mutant
glue that loses the same semantic (the adapter's logits equal that mutant's within bf16 noise).

    python -m benchmarks.glue_findings [--out reports/glues]

Writes README.md (the tables) and findings.json. P = 4, contiguous shards (the adapter's
llama3-style layout), 64 tokens (16 per rank), bfloat16 through the flash-attn stand-in; the
truth is float64 eager on one device; the noise is ringcheck's own glue on the same bf16 model.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

from benchmarks.glue_models import eager_logits, glue_logits, tiny_transformers_model, token_ids
from ringcheck.glues.ring_flash_attn import HEADS_K_STRIDE, RingFlashAttnGlue, hf_adapter
from ringcheck.launch import LocalRings

ROOT = Path(__file__).resolve().parents[1]
SEQ, P = 64, 4
MUTANTS = "ringcheck.catalogue.glue_mutants:"
# name -> (config class, options, documents); windows on both sides of the shard length (16)
MODELS = {
    "llama_docs": ("LlamaConfig", {}, [0, 19, 40, 64]),
    "granite (scaling 0.3)": ("GraniteConfig", dict(attention_multiplier=0.3), None),
    "mistral W=12": ("MistralConfig", dict(sliding_window=12), None),
    "mistral W=24": ("MistralConfig", dict(sliding_window=24), None),
    "gpt_oss W=12, sinks": ("GptOssConfig", dict(sliding_window=12, num_local_experts=2, num_experts_per_tok=1,
                                                 layer_types=["sliding_attention", "full_attention"]), None),
    "llama4_text chunk=12": ("Llama4TextConfig", dict(attention_chunk_size=12, intermediate_size_mlp=32,
                                                      num_local_experts=2, no_rope_layers=[1, 0],
                                                      layer_types=["chunked_attention", "full_attention"]), None),
    "gemma2 softcap": ("Gemma2Config", dict(sliding_window=12, attn_logit_softcapping=0.5, initializer_range=0.2,
                                            layer_types=["sliding_attention", "full_attention"]), None),
}
CANDIDATES = ("window_wider", "window_dropped_short_shard", "window_dropped", "sinks_dropped", "mask_plain_causal",
              "documents_crossed", "scale_default", "softcap_dropped")


# --- the patched copy: the adapter's _flash_attention_forward with the window in transformers' terms -----------

def patched_flash_attention_forward(process_group, heads_k_stride, refuse_sinks: bool = True):
    """A copy of ring-flash-attn 0.1.8's `create_ring_flash_attention_forward(...)._flash_attention_forward`
    (via its v3 wrapper's signature) with two changes, each marked: the window is transformers'
    W as flash's (W - 1, 0) on global positions, whatever the shard's key length; `s_aux` (sinks,
    which llama3_flash_attn_varlen_func cannot take) is an error instead of being swallowed."""
    adapter = hf_adapter()

    def forward(query_states, key_states, value_states, attention_mask, query_length, is_causal, dropout=0.0,
                position_ids=None, softmax_scale=None, sliding_window=None, use_top_left_mask=False, softcap=None,
                deterministic=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                target_dtype=None, attn_implementation=None, **kwargs):
        if refuse_sinks and kwargs.get("s_aux") is not None:   # CHANGED: was swallowed by **kwargs
            raise ValueError("sinks (s_aux) are not supported by llama3_flash_attn_varlen_func")
        causal = is_causal and not (use_top_left_mask and query_length == 1)
        flash_kwargs = {}
        if sliding_window is not None:        # CHANGED: was (W, W), and only when the shard's key length > W
            flash_kwargs["window_size"] = (sliding_window - 1, 0)
        flash_kwargs["deterministic"] = bool(deterministic)
        assert softcap is None, "llama3_flash_attn_varlen_func does not support softcap yet."
        flash_kwargs["group"] = process_group
        assert causal, "only causal attention is supported yet."
        assert query_states.size(0) == 1, "varlen data should be processed in advance."
        params = adapter.DATA_PARAMS
        out = adapter.llama3_flash_attn_varlen_func(
            query_states.squeeze(dim=0), key_states.squeeze(dim=0), value_states.squeeze(dim=0),
            cu_seqlens_q=params["cu_seqlens_q"], cu_seqlens_k=params["cu_seqlens_k"],
            max_seqlen_q=params["max_seqlen_q"], max_seqlen_k=params["max_seqlen_k"], heads_k_stride=heads_k_stride,
            local_k_slice=params["local_k_slice"], dropout_p=dropout, softmax_scale=softmax_scale, causal=causal,
            **flash_kwargs)
        return out.unsqueeze(dim=0)

    return forward


class PatchedGlue(RingFlashAttnGlue):
    """The adapter with the patched copy in place of its `_flash_attention_forward` (a user-contract
    glue); `refuse_sinks=False` patches the window alone, to see the sinks' loss by itself."""

    layout, dtype = "contiguous", "bfloat16"

    def __init__(self, refuse_sinks: bool = True):
        super().__init__()
        self.refuse_sinks = refuse_sinks
        self.describe = (f"ring-flash-attn's HF adapter with the window{' and sinks' if refuse_sinks else ''} "
                         f"patched (benchmarks/glue_findings.py)")

    def install(self, group) -> str:
        import transformers.modeling_flash_attention_utils as mfa  # after the adapter's own install
        name = super().install(group)
        mfa._flash_attention_forward = patched_flash_attention_forward(group, HEADS_K_STRIDE, self.refuse_sinks)
        return name


patched = PatchedGlue()
patched_window = PatchedGlue(refuse_sinks=False)


# --- as shipped ------------------------------------------------------------------------------------------------

def shipped_task(member) -> dict:
    """What ring-flash-attn 0.1.8's adapter does with transformers 5.23 as shipped (a fresh process)."""
    from ringcheck.flash_stand_in import install
    install()
    found = {}
    try:
        import ring_flash_attn  # noqa: F401  # the package imports its HF adapter
        found["import"] = "imports"
    except ImportError as exc:
        found["import"] = f"ImportError: {exc}"
    adapter = hf_adapter()   # with shim 1
    import transformers.modeling_flash_attention_utils as mfa
    found["transformers_parameters"] = len(inspect.signature(mfa._flash_attention_forward).parameters)
    found["adapter_parameters"] = [len(inspect.signature(f).parameters)
                                   for f in adapter.create_ring_flash_attention_forward(member.group, 1)]
    try:
        adapter.substitute_hf_flash_attn(member.group, HEADS_K_STRIDE)
        found["substitute"] = "installs"
    except ValueError as exc:
        found["substitute"] = f"ValueError: {exc}"
    site = str(Path(inspect.getfile(mfa)).parents[1])
    return {key: value.replace(site, "site-packages") if isinstance(value, str) else value
            for key, value in found.items()}


def run(out_dir: Path) -> dict:
    truth = {name: eager_logits(tiny_transformers_model(spec, "eager"), token_ids(SEQ), spec[2])
             for name, spec in MODELS.items()}
    with LocalRings() as rings:
        shipped = rings.run(1, shipped_task)[0]
    glues = {"ring_flash_attn": ("ring_flash_attn", None), "patched copy": ("benchmarks.glue_findings:patched", None),
             "window patched only": ("benchmarks.glue_findings:patched_window", None),
             "ringcheck (bf16 noise)": ("ringcheck", "contiguous"),
             **{m: (MUTANTS + m, None) for m in CANDIDATES}}
    logits = {}
    with LocalRings() as rings:
        for label, (spec, layout) in glues.items():
            ranks = rings.run(P, glue_logits, spec, layout, MODELS, "bfloat16", SEQ)
            logits[label] = {name: (ranks[0][name] if isinstance(ranks[0][name], str) else
                                    torch.cat([r[name] for r in ranks], dim=1)) for name in MODELS}
            print(f"{label}: done", file=sys.stderr)
    rows = []
    for name in MODELS:
        row = {"model": name}
        row["max |truth|"] = truth[name].abs().max().item()
        for label in ("ring_flash_attn", "patched copy", "window patched only", "ringcheck (bf16 noise)"):
            got = logits[label][name]
            row[label] = got if isinstance(got, str) else (got - truth[name]).abs().max().item()
        for label in ("ring_flash_attn", "window patched only"):
            row[f"{label}: nearest"] = nearest(logits, label, name)
        rows.append(row)
    return {"shipped": shipped, "rows": rows}


def nearest(logits: dict, label: str, name: str) -> str:
    """The glue of CANDIDATES (or the correct glue) whose bf16 logits `label`'s are closest to."""
    got = logits[label][name]
    if isinstance(got, str):
        return "-"
    near = {m: (got - logits[m][name]).abs().max().item() for m in ("ringcheck (bf16 noise)", *CANDIDATES)
            if not isinstance(logits[m][name], str)}
    best = min(near, key=near.get)
    return f"{'the correct glue' if best.startswith('ringcheck') else best} ({near[best]:.1e})"


def markdown(found: dict) -> str:
    s = found["shipped"]
    lines = ["# ring-flash-attn 0.1.8's Hugging Face adapter under transformers 5.23", "",
             "Regenerate: `python -m benchmarks.glue_findings` (see docs/findings/glues.md).", "",
             "## As shipped", "",
             f"- `import ring_flash_attn`: {s['import']}",
             f"- `substitute_hf_flash_attn` (with the import shim): {s['substitute']}",
             f"- transformers' `_flash_attention_forward` has {s['transformers_parameters']} parameters; the "
             f"adapter's variants have {s['adapter_parameters']}", "",
             f"## With the two shims (P={P}, contiguous, {SEQ} tokens, bfloat16 on the flash-attn stand-in)", "",
             "Max |logits - float64 eager| over all rows (max |truth| beside it); nearest: the catalogue's mutant "
             "glue (or the correct glue) whose bf16 logits the adapter's are closest to, and the distance.", "",
             "| model | max abs truth | ring_flash_attn | nearest | patched copy | window patched only | nearest | "
             "ringcheck (bf16 noise) |", "|---|---|---|---|---|---|---|---|"]
    for r in found["rows"]:
        def cell(v):
            return v.split("\n")[0][:90] if isinstance(v, str) else f"{v:.2e}"
        lines.append(f"| {r['model']} | {r['max |truth|']:.2f} | {cell(r['ring_flash_attn'])} | "
                     f"{r['ring_flash_attn: nearest']} | {cell(r['patched copy'])} | {cell(r['window patched only'])} | "
                     f"{r['window patched only: nearest']} | {cell(r['ringcheck (bf16 noise)'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "glues")
    args = parser.parse_args(argv)
    found = run(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "findings.json").write_text(json.dumps(found, indent=1) + "\n")
    (args.out / "README.md").write_text(markdown(found))
    print(markdown(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
