"""verl 0.9.1's Ulysses runs no all-to-all for a layer that hands no position_ids: the minimal
script, and the patched copy.

`_ulysses_flash_attention_forward` (`verl/models/transformers/monkey_patch.py`, the function L87-155)
runs its all-to-alls only `if ulysses_sp_size > 1 and position_ids is not None` (L119 and L151; the
comment above L119: a ViT hands no `position_ids`, so sequence parallelism is disabled for it). A
text model whose attention layers do not hand `position_ids` to the attention function
(gpt_bigcode: learned absolute positions, added to the embeddings, never passed to its attention)
passes verl's head checks (L343-350), is patched, and then every rank runs the flash path over its
own slice alone: a token attends only to the keys of its own rank's slice. Nothing warns.

The fix, patched in memory (`patch(positions)`): verl's function is handed the rank's own
`position_ids` (those `ulysses_pad_and_slice_inputs` gave its slice) where the layer hands none,
so that its all-to-alls run; the flash path then also reads the packed documents from them.

    python -m benchmarks.findings.verl minimal   # verl + transformers (+ ringcheck's flash stand-in), P=2, bf16
    python -m benchmarks.findings.verl confirm   # ringcheck step, as shipped and patched, P=4 (gpt_bigcode, ministral3)

`patched` is the patched copy as a glue (`--glue benchmarks.findings.verl:patched`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from benchmarks.findings.ranks import run_ranks
from ringcheck.thirdparty.transformers_private import FLASH_FORWARD
from ringcheck.trainers.verl import Verl, refuses_ring, verl_modules

SEQ, P = 64, 2
CONFIGS = {  # the minimal script's models: one without position_ids in its attention calls, one with (control)
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=128)),
    "llama (control)": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=128)),
}


def patch(positions) -> Callable[[], None]:
    """The patched copy, in memory: transformers' flash call (verl's function, once patched) handed
    `positions()` (the rank's position_ids) where the layer hands none. Returns the undo."""
    from transformers.integrations import flash_attention  # optional: transformers (the hf extra)

    shipped = getattr(flash_attention, FLASH_FORWARD)

    def with_positions(*args, **kwargs):
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions()
        return shipped(*args, **kwargs)

    setattr(flash_attention, FLASH_FORWARD, with_positions)
    return lambda: setattr(flash_attention, FLASH_FORWARD, shipped)


class PatchedVerl(Verl):
    """ringcheck's verl glue with `patch()` applied after verl's own (undone by uninstall)."""

    layout, dtype = "contiguous", "bfloat16"
    describe = "verl 0.9.1's Ulysses, patched: the rank's position_ids handed where the layer hands none"
    refuses_ring = staticmethod(refuses_ring)

    def configure(self, config, group) -> None:
        super().configure(config, group)
        self.undo_patch = patch(lambda: self.positions)

    def shard(self, batch: dict, group) -> dict:
        got = super().shard(batch, group)
        self.positions = got["position_ids"]
        return got

    def uninstall(self) -> None:
        if getattr(self, "undo_patch", None):
            self.undo_patch()
            self.undo_patch = None
        super().uninstall()


patched = PatchedVerl()


def _model(name: str, attn: str):
    import transformers
    cls, options = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**options)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16).eval()


def _rank(rank: int, port: int, patched_: bool, out) -> None:
    """One of P ranks: verl's patch, its slice of one sequence, its gather of the logits, against the
    same bfloat16 model through the same flash path on one process."""
    import torch.distributed as dist
    from transformers.integrations import flash_attention

    from ringcheck.trainers.flash import FLASH_CORE, install_flash_core

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    ulysses, monkey_patch = verl_modules()
    install_flash_core()
    shipped = getattr(flash_attention, FLASH_FORWARD)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).unsqueeze(0)
    result = {}
    for name in CONFIGS:
        model = _model(name, FLASH_CORE)
        with torch.no_grad():
            whole = model(input_ids=ids, position_ids=pos).logits.float()
        ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
        monkey_patch.apply_monkey_patch(model, ulysses_sp_size=P)
        mine, my_pos, pad = ulysses.ulysses_pad_and_slice_inputs(ids, pos, sp_size=P)
        undo = patch(lambda: my_pos) if patched_ else None
        with torch.no_grad():
            logits = model(input_ids=mine, position_ids=my_pos).logits
        gathered = ulysses.gather_outputs_and_unpad(logits, gather_dim=1, unpad_dim=1, padding_size=pad).float()
        result[name] = float((gathered - whole).norm() / whole.norm())
        if undo:
            undo()
        setattr(flash_attention, FLASH_FORWARD, shipped)   # transformers' own again for the next model
        ulysses.set_ulysses_sequence_parallel_group(None)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def minimal() -> dict:
    """verl at P=2 against the same model through the same flash path on one process, as shipped and
    patched: the relative error of the logits (bf16; a correct run is 0 here: the same kernel)."""
    found = {}
    for patched_ in (False, True):
        [result] = run_ranks(_rank, P, patched_)
        for name, err in result.items():
            print(f"{'patched' if patched_ else 'as shipped':10s} {name:16s} logits gathered vs one process (the same "
                  f"flash path, bf16): relative error {err:.1e}", flush=True)
        found["patched" if patched_ else "shipped"] = result
    return found


def confirm(models=("gpt_bigcode", "ministral3")) -> None:
    """ringcheck step --model at P=4, through verl's glue as shipped and through the patched copy."""
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.launch import open_ring
    from ringcheck.models.step import ModelStepConfig

    ring = open_ring(timeout=120)
    try:
        for model in models:
            for glue in ("verl", "benchmarks.findings.verl:patched"):
                judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=4), ring)
                failed = [c["case"] for c in judged["cases"] if c["verdict"] == "fail"]
                worst = max((c["logits"]["ratio"] for c in judged["cases"] if "ratio" in c.get("logits", {})),
                            default=float("nan"))
                print(f"{model:12s} {glue:36s} {judged['verdict']:5s} worst logits {worst:.2g} of the budget; "
                      f"failed: {', '.join(failed) or 'none'}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    what = (sys.argv[1:] or ["minimal"])[0]
    if what == "confirm" and sys.argv[2:]:   # confirm MODEL,MODEL
        confirm(tuple(sys.argv[2].split(",")))
    else:
        {"minimal": minimal, "confirm": confirm}[what]()
