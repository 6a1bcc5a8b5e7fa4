"""A ring step's communication against its compute, from the device's rate and the link's
bandwidth: is the transfer hidden behind the block computation?

One ring step of one layer's attention: this GPU sends its current K/V block to the next GPU
and receives the next one while it computes its block(s) with the one it holds (the backward
also sends the float32 dK/dV accumulators along). The transfer is hidden when it takes no
longer than the compute; the ring moves at its busiest rank's pace, so the compute is the
busiest rank's (`ring.busiest_pairs`). Times use the datasheet peaks scaled by
--compute-efficiency and --link-efficiency: a kernel at 60% of peak takes longer and hides
more, a link below its datasheet rate hides less. Per-message latency (microseconds on NVLink)
is left out: at the lengths where rings are used a step moves megabytes.
"""

from __future__ import annotations

from .hardware import LINKS, Link
from .memory import attention_shape
from .ring import BACKWARD_WORK, attention_flops, busiest_pairs, hiding_length
from .settings import Settings


def ring_link(s: Settings, cp: int) -> tuple[Link, str | None]:
    """The link a ring of `cp` GPUs runs over, and a note where the chosen one cannot join them all."""
    chosen = s.link_spec()
    if chosen.max_ring is not None and cp > chosen.max_ring:
        fallback = LINKS["pcie4"]
        return fallback, (f"{chosen.what} joins {chosen.max_ring} GPUs; a ring of {cp} crosses {fallback.what} "
                          f"on some hops, and the slowest hop sets every step: timed at {fallback.gb_per_s:g} GB/s")
    return chosen, None


def ring_steps(s: Settings, cp: int) -> dict:
    """Per pass (forward, backward): the first step (the diagonal block) and a steady step's
    bytes, seconds of transfer and of compute, and whether the transfer is hidden; the exposed
    transfer time of one attention call, and the fewest tokens per GPU that hide a steady step."""
    shape = attention_shape(s, cp)
    link, note = ring_link(s, cp)
    rate, bandwidth = s.flops_per_s(), link.gb_per_s * 1e9 * s.link_efficiency
    flops = attention_flops(shape, layout=s.layout, causal=s.causal, world_size=cp)
    result = {"link": link.name, "link_gb_per_s": link.gb_per_s, "note": note, "passes": {}}
    if cp == 1:
        result["note"] = "no ring at P = 1: nothing travels"
        return result
    n = shape.n
    steady_work = busiest_pairs(s.layout, s.causal, cp, n)[1] / (n * n)
    for name, backward in (("forward", False), ("backward", True)):
        factor = BACKWARD_WORK if backward else 1.0
        payload = shape.kv_block() + (shape.grad_block() if backward else 0)
        steps = []
        for step, f in enumerate(flops):
            sends = step < cp - 1 or backward  # the backward's last step sends the accumulators home
            size = (payload if step < cp - 1 else shape.grad_block()) if sends else 0
            comm, compute = size / bandwidth, f * factor / rate
            steps.append({"step": step, "bytes": size, "comm_s": comm, "compute_s": compute,
                          "hidden": comm <= compute})
        steady = steps[1]
        result["passes"][name] = {
            "first": steps[0], "steady": steady,
            "ratio": steady["comm_s"] / steady["compute_s"] if steady["compute_s"] else float("inf"),
            "exposed_s": sum(max(0.0, x["comm_s"] - x["compute_s"]) for x in steps),
            "compute_s": sum(x["compute_s"] for x in steps),
            "hiding_tokens": hiding_length(shape, work=steady_work, backward=backward, flops_per_s=rate,
                                           bytes_per_s=bandwidth),
        }
    return result


def optimizer_step(s: Settings, cp: int) -> dict:
    """One optimizer step on one GPU: its model compute (M micro-batches of forward, backward and
    any recompute, at the device's rate) against its gradient synchronisation over the dp x cp
    GPUs that share the weights (ring all-reduce of the gradients, or reduce-scatter with ZeRO 2
    and 3, plus ZeRO 3's weight all-gathers before each forward and backward)."""
    shape = attention_shape(s, cp)
    link, _ = ring_link(s, cp)
    tokens = s.batch * shape.n
    recompute = 1.0 if s.checkpointing != "none" else 0.0
    dense = s.model.flops_per_token() * tokens * (3.0 + recompute)
    attention = sum(attention_flops(shape, layout=s.layout, causal=s.causal, world_size=cp))
    attention *= s.model.layers * (1.0 + BACKWARD_WORK + recompute)
    compute = s.micro_batches * (dense + attention) / s.flops_per_s()
    shards = s.dp * cp
    grads = s.model.parameters() * s.optimizer_bytes()[1]
    share = (shards - 1) / shards
    sync = (share * grads if s.zero >= 2 else 2 * share * grads)
    if s.zero >= 3:
        sync += 2 * s.micro_batches * share * s.model.parameters() * s.optimizer_bytes()[0]
    sync_s = sync / (link.gb_per_s * 1e9 * s.link_efficiency)
    return {"micro_batches": s.micro_batches, "tokens_per_gpu": s.micro_batches * tokens,
            "compute_s": compute, "sync_bytes": sync, "sync_s": sync_s}
