"""High-precision attention reference (mpmath), certified by agreement at two precisions.

`mp_attention` computes attention forward (out, lse) and, given ``dout``, backward (dq, dk,
dv) from the *exact* values of the inputs: every bf16/fp16/fp32/fp64 number is an integer
times a power of two, and the result is checked rather than assumed to be precise.

How
    - Exact integer arithmetic wherever the math allows it. Each input slice is an integer
      matrix times one power of two, so every sum of products (q k^T, dO v^T, E v, ...) is an
      integer matrix product. It is computed exactly by float64 BLAS on 16-bit limbs (every
      limb product is < 2^32 and every sum < 2^53, so no rounding can happen; `imatmul`)
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
    - Variants (`ringcheck.reference.mp_variants`): packed documents and windows only change which keys
      a row sees; a sink is one more exact logit per row (and dsinks one more certified
      tensor); a softcap's tanh is evaluated at each of the two precisions, so agreement
      certifies it like the exps.

Precision is never set globally: libmp functions receive it explicitly, so ``mpmath.mp``
is left as it was. Results are cached on disk (`ringcheck.reference.cache`).

Nothing here imports ringcheck's ring: arguments follow `ringcheck.spec`, the one validation
vocabulary (which loads without the ring).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from mpmath import libmp

from ringcheck.spec import (
    REFERENCE_DTYPES,
    check_causal,
    check_dout,
    check_qkv,
    check_rows,
    check_softmax_scale,
)

from .cache import ResultCache, cache_key
from .mp_exact import NEG_INF, mpf_array, result_bits
from .mp_group import DEFAULT_TILING, GroupInputs, Tiling, exact_group
from .mp_variants import check_variants, exact_sum, log2_sum

FORMAT_VERSION = 1  # payloads gained an optional "dsinks" tensor: old entries still read the same
DEFAULT_DIGITS = 30
MAX_BITS = 4096  # automatic escalation stops here
_LOG10_2 = math.log10(2.0)
_TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


class UncertifiedError(RuntimeError):
    """The two precisions did not agree to the requested number of digits."""

    def __init__(self, message: str, certified_digits: float, digits_by_tensor: dict[str, float]):
        super().__init__(message)
        self.certified_digits = certified_digits
        self.digits_by_tensor = digits_by_tensor


@dataclass(frozen=True, eq=False)
class MPResult:
    """float64 tensors rounded from the high-precision values.

    Without ``rows``: out (batch, seq, heads, v_head_dim), lse (batch, heads, seq), and with
    dout dq like q, dk like k and dv like v. With ``rows`` (n indices): out and dq are
    (batch, n, heads, ...), lse is (batch, heads, n), dk and dv are None. dsinks (heads,)
    with sinks and dout (with ``rows``: the gradient when dout is 0 on every other row), else
    None. `certified_digits` is the minimum over `digits_by_tensor`; `precision` the bits used.
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
    dsinks: torch.Tensor | None = None


def mp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None,
                 *, causal: bool = False, softmax_scale: float | None = None,
                 rows: Iterable[int] | torch.Tensor | None = None, digits: float = DEFAULT_DIGITS,
                 precision: tuple[int, int] | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None, tiling: Tiling = DEFAULT_TILING,
                 cu_seqlens=None, window: tuple[int, int] | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> MPResult:
    """Certified high-precision attention on whole tensors.

    q (batch, seq_q, heads, head_dim); k (batch, seq_k, kv_heads, head_dim), v (batch,
    seq_k, kv_heads, v_head_dim) with heads a multiple of kv_heads (query head h uses K/V head
    h // (heads // kv_heads)); dout like the output, q's shape with v's head dim. Query i is
    at global position i + seq_k - seq_q (with ``rows`` too: row r is query r). Causal: key
    j is visible to it iff j <= that (as `dense_attention`); a row with no visible key has
    out 0, lse -inf and zero gradients. softmax_scale defaults to the float64 value
    1 / sqrt(head_dim), the one every implementation uses.

    Variants, as `dense_grads` (the ring's semantics, `ringcheck.spec`'s rules): `cu_seqlens`
    global document boundaries (tokens from its last entry on are padding: out 0, lse -inf,
    zero gradients, no sink), `window` (left, right) on global positions (-1 unbounded),
    `softcap` (logits softcap tanh(scale q.k / softcap)), `sinks` (heads,) logits that join
    each non-padding row's softmax denominator with no value (lse includes them; a row with
    no visible key has lse = its sink; -inf means no sink); with dout, `MPResult.dsinks`.

    `digits`: decimal digits the result must be certified to (0 serves whatever agrees).
    `precision`: (lo, hi) working bits; None picks lo = digits * log2(10) + 32, hi = 2 lo and
    doubles both while certification falls short, up to MAX_BITS. An explicit pair is used
    as given. Raises `UncertifiedError` (a RuntimeError) when `digits` is not reached.
    `cache`/`cache_dir`: results are kept on disk (default `ringcheck.reference.cache.default_cache_dir()`).
    `tiling`: how rows and keys are streamed (memory only; see `ringcheck.reference.mp_group.Tiling`).
    """
    tensors = _validate(q, k, v, dout, causal)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    variants = check_variants(q, k, cu_seqlens, window, softcap, sinks)
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
        if tiling != DEFAULT_TILING:  # dk and dv are rounded per tile
            params["tiling"] = [tiling.key_tile, tiling.tile, tiling.keep]
        params.update(variants.params())  # nothing for plain attention: its keys are unchanged
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
            payload = _compute(qd, kd, vd, dod, sel, q.shape[1], bool(causal), scale, (lo, hi), tiling,
                               None if variants.plain else variants)
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
        check_dout(dout, q, v)
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
# whole tensors: groups, certification, float64


def _compute(qd, kd, vd, dod, sel, nq, causal, scale, precision, tiling: Tiling, variants=None) -> dict:
    """Both precisions; the p_hi values rounded to float64; certified bits per tensor: the
    minimum over (batch, head) slices of min(agreement of lo with hi, a-priori bits of hi,
    bits of the mpf values); dsinks per head, summed exactly over batch and rows."""
    lo, hi = precision
    b_, _, h_, d = qd.shape  # qd, dod: the selected rows only
    nk, kvh, dv = kd.shape[1], kd.shape[2], vd.shape[3]
    grp = h_ // kvh
    full = sel is None
    sel = np.arange(nq) if full else sel
    ns = len(sel)
    key_grads = full and dod is not None
    sink_grads = dod is not None and variants is not None and variants.sinks is not None
    names = ["out", "lse"] + (["dq"] if dod is not None else []) + (["dk", "dv"] if key_grads else []) \
        + (["dsinks"] if sink_grads else [])
    shapes = {"out": (b_, ns, h_, dv), "lse": (b_, h_, ns), "dq": (b_, ns, h_, d), "dk": (b_, nk, kvh, d),
              "dv": (b_, nk, kvh, dv), "dsinks": (h_,)}
    vals = {n: np.zeros(shapes[n]) for n in names}
    bits = {n: math.inf for n in names}
    dsinks = {p: [libmp.fzero] * h_ for p in (lo, hi)}  # exact sums over batch and rows
    dsinks_bound = [NEG_INF] * h_
    for b in range(b_):
        for kh in range(kvh):
            heads = slice(kh * grp, (kh + 1) * grp)
            # rows: (head g, position), head-major
            qg = np.ascontiguousarray(qd[b, :, heads].transpose(1, 0, 2).reshape(grp * ns, d))
            dog = None if dod is None else \
                np.ascontiguousarray(dod[b, :, heads].transpose(1, 0, 2).reshape(grp * ns, dv))
            inp = GroupInputs(qg, kd[b, :, kh], vd[b, :, kh], dog, np.tile(sel, grp), causal, nk - nq, scale,
                          variants, None if variants is None else list(range(kh * grp, (kh + 1) * grp)))
            res = exact_group(inp, (lo, hi), key_grads=key_grads, tiling=tiling)
            (vhi, bhi), (vlo, _) = res[hi], res[lo]
            for g in range(grp if sink_grads else 0):
                rs, h = slice(g * ns, (g + 1) * ns), kh * grp + g
                for p, v in ((hi, vhi), (lo, vlo)):
                    dsinks[p][h] = exact_sum(dsinks[p][h], v["dsink"][rs].tolist())
                dsinks_bound[h] = log2_sum(dsinks_bound[h], bhi["dsink"][rs])
            for name in names:
                if name == "dsinks":
                    continue
                if name in ("dk", "dv"):
                    slices = [(slice(None), (b, slice(None), kh))]
                else:
                    slices = [(slice(g * ns, (g + 1) * ns), (b, slice(None), kh * grp + g) if name != "lse"
                               else (b, kh * grp + g)) for g in range(grp)]
                for rs, at in slices:
                    vals[name][at] = _to_float(vhi[name][rs])
                    bound = bhi[name] if np.ndim(bhi[name]) == 0 else np.max(bhi[name][rs], initial=NEG_INF)
                    bits[name] = min(bits[name], _certified_bits(vhi[name][rs], vlo[name][rs], float(bound)),
                                     result_bits((lo, hi)) - 1)
    if sink_grads:
        top, low = mpf_array(dsinks[hi], (h_,)), mpf_array(dsinks[lo], (h_,))
        vals["dsinks"] = _to_float(top)
        bits["dsinks"] = min(min(_certified_bits(top[h:h + 1], low[h:h + 1], dsinks_bound[h]) for h in range(h_)),
                             result_bits((lo, hi)) - 1)
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
        return math.inf if worst is None and log2_bound == NEG_INF else 0.0
    agree = math.inf if worst is None else top - worst
    apriori = (top - 1) - log2_bound  # |max| >= 2^(top - 1)
    return float(max(0.0, min(agree, apriori)))


def _result_from_payload(payload: dict, device, from_cache: bool = True) -> MPResult:
    t = {n: payload["tensors"].get(n) for n in _TENSORS}
    t = {n: (x.to(device) if x is not None else None) for n, x in t.items()}
    return MPResult(out=t["out"], lse=t["lse"], dq=t["dq"], dk=t["dk"], dv=t["dv"], rows=payload["rows"],
                    certified_digits=float(payload["certified_digits"]),
                    digits_by_tensor={k: float(v) for k, v in payload["digits_by_tensor"].items()},
                    precision=tuple(int(b) for b in payload["precision"]), from_cache=from_cache,
                    dsinks=t["dsinks"])
