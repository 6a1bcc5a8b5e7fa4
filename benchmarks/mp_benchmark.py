"""Throughput of the certified mpmath reference: query rows per second, forward and backward,
per sequence length and head dim. A benchmark, not a test: it prints a table.

    python -m reference.benchmark                  # the default grid, median of 3 runs
    python -m reference.benchmark --repeats 1 --full-seq-lens 128 --sampled-seq-lens 4096

Two modes:
- full: every query row; forward (out, lse), then forward + backward (dq, dk, dv).
- sampled: `--rows` query rows (out, lse, and with backward dq only), streaming over keys.
Rows per second counts query rows of all heads and batches (batch x heads x rows). The
cache is off. Inputs are standard normal, non-causal (every key visible: the slowest case).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mpmath
import torch

from ringcheck.reference.mp import mp_attention

TARGET_S = 20.0  # the targets: full fwd+bwd at N=128, d=64; 16 sampled rows at N=4096, d=64


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, seq, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, seq, kv_heads, head_dim, generator=gen).to(dtype)
    do = torch.randn(1, seq, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, do


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run(*, full_seq_lens, sampled_seq_lens, head_dims, heads, kv_heads, rows, dtype, repeats, digits):
    """Yield one dict per table row."""
    for mode, seq_lens in (("full", full_seq_lens), ("sampled", sampled_seq_lens)):
        for seq in seq_lens:
            for d in head_dims:
                q, k, v, do = _inputs(seq, heads, kv_heads, d, dtype)
                sel = None
                n_rows = seq
                if mode == "sampled":
                    n_rows = min(rows, seq)
                    sel = torch.randperm(seq, generator=torch.Generator().manual_seed(1))[:n_rows]
                fwd_s, fwd = _median_time(lambda: mp_attention(q, k, v, rows=sel, digits=digits, cache=False), repeats)
                bwd_s, bwd = _median_time(lambda: mp_attention(q, k, v, do, rows=sel, digits=digits, cache=False),
                                          repeats)
                counted = heads * n_rows
                target = ""
                if d == 64 and ((mode == "full" and seq == 128) or (mode == "sampled" and seq == 4096 and n_rows == 16)):
                    t = bwd_s if mode == "full" else fwd_s
                    target = f"{'met' if t < TARGET_S else 'MISSED'} ({t:.1f} s < {TARGET_S:.0f} s)"
                yield {"mode": mode, "seq": seq, "d": d, "rows": n_rows, "fwd_s": fwd_s, "fwd_rps": counted / fwd_s,
                       "bwd_s": bwd_s, "bwd_rps": counted / bwd_s,
                       "digits": min(fwd.certified_digits, bwd.certified_digits), "bits": bwd.precision,
                       "target": target}


def _machine() -> str:
    threads = torch.get_num_threads()
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, torch threads {threads}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, mpmath {mpmath.__version__} "
            f"(backend {mpmath.libmp.BACKEND})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m reference.benchmark", description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--full-seq-lens", type=ints, default=[64, 128], help="comma-separated (default 64,128)")
    ap.add_argument("--sampled-seq-lens", type=ints, default=[1024, 4096], help="comma-separated (default 1024,4096)")
    ap.add_argument("--head-dims", type=ints, default=[64, 128], help="comma-separated (default 64,128)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16, help="query rows in sampled mode (default 16)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--digits", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown (default 3)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.heads % a.kv_heads:
        ap.error(f"need --repeats >= 1 and --heads a multiple of --kv-heads (got {a.repeats}, {a.heads}, {a.kv_heads})")

    print(f"mp_attention throughput: batch 1, heads {a.heads}, kv_heads {a.kv_heads}, {a.dtype}, non-causal, "
          f"digits {a.digits:g}, median of {a.repeats}")
    print(f"machine: {_machine()}")
    head = (f"{'mode':<8} {'seq':>6} {'d':>4} {'rows':>5} {'fwd s':>8} {'fwd rows/s':>11} "
            f"{'fwd+bwd s':>10} {'f+b rows/s':>11} {'digits':>7} {'bits':>10}  target")
    print(head)
    print("-" * len(head))
    for r in run(full_seq_lens=a.full_seq_lens, sampled_seq_lens=a.sampled_seq_lens, head_dims=a.head_dims,
                 heads=a.heads, kv_heads=a.kv_heads, rows=a.rows, dtype=getattr(torch, a.dtype),
                 repeats=a.repeats, digits=a.digits):
        bits = f"{r['bits'][0]}/{r['bits'][1]}"
        print(f"{r['mode']:<8} {r['seq']:>6} {r['d']:>4} {r['rows']:>5} {r['fwd_s']:>8.2f} {r['fwd_rps']:>11.1f} "
              f"{r['bwd_s']:>10.2f} {r['bwd_rps']:>11.1f} {r['digits']:>7.1f} {bits:>10}  {r['target']}", flush=True)
    print("sampled mode: backward = dq of the sampled rows only; rows/s counts heads x rows.")


if __name__ == "__main__":
    main()
