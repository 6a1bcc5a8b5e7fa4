"""`load_glue`: the glue `--glue` names (built-in or the user's)."""

from __future__ import annotations

from ..spec import LAYOUTS
from .contract import Glue, user_glue
from .ours import ringcheck_glue

BUILT_IN = ("ringcheck", "ring_flash_attn", "deepspeed_ulysses")


def load_glue(spec: str = "ringcheck", *, layout: str | None = None) -> Glue:
    """The glue `spec` names: "ringcheck" (the default: ringcheck's own, `layout` contiguous unless
    given: any of its ring's sequence layouts), "ring_flash_attn" (ring-flash-attn's shipped
    Hugging Face adapter, contiguous), or the user's "PKG.MOD:OBJ". `layout` chooses the layout
    of a glue whose ring takes several (ringcheck's); for another glue it must be its own."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"glue must be a non-empty str ('ringcheck', 'ring_flash_attn' or 'package.module:object'), "
                        f"got {spec!r}")
    if spec == "ringcheck":
        return ringcheck_glue(layout or "contiguous")
    if spec == "ring_flash_attn":
        from .ring_flash_attn import ring_flash_attn_glue  # imports ring-flash-attn, an optional dependency
        glue = ring_flash_attn_glue()
    elif spec == "deepspeed_ulysses":
        from ..trainers.deepspeed_ulysses import deepspeed_ulysses_glue  # imports DeepSpeed, a trainer's package
        glue = deepspeed_ulysses_glue()
    else:
        glue = user_glue(spec)
    if layout is not None and layout != glue.layout:
        raise ValueError(f"glue {spec!r} shards {glue.layout!r} (its ring's layout); layout={layout!r} applies only "
                         f"to the ringcheck glue, whose ring takes any of {', '.join(LAYOUTS)}")
    return glue
