"""Triton forward kernel of one ring block: out and lse of q against one K/V chunk.

Laid out like Triton's fused-attention tutorial (`python/tutorials/06-fused-attention.py`):
small helpers, the inner loop over K/V tiles, the kernel, then the launcher.

Numerics (the contract of `ringcheck.ring.backends`):

- scores are scaled once into log2 units (`qk_scale = scale / ln 2`) so the softmax uses
  `exp2`; the lse leaves the kernel in natural-log units, float32;
- with ``SOFTCAP`` (a `constexpr`; the cap itself is the runtime float ``softcap``) the score is
  ``softcap * tanh(scale q.k / softcap)``, capped before masking; tanh is built from one `exp2`
  of ``-2|x|`` (`tile_tanh`: never overflows, saturates to +-1);
- online softmax over K/V tiles with a float32 running max `m_i`, sum `l_i` and output
  `acc`; a row that sees no key keeps `m_i = -inf` and `l_i = 0` and ends with out 0 and
  lse -inf, never NaN (every `exp2` is taken against a max that is made finite first);
- every `tl.dot` accumulates in float32. With `DOT_FP32` its operands are upcast to float32
  first (and multiplied in IEEE float32, never TF32): exact for float32/bf16/fp16 inputs, and
  required under Triton's interpreter, whose bf16 `tl.dot` is wrong by orders of magnitude.
  Without it (the GPU default for bf16/fp16) the operands stay in the input dtype for the
  tensor cores, and the probabilities are rounded to that dtype before `P @ V`, as in
  flash-attention.

Masks are `constexpr` flags of one kernel, never copies. ``CAUSAL``: key j is visible to query
i only if ``j - i <= diagonal``; ``BAND``: only if ``j - i >= lower`` (``diagonal`` and ``lower``
are runtime ints; the contract's "causal" sets CAUSAL, its "band" both, a bound that no row
reaches neither). `key_tiles` splits the K/V tiles of a query tile into those no row sees
(skipped: a narrow band costs O(rows x band), not O(rows x keys)), those every row sees whole
(no mask) and the rest, which are masked (``MASKED`` of the inner loop). Ragged shapes are
masked, not padded in memory: rows past ``sq``, keys past ``sk`` and head-dim columns past
``HEAD_DIM`` (q, k) or ``HEAD_DIM_V`` (v, out; MLA's value head dim may differ) are loaded as 0
and never stored; the tiles are ``HEAD_DIM_PAD`` and ``HEAD_DIM_V_PAD`` wide, the next powers
of two >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# helpers (shared with triton_bwd.py)
# ---------------------------------------------------------------------------------------------

@triton.jit
def tile_mm(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in float32. The left operand (a float32 intermediate such as the
    probabilities, or an input tile) is rounded to b's dtype unless DOT_FP32 upcasts both."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        tl.static_assert(b.dtype != tl.float32, "float32 operands need DOT_FP32 (else tl.dot rounds them to TF32)")
        return tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)


@triton.jit
def load_tile(base, offs_s, offs_d, stride_s, stride_d, s_len, HEAD_DIM: tl.constexpr):
    """The (len(offs_s), len(offs_d)) tile at base[offs_s, offs_d]; 0 outside s_len x HEAD_DIM."""
    mask = (offs_s[:, None] < s_len) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + tile_offsets(offs_s, offs_d, stride_s, stride_d), mask=mask, other=0.0)


@triton.jit
def tile_offsets(offs_s, offs_d, stride_s, stride_d):
    """The element offsets of the tile [offs_s, offs_d] in int64: in int32 a long shard's row
    offset (s - 1) x stride_s (heads x head_dim for a contiguous (b, s, h, d) tensor, more for
    fused QKV views) passes 2^31 and wraps to a wrong address."""
    return offs_s[:, None].to(tl.int64) * stride_s + offs_d[None, :].to(tl.int64) * stride_d


@triton.jit
def tile_tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow."""
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # 2 / ln 2
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _scores(q, kT, sm_scale, softcap, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    """The scores q @ kT in log2 units: scale q.k, or softcap tanh(scale q.k / softcap)."""
    qk = tile_mm(q, kT, DOT_FP32)
    if SOFTCAP:
        return tile_tanh(qk * (sm_scale / softcap)) * (softcap * 1.4426950408889634)
    else:
        return qk * (sm_scale * 1.4426950408889634)


@triton.jit
def tile_visible(rows, cols, sq, sk, diagonal, lower,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, BAND: tl.constexpr):
    """Query `rows` sees key `cols` (2-D index tensors that broadcast, e.g. offs_m[:, None] and
    offs_n[None, :]): both in bounds and, if MASKED, lower <= j - i <= diagonal where it applies."""
    visible = (rows < sq) & (cols < sk)
    if MASKED:
        if CAUSAL:
            visible = visible & (cols <= rows + diagonal)
        if BAND:
            visible = visible & (cols >= rows + lower)
    return visible


@triton.jit
def key_tiles(m0, sk, diagonal, lower, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, BAND: tl.constexpr):
    """For the query tile [m0, m0 + BLOCK_M): keys in [lo, hi) are all some row sees (tiles
    from lo, which is tile-aligned); the tiles in [full_lo, full_hi) are seen whole by every
    row (no mask), those in [lo, full_lo) and [full_hi, hi) need the mask."""
    lo = 0
    hi = sk
    full_lo = 0
    full_hi = sk
    if CAUSAL:
        # the last row sees j <= m0 + BLOCK_M - 1 + diagonal; the first one every key up to m0 + diagonal
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + diagonal, 0), sk)
        full_hi = tl.maximum(m0 + diagonal + 1, 0) // BLOCK_N * BLOCK_N
    if BAND:
        # the first row sees j >= m0 + lower; the last one every key from m0 + BLOCK_M - 1 + lower on
        lo = tl.maximum(m0 + lower, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + lower, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


# ---------------------------------------------------------------------------------------------
# the inner loop: one query tile against the K/V tiles [lo, hi)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                    offs_m, offs_d, offs_dv, lo, hi, sq, sk, diagonal, lower, sm_scale, softcap,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BAND: tl.constexpr,
                    SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(K, offs_n, offs_d, stride_ks, stride_kd, sk, HEAD_DIM)
        qk = _scores(q, tl.trans(k), sm_scale, softcap, SOFTCAP, DOT_FP32)  # (BLOCK_M, BLOCK_N), log2 units
        visible = tile_visible(offs_m[:, None], offs_n[None, :], sq, sk, diagonal, lower, MASKED, CAUSAL, BAND)
        qk = tl.where(visible, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        # a row that has seen no key yet keeps m = -inf; exponents are taken against 0 then,
        # so exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(V, offs_n, offs_dv, stride_vs, stride_vd, sk, HEAD_DIM_V)
        acc = acc * alpha[:, None] + tile_mm(p, v, DOT_FP32)
        m_i = m_ij
    return acc, l_i, m_i


# ---------------------------------------------------------------------------------------------
# the kernel: one program per (query tile, batch x head)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, sm_scale, softcap, diagonal, lower,
              stride_qb, stride_qs, stride_qh, stride_qd,
              stride_kb, stride_ks, stride_kh, stride_kd,
              stride_vb, stride_vs, stride_vh, stride_vd,
              stride_ob, stride_os, stride_oh, stride_od,
              stride_lb, stride_lh, stride_ls,
              heads, group, sq, sk,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, BAND: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD and HEAD_DIM_V <= HEAD_DIM_V_PAD)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // heads).to(tl.int64)
    off_h = off_bh % heads
    off_kvh = (off_h // group).to(tl.int64)  # grouped-query attention: K/V head of this query head
    off_h = off_h.to(tl.int64)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_kvh * stride_kh
    V += off_b * stride_vb + off_kvh * stride_vh
    Out += off_b * stride_ob + off_h * stride_oh
    Lse += off_b * stride_lb + off_h * stride_lh

    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    q = load_tile(Q, offs_m, offs_d, stride_qs, stride_qd, sq, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tiles(m0, sk, diagonal, lower, BLOCK_M, BLOCK_N, CAUSAL, BAND)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                    offs_m, offs_d, offs_dv, full_lo, full_hi, sq, sk, diagonal, lower,
                                    sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                                    False, CAUSAL, BAND, SOFTCAP, DOT_FP32)
    if CAUSAL or BAND:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                        offs_m, offs_d, offs_dv, lo, full_lo, sq, sk, diagonal, lower,
                                        sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                                        True, CAUSAL, BAND, SOFTCAP, DOT_FP32)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_kd, stride_vs, stride_vd,
                                        offs_m, offs_d, offs_dv, full_hi, hi, sq, sk, diagonal, lower,
                                        sm_scale, softcap, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                                        True, CAUSAL, BAND, SOFTCAP, DOT_FP32)

    # a row that saw no key has l_i = 0: out 0, lse -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # ln(2): back to natural log
    m_ok = offs_m < sq
    tl.store(Out + tile_offsets(offs_m, offs_dv, stride_os, stride_od), out,
             mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(Lse + offs_m.to(tl.int64) * stride_ls, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------

def is_interpreted() -> bool:
    """True when these kernels run under Triton's interpreter: `@triton.jit` chose the
    interpreter because TRITON_INTERPRET=1 was set when this module was imported."""
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


def head_dim_pad(head_dim: int) -> int:
    """The tile width along the head dimension: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim_padded: int, dot_fp32: bool) -> dict:
    """Tile sizes and launch options (`head_dim_padded`: the wider of the q/k and v tiles). The
    interpreter runs every program in Python, so it gets the smallest tiles tl.dot allows
    (small test shapes still span several tiles and reach every masking path). On the GPU: the
    tutorial's tiles for tensor-core dots, kept within shared memory up to head dim 256; smaller
    ones for IEEE float32 dots, which run on the FMA units (big tiles only cost registers and
    compile time there)."""
    if is_interpreted():
        return dict(BLOCK_M=16, BLOCK_N=16)
    if dot_fp32:
        if head_dim_padded <= 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim_padded <= 64:  # these two: no register spills at sm_90 (cuobjdump -res-usage)
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim_padded <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def head_dims(q: torch.Tensor, v: torch.Tensor) -> dict:
    """The head-dim constexprs of a block: q/k's and v's, each with its padded tile width."""
    d, dv = q.shape[-1], v.shape[-1]
    return {"HEAD_DIM": d, "HEAD_DIM_PAD": head_dim_pad(d), "HEAD_DIM_V": dv, "HEAD_DIM_V_PAD": head_dim_pad(dv)}


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      causal: bool, band: bool, diagonal: int, lower: int, softcap: float | None,
                      dot_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out (b, sq, h, dv) and lse (b, h, sq), float32, of one block; inputs already validated
    (q (b, sq, h, d), k (b, sk, kv_heads, d), v (b, sk, kv_heads, dv), one dtype, one device).
    `causal`/`band`: whether the bound `j - i <= diagonal` / `j - i >= lower` applies (int32
    values); `softcap`: None or the cap."""
    b, sq, h, _ = q.shape
    sk, kvh, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((b, sq, h, dv), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if min(b, sq, h) == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    dims = head_dims(q, v)
    config = fwd_config(max(dims["HEAD_DIM_PAD"], dims["HEAD_DIM_V_PAD"]), dot_fp32)
    grid = (triton.cdiv(sq, config["BLOCK_M"]), b * h)
    _attn_fwd[grid](
        q, k, v, out, lse, float(scale), 1.0 if softcap is None else float(softcap), int(diagonal), int(lower),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        h, h // kvh, sq, sk, **dims,
        CAUSAL=bool(causal), BAND=bool(band), SOFTCAP=softcap is not None, DOT_FP32=bool(dot_fp32), **config)
    return out, lse
