"""`--glue ring_flash_attn`: ring-flash-attn 0.1.8's shipped Hugging Face adapter
(`ring_flash_attn.adapters.hf_adapter`: `substitute_hf_flash_attn`, `update_ring_flash_attn_params`),
run on a CPU through ringcheck's flash-attn stand-in.

The adapter replaces transformers' `_flash_attention_forward` with its llama3-style varlen ring
(contiguous shards, K/V all-gathered, documents from `update_ring_flash_attn_params`) and
registers its own `flash_attention_forward` as "flash_attention_2". As shipped it does not run
with transformers 5.23, in two places; ringcheck supplies exactly those two and nothing else,
so that what is judged is the adapter's own attention code (docs/findings/glues.md):

1. its module imports `is_flash_attn_greater_or_equal_2_10` from
   `transformers.modeling_flash_attention_utils`, where 5.23 no longer has it (both branches of
   its try/except import the same name from the same place): ringcheck puts 5.23's
   `transformers.utils.is_flash_attn_greater_or_equal_2_10` there before the import;
2. `substitute_hf_flash_attn` picks its replacement by the number of parameters of
   transformers' `_flash_attention_forward` (13, 18, 19 or 20; 5.23's has 23) and raises
   ValueError "The current transformer version 5.23.0 is not supported" otherwise: ringcheck
   installs the adapter's newest variant (`_flash_attention_forward_v3`, written for
   transformers >= 4.53, which takes **kwargs) the way `substitute_hf_flash_attn` would.

transformers 5.23 accepts `attn_implementation="flash_attention_2"` only when the flash-attn
distribution (>= 2.3.3, package metadata "flash-attn") is installed and a CUDA, MLU or MUSA device
is available (`is_flash_attn_2_available`, `_flash_attn_can_dispatch`), which the stand-in is
not; so the adapter's `flash_attention_forward` (the very function it registers as
"flash_attention_2") is also registered under the name "ring_flash_attn", which the model is
built with. The five models of the Proof list do not branch on the implementation's name.
Flash kernels take bfloat16 and float16 only: the glue is judged in bfloat16.
"""

from __future__ import annotations

import importlib
import sys

import torch

from ..thirdparty.transformers_private import keep_attention_state
from .contract import Glue, group_device

NAME = "ring_flash_attn"
IMPLEMENTATION = "rfa_hf_adapter"  # no "flash" in it: transformers would look a "*flash*" name up as a hub kernel
HEADS_K_STRIDE = 1   # heads_k_stride of substitute_hf_flash_attn: one K/V head per exchange (divides any count)
SHIMS = ("is_flash_attn_greater_or_equal_2_10 supplied to transformers.modeling_flash_attention_utils",
         "the adapter's _flash_attention_forward_v3 installed where substitute_hf_flash_attn finds no variant with "
         "the parameter count of transformers 5.23's _flash_attention_forward")


def hf_adapter():
    """ring-flash-attn's `adapters.hf_adapter` module, imported with the stand-in installed and
    shim 1 of the module docstring (a ValueError saying what is missing otherwise)."""
    from ..flash_stand_in import install  # the stand-in before ring-flash-attn imports flash_attn
    install()
    try:
        import transformers.modeling_flash_attention_utils as mfa  # transformers is the optional extra `hf`
        from transformers import utils
    except ImportError as exc:
        raise ValueError(f"--glue ring_flash_attn needs transformers ({exc}); install the extra `hf`") from exc
    if not hasattr(mfa, "is_flash_attn_greater_or_equal_2_10"):
        mfa.is_flash_attn_greater_or_equal_2_10 = utils.is_flash_attn_greater_or_equal_2_10
    partial = sys.modules.get("ring_flash_attn")
    if partial is not None and getattr(partial, "__ringcheck_partial__", None):
        del sys.modules["ring_flash_attn"]   # ringcheck's --impl loader's ring-modules-only package
    try:
        return importlib.import_module("ring_flash_attn.adapters.hf_adapter")
    except ImportError as exc:
        raise ValueError(f"--glue ring_flash_attn: ring-flash-attn's Hugging Face adapter does not import ({exc}); "
                         f"pip install ring-flash-attn==0.1.8") from exc


class RingFlashAttnGlue:
    """The adapter installed on one rank (its module-level state is the adapter's own)."""

    def __init__(self):
        self.group = None
        self.adapter = None
        self.undo = None  # transformers' attention state before the adapter patched it (uninstall)

    def install(self, group) -> str:
        import transformers.modeling_flash_attention_utils as mfa  # transformers is the optional extra `hf`
        from transformers import AttentionInterface
        adapter = hf_adapter()
        self.group, self.adapter = group, adapter
        if self.undo is None:  # substitute_hf_flash_attn patches _flash_attention_forward and flash_attention_2
            self.undo = keep_attention_state()
        try:
            adapter.substitute_hf_flash_attn(group, HEADS_K_STRIDE)
        except ValueError:   # shim 2: what substitute_hf_flash_attn does, with its newest variant
            original = getattr(mfa, "_ringcheck_original_flash_forward", mfa._flash_attention_forward)
            mfa._ringcheck_original_flash_forward = original
            ring = adapter.create_ring_flash_attention_forward(group, HEADS_K_STRIDE)[3]
            mfa._flash_attention_forward = lambda *args, **kwargs: (
                ring(*args, **kwargs) if adapter.RING_ATTN_SWITCH else original(*args, **kwargs))
            if adapter.ALL_ATTENTION_FUNCTIONS is not None:
                adapter.ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = adapter.flash_attention_forward
        AttentionInterface.register(IMPLEMENTATION, adapter.flash_attention_forward)
        return IMPLEMENTATION

    def uninstall(self) -> None:
        """transformers as it was before `install`: the adapter leaves `_flash_attention_forward` and
        `ALL_ATTENTION_FUNCTIONS["flash_attention_2"]` patched for the process (a later flash-path
        user of the same process would otherwise run its ring, on this group)."""
        if self.undo is not None:
            self.undo()
            self.undo = None

    def prepare(self, cu_seqlens, group) -> None:
        """The adapter's own `update_ring_flash_attn_params` with the global boundaries (int32)."""
        if cu_seqlens is None:
            raise ValueError("--glue ring_flash_attn: prepare needs the global boundaries [0, ..., seq_len] (the "
                             "adapter's update_ring_flash_attn_params takes the whole sequence's length from them)")
        # on the rank's device: the varlen kernels take the boundaries there only (flash-attn's CHECK_DEVICE)
        bounds = torch.tensor([int(x) for x in cu_seqlens], dtype=torch.int32, device=group_device(group))
        self.adapter.update_ring_flash_attn_params(bounds, group)


def refuses(layer) -> list[str]:
    """The adapter asserts `softcap is None` ("llama3_flash_attn_varlen_func does not support softcap
    yet"): a softcapped layer cannot run. Everything else runs and is judged."""
    if layer.softcap:
        return [f"softcap {layer.softcap} (the adapter asserts softcap is None: llama3_flash_attn_varlen_func "
                f"does not support softcap yet)"]
    return []


def ring_flash_attn_glue() -> Glue:
    state = RingFlashAttnGlue()
    return Glue(name=NAME, install=state.install, layout="contiguous", prepare=state.prepare,
                uninstall=state.uninstall,
                describe=("ring-flash-attn 0.1.8's Hugging Face adapter (substitute_hf_flash_attn, "
                          "update_ring_flash_attn_params, llama3-style varlen ring) on ringcheck's flash-attn "
                          "stand-in, bfloat16; with transformers 5.23: " + "; ".join(SHIMS)),
                refuses=refuses, dtype="bfloat16")
