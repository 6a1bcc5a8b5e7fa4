"""The patched copy behind docs/findings/openrlhf.md: `--glue openrlhf` (OpenRLHF 0.11.2's own
setup_ring_attn and unpad_and_slice_tensor, unchanged) with ring-flash-attn's adapter function
replaced by benchmarks.glue_findings' patched copy (the window as transformers' W, the sinks
refused). A model that fails through `--glue openrlhf` and passes through this glue fails for the
adapter's reason, not OpenRLHF's sharding:

    ringcheck step --model mistral --glue benchmarks.openrlhf_findings:patched --world-size 4
    ringcheck step --model gpt_oss --glue benchmarks.openrlhf_findings:patched_window --world-size 4

and the other way round, a mutant of OpenRLHF's own sharding that the step must fail (the targets
rolled inside each rank's slice instead of on the whole sample):

    ringcheck step --model llama --glue benchmarks.openrlhf_findings:rolled_in_shards --world-size 4
"""

from __future__ import annotations

from types import SimpleNamespace

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


class RolledInShards(OpenRLHF):
    """OpenRLHF's glue with `unpad_and_slice_tensor`'s targets rolled after the slicing (a mutant)."""

    layout, dtype = "contiguous", "bfloat16"
    describe = "--glue openrlhf with the targets rolled inside each rank's slice (a mutant, benchmarks/openrlhf_findings.py)"

    def __init__(self):
        super().__init__()
        self.refuses_ring = refuses_ring

    def install(self, group) -> str:
        name = super().install(group)
        shipped = self.utils.unpad_and_slice_tensor

        def sliced_then_rolled(sequences, attention_mask, ring_attn_group):
            out = list(shipped(sequences, attention_mask, ring_attn_group))
            out[2] = out[0].roll(-1, dims=1)   # CHANGED: OpenRLHF rolls each whole sample before slicing
            return tuple(out)

        self.utils = SimpleNamespace(unpad_and_slice_tensor=sliced_then_rolled)  # OpenRLHF's module untouched
        return name


rolled_in_shards = RolledInShards()
