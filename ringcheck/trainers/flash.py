"""The flash core of the trainers' glues on a CPU: transformers' own flash path, under a name of
its own, over ringcheck's flash-attn stand-in (or the real flash-attn, where one is installed).

transformers 5.23 accepts `attn_implementation="flash_attention_2"` only with the flash-attn
distribution and a CUDA device (`is_flash_attn_2_available`), and looks any other name with
"flash" in it up as a hub kernel. So a trainer's glue that wraps the flash core runs it as
`FLASH_CORE`: transformers' `flash_attention_forward` and `flash_attention_mask` registered under
that name, and transformers' `_lazy_imports(FLASH_CORE)` answered with `flash_attn_func` /
`flash_attn_varlen_func` (`thirdparty.transformers_private.answer_flash_imports`). Everything
between the model and the kernel is transformers' own: the varlen path with `cu_seqlens` from
`position_ids` for packed documents, the window as `(w - 1, w - 1)` when the keys are longer
than w, the softcap, the scale. Flash kernels take bfloat16 and float16 only: a glue over this
core is judged in bfloat16 (`Glue.dtype`), with the measured noise budget.
"""

from __future__ import annotations

from collections.abc import Callable

from ..thirdparty.transformers_private import answer_flash_imports

FLASH_CORE = "fa2_stand_in"  # no "flash" in it: transformers would look a "*flash*" name up as a hub kernel
SHIM = (f"transformers' own flash_attention_forward registered as {FLASH_CORE!r}, its _lazy_imports answered with "
        f"ringcheck's flash-attn stand-in (transformers takes 'flash_attention_2' only with flash-attn and CUDA)")


def install_flash_core() -> Callable[[], None]:
    """Register `FLASH_CORE` (see the module's docstring) in this process; returns the undo (the
    kernel loader put back; the registered name stays, unused)."""
    from ..flash_stand_in import install  # the stand-in before flash_attn is imported below

    install()  # `import flash_attn` gives the stand-in, unless a real flash-attn is installed
    import flash_attn  # the stand-in (installed above) or the real one
    from transformers import AttentionInterface  # transformers is the optional extra `hf`
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FLASH_CORE, flash_attention_forward)
    AttentionMaskInterface.register(FLASH_CORE, flash_attention_mask)
    return answer_flash_imports(FLASH_CORE, flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func)
