"""`--glue llamafactory`: LLaMA-Factory 0.9.5's sequence parallelism (its v1 trainer with
`dist_config: {cp_size: P, cp_mode: ulysses}`), run as that trainer calls it
(`llamafactory/v1/core/base_trainer.py` L141-154 and L258-263), over transformers' flash path (on a
CPU: ringcheck's flash-attn stand-in, `ringcheck.trainers.flash`, in bfloat16 with the measured
noise budget, as a GPU runs flash-attn 2).

- **Its patch of transformers**: `SequenceParallelModelPlugin("ulysses")(model, dist_config)`, i.e.
  `apply_sequence_parallel` (`v1/plugins/model_plugins/parallelization/sequence_parallel.py`
  L84-126): every loaded transformers module's `_flash_attention_forward` rebound to its
  `new_flash_attn_forward` (L49), which runs `UlyssesAttention` (`ulysses.py` L55-166: an all-to-all
  from sequence shards to head groups, transformers' own `_flash_attention_forward` over the whole
  sequence with the gathered `position_ids`, the all-to-all back). Applied, as the trainer does,
  once the model is built (each case's model), and undone between models (`uninstall`).
- **Its sharding and its loss** (`forward_loss`, the glue's own loss hook): each micro-batch as its v1
  padding-free batches hold it (`input_ids`, `attention_mask` of ones, `labels` with the first of
  each row and of each packed document IGNORE, `loss_weights` 1.0 where a label counts,
  `position_ids`) through `SequenceParallelLossPlugin("sequence_parallel_loss")(model, batch)`
  (L152-200): its `padding_and_split_data` (L129: pad to a multiple of P, contiguous chunks), the
  model on the chunk, the labels gathered and shifted on the whole sequence, the log-probs gathered
  with `dist.nn.all_gather`, a weighted mean per micro-batch; then the trainer's scale (L258-263:
  `loss * mini_step_valid_tokens * dp_size / step_valid_tokens`) and FSDP2's mean of the gradients
  over the dp x cp ranks, which ringcheck's step sums (so the rank's share is that loss / (dp x cp)).
- **What it refuses, before any rank starts, one line each** (`refuses_ring`): qwen3_5
  (base_trainer.py L143-147), a model transformers does not build with `flash_attention_2`
  (base_trainer.py L149-152 requires it), and query heads that P does not divide
  (sequence_parallel.py L100).

Shims (`SHIMS`, the report prints them): the flash stand-in behind transformers' flash path;
LLaMA-Factory's `DistributedInterface` (its singleton, which builds its own world meshes) handed
ringcheck's CP group as its "cp" mesh; `sequence_parallel_loss`'s `.to(dist.get_rank())` (L157, a
CUDA index) moved to the rank's device. Nothing else of LLaMA-Factory's is changed. It needs
llamafactory importable (`pip install --no-deps llamafactory==0.9.5`: the plugin imports torch,
transformers and numpy alone). What it loses, with patched copies: docs/findings/trainers.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..glues.contract import Glue, group_device
from ..step.contract import IGNORE
from ..thirdparty.transformers_private import causal_lm_class, compatible_flash_implementations, supports_attention
from .flash import FLASH_CORE, install_flash_core
from .flash import SHIM as FLASH_SHIM

NAME = "llamafactory"
VERSION = "0.9.5"  # the LLaMA-Factory this adapter was written and measured against
V1 = "llamafactory.v1"
PLUGIN = f"{V1}.plugins.model_plugins.parallelization.sequence_parallel"
SP_DIR = "llamafactory/v1/plugins/model_plugins/parallelization/"
SP_FILE = SP_DIR + "sequence_parallel.py"
TRAINER_FILE = "llamafactory/v1/core/base_trainer.py"
SHIMS = (FLASH_SHIM + "; transformers' preload of the flash kernels when a model is built with flash_attention_2 "
         "(modeling_utils) done for that name, which LLaMA-Factory's UlyssesAttention reaches with no "
         "attn_implementation",
         "LLaMA-Factory's DistributedInterface singleton (it builds its own meshes over the whole world) is handed "
         "ringcheck's CP group as its 'cp' DeviceMesh",
         f"sequence_parallel_loss's .to(dist.get_rank()) ({SP_FILE} L157, a CUDA device index) moves the batch to "
         f"the rank's device")


def plugin():
    """LLaMA-Factory's `sequence_parallel` module, or ImportError with the fix."""
    if importlib.util.find_spec("llamafactory") is None:
        raise ImportError(f"--glue {NAME} runs LLaMA-Factory's own sequence-parallel code, and llamafactory is not "
                          f"installed; pip install --no-deps llamafactory=={VERSION} (the version this adapter was "
                          f"measured on; its v1 plugin imports torch and transformers alone)")
    return importlib.import_module(PLUGIN)


class RankDist:
    """`torch.distributed` as `sequence_parallel_loss` reads it, but `get_rank()` answers the rank's
    device (shim 3: on a GPU, `.to(dist.get_rank())` moves to `cuda:<global rank>`)."""

    def __init__(self, device: torch.device):
        self.device = device

    def get_rank(self, group=None):
        return self.device

    def __getattr__(self, name):
        return getattr(dist, name)


class LlamaFactoryUlysses:
    """The adapter: LLaMA-Factory's singleton handed the CP group, its plugin applied to each model,
    its loss per micro-batch."""

    def __init__(self):
        self.group = None
        self.model = None      # the model apply_sequence_parallel was last applied to
        self.rebound = {}      # module -> the _flash_attention_forward it held before (put back by uninstall)
        self.undo_core = None
        self.interface = None  # LLaMA-Factory's DistributedInterface state before the shim

    def install(self, group) -> str:
        sp = plugin()
        import torch.distributed.nn  # noqa: F401  (L194's dist.nn.all_gather; its trainer's FSDP2 imports it)
        from torch.distributed.device_mesh import DeviceMesh
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        if self.undo_core is None:
            self.undo_core = install_flash_core()
        lazy_import_flash_attention(FLASH_CORE)  # shim 1: transformers' preload, as for flash_attention_2
        self.group = group
        cls = sp.DistributedInterface
        self.interface = (cls._instance, cls._initialized)
        device = group_device(group)
        mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("cp",))
        shim = object.__new__(cls)  # shim 2: its singleton, its "cp" mesh ringcheck's CP group
        shim.__dict__.update(_initialized=True, _is_distributed=True, data_device_mesh={"cp": mesh},
                             model_device_mesh=None, strategy=SimpleNamespace(data_mesh_dim_names=("dp", "cp")))
        cls._instance = shim
        return FLASH_CORE

    def apply(self, model) -> None:
        """`SequenceParallelModelPlugin("ulysses")(model, dist_config)`, as the trainer calls it once
        the model is built (base_trainer.py L154), on a transformers whose modules are as shipped."""
        sp = plugin()
        self.put_back()
        self.rebound = {m: m._flash_attention_forward for m in list(sys.modules.values())
                        if "transformers" in (getattr(m, "__file__", None) or "")
                        and getattr(getattr(m, "_flash_attention_forward", None), "__name__", "")
                        == "_flash_attention_forward"}
        sp.SequenceParallelModelPlugin("ulysses")(model, {"cp_size": dist.get_world_size(self.group),
                                                          "cp_mode": "ulysses"})
        self.model = model

    def put_back(self) -> None:
        for module, original in self.rebound.items():
            module._flash_attention_forward = original
        self.rebound, self.model = {}, None

    def uninstall(self) -> None:
        self.put_back()
        if self.interface is not None:
            cls = plugin().DistributedInterface
            cls._instance, cls._initialized = self.interface
            self.interface = None
        if self.undo_core is not None:
            self.undo_core()
            self.undo_core = None

    def loss(self, model, batch: dict, group) -> dict:
        """One micro-batch through LLaMA-Factory's `sequence_parallel_loss` (its sharding, the model,
        its loss), scaled as its trainer scales it (L258-263), as this rank's share of the step."""
        sp = plugin()
        if model is not self.model:
            self.apply(model)
        ids = batch["input_ids"]
        labels = batch["labels"].clone()
        labels[:, 0] = IGNORE  # the target of no position: LLaMA-Factory's rendering never counts it
        for start in (batch["cu_seqlens"] or [])[1:-1]:
            labels[:, start] = IGNORE  # its padding-free packing (batching.py L137-141)
        micro = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                 "loss_weights": (labels != IGNORE).to(torch.float32), "position_ids": batch["position_ids"]}
        seen = {}

        def forward(**inputs):  # the model, its logits kept for the verdict
            seen["out"] = model(**inputs)
            return seen["out"]

        shimmed = sp.dist
        sp.dist = RankDist(ids.device)  # shim 3
        try:
            mean = sp.SequenceParallelLossPlugin("sequence_parallel_loss")(forward, micro)
        except Exception as exc:  # a crash in its code on a configuration it accepts: a finding, located
            raise RuntimeError(crash_words(exc, model.config, dist.get_world_size(group))) from None
        finally:
            sp.dist = shimmed
        mini = (labels != IGNORE).sum()  # compute_valid_tokens([micro_batch])
        cp = dist.get_world_size(group)
        # the trainer's scale (dp_size / step_valid_tokens), then FSDP2's mean over dp x cp: dp cancels
        share = mean * mini / (batch["total"] + 1e-6) / cp
        logits = seen["out"].logits
        m, rank = logits.shape[1], dist.get_rank(group)
        return {"loss": share, "logits": logits,
                "positions": torch.arange(rank * m, (rank + 1) * m, device=ids.device)}


def crash_words(exc: BaseException, config, world_size: int) -> str:
    """One line for an exception raised inside LLaMA-Factory's code: where (its file and line, the
    innermost of its frames), the cause where it is known, the exception's first line."""
    root = str(Path(plugin().__file__).parents[4])  # .../llamafactory, the package
    tb, where, inner = exc.__traceback__, None, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith(root):
            where = f"llamafactory{name[len(root):]} L{tb.tb_lineno}"
        inner = (name, tb.tb_lineno)
        tb = tb.tb_next
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first.split(' (expected')[0]}"  # the shapes differ per case, the place not
    if where is None:
        return text
    c = config.get_text_config()
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    cause = (f" ({kv} K/V heads at cp_size={world_size}: its K/V check reads the query heads, sequence_parallel.py "
             f"L93)" if kv % world_size else "")
    below = inner[0].split("site-packages/")[-1]
    if below.startswith("transformers/"):  # raised in transformers, below its code: that place, called from its
        return (f"{below} L{inner[1]} raised under LLaMA-Factory {VERSION}'s {where.replace(SP_DIR, '')} on a "
                f"configuration it accepts{cause}: {text}")
    return f"LLaMA-Factory {VERSION} crashed at {where.replace(SP_DIR, '')} on a configuration it accepts{cause}: {text}"


def refuses_ring(tiny, world_size: int) -> list[str]:
    """What LLaMA-Factory refuses before a step, one line each: qwen3_5 (its trainer raises), a model
    class transformers does not build with flash_attention_2 (its trainer requires that name), query
    heads that P does not divide (its plugin's assertion)."""
    config = tiny.config
    if config.model_type == "qwen3_5":
        return [f"LLaMA-Factory's trainer raises RuntimeError for model_type qwen3_5 with cp_size={world_size} > 1 "
                f"({TRAINER_FILE} L143-147: 'Sequence parallel is not supported for qwen3.5 model')"]
    out = []
    cls = causal_lm_class(config)
    own = compatible_flash_implementations(cls)
    if not supports_attention(cls, "flash_attention_2"):
        out.append(f"transformers builds no {cls.__name__} with attn_implementation='flash_attention_2' "
                   f"(_supports_flash_attn = False), which LLaMA-Factory's trainer requires for cp_size > 1 "
                   f"({TRAINER_FILE} L149-152 raises ValueError)")
    elif own and "flash_attention_2" not in own:
        out.append(f"transformers builds {cls.__name__} with the hub kernel {own[0]!r} when flash_attention_2 is asked "
                   f"for, so config._attn_implementation != 'flash_attention_2' and LLaMA-Factory's trainer raises "
                   f"ValueError for cp_size={world_size} ({TRAINER_FILE} L149-152)")
    try:
        heads = config.num_attention_heads
    except AttributeError:
        heads = config.text_config.num_attention_heads  # as its plugin reads them (L92-98)
    if heads % world_size:
        out.append(f"{heads} query heads are not divisible by cp_size={world_size}: LLaMA-Factory's "
                   f"apply_sequence_parallel asserts it ({SP_FILE} L100); run a --world-size that divides {heads}")
    return out


def llamafactory_glue(adapter: LlamaFactoryUlysses | None = None) -> Glue:
    """The built-in glue `llamafactory` (ImportError with the fix where llamafactory is missing);
    `adapter`: a subclass's instance, for a patched copy of LLaMA-Factory's code."""
    plugin()
    a = adapter or LlamaFactoryUlysses()
    return Glue(name=NAME, install=a.install, layout="contiguous", uninstall=a.uninstall, forward_loss=a.loss,
                refuses_ring=refuses_ring, dtype="bfloat16", shims=SHIMS,
                sharding=f"LLaMA-Factory {VERSION}'s padding_and_split_data (padded to a multiple of P, contiguous "
                         f"chunks) inside its sequence_parallel_loss (labels gathered and shifted on the whole "
                         f"sequence, log-probs gathered), scaled as its v1 trainer scales it",
                describe=f"LLaMA-Factory {VERSION}'s v1 ulysses plugin (apply_sequence_parallel over transformers' "
                         f"flash_attention_2 path on ringcheck's flash-attn stand-in, bfloat16) and its "
                         f"sequence_parallel_loss, as its trainer calls them")
