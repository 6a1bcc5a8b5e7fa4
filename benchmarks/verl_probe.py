"""Can verl 0.9.1's Ulysses glue run on a CPU as shipped? A probe for `--glue verl` (issue 62, item 1).

    .trainer-envs/verl/bin/python -m benchmarks.verl_probe [MODEL] [--world-size P]

(the environment: `python -m benchmarks.trainer_envs --env verl`.) On P gloo ranks it runs verl's own
`set_ulysses_sequence_parallel_group`, `apply_monkey_patch(model, ulysses_sp_size=P)` and
`ulysses_pad_and_slice_inputs` over one packed row of two documents (61 tokens: verl pads it to a
multiple of P), then `gather_outputs_and_unpad` of the logits, against the same bfloat16 model on
one device through the same flash path. The shims, each what `--glue verl` would list: `ray` stubbed
(verl's package imports it for annotations); transformers' own `flash_attention_forward` registered
under a name without "flash" and its `_lazy_imports` answered with ringcheck's flash-attn stand-in
(transformers refuses flash-attn without CUDA); verl's group is the whole world here. Not a check of
correctness (the truth is ringcheck's `step --model`): whether verl's code runs, and what it gives.

Measured (transformers 5.10.4): llama, mistral (1 K/V head: verl repeats it) and gemma2 (softcap,
sliding layers) at P=2, and mistral at P=4 (the row padded by 3), give logits bit-identical to the
one-device flash path (relative error 0.0 on every rank), about a minute a run on 2 shared cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringcheck.trainers.flash import FLASH_CORE, install_flash_core


def shims() -> None:
    """The `ray` stub and the flash path on the stand-in (`ringcheck.trainers.flash`, the trainers'
    glues' own flash core; see the module's docstring)."""
    ray = sys.modules.setdefault("ray", types.ModuleType("ray"))
    ray.ObjectRef = getattr(ray, "ObjectRef", type("ObjectRef", (), {}))
    install_flash_core()


def rank_main(rank: int, world: int, port: int, model_name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shims()
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.ulysses import (
        gather_outputs_and_unpad,
        set_ulysses_sequence_parallel_group,
        ulysses_pad_and_slice_inputs,
    )

    from ringcheck.models import tiny_model

    tiny = tiny_model(model_name)
    model = tiny.build(FLASH_CORE, dtype=torch.bfloat16)
    ids = torch.randint(0, tiny.vocab_size, (1, 61), generator=torch.Generator().manual_seed(0), device="cpu")
    pos = torch.cat([torch.arange(27, device="cpu"), torch.arange(34, device="cpu")]).unsqueeze(0)
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    apply_monkey_patch(model, ulysses_sp_size=world)
    mine, my_pos, pad = ulysses_pad_and_slice_inputs(ids, pos, sp_size=world)
    with torch.no_grad():
        logits = model(input_ids=mine, position_ids=my_pos, use_cache=False).logits
    gathered = gather_outputs_and_unpad(logits, gather_dim=1, unpad_dim=1, padding_size=pad).float()
    err = ((gathered - whole).norm() / whole.norm()).item()
    print(f"{model_name} rank {rank}/{world}: padded by {pad}, shard {tuple(mine.shape)}; logits gathered vs one "
          f"device (bf16, the same flash path): relative error {err:.2e}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama", help="a model_type (default llama)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.world_size, port, args.model), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
