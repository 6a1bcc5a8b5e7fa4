"""Seeded inputs: the same spec and seed give the same q, k, v, dout on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import AttentionSpec, RingSpec, sink_offset
from .distributions import generate, min_head_dim


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    sinks: torch.Tensor | None = None  # (heads,) float32 sink logits, when the spec has sinks


def make_inputs(spec: AttentionSpec, *, seed: int, distribution: str = "normal",
                device: torch.device | str = "cpu", ring: RingSpec | None = None) -> Inputs:
    """Whole-sequence inputs for `spec` in its dtype, drawn on the CPU from `seed` (so every
    rank and every device gets identical values) and then moved to `device`. `ring` is
    needed by distributions that place values by ring step (``late-max``)."""
    gen = torch.Generator().manual_seed(int(seed))
    q, k, v, dout = generate(distribution, spec, gen, ring)
    if spec.dv != spec.head_dim:  # values (and dout) of their own head dim, same distribution
        v_spec = spec.replace(head_dim=spec.dv, v_head_dim=None)
        # a distribution that places its maxima in q.k directions (late-max) needs a head dim
        # wide enough for them; v's head dim then draws normal values (v does not place maxima)
        v_dist = distribution if spec.dv >= min_head_dim(distribution, ring) else "normal"
        _, _, v, dout = generate(v_dist, v_spec, gen, ring)
    sinks = None
    if spec.sinks is not None:
        sinks = (sink_offset(spec.sinks, spec.seq_len) + torch.randn(spec.heads, generator=gen)).to(device)
    dt = spec.torch_dtype
    return Inputs(*(t.to(dt).to(device) for t in (q, k, v, dout)), sinks=sinks)


# the tiles block kernels walk a shard in (flash-attn 64/128, Triton autotuned 16-128): the last,
# partial tile of a shard longer than one and not a multiple of it is where kernels break
TILES = (16, 32, 64, 128)


def sample_rows(seq_len: int, count: int, seed: int) -> torch.Tensor:
    """`count` query rows of a sequence (at most seq_len): the first and the last, plus random
    others, sorted, without repeats; the same for every rank."""
    g = torch.Generator().manual_seed(seed + 7919)
    count = min(count, seq_len)
    picked = {0, seq_len - 1} if count >= 2 else {seq_len - 1}
    for idx in torch.randperm(seq_len, generator=g).tolist():
        if len(picked) >= count:
            break
        picked.add(idx)
    return torch.tensor(sorted(picked), dtype=torch.int64)


def with_sampled_rows(inputs: Inputs, rows: torch.Tensor) -> Inputs:
    """The inputs with dout zero except on `rows`: then dq of those rows and dk, dv of every
    key have an exact O(rows x N) reference (`judge.check.row_results`)."""
    keep = torch.zeros(inputs.dout.shape[1], dtype=inputs.dout.dtype)
    keep[rows] = 1
    return Inputs(inputs.q, inputs.k, inputs.v, inputs.dout * keep[None, :, None, None].to(inputs.dout.device),
                  inputs.sinks)
