"""`load_glue`: the glue `--glue` names (built-in or the user's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..spec import LAYOUTS
from .contract import Glue, user_glue
from .ours import ringcheck_glue
from .ulysses import ulysses_glue

BUILT_IN = ("ringcheck", "ulysses", "ring_flash_attn")  # and the trainers' glues, `named` from above (`ringcheck.trainers`)


def load_glue(spec: str = "ringcheck", *, layout: str | None = None,
              named: Mapping[str, Callable[[], Glue]] | None = None) -> Glue:
    """The glue `spec` names: "ringcheck" (the default: ringcheck's own, `layout` contiguous unless
    given: any of its ring's sequence layouts), "ring_flash_attn" (ring-flash-attn's shipped
    Hugging Face adapter, contiguous), a name in `named` (more built-in glues, each with the
    function that makes it, from the layers above this one: the trainers' glues,
    `ringcheck.trainers.TRAINER_GLUES`, which build on this package's contract, so that it never
    imports them), or the user's "PKG.MOD:OBJ". `layout` chooses the layout of a glue whose ring
    takes several (ringcheck's); for another glue it must be its own. "ulysses" is ringcheck's
    Ulysses glue (all-to-all over heads, contiguous)."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"glue must be a non-empty str ('ringcheck', 'ulysses', 'ring_flash_attn' or "
                        f"'package.module:object'), got {spec!r}")
    if spec == "ringcheck":
        return ringcheck_glue(layout or "contiguous")
    if spec == "ring_flash_attn":
        from .ring_flash_attn import ring_flash_attn_glue  # imports ring-flash-attn, an optional dependency
        glue = ring_flash_attn_glue()
    elif spec == "ulysses":
        glue = ulysses_glue()
    elif named and spec in named:
        glue = named[spec]()
    else:
        glue = user_glue(spec)
    if layout is not None and layout != glue.layout:
        raise ValueError(f"glue {spec!r} shards {glue.layout!r} (its ring's layout); layout={layout!r} applies only "
                         f"to the ringcheck glue, whose ring takes any of {', '.join(LAYOUTS)}")
    return glue
