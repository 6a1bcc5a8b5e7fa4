"""Bytes per GPU of one training step: weights, gradients, optimizer state, activations (the
ring's and the rest of each layer's, under the checkpointing policy), the ring's buffers; the
peak, whether it fits, and the smallest ring that fits.

The peak is the model state plus what the activations hold at their worst moment: every layer's
kept tensors (or, with checkpointing, every segment's input) plus the larger of

- the loss: the logits in the model's dtype, the float32 log-softmax the cross-entropy keeps,
  and the float32 gradient of the logits, for every token at once or (--loss-chunk) for one
  chunk of tokens at a time, as chunked and fused cross-entropy losses do;
- one layer's backward: the segment being recomputed (its layers' kept tensors), the backward's
  own gradients (`ModelShape.backward_working_elements`) and the ring's call (its buffers in
  flight and its kernel's tensors, `ring.call_peak`, less what the layer keeps anyway).

Model state with ZeRO stage z over the S = dp x cp GPUs that hold replicas of the weights
(FSDP and Megatron's distributed optimizer shard over the context-parallel ranks too): the
optimizer state is divided by S from stage 1, the gradients from stage 2, the weights from
stage 3, which then gathers one layer at a time (two with prefetch) for its forward and backward.
"""

from __future__ import annotations

import math

from .ring import Shape, call_peak, saved_bytes
from .settings import Settings, checkpoint_segment

REST_RSTD_BYTES = 8  # per token and layer: the two norms' float32 rstd


def attention_shape(s: Settings, cp: int) -> Shape:
    m = s.model
    return Shape(batch=s.batch, n=s.seq_len // cp, heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim, e=s.e)


def model_state(s: Settings, cp: int) -> dict[str, int]:
    """Bytes per GPU of the weights, gradients and optimizer state."""
    params = s.model.parameters()
    per_weight, per_grad, per_state = s.optimizer_bytes()
    shards = s.dp * cp
    weights = params * per_weight
    if s.zero >= 3:
        weights = math.ceil(weights / shards) + 2 * s.model.layer_parameters() * per_weight
    grads = params * per_grad if s.zero < 2 else math.ceil(params * per_grad / shards)
    state = params * per_state if s.zero < 1 else math.ceil(params * per_state / shards)
    return {"weights": weights, "gradients": grads, "optimizer": state}


def activations(s: Settings, cp: int) -> dict:
    """The activations' bytes per GPU for one micro-batch, itemised (module docstring)."""
    m, shape = s.model, attention_shape(s, cp)
    tokens = s.batch * shape.n
    attention = saved_bytes(shape)
    rest = tokens * (m.rest_elements() * s.e + REST_RSTD_BYTES)
    layer = attention + rest
    layer_input = tokens * m.hidden * s.e
    segment = checkpoint_segment(s.checkpointing, m.layers)
    if segment is None:
        kept, recompute = m.layers * layer, 0
    else:
        kept = math.ceil(m.layers / segment) * layer_input
        recompute = segment * layer - layer_input
    ring = call_peak(shape, layout=s.layout, causal=s.causal, world_size=cp, kernel=s.kernel)
    # what the call holds beyond the layer's kept tensors: its float32 output and lse are kept,
    # and the output it returns in the model's dtype is the output projection's kept input
    returned = shape.q(size=shape.e) if shape.e != shape.w else 0
    in_call = ring["bytes"] - shape.q() - shape.rows() - (returned if ring["pass"] else 0)
    backward = tokens * m.backward_working_elements() * s.e
    loss = s.batch * min(shape.n, s.loss_chunk or shape.n) * m.vocab * (s.e + 4 + 4)
    layer_peak = recompute + backward + in_call
    return {
        "attention_per_layer": attention, "rest_per_layer": rest, "layer_input": layer_input,
        "kept": kept, "recompute": recompute, "backward_working": backward, "ring_call": in_call,
        "ring_call_detail": ring, "loss": loss, "peak_moment": "loss" if loss >= layer_peak else "layer backward",
        "peak": kept + max(loss, layer_peak),
    }


def breakdown(s: Settings, cp: int) -> dict:
    """Everything one GPU holds at the step's peak, and whether it fits the device."""
    state = model_state(s, cp)
    acts = activations(s, cp)
    total = sum(state.values()) + acts["peak"]
    usable = s.usable_bytes()
    return {"cp": cp, **state, "activations": acts, "total": total, "usable": usable, "fits": total <= usable}


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def smallest_cp(s: Settings) -> dict:
    """The smallest ring (a divisor of the sequence the layout can hold) whose per-GPU peak fits;
    the memory only falls as the ring grows, so the first that fits is the answer. Without one,
    the largest ring's figures say what does not shrink."""
    candidates = [p for p in divisors(s.seq_len) if s.fits_layout(p)]
    for cp in candidates:
        found = breakdown(s, cp)
        if found["fits"]:
            return {"cp": cp, "total": found["total"], "why": f"the smallest ring whose peak fits: "
                                                                 f"{found['total'] / 2 ** 30:.1f} GiB at P = {cp}"}
    largest = breakdown(s, candidates[-1])
    state = largest["weights"] + largest["gradients"] + largest["optimizer"]
    fix = "shard them: --zero 1, 2 or 3" if s.zero < 3 else "more --dp shards them further"
    return {"cp": None, "total": largest["total"],
            "why": f"no ring fits: even at P = {candidates[-1]} the peak is {largest['total'] / 2 ** 30:.1f} GiB, "
                   f"of which weights, gradients and optimizer state take {state / 2 ** 30:.1f} GiB ({fix})"}
