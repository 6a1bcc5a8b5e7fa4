"""What `ringcheck train` runs: the implementation, the ring and its mesh, the model (a preset,
its shape flags over it), the data's length and batch, the attention variants, the optimiser.

`TrainConfig` holds the flags as given (None: the preset's value) and resolves them once, in
`__post_init__`, into concrete numbers; every value is checked there, with the value received
and the fix, so a bad flag ends the command before any rank starts. A config also answers the
questions a built-in adapter's own rules ask of a validate target (`full_spec`, `causal`,
`dtype`, `heads`, `layout`, `world_size`), so those rules apply to train unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..harness import Mesh
from ..judge.variant_options import VariantOptions
from ..ring.layouts import positions
from ..ring.loops import check_sinks_grad
from ..spec import AttentionSpec, RingSpec, check_int, is_custom_layout

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Preset:
    """A model and its data: the decoder's shape, the vocabulary, the sequence and the step size."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq_len: int
    batch: int
    lr: float


# tiny: CPU CI (the default run, 30 steps at P=4, within a minute on 2 cores: benchmarks/train_speed.py);
# small: a longer context and a wider model, for a machine with time to spare
PRESETS = {
    "tiny": Preset(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=64, seq_len=128, batch=2, lr=3e-3),
    "small": Preset(layers=4, heads=8, kv_heads=2, head_dim=32, vocab=256, seq_len=1024, batch=2, lr=1e-3),
}
SHAPE_FLAGS = ("layers", "heads", "kv_heads", "head_dim", "seq_len", "batch")
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1   # AdamW, as Llama-style pre-training runs it
FP16_LOSS_SCALE = 1024.0  # a static loss scale for float16 (small gradients would fall below its normal range)


def ffn_width(d_model: int) -> int:
    """SwiGLU's hidden width: 8/3 of the model width (Llama's), rounded up to a multiple of 32."""
    return 32 * math.ceil(8 * d_model / 3 / 32)


@dataclass(frozen=True)
class TrainConfig:
    """`ringcheck train`'s settings. Shape fields left None take the `model` preset's value."""

    impl: str = "ringcheck"
    layout: str = "zigzag"
    world_size: int = 4
    mesh: str | None = None          # `Mesh` text (dp=2,cp=4); None: one ring of world_size
    dtype: str = "bfloat16"
    steps: int = 30
    seed: int = 0
    model: str = "tiny"
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    seq_len: int | None = None
    batch: int | None = None
    documents: str | None = None
    pad: int = 0
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    sinks_grad: str = "partial"
    backend: str = "torch"           # our ring's block backend (--impl ringcheck)
    flash_attn_stand_in: bool = False

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"--model {self.model!r} is unknown; choose one of {sorted(PRESETS)}")
        preset = PRESETS[self.model]
        for name in SHAPE_FLAGS:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, getattr(preset, name))
            else:
                check_int(f"--{name.replace('_', '-')}", value, low=1)
        if self.window is not None:
            object.__setattr__(self, "window", tuple(self.window))
        check_int("--steps", self.steps, low=1)
        check_int("--world-size", self.world_size, low=1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not a training dtype; choose one of {list(DTYPES)}")
        if self.head_dim % 2:
            raise ValueError(f"--head-dim {self.head_dim} is odd; rotary embeddings rotate pairs of dims: pass an "
                             f"even head dim (e.g. {self.head_dim + 1})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}; grouped-query "
                             f"attention shares each K/V head among heads / kv_heads query heads (e.g. --kv-heads "
                             f"{math.gcd(self.heads, self.kv_heads)}, or --kv-heads {self.heads} for MHA)")
        check_sinks_grad(self.sinks_grad)
        if self.mesh is not None and self.mesh_spec.cp != self.world_size:
            raise ValueError(f"--mesh {self.mesh} has cp={self.mesh_spec.cp} but --world-size is {self.world_size}: "
                             f"the cp dim is the ring; drop --world-size or make the two agree")
        RingSpec(self.world_size, self.layout).check_seq_len(self.seq_len)
        self.full_spec()  # the variant at this length (documents add up, the layout takes them)

    # ---- what the run is made of

    @property
    def preset(self) -> Preset:
        return PRESETS[self.model]

    @property
    def vocab(self) -> int:
        return self.preset.vocab

    @property
    def lr(self) -> float:
        return self.preset.lr

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def ffn(self) -> int:
        return ffn_width(self.d_model)

    @property
    def causal(self) -> bool:
        return True  # a decoder

    @property
    def loss_scale(self) -> float:
        return FP16_LOSS_SCALE if self.dtype == "float16" else 1.0

    @property
    def mesh_spec(self) -> Mesh:
        return Mesh.ring(self.world_size) if self.mesh is None else Mesh.parse(self.mesh)

    @property
    def ring(self) -> RingSpec:
        return RingSpec(self.world_size, self.layout)

    @property
    def variants(self) -> VariantOptions:
        return VariantOptions(documents=self.documents, pad=self.pad, window=self.window, softcap=self.softcap,
                              sinks=self.sinks)

    def full_spec(self) -> AttentionSpec:
        """One attention call of the model (one CP group's batch, the whole sequence)."""
        variant, sinks, _ = self.variants.resolve(self.seq_len, self.ring, self.seed)
        spec = AttentionSpec(batch=self.batch, heads=self.heads, kv_heads=self.kv_heads, seq_len=self.seq_len,
                             head_dim=self.head_dim, dtype=self.dtype, causal=True, variant=variant, sinks=sinks)
        if self.layout == "zigzag_docs" or is_custom_layout(self.layout):  # checked before any rank starts
            positions(layout=self.layout, rank=0, world_size=self.world_size, seq_len=self.seq_len,
                      cu_seqlens=variant.cu_seqlens)
        return spec

    @property
    def cu_seqlens(self) -> tuple[int, ...] | None:
        return self.full_spec().variant.cu_seqlens

    def attention_kwargs(self) -> dict[str, Any]:
        """The variant keywords of every attention call (cu_seqlens as a tensor, window, softcap)."""
        return self.full_spec().variant_kwargs()

    # ---- words and flags

    def describe(self) -> str:
        sizes = (f"{self.layers} layers, {self.heads} heads ({self.kv_heads} K/V), head dim {self.head_dim}, "
                 f"width {self.d_model}, vocab {self.vocab}")
        return (f"{self.model} model ({sizes}); {self.steps} steps of batch {self.batch} x {self.seq_len} tokens in "
                f"{self.dtype}; {self.variants.describe()}")

    def flags(self) -> list[str]:
        """Every setting as the flags that give it (defaults spelled out, the shape resolved), so
        a change of defaults cannot change what a re-run command runs."""
        out = ["--impl", self.impl, "--layout", self.layout, "--world-size", str(self.world_size)]
        out += ["--mesh", self.mesh] if self.mesh is not None else []
        out += ["--dtype", self.dtype, "--steps", str(self.steps), "--seed", str(self.seed), "--model", self.model]
        out += [x for name in SHAPE_FLAGS for x in (f"--{name.replace('_', '-')}", str(getattr(self, name)))]
        out += self.variants.flags()
        out += ["--sinks-grad", self.sinks_grad] if self.sinks else []
        out += ["--backend", self.backend] if self.backend != "torch" else []
        out += ["--flash-attn-stand-in"] if self.flash_attn_stand_in else []
        return out

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc.update(d_model=self.d_model, ffn=self.ffn, vocab=self.vocab, lr=self.lr, loss_scale=self.loss_scale)
        if doc["window"] is not None:
            doc["window"] = list(doc["window"])
        return doc
