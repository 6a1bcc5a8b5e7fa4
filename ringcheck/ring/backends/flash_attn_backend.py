"""The flash-attn block backend: the contract of `ringcheck.ring.backends` on flash-attention 2's
CUDA kernels (`pip install flash-attn`, CUDA only, float16/bfloat16 only).

Forward: `flash_attn_func(..., return_attn_probs=True)`, which also returns the block's lse.
Backward: `flash_attn.flash_attn_interface._flash_attn_backward`, the kernel behind flash-attn's
autograd, which takes the softmax statistics as arguments, so the ring can hand it the
*merged* lse of the whole ring (as ring-flash-attention does). Its arguments changed across
flash-attn releases (`window_size` became `window_size_left/right` in 2.7, `softcap` came in
2.6); they are matched to the installed signature by name.

Three gaps between flash-attn and the contract, closed here:

1. Masks. flash-attn aligns its causal mask (and its sliding window) to the *bottom-right*
   corner: query i sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (window
   ``(left, right)``, -1 unbounded). The contract's is top-left with offsets: ``j - i <= diagonal``
   ("causal"), ``lower <= j - i <= diagonal`` ("band"). `flash_geometry` maps one onto the
   other: it cuts off the query rows that see no key (at the top and, under a band, at the
   bottom; they get out 0, lse -inf) and the keys no row sees (at the right and, under a band,
   at the left), and on the rest uses `causal=True` when the two alignments coincide, else a
   window `(left, right)` with each side >= 0 or -1 where no row reaches it. Every remaining
   row sees at least one key.
2. D. flash-attn's backward computes D = rowsum(dO * O) itself from the `out` it is given; the
   ring's D is that of the merged output, minus any gradient into lse. It is handed
   ``out = dO * D / |dO|^2``, whose row statistic is D (up to rounding to the input dtype,
   the precision flash-attn's own D has). A row with dO = 0 but D != 0 cannot be expressed
   and raises.
3. Precision. flash-attn returns out and the gradients in the input dtype; the contract's
   float32 outputs are those values upcast, so every block pays one rounding to bf16/fp16.
   Head dims that are not a multiple of 8 are zero-padded (as flash-attn's own wrapper does).

A softcap is flash-attn's own ``softcap`` argument (forward and backward, flash-attn >= 2.6:
s = softcap tanh(scale q.k / softcap), as in the contract); an older flash-attn raises. A value
head dim that differs from q/k's (MLA) raises NotImplementedError: flash-attn 2 requires one
head dim for q, k and v (Dao-AILab/flash-attention#753, #952).

On a machine without flash-attn, constructing the backend raises a RuntimeError that says how
to install it; it never falls back to another backend.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...spec import check_softcap
from ..layouts import check_mask

MIN_VERSION = (2, 3)  # window_size (sliding-window masks) arrived in flash-attn 2.3
SOFTCAP_VERSION = (2, 6)  # softcap (forward and backward) arrived in flash-attn 2.6
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class FlashGeometry:
    """A contract block as a flash-attn call: query rows [first_row, last_row) against keys
    [first_key, keys), with flash-attn's bottom-right aligned `causal` flag and `window`."""

    first_row: int
    keys: int
    causal: bool
    window: tuple[int, int]
    last_row: int
    first_key: int


def flash_geometry(sq: int, sk: int, mask: str, diagonal: int, lower: int = 0) -> FlashGeometry | None:
    """How the contract's mask maps onto flash-attn's; None when no query sees any key."""
    check_mask(mask, diagonal, lower)
    if sq == 0 or sk == 0:
        return None
    upper = diagonal if mask in ("causal", "band") else sk   # key j is visible to query i iff
    low = lower if mask == "band" else -sq                    # low <= j - i <= upper
    first_row = min(max(-upper, 0), sq)   # rows i < -upper see no key
    last_row = max(min(sq, sk - low), 0)  # rows i >= sk - low see no key
    if low > upper or first_row >= last_row:
        return None
    first_key = max(first_row + low, 0)   # keys below the first row's band are seen by no row
    keys = min(last_row + upper, sk)      # keys past the last row's band are seen by no row
    rows, n = last_row - first_row, keys - first_key
    # sub-block row r (query first_row + r) sees sub-block key c (key first_key + c) iff
    # low + first_row - first_key <= c - r <= upper + first_row - first_key; flash-attn lets it see
    # offset - left <= c - r <= offset + right with offset = n - rows
    offset = n - rows
    right = upper + first_row - first_key - offset       # = upper + last_row - keys >= 0
    left = offset - (low + first_row - first_key)        # = keys - last_row - low >= 0
    if offset + right >= n - 1:       # even the first row sees the last key
        right = -1
    if left >= rows - 1 + offset:     # even the last row sees the first key
        left = -1
    if (left, right) == (-1, 0):
        return FlashGeometry(first_row, keys, True, (-1, -1), last_row, first_key)
    return FlashGeometry(first_row, keys, False, (left, right), last_row, first_key)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the head dim to a multiple of 8 (flash-attn's kernels need it)."""
    extra = -x.shape[-1] % 8
    return F.pad(x, (0, extra)) if extra else x


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self):
        try:
            import flash_attn  # optional dependency: flash-attn (CUDA only)
            from flash_attn import flash_attn_func

            from ...thirdparty.flash_attn_private import flash_attn_backward  # after flash_attn: optional, as above
        except Exception as error:  # ImportError, or the CUDA extension failing to load
            raise RuntimeError(
                f"backend='flash_attn' needs the flash-attn package, which did not import "
                f"({type(error).__name__}: {error}). Install it on a CUDA machine with "
                "`pip install flash-attn --no-build-isolation` (or `pip install -e '.[flash]'`), "
                "or choose backend='triton' or 'torch'") from error
        version = getattr(flash_attn, "__version__", "0")
        if _version(version) < MIN_VERSION:
            raise RuntimeError(f"backend='flash_attn' needs flash-attn >= {'.'.join(map(str, MIN_VERSION))} "
                               f"(sliding windows), found {version}; `pip install -U flash-attn`")
        self.version = version
        self._forward = flash_attn_func
        self._backward = backward = flash_attn_backward()  # private: flash-attn's door
        target = getattr(backward, "_init_fn", backward)  # torch custom op (2.7+)
        try:
            self._backward_params = set(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            self._backward_params = set()

    # -- the contract ----------------------------------------------------------------------

    def forward(self, q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None):
        softcap = self._check(q, k, v, mask, diagonal, lower, softcap)
        b, sq, h, d = q.shape
        out = torch.zeros((b, sq, h, d), dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        g = flash_geometry(sq, k.shape[1], mask, diagonal, lower)
        if g is None:
            return out, lse
        rows, keys = slice(g.first_row, g.last_row), slice(g.first_key, g.keys)
        capped = {} if softcap is None else {"softcap": softcap}  # flash-attn < 2.6 has no such argument
        with torch.no_grad():
            o, block_lse, *_ = self._forward(
                _pad8(q[:, rows]), _pad8(k[:, keys]), _pad8(v[:, keys]), dropout_p=0.0,
                softmax_scale=float(scale), causal=g.causal, window_size=g.window, return_attn_probs=True,
                **capped)
        out[:, rows] = o[..., :d].float()
        lse[:, :, rows] = block_lse[:, :, :g.last_row - g.first_row].float()
        return out, lse

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        softcap = self._check(q, k, v, mask, diagonal, lower, softcap)
        sq, d = q.shape[1], q.shape[3]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        g = flash_geometry(sq, k.shape[1], mask, diagonal, lower)
        if g is None:
            return dq, dk, dv
        rows, keys = slice(g.first_row, g.last_row), slice(g.first_key, g.keys)
        do = dout[:, rows].to(q.dtype)
        row_lse, row_delta = lse[:, :, rows], delta[:, :, rows]
        # an `out` whose rowsum(dout * out) is the ring's D: out = dout * D / |dout|^2
        norm2 = do.float().pow(2).sum(-1).transpose(1, 2)                       # (b, h, rows)
        if bool(((norm2 == 0) & (row_delta != 0)).any()):
            raise ValueError("flash-attn's backward derives D from dout; a row with dout = 0 and "
                             "D != 0 (a gradient into lse alone) cannot be passed to it")
        factor = torch.where(norm2 > 0, row_delta / norm2.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        out_like = (do.float() * factor.transpose(1, 2).unsqueeze(-1)).to(q.dtype)
        # flash-attn marks a row without keys by lse = +inf (exp(s - lse) = 0); the ring, by -inf
        row_lse = torch.where(torch.isneginf(row_lse), float("inf"), row_lse).contiguous()
        qs, ks, vs = (_pad8(t).contiguous() for t in (q[:, rows], k[:, keys], v[:, keys]))
        dqs, dks, dvs = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
        self._call_backward(dout=_pad8(do).contiguous(), q=qs, k=ks, v=vs, out=_pad8(out_like).contiguous(),
                            softmax_lse=row_lse, dq=dqs, dk=dks, dv=dvs, scale=float(scale), geometry=g,
                            softcap=softcap)
        dq[:, rows] = dqs[..., :d].float()
        dk[:, keys] = dks[..., :d].float()
        dv[:, keys] = dvs[..., :d].float()
        return dq, dk, dv

    # -- helpers ---------------------------------------------------------------------------

    def _call_backward(self, *, dout, q, k, v, out, softmax_lse, dq, dk, dv, scale, geometry, softcap):
        kwargs = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                      dropout_p=0.0, softmax_scale=scale, causal=geometry.causal, alibi_slopes=None,
                      deterministic=True, rng_state=None)
        params = self._backward_params
        if "window_size" in params:                      # flash-attn < 2.7
            kwargs["window_size"] = geometry.window
        else:                                            # 2.7+
            kwargs["window_size_left"], kwargs["window_size_right"] = geometry.window
        if "softcap" in params or not params:            # 2.6+ (0.0: no cap)
            kwargs["softcap"] = 0.0 if softcap is None else softcap
        elif softcap is not None:
            raise RuntimeError(f"a softcap needs flash-attn >= {'.'.join(map(str, SOFTCAP_VERSION))}, whose "
                               f"_flash_attn_backward takes `softcap`; the installed {self.version} does not "
                               "(`pip install -U flash-attn`, or choose backend='triton' or 'torch')")
        if params:
            kwargs = {name: value for name, value in kwargs.items() if name in params}
        self._backward(**kwargs)

    def _check(self, q, k, v, mask, diagonal, lower, softcap) -> float | None:
        """Raise unless the arguments form one block flash-attn can run; returns the softcap."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim)")
            self._require_cuda(name, t)
        if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"flash-attn supports float16 and bfloat16 inputs, got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}; use backend='triton' or 'torch' for float32")
        if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not form one block")
        if v.shape[3] != k.shape[3]:
            raise NotImplementedError(
                f"flash-attn 2 needs one head dim for q, k and v, got {k.shape[3]} (q, k) and {v.shape[3]} (v); "
                "zero-pad the smaller one to the larger, or choose backend='triton' or 'torch', which take a "
                "value head dim of its own")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"heads={q.shape[2]} (q) is not divisible by kv_heads={k.shape[2]} (k, v)")
        if q.shape[3] > MAX_HEAD_DIM:
            raise ValueError(f"head_dim={q.shape[3]} is larger than flash-attn supports ({MAX_HEAD_DIM})")
        check_mask(mask, diagonal, lower)
        softcap = check_softcap(softcap)
        if softcap is not None and _version(self.version) < SOFTCAP_VERSION:
            raise RuntimeError(f"a softcap needs flash-attn >= {'.'.join(map(str, SOFTCAP_VERSION))} (its `softcap` "
                               f"argument), found {self.version}; `pip install -U flash-attn`, or choose "
                               "backend='triton' or 'torch'")
        return softcap

    @staticmethod
    def _require_cuda(name: str, t: torch.Tensor) -> None:
        if t.device.type != "cuda":
            raise ValueError(f"flash-attn runs on CUDA tensors; {name} is on {t.device}")
