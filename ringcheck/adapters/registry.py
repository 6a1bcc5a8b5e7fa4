"""The one registry of implementations under test: `load_impl` resolves `--impl` to an `Impl`.

Built-in adapters (`--impl NAME` or `--impl NAME:VARIANT`), one module each, stating its own
rules (layouts, masks, dtypes, variants, whether it runs inside a mesh) in one place:

- ``ringcheck`` - our ring (`ours`), any layout.
- ``ring_attention_pytorch`` - lucidrains' ring-attention-pytorch (`ring_attention_pytorch`).
- ``torch_cp`` - PyTorch's own context-parallel ring (`torch_cp`).
- ``ring_flash_attn:zigzag|basic|stripe|llama3`` - ring-flash-attn (`ring_flash_attn`).
- ``yunchang:ulysses|usp|ring:...`` - yunchang (`yunchang`).

Anything else of the form ``package.module:function`` is a user's implementation, checked
against the contract's signature (`ringcheck.adapters.contract`).
"""

from __future__ import annotations

import importlib

from ..ring.loops import check_sinks_grad
from ..user_code import import_object
from .contract import Impl, check_signature

# name -> the adapter module (relative to this package) whose `load` builds it
BUILTIN = {"ringcheck": ".ours", "ring_attention_pytorch": ".ring_attention_pytorch", "ring_flash_attn":
           ".ring_flash_attn", "yunchang": ".yunchang", "torch_cp": ".torch_cp"}


def load_impl(spec: str, *, layout: str, backend: str = "torch", sinks_grad: str = "partial") -> Impl:
    """Resolve `--impl`: a built-in adapter (`NAME` or `NAME:VARIANT`) or `module:function`.
    `layout`, `backend` and `sinks_grad` configure our own ring (`ringcheck`)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--impl must be a name like 'ringcheck' or 'package.module:function', got {spec!r}")
    check_sinks_grad(sinks_grad)
    head, _, tail = spec.partition(":")
    if head in BUILTIN:
        adapter = importlib.import_module(BUILTIN[head], __package__)
        if head in ("ring_flash_attn", "yunchang"):
            return adapter.load(spec)
        if tail:
            raise ValueError(f"--impl {spec!r}: the built-in adapter {head!r} has no variants; pass --impl {head}")
        if head == "ringcheck":
            return adapter.load(layout=layout, backend=backend, sinks_grad=sinks_grad)
        return adapter.load(layout=layout) if head == "ring_attention_pytorch" else adapter.load()
    if not tail:
        raise ValueError(f"--impl {spec!r} is neither a built-in adapter ({', '.join(BUILTIN)}) nor of the "
                         f"form 'package.module:function'")
    fn = import_object(spec, f"--impl {spec}")
    check_signature(fn, spec)
    return Impl(spec, fn)
