"""Computation conventions a correct kernel may follow, as float64 truths of exactly that
computation. A tensor is measured against the exact truth and against each convention's; the
smallest error counts (`precision.judge_precision`). Each convention is a legitimate way to
compute attention, so matching it is correct by definition, and a defect that costs precision
(a tensor rounded through a narrower dtype) is as far from every one of them as from the exact
truth: its error is unrelated to theirs.

- **Stored output** (`stored_output_truth`): the backward forms D = rowsum(dO * O) from the
  output the kernel delivered, as flash-attention's backward reads its stored, rounded O.
- **Kernels and rings of kernels** (`flash_truths`), for bfloat16 / float16 inputs. A flash
  kernel feeds its matrix units operands in the input dtype, so it rounds the probabilities
  (P, relative to its block's row maximum, in the forward; P = exp(s - lse) in the backward)
  and dS = P (dP - D) to the input dtype before the matmuls, accumulates in float32, and
  returns out, dq, dk and dv in the input dtype; a float32 kernel (flash-attn's CPU stand-in,
  autograd through float32 math) rounds only what it returns, with D from the delivered or the
  unrounded output.
  With grouped heads a kernel sums the group in float32 ("native"), rounds each query head's
  dk, dv first (flash-attention 2's `dk_expanded`), or accumulates the group head by head in
  the input dtype (PyTorch's CPU kernel). A ring built from such kernels (PyTorch's context
  parallel, ring-flash-attn, yunchang) gets each ring step's partial results that way and sums
  them in float32: the forward's partial out per key block (merged by its lse), the
  backward's dq per key block and dk, dv per query block, the blocks being the ranks' shards
  of the ring's layout. Given K and V repeated per query head (a ring without grouped heads,
  as our `torch_cp` adapter calls PyTorch's), each head's dk and dv is rounded after the ring
  and the group summed, rounded once.

Not a convention: partial results summed in the input dtype (the running output, or gradients
all-reduced in the input dtype). Each sum is one more rounding, so the error grows with the
ring; that is the defect the planted `low_precision_partial` mutant stands for.

These truths are of the computation, not of its float32 noise: a kernel's own float32
roundings (and its exponentials) still differ, by about one class error.
"""

from __future__ import annotations

import torch

from ..spec import AttentionSpec
from .inputs import Inputs
from .results import Results
from .scores import Scores, scores


def stored_output_truth(spec: AttentionSpec, inputs: Inputs, true: Results, out: torch.Tensor,
                        sc: Scores | None = None) -> Results:
    """The float64 backward of a kernel that forms D = rowsum(dO * O) from the output `out` it
    delivered: the truth `true` with dS = P (dP - D) shifted by -P delta, delta = rowsum(dO *
    (out - O)). `sc`: the case's float64 `scores`, if already computed."""
    sc = scores(spec, inputs, torch.float64) if sc is None else sc
    delta = (sc.dout * (out.detach().double() - true.out.double()).transpose(1, 2)).sum(-1, keepdim=True)
    dq, dk = sc.grads(-sc.p * delta)
    dsinks = None if true.dsinks is None else true.dsinks - (sc.p_all[..., -1] * delta[..., 0]).sum((0, 2))
    return Results(true.out, true.lse, true.dq + dq, true.dk + dk, true.dv, dsinks)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def _flash_out(sc: Scores, blocks: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """out (float64, (b, n, h, d)) of flash kernels over the key blocks `blocks` (boolean masks
    of the keys), each rounding its probabilities relative to its block's row maximum and its
    partial out to `dtype`, merged exactly by their lse (one block: rounded once at the end)."""
    p = sc.p
    logp = torch.log(p)
    o = torch.zeros_like(sc.dout)
    for keys in blocks:
        lb = logp.masked_fill(~keys, float("-inf"))
        top = lb.amax(-1, keepdim=True)
        unnormalised = torch.exp(lb - top.masked_fill(torch.isneginf(top), 0.0))
        total = unnormalised.sum(-1, keepdim=True).clamp_min(1e-300)
        part = torch.matmul(_rounded(unnormalised, dtype), sc.v) / total
        weight = p.masked_fill(~keys, 0.0).sum(-1, keepdim=True)  # exp(lse_block - lse): the merge
        o = o + weight * (_rounded(part, dtype) if len(blocks) > 1 else part)
    return (_rounded(o, dtype) if len(blocks) == 1 else o).transpose(1, 2)


def _group(t: torch.Tensor, sc: Scores, dtype: torch.dtype, way: str) -> torch.Tensor:
    """(b, h, keys, d) per-query-head partials -> (b, keys, kv_heads, d) rounded to `dtype`:
    the group summed in float32 ("native"), each head rounded first ("expanded",
    flash-attention 2's dk_expanded), or accumulated head by head in `dtype` ("sequential",
    PyTorch's CPU kernel)."""
    if way == "native":
        return _rounded(sc.home(t), dtype)
    if way == "expanded":
        return _rounded(sc.home(_rounded(t, dtype)), dtype)
    b, h, keys, d = t.shape
    g = t.view(b, sc.kv_heads, h // sc.kv_heads, keys, d)
    acc = _rounded(g[:, :, 0], dtype)
    for i in range(1, g.shape[2]):
        acc = _rounded(acc + g[:, :, i], dtype)
    return acc.transpose(1, 2)


def _partials(sc: Scores, out: torch.Tensor, blocks: list[torch.Tensor], dtype: torch.dtype,
              flash: bool) -> list[tuple[torch.Tensor, ...]]:
    """Per block (a query block is the same positions as its key block): the float64 dq partial
    (b, h, n, d) over its keys and the per-query-head dk, dv partials (b, h, keys, d) over its
    queries. `flash`: P and dS rounded to `dtype` (else float32 math); D from `out` (b, n, h, d):
    the delivered output, as flash-attention reads its stored one, or the unrounded output, as
    autograd through a float32 forward."""
    delta = (sc.dout * out.detach().double().transpose(1, 2)).sum(-1, keepdim=True)
    ds = sc.capped(sc.p * (sc.dp - delta))
    pr = sc.p
    if flash:
        ds, pr = _rounded(ds, dtype), _rounded(pr, dtype)
    parts = []
    for keys in blocks:
        cols, rows = keys.double().view(1, 1, 1, -1), keys.double().view(1, 1, -1, 1)
        parts.append((torch.matmul(ds * cols, sc.k) * sc.scale,
                      torch.matmul((ds * rows).transpose(-1, -2), sc.q) * sc.scale,
                      torch.matmul((pr * rows).transpose(-1, -2), sc.dout)))
    return parts


def _merged(parts: list[tuple[torch.Tensor, ...]], sc: Scores, dtype: torch.dtype,
            way: str) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv from the blocks' partials, each returned in `dtype` (dk, dv with the group
    summed `way`) and summed in float32. way "repeated": K and V were repeated per query head
    before the ring, so each head's dk and dv is summed over the blocks and the group after the
    ring ("expanded")."""
    dq = dk = dv = 0.0
    for pq, pk, pv in parts:
        if way == "repeated":
            pk, pv = _rounded(pk, dtype), _rounded(pv, dtype)
        else:
            pk, pv = _group(pk, sc, dtype, way), _group(pv, sc, dtype, way)
        dq, dk, dv = dq + _rounded(pq, dtype), dk + pk, dv + pv
    if way == "repeated":
        dk, dv = _group(dk, sc, dtype, "expanded"), _group(dv, sc, dtype, "expanded")
    return dq.transpose(1, 2), dk, dv


def flash_truths(spec: AttentionSpec, inputs: Inputs, true: Results, out: torch.Tensor, owner: torch.Tensor,
                 sc: Scores | None = None, tensors=("out", "dq", "dk", "dv")) -> list[Results]:
    """The float64 results of one kernel over the whole sequence and, on more than one rank, of
    a ring of kernels whose blocks are the ranks' shards (`owner`: each token's rank), for
    bfloat16 / float16 inputs (none for float32: rounding to the input dtype is then the
    float32 arithmetic the class already allows): flash kernels (P and dS rounded, D from the
    delivered output) or float32 ones (D from the delivered or the unrounded output), every
    way of summing grouped heads (`_group`; K and V repeated: rings only), the ring's partials
    summed in float32. The forward is the flash kernel's (its partial out merged in float32);
    lse and dsinks are the truth's (not a convention's).
    `out`: the output the kernel delivered (its backward's D). Only the forward or only the
    gradients are computed when `tensors` asks for no other (the others are the truth's)."""
    if spec.torch_dtype == torch.float32:
        return []
    sc = scores(spec, inputs, torch.float64) if sc is None else sc
    dtype, keys = spec.torch_dtype, sc.k.shape[2]
    shards = [owner[:keys] == r for r in sorted(set(owner.tolist()))]
    grouped = sc.kv_heads < sc.q.shape[1]
    grads = bool(set(tensors) & {"dq", "dk", "dv"})
    truths = []
    for blocks in [[torch.ones(keys, dtype=torch.bool)]] + ([shards] if len(shards) > 1 else []):
        o = _flash_out(sc, blocks, dtype) if "out" in tensors else true.out
        if not grads:
            truths.append(Results(o, true.lse, true.dq, true.dk, true.dv, true.dsinks))
            continue
        ways = ("native", "expanded", "sequential", "repeated") if grouped else ("native",)
        ways = ways if len(blocks) > 1 else ways[:3]
        for flash, d_from in ((True, out), (False, out), (False, true.out)):
            if d_from is true.out and len(blocks) == 1 and not grouped:
                continue  # float32 math rounded once: the exact truth's class
            parts = _partials(sc, d_from, blocks, dtype, flash)
            for way in ways:
                truths.append(Results(o, true.lse, *_merged(parts, sc, dtype, way), true.dsinks))
    return truths


def convention_truths(spec: AttentionSpec, inputs: Inputs, true: Results, out: torch.Tensor | None,
                      owner: torch.Tensor, tensors) -> dict[str, list[torch.Tensor]]:
    """Per tensor of `tensors`, the truths of the conventions it may follow: dq, dk and dsinks
    the stored output's D (`stored_output_truth`), and for bfloat16 / float16 inputs out, dq,
    dk and dv a flash kernel's or a ring of flash kernels' (`flash_truths`). `out`: the output
    the kernel delivered (None: it delivered none, so none is judged either)."""
    found: dict[str, list[torch.Tensor]] = {name: [] for name in tensors}
    if out is None:
        return found
    backward = set(tensors) & {"dq", "dk", "dsinks"}
    flash = set(tensors) & {"out", "dq", "dk", "dv"} if spec.torch_dtype != torch.float32 else set()
    sc = scores(spec, inputs, torch.float64) if backward or flash else None
    if backward:
        stored = stored_output_truth(spec, inputs, true, out, sc)
        for name in backward:
            found[name].append(stored.get(name))
    if flash:
        for kernel in flash_truths(spec, inputs, true, out, owner, sc, tensors=tensors):
            for name in flash:
                found[name].append(kernel.get(name))
    return found
