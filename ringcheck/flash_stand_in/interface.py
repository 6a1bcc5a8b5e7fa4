"""`flash_attn.flash_attn_interface` of the stand-in: flash-attn 2.7's Python API on the CPU.

The signatures are flash-attn 2.7's (what ring-flash-attn 0.1.8 and yunchang 0.6.4 call when
`flash_attn.__version__ >= "2.6.3"`): separate ``window_size_left`` / ``window_size_right``
in the private functions, forwards that return 4 values ``(out, softmax_lse, S_dmask,
rng_state)``, backwards that write into the caller's ``dq``, ``dk``, ``dv`` buffers (views
included) and return ``softmax_d``; the public ``flash_attn_func`` / ``flash_attn_varlen_func``
take ``window_size=(left, right)`` and ``softcap`` and return ``out`` or ``(out, softmax_lse,
S_dmask)`` with ``return_attn_probs=True``. lse is ``(b, h, s)`` float32, and ``(h, total_q)``
for the varlen functions (flash-attn >= 2.4's unpadded lse). The math is `kernel`'s.

Like the real kernels it takes float16 and bfloat16 only (a TypeError for float32): a ring's
float32 path is never run on flash-attn, and judging it here would blame the ring for code no
GPU runs (ring-flash-attn's ``dq = dq_buffer.to(torch.float32)`` aliases its buffer in float32).
`kernel` itself computes any dtype.

Where the stand-in departs from the real kernels (each on purpose):

- dropout and ALiBi raise a ValueError (exact attention only);
- rows of a varlen call outside every sequence, which the real kernels leave uninitialised
  (``torch.empty``), are NaN in out and lse unless ``zero_tensors=True`` (then 0 and -inf):
  a ring that reads them is caught instead of reading whatever memory held.
"""

from __future__ import annotations

import itertools

import torch

from ..launch.audit import check_on_device
from . import kernel

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
]


DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn 2's kernels take


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in DTYPES:
        raise TypeError(f"flash-attn stand-in: FlashAttention only supports fp16 and bf16 data type, got {q.dtype} "
                        f"(as the real kernels; validate a flash-attn based ring in float16 or bfloat16)")


def _scale(q: torch.Tensor, softmax_scale) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _rng_state(q: torch.Tensor) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _write(buffer: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`value` rounded once into the caller's buffer (a view is written through), or a new tensor."""
    if buffer is None:
        return value.to(dtype=torch.float32)
    if tuple(buffer.shape) != tuple(value.shape):
        raise ValueError(f"flash-attn stand-in: a gradient buffer has shape {tuple(buffer.shape)}, "
                         f"expected {tuple(value.shape)}")
    buffer.copy_(value)
    return buffer


# ------------------------------------------------------------------------------- dense

def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    out, lse, probs = kernel.forward(q, k, v, scale=_scale(q, softmax_scale), causal=bool(causal),
                                     window=(window_size_left, window_size_right), softcap=softcap)
    return out, lse, (probs.to(q.dtype) if return_softmax else None), _rng_state(q)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    gq, gk, gv, softmax_d = kernel.backward(dout, q, k, v, out, softmax_lse, scale=_scale(q, softmax_scale),
                                            causal=bool(causal), window=(window_size_left, window_size_right),
                                            softcap=softcap)
    _write(dq, gq.to(q.dtype)), _write(dk, gk.to(k.dtype)), _write(dv, gv.to(v.dtype))
    return softmax_d


# ------------------------------------------------------------------------------ varlen

def _sequences(cu_q, cu_k, max_q: int, max_k: int, total_q: int, total_k: int):
    """(q slice, k slice) of each sequence; the rules flash-attn's varlen kernels rely on."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"flash-attn stand-in: {name} must be a 1-d int32 tensor, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"flash-attn stand-in: cu_seqlens_q has {len(cu_q)} entries, cu_seqlens_k {len(cu_k)}")
    # the real kernels take the boundaries on q's device only (flash_api.cpp: CHECK_DEVICE(cu_seqlens_q)); read
    # with .tolist() here, a host tensor never meets the rank's: under the device audit it is judged here
    check_on_device({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, by="flash-attn's varlen kernel")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for name, cu, total, most in (("q", cq, total_q, max_q), ("k", ck, total_k, max_k)):
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        if cu[0] != 0 or min(lengths, default=0) < 0 or cu[-1] > total:
            raise ValueError(f"flash-attn stand-in: cu_seqlens_{name}={cu} must start at 0, never decrease and end "
                             f"within the {total} tokens given")
        if max(lengths, default=0) > most:
            raise ValueError(f"flash-attn stand-in: a sequence of length {max(lengths)} is longer than "
                             f"max_seqlen_{name}={most} (the real kernel would skip its tail rows)")
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise ValueError("flash-attn stand-in: block_table, leftpad_k and seqused_k are not supported")
    if return_softmax:
        raise ValueError("flash-attn stand-in: return_softmax is not supported by the varlen functions")
    fill_out, fill_lse = (0.0, float("-inf")) if zero_tensors else (float("nan"), float("nan"))
    out = torch.full_like(q, fill_out)
    lse = torch.full((q.shape[1], q.shape[0]), fill_lse, dtype=torch.float32, device=q.device)
    scale = _scale(q, softmax_scale)
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0]):
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # a sequence with no keys: every row is empty
            out[rows], lse[:, rows] = 0.0, float("inf")
            continue
        o, s_lse, _ = kernel.forward(q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0),
                                     scale=scale, causal=bool(causal), window=(window_size_left, window_size_right),
                                     softcap=softcap)
        out[rows], lse[:, rows] = o[0], s_lse[0]
    return out, lse, None, _rng_state(q)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if zero_tensors:
        dq.zero_(), dk.zero_(), dv.zero_()
    softmax_d = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    scale = _scale(q, softmax_scale)
    for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0]):
        if rows.stop == rows.start or keys.stop == keys.start:
            dq[rows], dk[keys], dv[keys] = 0.0, 0.0, 0.0
            continue
        gq, gk, gv, d = kernel.backward(dout[rows].unsqueeze(0), q[rows].unsqueeze(0), k[keys].unsqueeze(0),
                                        v[keys].unsqueeze(0), out[rows].unsqueeze(0),
                                        softmax_lse[:, rows].unsqueeze(0), scale=scale, causal=bool(causal),
                                        window=(window_size_left, window_size_right), softcap=softcap)
        dq[rows], dk[keys], dv[keys] = gq[0].to(dq.dtype), gk[0].to(dk.dtype), gv[0].to(dv.dtype)
        softmax_d[:, rows] = d[0]
    return softmax_d


# ------------------------------------------------------------------------------ public

class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size, softcap):
        out, lse, _ = kernel.forward(q, k, v, scale=softmax_scale, causal=causal, window=window_size,
                                     softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, window_size, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, window, softcap = ctx.args
        gq, gk, gv, _ = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal, window=window,
                                        softcap=softcap)
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    out, lse = _FlashAttnFunc.apply(q, k, v, _scale(q, softmax_scale), bool(causal), tuple(window_size), softcap)
    return (out, lse, None) if return_attn_probs else out


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap):
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, softmax_scale, causal,
                                                    window_size[0], window_size[1], softcap)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, softmax_scale, causal, window_size, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, window, softcap = ctx.args
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale,
                                    causal, window[0], window[1], softcap, None, False)
        return dq, dk, dv, *([None] * 8)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _check_dtype(q)
    kernel.check_unsupported(dropout_p, alibi_slopes)
    if block_table is not None:
        raise ValueError("flash-attn stand-in: block_table is not supported")
    out, lse = _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                          _scale(q, softmax_scale), bool(causal), tuple(window_size), softcap)
    return (out, lse, None) if return_attn_probs else out
