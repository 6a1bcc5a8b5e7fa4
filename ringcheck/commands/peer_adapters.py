"""Built-in adapters for rings built on flash-attn: ring-flash-attn 0.1.8 and yunchang 0.6.4.

Both call flash-attn's block kernels, so on a machine without CUDA they run only through
ringcheck's CPU stand-in (`ringcheck.flash_stand_in`, ``--flash-attn-stand-in``). Spellings:

- ``ring_flash_attn:zigzag`` - `zigzag_ring_flash_attn_func` on zigzag shards (causal only);
  with ``--documents`` `zigzag_ring_flash_attn_varlen_func` on ``--layout zigzag_docs``.
- ``ring_flash_attn:basic`` - `ring_flash_attn_func` on contiguous shards. Its varlen function
  (`ring_flash_attn_varlen_func`) needs every document split evenly over the ranks, a layout
  ringcheck does not have, so ``--documents`` is refused.
- ``ring_flash_attn:stripe`` - `stripe_flash_attn_func` on striped shards (causal only; no varlen).
- ``ring_flash_attn:llama3`` - `llama3_flash_attn_varlen_func` (all-gather of K/V, heads_k_stride
  1) on contiguous shards, with `llama3_flash_attn_prepare_cu_seqlens`; one document without
  ``--documents``.
- ``yunchang:ulysses`` - `UlyssesAttention` (all-to-all over heads) on contiguous shards.
- ``yunchang:usp[:ulysses=U]`` - `LongContextAttention` (Ulysses x ring, yunchang's "basic" ring)
  on contiguous shards; U divides the ring size P (default 2 where P >= 4 is even, else 1), the
  ring degree is P / U (at least 2 on CPU: a ring of one rank sends to itself in its backward,
  which gloo cannot); Ulysses groups are consecutive ranks, ring groups strided (yunchang's
  ``use_ulysses_low``), over the whole world.
- ``yunchang:ring:basic|zigzag|stripe`` - yunchang's copies of the three rings.

Variants: ``window`` goes to every function (all take ``window_size``; whether the ring is right
with it is what validate finds); ``softcap`` to yunchang's (ring-flash-attn 0.1.8 takes none);
``--documents`` to the varlen functions above, whose padding tail (ringcheck's tokens past the
last boundary) is passed as one more document and its rows' output zeroed (lse -inf) here, since
ring-flash-attn has no padding of its own. No adapter takes sinks. GQA: Ulysses degrees above the
K/V heads repeat each K/V head (gradients summed back by autograd). A combination an adapter
cannot run raises a ValueError before any rank starts (`Impl.check_target`).

ring-flash-attn's package ``__init__`` imports its Hugging Face adapter, which imports
``transformers`` (not a declared dependency). Where transformers is not installed, the adapter
loads the ring modules without that ``__init__`` (a bare package object whose submodules are
imported one by one); with transformers installed the package is imported whole.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
import traceback

import torch
import torch.distributed as dist

from ..flash_stand_in import install as install_flash_stand_in
from ..ring.layouts import positions
from .adapters import Impl, ImplFn, refuse_value_head_dim
from .validate_rows import CheckRow

PEERS = {"ring_flash_attn": ("ring-flash-attn", "ring-flash-attn==0.1.8"), "yunchang": ("yunchang", "yunchang==0.6.4")}
RFA_MODULES = ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn", "ring_flash_attn_varlen",
               "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen")
RFA_LAYOUTS = {"zigzag": ("zigzag", "zigzag_docs"), "basic": ("contiguous",), "stripe": ("striped",),
               "llama3": ("contiguous",)}
RFA_FUNCTIONS = {"zigzag": "zigzag_ring_flash_attn_func", "basic": "ring_flash_attn_func",
                 "stripe": "stripe_flash_attn_func"}
YUNCHANG_RINGS = {"basic": ("ring_flash_attn_func", "contiguous"), "zigzag": ("zigzag_ring_flash_attn_func", "zigzag"),
                  "stripe": ("stripe_flash_attn_func", "striped")}


# ------------------------------------------------------------------------------- imports

def import_chain(exc: BaseException) -> list[str]:
    """The modules an import went through before it failed (outermost first), and the one missing."""
    chain: list[str] = []
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_globals.get("__name__", "?")
        if not name.startswith(("importlib", "ringcheck")) and (not chain or chain[-1] != name):
            chain.append(name)
    missing = getattr(exc, "name", None)
    if missing and (not chain or chain[-1] != missing):
        chain.append(missing)
    return chain


def _import_error(spec: str, package: str, exc: ImportError) -> RuntimeError:
    from importlib.metadata import PackageNotFoundError, version  # only to name what is installed

    try:
        installed = f"{package} {version(package)}"
    except PackageNotFoundError:
        installed = package
    chain = " -> ".join(import_chain(exc))
    hint = ""
    if (getattr(exc, "name", "") or "").split(".")[0] == "flash_attn":
        hint = ("; it needs flash-attn: pass --flash-attn-stand-in to run it on ringcheck's CPU stand-in, or "
                "pip install flash-attn on a CUDA machine")
    return RuntimeError(f"--impl {spec}: {installed} is installed but cannot be imported: {type(exc).__name__}: "
                        f"{exc} (import chain: {chain}){hint}")


def _require(spec: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        package, pin = PEERS[module]
        raise RuntimeError(f"--impl {spec} needs the {package} package: pip install {pin} --no-deps "
                           f"(or pip install 'ringcheck[peers]')")


def load_ring_flash_attn(spec: str = "ring_flash_attn"):
    """The ring_flash_attn package: imported whole where transformers is installed, otherwise
    its ring modules without the package ``__init__`` (which imports the Hugging Face adapter)."""
    _require(spec, "ring_flash_attn")
    try:
        if "ring_flash_attn" in sys.modules or importlib.util.find_spec("transformers") is not None:
            return importlib.import_module("ring_flash_attn")
        found = importlib.util.find_spec("ring_flash_attn")
        package = importlib.util.module_from_spec(found)  # not executed: its __init__ needs transformers
        package.__ringcheck_partial__ = "ring modules only: transformers is not installed"
        sys.modules["ring_flash_attn"] = package
        for name in RFA_MODULES:
            module = importlib.import_module(f"ring_flash_attn.{name}")
            for attr in dir(module):
                if attr.endswith(("_func", "_prepare_cu_seqlens")):
                    setattr(package, attr, getattr(module, attr))
        return package
    except ImportError as exc:
        if getattr(sys.modules.get("ring_flash_attn"), "__ringcheck_partial__", None):
            del sys.modules["ring_flash_attn"]
        raise _import_error(spec, "ring-flash-attn", exc) from exc


def load_yunchang(spec: str = "yunchang"):
    """The yunchang package, with flash-attn behind it (yunchang imports without it and fails later)."""
    _require(spec, "yunchang")
    try:
        import flash_attn.flash_attn_interface  # noqa: F401  yunchang's FA path needs it; the real cause if not
        return importlib.import_module("yunchang")
    except ImportError as exc:
        raise _import_error(spec, "yunchang", exc) from exc


def stand_in_row(requested: bool) -> CheckRow | None:
    """With `requested` (``--flash-attn-stand-in``): install the flash-attn stand-in in this process
    (never over a real flash-attn) and return validate's information row that says what happened,
    so no report is silent about it; None without it."""
    if not requested:
        return None
    return CheckRow("flash-attn stand-in", "info", detail=install_flash_stand_in().describe())


def stand_in_task(member) -> str:
    """Ring task: install the stand-in in this rank's process (local ring workers live on between
    tasks, so a command runs it once per ring size before its own tasks); what it did, in words."""
    return install_flash_stand_in().describe()


# ------------------------------------------------------------------------------ helpers

def _window(window) -> tuple[int, int]:
    return (-1, -1) if window is None else (int(window[0]), int(window[1]))


def _padded_documents(cu_seqlens, seq_len: int) -> list[int]:
    """Global boundaries with ringcheck's padding tail as one more document (ring-flash-attn has none)."""
    cu = [int(x) for x in cu_seqlens]
    return cu + [seq_len] if cu[-1] < seq_len else cu


def _zero_padding(out, lse, cu_seqlens, layout: str, rank: int, world: int):
    """out 0 and lse -inf on this rank's padding rows (positions past the last boundary)."""
    if cu_seqlens is None:
        return out, lse
    seq_len = out.shape[1] * world
    end = int(cu_seqlens[-1])
    if end >= seq_len:
        return out, lse
    pad = positions(layout=layout, rank=rank, world_size=world, seq_len=seq_len,
                    cu_seqlens=[int(x) for x in cu_seqlens]).to(out.device) >= end
    out = out.masked_fill(pad[None, :, None, None], 0.0)
    return out, lse.masked_fill(pad[None, None, :], float("-inf"))


def _per_batch(call, q, k, v):
    """A varlen function takes (tokens, heads, dim): call it per batch element; out and lse stacked."""
    outs, lses = zip(*(call(q[b], k[b], v[b]) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses).float()


def _flash_dtype(spec: str, target) -> None:
    """flash-attn 2's limits, which every ring built on it shares: float16 / bfloat16, and v
    with q's head dim."""
    if target.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"--impl {spec} runs on flash-attn, whose kernels take float16 and bfloat16 only (so does "
                         f"the stand-in); pass --dtype bfloat16 or --dtype float16, not {target.dtype}")
    refuse_value_head_dim(spec, "flash-attn 2, which has no value head dim of its own", target)


def _rank_world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _repeat_kv(k, v, degree: int):
    """Repeat each K/V head until the K/V heads divide among `degree` ranks (Ulysses scatters heads)."""
    kv = k.shape[2]
    times = degree // math.gcd(kv, degree)
    return (k, v) if times == 1 else (k.repeat_interleave(times, 2), v.repeat_interleave(times, 2))


# ---------------------------------------------------------------------- ring-flash-attn

def _rfa_fn(variant: str) -> ImplFn:
    rfa = load_ring_flash_attn(f"ring_flash_attn:{variant}")

    def dense(q, k, v, *, causal, softmax_scale, group=None, window=None):
        out, lse, _ = getattr(rfa, RFA_FUNCTIONS[variant])(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                           window_size=_window(window), group=group,
                                                           return_attn_probs=True)
        return out, lse.float()

    def zigzag_varlen(q, k, v, *, causal, softmax_scale, group=None, window=None, cu_seqlens=None, layout=None):
        if cu_seqlens is None:
            return dense(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, window=window)
        rank, world = _rank_world(group)
        local = [c // world for c in _padded_documents(cu_seqlens, q.shape[1] * world)]
        cu = torch.tensor(local, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in itertools.pairwise(local))

        def one(qb, kb, vb):
            out, lse, _ = rfa.zigzag_ring_flash_attn_varlen_func(
                qb, kb, vb, cu, longest, softmax_scale=softmax_scale, causal=causal, window_size=_window(window),
                group=group, return_attn_probs=True)
            return out, lse
        out, lse = _per_batch(one, q, k, v)
        return _zero_padding(out, lse, cu_seqlens, "zigzag_docs", rank, world)

    def llama3(q, k, v, *, causal, softmax_scale, group=None, window=None, cu_seqlens=None):
        rank, world = _rank_world(group)
        seq_len = q.shape[1] * world
        docs = _padded_documents([0, seq_len] if cu_seqlens is None else cu_seqlens, seq_len)
        cu = torch.tensor(docs, dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)

        def one(qb, kb, vb):
            out, lse, _ = rfa.llama3_flash_attn_varlen_func(
                qb, kb, vb, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
                softmax_scale=softmax_scale, causal=causal, window_size=_window(window), group=group,
                return_attn_probs=True)
            return out, lse
        out, lse = _per_batch(one, q, k, v)
        return _zero_padding(out, lse, cu_seqlens, "contiguous", rank, world)

    return {"zigzag": zigzag_varlen, "llama3": llama3}.get(variant, dense)


FLASH_DTYPES = ("bfloat16", "float16")  # flash-attn's kernels (and the stand-in) take these only


def _causal_only(name: str):
    """`Impl.rule` of a ring that asserts causal (zig-zag and striped rings)."""
    def rule(layout: str, causal: bool) -> None:
        if not causal:
            raise ValueError(f"--impl {name} runs causal attention only; pass --causal")
    return rule


def _rfa_check(variant: str):
    def check(target) -> None:
        name = f"--impl ring_flash_attn:{variant}"
        _flash_dtype(name[7:], target)
        spec = target.full_spec()
        if variant in ("zigzag", "stripe") and not target.causal:
            raise ValueError(f"{name} runs causal attention only (ring-flash-attn asserts causal); pass --causal, "
                             f"or use ring_flash_attn:basic or ring_flash_attn:llama3 for bidirectional attention")
        if spec.variant.softcap is not None or spec.sinks:
            raise ValueError(f"{name}: ring-flash-attn 0.1.8's functions take no softcap and no sinks; drop "
                             f"--softcap / --sinks (yunchang's rings take a softcap: --impl yunchang:ring:{variant})")
        if spec.variant.cu_seqlens is None:
            if target.layout == "zigzag_docs":
                raise ValueError(f"{name}: --layout zigzag_docs needs --documents")
            return
        if variant in ("basic", "stripe"):
            raise ValueError(f"{name} with --documents: ring-flash-attn has "
                             + ("no striped varlen function" if variant == "stripe" else
                                "ring_flash_attn_varlen_func, which needs every document split evenly over the "
                                "ranks (a layout ringcheck does not have)")
                             + "; use ring_flash_attn:llama3 (contiguous) or ring_flash_attn:zigzag --layout "
                               "zigzag_docs")
        if variant == "zigzag" and target.layout != "zigzag_docs":
            raise ValueError(f"{name} with --documents runs zigzag_ring_flash_attn_varlen_func, which balances each "
                             f"document: pass --layout zigzag_docs")
    return check


def ring_flash_attn_impl(variant: str) -> Impl:
    if variant not in RFA_LAYOUTS:
        raise ValueError(f"--impl ring_flash_attn:{variant} is unknown; choose one of "
                         f"{[f'ring_flash_attn:{v}' for v in RFA_LAYOUTS]}")
    return Impl(f"ring_flash_attn:{variant}", _rfa_fn(variant), layouts=RFA_LAYOUTS[variant],
                rule=_causal_only(f"ring_flash_attn:{variant}") if variant in ("zigzag", "stripe") else None,
                check_target=_rfa_check(variant), dtypes=FLASH_DTYPES)


# ---------------------------------------------------------------------------- yunchang

_USP_GROUPS: dict[tuple, tuple] = {}


def _usp_groups(group, ulysses: int):
    """(ulysses group, ring group) of this rank: Ulysses groups of consecutive ranks, ring groups
    strided (yunchang's set_seq_parallel_pg with use_ulysses_low); made once per world and
    degree. Every rank of the world makes every group (gloo's new_group is world-collective), so
    `group` must be the whole world."""
    rank, world = _rank_world(group)
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
                                               window_size=_window(window), softcap=softcap or 0.0, group=group,
                                               return_attn_probs=True)
            return out, lse.float()

        def check(target) -> None:
            if kind != "basic" and not target.causal:
                raise ValueError(f"--impl {spec} runs causal attention only (yunchang asserts causal); pass "
                                 f"--causal or use yunchang:ring:basic")
            _no_documents(spec, target)
        return Impl(spec, yunchang_ring, layouts=(layout,), rule=_causal_only(spec) if kind != "basic" else None,
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
        _, world = _rank_world(group)
        u = ulysses_degree(world)
        k, v = _repeat_kv(k, v, u)
        kwargs = {"softmax_scale": softmax_scale, "causal": causal, "window_size": _window(window),
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
        if variant == "usp" and target.world_size == u and not torch.cuda.is_available():
            raise ValueError(f"--impl {spec}: a ring degree of 1 (ulysses={u} on {u} ranks) makes yunchang's ring "
                             f"backward send to its own rank, which gloo cannot; use --impl yunchang:ulysses for "
                             f"pure Ulysses, or yunchang:usp:ulysses=D with D < {target.world_size}")
        _no_documents(spec, target)
    return Impl(spec, yunchang_attention, layouts=("contiguous",), check_target=check, dtypes=FLASH_DTYPES)


def _no_documents(spec: str, target) -> None:
    _flash_dtype(spec, target)
    full = target.full_spec()
    if full.variant.cu_seqlens is not None or full.sinks:
        raise ValueError(f"--impl {spec}: yunchang 0.6.4's attention layers take no cu_seqlens and no sinks; drop "
                         f"--documents / --pad / --sinks (ring-flash-attn's varlen rings take documents: "
                         f"--impl ring_flash_attn:llama3)")


def load_peer(spec: str) -> Impl:
    """A built-in adapter of ring-flash-attn or yunchang (the spellings in this module's docstring)."""
    head, *parts = spec.split(":")
    if head == "ring_flash_attn":
        if len(parts) > 1:
            raise ValueError(f"--impl {spec}: ring_flash_attn takes one variant, e.g. ring_flash_attn:zigzag")
        return ring_flash_attn_impl(parts[0] if parts else "zigzag")
    variant = parts[0] if parts else ""
    if variant not in ("ulysses", "usp", "ring"):
        raise ValueError(f"--impl {spec} is unknown; choose yunchang:ulysses, yunchang:usp[:ulysses=N] or "
                         f"yunchang:ring:basic|zigzag|stripe")
    return _yunchang_impl(spec, variant, parts[1:])

