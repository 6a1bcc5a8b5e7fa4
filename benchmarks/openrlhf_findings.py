"""The patched copy behind docs/findings/openrlhf.md: `--glue openrlhf` (OpenRLHF 0.11.2's own
setup_ring_attn and unpad_and_slice_tensor, unchanged) with ring-flash-attn's adapter function
replaced by benchmarks.glue_findings' patched copy (the window as transformers' W, the sinks
refused). A model that fails through `--glue openrlhf` and passes through this glue fails for the
adapter's reason, not OpenRLHF's sharding:

    ringcheck step --model mistral --glue benchmarks.openrlhf_findings:patched --world-size 4
    ringcheck step --model gpt_oss --glue benchmarks.openrlhf_findings:patched_window --world-size 4
"""

from __future__ import annotations

from benchmarks.glue_findings import patched_flash_attention_forward
from ringcheck.trainers.openrlhf import HEAD_STRIDE, SHIMS, OpenRLHF, refuses_ring


class PatchedOpenRLHF(OpenRLHF):
    """OpenRLHF's glue, the adapter's `_flash_attention_forward` patched (a user-contract glue)."""

    layout, dtype = "contiguous", "bfloat16"

    def __init__(self, refuse_sinks: bool = True):
        super().__init__()
        self.refuse_sinks = refuse_sinks
        self.refuses_ring = refuses_ring
        self.describe = (f"--glue openrlhf with ring-flash-attn's adapter's window{' and sinks' if refuse_sinks else ''}"
                         f" patched (benchmarks/openrlhf_findings.py); shims: " + "; ".join(SHIMS))

    def install(self, group) -> str:
        name = super().install(group)  # OpenRLHF's setup_ring_attn, as shipped
        patch_adapter(group, self.refuse_sinks)
        return name


def patch_adapter(group, refuse_sinks: bool) -> None:
    """The adapter's `_flash_attention_forward` (what OpenRLHF's setup installed) replaced by the copy."""
    import transformers.modeling_flash_attention_utils as mfa  # after OpenRLHF's own setup
    mfa._flash_attention_forward = patched_flash_attention_forward(group, HEAD_STRIDE, refuse_sinks)


patched, patched_window = PatchedOpenRLHF(), PatchedOpenRLHF(refuse_sinks=False)
