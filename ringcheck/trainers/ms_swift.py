"""`--glue ms_swift[:CORE]` and `--glue ms_swift_ring`: ms-swift 4.6.0's sequence parallelism
(`--sequence_parallel_size P`), run as it ships: `SequenceParallel.prepare`
(`swift/sequence_parallel/sequence_parallel.py`) on the model, its forward hook's sharding, and its
loss (`per_token_loss_func_sp`, `GatherLoss`), as `Seq2SeqTrainer.compute_loss` calls them.

- **Which parallelism it runs is ms-swift's choice**: `_init_device_mesh` (L648) takes Ulysses over
  gcd(K/V heads, P) ranks and a zig-zag ring over the rest. `ms_swift` (= `ms_swift:sdpa`) and
  `ms_swift:flash_attention_2` are its Ulysses (the K/V heads a multiple of P) over transformers'
  sdpa and flash path; `ms_swift_ring` is the configuration where it picks its ring
  (`zigzag_ring_flash_attn_varlen_func`, K/V heads < P: padding-free, flash attention).
- **Its sharding** (`forward_loss`, through `run_loss`): `sequence_parallel.prepare_inputs` (the labels rolled on the
  whole row, padded and split) as `Seq2SeqTrainer._prepare_inputs` calls it; the model is given the
  whole rows and its forward pre-hook (`_prepare_forward_hook`, L278) pads and splits them, each
  rank a contiguous slice (Ulysses) or each document's two zig-zag chunks (ring).
- **Its loss**: `per_token_loss_func_sp` gathers every rank's per-token loss (`GatherLoss`), and
  `compute_loss` divides the sum by the number of targets. Every rank holds the whole loss and
  `GatherLoss.backward` multiplies by P for DDP's mean over the world: ringcheck's step sums over
  the group, so it takes ms-swift's loss / P (what DDP's mean does).
- **What it refuses, before any rank starts, one line**: sdpa where ms-swift picks its ring
  (NotImplementedError by design, L264), the ring where it picks none, heads its all-to-all cannot
  split, a model class transformers does not build with the core. Per case: packed documents over
  sdpa (its `padding_free` needs flash attention, `sft_args.py` L186-197, documented in
  `template_args.py` L63), and rows kept apart under the ring (padding-free packs them into one).
- **Its crashes on one rank, said on every rank before the forward** (findings): a length its pad
  fills with position id -1 on a model that looks a table up by position id (bert and its kin,
  any core: `lookup.negative_lookup` on the padded rows, the same on every rank), and over sdpa a
  single row P does not divide (its `sdpa_mask`).

Shims (`SHIMS`, the report prints them): its package imports modelscope, datasets, pandas, peft,
json_repair, requests at module level (accelerate and peft it uses: installed); where they are absent, stubs answer those imports (the glue
never calls them). Its mesh spans the world: it is given ringcheck's CP group. RANK / WORLD_SIZE as
torchrun sets them, `model.model_info` / `model_meta` and a tokenizer's `pad_token_id` (what
`prepare` reads), and for the flash core transformers' flash path under ringcheck's name
(`ringcheck.trainers.flash`). Nothing else of ms-swift's is changed. Its findings, with the patched
copies that bring them back: docs/findings/trainers.md.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..glues.contract import Glue
from ..step.contract import IGNORE
from ..thirdparty.transformers_private import (
    SUPPORTS,
    causal_lm_class,
    compatible_flash_implementations,
    keep_flash_attention_forward,
    supports_attention,
)
from .flash import FLASH_CORE, install_flash_core
from .flash import SHIM as FLASH_SHIM
from .lookup import negative_lookup
from .stubs import stubs

NAME, RING = "ms_swift", "ms_swift_ring"
VERSION = "4.6.0"           # the ms-swift this adapter was written and measured against
PAD_TOKEN = 0               # the pad_token_id its pad gives the input ids (the tokenizer's, which tiny models lack)
FIX = f"pip install --no-deps ms-swift=={VERSION} accelerate==1.16.0 peft==0.20.0"
# what its modules import at module level and the glue never calls: stubbed where not installed
STUBBED = ("modelscope", "datasets", "pandas", "json_repair", "requests", "urllib3")
# the core attentions its SequenceParallel wraps -> the name the model is built with, the dtype, its words
CORES = {"sdpa": ("sdpa", "float64", "transformers' sdpa"),
         "flash_attention_2": (FLASH_CORE, "bfloat16",
                               "transformers' flash_attention_2 path on ringcheck's flash-attn stand-in, bfloat16")}
SHIMS = (f"ms-swift's module-level imports of {', '.join(STUBBED)} answered by stubs where not installed (the glue "
         f"never calls them; accelerate and peft are real)",
         "its device mesh (init_device_mesh over the whole world, sequence_parallel.py L668) is given ringcheck's CP "
         "group: 'sequence' and 'ring' groups of it, no 'data' dim (ringcheck's replicas are its own)",
         "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE set as torchrun sets them while prepare reads them",
         "model.model_info (is_moe_model from the config) and model.model_meta (no multimodal arch) set on the model, "
         f"and a tokenizer of pad_token_id {PAD_TOKEN}, which prepare reads (ms-swift's model loader sets them)")


def swift():
    """ms-swift's modules the glue calls, or ImportError with the fix."""
    for package in ("swift", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"--glue {NAME} runs ms-swift's own sequence-parallel code, and {package} is not "
                              f"installed; {FIX} (the versions this adapter was measured on)")
    with stubs(STUBBED, FIX):
        sp = importlib.import_module("swift.sequence_parallel.sequence_parallel")
        loss = importlib.import_module("swift.sequence_parallel.utils")
        trainer = importlib.import_module("swift.trainers.utils")
        # their lazy modules import on first use: prepare's get_llm_model, and the SwiftModel it imports on call
        importlib.import_module("swift.model").get_llm_model
        importlib.import_module("swift.tuners").SwiftModel
    return SimpleNamespace(module=sp, sp=sp.sequence_parallel, cls=sp.SequenceParallel, gather_loss=loss.GatherLoss,
                           per_token_loss=trainer.per_token_loss_func_sp)


def crash_line(exc: BaseException) -> str:
    """One line for ms-swift's crash: the innermost frame in its package (file:line, function) and
    the error, or the error alone where none of its frames is on the stack."""
    import traceback  # start-up time: only when a run crashed

    root = os.path.dirname(os.path.dirname(swift().module.__file__))  # site-packages/swift
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(root + os.sep)]
    where = (f" at swift/{os.path.relpath(ours[-1].filename, root)}:{ours[-1].lineno} ({ours[-1].name})"
             if ours else "")
    return (f"ms-swift {VERSION} crashed on a configuration it accepts (a finding, docs/findings/trainers.md): "
            f"{type(exc).__name__}{where}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")


def split_sizes(kv_heads: int, world_size: int) -> tuple[int, int]:
    """ms-swift's (Ulysses size, ring size) at P (`_init_device_mesh`, L658-660)."""
    sp = math.gcd(kv_heads, world_size)
    return sp, world_size // sp


def kv_heads_of(config) -> int:
    """The head count `prepare` reads (L349-351): num_key_value_heads, else num_attention_heads."""
    c = config.get_text_config()
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


class CPMesh:
    """The device mesh `_init_device_mesh` builds, over ringcheck's CP group instead of the world
    (shim 2): its dims by name, each a group of the CP group's ranks ('sequence' inner, as in its
    (data, ring, sequence) mesh)."""

    def __init__(self, groups: dict):
        self.groups = groups
        self.mesh_dim_names = tuple(groups)

    def __getitem__(self, name: str):
        return SimpleNamespace(get_group=lambda: self.groups[name])


def cp_mesh(group, sp: int, rp: int) -> CPMesh:
    """`CPMesh` of the CP group: Ulysses over `sp` consecutive ranks of it, the ring over `rp`.
    Every rank of the world makes every CP group's sub-groups, in one order (new_group is collective)."""
    if rp == 1:
        return CPMesh({"sequence": group})
    mine = dist.get_process_group_ranks(group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    found = {}
    for ranks in sorted({tuple(r) for r in every}):
        for name, members in [*(("sequence", ranks[i * sp:(i + 1) * sp]) for i in range(rp)),
                              *(("ring", ranks[j::sp]) for j in range(sp))]:
            made = dist.new_group(list(members))
            if dist.get_rank() in members:
                found[name] = made
    return CPMesh({"ring": found["ring"], "sequence": found["sequence"]})


@contextmanager
def _launcher_env():
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE as torchrun sets them (shim 3), while
    `prepare` reads them (`get_dist_setting`); as they were afterwards."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    values = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MsSwift:
    """The adapter: ms-swift's `SequenceParallel` singleton prepared on each model the step builds,
    its inputs and loss per micro-batch, and transformers put back by `uninstall`."""

    def __init__(self, core: str = "sdpa", ring: bool = False):
        self.core, self.ring = core, ring
        self.attn = CORES[core][0]
        self.swift = self.group = self.mesh = self.moe = None
        self.prepared = weakref.WeakSet()   # the models prepare has seen
        self.saved = None                   # transformers' attention and masks as they were

    def install(self, group) -> str:
        self.swift = swift()
        self.group = group
        if self.attn == FLASH_CORE:
            self.undo_core = install_flash_core()
        self.saved = self.snapshot()
        return self.attn

    def configure(self, config, group) -> None:
        """The mesh ms-swift's `_init_device_mesh` would build at this P, over the CP group (shim 2)."""
        sp, rp = split_sizes(kv_heads_of(config), dist.get_world_size(group))
        self.mesh = cp_mesh(group, sp, rp)
        self.moe = any(getattr(config.get_text_config(), k, None) for k in ("num_experts", "num_local_experts"))

    def snapshot(self) -> dict:
        """transformers' attention functions, masks and mask builders that `prepare` replaces."""
        from transformers import masking_utils  # start-up time: a --model run only
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
        keys = ("flash_attention_2", "sdpa", FLASH_CORE)
        return {"attn": {k: ALL_ATTENTION_FUNCTIONS[k] for k in keys if k in ALL_ATTENTION_FUNCTIONS},
                "mask": {k: masks[k] for k in keys if k in masks},
                "module": {n: getattr(masking_utils, n) for n in ("flash_attention_mask", "create_causal_mask")},
                "undo_flash_forward": keep_flash_attention_forward()}

    def prepare(self, model) -> None:
        """ms-swift's `sequence_parallel.prepare(P, model, tokenizer, padding_free)`, as its
        `SwiftSft._prepare_model_tokenizer` calls it once the model is loaded, with shims 2-4."""
        if model in self.prepared:
            return
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # start-up time
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model.model_info = SimpleNamespace(is_moe_model=bool(self.moe))   # shim 4
        model.model_meta = SimpleNamespace(model_arch=None)
        module, world = self.swift.module, dist.get_world_size(self.group)
        shimmed = module.init_device_mesh
        module.init_device_mesh = lambda *args, **kwargs: self.mesh      # shim 2
        try:
            with _launcher_env():
                self.swift.sp.prepare(world, model, SimpleNamespace(pad_token_id=PAD_TOKEN),
                                      padding_free=self.core == "flash_attention_2")
        finally:
            module.init_device_mesh = shimmed
        if self.attn == FLASH_CORE:  # its flash_attention_2 wrapper and mask under the flash core's name
            ALL_ATTENTION_FUNCTIONS[FLASH_CORE] = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
            AttentionMaskInterface.register(FLASH_CORE, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
        self.prepared.add(model)

    def refuse_case(self, batch: dict, model=None) -> None:
        """ValueError for a micro-batch ms-swift does not take in this configuration, or on which it
        is known to crash on one rank (said on every rank alike: on one rank alone, the others
        would wait in its all-to-all)."""
        if self.core == "sdpa" and batch["cu_seqlens"] is not None:
            raise ValueError("packed documents are ms-swift's padding_free, which needs flash attention: "
                             "SftArguments._check_padding_free raises ValueError for attn_impl sdpa "
                             "(swift/arguments/sft_args.py L186-197, documented in template_args.py L63)")
        if self.ring and batch["input_ids"].shape[0] != 1:
            raise ValueError(f"ms-swift's ring needs padding_free (sequence_parallel.py L378), whose collator packs a "
                             f"micro-batch's {batch['input_ids'].shape[0]} rows into one; ringcheck's step holds rows "
                             f"apart, so this case is not judged")
        crash = (self.lookup_crash(model, batch) if model is not None else None) or \
            self.known_crash(*batch["input_ids"].shape, dist.get_world_size(self.group))
        if crash:
            raise ValueError(crash)

    def lookup_crash(self, model, batch: dict) -> str | None:
        """The line of ms-swift's crash where its pad gives the position ids -1 and the model looks a
        table up by position id (a finding, docs/findings/trainers.md): `negative_lookup` on the
        whole rows as its pad makes them, the same on every rank; None where it pads nothing or the
        model reaches its attention first."""
        sp, pos = self.swift.sp, batch["position_ids"]
        padded = sp.pad(pos, padding_value=-1, position_ids=pos, dim=-1)
        if padded.shape[-1] == pos.shape[-1]:
            return None
        ids = sp.pad(batch["input_ids"], padding_value=PAD_TOKEN, position_ids=pos)
        world, sp.world_size = sp.world_size, 1  # its own switch: its hook, masks and attention pass through
        try:
            where = negative_lookup(model, self.attn, ids, padded)
        finally:
            sp.world_size = world
        if where is None:
            return None
        return (f"ms-swift crashes here (a finding): {pos.shape[-1]} tokens pad to {padded.shape[-1]} with position "
                f"id -1 (sequence_parallel.py L598), which {type(model).__name__} reads as an index ({where}): out of "
                f"range on the rank holding the padding, while the others wait in the all-to-all (ulysses.py L68)")

    def known_crash(self, rows: int, n: int, world: int) -> str | None:
        """The line of a crash of ms-swift's on one rank only (a finding, docs/findings/trainers.md),
        said before the forward; None where none is known."""
        if self.core == "sdpa" and rows == 1 and n % world:
            return (f"ms-swift crashes here (a finding): {n} tokens pad to a multiple of P={world} with position id -1 "
                    f"(sequence_parallel.py L598), which transformers reads as a packed document on the last shard, "
                    f"whose mask ms-swift's sdpa_mask (L104-120) asks at the whole length: IndexError there, the other "
                    f"ranks wait in the all-to-all")
        return None

    def run_loss(self, model, batch: dict, total: torch.Tensor, group):
        """One micro-batch as ms-swift's trainer runs it: `prepare_inputs` (its label shift and split,
        `Seq2SeqTrainer._prepare_inputs`), the forward on the whole rows (its pre-hook splits them),
        `per_token_loss_func_sp` and `compute_loss`'s sum / the number of targets; the loss / P
        (DDP's mean, which its `GatherLoss.backward` x P expects). Returns this rank's logits, the
        loss, and the global position of each logit (padding: past the rows' length)."""
        self.prepare(model)
        self.refuse_case(batch, model)
        ids, pos = batch["input_ids"], batch["position_ids"]
        # each sample's first label -100, as its template's encode sets it (template/base.py L1650): its roll
        # of the labels (pad_and_split_inputs L628) wraps the first label round to the last token. Not a target
        # of any token in the truth (labels[i + 1] is token i's), so the targets are the same
        labels = batch["labels"].clone()
        labels[pos == 0] = IGNORE
        inputs = {"input_ids": ids, "position_ids": pos, "labels": labels}
        self.swift.sp.prepare_inputs(inputs)
        try:
            outputs = model(input_ids=ids, position_ids=pos, use_cache=False)
            per_token = self.swift.per_token_loss(outputs, inputs["labels"])
        except Exception as exc:  # its crash on a configuration it accepts: a finding, named where it happened
            raise RuntimeError(crash_line(exc)) from exc
        loss = per_token.sum() / total / dist.get_world_size(group)
        return outputs.logits, loss, self.held(ids.shape[1], ids.device)

    def forward_loss(self, model, batch: dict, group) -> dict:
        """The glue contract's `Glue.forward_loss`: `run_loss` with `batch["total"]`, its loss, logits
        and positions as a dict."""
        logits, loss, held = self.run_loss(model, batch, batch["total"], group)
        return {"loss": loss, "logits": logits, "positions": held}

    def held(self, n: int, device) -> torch.Tensor:
        """The global positions of this rank's tokens: ms-swift's own pad and split (as its
        `pad_and_split_inputs` treats the input ids) of the positions 0..n-1, its padding at n."""
        sp = self.swift.sp
        real = sp.real_position_ids
        where = torch.arange(n, device=device).expand(real.shape[0], n)
        padded = sp.pad(where, padding_value=n, position_ids=real)
        return sp.split(padded, dim=1, position_ids=sp.pad(real, padding_value=-1, position_ids=real))[0]

    def uninstall(self) -> None:
        """transformers as it was before `prepare`, and ms-swift's singleton as new (its next
        `prepare` initializes again)."""
        from transformers import masking_utils  # start-up time: a --model run only
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.saved is None:
            return
        for key, value in self.saved["attn"].items():
            ALL_ATTENTION_FUNCTIONS[key] = value
        for key in ("flash_attention_2_origin", "sdpa_origin"):
            if key in ALL_ATTENTION_FUNCTIONS:
                del ALL_ATTENTION_FUNCTIONS[key]
        for key, value in self.saved["mask"].items():
            masking_utils.AttentionMaskInterface.register(key, value)
        for name, value in self.saved["module"].items():
            setattr(masking_utils, name, value)
        if hasattr(masking_utils, "origin_create_causal_mask"):
            delattr(masking_utils, "origin_create_causal_mask")
        self.saved["undo_flash_forward"]()
        if self.attn == FLASH_CORE:
            self.undo_core()
        self.swift.cls._global_inited = False
        self.swift.sp.__init__()  # the module's singleton, as its import made it
        self.saved = None

    def refuses_ring(self, tiny, world_size: int) -> list[str]:
        """What ms-swift refuses at P (or runs as another glue), one line each: the parallelism it
        picks (`_init_device_mesh`, L658-660) not this glue's, heads its all-to-all does not split
        (`ulysses.py` L20-21), a model class transformers does not build with the core."""
        kv = kv_heads_of(tiny.config)
        sp, rp = split_sizes(kv, world_size)
        picks = (f"{kv} K/V heads at P={world_size}: ms-swift's _init_device_mesh takes Ulysses over gcd = {sp} "
                 f"ranks and {'a zig-zag ring of ' + str(rp) if rp > 1 else 'no ring'} (sequence_parallel.py L658-660)")
        out = []
        if rp > 1 and self.core == "sdpa":
            out.append(f"{picks}, and its sdpa path raises NotImplementedError('SDPA does not support Ring "
                       f"attention.') by design (sequence_parallel.py L264); run --glue {RING}")
        elif rp > 1 and not self.ring:
            out.append(f"{picks}: its ring, which --glue {RING} judges")
        elif rp == 1 and self.ring:
            out.append(f"{picks}: Ulysses alone, which --glue {NAME}:flash_attention_2 judges; its ring runs at a P "
                       f"that does not divide {kv}")
        odd = sorted({x.heads for x in tiny.layers if x.heads % sp} | {x.kv_heads for x in tiny.layers if x.kv_heads % sp})
        if odd:
            out.append(f"heads {odd} of some layers are not divisible by ms-swift's Ulysses size {sp}: its all-to-all "
                       f"asserts (ulysses.py L20-21)")
        return out + refuses_core(causal_lm_class(tiny.config), self.core)


def refuses_core(cls: type, core: str) -> list[str]:
    """The line where transformers does not build `cls` with `core`, or (flash) builds it with a hub
    kernel of its own that the stand-in does not stand in for (gpt_oss)."""
    own = compatible_flash_implementations(cls)
    if not supports_attention(cls, core):
        return [f"transformers builds no {cls.__name__} with attn_implementation={core!r} ({SUPPORTS[core]} = False), "
                f"and ms-swift's sequence parallelism wraps the model's own core attention"]
    if core != "sdpa" and own and "flash_attention_2" not in own:
        return [f"transformers builds {cls.__name__} with the hub kernel {own[0]!r} when flash_attention_2 is asked "
                f"for (its compatible flash kernels), which ringcheck does not run (its flash-attn stand-in is "
                f"flash-attn 2's API): not judged here"]
    return []


def glue_name(core: str, ring: bool = False) -> str:
    """The `--glue` spelling of ms-swift's sequence parallelism over `core`."""
    return RING if ring else NAME if core == "sdpa" else f"{NAME}:{core}"


def ms_swift_glue(core: str = "sdpa", ring: bool = False, adapter: MsSwift | None = None) -> Glue:
    """The built-in glue `ms_swift` over `core` (a key of `CORES`), or its ring (`ms_swift_ring`,
    flash attention); ImportError with the fix where ms-swift is missing. `adapter`: a subclass's
    instance (a planted bug or a patched copy of ms-swift's code) in place of `MsSwift(core, ring)`."""
    swift()
    a = adapter or MsSwift(core, ring)
    words, dtype = CORES[core][2], CORES[core][1]
    kind = ("its zig-zag ring (zigzag_ring_flash_attn_varlen_func, K/V heads < P)" if ring
            else "its Ulysses (DistributedAttention)")
    return Glue(name=glue_name(core, ring), install=a.install, layout="contiguous", configure=a.configure,
                uninstall=a.uninstall, refuses_ring=a.refuses_ring, forward_loss=a.forward_loss, dtype=dtype,
                shims=SHIMS + ((FLASH_SHIM + "; ms-swift's flash_attention_2 wrapper and mask registered under it",)
                               if core != "sdpa" else ()),
                sharding=f"ms-swift {VERSION}'s forward pre-hook (pad_and_split_inputs: "
                         f"{'each document padded to 2P, its zig-zag chunks' if ring else 'contiguous slices'}), "
                         f"prepare_inputs (labels rolled on the whole row, split) and its loss "
                         f"(per_token_loss_func_sp, GatherLoss)",
                describe=f"ms-swift {VERSION}'s sequence parallelism, {kind} over {words}, as shipped")
