"""`--glue deepspeed_ulysses[:CORE]`: DeepSpeed's Ulysses sequence parallelism for Hugging Face
models (ALST, `deepspeed/runtime/sequence_parallel/ulysses_sp.py`), what accelerate and TRL call
with `sp_backend="deepspeed"`, run as it ships, over either core attention its docs name:
`deepspeed_ulysses` wraps transformers' sdpa, `deepspeed_ulysses:flash_attention_2` transformers'
flash path (on a CPU through ringcheck's flash-attn stand-in, `ringcheck.trainers.flash`, judged
in bfloat16 with the measured noise budget, as `--glue ring_flash_attn` is).

- **Its patch of transformers**: `UlyssesSPAttentionHF.register_with_transformers(model,
  core_attn_implementation=CORE, sequence_parallel_size=P, micro_batch_size=rows)` overrides
  `ALL_ATTENTION_FUNCTIONS[CORE]` with its wrapper (an all-to-all from sequence shards to head
  groups, the core over the whole sequence with the gathered `position_ids` and no mask, the
  all-to-all back). `configure` calls it with the model's config; `uninstall` puts the core back.
- **Its sharding of the batch**: `UlyssesSPDataLoaderAdapter` over a loader of the one global
  batch: it gathers every rank's sample, shifts the labels on the whole sequence and hands each
  rank its contiguous slice (`shard`); the first micro-batch it yields is the batch of rank 0,
  the one every rank of the group was given.
- **What it refuses, before any rank starts, one line each**: heads that do not divide as
  `UlyssesSPAttentionHF.__init__` requires, and a model class that transformers does not let run
  the core (`_supports_sdpa` / `_supports_flash_attn` False: gpt_oss has no sdpa, its sinks).

Shims (the report prints them): DeepSpeed's `mpu.initialize_sequence_parallel` builds its SP
groups from the whole world's consecutive ranks; here it is handed the CP group of ringcheck's
mesh instead, so that the group DeepSpeed attends over is the one ringcheck judges; for the flash
core, transformers' flash path under a name of its own (`ringcheck.trainers.flash`). Nothing else
of DeepSpeed's is changed. It needs `deepspeed` importable (`pip install deepspeed==0.19.8`; on a
CPU it builds its shared-memory comm op with ninja the first time). What it loses, with the
patched copies that bring it back: docs/findings/trainers.md.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ..glues.contract import Glue
from ..thirdparty.deepspeed_private import hand_sequence_parallel_group, release_sequence_parallel_groups
from ..thirdparty.torch_private import extension_build_directory
from ..thirdparty.transformers_private import (
    SUPPORTS,
    causal_lm_class,
    compatible_flash_implementations,
    set_attn_implementation,
    supports_attention,
)
from .flash import FLASH_CORE, install_flash_core
from .flash import SHIM as FLASH_SHIM

NAME = "deepspeed_ulysses"
VERSION = "0.19.8"  # the DeepSpeed this adapter was written and measured against
# the core attentions DeepSpeed wraps (its docs: flash_attention_2, or sdpa; eager it refuses) -> the name the
# model is built with, the dtype it is judged in, and its words
CORES = {"sdpa": ("sdpa", "float64", "transformers' sdpa"),
         "flash_attention_2": (FLASH_CORE, "bfloat16",
                               "transformers' flash_attention_2 path on ringcheck's flash-attn stand-in, bfloat16")}
GROUP_SHIM = ("DeepSpeed's mpu.initialize_sequence_parallel is given ringcheck's CP group (it builds its own from the "
              "whole world's consecutive ranks)")


def _deepspeed():
    """DeepSpeed's modules, or ImportError with the fix."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"--glue {NAME} runs DeepSpeed's own Ulysses code, and deepspeed is not installed; "
                          f"pip install deepspeed=={VERSION} (the version this adapter was measured on)")
    import deepspeed.comm as dscomm  # optional: a trainer's package, only for --glue deepspeed_ulysses
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu  # optional, as above
    from deepspeed.runtime.sequence_parallel import ulysses_sp  # optional, as above
    return dscomm, mpu, ulysses_sp


SHM_OP = "deepspeed_shm_comm"   # the comm op DeepSpeed builds with torch's cpp_extension on a CPU
STALE_LOCK_S = 600              # a build takes under a minute; a lock this old was left by a killed build


def stale_build_lock(build_dir: Path, now: float, older_than_s: float = STALE_LOCK_S) -> str | None:
    """The line that says why DeepSpeed would wait forever, or None: torch's build of DeepSpeed's
    comm op takes a `lock` file in its build directory and every later build waits until it is
    gone, so a build killed midway leaves every DeepSpeed run of the machine hanging, silently."""
    lock = build_dir / "lock"
    try:
        age = now - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < older_than_s:
        return None   # another process may be building it now
    return (f"DeepSpeed's comm op build lock {lock} is {age / 60:.0f} min old: a build killed midway left it, and "
            f"DeepSpeed would wait on it forever; remove it (rm {lock}) and run again")


class DeepSpeedUlysses:
    """The adapter: the state DeepSpeed's entry points need between ringcheck's calls. `core`: the
    key of `CORES` DeepSpeed wraps ("sdpa" or "flash_attention_2")."""

    def __init__(self, core: str = "sdpa"):
        self.core = core
        self.attn = CORES[core][0]   # the attn_implementation name the model is built with
        self.group = self.config = None
        self.rows = 0
        self.original = None   # the core as transformers had it, put back by uninstall
        self.undo_core = None  # the flash core's shim, undone by uninstall

    def install(self, group) -> str:
        dscomm, _, _ = _deepspeed()
        if not dscomm.is_initialized():
            stale = stale_build_lock(Path(extension_build_directory(SHM_OP)), time.time())
            if stale:
                raise RuntimeError(stale)  # DeepSpeed's comm over the torch.distributed world already made
            dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        if self.attn == FLASH_CORE and self.undo_core is None:
            self.undo_core = install_flash_core()
        self.group = group
        return self.attn

    def configure(self, config, group, rows: int = 1) -> None:
        """DeepSpeed's `register_with_transformers` for this model, the CP group (the shim above) and
        `rows` per micro-batch (its `micro_batch_size`: `shard` registers again when a batch has other)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time: a --model run only

        self.config, self.rows = config, rows

        _, mpu, ulysses_sp = _deepspeed()
        self.put_core_back()
        self.original = ALL_ATTENTION_FUNCTIONS[self.attn]
        release_sequence_parallel_groups()
        shimmed = mpu.initialize_sequence_parallel

        def initialize(sequence_parallel_size: int) -> None:  # the shim: DeepSpeed's group is ringcheck's CP group
            hand_sequence_parallel_group(group)

        mpu.initialize_sequence_parallel = initialize
        try:
            copy = type(config).from_dict(config.to_dict())
            set_attn_implementation(copy, self.attn)  # the model is built with the core implementation DeepSpeed wraps
            ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
                SimpleNamespace(config=copy), self.attn, torch.distributed.get_world_size(group), micro_batch_size=rows,
                seq_length_is_variable=True)
        finally:
            mpu.initialize_sequence_parallel = shimmed

    def put_core_back(self) -> None:
        """transformers' core attention as it was before DeepSpeed's wrapper replaced it."""
        if self.original is not None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time

            ALL_ATTENTION_FUNCTIONS[self.attn] = self.original
            self.original = None

    def uninstall(self) -> None:
        self.put_core_back()
        if self.undo_core is not None:
            self.undo_core()
            self.undo_core = None

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
        # its slices are on the CPU by design (ulysses_sp.py L724, .cpu(): "keep the prefill buffer on cpu"), and the
        # trainer moves the batch to the rank's device (HF Trainer's _prepare_inputs): so does the step
        device = batch["input_ids"].device
        ids = mine["input_ids"].to(device)
        n = ids.shape[1]
        return {"input_ids": ids, "position_ids": mine["position_ids"].to(device),
                "labels": mine["shift_labels"].to(device), "positions": torch.arange(rank * n, (rank + 1) * n, device=device)}

    def refuses_ring(self, tiny, world_size: int) -> list[str]:
        """What DeepSpeed (`UlyssesSPAttentionHF.__init__`, `register_with_transformers`) and
        transformers refuse before a step, one line each: a config without the K/V head count
        DeepSpeed reads, layers whose heads differ from the config's (DeepSpeed sizes its all-to-all
        from the config), the query heads not divisible by P, the K/V heads dividing P neither way
        (it replicates K/V heads fewer than the ranks), a model class that does not run the core."""
        c = tiny.config.get_text_config()
        if not hasattr(c, "num_key_value_heads"):
            return [f"DeepSpeed's register_with_transformers reads config.num_key_value_heads (ulysses_sp.py L512), "
                    f"which {type(c).__name__} does not have: it raises AttributeError"]
        heads, kv = c.num_attention_heads, c.num_key_value_heads
        try:
            size = getattr(c, "head_dim", None) or c.hidden_size // heads  # what DeepSpeed takes (L506-512)
        except Exception as exc:  # a per-layer attribute that transformers refuses to read globally (gemma4)
            return [f"DeepSpeed's register_with_transformers reads config.head_dim (ulysses_sp.py L508-511), and "
                    f"{type(c).__name__} raises {type(exc).__name__} there (a per-layer head_dim)"]
        odd = [layer.index for layer in tiny.layers if (layer.heads, layer.kv_heads, layer.head_dim) != (heads, kv, size)]
        out = [] if not odd else [
            f"layers {', '.join(map(str, odd))} attend with other head counts or head sizes than the config's "
            f"({heads} query heads, {kv} K/V heads of {size}), which DeepSpeed sizes its all-to-all from: its shape "
            f"assertion fails (ulysses_sp.py L299-305)"]
        if heads % world_size:
            out.append(f"{heads} query heads are not divisible by P={world_size}: DeepSpeed's UlyssesSPAttentionHF "
                       f"raises ValueError; run a --world-size that divides {heads}")
        if kv % world_size and world_size % kv:
            out.append(f"{kv} K/V heads and P={world_size} divide neither way: DeepSpeed's UlyssesSPAttentionHF "
                       f"raises ValueError")
        return out + self.refuses_core(causal_lm_class(tiny.config))

    def refuses_core(self, cls: type) -> list[str]:
        """The one line where transformers does not run `cls` with this core: the class refuses it, or
        (flash) the class names its own flash kernels, and transformers builds it with the first of
        those instead of flash_attention_2 (a hub kernel the stand-in does not stand in for)."""
        own = compatible_flash_implementations(cls)
        kernel = (f"transformers builds {cls.__name__} with the hub kernel {own[0]!r} when flash_attention_2 is asked "
                  f"for (its compatible flash kernels), which ringcheck does not run (its flash-attn stand-in is "
                  f"flash-attn 2's API)" if own and "flash_attention_2" not in own else None)
        if not supports_attention(cls, self.core):
            if self.core == "sdpa":
                fix = (f"{kernel}: not judged here" if kernel else
                       f"run --glue {glue_name('flash_attention_2')}"
                       if supports_attention(cls, "flash_attention_2") else "no core DeepSpeed wraps runs it")
            else:
                fix = f"run --glue {NAME}" if supports_attention(cls, "sdpa") else "no core DeepSpeed wraps runs it"
            return [f"transformers builds no {cls.__name__} with attn_implementation={self.core!r} ({SUPPORTS[self.core]}"
                    f" = False), and DeepSpeed's Ulysses wraps the model's own core attention; {fix}"]
        if self.core != "sdpa" and kernel:
            return [f"{kernel}: not judged here" + (f"; run --glue {NAME}" if supports_attention(cls, "sdpa") else "")]
        return []


def glue_name(core: str) -> str:
    """The `--glue` spelling of DeepSpeed's Ulysses over `core`."""
    return NAME if core == "sdpa" else f"{NAME}:{core}"


def deepspeed_ulysses_glue(core: str = "sdpa") -> Glue:
    """The built-in glue `deepspeed_ulysses` over `core` (a key of `CORES`; ImportError with the fix
    where deepspeed is missing)."""
    _deepspeed()
    a = DeepSpeedUlysses(core)
    words, dtype = CORES[core][2], CORES[core][1]
    return Glue(name=glue_name(core), install=a.install, layout="contiguous", configure=a.configure,
                shard=a.shard, uninstall=a.uninstall, refuses_ring=a.refuses_ring, dtype=dtype,
                shims=(GROUP_SHIM,) + ((FLASH_SHIM,) if core != "sdpa" else ()),
                sharding=f"DeepSpeed {VERSION}'s UlyssesSPDataLoaderAdapter (contiguous slices, labels shifted "
                         f"on the whole sequence)",
                describe=f"DeepSpeed {VERSION}'s Ulysses (UlyssesSPAttentionHF over {words}), as shipped")
