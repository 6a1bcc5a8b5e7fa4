"""DeepSpeed 0.19.8's ALST over sdpa loses the mask: the minimal script, and the patched copy.

`UlyssesSPAttentionHF.register_with_transformers` wraps transformers' core attention in
`uattn_wrapper`, which sets `attention_mask = None` for every core but flex
(`deepspeed/runtime/sequence_parallel/ulysses_sp.py` L544-546, "SP relies on position_ids (not
attention_mask) for causal masking"); `UlyssesSPAttentionHF.forward` then gathers the
`position_ids` (L294-296) and calls the core over the whole sequence with them and no mask
(L356). transformers' flash path reads packed documents from those `position_ids` and the window
from `sliding_window`; its sdpa reads neither (`sdpa_attention_forward` runs `is_causal=True` when
the mask is None). So over sdpa every layer attends plain causal over the gathered sequence:
packed documents see each other, and sliding windows are gone. Nothing warns.

The fix, patched in memory (`patch()`): DeepSpeed hands its core, when the mask it was given is
None, the mask of the gathered sequence rebuilt from what it already holds: causal, within each
document (a document starts where the gathered `position_ids` do not continue by one), within the
layer's `sliding_window` (`rebuilt_mask`). This is the O(n^2) mask DeepSpeed's wrapper avoids; a
later DeepSpeed tutorial refuses packed sdpa instead (docs/findings/trainers.md).

    python -m benchmarks.findings.deepspeed_ulysses minimal   # DeepSpeed + transformers only, P=2, float64
    python -m benchmarks.findings.deepspeed_ulysses confirm   # ringcheck step, as shipped and patched, P=4

`sdpa_patched` is the patched copy as a glue (`--glue benchmarks.findings.deepspeed_ulysses:sdpa_patched`).
"""

from __future__ import annotations

import sys

import torch

from benchmarks.findings.ranks import confirm_line, run_ranks
from ringcheck.thirdparty.deepspeed_private import release_sequence_parallel_groups
from ringcheck.trainers.deepspeed_ulysses import DeepSpeedUlysses

SEQ, P = 16, 2
CONFIGS = {  # the minimal script's models: a window shorter than the sequence; three packed documents
    "mistral (sliding_window 4)": ("MistralConfig", dict(sliding_window=4), [0, SEQ]),
    "llama (documents 5 + 6 + 5)": ("LlamaConfig", {}, [0, 5, 11, SEQ]),
}
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0)


def rebuilt_mask(attn):
    """`attn` (the core DeepSpeed wraps) handed, where DeepSpeed dropped the mask, the boolean mask of
    the gathered sequence: causal, within each document, within the layer's window."""
    def core(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None:
            pos = kwargs["position_ids"]                                   # (rows, whole sequence), gathered
            starts = torch.ones_like(pos, dtype=torch.bool)
            starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1                   # a document starts where they do not continue
            doc = starts.cumsum(-1)
            i = torch.arange(pos.shape[-1], device=pos.device)
            keep = (i[:, None] >= i[None, :]) & (doc[:, :, None] == doc[:, None, :])
            if kwargs.get("sliding_window"):
                keep = keep & (i[:, None] - i[None, :] < kwargs["sliding_window"])
            attention_mask = keep[:, None]
        return attn(module, query, key, value, attention_mask, *args, **kwargs)

    return core


def patch():
    """The patched copy, in memory: every `UlyssesSPAttentionHF` built from now on wraps its core in
    `rebuilt_mask`. Returns the undo."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # optional: deepspeed

    original = UlyssesSPAttentionHF.__init__

    def init(self, attn, *args, **kwargs):
        original(self, rebuilt_mask(attn), *args, **kwargs)

    UlyssesSPAttentionHF.__init__ = init

    def undo():
        UlyssesSPAttentionHF.__init__ = original

    return undo


class PatchedUlysses(DeepSpeedUlysses):
    """ringcheck's DeepSpeed glue with `patch()` applied on the rank (and undone by uninstall)."""

    describe = "DeepSpeed 0.19.8's Ulysses over sdpa, patched: the core given the gathered sequence's mask"

    def install(self, group) -> str:
        self.undo_patch = patch()
        return super().install(group)

    def uninstall(self) -> None:
        super().uninstall()
        if getattr(self, "undo_patch", None):
            self.undo_patch()
            self.undo_patch = None


sdpa_patched = PatchedUlysses("sdpa")


def _model(name: str, attn: str):
    import transformers
    cls, options, _ = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**SMALL, **options)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                         dtype=torch.float64).eval()


def _truth(name: str, ids: torch.Tensor, attn: str = "eager") -> torch.Tensor:
    """One process, each document its own forward (positions from 0): eager, the truth; sdpa, the
    floor (the same model's float32 steps, its norms', rounded another way)."""
    model, cu = _model(name, attn), CONFIGS[name][2]
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[:, s:e], position_ids=torch.arange(e - s)[None]).logits
                          for s, e in zip(cu, cu[1:])], dim=1)


def _rank(rank: int, port: int, patched: bool, out) -> None:
    """One of P ranks: DeepSpeed's register_with_transformers over sdpa, the rank's contiguous slice."""
    import deepspeed.comm as dscomm
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    undo = patch() if patched else None
    ids = torch.randint(0, SMALL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    result = {}
    for name, (_, _, cu) in CONFIGS.items():
        model = _model(name, "sdpa")
        release_sequence_parallel_groups()  # DeepSpeed's groups are made once per process: made again per model
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", P, micro_batch_size=1)
        pos = torch.cat([torch.arange(e - s) for s, e in zip(cu, cu[1:])])[None]
        n = SEQ // P
        with torch.no_grad():
            mine = model(input_ids=ids[:, rank * n:(rank + 1) * n], position_ids=pos[:, rank * n:(rank + 1) * n]).logits
        pieces = [torch.empty_like(mine) for _ in range(P)]
        dist.all_gather(pieces, mine)
        import transformers.integrations.sdpa_attention as sdpa  # transformers' own, back for the truth's floor
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa.sdpa_attention_forward
        if rank == 0:
            whole, truth, floor = torch.cat(pieces, dim=1), _truth(name, ids), _truth(name, ids, "sdpa")
            result[name] = [float((x - truth).norm() / truth.norm()) for x in (whole, floor)]
    if undo:
        undo()
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def minimal() -> dict:
    """DeepSpeed's ALST over sdpa at P=2 against eager on one process, as shipped and patched:
    the relative error of the logits (float64: a correct run is ~1e-16)."""
    found = {}
    for patched in (False, True):
        [result] = run_ranks(_rank, P, patched)
        for name, (err, floor) in result.items():
            print(f"{'patched' if patched else 'as shipped':10s} {name:28s} logits relative error {err:.1e} "
                  f"(sdpa on one process, documents apart: {floor:.1e})")
        found["patched" if patched else "shipped"] = result
    return found


def confirm() -> None:
    """ringcheck step --model at P=4, through DeepSpeed's glue as shipped and through the patched copy."""
    from ringcheck.launch import open_ring

    ring = open_ring(timeout=120)
    try:
        for model in ("llama", "mistral", "gemma3_text"):
            for glue in ("deepspeed_ulysses", "benchmarks.findings.deepspeed_ulysses:sdpa_patched"):
                print(f"{model:12s} {glue:52s} {confirm_line(ring, model, glue)}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    {"minimal": minimal, "confirm": confirm}[(sys.argv[1:] or ["minimal"])[0]]()
