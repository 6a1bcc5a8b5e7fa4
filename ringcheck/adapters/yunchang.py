"""Built-in adapters of yunchang 0.6.4, each with its own rules stated here:

- ``yunchang:ulysses`` - `UlyssesAttention` (all-to-all over heads) on contiguous shards.
- ``yunchang:usp[:ulysses=U]`` - `LongContextAttention` (Ulysses x ring, yunchang's "basic" ring)
  on contiguous shards; U divides the ring size P (default 2 where P >= 4 is even, else 1), the
  ring degree is P / U (at least 2 on CPU: a ring of one rank sends to itself in its backward,
  which gloo cannot); Ulysses groups are consecutive ranks, ring groups strided (yunchang's
  ``use_ulysses_low``), over the whole world (so it is never run inside a mesh).
- ``yunchang:ring:basic|zigzag|stripe`` - yunchang's copies of the three rings.

``window`` and ``softcap`` go to every function; no documents and no sinks (its layers take
neither). GQA: Ulysses degrees above the K/V heads repeat each K/V head (gradients summed back
by autograd).
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

from ..flash_stand_in import active as stand_in_active
from .contract import Impl
from .flash import FLASH_DTYPES, causal_only, flash_dtype, import_error, rank_world, repeat_kv, require, window_size

USP_WORLD_ONLY = ("yunchang:usp builds its Ulysses and ring groups over the whole world (yunchang's "
                  "set_seq_parallel_pg), not inside the group it is given")
YUNCHANG_RINGS = {"basic": ("ring_flash_attn_func", "contiguous"), "zigzag": ("zigzag_ring_flash_attn_func", "zigzag"),
                  "stripe": ("stripe_flash_attn_func", "striped")}



def load_yunchang(spec: str = "yunchang"):
    """The yunchang package, with flash-attn behind it (yunchang imports without it and fails later)."""
    require(spec, "yunchang")
    try:
        import flash_attn.flash_attn_interface  # noqa: F401  yunchang's FA path needs it; the real cause if not
        return importlib.import_module("yunchang")
    except ImportError as exc:
        raise import_error(spec, "yunchang", exc) from exc


_USP_GROUPS: dict[tuple, tuple] = {}


def _usp_groups(group, ulysses: int):
    """(ulysses group, ring group) of this rank: Ulysses groups of consecutive ranks, ring groups
    strided (yunchang's set_seq_parallel_pg with use_ulysses_low); made once per world and
    degree. Every rank of the world makes every group (gloo's new_group is world-collective), so
    `group` must be the whole world."""
    rank, world = rank_world(group)
    if world != dist.get_world_size():
        raise ValueError(f"yunchang:usp builds its Ulysses and ring groups over the whole world; it runs on a ring "
                         f"of {world} ranks inside a world of {dist.get_world_size()}: run it with --world-size "
                         f"equal to the world")
    key = (world, ulysses)
    if key not in _USP_GROUPS:
        ring = world // ulysses
        ulysses_groups = [dist.new_group(list(range(i * ulysses, (i + 1) * ulysses))) for i in range(ring)]
        ring_groups = [dist.new_group(list(range(i, world, ulysses))) for i in range(ulysses)]
        _USP_GROUPS[key] = (ulysses_groups[rank // ulysses], ring_groups[rank % ulysses])
    return _USP_GROUPS[key]


def _parse_options(spec: str, parts: list[str], known: dict[str, int]) -> dict[str, int]:
    options = dict(known)
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in known or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--impl {spec}: option {part!r} is not understood; options: "
                             f"{', '.join(f'{k}=N' for k in known)} (e.g. yunchang:usp:ulysses=2)")
        options[key] = int(value)
    return options


def _yunchang_impl(spec: str, variant: str, options: list[str]) -> Impl:
    yc = load_yunchang(spec)
    from yunchang.kernels import AttnType  # the package is importable: checked just above

    if variant == "ring":
        kind = options[0] if options else "basic"
        if kind not in YUNCHANG_RINGS or len(options) > 1:
            raise ValueError(f"--impl {spec} is unknown; choose yunchang:ring:basic, yunchang:ring:zigzag or "
                             f"yunchang:ring:stripe")
        fn_name, layout = YUNCHANG_RINGS[kind]

        def yunchang_ring(q, k, v, *, causal, softmax_scale, group=None, window=None, softcap=None):
            out, lse, _ = getattr(yc, fn_name)(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                               window_size=window_size(window), softcap=softcap or 0.0, group=group,
                                               return_attn_probs=True)
            return out, lse.float()

        def check(target) -> None:
            if kind != "basic" and not target.causal:
                raise ValueError(f"--impl {spec} runs causal attention only (yunchang asserts causal); pass "
                                 f"--causal or use yunchang:ring:basic")
            _no_documents(spec, target)
        return Impl(spec, yunchang_ring, layouts=(layout,), rule=causal_only(spec) if kind != "basic" else None,
                    check_target=check, dtypes=FLASH_DTYPES)

    degree = {"ulysses": None, "usp": 2}[variant]
    chosen = _parse_options(spec, options, {"ulysses": degree} if variant == "usp" else {})

    def ulysses_degree(world: int) -> int:
        if variant == "ulysses":
            return world
        if options:
            return chosen["ulysses"]
        return 2 if world % 2 == 0 and world >= 4 else 1  # default: a real hybrid where the ring allows one

    def yunchang_attention(q, k, v, *, causal, softmax_scale, group=None, window=None, softcap=None):
        _, world = rank_world(group)
        u = ulysses_degree(world)
        k, v = repeat_kv(k, v, u)
        kwargs = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window_size(window),
                      "softcap": softcap or 0.0}
        if variant == "ulysses":
            layer = yc.UlyssesAttention(sequence_process_group=group, attn_type=AttnType.FA)
            return layer(q, k, v, **kwargs)
        from yunchang.globals import PROCESS_GROUP  # LongContextAttention reads its groups from this singleton

        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _usp_groups(group, u)
        layer = yc.LongContextAttention(ring_impl_type="basic", attn_type=AttnType.FA)
        return layer(q, k, v, **kwargs)

    def check(target) -> None:
        u = ulysses_degree(target.world_size)
        if target.world_size % u:
            raise ValueError(f"--impl {spec}: the Ulysses degree {u} does not divide --world-size "
                             f"{target.world_size}; pass yunchang:usp:ulysses=D with D dividing it")
        if target.heads % u:
            raise ValueError(f"--impl {spec}: Ulysses scatters the {target.heads} query heads over {u} ranks; "
                             f"pass --heads as a multiple of {u}")
        if variant == "usp" and target.world_size == u and stand_in_active():  # CPU tensors: gloo
            raise ValueError(f"--impl {spec}: a ring degree of 1 (ulysses={u} on {u} ranks) makes yunchang's ring "
                             f"backward send to its own rank, which gloo cannot; use --impl yunchang:ulysses for "
                             f"pure Ulysses, or yunchang:usp:ulysses=D with D < {target.world_size}")
        _no_documents(spec, target)
    return Impl(spec, yunchang_attention, layouts=("contiguous",), check_target=check, dtypes=FLASH_DTYPES,
                world_only=USP_WORLD_ONLY if variant == "usp" else None)


def _no_documents(spec: str, target) -> None:
    flash_dtype(spec, target)
    full = target.full_spec()
    if full.variant.cu_seqlens is not None or full.sinks:
        raise ValueError(f"--impl {spec}: yunchang 0.6.4's attention layers take no cu_seqlens and no sinks; drop "
                         f"--documents / --pad / --sinks (ring-flash-attn's varlen rings take documents: "
                         f"--impl ring_flash_attn:llama3)")


def load(spec: str) -> Impl:
    """``yunchang:ulysses``, ``yunchang:usp[:ulysses=N]`` or ``yunchang:ring:basic|zigzag|stripe``."""
    _, *parts = spec.split(":")
    variant = parts[0] if parts else ""
    if variant not in ("ulysses", "usp", "ring"):
        raise ValueError(f"--impl {spec} is unknown; choose yunchang:ulysses, yunchang:usp[:ulysses=N] or "
                         f"yunchang:ring:basic|zigzag|stripe")
    return _yunchang_impl(spec, variant, parts[1:])
