"""The `--impl` contract: what every implementation under test is called with and must return.

    fn(q, k, v, *, causal: bool, softmax_scale: float, group) -> out  or  (out, lse)

q is this rank's shard (batch, local_seq, heads, head_dim); k and v are (batch, local_seq,
kv_heads, head_dim), laid out as `--layout` says; out has q's shape (with v's head dim) and
dtype; lse, if returned, is (batch, heads, local_seq) float32; gradients flow to q, k and v.
`group` is the ring's process group: inside a mesh one sub-group of the world (offset or
strided global ranks), so every collective and every peer must be taken from it.

Optional keywords (`OPTIONAL_KEYWORDS`): an implementation whose signature names ``layout``
(or takes ``**kwargs``) is also given ``layout=`` (the layout of the shards it receives), so
one function can serve every layout; one that does not is called without it. The variant
keywords (``cu_seqlens``, ``window``, ``softcap``, ``sinks``) go the same way (`Impl.call`):
passed only where the signature accepts them. With sinks, each rank's ``sinks.grad`` follows a
declared convention (``--sinks-grad``): ``partial`` (its own rows' share; the framework sums it
over the group, as Megatron-LM and torchtitan do) or ``reduced`` (the whole sequence's on
every rank: the ring all-reduces it).

q, k, v and the gradient arriving at out may be views (of a fused QKV projection, k and v of
different strides, a transposed dout): an implementation must read them by their strides.
A breach of the contract is a `ContractError` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ring.loops import SINKS_GRAD  # noqa: F401 - the conventions of a replicated parameter's gradient

ImplFn = Callable[..., Any]

# keywords an implementation is given only when its signature accepts them (by name, or
# through **kwargs): the shards' layout; the variant keywords of a target join this list
OPTIONAL_KEYWORDS = ("layout",)


class ContractError(ValueError):
    """The implementation broke the --impl contract (shape, dtype, gradients): a usage error."""


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
    # None: it runs on whatever group it is given, inside a mesh too; else why it rings over the
    # whole world only (its own rule: it is then run alone, and validate says so in a row)
    world_only: str | None = None

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


def refuse_value_head_dim(name: str, kernel: str, target) -> None:
    """ValueError when `target` gives v a head dim of its own and `kernel` (what the
    implementation runs on, and why that cannot) has one head size for q, k and v."""
    spec = target.full_spec()
    if spec.v_head_dim not in (None, spec.head_dim):
        raise ValueError(f"--impl {name} runs on {kernel} (v's head dim {spec.v_head_dim} != q's {spec.head_dim}); "
                         f"drop --head-dim-v")


def check_signature(fn: ImplFn, name: str) -> None:
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



def unpack(result: Any, q: torch.Tensor, v: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse or None) of what the implementation returned, checked against the contract."""
    if isinstance(result, torch.Tensor):
        out, lse = result, None
    elif isinstance(result, (tuple, list)) and len(result) >= 1 and isinstance(result[0], torch.Tensor):
        out = result[0]
        lse = result[1] if len(result) > 1 and isinstance(result[1], torch.Tensor) else None
    else:
        raise ContractError(f"--impl {name} returned {type(result).__name__}; the contract is out or (out, lse) "
                            f"tensors")
    want_out = (*q.shape[:3], v.shape[3])
    if tuple(out.shape) != want_out or out.dtype != q.dtype:
        raise ContractError(f"--impl {name} returned out of shape {tuple(out.shape)} and dtype {out.dtype}; the "
                            f"contract is q's shape with v's head dim {want_out} and dtype {q.dtype}")
    if lse is not None:
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ContractError(f"--impl {name} returned lse of shape {tuple(lse.shape)}; the contract is "
                                f"(batch, heads, local_seq) = {want}, float32")
        lse = lse.float()
    return out, lse
