"""The model: a small Llama-style decoder, written as functions of a dict of parameters.

embedding -> L x [RMSNorm -> grouped-query attention with rotary embeddings (and learnable
sinks with --sinks) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.

Precision as mixed-precision training runs it: the parameters are float32 master weights;
every use casts its weight to the training dtype (so each use's gradient comes back in float32
and uses are summed in float32, as FSDP's float32 gradient reduction does), activations live
in the training dtype, RMSNorm and the rotary embedding compute in float32 and round once,
the logits are upcast to float32 for the loss. The sinks stay float32 (a logit per head).

`loss_of` runs the model on *pieces* of the same sequences (a ring rank's shard, the whole
sequence, or a single device's token chunks) and takes the attention as a function of every
piece's q, k, v, so one definition serves the ring and every single-device run. The loss is
the sum of the counted tokens' cross-entropy over `count`, the global number of counted
tokens: summed over every rank (or piece), the gradients are those of the one mean over the
global batch, exactly in exact arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..ring.merge import working_dtype
from ..spec import DTYPES
from .config import TrainConfig
from .data import Batch

ROPE_BASE = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02

# attend(qs, ks, vs, sinks) -> outs: one (q, k, v) per piece in, one output per piece out
Attend = Callable[[list, list, list, "torch.Tensor | None"], list]


def parameter_shapes(config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in the order they are initialised and reported."""
    d, hd, f = config.d_model, config.head_dim, config.ffn
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab, d)}
    for i in range(config.layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (d,), p + "wq": (d, config.heads * hd), p + "wk": (d, config.kv_heads * hd),
                       p + "wv": (d, config.kv_heads * hd), p + "wo": (config.heads * hd, d)})
        if config.sinks:
            shapes[p + "sinks"] = (config.heads,)
        shapes.update({p + "mlp_norm": (d,), p + "w_gate": (d, f), p + "w_up": (d, f), p + "w_down": (f, d)})
    shapes.update({"norm": (d,), "lm_head": (d, config.vocab)})
    return shapes


def init_parameters(config: TrainConfig) -> dict[str, torch.Tensor]:
    """float32 master weights drawn from the seed alone (the same in every run and on every
    rank): normal(0, 0.02) matrices, the residual outputs (wo, w_down) scaled by 1/sqrt(2L),
    norms at 1, sinks around ln(seq_len) (a sink that takes a share of each row that matters;
    a sink at 0 would hide a lost sink gradient in bf16)."""
    gen = torch.Generator().manual_seed(config.seed)
    params = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm"):
            params[name] = torch.ones(shape)
        elif name.endswith("sinks"):
            params[name] = math.log(config.seq_len) + torch.randn(shape, generator=gen)
        else:
            std = INIT_STD / math.sqrt(2 * config.layers) if name.endswith(("wo", "w_down")) else INIT_STD
            params[name] = torch.randn(shape, generator=gen) * std
    return params


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in the working dtype (float32; float64 stays float64), rounded once to x's dtype."""
    xf = x.to(working_dtype(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype) * weight


def rope_tables(rope: torch.Tensor, head_dim: int, device,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in `dtype` of the rotary positions `rope`: (n, 1, head_dim / 2) for positions
    (n,) shared by every sequence, (b, n, 1, head_dim / 2) for per-sequence positions (b, n)."""
    inv = 1.0 / ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=rope.device) / head_dim)
    angles = (rope.to(torch.float64)[..., None] * inv).to(dtype).to(device)
    return angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (b, n, heads, d) in the working dtype, rounded once to x's dtype."""
    half = x.shape[-1] // 2
    work = working_dtype(x.dtype)
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def decoder(params: dict[str, torch.Tensor], pieces: Sequence, attend: Attend, config: TrainConfig, device,
            dtype: torch.dtype, layer_call: Callable | None = None) -> list[torch.Tensor]:
    """The decoder's final hidden states (before the last norm), one per piece (anything with
    `tokens` (b, n) and `rope` (n,) or (b, n)), every weight cast to `dtype` at each use.
    `layer_call(fn, *xs)`, when given, runs each layer's `fn(*xs) -> xs` (e.g. under activation
    checkpointing)."""
    h, kvh, hd = config.heads, config.kv_heads, config.head_dim

    def w(name: str) -> torch.Tensor:  # one cast per use: each use's gradient returns to the master in float32
        return params[name].to(dtype)

    tables = [rope_tables(p.rope, hd, device, working_dtype(dtype)) for p in pieces]

    def layer(i: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pre = f"layers.{i}."
        qs, ks, vs = [], [], []
        for x, (cos, sin) in zip(xs, tables):
            b, n, _ = x.shape
            a = rms_norm(x, w(pre + "attn_norm"))
            qs.append(rotate((a @ w(pre + "wq")).view(b, n, h, hd), cos, sin))
            ks.append(rotate((a @ w(pre + "wk")).view(b, n, kvh, hd), cos, sin))
            vs.append((a @ w(pre + "wv")).view(b, n, kvh, hd))
        outs = attend(qs, ks, vs, params.get(pre + "sinks"))
        new = []
        for x, out in zip(xs, outs):
            x = x + out.reshape(*out.shape[:2], h * hd) @ w(pre + "wo")
            m = rms_norm(x, w(pre + "mlp_norm"))
            new.append(x + (F.silu(m @ w(pre + "w_gate")) * (m @ w(pre + "w_up"))) @ w(pre + "w_down"))
        return tuple(new)

    xs = tuple(F.embedding(p.tokens.to(device), w("embed")) for p in pieces)
    for i in range(config.layers):
        xs = layer(i, *xs) if layer_call is None else layer_call(lambda *a, i=i: layer(i, *a), *xs)
    return list(xs)


def loss_of(params: dict[str, torch.Tensor], pieces: Sequence[Batch], attend: Attend, config: TrainConfig,
            count: int, device) -> torch.Tensor:
    """The counted tokens' cross-entropy summed over every piece, over `count` (float32)."""
    dtype = DTYPES[config.dtype]
    xs = decoder(params, pieces, attend, config, device, dtype)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for x, p in zip(xs, pieces):
        # a piece with no counted target (a rank holding only questions' sources, or padding) adds 0, yet its
        # graph still reaches every parameter: its ring backward runs like every rank's
        counted = p.counted.to(device)
        logits = (rms_norm(x[counted], params["norm"].to(dtype)) @ params["lm_head"].to(dtype)).float()
        total = total + F.cross_entropy(logits, p.labels.to(device)[counted], reduction="sum")
    return total / count
