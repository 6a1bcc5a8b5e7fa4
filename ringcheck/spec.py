"""Frozen descriptions of an attention problem, a ring, and an error budget, and the one
argument-validation vocabulary (`check_*`): the same argument gets the same rule and the same
message everywhere (the ring, the references, the commands).

No I/O and no environment reads here: every other module receives these objects explicitly.
"""

from __future__ import annotations

import math
import re
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
RING_DTYPES = REFERENCE_DTYPES  # our ring runs float64 too, in float64 (ring.merge.working_dtype)
LAYOUTS = ("contiguous", "zigzag", "striped")
# layouts that balance per document: they need the packed sequence's `cu_seqlens`
DOC_LAYOUTS = ("zigzag_docs",)
ALL_LAYOUTS = LAYOUTS + DOC_LAYOUTS


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


_CUSTOM_LAYOUT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_custom_layout(layout: object) -> bool:
    """A layout named `module:function` (a user's: FN(rank, world_size, seq_len,
    cu_seqlens=None) -> the global positions that rank holds, in its local order)."""
    return isinstance(layout, str) and ":" in layout


def check_layout(layout: object) -> str:
    if is_custom_layout(layout):
        if not _CUSTOM_LAYOUT.match(layout):  # type: ignore[arg-type]
            raise ValueError(f"layout={layout!r} is neither a built-in layout nor `package.module:function` "
                             f"(a custom layout: FN(rank, world_size, seq_len, cu_seqlens=None) -> LongTensor)")
        return layout  # type: ignore[return-value]
    if layout not in ALL_LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; choose one of {list(ALL_LAYOUTS)} or a custom layout "
                         f"`package.module:function`")
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
    q (batch, seq, heads, head_dim), k (batch, seq, kv_heads, head_dim) and v (batch, seq,
    kv_heads, v_head_dim) - the value head dim may differ (MLA) -, one dtype of `dtypes`, one
    device, no empty dimension.

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
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must agree on (batch, seq, kv_heads), got {ks} and {vs} "
                         f"(only the head dim may differ: v may carry its own value head dim)")
    if qs[3] != ks[3]:
        raise ValueError(f"q {qs} and k {ks} must share the query/key head dim, got {qs[3]} and {ks[3]}; "
                         f"a value head dim of its own belongs on v, not on k")
    if qs[0] != ks[0] or (same_length and qs[1] != ks[1]):
        agree = f"batch and {what} length" if same_length else "batch"
        raise ValueError(f"q {qs} and k {ks} must agree on {agree}")
    if qs[2] % ks[2]:
        raise ValueError(f"heads={qs[2]} (q) is not divisible by kv_heads={ks[2]} (k, v)")


def check_dout(dout: object, q: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """dout is a tensor shaped like the output: q's shape with v's head dim (when v is given)."""
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout must be a torch.Tensor, got {type(dout).__name__}")
    want = tuple(q.shape) if v is None else (*q.shape[:3], v.shape[3])
    if tuple(dout.shape) != want:
        what = "q's shape" if v is None else "q's shape with v's head dim"
        raise ValueError(f"dout must have {what}, {want}, got {tuple(dout.shape)}")


# ------------------------------------------------------------------ attention variants

def check_cu_seqlens(cu_seqlens: object, seq_len: int) -> tuple[int, ...] | None:
    """Global document boundaries of a packed sequence: an int32/int64 tensor (or a sequence of
    ints) (num_docs + 1,), starting at 0, non-decreasing, last entry <= seq_len; returned as
    a tuple of ints (None stays None). Tokens from the last entry on are padding."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got dtype {cu_seqlens.dtype}; "
                            f"convert it with .to(torch.int32)")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D (num_docs + 1,), got shape {tuple(cu_seqlens.shape)}")
        values = [int(x) for x in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        values = list(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be an int32/int64 tensor of document boundaries, got {cu_seqlens!r}")
    if not values:
        raise ValueError("cu_seqlens is empty; it needs (num_docs + 1) boundaries starting at 0, e.g. [0, seq_len]")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]} (cu_seqlens={values}); prepend 0")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing, but entry {i} ({values[i]}) < entry {i - 1} "
                             f"({values[i - 1]}); it holds cumulative document lengths")
    if values[-1] > seq_len:
        raise ValueError(f"cu_seqlens ends at {values[-1]}, past seq_len={seq_len}; the last entry is where the "
                         f"documents end (<= seq_len, the rest is padding)")
    return tuple(values)


def check_window(window: object) -> tuple[int, int]:
    """A sliding window (left, right) in flash-attention's convention: query i sees key j iff
    i - left <= j <= i + right, -1 unbounded on that side. None means (-1, -1)."""
    if window is None:
        return (-1, -1)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in window)):
        raise TypeError(f"window must be a pair of ints (left, right), -1 for unbounded, got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window=({left}, {right}) has a side below -1; use -1 for unbounded or a size >= 0")
    return (left, right)


def check_softcap(softcap: object) -> float | None:
    """A logit softcap: None (no cap) or a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r} "
                         f"(0 means no cap in some libraries: pass None here)")
    return float(softcap)


def check_sinks(sinks: object, heads: int, device: torch.device | None = None) -> torch.Tensor | None:
    """Attention sinks: None or a floating-point tensor (heads,), one logit per query head."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor (heads,) of logits, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    if device is not None and sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {device}; move them to q's device")
    return sinks


@dataclass(frozen=True)
class Variant:
    """The mask- and score-changing options of one attention problem (all optional):
    packed documents (`cu_seqlens`, global boundaries; the tail past the last one is padding),
    a sliding `window` (left, right) and a logit `softcap`. Sinks are a tensor input, not
    part of it. `Variant()` is plain attention."""

    cu_seqlens: tuple[int, ...] | None = None
    window: tuple[int, int] = (-1, -1)
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.cu_seqlens is not None:
            cu = tuple(self.cu_seqlens.tolist() if isinstance(self.cu_seqlens, torch.Tensor) else self.cu_seqlens)
            object.__setattr__(self, "cu_seqlens", check_cu_seqlens(cu, max(cu, default=0)))
        object.__setattr__(self, "window", check_window(self.window))
        object.__setattr__(self, "softcap", check_softcap(self.softcap))

    @staticmethod
    def of(*, cu_seqlens=None, window=None, softcap=None, seq_len: int) -> Variant:
        """The validated variant of a call's keyword arguments."""
        return Variant(check_cu_seqlens(cu_seqlens, seq_len), check_window(window), check_softcap(softcap))

    @property
    def masks_tokens(self) -> bool:
        """Whether documents or a window change which keys a query sees (beyond causal)."""
        return self.cu_seqlens is not None or self.window != (-1, -1)

    def check_seq_len(self, seq_len: int) -> None:
        if self.cu_seqlens is not None:
            check_cu_seqlens(self.cu_seqlens, seq_len)

    def kwargs(self) -> dict:
        """cu_seqlens (as an int64 tensor), window, softcap: those that are not plain attention."""
        out: dict = {}
        if self.cu_seqlens is not None:
            out["cu_seqlens"] = torch.tensor(self.cu_seqlens, dtype=torch.int64)
        if self.window != (-1, -1):
            out["window"] = self.window
        if self.softcap is not None:
            out["softcap"] = self.softcap
        return out

    def describe(self) -> list[str]:
        words = []
        if self.cu_seqlens is not None:
            words.append(f"cu_seqlens={list(self.cu_seqlens)}")
        if self.window != (-1, -1):
            words.append(f"window={self.window}")
        if self.softcap is not None:
            words.append(f"softcap={self.softcap:g}")
        return words


# how the (heads,) sink logits of a case are drawn: N(0, 1) plus an offset: none, far above or
# far below every score, or "typical": ln(seq_len), the lse of a row spread evenly over the
# sequence, so that the sink takes a share of each row's mass that matters
SINK_KINDS = ("normal", "high", "low", "typical")


def sink_offset(kind: str, seq_len: int) -> float:
    """The offset of the sink logits of `kind` (see SINK_KINDS) for a sequence of seq_len."""
    offsets = {"normal": 0.0, "high": 40.0, "low": -40.0, "typical": math.log(seq_len)}
    if kind not in offsets:
        raise ValueError(f"sinks={kind!r} is unknown; choose one of {list(SINK_KINDS)}")
    return offsets[kind]


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
    """One attention problem on whole tensors: q is (batch, seq_len, heads, head_dim), k is
    (batch, seq_len, kv_heads, head_dim) and v (batch, seq_len, kv_heads, v_head_dim) (None:
    head_dim). `variant` holds documents, window and softcap; `sinks` names how the (heads,)
    sink logits are drawn (`SINK_KINDS`), None for no sinks."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = False
    softmax_scale: float | None = None
    v_head_dim: int | None = None
    variant: Variant = Variant()
    sinks: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "kv_heads", "seq_len", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if self.v_head_dim is not None:
            check_positive_int("v_head_dim", self.v_head_dim)
        if not isinstance(self.variant, Variant):
            raise TypeError(f"variant must be a ringcheck.spec.Variant, got {self.variant!r}")
        self.variant.check_seq_len(self.seq_len)
        if self.sinks is not None and self.sinks not in SINK_KINDS:
            raise ValueError(f"sinks={self.sinks!r} is unknown; choose one of {list(SINK_KINDS)} or None")
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
    def dv(self) -> int:
        """The value (and output) head dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def variant_kwargs(self) -> dict:
        """The keyword arguments (cu_seqlens, window, softcap) every entry point takes for
        this spec's variant; only those that differ from plain attention."""
        return self.variant.kwargs()

    def describe_variant(self) -> str:
        """Words for the variant ('' for plain attention)."""
        words = self.variant.describe()
        if self.sinks is not None:
            words.append(f"sinks={self.sinks}")
        if self.v_head_dim is not None:
            words.append(f"d_v={self.v_head_dim}")
        return " ".join(words)

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for multi-head attention)."""
        return self.heads // self.kv_heads

    def replace(self, **changes) -> AttentionSpec:
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
        return 2 * self.world_size if self.layout in ("zigzag", "zigzag_docs") else self.world_size

    def check_seq_len(self, seq_len: int) -> int:
        """Validate that `seq_len` can be laid out; return the tokens per rank."""
        if seq_len % self.chunks:
            if self.chunks != self.world_size:
                why = f"2 x world_size={2 * self.world_size} for the {self.layout} layout"
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
