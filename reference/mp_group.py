"""One K/V head group of `ringcheck.reference.mp`: rows (query head g, position) against all keys,
streamed over key tiles, with the a-priori bounds of the fixed-point exponentials. Masks,
sinks and a softcap (`ringcheck.reference.mp_variants`) enter through `GroupInputs.variants`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mpmath import libmp

from .mp_exact import (
    NEG_INF,
    acc_add,
    accumulate_exact,
    cat_limbs,
    dyadic,
    exp_fixed,
    float_limbs,
    grid,
    imatmul,
    int_limbs,
    limbs_to_ints,
    log2add,
    mpf_array,
    result_bits,
    round_ratio,
)
from .mp_variants import RowLogits, Variants, row_sinks, sink_rows, visible


@dataclass(frozen=True)
class Tiling:
    """How a group streams: memory, never results (the exact parts are bit-identical for any
    tiling; dk and dv, rounded per tile, agree to the certified digits)."""

    key_tile: int = 4096    # keys per tile
    tile: int = 1 << 17     # Python integers per (rows x keys) tile: rows per block = tile // key tile
    keep: int = 1 << 18     # tiles of one row block are kept between passes up to this many entries


DEFAULT_TILING = Tiling()


# ---------------------------------------------------------------------------------------
# one K/V head group: rows (query head g, position) against all keys


@dataclass
class GroupInputs:
    """One (batch, K/V head) group in exact form. q (R, d), do (R, dv) rows; k (Nk, d), v (Nk, dv).
    `variants`: masks, softcap and sinks (None: plain); `heads`: the query head of each block
    of R / len(heads) rows (for the sinks)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray | None
    pos: np.ndarray  # (R,) query position of each row
    causal: bool
    offset: int  # global position of row r: pos[r] + offset (causal: key j visible iff j <= it)
    scale: float
    variants: Variants | None = None
    heads: list[int] | None = None

    def __post_init__(self):
        self.qpos = self.pos + self.offset
        self.sink = row_sinks(self.variants, self.heads, self.qpos) if self.heads is not None else None
        self.logits = self.variants is not None and self.variants.logits
        self.ms, self.es = dyadic(self.scale)
        self.gq, self.gk, self.gv = grid(self.q), grid(self.k), grid(self.v)
        self.go = grid(self.do) if self.do is not None else None
        self.ex = self.es + self.gq.e + self.gk.e  # x = ms * (q k^T integers) * 2^ex
        # magnitudes for the a-priori bounds (`_Bounds`)
        self.vmax, self.kmax = float(np.abs(self.v).max()), float(np.abs(self.k).max())
        self.qmax = float(np.abs(self.q).max())
        if self.do is not None:
            self.domax = float(np.abs(self.do).max())
            self.do_l1 = np.abs(self.do).sum(axis=1)


def exact_group(inp: GroupInputs, precisions: tuple[int, ...], *, key_grads: bool, tiling: Tiling = DEFAULT_TILING):
    """Per precision p: ({name: object array of mpf}, {name: log2 of an a-priori error bound}).

    out (R, dv), lse (R,), dq (R, d) if do is given, dsink (R,) (each row's term of dsinks)
    if do and sinks are, dk (Nk, d), dv (Nk, dv) if key_grads. Row bounds are per row ((R,)
    arrays); key bounds are one number for the group.
    """
    R, d = inp.q.shape
    nk = inp.k.shape[0]
    kb = min(nk, tiling.key_tile)
    rb = max(1, tiling.tile // kb)
    vals = {p: {} for p in precisions}
    bounds = {p: {} for p in precisions}
    key_acc = {p: {"dk": {}, "dv": {}} for p in precisions}
    key_bound = {p: {"dk": NEG_INF, "dv": NEG_INF} for p in precisions}
    kt = None
    if nk * d * inp.gk.limbs <= (1 << 22):  # small enough: keep k's limbs for every row block
        kt = np.swapaxes(float_limbs(inp.k, inp.gk), 0, 1)
    for r0 in range(0, R, rb):
        block = _RowBlock(inp, slice(r0, min(R, r0 + rb)), kb, precisions, kt, tiling.keep)
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
            vals[p].update(_finish_keys(inp, key_acc[p], nk))
            bounds[p].update(key_bound[p])
        out[p] = (vals[p], bounds[p])
    return out


class _RowBlock:
    """Rows [rows] of a group against all key tiles.

    Pass 1: the exact row maxima m of ms * S. Pass 2, all precisions at once (scores and
    G = dO v^T are exact, so shared): fixed-point E, L = sum E, num = E v, and for dq
    A = (E * G) k and B = E k. With a softcap or sinks (`RowLogits`), E is taken relative to
    the row's largest logit, the sink's term joins L, and a softcap's dq, dk use E2 = E (1 - t^2)
    in place of E. `key_grads` is pass 3. Tiles are kept between passes when
    the block is small, else recomputed (same values: everything before E is exact).
    """

    def __init__(self, inp: GroupInputs, rows: slice, kb: int, precisions, kt, keep: int):
        self.inp, self.precisions = inp, precisions
        nk = inp.k.shape[0]
        dv = inp.v.shape[1]
        self.tiles = [(j0, min(nk, j0 + kb)) for j0 in range(0, nk, kb)]
        self.pos = inp.pos[rows]
        self.qpos = inp.qpos[rows]
        self.ql = float_limbs(inp.q[rows], inp.gq)
        self.dol = float_limbs(inp.do[rows], inp.go) if inp.do is not None else None
        self.do_l1 = inp.do_l1[rows] if inp.do is not None else None
        self.kt = kt
        n = len(self.pos)
        self.keep = n * nk <= keep
        self.cache: dict = {}
        self.m = np.full(n, NEG_INF, dtype=object)
        nvis = np.zeros(n, dtype=np.int64)
        for t in range(len(self.tiles)):
            s, vis = self._scores(t)
            masked = s if vis is None else np.where(vis, s, NEG_INF)
            self.m = np.maximum(self.m, masked.max(axis=1))
            if inp.logits:
                nvis += s.shape[1] if vis is None else vis.sum(axis=1)
        self.rl = RowLogits(self.m, inp.ex, None if inp.sink is None else inp.sink[rows],
                            inp.variants.softcap) if inp.logits else None
        if self.rl is None:
            self.empty = np.array([m == NEG_INF for m in self.m.tolist()], dtype=bool)
            self.N, self.multi = nk, None
        else:
            self.empty = self.rl.empty
            self.N = nk + int(self.rl.has_sink.any())  # terms of a row's sum (the sink is one)
            self.multi = nvis + self.rl.has_sink >= 2  # else dS = 0 exactly, whatever E2 is
        self.F = {p: p + 8 + nk.bit_length() for p in precisions}  # guard: sums of nk terms
        self.inexact = np.zeros(n, dtype=bool)  # rows with an E that is not exactly 0 or 2^F
        self.inexact2 = np.zeros(n, dtype=bool)  # rows with an E2 (softcap) not exactly E
        self.L = {p: np.zeros(n, dtype=object) for p in precisions}
        self.num, self.A, self.B = ({p: None for p in precisions} for _ in range(3))
        for t, (j0, j1) in enumerate(self.tiles):
            s, vis = self._scores(t)
            vl = float_limbs(inp.v[j0:j1], inp.gv)
            kl = float_limbs(inp.k[j0:j1], inp.gk) if self.dol is not None else None
            g = self._g(t) if self.dol is not None else None
            for p in precisions:
                e, e2 = self._exp(t, p, s, vis)
                self.L[p] = self.L[p] + e.sum(axis=1)
                el = int_limbs(e)
                if kl is None:
                    num = imatmul(el, vl)
                elif e2 is e:  # E v and E k in one product
                    both = imatmul(el, cat_limbs(vl, kl))
                    num, b = both[:, :dv], both[:, dv:]
                    a = imatmul(int_limbs(e * g), kl)
                else:  # softcap: dS carries 1 - t^2, so dq uses E2 in place of E
                    num, b = imatmul(el, vl), imatmul(int_limbs(e2), kl)
                    a = imatmul(int_limbs(e2 * g), kl)
                if kl is not None:
                    self.A[p] = acc_add(self.A[p], a)
                    self.B[p] = acc_add(self.B[p], b)
                self.num[p] = acc_add(self.num[p], num)
        self.esink = {}
        if inp.sink is not None:
            for p in precisions:  # the sink: one more term of L, with no value
                self.esink[p], inexact = self.rl.sink_exp(self.F[p])
                self.inexact |= inexact
                self.L[p] = self.L[p] + self.esink[p]
        for p in precisions:  # masked rows: E = 0 everywhere; L = 1 keeps formulas defined
            self.L[p][self.empty] = 1
        if self.dol is not None:
            do_int = limbs_to_ints(self.dol)
            self.dn = {p: (do_int * self.num[p]).sum(axis=1) for p in precisions}  # D = Dn 2^(eo+ev) / L

    # -- tiles ---------------------------------------------------------------------------
    def _scores(self, t):
        if ("s", t) in self.cache:
            return self.cache[("s", t)]
        inp = self.inp
        j0, j1 = self.tiles[t]
        kt = self.kt[:, j0:j1] if self.kt is not None else np.swapaxes(float_limbs(inp.k[j0:j1], inp.gk), 0, 1)
        s = imatmul(self.ql, kt) * inp.ms
        vis = visible(self.qpos, j0, j1, inp.causal, inp.variants)
        if self.keep:
            self.cache[("s", t)] = (s, vis)
        return s, vis

    def _g(self, t):
        if ("g", t) in self.cache:
            return self.cache[("g", t)]
        j0, j1 = self.tiles[t]
        g = imatmul(self.dol, np.swapaxes(float_limbs(self.inp.v[j0:j1], self.inp.gv), 0, 1))
        if self.keep:
            self.cache[("g", t)] = g
        return g

    def _exp(self, t, p, s=None, vis=None):
        """(E, E2) of tile t at precision p; E2 (softcap: E (1 - t^2)) is E itself without."""
        if ("e", t, p) in self.cache:
            return self.cache[("e", t, p)]
        if s is None:
            s, vis = self._scores(t)
        if self.rl is None:
            e, inexact = exp_fixed(s, self.m, vis, self.inp.ex, self.F[p])
            e2 = e
        else:
            e, e2, inexact, inexact2 = self.rl.exp(s, vis, self.F[p], self.dol is not None)
            self.inexact2 |= inexact2
        self.inexact |= inexact
        if self.keep:
            self.cache[("e", t, p)] = (e, e2)
        return e, e2

    def _bounds(self, p):
        """`_Bounds` of the forward, and of dq, dk (which E2 enters, where it matters)."""
        bnd = _Bounds(self.F[p], self.inexact)
        if self.multi is None or not self.inexact2.any():
            return bnd, bnd
        return bnd, _Bounds(self.F[p], self.inexact | (self.inexact2 & self.multi))

    # -- results of the rows -------------------------------------------------------------
    def finish_rows(self, p):
        inp, F, L = self.inp, self.F[p], self.L[p]
        prec = result_bits(self.precisions)
        rnd = libmp.round_nearest
        n, d = self.ql.shape[:2]
        dv = inp.v.shape[1]
        ev = inp.gv.e
        ref = self.rl.reference(F) if self.rl is not None else None
        out, lse = [], []
        for r in range(n):
            if self.empty[r]:
                out.extend([libmp.fzero] * dv)
                lse.append(libmp.fninf)
                continue
            den = libmp.from_int(L[r])
            out.extend(libmp.mpf_div(libmp.from_man_exp(x, ev), den, prec, rnd) for x in self.num[p][r].tolist())
            log_l = libmp.mpf_log(libmp.from_man_exp(L[r], -F), p, rnd)
            top = libmp.from_man_exp(self.m[r], inp.ex) if ref is None else ref[r]
            lse.append(libmp.mpf_add(top, log_l, prec, rnd))
        vals = {"out": mpf_array(out, (n, dv)), "lse": mpf_array(lse, (n,))}
        N = self.N
        bnd, bnd_d = self._bounds(p)
        bounds = {"out": bnd.rows(4 * N * inp.vmax),
                  "lse": log2add(bnd.rows(2 * N), np.where(self.empty, NEG_INF, math.log2(math.log(N + 1) + 1) - p))}
        if self.rl is not None:
            bounds["lse"] = log2add(bounds["lse"], self.rl.reference_bound(F))
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
            vals["dq"] = mpf_array(dq, (n, d))
            bounds["dq"] = bnd_d.rows(12 * N * abs(inp.scale) * inp.kmax * inp.vmax * self.do_l1)
            if self.esink:  # dsinks = -sum_r P_sink D: |d| <= 4 N delta max|v| |dO_r|_1, doubled
                terms, rounding = sink_rows(self.esink[p], L, self.dn[p], inp.go.e + inp.gv.e, prec)
                vals["dsink"] = mpf_array(terms, (n,))
                bounds["dsink"] = log2add(bnd.rows(8 * N * inp.vmax * self.do_l1 * self.rl.has_sink), rounding)
        return vals, bounds

    # -- dk and dv: sums over rows, accumulated across row blocks ------------------------
    def key_grads(self, acc, bound):
        """dV_J += P^T dO and dK_J (without ms 2^(es+eo+ev)) += dS^T q per key tile J, with
        P = E / L and dS ~ E (G L - Dn) / L^2 rounded to F bits per tile."""
        inp = self.inp
        n, N = len(self.pos), self.N
        for p in self.precisions:  # bounds of the E quantization, summed over the rows
            bnd, bnd_d = self._bounds(p)
            bound[p]["dv"] = log2add(bound[p]["dv"], bnd.total(4 * N * inp.domax))
            bound[p]["dk"] = log2add(bound[p]["dk"], bnd_d.total(12 * N * abs(inp.scale) * inp.qmax * inp.vmax * self.do_l1))
        for t, (j0, _j1) in enumerate(self.tiles):
            g = self._g(t)
            for p in self.precisions:
                e, e2 = self._exp(t, p)
                F, L, dn = self.F[p], self.L[p][:, None], self.dn[p][:, None]
                pr, tp, inexact = round_ratio(e, L, F)
                if pr is not None:
                    accumulate_exact(acc[p]["dv"], j0, imatmul(int_limbs(pr.T), self.dol), inp.go.e - tp)
                    if inexact:  # each P off by <= 2^(-T-1): n rows of |dO| <= domax
                        bound[p]["dv"] = log2add(bound[p]["dv"], math.log2(n * inp.domax) - tp - 1)
                ds, ts, inexact = round_ratio(e2 * (g * L - dn), L * L, F)
                if ds is not None:
                    accumulate_exact(acc[p]["dk"], j0, imatmul(int_limbs(ds.T), self.ql), inp.gq.e - ts)
                    if inexact:  # each dS off by <= 2^(eo+ev-T-1)
                        bound[p]["dk"] = log2add(bound[p]["dk"], math.log2(n * abs(inp.scale) * inp.qmax)
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
            return np.where(self.inexact & (f > 0), np.log2(f) - self.F, NEG_INF)

    def total(self, factor) -> float:
        f = np.broadcast_to(np.asarray(factor, dtype=np.float64), self.inexact.shape)
        s = float(f[self.inexact].sum())
        return math.log2(s) - self.F if s > 0 else NEG_INF


def _finish_keys(inp: GroupInputs, acc, nk: int) -> dict[str, np.ndarray]:
    """dk and dv as mpf arrays: the accumulated integers are exact, so no rounding here."""
    out = {}
    for name in ("dk", "dv"):
        d = (inp.k if name == "dk" else inp.v).shape[1]
        flat = [libmp.fzero] * (nk * d)
        for j0, (ints, e) in acc[name].items():
            if name == "dk":
                ints, e = ints * inp.ms, e + inp.es + inp.go.e + inp.gv.e
            for i, x in enumerate(ints.ravel().tolist()):
                flat[j0 * d + i] = libmp.from_man_exp(x, e)
        out[name] = mpf_array(flat, (nk, d))
    return out


