"""Exact integer arithmetic for `ringcheck.reference.mp`: float arrays <-> 16-bit limbs <-> Python
integers, exact matrix products on float64 BLAS, fixed-point exponentials and ratios."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from mpmath import libmp

_LIMB = 1 << 16  # limb base: |limb| < 2^16
_K_CHUNK = 1 << 16  # contraction length per BLAS call: 2^16 * (2^16 - 1)^2 < 2^48 < 2^53
NEG_INF = float("-inf")
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------
# exact integers: float arrays <-> 16-bit limbs <-> Python integers


@dataclass(frozen=True)
class _Grid:
    """A float64 array is exactly (integer array) * 2^e, with integers of < 16 * limbs bits."""

    e: int
    limbs: int


def grid(x: np.ndarray) -> _Grid:
    lo, hi = None, None  # lowest set bit and top exponent over the nonzero values
    flat = x.reshape(-1)
    for i in range(0, flat.size, 1 << 20):  # chunks bound the temporaries
        a = np.abs(flat[i:i + (1 << 20)])
        a = a[a != 0]
        if a.size == 0:
            continue
        m, ex = np.frexp(a)  # a = m 2^ex, m in [0.5, 1)
        man = np.ldexp(m, 53).astype(np.int64)  # a = man 2^(ex - 53), man an integer < 2^53
        tz = np.frexp((man & -man).astype(np.float64))[1] - 1  # trailing zero bits of man
        c_lo, c_hi = int((ex - 53 + tz).min()), int(ex.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    if lo is None:
        return _Grid(0, 1)
    return _Grid(lo, max(1, -(-(hi - lo) // 16)))


def float_limbs(x: np.ndarray, g: _Grid) -> np.ndarray:
    """Limbs (..., g.limbs) with x = sum_l limbs[..., l] 2^(16 l) 2^g.e exactly; each limb is an
    integer in float64 carrying x's sign. Vectorized; every step below is exact."""
    m, ex = np.frexp(np.abs(x))
    man = np.ldexp(m, 53)  # integer-valued float64 < 2^53
    shift = ex - 53 - g.e  # |x| 2^-e = man 2^shift, an integer
    limbs = np.empty(x.shape + (g.limbs,))
    for i in range(g.limbs):
        s = shift - 16 * i
        # bits [16i, 16i + 16) of man << shift: zero when s >= 16 (below man's lowest bit,
        # which the grid puts at or above bit 0) or s < -53 (above man's highest bit)
        part = np.fmod(np.floor(np.ldexp(man, np.clip(s, -53, 15))), _LIMB)
        limbs[..., i] = np.where((s < 16) & (s >= -53), part, 0.0)
    return limbs * np.sign(x)[..., None]


def int_limbs(a: np.ndarray) -> np.ndarray:
    """Limbs (..., n) of an object array of Python (or gmpy2) integers."""
    flat = a.ravel().tolist()
    bits = max((abs(v).bit_length() for v in flat), default=0)
    n = max(1, -(-bits // 16))
    nb = 2 * n
    buf = b"".join([abs(v).to_bytes(nb, "little") for v in flat])
    mag = np.frombuffer(buf, dtype="<u2").reshape(len(flat), n).astype(np.float64)
    neg = np.fromiter((v < 0 for v in flat), dtype=bool, count=len(flat))
    mag[neg] *= -1.0
    return mag.reshape(a.shape + (n,))


def _from_digits(digits: np.ndarray) -> np.ndarray:
    """Python integers sum_s digits[s] 2^(16 s) from int64 digit planes of any sign."""
    planes = digits.shape[0]
    flat = digits.reshape(planes, -1)
    n = flat.shape[1]
    low = np.empty((n, planes), np.uint16)
    carry = np.zeros(n, np.int64)
    for s in range(planes):  # carries, vectorized over elements
        x = flat[s] + carry
        low[:, s] = x & 0xFFFF
        carry = x >> 16
    buf = memoryview(low.astype("<u2", copy=False).tobytes())
    nb, top = 2 * planes, 16 * planes
    vals = [int.from_bytes(buf[i * nb:(i + 1) * nb], "little") for i in range(n)]
    for i in np.flatnonzero(carry).tolist():  # negative (or, in principle, large) values
        vals[i] += int(carry[i]) << top
    out = np.empty(n, dtype=object)
    out[:] = vals
    return out.reshape(digits.shape[1:])


def limbs_to_ints(limbs: np.ndarray) -> np.ndarray:
    return _from_digits(np.moveaxis(limbs, -1, 0).astype(np.int64))


def imatmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact integer matrix product of limb arrays a (m, k, La) and b (k, n, Lb): an (m, n)
    object array of Python integers.

    One float64 matmul per chunk of k gives every limb pair at once; all its entries are
    integers below k * (2^16 - 1)^2 < 2^48 < 2^53, so BLAS computes them exactly in any
    summation order. Pairs of equal weight 2^(16 (i + j)) are summed in int64 and the planes
    reassembled by `_from_digits`.
    """
    m, k, la = a.shape
    k2, n, lb = b.shape
    if k != k2:
        raise RuntimeError(f"internal: contraction lengths differ ({k} vs {k2})")
    total = None
    per_flush = max(1, (1 << 14) // min(la, lb))  # int64 planes hold < 2^62
    digits = np.zeros((la + lb - 1, m, n), np.int64)
    pending = 0
    for k0 in range(0, k, _K_CHUNK):
        aa = np.ascontiguousarray(a[:, k0:k0 + _K_CHUNK].transpose(2, 0, 1)).reshape(la * m, -1)
        bb = np.ascontiguousarray(b[k0:k0 + _K_CHUNK].transpose(0, 2, 1)).reshape(-1, lb * n)
        c = torch.from_numpy(aa).matmul(torch.from_numpy(bb)).numpy().reshape(la, m, lb, n).astype(np.int64)
        for i in range(la):
            digits[i:i + lb] += c[i].transpose(1, 0, 2)
        pending += 1
        if pending == per_flush:
            part = _from_digits(digits)
            total = part if total is None else total + part
            digits[:] = 0
            pending = 0
    if pending or total is None:
        part = _from_digits(digits)
        total = part if total is None else total + part
    return total


def dyadic(x: float) -> tuple[int, int]:
    """x = man * 2^exp exactly."""
    if x == 0:
        return 0, 0
    m, e = math.frexp(x)
    return int(math.ldexp(m, 53)), e - 53


def log2add(a, b):
    """log2(2^a + 2^b), elementwise; -inf stands for 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    with np.errstate(invalid="ignore"):
        r = np.where(hi == NEG_INF, NEG_INF, hi + np.log2(1.0 + np.exp2(lo - hi)))
    return float(r) if r.ndim == 0 else r


def acc_add(acc, x):
    return x if acc is None else acc + x


def cat_limbs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(a.shape[-1], b.shape[-1])
    return np.concatenate([np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])]) for x in (a, b)], axis=1)


def exp_fixed(s: np.ndarray, m: np.ndarray, vis, ex: int, F: int):
    """E = round(exp((s - m) 2^ex) 2^F) per entry (0 where not visible; s - m <= 0 is exact),
    and per row whether any E is inexact (anything but the maximum's exact 2^F)."""
    wp = F + 10
    # exp(x) < 2^-(F+2) rounds to 0 below this cut: skip the call (the cut is rounded down)
    cut = -(math.ceil((F + 2) * _LN2 * (1 << 40)) << max(0, -ex - 40)) >> max(0, ex + 40)
    vrows = vis.tolist() if vis is not None else None
    one = 1 << F
    mpf_exp, from_man_exp, to_fixed = libmp.mpf_exp, libmp.from_man_exp, libmp.to_fixed
    flat, inexact = [], []
    for i, (row, mi) in enumerate(zip(s.tolist(), m.tolist())):
        if mi == NEG_INF:
            flat.extend([0] * len(row))
            inexact.append(False)
            continue
        vr = vrows[i] if vrows is not None else None
        before = len(flat)
        exact = 0
        for j, sj in enumerate(row):
            if vr is not None and not vr[j]:
                flat.append(0)
                exact += 1
                continue
            y = sj - mi
            if not y:
                flat.append(one)
                exact += 1
            elif y < cut:
                flat.append(0)
            else:
                flat.append((to_fixed(mpf_exp(from_man_exp(y, ex), wp), F + 1) + 1) >> 1)
        inexact.append(exact < len(flat) - before)
    arr = np.empty(len(flat), dtype=object)
    arr[:] = flat
    return arr.reshape(s.shape), np.array(inexact, dtype=bool)


def round_ratio(num: np.ndarray, den: np.ndarray, F: int):
    """(W, T, inexact): integers W = round(num / den * 2^T) (halves up), T chosen so that the
    largest |W| is about 2^F; (None, 0, False) if every num is 0. den (R, 1) is positive."""
    nonzero = np.array([any(row) for row in num.tolist()], dtype=bool)
    if not nonzero.any():
        return None, 0, False
    top = _bit_length(num).max(axis=1) - _bit_length(den[:, 0])  # |num / den| < 2^(top + 1)
    T = F - int(top[nonzero].max())
    if T >= 0:
        n, dd = num * (1 << T), den
    else:
        n, dd = num, den * (1 << -T)
    return (2 * n + dd) // (2 * dd), T, bool((n % dd).any())


_bit_length = np.frompyfunc(lambda x: x.bit_length(), 1, 1)


def accumulate_exact(store: dict, j0: int, ints: np.ndarray, e: int) -> None:
    """store[j0] += ints * 2^e, exactly (aligning to the smaller exponent)."""
    if j0 not in store:
        store[j0] = (ints, e)
        return
    old, eo = store[j0]
    if e < eo:
        store[j0] = (old * (1 << (eo - e)) + ints, e)
    else:
        store[j0] = (old + ints * (1 << (e - eo)), eo)


def mpf_array(values: list, shape) -> np.ndarray:
    """An object array of mpf tuples (filled one by one: numpy would unpack the tuples)."""
    arr = np.empty(len(values), dtype=object)
    for i, x in enumerate(values):
        arr[i] = x
    return arr.reshape(shape)


def result_bits(precisions) -> int:
    """Bits of the mpf values a rational result is rounded to: well above the highest p."""
    return max(precisions) + 32


