"""The PyTorch block backend, with two paths behind one contract.

- The plain path (`TorchBackend(fast=False)`, backend name ``torch_plain``): readable float32
  matmuls, the path every other backend is compared with. Inputs are upcast to float32 once
  per block; grouped-query attention broadcasts each K/V head over its group of query heads
  (K/V are not copied). Handles every mask, including the striped layout's diagonal -1. It
  never holds a block's whole score matrix: it runs the block's query rows a tile at a time,
  each tile's float32 scores within `ROW_TILE_BYTES` (rows are independent in the forward;
  the backward adds each tile's dK/dV into the block's), and holds at most three such tiles at
  once (scores and their tanh under a softcap, probabilities, dP). Tiled and untiled results
  agree within rounding (a matmul's bits depend on its row count). A block that fits in one tile runs as one. This is the path of the ``torch`` backend
  on CUDA, where a long block's whole scores would not fit (16384 x 8192 rows and keys at 32
  heads: 16 GiB a tensor).
- The fast path (the default ``torch`` backend): PyTorch's fused CPU flash-attention kernels
  (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which take the merged
  out and lse exactly as the ring's backward needs), on inputs upcast to float32 so that no
  block output is rounded to a low dtype before the merge. Used on CPU tensors for the full
  mask and the square causal diagonal (the striped layout's strict diagonal -1 too, as the
  ordinary causal mask on slices shifted by one); anything else (band masks, a softcap) takes the plain path.
  GQA expands K/V to the query heads there (the kernel wants equal head counts) and sums dK/dV back;
  a value head dim other than the query/key one is zero-padded to the larger (zeros change no score
  and no output column).

Both paths compute in float64 on float64 inputs (and return float64): "float32" below is the
working dtype of every other input dtype (`ringcheck.ring.merge.working_dtype`).
"""

from __future__ import annotations

import torch

from ...thirdparty.torch_private import cpu_flash_attention
from ..layouts import check_mask
from ..merge import working_dtype


def _up(t: torch.Tensor) -> torch.Tensor:
    """`t` in its working dtype: float32 (float64 stays float64)."""
    return t.to(working_dtype(t.dtype))


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, kv_heads, group, s, d) float32; query head h is in group h // group."""
    b, s, h, d = q.shape
    return _up(q).view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _kv(x: torch.Tensor) -> torch.Tensor:
    """(b, s, kv_heads, d) -> (b, kv_heads, 1, s, d) float32, broadcast over the group."""
    return _up(x).permute(0, 2, 1, 3).unsqueeze(2)


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """(b, kv_heads, group, s, d) -> (b, s, heads, d)."""
    b, kvh, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, kvh * g, d)


def _scores(qg: torch.Tensor, kg: torch.Tensor, scale: float, mask: str, diagonal: int, lower: int = 0,
            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capped and masked scores, and tanh of the uncapped ones (None without a softcap)."""
    check_mask(mask, diagonal, lower)
    s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)
    t = None
    if softcap is not None:
        t = s.div_(softcap).tanh_()
        s = softcap * t
    if mask != "full":
        sq, sk = s.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(diagonal)
        if mask == "band":
            visible &= torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(lower)
        s = s.masked_fill_(~visible, float("-inf"))
    return s, t


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse), in the place of `s`, with empty rows (lse = -inf) giving 0 instead of NaN."""
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    return s.sub_(safe.unsqueeze(-1)).exp_()


ROW_TILE_BYTES = 128 * 2**20  # the plain path's bytes of one tile of float32 scores (module docstring)


def row_tiles(rows: int, row_bytes: int, tile_bytes: int = ROW_TILE_BYTES) -> list[tuple[int, int]]:
    """The plain path's query-row tiles [r0, r1) of a block of `rows` rows whose scores take
    `row_bytes` a row: as many rows as `tile_bytes` holds, at least one (one tile, possibly
    empty, for a block that fits)."""
    step = max(1, tile_bytes // max(row_bytes, 1))
    return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)] or [(0, rows)]


def _by_rows(tiles: list[tuple[int, int]], compute) -> list[torch.Tensor]:
    """`compute(r0, r1)`'s tensors, whose dim 3 holds the rows [r0, r1), for every tile, written
    into tensors of all the rows (a single tile's are returned as they are)."""
    if len(tiles) == 1:
        return list(compute(*tiles[0]))
    whole: list[torch.Tensor] = []
    for r0, r1 in tiles:
        parts = compute(r0, r1)
        if not whole:
            whole = [t.new_empty(*t.shape[:3], tiles[-1][1], *t.shape[4:]) for t in parts]
        for into, part in zip(whole, parts):
            into[:, :, :, r0:r1] = part
    return whole


def _flash_ok(q: torch.Tensor, k: torch.Tensor, mask: str, diagonal: int) -> bool:
    if q.device.type != "cpu" or q.shape[1] == 0 or k.shape[1] == 0:
        return False
    return mask == "full" or (mask == "causal" and diagonal == 0 and q.shape[1] == k.shape[1])


def _pad_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of x to `size`."""
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, kvh, d) -> (b, heads, s, d) float32, each K/V head repeated over its group."""
    x = _up(x).transpose(1, 2)
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) gradients of repeated K/V heads -> (b, s, kv_heads, d)."""
    b, h, s, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, s, d).sum(2).transpose(1, 2)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous tensor that starts its own allocation: the float32 bits of the CPU
    flash kernel, and of the matmuls of the plain path, depend on their inputs' strides and on
    where they start in memory (a view at an offset, e.g. rank 1's part of a whole tensor,
    rounds differently from a copy of it), so the same values must always reach them the same
    way."""
    return t if t.is_contiguous() and t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format)


_FLASH_FWD, _FLASH_BWD = cpu_flash_attention()  # aten's private ops, through torch's door


class TorchBackend:
    def __init__(self, fast: bool = True, row_tile_bytes: int = ROW_TILE_BYTES):
        self.fast = fast
        self.name = "torch" if fast else "torch_plain"
        self.row_tile_bytes = row_tile_bytes  # the plain path's score tile (`row_tiles`)

    def _strict(self, q, k, mask, diagonal) -> bool:
        """A square block with the striped layout's strict causal mask (diagonal -1): query i
        sees keys j <= i - 1, i.e. queries 1.. against keys ..n-2 under the ordinary causal
        mask, with query 0 seeing nothing - so the fused kernel runs it on shifted slices."""
        return (self.fast and mask == "causal" and diagonal == -1 and q.shape[1] == k.shape[1] >= 2
                and q.device.type == "cpu")

    def forward(self, q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None):
        if softcap is not None or mask == "band":
            return self._plain_forward(q, k, v, scale=scale, mask=mask, diagonal=diagonal, lower=lower,
                                       softcap=softcap)
        if self._strict(q, k, mask, diagonal):
            out, lse = self.forward(q[:, 1:], k[:, :-1], v[:, :-1], scale=scale, mask="causal", diagonal=0)
            b, _, h, d = out.shape
            return (torch.cat([out.new_zeros(b, 1, h, d), out], dim=1),
                    torch.cat([lse.new_full((b, h, 1), float("-inf")), lse], dim=2))
        if self.fast and _flash_ok(q, k, mask, diagonal):
            h, d, dv = q.shape[2], q.shape[3], v.shape[3]
            width = max(d, dv)
            # owned inputs: the fused kernel's float32 bits depend on strides and alignment, not only on values
            out, lse = _FLASH_FWD(_owned(_pad_dim(_up(q), width).transpose(1, 2)),
                                  _owned(_pad_dim(_heads_first(k, h), width)),
                                  _owned(_pad_dim(_heads_first(v, h), width)), 0.0, mask == "causal", scale=scale)
            return out.transpose(1, 2)[..., :dv], lse
        return self._plain_forward(q, k, v, scale=scale, mask=mask, diagonal=diagonal)

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        if softcap is not None or mask == "band":
            return self._plain_backward(q, k, v, dout, lse, delta, scale=scale, mask=mask, diagonal=diagonal,
                                        lower=lower, softcap=softcap)
        if self._strict(q, k, mask, diagonal):
            dq, dk, dv = self.backward(q[:, 1:], k[:, :-1], v[:, :-1], dout[:, 1:], lse[:, :, 1:].contiguous(),
                                       delta[:, :, 1:].contiguous(), scale=scale, mask="causal", diagonal=0)
            return (torch.cat([dq.new_zeros(dq[:, :1].shape), dq], dim=1),
                    torch.cat([dk, dk.new_zeros(dk[:, :1].shape)], dim=1),
                    torch.cat([dv, dv.new_zeros(dv[:, :1].shape)], dim=1))
        if self.fast and _flash_ok(q, k, mask, diagonal) and not self._zero_rows_with_delta(dout, delta):
            # the kernel derives delta = rowsum(dout * out) itself from the out it is given; an
            # out whose rowsum with dout is `delta` is out* = delta / |dout|^2 dout (any out with
            # that rowsum gives the same gradients), built here so the merged statistic is used
            h, kvh, d, d_v = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
            width = max(d, d_v)
            do = _owned(_pad_dim(_up(dout), width).transpose(1, 2))
            norm = (do * do).sum(-1, keepdim=True)
            out = torch.where(norm > 0, do * (delta.unsqueeze(-1) / norm.clamp_min(1e-30)), do)
            dq, dk, dv = _FLASH_BWD(do, _owned(_pad_dim(_up(q), width).transpose(1, 2)),
                                    _owned(_pad_dim(_heads_first(k, h), width)),
                                    _owned(_pad_dim(_heads_first(v, h), width)),
                                    _owned(out), _owned(lse), 0.0, mask == "causal", scale=scale)
            return (dq.transpose(1, 2)[..., :d], _group_sum(dk, kvh)[..., :d], _group_sum(dv, kvh)[..., :d_v])
        return self._plain_backward(q, k, v, dout, lse, delta, scale=scale, mask=mask, diagonal=diagonal)

    @staticmethod
    def _zero_rows_with_delta(dout: torch.Tensor, delta: torch.Tensor) -> bool:
        """A row whose dout is all zero but whose delta is not (a gradient through lse only)
        cannot be expressed as an out for the fused kernel: such blocks take the plain path."""
        zero = (dout == 0).all(-1).transpose(1, 2)  # (b, h, s)
        return bool((zero & (delta != 0)).any())

    def _tiles(self, qg: torch.Tensor, kg: torch.Tensor) -> list[tuple[int, int]]:
        """The query-row tiles of a block: qg (b, kvh, g, sq, d), kg (b, kvh, 1, sk, d)."""
        b, kvh, g, sq, _ = qg.shape
        return row_tiles(sq, b * kvh * g * kg.shape[3] * qg.element_size(), self.row_tile_bytes)

    def _plain_forward(self, q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None):
        q, k, v = (_owned(_up(t)) for t in (q, k, v))
        kvh = k.shape[2]
        qg, kg, vg = _grouped(q, kvh), _kv(k), _kv(v)

        def rows(r0, r1):  # a row tile's mask is the block's, moved by its first row
            s, _ = _scores(qg[:, :, :, r0:r1], kg, scale, mask, diagonal + r0, lower + r0, softcap)
            lse = torch.logsumexp(s, dim=-1)                                  # (b, kvh, g, rows)
            return torch.matmul(_probabilities(s, lse), vg), lse

        out, lse = _by_rows(self._tiles(qg, kg), rows)
        b, _, _, sq = lse.shape
        return _ungroup(out), lse.reshape(b, -1, sq)

    def _plain_backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        # owned: a float32 dout that is rank 1's view into a whole tensor gave other dq bits than
        # a copy of it (found by check_padding_is_inert: a window band, which takes this path)
        q, k, v, dout, lse, delta = (_owned(_up(t)) for t in (q, k, v, dout, lse, delta))
        kvh = k.shape[2]
        qg, kg, vg, dog = _grouped(q, kvh), _kv(k), _kv(v), _grouped(dout, kvh)
        b, h, sq = lse.shape
        lse, delta = lse.view(b, kvh, h // kvh, sq), delta.view(b, kvh, h // kvh, sq)
        dkv: list[torch.Tensor] = []  # the block's dK and dV, (b, kvh, sk, d): the tiles' sums

        def rows(r0, r1):
            qr, dor = qg[:, :, :, r0:r1], dog[:, :, :, r0:r1]
            s, t = _scores(qr, kg, scale, mask, diagonal + r0, lower + r0, softcap)
            p = _probabilities(s, lse[..., r0:r1])
            dv = torch.matmul(p.transpose(-1, -2), dor).sum(2)                  # (b, kvh, sk, d_v)
            ds = torch.matmul(dor, vg.transpose(-1, -2)).sub_(delta[..., r0:r1].unsqueeze(-1)).mul_(p)
            del p, s
            if t is not None:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
                ds = ds.mul_(t.mul_(t).neg_().add_(1))
            dk = torch.matmul(ds.transpose(-1, -2), qr).sum(2)
            dkv[:] = [dk, dv] if not dkv else [dkv[0].add_(dk), dkv[1].add_(dv)]
            return (torch.matmul(ds, kg).mul_(scale),)

        dq, = _by_rows(self._tiles(qg, kg), rows)
        dk, dv = dkv
        return _ungroup(dq), dk.mul_(scale).transpose(1, 2), dv.transpose(1, 2)
