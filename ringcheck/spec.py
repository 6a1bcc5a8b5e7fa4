"""Frozen descriptions of an attention problem, a ring, and an error budget, and the one
argument-validation vocabulary (`check_*`): the same argument gets the same rule and the same
message everywhere (the ring, the references, the commands).

No I/O and no environment reads here: every other module receives these objects explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# the references also take float64 inputs (the truth is float64)
REFERENCE_DTYPES: dict[str, torch.dtype] = {**DTYPES, "float64": torch.float64}
LAYOUTS = ("contiguous", "zigzag", "striped")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The short name (`"bfloat16"`) of a supported dtype given as a name or a torch dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise TypeError(f"dtype={dtype} is not supported; choose one of {sorted(DTYPES)}")


DEFAULT_TIMEOUT = 60.0  # seconds, for every wait of the ring and every collective we start

_NOT_INITIALIZED = ("torch.distributed is not initialized: launch with `torchrun --nproc-per-node=<P> ...` "
                    "or call torch.distributed.init_process_group(...) before {what}")


# ------------------------------------------------------------------ the validation vocabulary

def check_int(name: str, value: object, *, low: int = 1) -> int:
    """An int >= `low` (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """An int >= 1 (bool refused)."""
    return check_int(name, value, low=1)


def check_causal(causal: object) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return causal


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {list(LAYOUTS)}")
    return layout  # type: ignore[return-value]


def check_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    """The scale to use: `1/sqrt(head_dim)` for None, else a finite positive number."""
    if softmax_scale is None:
        return default_scale(head_dim)
    if isinstance(softmax_scale, bool) or not (
            isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return float(softmax_scale)


def check_timeout(timeout: object) -> float:
    """A timeout in seconds: a finite positive number, returned as float."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def check_qkv(q: object, k: object, v: object, *, what: str = "shard",
              dtypes: dict[str, torch.dtype] = DTYPES, same_length: bool = True) -> None:
    """Raise TypeError/ValueError unless q, k, v form one valid attention input:
    q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim), one dtype of
    `dtypes`, one device, no empty dimension.

    The ring uses the defaults. The references pass ``dtypes=REFERENCE_DTYPES`` (the truth
    also takes float64 inputs) and ``same_length=False`` (a reference also computes one
    block, whose query and key lengths may differ: causal is aligned bottom-right there)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes.values():
            raise TypeError(f"{name} has dtype {t.dtype}; supported floating-point dtypes: {sorted(dtypes)}")
        if min(t.shape) < 1:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):  # type: ignore[union-attr]
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")  # type: ignore[union-attr]
    if not (q.device == k.device == v.device):  # type: ignore[union-attr]
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")  # type: ignore[union-attr]
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)  # type: ignore[union-attr]
    if ks != vs:
        raise ValueError(f"k and v must have one shape, got {ks} and {vs}")
    if qs[0] != ks[0] or qs[3] != ks[3] or (same_length and qs[1] != ks[1]):
        agree = f"batch, {what} length and head_dim" if same_length else "batch and head_dim"
        raise ValueError(f"q {qs} and k {ks} must agree on {agree}")
    if qs[2] % ks[2]:
        raise ValueError(f"heads={qs[2]} (q) is not divisible by kv_heads={ks[2]} (k, v)")


def check_dout(dout: object, q: torch.Tensor) -> None:
    """dout is a tensor of q's shape."""
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout must be a torch.Tensor, got {type(dout).__name__}")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}")


def check_rows(rows: object, seq_len: int) -> torch.Tensor:
    """Query row indices: a non-empty 1-D sequence of ints in [0, seq_len), as int64."""
    values = rows.tolist() if isinstance(rows, torch.Tensor) else rows
    try:
        flat = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"rows must be a non-empty 1-D sequence of query indices, got {rows!r}") from None
    if flat.dim() != 1 or flat.numel() == 0 or flat.is_floating_point() or flat.dtype == torch.bool:
        raise ValueError(f"rows must be a non-empty 1-D sequence of query indices, got {rows!r}")
    flat = flat.to(torch.int64)
    if int(flat.min()) < 0 or int(flat.max()) >= seq_len:
        raise ValueError(f"rows must lie in [0, {seq_len}) (the query length), got min {int(flat.min())}, "
                         f"max {int(flat.max())}")
    return flat


def require_distributed(what: str) -> None:
    """RuntimeError with the fix unless torch.distributed is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(_NOT_INITIALIZED.format(what=what))



@dataclass(frozen=True)
class AttentionSpec:
    """One attention problem on whole tensors: q is (batch, seq_len, heads, head_dim) and
    k, v are (batch, seq_len, kv_heads, head_dim)."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "kv_heads", "seq_len", "head_dim"):
            check_positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}: grouped-query "
                f"attention needs heads to be a multiple of kv_heads (e.g. kv_heads="
                f"{math.gcd(self.heads, self.kv_heads)})"
            )
        check_softmax_scale(self.softmax_scale, self.head_dim)

    @property
    def scale(self) -> float:
        return default_scale(self.head_dim) if self.softmax_scale is None else float(self.softmax_scale)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for multi-head attention)."""
        return self.heads // self.kv_heads

    def replace(self, **changes) -> "AttentionSpec":
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields.update(changes)
        return AttentionSpec(**fields)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class RingSpec:
    """A ring of `world_size` ranks holding the sequence in `layout`."""

    world_size: int
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        check_positive_int("world_size", self.world_size)
        check_layout(self.layout)

    @property
    def chunks(self) -> int:
        """How many equal pieces the layout cuts the sequence into before dealing them out."""
        return 2 * self.world_size if self.layout == "zigzag" else self.world_size

    def check_seq_len(self, seq_len: int) -> int:
        """Validate that `seq_len` can be laid out; return the tokens per rank."""
        if seq_len % self.chunks:
            if self.layout == "zigzag":
                why = f"2 x world_size={2 * self.world_size} for the zigzag layout"
            else:
                why = f"world_size={self.world_size} for the {self.layout} layout"
            fix = (seq_len // self.chunks + 1) * self.chunks
            raise ValueError(
                f"seq_len={seq_len} is not divisible by {why}; use a multiple of it "
                f"(e.g. seq_len={fix}) or pad the sequence"
            )
        return seq_len // self.world_size


@dataclass(frozen=True)
class Budget:
    """flash-attention's rule: error to the truth <= k x (peer's error to the truth) + slack.

    The peer is the same computation done naively in the input dtype on one device; the
    slack is the rounding floor of the output dtype, 2 * |(ref + 0.3 - 0.3) - ref|.
    """

    k_forward: float = 2.0
    k_backward: float = 3.0

    def __post_init__(self) -> None:
        for name in ("k_forward", "k_backward"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 1):
                raise ValueError(f"{name} must be a number >= 1, got {value!r}")

    def k_for(self, tensor: str) -> float:
        return self.k_forward if tensor in ("out", "lse") else self.k_backward
