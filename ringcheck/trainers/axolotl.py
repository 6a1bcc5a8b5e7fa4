"""`--glue axolotl[:CORE]`: axolotl's context parallelism as axolotl 0.21 delegates it, to
axolotl-ringmaster 0.2.7 (`ringmaster`), run as it ships, over either core attention: `axolotl`
wraps transformers' sdpa, `axolotl:flash_attention_2` transformers' flash path (on a CPU through
ringcheck's flash-attn stand-in, `ringcheck.trainers.flash`, judged in bfloat16).

- **Its setup**: `ringmaster.setup(RingmasterConfig(size=P), num_kv_heads=K, device_mesh=...,
  device_type=..., inner_attn=CORE)` (`ringmaster/__init__.py` L75-115), as axolotl's
  `ContextParallelPlugin` calls it: the K/V heads of the model's text config, a mesh whose `cp` dim
  is ringcheck's CP group (split into `cp_ring` x `cp_ulysses` for USP, as axolotl's
  `RingmasterMesh` splits it). ringmaster picks its strategy from the heads
  (`strategies/usp.py` `auto_select` L28-71): the largest Ulysses degree that divides both P and K,
  the ring over the rest: Ulysses, ring, or both (USP). The report says which it chose.
- **Its sharding** (`shard`): what `ContextParallelContextManager`'s forward pre-hook does
  (`sp_context.py` L122-140): `broadcast_batch`, `prepare_global_batch`, `shard_batch` (contiguous
  slices, labels shifted on the whole sequence, padded to P) and the packed documents' boundaries
  (`varlen_meta`) handed to the runtime.
- **Not judged by the step**: axolotl's loss (ringmaster's `global_num_items_in_batch`); ringcheck's
  step divides by the global count itself.

Shims (`SHIMS`, the report prints them), each one line in docs/findings/trainers.md: the model is
built with an attention name ringcheck gives before it knows the heads, bound in `configure` to
the function `setup` registered; ringmaster's `intra_node_size()` is answered with P (on a CPU it
answers 1, and the auto-selector would never pick Ulysses); over sdpa, the dense ring's
`torch_native` block (the aten flash SDPA op, CUDA only) is ringmaster's own CPU block `math_block`
(`ring/kernels.py` L54, float32: the glue is judged in float32); over the flash core, `ring_impl`
is `hf_kernels`, what `auto` resolves `flash_attention_2` to, and transformers' flash path runs
under a name of its own (`ringcheck.trainers.flash`).

`axolotl@0.19`: axolotl 0.19.0's own ring glue (ring-flash-attn), not run, in one line (`AXOLOTL_019`).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from ..glues.contract import Glue, group_device
from .flash import FLASH_CORE, install_flash_core
from .flash import SHIM as FLASH_SHIM

NAME = "axolotl"
VERSION = "0.2.7"   # the axolotl-ringmaster this adapter was written and measured against (axolotl 0.21's CP)
ATTN = "ringmaster_cp"  # the attn_implementation the model is built with: bound in configure (ALIAS_SHIM)
# the core attentions ringmaster wraps -> its inner_attn name, the dtype it is judged in, and its words
CORES = {"sdpa": ("sdpa", "float32", "transformers' sdpa"),
         "flash_attention_2": (FLASH_CORE, "bfloat16",
                               "transformers' flash_attention_2 path on ringcheck's flash-attn stand-in, bfloat16")}
ALIAS_SHIM = (f"the model is built with attn_implementation {ATTN!r}, bound in configure to the function "
              f"ringmaster.setup registered (runtime.attn_implementation): ringcheck names the implementation "
              f"before the model's heads pick ringmaster's strategy")
NODE_SHIM = ("ringmaster's intra_node_size() is answered with P (ringcheck's P ranks share one machine; on a CPU "
             "without LOCAL_WORLD_SIZE it answers 1, and auto_select would never pick Ulysses)")
MATH_SHIM = ("the dense ring's torch_native block (aten._scaled_dot_product_flash_attention, ring/kernels.py L45-51, "
             "a CUDA op) is ringmaster's CPU block math_block (L54-80, float32: the glue is judged in float32)")
KERNELS_SHIM = ("ring_impl hf_kernels, what auto resolves flash_attention_2 to (strategies/ring.py L23-28; the "
                "stand-in's name does not start with 'flash_attention')")


def _ringmaster():
    """The `ringmaster` package, or ImportError with the fix."""
    if importlib.util.find_spec("ringmaster") is None:
        raise ImportError(f"--glue {NAME} runs axolotl-ringmaster's own context-parallel code, and it is not "
                          f"installed; pip install --no-deps axolotl-ringmaster=={VERSION} (the version this adapter "
                          f"was measured on; it needs torch and transformers alone)")
    import ringmaster  # optional: a trainer's package, only for --glue axolotl
    return ringmaster


def kv_heads(config) -> int:
    """The K/V heads axolotl hands ringmaster (`ContextParallelPlugin._num_kv_heads`, TP 1): the
    text config's `num_key_value_heads`, else its `num_attention_heads`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"{type(text).__name__} has neither num_key_value_heads nor num_attention_heads, which "
                         f"axolotl hands ringmaster.setup as num_kv_heads")
    return int(heads)


def strategy(kv: int, world_size: int) -> tuple[int, int, str]:
    """ringmaster's own choice (`auto_select`, intra-node size P: NODE_SHIM): (Ulysses degree,
    ring degree, words)."""
    from ringmaster.config import AUTO, Backend  # optional, as above
    from ringmaster.strategies import auto_select

    u, r, _ = auto_select(total=world_size, requested_backend=Backend.AUTO, requested_ulysses=AUTO,
                          requested_ring=AUTO, num_kv_heads=kv, intra_node_size=world_size)
    words = (f"Ulysses over all {u} ranks" if r == 1 else f"ring over all {r} ranks" if u == 1
             else f"USP: Ulysses over {u} x ring over {r}")
    return u, r, f"{words} (auto_select for {kv} K/V heads at P={world_size})"


class Ringmaster:
    """The adapter: ringmaster's runtime on the CP group, then its sharding per micro-batch."""

    def __init__(self, core: str = "sdpa"):
        self.core = core
        self.inner = CORES[core][0]
        self.runtime = None
        self.undo: list = []   # what uninstall puts back, last first

    def install(self, group) -> str:
        ringmaster = _ringmaster()
        from transformers import AttentionInterface  # transformers: the optional extra `hf`

        if self.inner == FLASH_CORE and not self.undo:
            self.undo.append(install_flash_core())
        if self.core == "sdpa" and dist.get_backend(group) == "gloo":  # MATH_SHIM: a CPU has no aten flash op
            from ringmaster.ring import kernels  # optional: a trainer's package, as above

            native = kernels.PROVIDERS["torch_native"]
            kernels.PROVIDERS["torch_native"] = kernels.math_block
            self.undo.append(lambda: kernels.PROVIDERS.__setitem__("torch_native", native))

        def unbound(*args, **kwargs):
            raise RuntimeError(f"--glue {NAME}: {ATTN!r} was called before configure(config, group) ran "
                               f"ringmaster.setup; call configure once the model's config is known")

        AttentionInterface.register(ATTN, unbound)
        self.undo.append(ringmaster.teardown)
        return ATTN

    def configure(self, config, group) -> None:
        """`ringmaster.setup` for this model on the CP group, and ATTN bound to what it registered."""
        ringmaster = _ringmaster()
        from ringmaster.config import RingImpl  # optional, as above
        from torch.distributed.device_mesh import DeviceMesh
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        world, kv = dist.get_world_size(group), kv_heads(config)
        u, r, _ = strategy(kv, world)
        device = group_device(group)
        if u > 1 and r > 1:  # as axolotl's RingmasterMesh splits the cp dim for USP (ring outer, Ulysses inner)
            ranks = torch.tensor(dist.get_process_group_ranks(group), dtype=torch.int64, device="cpu")
            mesh = DeviceMesh(device, ranks.view(r, u), mesh_dim_names=("cp_ring", "cp_ulysses"))
        else:
            mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("cp",))
        cfg = ringmaster.RingmasterConfig(size=world, ring_impl=RingImpl.HF_KERNELS if self.core != "sdpa"
                                          else RingImpl.AUTO)
        own = ringmaster.intra_node_size
        ringmaster.intra_node_size = lambda: world  # NODE_SHIM
        try:
            self.runtime = ringmaster.setup(cfg, num_kv_heads=kv, device_mesh=mesh, cp_dim="cp",
                                            device_type=device, inner_attn=self.inner)
        finally:
            ringmaster.intra_node_size = own
        AttentionInterface.register(ATTN, ALL_ATTENTION_FUNCTIONS[self.runtime.attn_implementation])

    def uninstall(self) -> None:
        while self.undo:
            self.undo.pop()()
        self.runtime = None

    def shard(self, batch: dict, group) -> dict:
        """What `ContextParallelContextManager`'s pre-hook does to the forward's kwargs (sp_context.py
        L122-140): this rank's contiguous slice, and the global document boundaries on the runtime."""
        from ringmaster import broadcast_batch  # optional, as above
        from ringmaster.shard import prepare_global_batch, shard_batch, varlen_meta

        kwargs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        broadcast_batch(kwargs, group)
        kwargs = prepare_global_batch(kwargs)
        global_pos = kwargs.get("position_ids")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        kwargs, info = shard_batch(kwargs, cp_rank=rank, cp_size=world, load_balance=self.runtime.shard_load_balance)
        self.runtime.varlen = varlen_meta(global_pos, info.original_seq_len + info.pad_len)
        ids = kwargs["input_ids"]
        n = ids.shape[1]
        return {"input_ids": ids, "position_ids": kwargs["position_ids"], "labels": kwargs["shift_labels"],  # -100: IGNORE
                "positions": torch.arange(rank * n, (rank + 1) * n, device=ids.device)}

    def refuses_ring(self, tiny, world_size: int) -> list[str]:
        """What ringmaster raises at P before a step, one line: layers whose query or K/V heads the
        Ulysses degree it picks from the config's K/V heads does not divide (its ValueError,
        strategies/ulysses.py L144-149; the all-to-all of USP splits the same heads)."""
        u, _, words = strategy(kv_heads(tiny.config), world_size)
        odd = [layer for layer in tiny.layers if layer.heads % u or layer.kv_heads % u]
        if u == 1 or not odd:
            return []
        shown = ", ".join(f"{layer.index} ({layer.heads} query / {layer.kv_heads} K/V heads)" for layer in odd)
        return [f"ringmaster picks {words} from the config; its Ulysses degree {u} does not divide the heads of "
                f"layers {shown}: ringmaster's Ulysses raises ValueError (strategies/ulysses.py L144-149); no "
                f"auto choice at P={world_size} runs it"]

    def describe_for(self, tiny, world_size: int) -> str:
        return (f"axolotl-ringmaster {VERSION}'s setup over {CORES[self.core][2]}, as axolotl 0.21 calls it; "
                f"it chose {strategy(kv_heads(tiny.config), world_size)[2]}")


def glue_name(core: str) -> str:
    """The `--glue` spelling of ringmaster over `core`."""
    return NAME if core == "sdpa" else f"{NAME}:{core}"


def axolotl_glue(core: str = "sdpa") -> Glue:
    """The built-in glue `axolotl` over `core` (a key of `CORES`; ImportError with the fix where
    axolotl-ringmaster is missing)."""
    _ringmaster()
    a = Ringmaster(core)
    shims = (ALIAS_SHIM, NODE_SHIM) + ((MATH_SHIM,) if core == "sdpa" else (KERNELS_SHIM, FLASH_SHIM))
    return Glue(name=glue_name(core), install=a.install, layout="contiguous", configure=a.configure,
                shard=a.shard, uninstall=a.uninstall, refuses_ring=a.refuses_ring, dtype=CORES[core][1],
                shims=shims, describe_for=a.describe_for,
                sharding=f"axolotl-ringmaster {VERSION}'s shard_batch as its ContextParallelContextManager calls "
                         f"it (contiguous slices, labels shifted on the whole sequence, varlen_meta)",
                describe=f"axolotl-ringmaster {VERSION}'s setup over {CORES[core][2]}, as axolotl 0.21 calls it")


AXOLOTL_019 = ("axolotl 0.19.0's ring glue is not run: register_ring_attn_from_device_mesh hands ring-flash-attn's "
               "substitute_hf_flash_attn (monkeypatch/ring_attn/patch.py L200), which raises ValueError with "
               "transformers 5.23 (no variant for its flash signature; axolotl 0.19.0 pins transformers 5.16.1), and "
               "update_ring_attn_params moves cu_seqlens to torch.cuda.current_device() (L230), which a CPU has "
               "not; run it on a GPU under that pin, or check axolotl 0.21's CP with --glue axolotl")


def axolotl_019_glue() -> Glue:
    """`--glue axolotl@0.19`: refused for every model and P, in one line (`AXOLOTL_019`)."""

    def install(group) -> str:
        raise RuntimeError(AXOLOTL_019)

    return Glue(name="axolotl@0.19", install=install, refuses_ring=lambda tiny, world_size: [AXOLOTL_019],
                describe="axolotl 0.19.0's ring-flash-attn glue (not run)")
