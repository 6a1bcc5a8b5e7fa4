"""Frozen descriptions of an attention problem, a ring, and an error budget.

No I/O and no environment reads here: every other module receives these objects explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
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


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


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
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}: grouped-query "
                f"attention needs heads to be a multiple of kv_heads (e.g. kv_heads="
                f"{math.gcd(self.heads, self.kv_heads)})"
            )
        if self.softmax_scale is not None and not (
            isinstance(self.softmax_scale, (int, float)) and math.isfinite(self.softmax_scale)
            and self.softmax_scale > 0
        ):
            raise ValueError(f"softmax_scale must be a finite positive number, got {self.softmax_scale!r}")

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
        _positive_int("world_size", self.world_size)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is unknown; choose one of {list(LAYOUTS)}")

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
