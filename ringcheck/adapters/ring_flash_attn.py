"""Built-in adapters ``ring_flash_attn:zigzag|basic|stripe|llama3``: the rings of
ring-flash-attn 0.1.8, each with its own rules (layouts, masks, variants) stated here.

- ``ring_flash_attn:zigzag`` - `zigzag_ring_flash_attn_func` on zigzag shards (causal only);
  with ``--documents`` `zigzag_ring_flash_attn_varlen_func` on ``--layout zigzag_docs``.
- ``ring_flash_attn:basic`` - `ring_flash_attn_func` on contiguous shards. Its varlen function
  (`ring_flash_attn_varlen_func`) needs every document split evenly over the ranks, a layout
  ringcheck does not have, so ``--documents`` is refused.
- ``ring_flash_attn:stripe`` - `stripe_flash_attn_func` on striped shards (causal only; no varlen).
- ``ring_flash_attn:llama3`` - `llama3_flash_attn_varlen_func` (all-gather of K/V, heads_k_stride
  1) on contiguous shards, with `llama3_flash_attn_prepare_cu_seqlens`; one document without
  ``--documents``.

``window`` goes to every function (all take ``window_size``; whether the ring is right with it
is what validate finds); no softcap and no sinks (its API takes neither); ``--documents`` to the
varlen functions, whose padding tail (ringcheck's tokens past the last boundary) is passed as
one more document and its rows' output zeroed (lse -inf) here.

ring-flash-attn's package ``__init__`` imports its Hugging Face adapter, which imports
``transformers`` (not a declared dependency). Where transformers is not installed, the adapter
loads the ring modules without that ``__init__`` (a bare package object whose submodules are
imported one by one); with transformers installed the package is imported whole.

``deterministic`` is left at ring-flash-attn's default, False, as users run it: on a GPU its
backward then accumulates with atomic adds, and validate reports that (the determinism row's
FLAG) and judges the bit-exact properties within budgets, rather than judging a setting users do
not run (docs/reference/determinism.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys

import torch

from .contract import Impl, ImplFn
from .flash import (
    FLASH_DTYPES,
    causal_only,
    flash_dtype,
    import_error,
    padded_documents,
    per_batch,
    rank_world,
    require,
    window_size,
    zero_padding,
)

RFA_MODULES = ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn", "ring_flash_attn_varlen",
               "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen")
RFA_LAYOUTS = {"zigzag": ("zigzag", "zigzag_docs"), "basic": ("contiguous",), "stripe": ("striped",),
               "llama3": ("contiguous",)}
RFA_FUNCTIONS = {"zigzag": "zigzag_ring_flash_attn_func", "basic": "ring_flash_attn_func",
                 "stripe": "stripe_flash_attn_func"}

def load_ring_flash_attn(spec: str = "ring_flash_attn"):
    """The ring_flash_attn package: imported whole where transformers is installed and its
    Hugging Face adapter imports with it, otherwise its ring modules without the package
    ``__init__`` (which imports that adapter: ring-flash-attn 0.1.8's needs a name transformers
    5.x no longer has)."""
    require(spec, "ring_flash_attn")
    if "ring_flash_attn" in sys.modules:
        return sys.modules["ring_flash_attn"]
    why = "ring modules only: transformers is not installed"
    if importlib.util.find_spec("transformers") is not None:
        try:
            return importlib.import_module("ring_flash_attn")
        except ImportError as exc:  # the ring modules alone, below
            sys.modules.pop("ring_flash_attn", None)
            why = f"ring modules only: its Hugging Face adapter does not import ({exc})"
    try:
        found = importlib.util.find_spec("ring_flash_attn")
        package = importlib.util.module_from_spec(found)  # not executed: its __init__ needs transformers
        package.__ringcheck_partial__ = why
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
        raise import_error(spec, "ring-flash-attn", exc) from exc


def _rfa_fn(variant: str) -> ImplFn:
    rfa = load_ring_flash_attn(f"ring_flash_attn:{variant}")

    def dense(q, k, v, *, causal, softmax_scale, group=None, window=None):
        out, lse, _ = getattr(rfa, RFA_FUNCTIONS[variant])(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                           window_size=window_size(window), group=group,
                                                           return_attn_probs=True)
        return out, lse.float()

    def zigzag_varlen(q, k, v, *, causal, softmax_scale, group=None, window=None, cu_seqlens=None, layout=None):
        if cu_seqlens is None:
            return dense(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, window=window)
        rank, world = rank_world(group)
        local = [c // world for c in padded_documents(cu_seqlens, q.shape[1] * world)]
        cu = torch.tensor(local, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in itertools.pairwise(local))

        def one(qb, kb, vb):
            out, lse, _ = rfa.zigzag_ring_flash_attn_varlen_func(
                qb, kb, vb, cu, longest, softmax_scale=softmax_scale, causal=causal, window_size=window_size(window),
                group=group, return_attn_probs=True)
            return out, lse
        out, lse = per_batch(one, q, k, v)
        return zero_padding(out, lse, cu_seqlens, "zigzag_docs", rank, world)

    def llama3(q, k, v, *, causal, softmax_scale, group=None, window=None, cu_seqlens=None):
        rank, world = rank_world(group)
        seq_len = q.shape[1] * world
        docs = padded_documents([0, seq_len] if cu_seqlens is None else cu_seqlens, seq_len)
        cu = torch.tensor(docs, dtype=torch.int32, device=q.device)
        cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)

        def one(qb, kb, vb):
            out, lse, _ = rfa.llama3_flash_attn_varlen_func(
                qb, kb, vb, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size(window), group=group,
                return_attn_probs=True)
            return out, lse
        out, lse = per_batch(one, q, k, v)
        return zero_padding(out, lse, cu_seqlens, "contiguous", rank, world)

    return {"zigzag": zigzag_varlen, "llama3": llama3}.get(variant, dense)


def _rfa_check(variant: str):
    def check(target) -> None:
        name = f"--impl ring_flash_attn:{variant}"
        flash_dtype(name[7:], target)
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
                rule=causal_only(f"ring_flash_attn:{variant}") if variant in ("zigzag", "stripe") else None,
                check_target=_rfa_check(variant), dtypes=FLASH_DTYPES)


def load(spec: str) -> Impl:
    """``ring_flash_attn`` or ``ring_flash_attn:VARIANT``."""
    head, *parts = spec.split(":")
    if len(parts) > 1:
        raise ValueError(f"--impl {spec}: ring_flash_attn takes one variant, e.g. ring_flash_attn:zigzag")
    return ring_flash_attn_impl(parts[0] if parts else "zigzag")
