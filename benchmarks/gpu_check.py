"""The GPU check, one command on a CUDA machine: ``python -m benchmarks.gpu_check`` (repo root).

1. Runs the backend suites (`suites/test_triton_backend.py`, `suites/test_triton_variants.py`: band
   masks, softcap and d_v != d_qk, `suites/test_flash_attn_backend.py`)
   in a child pytest with the Triton kernels compiled for the GPU (TRITON_INTERPRET removed
   from its environment): the ring cases on CUDA tensors with the Triton and PyTorch backends,
   the GPU-only cases, and flash-attn where it is installed.
2. Prints forward and backward time (median ms, `triton.testing.do_bench`) and TFLOP/s of the
   Triton block kernel against `torch.nn.functional.scaled_dot_product_attention` (and
   flash-attn if installed): bf16, head dims 64 and 128, N = 4K and 16K tokens (batch x N =
   16K, heads x d = 2048), causal and not. FLOPs: forward 4 b h N^2 d (halved for causal),
   backward 2.5 x forward. The Triton backward includes its D preprocess kernel; the last
   column is max |out - SDPA out| as a sanity check of the compiled forward.

Without a CUDA device it prints why and exits 0 (nothing to check); a failing suite exits 1, and so
does a Python without the test kit's modules (pytest, hypothesis, mpmath: said up front, with the
fix). The whole GPU run of issue 64, with this table as one stage: `benchmarks.gpu_run`.
Budget: a few minutes on one H100/H200 (kernel compilation dominates the first run; Triton
caches it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SUITES = ("suites/test_triton_backend.py", "suites/test_triton_variants.py", "suites/test_flash_attn_backend.py")
HEAD_DIMS = (64, 128)
SEQ_LENS = (4096, 16384)
TOKENS = 16384   # batch x N
WIDTH = 2048     # heads x head_dim


def run_suites(suites: list[str], timeout_s: int) -> int:
    """pytest on each of `suites` in a child process whose kernels compile for the GPU, one at a
    time with its own timeout (`timeout_s` each: a cold Triton cache compiles every variant),
    its result printed as soon as it is known. The test kit's modules are checked first."""
    from benchmarks.gpu_run import check_dependencies  # the one dependency check (gpu_run's)

    missing = [s for s in suites if not (REPO / s).exists()]
    if missing:
        print(f"gpu_check: suites not found under {REPO}: {missing} (run from a source checkout)")
        return 1
    deps = check_dependencies()
    if deps["missing"]:
        print(f"gpu_check: the suites need modules this Python lacks; {deps['advice']}")
        return 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    status = 0
    for suite in suites:
        cmd = [sys.executable, "-m", "pytest", suite, "-q", "-ra", "-p", "no:cacheprovider"]
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "4"]  # compiling the kernel variants dominates: spread it over processes
        print("gpu_check: " + " ".join(cmd), flush=True)
        start = time.perf_counter()
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"gpu_check: {suite} did not finish within {timeout_s} s", flush=True)
            status = 1
            continue
        print(f"gpu_check: {suite} {'passed' if rc == 0 else 'FAILED'} in {time.perf_counter() - start:.0f} s",
              flush=True)
        status = status or rc
    return status


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def benchmark(rep_ms: int, *, device: str = "cuda", bench=None, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS,
              tokens: int = TOKENS, width: int = WIDTH) -> list[tuple]:
    """Print (and return) the timing table. `bench(fn, grads) -> ms` defaults to
    `triton.testing.do_bench`; the other arguments let a CPU test run the same code small."""
    import torch.nn.functional as F

    from ringcheck.ring.backends import get_backend

    triton_backend = get_backend("triton")
    from ringcheck import flash_stand_in

    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed, or its CUDA extension does not load
        flash_attn_func = None
    if flash_stand_in.active():  # ringcheck's CPU stand-in (installed earlier in this process): not flash-attn's kernels
        flash_attn_func = None
    if bench is None:
        from triton.testing import do_bench

        def bench(fn, grads=None):
            return do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=grads, return_mode="median")

    header = (f"{'d':>4} {'N':>6} {'causal':>6}  {'impl':<10} {'fwd ms':>8} {'TFLOP/s':>8} "
              f"{'bwd ms':>8} {'TFLOP/s':>8}  {'max|out-sdpa|':>13}")
    print("\n" + header + "\n" + "-" * len(header), flush=True)
    dev = torch.device(device)
    table = []
    for d in head_dims:
        for n in seq_lens:
            b, h = tokens // n, width // d
            scale = d ** -0.5
            gen = torch.Generator(device=dev).manual_seed(0)
            q, k, v, dout = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
                             for _ in range(4))
            for causal in (False, True):
                fwd_flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
                bwd_flops = 2.5 * fwd_flops
                mask = "causal" if causal else "full"
                rows = []

                # SDPA on (b, h, n, d)
                qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                dot = dout.transpose(1, 2).contiguous()
                ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                sdpa_out = ref.detach().transpose(1, 2).float()
                fwd = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale))
                bwd = bench(lambda: ref.backward(dot, retain_graph=True), grads=[qt, kt, vt])
                rows.append(("sdpa", fwd, bwd, 0.0))
                del ref, qt, kt, vt

                # the Triton block kernels (forward returns float32 out and lse, as the ring needs)
                out, lse = triton_backend.forward(q, k, v, scale=scale, mask=mask, diagonal=0)
                err = float((out - sdpa_out).abs().max())
                fwd = bench(lambda: triton_backend.forward(q, k, v, scale=scale, mask=mask, diagonal=0))
                bwd = bench(lambda: triton_backend.backward(q, k, v, dout, lse, triton_backend.row_delta(out, dout),
                                                            scale=scale, mask=mask, diagonal=0))
                rows.insert(0, ("triton", fwd, bwd, err))
                del out, lse

                if flash_attn_func is not None:
                    qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))
                    ref = flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal)
                    err = float((ref.detach().float() - sdpa_out).abs().max())
                    fwd = bench(lambda: flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=causal))
                    bwd = bench(lambda: ref.backward(dout, retain_graph=True), grads=[qf, kf, vf])
                    rows.append(("flash-attn", fwd, bwd, err))
                    del ref, qf, kf, vf

                for name, fwd, bwd, err in rows:
                    table.append((d, n, causal, name, fwd, _tflops(fwd_flops, fwd), bwd, _tflops(bwd_flops, bwd), err))
                    print(f"{d:>4} {n:>6} {'yes' if causal else 'no':>6}  {name:<10} {fwd:>8.3f} "
                          f"{_tflops(fwd_flops, fwd):>8.1f} {bwd:>8.3f} {_tflops(bwd_flops, bwd):>8.1f}  "
                          f"{err:>13.2e}", flush=True)
            del q, k, v, dout
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n(bf16; batch x N = {tokens}, heads x d = {width}; median of do_bench, rep {rep_ms} ms; "
          "Triton out is float32, compared with SDPA's bf16 out)")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest suites")
    parser.add_argument("--no-bench", action="store_true", help="skip the timing table")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), help="pytest paths, relative to the repo")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    parser.add_argument("--tests-timeout", type=int, default=300, help="seconds allowed for each suite")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device here (torch.cuda.is_available() is False). On a CPU "
              "machine the Triton backend is checked under the interpreter by `make test`.")
        return 0
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: triton is not installed; `pip install -e '.[triton]'`")
        return 1
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    status = 0
    if not args.no_tests:
        status = run_suites(args.suites, args.tests_timeout)
    if not args.no_bench:
        from ringcheck.ring.backends import get_backend

        if get_backend("triton").interpreted:
            print("gpu_check: TRITON_INTERPRET=1 is set, so the Triton kernels are interpreted; unset it "
                  "to time the compiled kernels")
            return 1
        benchmark(args.rep_ms)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
