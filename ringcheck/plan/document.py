"""The body of a `ringcheck.plan` document: the settings, the model's size, the hardware with
its sources, the per-GPU memory at the given ring, the smallest ring that fits, the ring step's
communication against its compute, the optimizer step, and the conventions in words. The CLI
adds the schema header and `meta` (`ringcheck.documents`)."""

from __future__ import annotations

from .hardware import GIB
from .memory import breakdown, smallest_cp
from .settings import OPTIMIZERS, Settings, checkpoint_segment
from .timing import optimizer_step, ring_steps

EXIT_OF = {"fits": 0, "does not fit": 1}
KERNEL_WORDS = {
    "flash-attn2": "the block kernel's tensors are flash-attn 2's (dq, dk, dv, its float32 dq accumulator)",
    "torch-cpu": "the block kernel's tensors are ringcheck's CPU backend's (float32 heads-first copies)",
    "torch-cuda": "the block kernel's tensors are ringcheck's torch backend's on CUDA (float32 copies, scores by "
                  "tiles of query rows)",
}


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def conventions(s: Settings) -> list[str]:
    """What the figures assume, in words (the reports print these)."""
    segment = checkpoint_segment(s.checkpointing, s.model.layers)
    policy = ("no activation checkpointing: every layer keeps its activations" if segment is None else
              "full checkpointing: each layer keeps its input and is recomputed in the backward" if segment == 1 else
              f"checkpointing every {segment} layers: each segment of {segment} keeps its input, one segment is "
              f"recomputed at a time")
    zero = {0: "weights, gradients and optimizer state replicated on every GPU",
            1: "optimizer state sharded over the dp x cp GPUs (ZeRO 1)",
            2: "optimizer state and gradients sharded over the dp x cp GPUs (ZeRO 2)",
            3: "weights, gradients and optimizer state sharded over the dp x cp GPUs (ZeRO 3 / FSDP), one layer "
               "gathered at a time (two with prefetch)"}[s.zero]
    return [
        f"optimizer: {s.optimizer}, {OPTIMIZERS[s.optimizer]}; {zero}",
        f"activations: {policy}; one micro-batch of {s.batch} sequence(s) at a time (--micro-batches "
        f"{s.micro_batches} run one after another: they change the step's time, not the peak)",
        f"attention: ringcheck's ring ({s.layout}, {'causal' if s.causal else 'bidirectional'}): it keeps q, k, v, "
        f"its float32 output and lse; {KERNEL_WORDS[s.kernel]}",
        "model: Llama-style (fused RMSNorm, SwiGLU, GQA, untied embeddings); the loss makes float32 logits for "
        + (f"{s.loss_chunk:,} tokens at a time" if s.loss_chunk else "every token at once"),
    ]


def plan_document(s: Settings) -> dict:
    """The document's body (module docstring); `verdict` is "fits" or "does not fit"."""
    device, _ = s.hardware()
    mem = breakdown(s, s.cp)
    smallest = smallest_cp(s)
    ring = ring_steps(s, s.cp)
    verdict = "fits" if mem["fits"] else "does not fit"
    where = f"{device.what} ({device.memory_gib:g} GiB less {s.reserve_gib:g} GiB reserved)"
    relation = "within" if mem["fits"] else "over"
    why = f"{_gib(mem['total'])} per GPU at P = {s.cp}, {relation} the {_gib(mem['usable'])} usable on an {where}"
    why += ("; " + smallest["why"]) if smallest["cp"] != s.cp else ""
    notes = [ring["note"]] if ring.get("note") else []
    return {
        "verdict": verdict, "fits": mem["fits"], "why": why,
        "settings": s.to_dict(),
        "model": {"parameters": s.model.parameters(), "layer_parameters": s.model.layer_parameters(),
                  "tokens_per_gpu": s.batch * s.seq_len // s.cp},
        "hardware": {"device": device.name, "device_what": device.what, "memory_gib": device.memory_gib,
                     "tflops": s.flops_per_s() / 1e12, "device_source": device.source,
                     "link": s.link_spec().name, "link_what": s.link_spec().what,
                     "link_gb_per_s": s.link_spec().gb_per_s, "link_source": s.link_spec().source},
        "memory": mem,
        "smallest_cp": smallest,
        "ring": ring,
        "step": optimizer_step(s, s.cp),
        "conventions": conventions(s),
        "notes": notes,
    }
