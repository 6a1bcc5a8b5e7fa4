"""LLaMA-Factory 0.9.5's v1 ulysses plugin loses the layer's attention semantics and crashes with
fewer K/V heads than ranks: the minimal script, and the patched copy.

`apply_sequence_parallel` (`llamafactory/v1/plugins/model_plugins/parallelization/sequence_parallel.py`
L84-126) rebinds transformers' `_flash_attention_forward` to a partial of `new_flash_attn_forward`
(L49-81). transformers' flash path calls it with the layer's `softmax_scale`, `sliding_window`,
`softcap` (and gpt-oss's `s_aux`) as keywords; `new_flash_attn_forward` reads only `position_ids`
from its `**kwargs` (L75) and `UlyssesAttention.forward` (`ulysses.py` L122-156) calls transformers'
own `_flash_attention_forward` over the gathered sequence with `softmax_scale = head_dim ** -0.5`
(L122-123) and no window, no softcap. So every layer attends plain causal over the whole sequence
(documents kept: the gathered `position_ids` carry them), with the default scale: sliding windows
removed, softcaps dropped, and a scale of the model's own (granite's `attention_multiplier`,
gemma's `query_pre_attn_scalar`) replaced. Nothing warns.

And K/V heads that P does not divide: `SeqAllToAll4D` splits the K/V heads into P pieces with
`torch.tensor_split` (`seq_comm.py` L32), so with fewer K/V heads than ranks some pieces are empty
and the all-to-all raises (L34; gloo: "invalid tensor size"). Its check (L101) would allow P a
multiple of the K/V heads, but reads the query heads for the K/V heads (L93), so it checks nothing.

The fix, patched in memory (`patch()`, `patched_new_flash_attn_forward`): the layer's `softmax_scale`
handed to `UlyssesAttention` (it has the parameter, L87), its `sliding_window` and `softcap` handed to
transformers' `_flash_attention_forward` with the rest; and K/V heads fewer than P replicated to P
(`repeat_interleave`, as DeepSpeed's `UlyssesSPAttentionHF` does), so that rank g gets the K/V head
of its query heads.

    python -m benchmarks.findings.llamafactory minimal   # LLaMA-Factory's own functions alone, P=2, float64
    python -m benchmarks.findings.llamafactory device    # its batch moved to cuda:<global rank> (SP L157)
    python -m benchmarks.findings.llamafactory confirm   # ringcheck step, as shipped and patched
    python -m benchmarks.findings.llamafactory confirm mistral,granite 4 benchmarks.findings.llamafactory:patched

`patched` is the patched copy as a glue (`--glue benchmarks.findings.llamafactory:patched`).
"""

from __future__ import annotations

import math
import queue
import socket
import sys
from dataclasses import replace
from functools import partial

import torch

from ringcheck.trainers.llamafactory import LlamaFactoryUlysses, llamafactory_glue, plugin

P, SEQ, HEADS, DIM = 2, 16, 4, 8
CASES = {  # the minimal script's layers: what transformers' flash path hands the attention
    "sliding_window 4": dict(kv=4, sliding_window=4),
    "softcap 2.0": dict(kv=4, softcap=2.0),
    "softmax_scale 0.9 (granite's attention_multiplier)": dict(kv=4, softmax_scale=0.9),
    "1 K/V head at P=2": dict(kv=1),
}


def patched_new_flash_attn_forward(query_states, key_states, value_states, attention_mask, sequence_parallel_size=1,
                                   dropout=0, deterministic=False, is_causal=True, group=None, mode="ulysses",
                                   attn_fn=None, target_dtype=None, **kwargs):
    """LLaMA-Factory's `new_flash_attn_forward` (sequence_parallel.py L49-81), patched: marked below."""
    if mode != "ulysses":
        raise NotImplementedError("Other sequence parallel modes are to be implemented.")
    kv = key_states.shape[2]
    if kv % sequence_parallel_size:  # patch: K/V heads fewer than P, replicated so each rank gets its group's
        key_states = key_states.repeat_interleave(sequence_parallel_size // kv, dim=2)
        value_states = value_states.repeat_interleave(sequence_parallel_size // kv, dim=2)
    layer = {k: kwargs[k] for k in ("sliding_window", "softcap") if kwargs.get(k) is not None}  # patch: kept
    dist_attn = plugin().UlyssesAttention(sequence_process_group=group, attn_fn=partial(attn_fn, **layer))
    return dist_attn(query_states, key_states, value_states, attention_mask,
                     query_length=query_states.shape[1] * sequence_parallel_size, deterministic=deterministic,
                     dropout_p=dropout, causal=is_causal, position_ids=kwargs.get("position_ids", None),
                     target_dtype=target_dtype, softmax_scale=kwargs.get("softmax_scale"))  # patch: the layer's


def patch():
    """The patched copy, in memory: `apply_sequence_parallel` from now on binds the patched
    `new_flash_attn_forward` (it reads the module's name when it builds its partial). Returns the undo."""
    sp = plugin()
    shipped = sp.new_flash_attn_forward
    sp.new_flash_attn_forward = patched_new_flash_attn_forward

    def undo():
        sp.new_flash_attn_forward = shipped

    return undo


class PatchedLlamaFactory(LlamaFactoryUlysses):
    """ringcheck's LLaMA-Factory glue with `patch()` applied while its plugin is applied to a model."""

    def apply(self, model) -> None:
        undo = patch()
        try:
            super().apply(model)
        finally:
            undo()


patched = replace(llamafactory_glue(PatchedLlamaFactory()), name="benchmarks.findings.llamafactory:patched",
                  describe="LLaMA-Factory 0.9.5's ulysses plugin and loss, patched: the layer's scale, window and "
                           "softcap handed on; K/V heads fewer than P replicated")


def reference(q, k, v, attention_mask, query_length=None, is_causal=True, dropout=0.0, position_ids=None,
              softmax_scale=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' `_flash_attention_forward` contract in float64, eagerly: (batch, seq, heads, dim)
    in and out, causal, packed documents from `position_ids`, the window, the softcap, the scale."""
    n, heads = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * (softmax_scale or q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n)
    keep = i[:, None] >= i[None, :]
    if position_ids is not None:
        doc = torch.cat([torch.ones(1, dtype=torch.long), (position_ids[0, 1:] != position_ids[0, :-1] + 1).long()])
        doc = doc.cumsum(0)
        keep = keep & (doc[:, None] == doc[None, :])
    if sliding_window:
        keep = keep & (i[:, None] - i[None, :] < sliding_window)
    s = s.masked_fill(~keep, -math.inf)
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def _inputs(kv: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, SEQ, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, kv, kv))
    pos = torch.cat([torch.arange(7), torch.arange(SEQ - 7)])[None]  # two packed documents, 7 + 9
    return q, k, v, pos


def _rank(rank: int, port: int, out) -> None:
    """One of P ranks: LLaMA-Factory's new_flash_attn_forward (shipped, then patched) on its shard."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    sp, n = plugin(), SEQ // P
    result = {}
    for name, case in CASES.items():
        layer = {k: v for k, v in case.items() if k != "kv"}
        q, k, v, pos = _inputs(case["kv"])
        truth = reference(q, k, v, None, position_ids=pos, **layer)
        mine = slice(rank * n, (rank + 1) * n)
        for label, fn in (("as shipped", sp.new_flash_attn_forward), ("patched", patched_new_flash_attn_forward)):
            try:
                o = fn(q[:, mine], k[:, mine], v[:, mine], None, sequence_parallel_size=P, group=dist.group.WORLD,
                       attn_fn=reference, position_ids=pos[:, mine], **layer)
                pieces = [torch.empty_like(o) for _ in range(P)]
                dist.all_gather(pieces, o.contiguous())
                whole = torch.cat(pieces, dim=1)
                result[(name, label)] = f"output relative error {float((whole - truth).norm() / truth.norm()):.1e}"
            except RuntimeError as exc:
                result[(name, label)] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def minimal() -> dict:
    """LLaMA-Factory's `new_flash_attn_forward` (its UlyssesAttention and all-to-alls) at P=2 around a
    float64 eager attention with transformers' flash contract, against that attention on the whole
    sequence: as shipped and patched (a correct run is ~1e-16)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(P)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=300)
    except queue.Empty:
        raise RuntimeError(f"no result from rank 0 (exit codes {[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(timeout=60)
    for (name, label), words in result.items():
        print(f"{label:10s} {name:52s} {words}")
    return result


def device() -> str:
    """`sequence_parallel_loss` moves the batch with `.to(dist.get_rank())` (SP L157): the global rank
    as a CUDA device index, while its trainer computes on `cuda:LOCAL_RANK` (`accelerator/helper.py`
    L122-125, `set_device_index`). On the first rank of the second node of two 8-GPU nodes (RANK=8,
    LOCAL_RANK=0) the batch goes to cuda:8. Here one gloo process, LLaMA-Factory's singleton handed its
    group as the glue hands it, and `dist.get_rank()` answering 8 as it would there: where L157 sends
    the batch (on a CPU build the move to a CUDA index raises, which shows it is one)."""
    import os
    import traceback

    import torch.distributed as dist

    from ringcheck.trainers.llamafactory import RankDist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    glue, sp = LlamaFactoryUlysses(), plugin()
    os.environ.update(LOCAL_RANK="0", RANK="8")
    shimmed = sp.dist
    try:
        glue.install(dist.group.WORLD)
        sp.dist = RankDist(8)   # dist.get_rank() on the first rank of the second node
        sp.sequence_parallel_loss(lambda **inputs: None, {"input_ids": torch.zeros(1, 4, dtype=torch.int64)})
        words = "no error: the batch stayed where it was"
    except Exception as exc:
        line = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("sequence_parallel.py")]
        where = f"sequence_parallel.py:{line[-1].lineno}" if line else "outside sequence_parallel.py"
        words = f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0][:120]}"
    finally:
        sp.dist = shimmed
        glue.uninstall()
        dist.destroy_process_group()
    print(f"its trainer's device: cuda:{os.environ['LOCAL_RANK']} (set_device_index, LOCAL_RANK); the batch is moved "
          f"to index 8 of the accelerator, cuda:8 (.to(dist.get_rank()), RANK=8): {words}")
    return words


GLUES = ("llamafactory", "benchmarks.findings.llamafactory:patched")


def confirm(models=("mistral", "gemma2", "gemma3_text", "granite", "qwen3_moe"), sizes=(2, 4), glues=GLUES) -> None:
    """ringcheck step --model through LLaMA-Factory's glue as shipped and through the patched copy."""
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.launch import open_ring
    from ringcheck.models.step import ModelStepConfig

    ring = open_ring(timeout=120)
    try:
        for model in models:
            for size in sizes:
                for glue in glues:
                    judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=size), ring)
                    failed = [c["case"] for c in judged["cases"] if c["verdict"] != "pass"]
                    worst = max((c["logits"]["ratio"] for c in judged["cases"] if "logits" in c), default=float("nan"))
                    print(f"{model:12s} P={size} {glue:42s} {judged['verdict']:10s} worst logits {worst:.2g} of the "
                          f"budget; not passed: {', '.join(failed) or 'none'}; {judged['why'][:160]}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":  # minimal | device | confirm [MODELS [SIZES [GLUES]]], each comma-separated
    command, *rest = sys.argv[1:] or ["minimal"]
    if command == "confirm" and rest:
        confirm(*(tuple(int(x) if i == 1 else x for x in arg.split(",")) for i, arg in enumerate(rest)))
    else:
        {"minimal": minimal, "device": device, "confirm": confirm}[command]()
