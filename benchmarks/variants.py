"""What the attention variants cost in our ring: a benchmark, not a test (timing never fails
anything). It prints three tables and writes them to --out as variants.json:

1. packed documents: one packed sequence of 16 documents (mixed lengths) through the ring
   against the sum of the 16 documents run one by one on the same ring (target: <= 1.2x);
2. per-document zig-zag balance: each rank's visible (query, key) pairs under causal masking
   for mixed document lengths, max / mean (target: <= 1.05 for zigzag_docs), with the plain
   layouts for comparison (exact counts from the block plan, and the measured per-rank time);
3. sliding windows: time against sequence length at a fixed window w, with the time of full
   causal attention beside it (a window costs O(N w): doubling N doubles its time).

    python -m benchmarks.variants                   # the default sizes, median of 5 runs
    python -m benchmarks.variants --repeats 3 --tokens 4096

Times are forward + backward of the simulated ring (every rank in this process, torch
backend, float32 upcast kernels), one CPU thread, medians over --repeats runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ringcheck import simulate_ring
from ringcheck.ring.backends import get_backend
from ringcheck.ring.drivers import NoCommDriver
from ringcheck.ring.layouts import shard, work_counts
from ringcheck.ring.loops import RankShard, RingConfig, forward_loop


def _inputs(n: int, heads: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads, d, generator=g) for _ in range(4)]


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fwd_bwd(q, k, v, do, **kwargs):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = simulate_ring(*leaves, **kwargs)
    torch.autograd.grad(out, leaves, do)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def packed_documents(args) -> dict:
    p, unit = args.world_size, 2 * args.world_size
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(16, generator=g) + 0.2
    lengths = [max(unit, int(w / weights.sum() * args.tokens) // unit * unit) for w in weights]
    lengths[-1] += args.tokens - sum(lengths)
    q, k, v, do = _inputs(sum(lengths), args.heads, args.head_dim)
    cu = torch.tensor(_cu(lengths))
    rows = []
    for layout, one_layout in (("zigzag_docs", "zigzag"), ("contiguous", "contiguous")):
        packed = _median(lambda: _fwd_bwd(q, k, v, do, world_size=p, causal=True, layout=layout, cu_seqlens=cu),
                         args.repeats)
        alone = 0.0
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            piece = [t[:, a:b] for t in (q, k, v, do)]
            piece_layout = one_layout if (b - a) % unit == 0 or one_layout == "zigzag" else "contiguous"
            alone += _median(lambda piece=piece: _fwd_bwd(*piece, world_size=p, causal=True, layout=piece_layout),
                             args.repeats)
        rows.append({"layout": layout, "documents": len(lengths), "tokens": sum(lengths), "packed_s": packed,
                     "one_by_one_s": alone, "ratio": packed / alone})
    return {"lengths": lengths, "rows": rows}


def _rank_times(layout, p, cu, q, k, v, repeats) -> list[float]:
    """Each rank's forward alone (its own K/V visiting every step: the compute of its blocks)."""
    config = RingConfig(world_size=p, layout=layout, causal=True, scale=q.shape[-1] ** -0.5,
                        cu_seqlens=tuple(cu))
    backend = get_backend("torch")
    times = []
    for r in range(p):
        qs, ks, vs = (shard(t, layout=layout, rank=r, world_size=p, cu_seqlens=cu) for t in (q, k, v))
        times.append(_median(lambda qs=qs, ks=ks, vs=vs, r=r: NoCommDriver(r, p).run(
            [forward_loop(config, RankShard(r, p), qs, ks, vs, backend)]), repeats))
    return times


def balance(args) -> dict:
    p, unit = args.world_size, 2 * args.world_size
    lengths = [unit * m for m in (40, 3, 17, 1, 64, 9, 25, 2, 33, 6)]
    cu = _cu(lengths)
    n = cu[-1]
    q, k, v, _ = _inputs(n, args.heads, args.head_dim)
    rows = []
    for layout in ("zigzag_docs", "zigzag", "contiguous", "striped"):
        counts = work_counts(layout=layout, world_size=p, seq_len=n, causal=True, cu_seqlens=cu)
        times = _rank_times(layout, p, cu, q, k, v, args.repeats)
        rows.append({"layout": layout, "pairs_per_rank": counts,
                     "pairs_max_over_mean": max(counts) / (sum(counts) / p),
                     "time_per_rank_s": times, "time_max_over_mean": max(times) / (sum(times) / p)})
    return {"lengths": lengths, "rows": rows}


def windows(args) -> dict:
    rows = []
    for n in args.window_lengths:
        q, k, v, do = _inputs(n, args.heads, args.head_dim)
        windowed = _median(lambda: _fwd_bwd(q, k, v, do, world_size=args.world_size, causal=True, layout="zigzag",
                                            window=(args.window, 0)), args.repeats)
        full = _median(lambda: _fwd_bwd(q, k, v, do, world_size=args.world_size, causal=True, layout="zigzag"),
                       args.repeats)
        rows.append({"seq_len": n, "window": args.window, "window_s": windowed, "full_causal_s": full})
    for a, b in zip(rows, rows[1:]):
        b["window_growth"] = b["window_s"] / a["window_s"]
        b["full_growth"] = b["full_causal_s"] / a["full_causal_s"]
    return {"rows": rows}


def _print(console: Console, doc: dict) -> None:
    t = Table(title=f"packed documents vs one by one (P={doc['world_size']}, causal, fwd+bwd, median s)")
    for c in ("layout", "documents", "tokens", "packed", "one by one", "ratio"):
        t.add_column(c, justify="right")
    for r in doc["packed"]["rows"]:
        t.add_row(r["layout"], str(r["documents"]), str(r["tokens"]), f"{r['packed_s']:.3f}",
                  f"{r['one_by_one_s']:.3f}", f"{r['ratio']:.2f}")
    console.print(t)
    t = Table(title=f"per-rank causal work, mixed documents (P={doc['world_size']})")
    for c in ("layout", "pairs max/mean", "time max/mean", "pairs per rank"):
        t.add_column(c, justify="right")
    for r in doc["balance"]["rows"]:
        t.add_row(r["layout"], f"{r['pairs_max_over_mean']:.3f}", f"{r['time_max_over_mean']:.2f}",
                  " ".join(str(c) for c in r["pairs_per_rank"]))
    console.print(t)
    t = Table(title=f"sliding window vs full causal (P={doc['world_size']}, zigzag, fwd+bwd, median s)")
    for c in ("seq_len", "window", "window s", "x prev", "full causal s", "x prev"):
        t.add_column(c, justify="right")
    for r in doc["windows"]["rows"]:
        t.add_row(str(r["seq_len"]), str(r["window"]), f"{r['window_s']:.3f}", f"{r.get('window_growth', 0):.2f}",
                  f"{r['full_causal_s']:.3f}", f"{r.get('full_growth', 0):.2f}")
    console.print(t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="packed sequence length (default 4096)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--window-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="reports/variants")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    doc = {"world_size": args.world_size, "heads": args.heads, "head_dim": args.head_dim, "repeats": args.repeats,
           "packed": packed_documents(args), "balance": balance(args), "windows": windows(args)}
    _print(Console(), doc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'variants.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
