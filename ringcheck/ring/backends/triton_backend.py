"""The Triton block backend: the contract of `ringcheck.ring.backends` on fused Triton kernels.

Thin glue: it validates the block, maps its mask onto the kernels' switches (`mask_flags`: the
upper bound ``CAUSAL``, the lower bound ``BAND``, each off where no row reaches it), decides the
one numerics switch (`dot_fp32`) and calls the launchers of `triton_fwd` (forward) and
`triton_bwd` (preprocess, dK/dV, dQ). A softcap and a value head dim of its own (MLA) are
passed straight through: the kernels take both.

Compiled or interpreted. Triton 3.x decides when a kernel is *decorated*: `@triton.jit`
returns an interpreted function if TRITON_INTERPRET=1 is set in the environment at that
moment (when `ringcheck.ring.backends.triton_fwd` is first imported), a GPU-compiled one otherwise;
a process has one or the other. This module never reads the environment; it asks the kernels
what they are:

- compiled kernels run CUDA tensors; CPU tensors raise a RuntimeError that says how to run
  them under the interpreter (never a silent fallback to another backend);
- interpreted kernels run CPU tensors (CUDA tensors too, copied through the host: slow).

`dot_fp32` (a `constexpr` of the kernels): upcast every `tl.dot` operand to float32 (IEEE).
Default: on under the interpreter (its bf16 `tl.dot` is wrong: errors near 1e10) and for
float32 inputs (never TF32); off on the GPU for bf16/fp16, whose tensor cores multiply in the
input dtype with float32 accumulation.
"""

from __future__ import annotations

import torch

from ...spec import check_softcap, check_softmax_scale
from ..layouts import check_mask

try:
    from . import triton_bwd, triton_fwd
    from .triton_bwd import attention_backward, attention_row_delta
    from .triton_fwd import attention_forward, is_interpreted
except ImportError as error:  # triton missing (not installable on this platform)
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonBackend:
    name = "triton"

    def __init__(self, *, dot_fp32: bool | None = None):
        if _IMPORT_ERROR is not None:
            raise RuntimeError(
                f"backend='triton' needs the triton package, which did not import ({_IMPORT_ERROR}); "
                "install it with `pip install -e '.[triton]'` (Linux), or choose backend='torch'"
            ) from _IMPORT_ERROR
        if dot_fp32 is not None and not isinstance(dot_fp32, bool):
            raise TypeError(f"dot_fp32 must be True, False or None (automatic), got {dot_fp32!r}")
        self._dot_fp32 = dot_fp32

    @property
    def interpreted(self) -> bool:
        """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1 at import)."""
        return is_interpreted()

    def dot_fp32(self, dtype: torch.dtype) -> bool:
        """The `DOT_FP32` flag the kernels get for inputs of `dtype`."""
        if dtype == torch.float32:
            return True  # float32 operands are multiplied in IEEE float32 whatever was asked
        if self._dot_fp32 is not None:
            return self._dot_fp32
        return self.interpreted

    # -- the contract ----------------------------------------------------------------------

    def forward(self, q, k, v, *, scale, mask, diagonal=0, lower=0, softcap=None):
        softcap = self._check(q=q, k=k, v=v, scale=scale, mask=mask, diagonal=diagonal, lower=lower,
                              softcap=softcap)
        flags = mask_flags(mask, diagonal, lower, q.shape[1], k.shape[1])
        return attention_forward(q, k, v, scale=scale, **flags, softcap=softcap, dot_fp32=self.dot_fp32(q.dtype))

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0, lower=0, softcap=None):
        softcap = self._check(q=q, k=k, v=v, scale=scale, mask=mask, diagonal=diagonal, lower=lower,
                              softcap=softcap)
        b, sq, h, _ = q.shape
        out_shape = (b, sq, h, v.shape[3])
        if tuple(dout.shape) != out_shape or dout.device != q.device:
            raise ValueError(f"dout must be like the output (batch, sq, heads, v_head_dim) = {out_shape} on "
                             f"{q.device}, got {tuple(dout.shape)} on {dout.device}")
        for name, t in (("lse", lse), ("delta", delta)):
            if t.shape != (b, h, sq) or t.dtype != torch.float32 or t.device != q.device:
                raise ValueError(f"{name} must be float32 of shape (batch, heads, sq) = {(b, h, sq)} on "
                                 f"{q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        flags = mask_flags(mask, diagonal, lower, sq, k.shape[1])
        return attention_backward(q, k, v, dout.to(q.dtype), lse, delta, scale=scale, **flags, softcap=softcap,
                                  dot_fp32=self.dot_fp32(q.dtype))

    def row_delta(self, out, dout):
        """D = rowsum(dout * out), float32 (batch, heads, seq): the backward's preprocess kernel
        (the ring computes D itself with `ringcheck.ring.backends.row_delta`; this is its kernel twin)."""
        if out.shape != dout.shape or out.dim() != 4:
            raise ValueError(f"out and dout must be one 4-D shape, got {tuple(out.shape)} and {tuple(dout.shape)}")
        self._check_device(out)
        return attention_row_delta(out, dout)

    # -- validation ------------------------------------------------------------------------

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda" or self.interpreted:
            return
        raise RuntimeError(
            f"the Triton kernels were compiled for the GPU but got tensors on {t.device}. Either move "
            "them to a CUDA device, or run the kernels on the CPU under Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before ringcheck's Triton kernels are imported "
            "(e.g. `TRITON_INTERPRET=1 python -m pytest suites`); the test suites' conftest does that "
            "on machines without CUDA")

    def _check(self, *, q, k, v, scale, mask, diagonal, lower, softcap) -> float | None:
        """Raise unless the arguments form one block; returns the softcap (None or a float)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim), got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        if q.dtype not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k, v must share one dtype of {[str(d) for d in SUPPORTED_DTYPES]}, got "
                            f"{q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not form one "
                             "block: k and v must agree on (batch, seq, kv_heads), q and k on batch and "
                             "head_dim (v may have a head dim of its own)")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"heads={q.shape[2]} (q) is not divisible by kv_heads={k.shape[2]} (k, v)")
        if max(q.shape[3], v.shape[3]) > MAX_HEAD_DIM:
            raise ValueError(f"head dims {q.shape[3]} (q, k) and {v.shape[3]} (v): the Triton kernels support "
                             f"up to {MAX_HEAD_DIM}")
        check_mask(mask, diagonal, lower)
        check_softmax_scale(scale, q.shape[3])
        softcap = check_softcap(softcap)
        self._check_device(q)
        return softcap


def mask_flags(mask: str, diagonal: int, lower: int, sq: int, sk: int) -> dict:
    """The kernels' mask switches for a (sq, sk) block: ``causal`` (the bound j - i <= diagonal
    applies) and ``band`` (j - i >= lower applies), each off where no row reaches it (a band
    whose bound lies outside the block costs no masking), and both offsets clamped to
    [-sq, sk], which leaves the mask as it is and keeps them int32."""
    def clamp(x: int) -> int:
        return min(max(x, -sq), sk)
    causal = mask in ("causal", "band") and diagonal < sk - 1   # key sk - 1 is past some row's bound
    band = mask == "band" and lower > 1 - sq                    # key 0 is below some row's bound
    return {"causal": causal, "band": band, "diagonal": clamp(diagonal), "lower": clamp(lower)}


# -- ahead-of-time compilation, without a GPU -------------------------------------------------

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _ast_source(kernel, args: dict, constexprs: dict):
    """The kernel's source specialized as a launch with `args` would be: pointers (given as
    torch dtypes) 16-byte aligned, ints equal to 1 made constants, ints divisible by 16 marked."""
    from triton.compiler import ASTSource  # optional dependency: triton (GPU compilation only)

    signature, constants, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, torch.dtype):
            signature[name] = "*" + _TRITON_TYPES[value]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constants, attrs)


def compile_for_gpu(**launch) -> dict[str, int]:
    """Compile the four kernels for an NVIDIA GPU on a machine without one (`compiled_for_gpu`,
    which takes the same keywords); returns each kernel's shared memory in bytes."""
    return {name: kernel.metadata.shared for name, kernel in compiled_for_gpu(**launch).items()}


def gpu_assembly(stage: str = "ttir", **launch) -> dict[str, str]:
    """Each kernel's code at one compilation `stage` ("ttir", "ttgir", "llir", "ptx"), compiled
    as `compiled_for_gpu` compiles it: what the arithmetic became (e.g. the width of the tile
    offsets), read on a CPU."""
    return {name: kernel.asm[stage] for name, kernel in compiled_for_gpu(**launch).items()}


def compiled_for_gpu(*, arch: int = 90, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                     causal: bool = True, dot_fp32: bool | None = None, seq: int = 4096,
                     heads: int = 8, kv_heads: int = 2, v_head_dim: int | None = None,
                     band: bool = False, softcap: bool = False) -> dict:
    """The four kernels compiled for an NVIDIA GPU of compute capability `arch` on a machine
    without one (Triton ships ptxas), as a launch on contiguous (1, seq, heads, head_dim)
    tensors (v: `v_head_dim`, default head_dim) would, with the mask switches `causal` and
    `band` and the softcap switch: {kernel name: Triton's compiled kernel}. This catches on a
    CPU what the interpreter lets through (types, constexpr scoping, shared-memory size).
    Needs the compiled kernels: a process without TRITON_INTERPRET."""
    import triton  # optional dependency: triton (GPU compilation only)
    from triton.backends.compiler import GPUTarget

    if is_interpreted():
        raise RuntimeError("compiling for a GPU needs the compiled kernels; run it in a process without TRITON_INTERPRET")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    flag = TritonBackend(dot_fp32=dot_fp32).dot_fp32(dtype)
    pad, v_pad = triton_fwd.head_dim_pad(head_dim), triton_fwd.head_dim_pad(v_head_dim)
    target = GPUTarget("cuda", arch, 32)
    group = heads // kv_heads

    def strides(prefix, h, d, letters="bshd"):
        shape = dict(b=1, s=seq, h=h, d=d)
        values, step = {}, 1
        for letter in reversed(letters):  # contiguous, innermost last
            values[f"stride_{prefix}{letter}"] = step
            step *= shape[letter]
        return values

    ints = dict(heads=heads, kv_heads=kv_heads, group=group, sq=seq, sk=seq, seq=seq, diagonal=0,
                lower=-seq // 8, sm_scale=0.125, softcap=30.0)
    for prefix, h, d in (("q", heads, head_dim), ("dq", heads, head_dim), ("o", heads, v_head_dim),
                         ("do", heads, v_head_dim), ("k", kv_heads, head_dim), ("dk", kv_heads, head_dim),
                         ("v", kv_heads, v_head_dim), ("dv", kv_heads, v_head_dim)):
        ints |= strides(prefix, h, d)
    for prefix in ("l", "d"):
        ints |= strides(prefix, heads, 1, "bhs")
    pointers = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, Out=torch.float32, O=torch.float32, Lse=torch.float32,
                    Delta=torch.float32, DQ=torch.float32, DK=torch.float32, DV=torch.float32)
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, HEAD_DIM_V=v_head_dim, HEAD_DIM_V_PAD=v_pad,
                  CAUSAL=causal, BAND=band, SOFTCAP=softcap, DOT_FP32=flag)
    widest = max(pad, v_pad)
    dkdv_config, dq_config = triton_bwd.bwd_config(widest, flag)
    jobs = [("forward", triton_fwd._attn_fwd, triton_fwd.fwd_config(widest, flag), common),
            ("backward dK/dV", triton_bwd._attn_bwd_dkdv, dkdv_config, common),
            ("backward dQ", triton_bwd._attn_bwd_dq, dq_config, common),
            ("backward preprocess", triton_bwd._attn_bwd_preprocess, dict(BLOCK_M=64),
             dict(HEAD_DIM=v_head_dim, HEAD_DIM_PAD=v_pad))]
    compiled = {}
    for name, kernel, config, consts in jobs:
        config = dict(config)
        options = {key: config.pop(key) for key in ("num_warps", "num_stages") if key in config}
        source = _ast_source(kernel, {**pointers, **ints}, {**consts, **config})
        compiled[name] = triton.compile(source, target=target, options=options)
    return compiled
