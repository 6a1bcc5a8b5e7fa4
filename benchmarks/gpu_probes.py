"""What only a GPU shows, as the GPU run's probes (`benchmarks.gpu_run`):
``python -m benchmarks.gpu_probes NAME OUT`` writes ``OUT/probe-NAME.json`` and exits 1 when the
probe fails.

- ``long_shard`` (issue 59, defect 11): a query shard of 524,352 tokens at 32 heads of 128, whose
  last rows start past 2^31 elements, through the compiled Triton forward and backward; the last
  rows' out and dq against the torch backend on those rows alone (int32 offsets wrapped there).
- ``ring``: `simulate_ring` on CUDA bf16 tensors, torch and triton backends, P = 1..8, zig-zag,
  causal, GQA, against float64 on the CPU; max error per P (a sanity check: the suites judge).
- ``torch_peak`` (defect 13): the torch backend's forward and backward peak on CUDA (the
  allocator's) for one long block, against `plan --kernel torch-cuda`'s count, and the whole
  block's float32 scores for scale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def long_shard() -> dict:
    from ringcheck.ring.backends import get_backend, row_delta  # start-up time: only the probe that runs imports it

    heads, dim, tail = 32, 128, 64
    rows = 2**31 // (heads * dim) + tail  # the last `tail` rows' offsets are past 2^31 elements
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 128, 8, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    triton, plain = get_backend("triton"), get_backend("torch")
    kw = dict(scale=dim ** -0.5, mask="full", diagonal=0)
    out, lse = triton.forward(q, k, v, **kw)
    dout = torch.randn_like(q)
    dq = triton.backward(q, k, v, dout, lse, row_delta(out, dout), **kw)[0]
    end = q[:, -tail:]
    ref_out, ref_lse = plain.forward(end, k, v, **kw)
    ref_dq = plain.backward(end, k, v, dout[:, -tail:], ref_lse, row_delta(ref_out, dout[:, -tail:]), **kw)[0]
    errors = {"out": float((out[:, -tail:] - ref_out).abs().max()), "dq": float((dq[:, -tail:] - ref_dq).abs().max()),
              "lse": float((lse[..., -tail:] - ref_lse).abs().max())}
    return {"rows": rows, "first offset past 2^31 at row": 2**31 // (heads * dim), "max errors": errors,
            "ok": all(e < 5e-2 for e in errors.values())}


def ring() -> dict:
    from ringcheck import simulate_ring  # start-up time: only the probe that runs imports it
    from ringcheck.reference import dense_attention  # start-up time: only the probe that runs imports it

    table, ok = [], True
    for backend in ("torch", "triton"):
        for world in range(1, 9):
            seq = 2 * world * 64
            gen = torch.Generator().manual_seed(world)
            q, k, v = (torch.randn(1, seq, h, 64, generator=gen).to(torch.bfloat16) for h in (8, 2, 2))
            truth = dense_attention(q.double(), k.double(), v.double(), causal=True)
            out = simulate_ring(q.cuda(), k.cuda(), v.cuda(), world_size=world, causal=True, layout="zigzag",
                                backend=backend)
            err = float((out.double().cpu() - truth).abs().max())
            ok &= err < 5e-2
            table.append({"backend": backend, "P": world, "max |out - float64|": err})
    return {"table": table, "ok": ok}


def torch_peak() -> dict:
    from ringcheck.measure import peak_bytes  # start-up time: only the probe that runs imports it
    from ringcheck.plan import KERNELS, Shape  # start-up time: only the probe that runs imports it
    from ringcheck.plan.ring import Block  # start-up time: only the probe that runs imports it
    from ringcheck.ring.backends import get_backend, row_delta  # start-up time: only the probe that runs imports it

    n, heads, kv_heads, dim = 8192, 16, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    backend = get_backend("torch")
    kw = dict(scale=dim ** -0.5, mask="causal", diagonal=0)
    forward, (out, lse) = peak_bytes(lambda: backend.forward(q, k, v, **kw), device="cuda")
    delta = row_delta(out, dout)
    backward, _ = peak_bytes(lambda: backend.backward(q, k, v, dout, lse, delta, **kw), device="cuda")
    shape, block = Shape(batch=1, n=n, heads=heads, kv_heads=kv_heads, head_dim=dim, e=2), Block(n, n, 0.5)
    plan = {p: KERNELS["torch-cuda"](shape, block, p == "backward") for p in ("forward", "backward")}
    measured = {"forward": forward, "backward": backward}
    return {"measured bytes": measured, "plan bytes": plan, "whole block's scores": 4 * heads * n * n,
            "measured / plan": {p: measured[p] / plan[p] for p in plan},
            "ok": all(measured[p] <= 1.1 * plan[p] for p in plan)}


PROBES = {"long_shard": long_shard, "ring": ring, "torch_peak": torch_peak}


def main(argv: list[str] | None = None) -> int:
    name, out = (argv if argv is not None else sys.argv[1:])[:2]
    if not torch.cuda.is_available():
        print(f"gpu_probes {name}: skipped, no CUDA device")
        return 0
    result = PROBES[name]()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"probe-{name}.json").write_text(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
