"""Attention variants of `ringcheck.reference.mp`: packed documents and sliding windows (which keys a
row sees), a logit softcap and attention sinks, on the exact-integer machinery.

The semantics are `ringcheck.reference.dense`'s (and the ring's); what changes here is only how each
is made exact or certified:

- Masks (`visible`) are decided on global positions, integers: exact by construction.
- Sinks: one more logit per row (its query head's), with no value. A float is a dyadic
  rational, so without a softcap the sink is put on the scores' exponent grid and the row's
  reference (its largest logit, subtracted before exp) stays an exact integer: the sink's
  term E_sink = round(exp(sink - max) 2^F) is formed like the keys' (`exp_fixed`, exactly
  2^F when the sink is the maximum) and joins L. Then dsinks = -sum_r E_sink Dn / L^2
  (D = Dn / L): exact rationals given E, each rounded to the result bits and summed exactly.
- Softcap: logits c tanh(y / c) of the exact scaled scores y. tanh increases, so a row's
  largest logit is still that of the exact integer maximum of y (its keys keep E = 2^F
  exactly); whether the sink is above it is decided rigorously (`_sink_above`). Everything
  else is evaluated per precision p, at a working precision tied to p's fixed-point bits F
  (absolute error < 2^-(F+10), well below the fixed-point step 2^-F that `_Bounds` charges
  for), so the two precisions evaluate tanh independently and their agreement certifies it.
  The backward's dS (1 - t^2) uses a second fixed-point array E2 = round(E (1 - t^2)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from mpmath import libmp

from ringcheck.spec import check_cu_seqlens, check_sinks, check_softcap, check_window

from .mp_exact import NEG_INF, dyadic, exp_fixed, log2add

_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Variants:
    """The validated variant options of one `mp_attention` call; sinks as exact float64
    values, one per query head (-inf: that head has no sink)."""

    cu_seqlens: tuple[int, ...] | None = None
    window: tuple[int, int] = (-1, -1)
    softcap: float | None = None
    sinks: tuple[float, ...] | None = None

    @property
    def plain(self) -> bool:
        return self == Variants()

    @property
    def logits(self) -> bool:
        """Whether the logits change (softcap or sinks), not only which keys are seen."""
        return self.softcap is not None or self.sinks is not None

    def params(self) -> dict:
        """Cache-key entries of the options that are set (none for plain attention, so its
        keys stay as they were)."""
        out: dict = {}
        if self.cu_seqlens is not None:
            out["cu_seqlens"] = list(self.cu_seqlens)
        if self.window != (-1, -1):
            out["window"] = list(self.window)
        if self.softcap is not None:
            out["softcap"] = self.softcap.hex()
        if self.sinks is not None:
            out["sinks"] = [x.hex() for x in self.sinks]
        return out


def check_variants(q: torch.Tensor, k: torch.Tensor, cu_seqlens, window, softcap, sinks) -> Variants:
    """The ring's rules (`ringcheck.spec`), as `dense_attention` applies them, plus sinks the
    reference can take exactly: finite or -inf (no sink)."""
    cu = check_cu_seqlens(cu_seqlens, k.shape[1])
    win = check_window(window)
    cap = check_softcap(softcap)
    s = check_sinks(sinks, q.shape[2], q.device)
    values = None
    if s is not None:
        t = s.detach().to("cpu", torch.float64)  # exact: every float is a float64
        if bool(torch.isnan(t).any() | torch.isposinf(t).any()):
            raise ValueError("sinks contains NaN or +Inf; the reference needs finite sinks (-inf means no sink)")
        values = tuple(float(x) for x in t.tolist())
    return Variants(cu, win, cap, values)


# ---------------------------------------------------------------------------------------
# masks


def visible(qpos: np.ndarray, j0: int, j1: int, causal: bool, var: Variants | None) -> np.ndarray | None:
    """(rows, j1 - j0) bool: the query at global position qpos[r] sees key j0 + c (as
    `ringcheck.reference.dense.visibility`); None when every entry is visible."""
    kpos = np.arange(j0, j1)
    vis = None

    def both(x):
        return x if vis is None else vis & x

    if causal:
        vis = kpos[None, :] <= qpos[:, None]
    if var is not None:
        if var.cu_seqlens is not None:
            cu = np.asarray(var.cu_seqlens)
            end = var.cu_seqlens[-1]
            qdoc, kdoc = np.searchsorted(cu, qpos, side="right"), np.searchsorted(cu, kpos, side="right")
            vis = both((qdoc[:, None] == kdoc[None, :]) & (qpos < end)[:, None] & (kpos < end)[None, :])
        left, right = var.window
        if left >= 0:
            vis = both(kpos[None, :] >= (qpos - left)[:, None])
        if right >= 0:
            vis = both(kpos[None, :] <= (qpos + right)[:, None])
    if vis is not None and vis.all():
        return None
    return vis


def row_sinks(var: Variants | None, heads: list[int], qpos: np.ndarray) -> np.ndarray | None:
    """(rows,) float64 sink of each row (rows head-major: len(qpos) // len(heads) per head),
    -inf on padding rows (past the last document) and for heads without one."""
    if var is None or var.sinks is None:
        return None
    s = np.repeat(np.array([var.sinks[h] for h in heads], dtype=np.float64), len(qpos) // len(heads))
    if var.cu_seqlens is not None:
        s[qpos >= var.cu_seqlens[-1]] = NEG_INF
    return s


# ---------------------------------------------------------------------------------------
# the logits of a row block: reference (largest logit), fixed-point exps, sink terms


class RowLogits:
    """Per row block, after pass 1 (m: exact integer maxima of the visible scaled scores, y =
    m 2^ex, -inf for none): the row reference and, per fixed-point F, the exps of a key tile
    (E and E2 = E (1 - t^2), E2 is E without a softcap), of the sink, and the reference as an
    mpf (for lse)."""

    def __init__(self, m: np.ndarray, ex: int, sink: np.ndarray | None, softcap: float | None):
        n = len(m)
        self.m, self.ex, self.cap = m, ex, softcap
        self.sink = sink if sink is not None else np.full(n, NEG_INF)
        self.has_sink = self.sink > NEG_INF
        ms = m.tolist()
        self.empty = np.array([mi == NEG_INF for mi in ms], dtype=bool) & ~self.has_sink
        self._ref: dict[int, list] = {}
        if softcap is None:  # everything on one exact grid 2^e0
            exps = [dyadic(x)[1] for x in self.sink.tolist() if x > NEG_INF and x != 0]
            self.e0 = min([ex] + exps)
            self.shift = ex - self.e0
            self.sink_int = _objects([_on_grid(x, self.e0) for x in self.sink.tolist()])
            self.ref = _objects([mi if mi == NEG_INF else mi << self.shift for mi in ms])
            self.ref = np.maximum(self.ref, self.sink_int)
            self.sink_ref = None
        else:
            self.C = libmp.from_float(softcap)
            self.cbits = max(0, math.ceil(math.log2(softcap)))
            self.sink_ref = np.array([bool(h) and (mi == NEG_INF or _sink_above(mi, ex, s, self.C, softcap))
                                      for mi, s, h in zip(ms, self.sink.tolist(), self.has_sink.tolist())])

    # -- references ----------------------------------------------------------------------
    def wp(self, F: int) -> int:
        """Working bits of the capped logits: absolute error < c 2^-(wp - 2) <= 2^-(F + 10)."""
        return F + 12 + self.cbits

    def logit(self, y, wp: int):
        """(c tanh(y 2^ex / c), tanh) at wp bits."""
        t = libmp.mpf_tanh(libmp.mpf_div(libmp.from_man_exp(y, self.ex), self.C, wp), wp)
        return libmp.mpf_mul(self.C, t, wp), t

    def reference(self, F: int) -> list:
        """Per row the logit subtracted before exp, an mpf (None for empty rows)."""
        if F in self._ref:
            return self._ref[F]
        out = []
        for i, mi in enumerate(self.m.tolist()):
            if self.empty[i]:
                out.append(None)
            elif self.cap is None:
                out.append(libmp.from_man_exp(self.ref[i], self.e0))
            elif self.sink_ref[i]:
                out.append(libmp.from_float(float(self.sink[i])))
            else:
                out.append(self.logit(mi, self.wp(F))[0])
        self._ref[F] = out
        return out

    def reference_bound(self, F: int) -> np.ndarray:
        """log2 of the reference's error per row (lse adds it): 0 (-inf) unless it is an
        evaluated capped logit."""
        if self.cap is None:
            return np.full(len(self.m), NEG_INF)
        approx = ~self.empty & ~self.sink_ref
        return np.where(approx, math.log2(self.cap) + 2 - self.wp(F), NEG_INF)

    # -- fixed-point exps ----------------------------------------------------------------
    def exp(self, s: np.ndarray, vis, F: int, backward: bool):
        """(E, E2, inexact, inexact2) of a key tile's integer scores s."""
        if self.cap is None:
            e, inexact = exp_fixed(s * (1 << self.shift) if self.shift else s, self.ref, vis, self.e0, F)
            return e, e, inexact, np.zeros(len(inexact), dtype=bool)
        return self._exp_capped(s, vis, F, backward)

    def sink_exp(self, F: int):
        """((rows,) E_sink, inexact): 0 where a row has no sink."""
        n = len(self.m)
        if self.cap is None:
            e, inexact = exp_fixed(self.sink_int.reshape(n, 1), self.ref, self.has_sink.reshape(n, 1), self.e0, F)
            return e[:, 0], inexact
        ref, wp = self.reference(F), self.wp(F)
        cut = -(F + 2) * _LN2 - 1.0
        vals, inexact = [], np.zeros(n, dtype=bool)
        for i in range(n):
            if not self.has_sink[i]:
                vals.append(0)
            elif self.sink_ref[i]:
                vals.append(1 << F)
            else:
                inexact[i] = True
                a = libmp.mpf_sub(libmp.from_float(float(self.sink[i])), ref[i], wp)
                vals.append(0 if libmp.to_float(a) < cut else _fixed(libmp.mpf_exp(a, wp), F))
        return _objects(vals), inexact

    def _exp_capped(self, s, vis, F: int, backward: bool):
        ref, wp = self.reference(F), self.wp(F)
        one, fone = 1 << F, libmp.fone
        cut = -(F + 2) * _LN2 - 1.0  # exp below 2^-(F+2): 0 (conservative, in float)
        vrows = vis.tolist() if vis is not None else None
        e_flat, e2_flat = [], []
        n = s.shape[0]
        inexact, inexact2 = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        for i, (row, mi) in enumerate(zip(s.tolist(), self.m.tolist())):
            if ref[i] is None or mi == NEG_INF:  # no visible key
                e_flat.extend([0] * len(row))
                e2_flat.extend([0] * len(row))
                continue
            vr = vrows[i] if vrows is not None else None
            at_max = not self.sink_ref[i]
            top2 = None
            for j, y in enumerate(row):
                if vr is not None and not vr[j]:
                    e_flat.append(0)
                    e2_flat.append(0)
                    continue
                if at_max and y == mi:  # the row's maximum: exp(0) exactly
                    if top2 is None:
                        t = self.logit(mi, wp)[1]
                        top2 = one if t == libmp.fzero else _fixed(libmp.mpf_sub(fone, libmp.mpf_mul(t, t, wp), wp), F)
                        inexact2[i] |= t != libmp.fzero
                    e_flat.append(one)
                    e2_flat.append(top2 if backward else one)
                    continue
                inexact[i] = inexact2[i] = True
                f, t = self.logit(y, wp)
                a = libmp.mpf_sub(f, ref[i], wp)
                if libmp.to_float(a) < cut:
                    e_flat.append(0)
                    e2_flat.append(0)
                    continue
                ea = libmp.mpf_exp(a, wp)
                e_flat.append(_fixed(ea, F))
                if backward:
                    om = libmp.mpf_sub(fone, libmp.mpf_mul(t, t, wp), wp)
                    e2_flat.append(_fixed(libmp.mpf_mul(ea, om, wp), F))
                else:
                    e2_flat.append(e_flat[-1])
        e, e2 = _objects(e_flat).reshape(s.shape), _objects(e2_flat).reshape(s.shape)
        return e, e2, inexact, inexact2


def _sink_above(m: int, ex: int, sink: float, C, cap: float) -> bool:
    """Whether sink > c tanh(m 2^ex / c), decided rigorously (ties: False). tanh of a nonzero
    dyadic is transcendental, so only m = 0 can tie, and the loop ends."""
    if m == 0:  # tanh(0) = 0 exactly
        return sink > 0
    if sink >= cap or sink <= -cap:  # |c tanh| < c
        return sink >= cap
    s = libmp.from_float(sink)
    y = libmp.from_man_exp(m, ex)
    wp = 64
    while wp <= 1 << 16:
        f = libmp.mpf_mul(C, libmp.mpf_tanh(libmp.mpf_div(y, C, wp), wp), wp)
        d = libmp.mpf_sub(s, f, wp)
        if d != libmp.fzero and d[2] + d[3] > math.log2(cap) + 4 - wp:  # |d| beyond the error
            return not d[0]
        wp *= 2
    raise RuntimeError(f"internal: cannot order sink {sink!r} and a capped logit")


def _fixed(x, F: int) -> int:
    """round(x 2^F), halves up."""
    return (libmp.to_fixed(x, F + 1) + 1) >> 1


def _on_grid(x: float, e0: int):
    if x == NEG_INF:
        return NEG_INF
    man, e = dyadic(x)
    return man << (e - e0) if man else 0


def _objects(values: list) -> np.ndarray:
    """A 1-D object array (fromiter: assigning a list of gmpy2 integers probes each for the
    buffer protocol, ~100x slower)."""
    return np.fromiter(values, dtype=object, count=len(values))


# ---------------------------------------------------------------------------------------
# dsinks: sums over rows and batch


def sink_rows(esink, L, dn, e: int, prec: int):
    """Per row -E_sink Dn 2^e / L^2 rounded to prec bits, and log2 of that rounding."""
    terms, rnd = [], []
    for es, lr, d in zip(esink.tolist(), L.tolist(), dn.tolist()):
        if not es or not d:
            terms.append(libmp.fzero)
            rnd.append(NEG_INF)
            continue
        x = libmp.mpf_div(libmp.from_man_exp(-es * d, e), libmp.from_int(lr * lr), prec, libmp.round_nearest)
        terms.append(x)
        rnd.append(x[2] + x[3] - prec)
    return terms, np.array(rnd, dtype=np.float64)


def exact_sum(acc, values) -> tuple:
    """acc + sum(values) as an exact mpf."""
    for x in values:
        acc = libmp.mpf_add(acc, x, 0)
    return acc


def log2_sum(acc: float, bounds) -> float:
    """log2(2^acc + sum 2^bounds)."""
    for b in np.asarray(bounds, dtype=np.float64).ravel().tolist():
        acc = log2add(acc, b)
    return acc
