"""What `ringcheck plan` is asked: the model, the sequence, the parallelism, the training
conventions and the hardware, checked once (ValueError names the value and the fix)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from .hardware import DEFAULT_RESERVE_GIB, GIB, Device, Link, device, link
from .model import ModelShape
from .ring import KERNELS

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
# optimizer name -> (what it keeps, in words); bytes per parameter in `Settings.optimizer_bytes`
OPTIMIZERS = {
    "adam-mixed": "mixed-precision Adam (ZeRO paper's convention): weights and gradients in the model's dtype, "
                  "a float32 master copy and two float32 moments (4 + 4 + 4 bytes per parameter; no master "
                  "copy when the model is float32)",
    "adam": "Adam with its two moments in the model's dtype, no master copy",
    "sgd": "SGD without momentum: weights and gradients only",
}
LAYOUTS = ("zigzag", "contiguous", "striped")
_EVERY = re.compile(r"every-([0-9]+)")


def checkpoint_segment(policy: str, layers: int) -> int | None:
    """Layers per checkpointed segment: None for `none`, 1 for `full`, k for `every-k`."""
    if policy == "none":
        return None
    if policy == "full":
        return 1
    found = _EVERY.fullmatch(policy)
    if not found or int(found.group(1)) < 1:
        raise ValueError(f"--checkpointing {policy!r}: choose none, full (every layer's input is kept and the "
                         f"layer recomputed) or every-K (segments of K layers, e.g. every-2)")
    return min(int(found.group(1)), layers)


@dataclass(frozen=True)
class Settings:
    model: ModelShape
    seq_len: int
    cp: int
    dp: int = 1
    batch: int = 1               # sequences in one micro-batch
    micro_batches: int = 1       # micro-batches per optimizer step (gradient accumulation, one after another)
    dtype: str = "bf16"
    checkpointing: str = "none"
    optimizer: str = "adam-mixed"
    zero: int = 0                # 0 replicated; 1 optimizer, 2 + gradients, 3 + weights sharded over dp x cp
    device: str = "h100"
    link: str | None = None      # None: the device's own
    memory_gib: float | None = None
    tflops: float | None = None
    reserve_gib: float = DEFAULT_RESERVE_GIB
    layout: str = "zigzag"
    causal: bool = True
    kernel: str = "flash-attn2"
    loss_chunk: int | None = None  # tokens whose logits exist at once (a chunked or fused loss); None: all of them
    compute_efficiency: float = 1.0
    link_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("seq_len", "cp", "dp", "batch", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        if self.loss_chunk is not None and (isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int)
                                            or self.loss_chunk < 1):
            raise ValueError(f"--loss-chunk must be a number of tokens >= 1, got {self.loss_chunk!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        checkpoint_segment(self.checkpointing, self.model.layers)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero {self.zero!r}: choose 0 (replicated), 1 (optimizer state sharded over "
                             f"dp x cp), 2 (and gradients) or 3 (and weights, as FSDP)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout!r}: choose one of {', '.join(LAYOUTS)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"--kernel {self.kernel!r}: choose one of {', '.join(KERNELS)}")
        for name in ("memory_gib", "tflops", "compute_efficiency", "link_efficiency"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")
        for name in ("compute_efficiency", "link_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"--{name.replace('_', '-')} is a share of the datasheet peak, at most 1, got "
                                 f"{getattr(self, name)!r}")
        if not (isinstance(self.reserve_gib, (int, float)) and 0 <= self.reserve_gib < math.inf):
            raise ValueError(f"--reserve-gib must be a number >= 0, got {self.reserve_gib!r}")
        self.check_cp(self.cp)
        self.hardware()  # an unknown device or link fails here
        if self.usable_bytes() <= 0:
            raise ValueError(f"--reserve-gib {self.reserve_gib:g} leaves nothing of the {self.device_spec().memory_gib:g} "
                             f"GiB of the {self.device}")

    def check_cp(self, cp: int) -> None:
        """ValueError unless a ring of `cp` GPUs can hold seq_len tokens in this layout."""
        parts = 2 * cp if self.layout == "zigzag" and self.causal else cp
        if self.seq_len % parts:
            what = f"2 x --cp {cp} (the zigzag layout holds two chunks per GPU)" if parts != cp else f"--cp {cp}"
            raise ValueError(f"--seq-len {self.seq_len} is not divisible by {what}; pick a sequence length that "
                             f"is, or another --cp")

    def fits_layout(self, cp: int) -> bool:
        try:
            self.check_cp(cp)
        except ValueError:
            return False
        return True

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def device_spec(self) -> Device:
        found = device(self.device)
        if self.memory_gib is None and self.tflops is None:
            return found
        return Device(found.name, found.what + " (with overrides)",
                      found.memory_gib if self.memory_gib is None else self.memory_gib,
                      found.bf16_tflops if self.tflops is None else self.tflops,
                      found.fp32_tflops if self.tflops is None else self.tflops, found.link,
                      found.source + "; overridden on the command line")

    def link_spec(self) -> Link:
        return link(self.link or self.device_spec().link, self.device)

    def hardware(self) -> tuple[Device, Link]:
        return self.device_spec(), self.link_spec()

    def usable_bytes(self) -> float:
        return (self.device_spec().memory_gib - self.reserve_gib) * GIB

    def flops_per_s(self) -> float:
        spec = self.device_spec()
        return (spec.bf16_tflops if self.e == 2 else spec.fp32_tflops) * 1e12 * self.compute_efficiency

    def optimizer_bytes(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes per parameter, unsharded."""
        e = self.e
        if self.optimizer == "adam-mixed":
            return e, e, 8 + (4 if e < 4 else 0)
        if self.optimizer == "adam":
            return e, e, 2 * e
        return e, e, 0

    def to_dict(self) -> dict:
        values = asdict(self)
        values["model"] = asdict(self.model)
        return values
