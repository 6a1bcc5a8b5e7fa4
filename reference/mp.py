"""High-precision attention reference (mpmath), certified by agreement at two precisions.

`mp_attention` computes attention forward (out, lse) and, given ``dout``, backward (dq, dk,
dv) from the *exact* values of the inputs: every bf16/fp16/fp32/fp64 number is an integer
times a power of two, and the result is checked rather than assumed to be precise.

How
    - Exact integer arithmetic wherever the math allows it. Each input slice is an integer
      matrix times one power of two, so every sum of products (q k^T, dO v^T, E v, ...) is an
      integer matrix product. It is computed exactly by float64 BLAS on 16-bit limbs (every
      limb product is < 2^32 and every sum < 2^53, so no rounding can happen; `_imatmul`)
      and reassembled into Python integers. No mpmath number is built per product.
    - Only exp and log need a working precision p. Per visible score, e = exp(x - max) is
      rounded to a fixed-point integer E with F = p + guard fractional bits (mpmath's libmp,
      on the gmpy2 backend); the row maximum's term is exactly 2^F. With L = sum E,
      lse = max + log(L / 2^F): since L / 2^F = 1 + s is formed exactly, this is Blanchard,
      Higham and Higham's max + log1p(s). Given E, out = E v / L and
      dq = scale (L (E*G) k - Dn E k) / L^2 (G = dO v^T, Dn = rowsum(dO * E v)) are exact
      rationals, rounded once to float64. dk and dv need P = E / L and
      dS = E (G L - Dn) / L^2 rounded to F bits per tile, then exact products again.
    - Certification: everything that depends on p is computed at two precisions p_lo < p_hi
      from the same exact scores. The served result is the p_hi one; its certified precision
      is the number of bits on which the two agree, per tensor and per (batch, head) slice,
      measured against the slice's largest magnitude (normwise in the max norm, so an entry
      that is exactly zero in truth cannot make certification impossible), capped by an
      a-priori bound on what the fixed-point E of p_hi can cost (`_Bounds`: two precisions
      that both flush the same tiny exponentials to 0 agree exactly and are both wrong) and
      by the p_hi + 32 bits the rational results are rounded to. With precision=None the
      pair doubles until `digits` is reached.
    - Row sampling: with ``rows``, only those query rows are computed, streaming over key
      tiles (two passes: the exact row maximum, then exps and sums), so memory is
      O(rows x tile + N d).

Precision is never set globally: libmp functions receive it explicitly, so ``mpmath.mp``
is left as it was. Results are cached on disk (`reference.cache`).

Nothing here imports ringcheck's ring: arguments follow `ringcheck.spec`, the one validation
vocabulary (which loads without the ring).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from mpmath import libmp

from ringcheck.spec import REFERENCE_DTYPES, check_causal, check_dout, check_qkv, check_rows, check_softmax_scale

from .cache import ResultCache, cache_key

FORMAT_VERSION = 1
DEFAULT_DIGITS = 30
MAX_BITS = 4096  # automatic escalation stops here

_LIMB = 1 << 16  # limb base: |limb| < 2^16
_K_CHUNK = 1 << 16  # contraction length per BLAS call: 2^16 * (2^16 - 1)^2 < 2^48 < 2^53
_KEY_TILE = 4096  # keys per tile
_TILE = 1 << 17  # Python integers per (rows x keys) tile: rows per block = _TILE // key tile
_KEEP = 1 << 18  # tiles of one row block are kept between passes up to this many entries
_NEG_INF = float("-inf")
_LOG10_2 = math.log10(2.0)
_LN2 = math.log(2.0)
_TENSORS = ("out", "lse", "dq", "dk", "dv")


class UncertifiedError(RuntimeError):
    """The two precisions did not agree to the requested number of digits."""

    def __init__(self, message: str, certified_digits: float, digits_by_tensor: dict[str, float]):
        super().__init__(message)
        self.certified_digits = certified_digits
        self.digits_by_tensor = digits_by_tensor


@dataclass(frozen=True, eq=False)
class MPResult:
    """float64 tensors rounded from the high-precision values.

    Without ``rows``: out (batch, seq, heads, head_dim), lse (batch, heads, seq), and with
    dout dq like q, dk and dv like k. With ``rows`` (n indices): out and dq are
    (batch, n, heads, head_dim), lse is (batch, heads, n), dk and dv are None.
    `certified_digits` is the minimum over `digits_by_tensor`; `precision` the bits used.
    """

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    rows: torch.Tensor | None
    certified_digits: float
    digits_by_tensor: dict[str, float] = field(default_factory=dict)
    precision: tuple[int, int] = (0, 0)
    from_cache: bool = False


def mp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None,
                 *, causal: bool = False, softmax_scale: float | None = None,
                 rows: Iterable[int] | torch.Tensor | None = None, digits: float = DEFAULT_DIGITS,
                 precision: tuple[int, int] | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None) -> MPResult:
    """Certified high-precision attention on whole tensors.

    q (batch, seq_q, heads, head_dim); k, v (batch, seq_k, kv_heads, head_dim) with heads a
    multiple of kv_heads (query head h uses K/V head h // (heads // kv_heads)); dout like q.
    Causal: key j is visible to query i iff j <= i + seq_k - seq_q (as `dense_attention`);
    a row with no visible key has out 0, lse -inf and zero gradients. softmax_scale defaults
    to the float64 value 1 / sqrt(head_dim), the one every implementation uses.

    `digits`: decimal digits the result must be certified to (0 serves whatever agrees).
    `precision`: (lo, hi) working bits; None picks lo = digits * log2(10) + 32, hi = 2 lo and
    doubles both while certification falls short, up to MAX_BITS. An explicit pair is used
    as given. Raises `UncertifiedError` (a RuntimeError) when `digits` is not reached.
    `cache`/`cache_dir`: results are kept on disk (default `reference.cache.default_cache_dir()`).
    """
    tensors = _validate(q, k, v, dout, causal)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    sel = _rows(rows, q.shape[1])
    if isinstance(digits, bool) or not isinstance(digits, (int, float)) or not 0 <= digits < math.inf:
        raise ValueError(f"digits must be a finite number >= 0, got {digits!r}")
    pairs = _precision_pairs(digits, precision)

    store = ResultCache(cache_dir) if cache else None
    key = None
    if store is not None:
        params = {"version": FORMAT_VERSION, "causal": bool(causal), "scale": scale.hex(),
                  "rows": None if sel is None else sel.tolist(), "digits": float(digits),
                  "precision": None if precision is None else list(precision)}
        key = cache_key(tensors, params)
        hit = store.get(key)
        if hit is not None:
            return _result_from_payload(hit, q.device)

    rows_idx = slice(None) if sel is None else torch.from_numpy(sel)
    qd, kd, vd = _float64(q[:, rows_idx]), _float64(k), _float64(v)
    dod = None if dout is None else _float64(dout[:, rows_idx])
    failure = None
    for lo, hi in pairs:
        with _one_blas_thread():
            payload = _compute(qd, kd, vd, dod, sel, q.shape[1], bool(causal), scale, (lo, hi))
        if payload["certified_digits"] >= digits:
            if store is not None:
                store.put(key, payload)
            return _result_from_payload(payload, q.device, from_cache=False)
        failure = payload
    worst = min(failure["digits_by_tensor"], key=failure["digits_by_tensor"].get)
    raise UncertifiedError(
        f"mp_attention certified only {failure['certified_digits']:.1f} decimal digits "
        f"(worst tensor: {worst}; per tensor {_fmt_digits(failure['digits_by_tensor'])}) at "
        f"precision={tuple(failure['precision'])} bits, but digits={digits} was requested. "
        f"Pass more bits (precision=(lo, hi) with larger lo and hi, or precision=None to "
        f"escalate automatically up to {MAX_BITS} bits) or lower digits.",
        failure["certified_digits"], dict(failure["digits_by_tensor"]))


# ---------------------------------------------------------------------------------------
# arguments


def _validate(q, k, v, dout, causal) -> list[torch.Tensor]:
    """The ring's argument rules (`ringcheck.spec`), plus finite inputs: certification needs
    exact finite values."""
    check_qkv(q, k, v, what="sequence", dtypes=REFERENCE_DTYPES, same_length=False)
    check_causal(causal)
    named = [("q", q), ("k", k), ("v", v)]
    if dout is not None:
        check_dout(dout, q)
        named.append(("dout", dout))
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf; the reference needs finite inputs")
    return [t for _, t in named]


def _rows(rows, seq: int) -> np.ndarray | None:
    return None if rows is None else check_rows(rows, seq).numpy()


def _precision_pairs(digits: float, precision) -> list[tuple[int, int]]:
    if precision is not None:
        ok = (isinstance(precision, (tuple, list)) and len(precision) == 2
              and all(isinstance(b, int) and not isinstance(b, bool) for b in precision)
              and 2 <= precision[0] < precision[1])
        if not ok:
            raise ValueError(f"precision must be a pair of ints (lo, hi) with 2 <= lo < hi bits, got {precision!r}")
        return [(int(precision[0]), int(precision[1]))]
    lo = math.ceil(digits / _LOG10_2) + 32
    pairs = []
    while 2 * lo <= MAX_BITS or not pairs:
        pairs.append((lo, 2 * lo))
        lo *= 2
    return pairs


@contextmanager
def _one_blas_thread():
    """The limb products are small, skinny float64 GEMMs; on a shared 2-core machine a
    second BLAS thread made them 4x slower (spinning against other processes), so they run
    on one thread. torch's setting is restored afterwards."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def _float64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()  # every bf16/fp16/fp32 value is exact in float64


def _fmt_digits(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.1f}" for k, v in d.items())


# ---------------------------------------------------------------------------------------
# exact integers: float arrays <-> 16-bit limbs <-> Python integers


@dataclass(frozen=True)
class _Grid:
    """A float64 array is exactly (integer array) * 2^e, with integers of < 16 * limbs bits."""

    e: int
    limbs: int


def _grid(x: np.ndarray) -> _Grid:
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


def _float_limbs(x: np.ndarray, g: _Grid) -> np.ndarray:
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


def _int_limbs(a: np.ndarray) -> np.ndarray:
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


def _limbs_to_ints(limbs: np.ndarray) -> np.ndarray:
    return _from_digits(np.moveaxis(limbs, -1, 0).astype(np.int64))


def _imatmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
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


def _dyadic(x: float) -> tuple[int, int]:
    """x = man * 2^exp exactly."""
    if x == 0:
        return 0, 0
    m, e = math.frexp(x)
    return int(math.ldexp(m, 53)), e - 53


# ---------------------------------------------------------------------------------------
# one K/V head group: rows (query head g, position) against all keys


@dataclass
class _Inputs:
    """One (batch, K/V head) group in exact form. q, do: (R, d) rows; k, v: (Nk, d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray | None
    pos: np.ndarray  # (R,) query position of each row
    causal: bool
    offset: int  # key j visible to row r iff j <= pos[r] + offset
    scale: float

    def __post_init__(self):
        self.ms, self.es = _dyadic(self.scale)
        self.gq, self.gk, self.gv = _grid(self.q), _grid(self.k), _grid(self.v)
        self.go = _grid(self.do) if self.do is not None else None
        self.ex = self.es + self.gq.e + self.gk.e  # x = ms * (q k^T integers) * 2^ex
        # magnitudes for the a-priori bounds (`_Bounds`)
        self.vmax, self.kmax = float(np.abs(self.v).max()), float(np.abs(self.k).max())
        self.qmax = float(np.abs(self.q).max())
        if self.do is not None:
            self.domax = float(np.abs(self.do).max())
            self.do_l1 = np.abs(self.do).sum(axis=1)


def _group(inp: _Inputs, precisions: tuple[int, ...], *, key_grads: bool):
    """Per precision p: ({name: object array of mpf}, {name: log2 of an a-priori error bound}).

    out (R, d), lse (R,), dq (R, d) if do is given, dk, dv (Nk, d) if key_grads. Row bounds
    are per row ((R,) arrays); key bounds are one number for the group.
    """
    R, d = inp.q.shape
    nk = inp.k.shape[0]
    kb = min(nk, _KEY_TILE)
    rb = max(1, _TILE // kb)
    vals = {p: {} for p in precisions}
    bounds = {p: {} for p in precisions}
    key_acc = {p: {"dk": {}, "dv": {}} for p in precisions}
    key_bound = {p: {"dk": _NEG_INF, "dv": _NEG_INF} for p in precisions}
    kt = None
    if nk * d * inp.gk.limbs <= (1 << 22):  # small enough: keep k's limbs for every row block
        kt = np.swapaxes(_float_limbs(inp.k, inp.gk), 0, 1)
    for r0 in range(0, R, rb):
        block = _RowBlock(inp, slice(r0, min(R, r0 + rb)), kb, precisions, kt)
        for p in precisions:
            v, b = block.finish_rows(p)
            for name in v:
                vals[p].setdefault(name, []).append(v[name])
                bounds[p].setdefault(name, []).append(b[name])
        if key_grads:
            block.key_grads(key_acc, key_bound)
    out = {}
    for p in precisions:
        vals[p] = {name: np.concatenate(x) for name, x in vals[p].items()}
        bounds[p] = {name: np.concatenate(x) for name, x in bounds[p].items()}
        if key_grads:
            vals[p].update(_finish_keys(inp, key_acc[p], nk, d))
            bounds[p].update(key_bound[p])
        out[p] = (vals[p], bounds[p])
    return out


class _RowBlock:
    """Rows [rows] of a group against all key tiles.

    Pass 1: the exact row maxima m of ms * S. Pass 2, all precisions at once (scores and
    G = dO v^T are exact, so shared): fixed-point E, L = sum E, num = E v, and for dq
    A = (E * G) k and B = E k. `key_grads` is pass 3. Tiles are kept between passes when
    the block is small, else recomputed (same values: everything before E is exact).
    """

    def __init__(self, inp: _Inputs, rows: slice, kb: int, precisions, kt):
        self.inp, self.precisions = inp, precisions
        nk, d = inp.k.shape
        self.tiles = [(j0, min(nk, j0 + kb)) for j0 in range(0, nk, kb)]
        self.pos = inp.pos[rows]
        self.ql = _float_limbs(inp.q[rows], inp.gq)
        self.dol = _float_limbs(inp.do[rows], inp.go) if inp.do is not None else None
        self.do_l1 = inp.do_l1[rows] if inp.do is not None else None
        self.kt = kt
        n = len(self.pos)
        self.keep = n * nk <= _KEEP
        self.cache: dict = {}
        self.m = np.full(n, _NEG_INF, dtype=object)
        for t in range(len(self.tiles)):
            s, vis = self._scores(t)
            masked = s if vis is None else np.where(vis, s, _NEG_INF)
            self.m = np.maximum(self.m, masked.max(axis=1))
        self.empty = np.array([m == _NEG_INF for m in self.m.tolist()], dtype=bool)
        self.F = {p: p + 8 + nk.bit_length() for p in precisions}  # guard: sums of nk terms
        self.inexact = np.zeros(n, dtype=bool)  # rows with an E that is not exactly 0 or 2^F
        self.L = {p: np.zeros(n, dtype=object) for p in precisions}
        self.num, self.A, self.B = ({p: None for p in precisions} for _ in range(3))
        for t, (j0, j1) in enumerate(self.tiles):
            s, vis = self._scores(t)
            vl = _float_limbs(inp.v[j0:j1], inp.gv)
            kl = _float_limbs(inp.k[j0:j1], inp.gk) if self.dol is not None else None
            g = self._g(t) if self.dol is not None else None
            for p in precisions:
                e = self._exp(t, p, s, vis)
                self.L[p] = self.L[p] + e.sum(axis=1)
                el = _int_limbs(e)
                if kl is None:
                    num = _imatmul(el, vl)
                else:  # E v and E k in one product
                    both = _imatmul(el, _cat_limbs(vl, kl))
                    num, b = both[:, :d], both[:, d:]
                    a = _imatmul(_int_limbs(e * g), kl)
                    self.A[p] = _add(self.A[p], a)
                    self.B[p] = _add(self.B[p], b)
                self.num[p] = _add(self.num[p], num)
        for p in precisions:  # masked rows: E = 0 everywhere; L = 1 keeps formulas defined
            self.L[p][self.empty] = 1
        if self.dol is not None:
            do_int = _limbs_to_ints(self.dol)
            self.dn = {p: (do_int * self.num[p]).sum(axis=1) for p in precisions}  # D = Dn 2^(eo+ev) / L

    # -- tiles ---------------------------------------------------------------------------
    def _scores(self, t):
        if ("s", t) in self.cache:
            return self.cache[("s", t)]
        inp = self.inp
        j0, j1 = self.tiles[t]
        kt = self.kt[:, j0:j1] if self.kt is not None else np.swapaxes(_float_limbs(inp.k[j0:j1], inp.gk), 0, 1)
        s = _imatmul(self.ql, kt) * inp.ms
        vis = None
        if inp.causal:
            vis = np.arange(j0, j1)[None, :] <= (self.pos + inp.offset)[:, None]
            if vis.all():
                vis = None
        if self.keep:
            self.cache[("s", t)] = (s, vis)
        return s, vis

    def _g(self, t):
        if ("g", t) in self.cache:
            return self.cache[("g", t)]
        j0, j1 = self.tiles[t]
        g = _imatmul(self.dol, np.swapaxes(_float_limbs(self.inp.v[j0:j1], self.inp.gv), 0, 1))
        if self.keep:
            self.cache[("g", t)] = g
        return g

    def _exp(self, t, p, s=None, vis=None):
        if ("e", t, p) in self.cache:
            return self.cache[("e", t, p)]
        if s is None:
            s, vis = self._scores(t)
        e, inexact = _exp_fixed(s, self.m, vis, self.inp.ex, self.F[p])
        self.inexact |= inexact
        if self.keep:
            self.cache[("e", t, p)] = e
        return e

    # -- results of the rows -------------------------------------------------------------
    def finish_rows(self, p):
        inp, F, L = self.inp, self.F[p], self.L[p]
        prec = _result_bits(self.precisions)
        rnd = libmp.round_nearest
        n, d = self.ql.shape[:2]
        ev = inp.gv.e
        out, lse = [], []
        for r in range(n):
            if self.empty[r]:
                out.extend([libmp.fzero] * d)
                lse.append(libmp.fninf)
                continue
            den = libmp.from_int(L[r])
            out.extend(libmp.mpf_div(libmp.from_man_exp(x, ev), den, prec, rnd) for x in self.num[p][r].tolist())
            log_l = libmp.mpf_log(libmp.from_man_exp(L[r], -F), p, rnd)
            lse.append(libmp.mpf_add(libmp.from_man_exp(self.m[r], inp.ex), log_l, prec, rnd))
        vals = {"out": _mpf_array(out, (n, d)), "lse": _mpf_array(lse, (n,))}
        nk = inp.k.shape[0]
        bnd = _Bounds(F, self.inexact)
        bounds = {"out": bnd.rows(4 * nk * inp.vmax),
                  "lse": _log2add(bnd.rows(2 * nk), np.where(self.empty, _NEG_INF, math.log2(math.log(nk + 1) + 1) - p))}
        if self.dol is not None:
            # dq = ms 2^(es+eo+ev+ek) (L A - Dn B) / L^2
            e = inp.es + inp.go.e + inp.gv.e + inp.gk.e
            dq = []
            for r in range(n):
                if self.empty[r]:
                    dq.extend([libmp.fzero] * d)
                    continue
                lr, dn = L[r], self.dn[p][r]
                den = libmp.from_int(lr * lr)
                dq.extend(libmp.mpf_div(libmp.from_man_exp(inp.ms * (lr * a - dn * b), e), den, prec, rnd)
                          for a, b in zip(self.A[p][r].tolist(), self.B[p][r].tolist()))
            vals["dq"] = _mpf_array(dq, (n, d))
            bounds["dq"] = bnd.rows(12 * nk * abs(inp.scale) * inp.kmax * inp.vmax * self.do_l1)
        return vals, bounds

    # -- dk and dv: sums over rows, accumulated across row blocks ------------------------
    def key_grads(self, acc, bound):
        """dV_J += P^T dO and dK_J (without ms 2^(es+eo+ev)) += dS^T q per key tile J, with
        P = E / L and dS ~ E (G L - Dn) / L^2 rounded to F bits per tile."""
        inp = self.inp
        n, nk = len(self.pos), inp.k.shape[0]
        for p in self.precisions:  # bounds of the E quantization, summed over the rows
            bnd = _Bounds(self.F[p], self.inexact)
            bound[p]["dv"] = _log2add(bound[p]["dv"], bnd.total(4 * nk * inp.domax))
            bound[p]["dk"] = _log2add(bound[p]["dk"], bnd.total(12 * nk * abs(inp.scale) * inp.qmax * inp.vmax * self.do_l1))
        for t, (j0, j1) in enumerate(self.tiles):
            g = self._g(t)
            for p in self.precisions:
                e = self._exp(t, p)
                F, L, dn = self.F[p], self.L[p][:, None], self.dn[p][:, None]
                pr, tp, inexact = _round_ratio(e, L, F)
                if pr is not None:
                    _accumulate(acc[p]["dv"], j0, _imatmul(_int_limbs(pr.T), self.dol), inp.go.e - tp)
                    if inexact:  # each P off by <= 2^(-T-1): n rows of |dO| <= domax
                        bound[p]["dv"] = _log2add(bound[p]["dv"], math.log2(n * inp.domax) - tp - 1)
                ds, ts, inexact = _round_ratio(e * (g * L - dn), L * L, F)
                if ds is not None:
                    _accumulate(acc[p]["dk"], j0, _imatmul(_int_limbs(ds.T), self.ql), inp.gq.e - ts)
                    if inexact:  # each dS off by <= 2^(eo+ev-T-1)
                        bound[p]["dk"] = _log2add(bound[p]["dk"], math.log2(n * abs(inp.scale) * inp.qmax)
                                                  + inp.go.e + inp.gv.e - ts - 1)


class _Bounds:
    """A-priori bounds on what the fixed-point E costs, as log2 of absolute errors.

    Agreement of two precisions cannot see an error both share, and one is shared by
    construction: an exponential below 2^-F of its row's maximum is 0 at every precision
    whose F is too small to hold it (a sink key 60 logits above the rest makes P one-hot
    at 20 and 40 bits alike, and dq = 0 at both). So the certified precision is also capped
    by a bound on that quantization. With w = E / 2^F in [0, 1] (the maximum's w = 1, so
    l = sum w >= 1), each w off by |eps| <= delta = 2^-F, first order:
      sum_j |dP_j| <= 2 N delta, so |d out| <= 2 N delta max|v|, |d lse| <= N delta,
      |d D| <= |dO_r|_1 2 N delta max|v|, sum_j |d dS_j| <= 6 N delta |dO_r|_1 max|v|,
      |d dq| <= |scale| max|k| (that), |d dk| <= |scale| max|q| sum_r (that),
      |d dv| <= 2 N delta max|dO| per row;
    each is doubled for the second order. Rows whose E are all exact (only the maximum, or
    masked) have delta = 0.
    """

    def __init__(self, F: int, inexact: np.ndarray):
        self.F, self.inexact = F, inexact

    def rows(self, factor) -> np.ndarray:
        f = np.broadcast_to(np.asarray(factor, dtype=np.float64), self.inexact.shape)
        with np.errstate(divide="ignore"):
            return np.where(self.inexact & (f > 0), np.log2(f) - self.F, _NEG_INF)

    def total(self, factor) -> float:
        f = np.broadcast_to(np.asarray(factor, dtype=np.float64), self.inexact.shape)
        s = float(f[self.inexact].sum())
        return math.log2(s) - self.F if s > 0 else _NEG_INF


def _log2add(a, b):
    """log2(2^a + 2^b), elementwise; -inf stands for 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    with np.errstate(invalid="ignore"):
        r = np.where(hi == _NEG_INF, _NEG_INF, hi + np.log2(1.0 + np.exp2(lo - hi)))
    return float(r) if r.ndim == 0 else r


def _add(acc, x):
    return x if acc is None else acc + x


def _cat_limbs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(a.shape[-1], b.shape[-1])
    return np.concatenate([np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])]) for x in (a, b)], axis=1)


def _exp_fixed(s: np.ndarray, m: np.ndarray, vis, ex: int, F: int):
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
        if mi == _NEG_INF:
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


def _round_ratio(num: np.ndarray, den: np.ndarray, F: int):
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


def _accumulate(store: dict, j0: int, ints: np.ndarray, e: int) -> None:
    """store[j0] += ints * 2^e, exactly (aligning to the smaller exponent)."""
    if j0 not in store:
        store[j0] = (ints, e)
        return
    old, eo = store[j0]
    if e < eo:
        store[j0] = (old * (1 << (eo - e)) + ints, e)
    else:
        store[j0] = (old + ints * (1 << (e - eo)), eo)


def _finish_keys(inp: _Inputs, acc, nk: int, d: int) -> dict[str, np.ndarray]:
    """dk and dv as mpf arrays: the accumulated integers are exact, so no rounding here."""
    out = {}
    for name in ("dk", "dv"):
        flat = [libmp.fzero] * (nk * d)
        for j0, (ints, e) in acc[name].items():
            if name == "dk":
                ints, e = ints * inp.ms, e + inp.es + inp.go.e + inp.gv.e
            for i, x in enumerate(ints.ravel().tolist()):
                flat[j0 * d + i] = libmp.from_man_exp(x, e)
        out[name] = _mpf_array(flat, (nk, d))
    return out


def _mpf_array(values: list, shape) -> np.ndarray:
    """An object array of mpf tuples (filled one by one: numpy would unpack the tuples)."""
    arr = np.empty(len(values), dtype=object)
    for i, x in enumerate(values):
        arr[i] = x
    return arr.reshape(shape)


def _result_bits(precisions) -> int:
    """Bits of the mpf values a rational result is rounded to: well above the highest p."""
    return max(precisions) + 32


# ---------------------------------------------------------------------------------------
# whole tensors: groups, certification, float64


def _compute(qd, kd, vd, dod, sel, nq, causal, scale, precision) -> dict:
    """Both precisions; the p_hi values rounded to float64; certified bits per tensor: the
    minimum over (batch, head) slices of min(agreement of lo with hi, a-priori bits of hi,
    bits of the mpf values)."""
    lo, hi = precision
    b_, _, h_, d = qd.shape  # qd, dod: the selected rows only
    nk, kvh = kd.shape[1], kd.shape[2]
    grp = h_ // kvh
    full = sel is None
    sel = np.arange(nq) if full else sel
    ns = len(sel)
    key_grads = full and dod is not None
    names = ["out", "lse"] + (["dq"] if dod is not None else []) + (["dk", "dv"] if key_grads else [])
    shapes = {"out": (b_, ns, h_, d), "lse": (b_, h_, ns), "dq": (b_, ns, h_, d), "dk": (b_, nk, kvh, d),
              "dv": (b_, nk, kvh, d)}
    vals = {n: np.zeros(shapes[n]) for n in names}
    bits = {n: math.inf for n in names}
    for b in range(b_):
        for kh in range(kvh):
            heads = slice(kh * grp, (kh + 1) * grp)
            # rows: (head g, position), head-major
            qg = np.ascontiguousarray(qd[b, :, heads].transpose(1, 0, 2).reshape(grp * ns, d))
            dog = None if dod is None else \
                np.ascontiguousarray(dod[b, :, heads].transpose(1, 0, 2).reshape(grp * ns, d))
            inp = _Inputs(qg, kd[b, :, kh], vd[b, :, kh], dog, np.tile(sel, grp), causal, nk - nq, scale)
            res = _group(inp, (lo, hi), key_grads=key_grads)
            (vhi, bhi), (vlo, _) = res[hi], res[lo]
            for name in names:
                if name in ("dk", "dv"):
                    slices = [(slice(None), (b, slice(None), kh))]
                else:
                    slices = [(slice(g * ns, (g + 1) * ns), (b, slice(None), kh * grp + g) if name != "lse"
                               else (b, kh * grp + g)) for g in range(grp)]
                for rs, at in slices:
                    vals[name][at] = _to_float(vhi[name][rs])
                    bound = bhi[name] if np.ndim(bhi[name]) == 0 else np.max(bhi[name][rs], initial=_NEG_INF)
                    bits[name] = min(bits[name], _certified_bits(vhi[name][rs], vlo[name][rs], float(bound)),
                                     _result_bits((lo, hi)) - 1)
    digits = {n: bits[n] * _LOG10_2 for n in names}
    return {"tensors": {n: torch.from_numpy(vals[n]) for n in names},
            "rows": None if full else torch.from_numpy(sel.copy()),
            "certified_digits": min(digits.values()), "digits_by_tensor": digits,
            "precision": [lo, hi]}


def _to_float(a: np.ndarray) -> np.ndarray:
    flat = [libmp.to_float(x, rnd=libmp.round_nearest) for x in a.ravel().tolist()]
    return np.array(flat, dtype=np.float64).reshape(a.shape)


def _mag(x) -> int:
    return x[2] + x[3]  # |x| < 2^(exp + bitcount)


def _certified_bits(hi: np.ndarray, lo: np.ndarray, log2_bound: float) -> float:
    """Certified bits of a slice of p_hi values: the bits to which the p_lo values agree with
    them, capped by the a-priori bound (`_Bounds`), both relative to the slice's largest
    |value|. inf when lo and hi are identical and the bound is 0; 0 when they disagree about
    a non-finite value (lse = -inf) or the slice is 0 but not provably so."""
    top, worst = None, None
    special = (libmp.fninf, libmp.finf, libmp.fnan)
    for x, y in zip(hi.ravel().tolist(), lo.ravel().tolist()):
        if x[1] and (top is None or _mag(x) > top):
            top = _mag(x)
        if x == y:
            continue
        if x in special or y in special:
            return 0.0
        diff = libmp.mpf_sub(x, y, 16)
        if worst is None or _mag(diff) > worst:
            worst = _mag(diff)
    if top is None:  # every hi value is 0 (or -inf, for lse of masked rows)
        return math.inf if worst is None and log2_bound == _NEG_INF else 0.0
    agree = math.inf if worst is None else top - worst
    apriori = (top - 1) - log2_bound  # |max| >= 2^(top - 1)
    return float(max(0.0, min(agree, apriori)))


def _result_from_payload(payload: dict, device, from_cache: bool = True) -> MPResult:
    t = {n: payload["tensors"].get(n) for n in _TENSORS}
    t = {n: (x.to(device) if x is not None else None) for n, x in t.items()}
    return MPResult(out=t["out"], lse=t["lse"], dq=t["dq"], dk=t["dk"], dv=t["dv"], rows=payload["rows"],
                    certified_digits=float(payload["certified_digits"]),
                    digits_by_tensor={k: float(v) for k, v in payload["digits_by_tensor"].items()},
                    precision=tuple(int(b) for b in payload["precision"]), from_cache=from_cache)
