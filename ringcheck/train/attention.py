"""Single-device attention for the reference and noise runs, and the ring's attention on a rank.

Three single-device kernels, each with every variant the model trains with (documents and
padding, a sliding window, a softcap, learnable sinks) on the whole sequence:

- ``exact``: float64 attention (`ringcheck.reference.dense.dense_attention`, differentiated by autograd
  in float64) rounded once to the training dtype, forward and backward: the attention a
  kernel without any rounding of its own would deliver. The reference uses it.
- ``fused``: `torch.nn.functional.scaled_dot_product_attention` in the training dtype (on CPU
  its flash kernel: blockwise online softmax, float32 accumulation), what a model is trained
  with on one device; sinks join as one more key of value 0 with the sink as a float32 bias.
  No softcap (SDPA has none): a run with --softcap takes ``naive`` instead.
- ``naive``: every matmul and the softmax in the training dtype
  (`ringcheck.reference.dense.peer_attention`), eager attention as models were long trained with.

`ring_attend` is the attention of one rank of the ring: its shard through the implementation
under test (`ringcheck.adapters.Impl.call`, only the keywords it accepts), checked against the
contract (`unpack`: shape, dtype; an output without a graph is a contract error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringcheck.reference.dense import attention_mask, dense_attention, peer_attention

from ..adapters import ContractError, Impl, unpack
from .config import TrainConfig
from .model import Attend

KERNELS = ("exact", "fused", "naive")


def _whole(qs, ks, vs):
    """The pieces of a single device joined along the sequence, and how to split outputs back."""
    sizes = [q.shape[1] for q in qs]
    return (torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1),
            lambda out: list(torch.split(out, sizes, dim=1)))


def _variant(config: TrainConfig) -> dict:
    kw = config.attention_kwargs()
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = tuple(int(x) for x in kw["cu_seqlens"].tolist())
    return kw


def exact_kernel(config: TrainConfig, q, k, v, sinks):
    out = dense_attention(q.double(), k.double(), v.double(), causal=True, softmax_scale=config.head_dim ** -0.5,
                          sinks=None if sinks is None else sinks.double(), **_variant(config))
    return out.to(q.dtype)


def naive_kernel(config: TrainConfig, q, k, v, sinks):
    return peer_attention(q, k, v, causal=True, softmax_scale=config.head_dim ** -0.5, sinks=sinks,
                          **_variant(config))


def fused_kernel(config: TrainConfig, q, k, v, sinks):
    """SDPA on (b, heads, n, d). Rows that see no key (padding) see their own key instead
    (SDPA would give NaN) and their output is zeroed: no counted token depends on them."""
    kw = _variant(config)
    n, device = q.shape[1], q.device
    seen = attention_mask(n, causal=True, cu_seqlens=kw.get("cu_seqlens"), window=kw.get("window")).to(device)
    empty = ~seen.any(-1)
    seen = seen | (torch.eye(n, dtype=torch.bool, device=device) & empty[:, None])
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if sinks is None:
        mask = seen
    else:  # one more key (0, value 0) whose logit is the sink: a float32 bias on that column
        b, kvh, _, d = kt.shape
        kt = torch.cat([kt, kt.new_zeros(b, kvh, 1, d)], 2)
        vt = torch.cat([vt, vt.new_zeros(b, kvh, 1, vt.shape[-1])], 2)
        bias = torch.zeros(config.heads, n, n + 1, device=device).masked_fill(
            ~torch.cat([seen, ~empty[:, None]], 1), float("-inf"))
        mask = bias + torch.cat([torch.zeros(config.heads, n, n, device=device),
                                 sinks.float().view(-1, 1, 1).expand(config.heads, n, 1)], 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=config.head_dim ** -0.5,
                                         enable_gqa=config.heads != config.kv_heads).transpose(1, 2)
    return out.masked_fill(empty.view(1, n, 1, 1), 0.0) if bool(empty.any()) else out


_KERNELS = {"exact": exact_kernel, "fused": fused_kernel, "naive": naive_kernel}


def single_device(config: TrainConfig, kernel: str) -> Attend:
    """The attention of a single-device run: `kernel` (`KERNELS`) on the whole sequence."""
    if kernel not in _KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is unknown; choose one of {list(KERNELS)}")
    if kernel == "fused" and config.softcap is not None:
        raise ValueError("the fused kernel (SDPA) has no softcap: take the naive kernel with --softcap")
    fn = _KERNELS[kernel]

    def attend(qs, ks, vs, sinks):
        q, k, v, split = _whole(qs, ks, vs)
        return split(fn(config, q, k, v, sinks))
    return attend


def ring_attend(impl: Impl, config: TrainConfig, group) -> Attend:
    """One rank's attention: its shard through the implementation under test on `group`."""
    variant = config.attention_kwargs()

    def attend(qs, ks, vs, sinks):
        (q,), (k,), (v,) = qs, ks, vs
        kw = {n: (x.to(q.device) if isinstance(x, torch.Tensor) else x) for n, x in variant.items()}
        if sinks is not None:
            kw["sinks"] = sinks
        out, _ = unpack(impl.call(q, k, v, causal=True, softmax_scale=config.head_dim ** -0.5, group=group,
                                  layout=config.layout, **kw), q, v, impl.name)
        if not out.requires_grad:
            raise ContractError(f"--impl {impl.name} returned an out with no autograd graph, so no gradient can "
                                f"reach the model's q, k, v projections; train needs a ring with a backward")
        return [out]
    return attend
