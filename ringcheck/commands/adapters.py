"""Implementations under test: load `package.module:function`, or a built-in adapter by name.

The contract every implementation keeps (what `ringcheck validate --impl` calls on each rank):

    fn(q, k, v, *, causal: bool, softmax_scale: float, group) -> out  or  (out, lse)

q is this rank's shard (batch, local_seq, heads, head_dim); k and v are (batch, local_seq,
kv_heads, head_dim), laid out as `--layout` says; out has q's shape and dtype; lse, if
returned, is (batch, heads, local_seq) float32; gradients flow to q, k and v.

Optional keywords (`OPTIONAL_KEYWORDS`): an implementation whose signature names ``layout``
(or takes ``**kwargs``) is also given ``layout=`` ("contiguous", "zigzag" or "striped", the
layout of the shards it receives), so one function can serve every layout; one that does not
is called without it. Variant keywords a target may add later go the same way (`Impl.call`):
passed only where the signature accepts them.

Built-in adapters (`--impl NAME` or `--impl NAME:VARIANT`):

- ``ringcheck`` - our ring (`ringcheck.ring_attention`), any layout.
- ``ring_attention_pytorch`` - lucidrains' ring-attention-pytorch `ring_flash_attn`
  (pure PyTorch, CPU and GPU); layouts contiguous and striped.
- ``ring_flash_attn:zigzag|basic|stripe|llama3`` and ``yunchang:ulysses|usp|ring:...`` - rings
  built on flash-attn (`ringcheck.commands.peer_adapters`; on CPU through the flash-attn stand-in).
- ``torch_cp`` - PyTorch's own context-parallel ring (the private
  `_templated_ring_attention`, with the CPU flash kernels on CPU); layouts contiguous
  (bidirectional, and causal without load balancing) and zigzag (causal, its head-tail load
  balancing).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import ring_attention
from ..user_code import import_object

ImplFn = Callable[..., Any]

# keywords an implementation is given only when its signature accepts them (by name, or
# through **kwargs): the shards' layout; the variant keywords of a target join this list
OPTIONAL_KEYWORDS = ("layout",)


def accepted_keywords(fn: ImplFn, names) -> tuple[str, ...]:
    """Of `names`, those `fn` takes as keyword arguments: named in its signature (keyword-only
    or positional-or-keyword), or all of them when it takes **kwargs; none when its signature
    cannot be read (a builtin)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return tuple(names)
    return tuple(n for n in names if n in params and params[n].kind in (params[n].KEYWORD_ONLY,
                                                                        params[n].POSITIONAL_OR_KEYWORD))


# the contract's variant keywords, and the flag that asks for each
VARIANT_FLAGS = {"cu_seqlens": "--documents", "window": "--window", "softcap": "--softcap", "sinks": "--sinks"}


def require_variant_keywords(fn: ImplFn, name: str, spec) -> None:
    """ValueError naming each variant keyword the `AttentionSpec` `spec` passes (documents, a
    window, a softcap, sinks) that `fn` does not accept (nor **kwargs), and the flag that asked
    for it: before any rank starts, so no variant is judged that was never given."""
    needed = [*spec.variant_kwargs(), *(["sinks"] if spec.sinks is not None else [])]
    missing = [k for k in needed if k not in accepted_keywords(fn, needed)]
    if missing:
        said = ", ".join(f"{k} (asked for by {VARIANT_FLAGS[k]})" for k in missing)
        raise ValueError(f"--impl {name} does not accept the variant keyword(s) {said}: add them to its signature "
                         f"(fn(q, k, v, *, causal, softmax_scale, group, {', '.join(missing)}=None, ...)) or drop "
                         f"the flag(s)")


@dataclass(frozen=True)
class Impl:
    """A loaded implementation: the callable plus what it can run."""

    name: str
    fn: ImplFn
    layouts: tuple[str, ...] | None = None   # None: whatever layout it is given
    # extra rule of the implementation: (layout, causal) -> raises ValueError if it cannot run them
    rule: Callable[[str, bool], None] | None = None
    # the whole target (a `ringcheck.commands.validate.Target`) -> ValueError if it cannot run it
    # (variants, heads): called before any rank starts
    check_target: Callable[[Any], None] | None = None
    dtypes: tuple[str, ...] | None = None   # the input dtypes it runs (None: every one)

    def check_layout(self, layout: str, causal: bool) -> None:
        if self.layouts is not None and layout not in self.layouts:
            raise ValueError(f"--impl {self.name} runs the layouts {list(self.layouts)}, not {layout!r}; "
                             f"pass --layout {self.layouts[0]}")
        if self.rule is not None:
            self.rule(layout, causal)

    def call(self, q, k, v, *, causal: bool, softmax_scale: float | None, group, **optional: Any) -> Any:
        """`fn` under the contract: q, k, v, causal, softmax_scale and group always; each of
        `optional` (layout=, variant keywords) only when `fn` accepts it (`accepted_keywords`)."""
        extra = {name: optional[name] for name in accepted_keywords(self.fn, optional)}
        return self.fn(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, **extra)


# ------------------------------------------------------------------------------------ ours

def _ours(layout: str, backend: str) -> ImplFn:
    def ringcheck_ring(q, k, v, *, causal, softmax_scale, group=None, cu_seqlens=None, window=None, softcap=None,
                       sinks=None):
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                              layout=layout, backend=backend, return_lse=True, cu_seqlens=cu_seqlens,
                              window=window, softcap=softcap, sinks=sinks)
    return ringcheck_ring


# ------------------------------------------------------------------ ring-attention-pytorch

def _ring_attention_pytorch(layout: str) -> ImplFn:
    try:
        # optional dependency: the peer ring
        from ring_attention_pytorch import ring_flash_attn
    except ImportError as exc:
        raise RuntimeError("--impl ring_attention_pytorch needs the package: "
                           "pip install ring-attention-pytorch==0.5.20") from exc

    def ring_attention_pytorch(q, k, v, *, causal, softmax_scale, group=None):
        if group is not None and group != dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("ring_attention_pytorch rings over the default world group only; "
                             "run it with --world-size equal to the torchrun world")
        d, heads, kv_heads = q.shape[-1], q.shape[2], k.shape[2]
        # it always scales by head_dim ** -0.5: fold the requested scale into q
        q = q * (softmax_scale * d ** 0.5) if softmax_scale is not None else q
        # its GQA repeats K/V heads as '(g h)': query head i uses K/V head i % kv_heads; the
        # contract's is h // group. Reorder the query heads so both mean the same, and back.
        group = heads // kv_heads
        order = torch.tensor([j * kv_heads + h // group for h, j in ((h, h % group) for h in range(heads))])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(heads)
        out = ring_flash_attn(q[:, :, inverse], k, v, causal=causal, bucket_size=q.shape[1],
                              ring_reduce_col=True, striped_ring_attn=(layout == "striped"))
        return out[:, :, order]
    return ring_attention_pytorch


# ---------------------------------------------------------------------- PyTorch's own CP

class _TorchCPRing(torch.autograd.Function):
    """PyTorch's `_templated_ring_attention` forward and its backward, on (b, h, n, d)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, balance):
        # optional: torch's private context-parallel API, present only in some torch versions
        from torch.distributed.tensor.experimental._attention import _cp_options
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention,
        )

        old = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = balance
        try:
            out, lse = _templated_ring_attention(
                group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                q, k, v, is_causal=causal, dropout_p=0.0, scale=scale)[:2]
        finally:
            _cp_options.enable_load_balance = old
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.balance = causal, scale, group, balance
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # optional: torch's private context-parallel API, present only in some torch versions
        from torch.distributed.tensor.experimental._attention import _cp_options
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        q, k, v, out, lse = ctx.saved_tensors
        old = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = ctx.balance
        try:
            dq, dk, dv = _templated_ring_attention_backward(
                ctx.group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                logsumexp=lse, is_causal=ctx.causal, dropout_p=0.0, scale=ctx.scale)[:3]
        finally:
            _cp_options.enable_load_balance = old
        return dq, dk, dv, None, None, None, None


def _torch_cp_rule(layout: str, causal: bool) -> None:
    if not causal and layout != "contiguous":
        raise ValueError("--impl torch_cp runs bidirectional attention on contiguous shards: use --layout "
                         "contiguous without --causal (causal runs contiguous, or zigzag with its head-tail "
                         "load balancing)")


def refuse_value_head_dim(name: str, kernel: str, target) -> None:
    """ValueError when `target` gives v a head dim of its own and `kernel` (what the
    implementation runs on, and why that cannot) has one head size for q, k and v."""
    spec = target.full_spec()
    if spec.v_head_dim not in (None, spec.head_dim):
        raise ValueError(f"--impl {name} runs on {kernel} (v's head dim {spec.v_head_dim} != q's {spec.head_dim}); "
                         f"drop --head-dim-v")


def _torch_cp_check(target) -> None:
    refuse_value_head_dim("torch_cp", "PyTorch's CPU flash kernel, which needs q, k and v of one head size", target)


def _torch_cp() -> ImplFn:
    def torch_cp(q, k, v, *, causal, softmax_scale, group=None, layout="zigzag"):
        group = group if group is not None else dist.group.WORLD
        if q.device.type == "cuda":
            raise RuntimeError("--impl torch_cp is wired to the CPU flash kernels; on CUDA use "
                               "torch.distributed.tensor.experimental.context_parallel directly")
        heads, kv_heads = q.shape[2], k.shape[2]
        # (b, n, h, d) -> (b, h, n, d); the CPU flash kernel wants as many K/V heads as q heads
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        # head-tail load balancing on zigzag shards; plain contiguous shards without it
        out, lse = _TorchCPRing.apply(qt, kt, vt, causal, softmax_scale, group, causal and layout == "zigzag")
        return out.transpose(1, 2), lse.float()
    return torch_cp


# --------------------------------------------------------------------------------- loading

BUILTIN = ("ringcheck", "ring_attention_pytorch", "ring_flash_attn", "yunchang", "torch_cp")


def _check_signature(fn: ImplFn, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"--impl {name} is not callable (it is a {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C functions: trust them
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    missing = [kw for kw in ("causal", "softmax_scale", "group") if kw not in params and not has_var_kw]
    if (len(positional) < 3 and not has_var_pos) or missing:
        raise TypeError(
            f"--impl {name} has the signature {name.split(':')[-1]}{sig}; the contract is "
            f"fn(q, k, v, *, causal, softmax_scale, group) -> out or (out, lse)"
            + (f" (missing keyword(s): {', '.join(missing)})" if missing else ""))


def load_impl(spec: str, *, layout: str, backend: str = "torch") -> Impl:
    """Resolve `--impl`: a built-in adapter (`NAME` or `NAME:VARIANT`) or `module:function`."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--impl must be a name like 'ringcheck' or 'package.module:function', got {spec!r}")
    head, _, tail = spec.partition(":")
    if head == "ringcheck" and not tail:
        return Impl("ringcheck", _ours(layout, backend))
    if head == "ring_attention_pytorch" and not tail:
        return Impl(spec, _ring_attention_pytorch(layout), layouts=("contiguous", "striped"))
    if head in ("ring_flash_attn", "yunchang"):
        from .peer_adapters import load_peer  # it imports Impl from this module

        return load_peer(spec)
    if head == "torch_cp" and not tail:
        return Impl("torch_cp", _torch_cp(), layouts=("contiguous", "zigzag"), rule=_torch_cp_rule,
                    check_target=_torch_cp_check)
    if not tail:
        raise ValueError(f"--impl {spec!r} is neither a built-in adapter ({', '.join(BUILTIN)}) nor of the "
                         f"form 'package.module:function'")
    fn = import_object(spec, f"--impl {spec}")
    _check_signature(fn, spec)
    return Impl(spec, fn)
