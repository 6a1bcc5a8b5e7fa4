"""The training runs: the ring's on every rank of the mesh, and the single-device runs.

One loop (`run_steps`) serves both: float32 master weights from the seed, AdamW, `steps`
steps; each step's loss (the global batch's mean over counted tokens) and gradient norm, and
the gradients of step 0 (before the first update: every run starts from the same weights, so
step 0's gradients compare like for like).

The ring's run (`ring_task`, a task of `ringcheck.launch`): every rank of every CP group of
the mesh trains on its layout's shard of its group's sequences, the attention through the
implementation under test on its CP group, and then reduces the gradients the way DDP/FSDP
do, outside attention: every parameter's gradient is summed in float32 over the whole mesh
(the CP group and every other dim); with ``--sinks-grad reduced`` the sinks' gradient, which
the ring already summed over its CP group, is summed over the replicas only (the ranks at
the same cp index). A ring that all-reduces the sinks inside attention but is declared
``partial`` therefore trains with P times their gradient, as it would under such a framework.

The single-device runs (`single_task`): the same model, data and initialisation on one
process with the whole global batch, differing only in legitimate ways (`SINGLE_RUNS`): the
reference, and the noise runs whose spread is the noise floor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..adapters import ContractError
from ..harness import ImplOptions
from ..harness.mesh import MESH_FAMILY, REPLICAS
from ..harness.runner import loaded
from .attention import ring_attend, single_device
from .config import BETAS, EPS, WEIGHT_DECAY, TrainConfig
from .data import Batch, counted_tokens, make_batch, rank_part
from .model import init_parameters, loss_of

REFERENCE = "reference"
CHUNKS = 3  # the chunked runs' token chunks: not a power of two, so no ring of the sweep shards alike
KERNEL_WORDS = {"exact": "float64 attention rounded once to the training dtype",
                "fused": "torch's scaled_dot_product_attention in the training dtype (a flash-style kernel)",
                "naive": "eager attention, every matmul and the softmax in the training dtype"}
CHUNK_WORDS = (f"the position-wise layers in {CHUNKS} token chunks, each chunk's weight gradients rounded and then "
               f"summed in float32 (another order of the reductions, as the ring's ranks sum theirs)")
# run -> (attention kernel, token chunks of the position-wise layers)
SINGLE_RUNS = {REFERENCE: ("exact", 1), "fused": ("fused", 1), "naive": ("naive", 1), "chunked": ("exact", CHUNKS),
               "fused_chunked": ("fused", CHUNKS), "naive_chunked": ("naive", CHUNKS)}


def run_words(name: str) -> str:
    """What a single-device run is, in words."""
    kernel, pieces = SINGLE_RUNS[name]
    return KERNEL_WORDS[kernel] + (f"; {CHUNK_WORDS}" if pieces > 1 else ", the whole sequence at once")


def noise_runs(config: TrainConfig) -> tuple[str, ...]:
    """The single-device runs beside the reference whose spread is the noise floor: every
    other attention kernel and every other order of the reductions (SDPA has no softcap: with
    --softcap the fused kernel is left out)."""
    return tuple(n for n, (kernel, _) in SINGLE_RUNS.items()
                 if n != REFERENCE and not (kernel == "fused" and config.softcap is not None))


class AdamW:
    """AdamW as `torch.optim.AdamW` computes it (decoupled weight decay on the matrices,
    bias-corrected moments), written out: the same arithmetic in every run, and no import of
    torch.optim (which imports torch._dynamo: seconds per process on a loaded machine)."""

    def __init__(self, config: TrainConfig, params: dict[str, torch.Tensor]):
        self.params, self.lr, self.t = params, config.lr, 0
        self.m = {n: torch.zeros_like(p) for n, p in params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        (b1, b2), t = BETAS, self.t
        for name, p in self.params.items():
            g = grads[name]
            if p.dim() == 2:
                p.mul_(1 - self.lr * WEIGHT_DECAY)
            self.m[name].lerp_(g, 1 - b1)
            self.v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (self.v[name].sqrt() / math.sqrt(1 - b2 ** t)).add_(EPS)
            p.addcdiv_(self.m[name], denom, value=-self.lr / (1 - b1 ** t))


StepLoss = Callable[[int, dict], torch.Tensor]
Reduce = Callable[[dict, torch.Tensor], float]


def run_steps(config: TrainConfig, device, step_loss: StepLoss, reduce: Reduce, *, keep_grads: bool,
              progress: Callable[[str], None] | None = None, label: str = "") -> dict[str, Any]:
    """`config.steps` steps of AdamW: per step the loss and gradient norm (after `reduce`,
    which sums the gradients the way the framework does and returns the global loss), the
    step-0 gradients when `keep_grads`."""
    params = {n: p.to(device).requires_grad_() for n, p in init_parameters(config).items()}
    opt = AdamW(config, params)
    losses, norms, kept = [], [], None
    start = time.perf_counter()
    for step in range(config.steps):
        loss = step_loss(step, params)
        (loss * config.loss_scale).backward()
        missing = [n for n, p in params.items() if p.grad is None]
        if missing:
            raise ContractError(f"no gradient reached {', '.join(missing)}: the attention under test cut the graph "
                                f"(it must be differentiable in q, k, v{' and sinks' if config.sinks else ''})")
        grads = {n: p.grad / config.loss_scale for n, p in params.items()}
        losses.append(reduce(grads, loss.detach()))
        for p in params.values():
            p.grad = None
        norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())))
        if step == 0 and keep_grads:
            kept = {n: g.detach().cpu().clone() for n, g in grads.items()}
        opt.step(grads)
        if progress is not None:
            progress(f"{label}step {step + 1}/{config.steps}: loss {losses[-1]:.4f}")
    return {"losses": losses, "grad_norms": norms, "grads": kept, "seconds": time.perf_counter() - start}


def _framework_reduce(config: TrainConfig, mesh_group, replicas_group) -> Reduce:
    """The framework's gradient reduction (DDP/FSDP, float32): one flat all-reduce over the
    mesh of every gradient and the loss; under `reduced` the sinks' over the replicas only."""
    own = config.sinks and config.sinks_grad == "reduced"

    def reduce(grads: dict, loss: torch.Tensor) -> float:
        names = [n for n in grads if not (own and n.endswith("sinks"))]
        flat = torch.cat([grads[n].reshape(-1) for n in names] + [loss.float().reshape(1)])
        dist.all_reduce(flat, group=mesh_group)
        _unflatten(grads, names, flat)
        if own:
            sinks = [n for n in grads if n.endswith("sinks")]
            flat_s = torch.cat([grads[n].reshape(-1) for n in sinks])
            if dist.get_world_size(replicas_group) > 1:
                dist.all_reduce(flat_s, group=replicas_group)
            _unflatten(grads, sinks, flat_s)
        return float(flat[-1])
    return reduce


def _unflatten(grads: dict, names: list[str], flat: torch.Tensor) -> None:
    at = 0
    for n in names:
        size = grads[n].numel()
        grads[n] = flat[at:at + size].view_as(grads[n]).clone()
        at += size


def ring_task(member, options: ImplOptions, config: TrainConfig, progress=None) -> dict[str, Any]:
    """One rank of the ring's run (`ringcheck.launch` task). Rank 0 of group 0 reports its
    progress and returns the step-0 gradients (every rank holds the same after the reduction)."""
    impl = loaded(options)
    rings = config.mesh_spec.rings
    count = counted_tokens(config, rings)
    attend = ring_attend(impl, config, member.group)

    def step_loss(step: int, params: dict) -> torch.Tensor:
        batch = make_batch(config, step, config.batch * rings)
        part = rank_part(config, batch, rank=member.rank, group_index=member.group_index)
        return loss_of(params, [part], attend, config, count, member.device)

    first = member.group_index == 0 and member.rank == 0
    reduce = _framework_reduce(config, member.groups[MESH_FAMILY], member.groups[REPLICAS])
    return run_steps(config, member.device, step_loss, reduce, keep_grads=first,
                     progress=progress if first else None, label="ring ")


def single_key(config: TrainConfig) -> tuple:
    """What a single-device run depends on (not the implementation, the ring's size or its mesh
    beyond the global batch): runs of equal keys are the same runs."""
    return (config.dtype, config.seed, config.steps, config.model, config.layers, config.heads, config.kv_heads,
            config.head_dim, config.seq_len, config.batch * config.mesh_spec.rings, config.cu_seqlens, config.window,
            config.softcap, config.sinks, config.layout == "striped")


def chunks(batch: Batch, count: int) -> list[Batch]:
    """The batch as `count` contiguous token chunks (the same sequences)."""
    index = torch.arange(batch.tokens.shape[1])
    return [batch.part(piece, slice(None)) for piece in torch.tensor_split(index, count)]


def single_run(config: TrainConfig, name: str, device="cpu", progress=None) -> dict[str, Any]:
    """One single-device run of `SINGLE_RUNS` on the whole global batch."""
    kernel, pieces = SINGLE_RUNS[name]
    rings = config.mesh_spec.rings
    count = counted_tokens(config, rings)
    attend = single_device(config, kernel)

    def step_loss(step: int, params: dict) -> torch.Tensor:
        batch = make_batch(config, step, config.batch * rings)
        return loss_of(params, chunks(batch, pieces) if pieces > 1 else [batch], attend, config, count, device)

    def reduce(grads: dict, loss: torch.Tensor) -> float:
        return float(loss)

    result = run_steps(config, device, step_loss, reduce, keep_grads=True)
    if progress is not None:
        progress(f"single-device run {name} done")
    return result


def single_task(member, config: TrainConfig, names: tuple[str, ...], slots: int, progress=None) -> dict[str, Any]:
    """Rank `member.group_index` of `slots` single-rank groups runs every slots-th run of `names`."""
    return {name: single_run(config, name, member.device, progress) for name in names[member.group_index::slots]}
