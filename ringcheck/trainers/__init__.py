"""The context-parallel glues that training frameworks ship, run as they ship (issue 49): one
module per trainer, each the adapter that calls the trainer's own public entry (its patch of
transformers, its own sharding of the batch) under ringcheck's glue contract
(`ringcheck.glues.contract.Glue`), and a shim only where the trainer's code cannot run on a CPU,
each named in the glue's `shims` (the report prints them).

| `--glue` | trainer | entry | kind |
|---|---|---|---|
| `deepspeed_ulysses` | DeepSpeed (ALST) | `UlyssesSPAttentionHF.register_with_transformers`, `UlyssesSPDataLoaderAdapter` | Ulysses over sdpa |
| `deepspeed_ulysses:flash_attention_2` | DeepSpeed (ALST) | the same | Ulysses over transformers' flash path (`trainers.flash`) |
| `openrlhf` | OpenRLHF 0.11.2 | `setup_ring_attn`, `unpad_and_slice_tensor`, `update_ring_attn_params` | ring (ring-flash-attn's HF adapter) |
| `llamafactory` | LLaMA-Factory 0.9.5 (v1) | `apply_sequence_parallel`, `sequence_parallel_loss` (its `padding_and_split_data`) | Ulysses over transformers' flash path, its own loss (`Glue.forward_loss`) |
| `verl` | verl 0.9.1 | `set_ulysses_sequence_parallel_group`, `apply_monkey_patch`, `ulysses_pad_and_slice_inputs`, `gather_outputs_and_unpad` | Ulysses over transformers' flash path (`trainers.flash`) |
| `ms_swift` (= `ms_swift:sdpa`) | ms-swift 4.6.0 | `SequenceParallel.prepare`, its forward hook, `prepare_inputs`, `per_token_loss_func_sp` (`GatherLoss`) | Ulysses over sdpa (K/V heads a multiple of P) |
| `ms_swift:flash_attention_2` | ms-swift 4.6.0 | the same | Ulysses over transformers' flash path (`trainers.flash`) |
| `ms_swift_ring` | ms-swift 4.6.0 | the same | its zig-zag ring (`zigzag_ring_flash_attn_varlen_func`) where it picks one: K/V heads < P, padding-free, flash |
| `axolotl` | axolotl 0.21 (axolotl-ringmaster 0.2.7) | `ringmaster.setup`, `shard_batch` as its `ContextParallelContextManager` calls it | Ulysses, ring or both (USP), picked by the K/V heads, over sdpa |
| `axolotl:flash_attention_2` | the same | the same | the same over transformers' flash path (`trainers.flash`) |
| `axolotl@0.19` | axolotl 0.19.0 | `register_ring_attn_from_device_mesh` (ring-flash-attn) | not run: exit 2, one line |

The glues' loader (`ringcheck.glues.load_glue`) imports no trainer: the trainers build on its
contract. The layer above both (`ringcheck.models.step.glue_of`) hands it `TRAINER_GLUES`.
"""

from __future__ import annotations

from functools import partial

from .axolotl import axolotl_019_glue, axolotl_glue
from .deepspeed_ulysses import deepspeed_ulysses_glue
from .llamafactory import llamafactory_glue
from .ms_swift import ms_swift_glue
from .openrlhf import openrlhf_glue
from .verl import verl_glue

# `--glue NAME` -> the function that makes the trainer's glue (ImportError with the fix where the
# trainer's package is missing; importing the module imports no trainer's package)
TRAINER_GLUES = {"deepspeed_ulysses": deepspeed_ulysses_glue,
                 "deepspeed_ulysses:flash_attention_2": partial(deepspeed_ulysses_glue, "flash_attention_2"),
                 "openrlhf": openrlhf_glue,
                 "llamafactory": llamafactory_glue,
                 "verl": verl_glue,
                 "ms_swift": ms_swift_glue,
                 "ms_swift:sdpa": ms_swift_glue,
                 "ms_swift:flash_attention_2": partial(ms_swift_glue, "flash_attention_2"),
                 "ms_swift_ring": partial(ms_swift_glue, "flash_attention_2", ring=True),
                 "axolotl": axolotl_glue,
                 "axolotl:flash_attention_2": partial(axolotl_glue, "flash_attention_2"),
                 "axolotl@0.19": axolotl_019_glue}
