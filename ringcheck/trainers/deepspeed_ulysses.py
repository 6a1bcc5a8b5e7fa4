"""`--glue deepspeed_ulysses`: DeepSpeed's Ulysses sequence parallelism for Hugging Face models
(ALST, `deepspeed/runtime/sequence_parallel/ulysses_sp.py`), what accelerate and TRL call with
`sp_backend="deepspeed"`, run as it ships.

- **Its patch of transformers**: `UlyssesSPAttentionHF.register_with_transformers(model,
  core_attn_implementation="sdpa", sequence_parallel_size=P, micro_batch_size=rows)` overrides
  `ALL_ATTENTION_FUNCTIONS["sdpa"]` with its wrapper (an all-to-all from sequence shards to head
  groups, transformers' sdpa over the whole sequence, the all-to-all back). `configure` calls it
  with the model's config; `uninstall` puts transformers' sdpa back.
- **Its sharding of the batch**: `UlyssesSPDataLoaderAdapter` over a loader of the one global
  batch: it gathers every rank's sample, shifts the labels on the whole sequence and hands each
  rank its contiguous slice (`shard`); the first micro-batch it yields is the batch of rank 0,
  the one every rank of the group was given.

Shims (the report prints them): DeepSpeed's `mpu.initialize_sequence_parallel` builds its SP
groups from the whole world's consecutive ranks; here it is handed the CP group of ringcheck's
mesh instead, so that the group DeepSpeed attends over is the one ringcheck judges. Nothing else
of DeepSpeed's is changed. It needs `deepspeed` importable (`pip install deepspeed==0.19.8`; on a
CPU it builds its shared-memory comm op with ninja the first time).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch

from ..glues.contract import Glue
from ..thirdparty.deepspeed_private import hand_sequence_parallel_group, release_sequence_parallel_groups
from ..thirdparty.transformers_private import set_attn_implementation

VERSION = "0.19.8"  # the DeepSpeed this adapter was written and measured against
CORE = "sdpa"       # the core attention DeepSpeed wraps (its docs' default; eager it refuses)
SHIMS = ("DeepSpeed's mpu.initialize_sequence_parallel is given ringcheck's CP group (it builds its own from the "
         "whole world's consecutive ranks)",)


def _deepspeed():
    """DeepSpeed's modules, or ImportError with the fix."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"--glue deepspeed_ulysses runs DeepSpeed's own Ulysses code, and deepspeed is not installed; "
                          f"pip install deepspeed=={VERSION} (the version this adapter was measured on)")
    import deepspeed.comm as dscomm  # optional: a trainer's package, only for --glue deepspeed_ulysses
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu  # optional, as above
    from deepspeed.runtime.sequence_parallel import ulysses_sp  # optional, as above
    return dscomm, mpu, ulysses_sp


class DeepSpeedUlysses:
    """The adapter: the state DeepSpeed's entry points need between ringcheck's calls."""

    def __init__(self):
        self.group = self.config = None
        self.rows = 0
        self.original = None   # transformers' sdpa, put back by uninstall

    def install(self, group) -> str:
        dscomm, _, _ = _deepspeed()
        if not dscomm.is_initialized():  # DeepSpeed's comm over the torch.distributed world already made
            dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        self.group = group
        return CORE

    def configure(self, config, group, rows: int = 1) -> None:
        """DeepSpeed's `register_with_transformers` for this model, the CP group (the shim above) and
        `rows` per micro-batch (its `micro_batch_size`: `shard` registers again when a batch has other)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time: a --model run only

        self.config, self.rows = config, rows

        _, mpu, ulysses_sp = _deepspeed()
        self.uninstall()
        self.original = ALL_ATTENTION_FUNCTIONS[CORE]
        release_sequence_parallel_groups()
        shimmed = mpu.initialize_sequence_parallel

        def initialize(sequence_parallel_size: int) -> None:  # the shim: DeepSpeed's group is ringcheck's CP group
            hand_sequence_parallel_group(group)

        mpu.initialize_sequence_parallel = initialize
        try:
            copy = type(config).from_dict(config.to_dict())
            set_attn_implementation(copy, CORE)  # the model is built with the core implementation DeepSpeed wraps
            ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
                SimpleNamespace(config=copy), CORE, torch.distributed.get_world_size(group), micro_batch_size=rows,
                seq_length_is_variable=True)
        finally:
            mpu.initialize_sequence_parallel = shimmed

    def uninstall(self) -> None:
        if self.original is not None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time

            ALL_ATTENTION_FUNCTIONS[CORE] = self.original
            self.original = None

    def shard(self, batch: dict, group) -> dict:
        """DeepSpeed's `UlyssesSPDataLoaderAdapter` on a loader of this one batch: this rank's slice."""
        _, _, ulysses_sp = _deepspeed()
        if batch["input_ids"].shape[0] != self.rows:  # a user sets micro_batch_size to the batch's rows
            self.configure(self.config, group, rows=batch["input_ids"].shape[0])
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        sample = {k: v for k, v in batch.items() if k != "cu_seqlens"}  # DeepSpeed's loader holds no boundaries
        adapter = ulysses_sp.UlyssesSPDataLoaderAdapter([sample], sp_rank=rank, sp_group=group, sp_world_size=world,
                                                        device=batch["input_ids"].device)
        mine = next(adapter)  # the batch of the group's rank 0 (every rank was given the same), this rank's slice
        n = mine["input_ids"].shape[1]
        return {"input_ids": mine["input_ids"], "position_ids": mine["position_ids"], "labels": mine["shift_labels"],
                "positions": torch.arange(rank * n, (rank + 1) * n, device=mine["input_ids"].device)}

    @staticmethod
    def refuses_ring(tiny, world_size: int) -> list[str]:
        """DeepSpeed's own conditions (`UlyssesSPAttentionHF.__init__`): the query heads divisible by P, and
        the K/V heads divisible by P or P by them (it replicates K/V heads fewer than the ranks)."""
        c = tiny.config.get_text_config()
        heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        out = []
        if heads % world_size:
            out.append(f"{heads} query heads are not divisible by P={world_size}: DeepSpeed's UlyssesSPAttentionHF "
                       f"raises ValueError; run a --world-size that divides {heads}")
        if kv % world_size and world_size % kv:
            out.append(f"{kv} K/V heads and P={world_size} divide neither way: DeepSpeed's UlyssesSPAttentionHF "
                       f"raises ValueError")
        return out


def deepspeed_ulysses_glue() -> Glue:
    """The built-in glue `deepspeed_ulysses` (ImportError with the fix where deepspeed is missing)."""
    _deepspeed()
    a = DeepSpeedUlysses()
    return Glue(name="deepspeed_ulysses", install=a.install, layout="contiguous", configure=a.configure,
                shard=a.shard, uninstall=a.uninstall, refuses_ring=a.refuses_ring, shims=SHIMS,
                sharding=f"DeepSpeed {VERSION}'s UlyssesSPDataLoaderAdapter (contiguous slices, labels shifted "
                         f"on the whole sequence)",
                describe=f"DeepSpeed {VERSION}'s Ulysses (UlyssesSPAttentionHF over transformers' {CORE}), as shipped")
