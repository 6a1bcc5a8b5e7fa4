"""Recipe mutants of the `hf_llama` recipe (needs the optional extra `hf`, transformers).

`labels_sharded`: the sharded *unshifted* labels handed to `LlamaForCausalLM(labels=...)`, which
shifts them inside the shard (transformers #36607, #48493): the token at every shard boundary
loses its target. The count is the sum of the ranks' own counts (all-reduced), as such a step
passes `num_items_in_batch`. `ringcheck step` must name it `labels_shifted_in_shards`.
"""

from __future__ import annotations

from ..recipes.hf_llama import HFLlamaRecipe
from ..step.contract import CP, IGNORE
from .step_mutants import LabelsShiftedInShards


class LabelsSharded(HFLlamaRecipe):
    """The model's own shift on each shard (no shift_labels)."""

    count = LabelsShiftedInShards.count
    targets = LabelsShiftedInShards.targets

    def model_labels(self, labels, cp: CP, cu) -> dict:
        return {"labels": cp.shard(cp.pad(labels, IGNORE), cu_seqlens=cu)}


labels_sharded = LabelsSharded()
EXPECTED = {"labels_sharded": ("one_sequence", "labels_shifted_in_shards")}
