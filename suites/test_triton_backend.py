"""The Triton block backend, judged like the PyTorch one: the simulated ring against float64
with the budget rule (error <= k x same-dtype peer error + slack), per tensor.

Where it runs:
- without CUDA, under Triton's interpreter on CPU tensors. TRITON_INTERPRET=1 must be in the
  environment when the kernels are *decorated* (first import of
  `ringcheck.ring.backends.triton_fwd`), so this module sets it before anything imports them;
- with CUDA (and TRITON_INTERPRET unset), compiled on the GPU: the same cases run on CUDA
  tensors, plus GPU-only cases (tile-spanning shapes, the tensor-core bf16 path, the torch
  backend on CUDA). `python -m benchmarks.gpu_check` runs this file that way.

Trimmed for a 2-core CPU (every kernel program runs in Python): ring sizes 1, 2, 4, 8 for
bf16 with grouped-query heads (striped up to P=4); float32 and float16 at P=4; odd head dims
and GQA groups at P=2; tile-spanning chunk lengths (several 16-row interpreter tiles, ragged
tails) at P=1 and 2. Sequences are 2P x 4 tokens unless a case needs more. The cases are the
tables TRITON_CASES, TRITON_PLANTED_CASES and TRITON_GPU_CASES of `ringcheck.testing.cases`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

try:
    import fcntl  # the lock the pytest-xdist workers share (POSIX)
except ImportError:
    fcntl = None

if not torch.cuda.is_available():
    # before the kernels are first imported (see the module docstring); a no-op if set already
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import triton
import triton.language as tl

from ringcheck.catalogue.planted import with_backend
from ringcheck.judge.check import Case, run_case, simulated_impl
from ringcheck.judge.verdict import judge
from ringcheck.ring import simulate_ring
from ringcheck.ring.backends import get_backend, row_delta
from ringcheck.ring.backends.torch_backend import TorchBackend
from ringcheck.ring.backends.triton_backend import TritonBackend
from ringcheck.ring.loops import REAL_PARTS
from ringcheck.testing.cases import TRITON_CASES, TRITON_GPU_CASES, TRITON_PLANTED_CASES

BACKEND = TritonBackend()
if BACKEND.interpreted:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("the Triton kernels were compiled (TRITON_INTERPRET unset at their import) and there is "
                "no CUDA device; run with TRITON_INTERPRET=1", allow_module_level=True)
SANITIZED_CASE = "p4_zigzag_bf16_h2kv1_triton"  # causal, zig-zag, 4 ranks
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs the kernels compiled on a CUDA device")
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="the defect exists only under Triton's interpreter")

REPO = Path(__file__).resolve().parents[1]


def verdict_of(case: Case, backend=None):
    """`run_case`, with the ring run on DEVICE (inputs and results stay on the CPU); with
    `backend` (a block backend instance: a planted bug) in place of the case's."""
    parts = REAL_PARTS if backend is None else with_backend(backend)
    if DEVICE == "cpu":
        return run_case(case, impl=simulated_impl(case, parts=parts))

    def impl(q, k, v):
        out, lse = simulate_ring(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), world_size=case.ring.world_size,
                                 causal=case.spec.causal, softmax_scale=case.spec.softmax_scale,
                                 layout=case.ring.layout, backend=case.backend, return_lse=True, parts=parts)
        return out.cpu(), lse.cpu()
    return run_case(case, impl=impl)


# make test runs every shape case (head dims, heads, tiles) and, of the grid of ring size x mode x dtype, a
# covering subset: every ring size (1, 2, 4, 8), every mode and every dtype at least once (the kernels are
# per block: a larger ring adds blocks, not code); the other combinations carry the marker thorough
# (make test-thorough, in CI)
_THOROUGH = {"p8_zigzag_bf16_h2kv1_triton", "p8_bidirectional_bf16_h2kv1_triton", "p4_causal_fp32_h2kv1_triton",
             "p4_striped_fp32_h2kv1_triton", "p4_zigzag_fp16_h2kv1_triton", "p4_bidirectional_fp16_h2kv1_triton",
             "p1_causal_bf16_h2kv1_triton", "p1_zigzag_bf16_h2kv1_triton", "p1_striped_bf16_h2kv1_triton",
             "p2_bidirectional_bf16_h2kv1_triton", "p2_zigzag_bf16_h2kv1_triton", "p2_striped_bf16_h2kv1_triton",
             "p4_bidirectional_bf16_h2kv1_triton", "p4_causal_bf16_h2kv1_triton", "p4_zigzag_fp32_h2kv1_triton",
             "p4_striped_fp16_h2kv1_triton"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.thorough) if n in _THOROUGH else n
                                  for n in TRITON_CASES])
def test_ring_with_triton_blocks_meets_budget(name):
    verdict = verdict_of(TRITON_CASES[name])
    assert verdict.passed, verdict.message()


@interpreter_only
def test_the_ring_passes_with_the_interpreters_overflow_sanitizer_asserting(triton_overflow_sanitizer):
    """The suites run the interpreter without its int32 overflow sanitizer, which cannot fire
    there (suite_defaults); this test keeps it on, with the asserts that let it fire: a zig-zag
    causal ring of Triton blocks, forward and backward, overflows no int32 index."""
    verdict = verdict_of(TRITON_CASES[SANITIZED_CASE])
    assert verdict.passed, verdict.message()


@triton.jit
def _int32_product(X, a, b):
    tl.store(X, a * b)


@interpreter_only
def test_the_overflow_sanitizer_fires_only_with_the_interpreters_asserts(triton_overflow_sanitizer):
    """Why it may be off elsewhere: its check reaches an assert only where the interpreter's
    debug option is on (the fixture); with debug off, as Triton builds the interpreter, an int32
    overflow passes silently whether the sanitizer is on or not."""
    from triton.runtime.interpreter import InterpreterError, interpreter_builder

    x = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(InterpreterError, match="int32 overflow detected for operation mul"):
        _int32_product[(1,)](x, 2 ** 20, 2 ** 20)
    asserting = interpreter_builder.options
    try:
        interpreter_builder.options = dataclasses.replace(asserting, sanitize_overflow=True, debug=False)
        _int32_product[(1,)](x, 2 ** 20, 2 ** 20)
        assert int(x) == 0  # 2**40 wrapped: nothing said
    finally:
        interpreter_builder.options = asserting


# --- exactness where the math guarantees it --------------------------------------------------

def test_ring_of_one_is_the_block_kernel_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 20, h, 40, generator=gen).to(torch.bfloat16).to(DEVICE) for h in (4, 2, 2))
    out, lse = simulate_ring(q, k, v, world_size=1, causal=True, backend="triton", return_lse=True)
    block_out, block_lse = BACKEND.forward(q, k, v, scale=40 ** -0.5, mask="causal", diagonal=0)
    assert torch.equal(out, block_out.to(torch.bfloat16))
    assert torch.equal(lse, block_lse)


def test_kernels_are_deterministic():
    gen = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 21, 4, 24, generator=gen).to(torch.float16).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 21, 2, 24, generator=gen).to(torch.float16).to(DEVICE) for _ in range(2))
    runs = []
    for _ in range(2):
        out, lse = BACKEND.forward(q, k, v, scale=0.3, mask="causal", diagonal=-1)
        runs.append((out, lse, *BACKEND.backward(q, k, v, dout, lse, row_delta(out, dout), scale=0.3,
                                                 mask="causal", diagonal=-1)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


# --- one block against float64, any geometry --------------------------------------------------

def block_truth(q, k, v, dout, *, scale, mask, diagonal):
    """float64 out, lse, dq, dk, dv of one block (its own lse and D: a ring of one block)."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    f = torch.float64
    qh = q.transpose(1, 2).to(f)
    kh, vh = (x.transpose(1, 2).repeat_interleave(h // kvh, dim=1).to(f) for x in (k, v))
    s = qh @ kh.transpose(-1, -2) * scale
    if mask == "causal":
        visible = torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).tril(diagonal)
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))
    out = p @ vh
    doh = dout.transpose(1, 2).to(f)
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * out).sum(-1, keepdim=True))
    dq = ds @ kh * scale
    dk = (ds.transpose(-1, -2) @ qh * scale).view(b, kvh, h // kvh, -1, d).sum(2)
    dv = (p.transpose(-1, -2) @ doh).view(b, kvh, h // kvh, -1, d).sum(2)
    return out.transpose(1, 2), lse, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def check_block(*, batch, sq, sk, heads, kv_heads, head_dim, dtype, mask, diagonal, seed=0):
    """The Triton block results against float64, budgeted by the torch backend's error. Dots in
    float32 (the default under the interpreter) so that the float32 torch backend is a fair
    peer; the tensor-core path is judged against the same-dtype peer by the ring cases."""
    backend = TritonBackend(dot_fp32=True)
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, sq, heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, sk, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    true = block_truth(q, k, v, dout, scale=scale, mask=mask, diagonal=diagonal)
    lse, delta = true[1].float(), (dout.double() * true[0]).sum(-1).transpose(1, 2).float()
    opts = dict(scale=scale, mask=mask, diagonal=diagonal)
    peer = (*TorchBackend().forward(q, k, v, **opts), *TorchBackend().backward(q, k, v, dout, lse, delta, **opts))
    qd, kd, vd, dod = (t.to(DEVICE) for t in (q, k, v, dout))
    got = (*backend.forward(qd, kd, vd, **opts),
           *backend.backward(qd, kd, vd, dod, lse.to(DEVICE), delta.to(DEVICE), **opts))
    failures = []
    for name, g, t, p, k_budget in zip(("out", "lse", "dq", "dk", "dv"), got, true, peer, (2, 2, 3, 3, 3)):
        assert g.dtype == torch.float32, f"{name} is {g.dtype}; the contract says float32"
        tv = judge(name, g.cpu(), t, p, k=k_budget, dtype=torch.float32)
        if not tv.passed:
            failures.append(tv.describe())
    return failures


BLOCKS = [  # (sq, sk, diagonal): square and not, ring diagonals 0/-1, rows with no visible key
    (8, 8, 0), (8, 8, -1), (37, 45, 0), (45, 37, -1), (40, 33, -20), (20, 50, 17), (33, 33, -40),
    (17, 17, 100),
]


@pytest.mark.parametrize("sq,sk,diagonal", BLOCKS, ids=[f"{a}x{b}-diag{c}" for a, b, c in BLOCKS])
def test_causal_block_matches_float64(sq, sk, diagonal):
    failures = check_block(batch=1, sq=sq, sk=sk, heads=4, kv_heads=2, head_dim=40,
                           dtype=torch.bfloat16, mask="causal", diagonal=diagonal)
    assert not failures, "\n".join(failures)


def test_rows_without_keys_give_zero_and_minus_inf_without_nan():
    q, k, v = (torch.randn(1, 20, 2, 16).to(DEVICE) for _ in range(3))
    out, lse = BACKEND.forward(q, k, v, scale=0.25, mask="causal", diagonal=-5)   # rows 0..4 see nothing
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()
    assert (out[:, :5] == 0).all() and not out.isnan().any()
    grads = BACKEND.backward(q, k, v, torch.randn_like(q), lse, torch.zeros_like(lse), scale=0.25,
                             mask="causal", diagonal=-5)
    assert not any(g.isnan().any() for g in grads)
    assert (grads[0][:, :5] == 0).all()


def test_preprocess_kernel_is_row_delta():
    out, dout = (torch.randn(2, 23, 3, 59).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    torch.testing.assert_close(BACKEND.row_delta(out, dout), row_delta(out, dout), rtol=1e-6, atol=1e-5)


# --- planted bugs: the verdict must catch them -------------------------------------------------

class ShiftedDiagonal(TritonBackend):
    """A planted bug: the causal offset off by one (forward, backward, or both)."""

    def __init__(self, forward_shift: int, backward_shift: int):
        super().__init__()
        self.shifts = forward_shift, backward_shift

    def forward(self, q, k, v, *, scale, mask, diagonal=0):
        return super().forward(q, k, v, scale=scale, mask=mask, diagonal=diagonal + self.shifts[0])

    def backward(self, q, k, v, dout, lse, delta, *, scale, mask, diagonal=0):
        return super().backward(q, k, v, dout, lse, delta, scale=scale, mask=mask,
                                diagonal=diagonal + self.shifts[1])


@interpreter_only
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the garbage scores
def test_verdict_catches_bf16_dot_without_upcast_under_the_interpreter():
    case = TRITON_PLANTED_CASES["p2_causal"]
    verdict = verdict_of(case, TritonBackend(dot_fp32=False))
    assert not verdict.passed, "bf16 tl.dot without upcast under the interpreter went unnoticed"
    assert {"out", "lse"} <= {t.tensor for t in verdict.failures}, verdict.message()
    assert verdict["out"].error > 1e3, verdict.message()  # garbage, not a rounding difference
    assert verdict_of(case, TritonBackend(dot_fp32=True)).passed


@pytest.mark.parametrize("name", ["p2_causal", "p2_striped"])
def test_verdict_catches_a_wrong_causal_offset(name):
    verdict = verdict_of(TRITON_PLANTED_CASES[name], ShiftedDiagonal(1, 1))
    assert not verdict.passed and "out" in {t.tensor for t in verdict.failures}, verdict.message()


def test_verdict_catches_a_wrong_causal_offset_in_the_backward_alone():
    verdict = verdict_of(TRITON_PLANTED_CASES["p2_zigzag"], ShiftedDiagonal(0, 1))
    failed = {t.tensor for t in verdict.failures}
    assert failed and failed <= {"dq", "dk", "dv"}, verdict.message()


# --- errors, never silent fallbacks ------------------------------------------------------------

def test_cpu_tensors_with_compiled_kernels_raise_with_the_fix():
    """Without TRITON_INTERPRET the kernels compile for the GPU; CPU tensors must not run
    silently anywhere else (a fresh process, since the choice is made at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = ("import torch\nfrom ringcheck.ring.backends import get_backend\nx = torch.zeros(1, 4, 1, 16)\n"
            "get_backend('triton').forward(x, x, x, scale=1.0, mask='full', diagonal=0)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "RuntimeError" in done.stderr and "TRITON_INTERPRET=1" in done.stderr, done.stderr[-2000:]


H100_SHARED_MEMORY = 232448  # bytes of shared memory one block may use on sm_90


NO_NVIDIA_BACKEND = pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                                       reason="this triton has no NVIDIA backend")

# what the tests below read of the kernels compiled for sm_90: one process compiles them all (a Python with
# torch and Triton, and each compilation, cost seconds), printing one JSON object
FOR_AN_H100 = """
import json, torch
from ringcheck.ring.backends.triton_backend import compile_for_gpu, gpu_assembly
print(json.dumps({
    "bf16 d128 causal": compile_for_gpu(arch=90, dtype=torch.bfloat16, head_dim=128, causal=True),
    "fp16 d59 3 heads over 1": compile_for_gpu(arch=90, dtype=torch.float16, head_dim=59, causal=False, heads=3,
                                               kv_heads=1),
    "bf16 d192 v128 causal band softcap": compile_for_gpu(arch=90, dtype=torch.bfloat16, head_dim=192, v_head_dim=128,
                                                          causal=True, band=True, softcap=True),
    "ttir bf16 d128 causal": gpu_assembly("ttir", arch=90, dtype=torch.bfloat16, head_dim=128, causal=True),
}))
"""


@pytest.fixture(scope="session")
def for_an_h100(tmp_path_factory):
    """The kernels compiled for sm_90 in a process without TRITON_INTERPRET (the interpreter is lax:
    types, constexpr scoping, memory), once per run: the first pytest-xdist worker to ask compiles them
    under a lock, the others read what it wrote."""
    run = tmp_path_factory.getbasetemp()
    run = run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run  # the run's folder, its workers'
    with open(run / "for-an-h100.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        written = run / "for-an-h100.json"
        if not written.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
            done = subprocess.run([sys.executable, "-c", FOR_AN_H100], env=env, capture_output=True, text=True,
                                  timeout=600, check=False)
            said = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None
            written.write_text(json.dumps({"compiled": said and json.loads(said), "stderr": done.stderr[-3000:]}))
    compiled = json.loads(written.read_text())
    assert compiled["compiled"] is not None, compiled["stderr"]
    return compiled["compiled"]


@NO_NVIDIA_BACKEND
def test_kernels_compile_for_an_h100_without_one(for_an_h100):
    """The tensor-core variants for sm_90, ahead of time, within an H100's shared memory."""
    for what in ("bf16 d128 causal", "fp16 d59 3 heads over 1"):
        shared = for_an_h100[what]  # {kernel: bytes}
        assert len(shared) == 4 and max(shared.values()) <= H100_SHARED_MEMORY, (what, shared)


@NO_NVIDIA_BACKEND
def test_variant_kernels_compile_for_an_h100_without_one(for_an_h100):
    """The band + softcap + MLA (192/128) switches for sm_90, within an H100's shared memory."""
    shared = for_an_h100["bf16 d192 v128 causal band softcap"]
    assert len(shared) == 4 and max(shared.values()) <= H100_SHARED_MEMORY, shared


@NO_NVIDIA_BACKEND
def test_every_tile_address_is_computed_in_int64(for_an_h100):
    """Issue 59, defect 11: a tile's element offset (row x stride_s + column x stride_d) in
    int32 wraps once (local_len - 1) x heads x head_dim reaches 2^31 (524,288 tokens per rank at
    32 heads of 128), an illegal or silently wrong address on the GPU. No CPU can hold such a
    shard, so read what the compiler made of the arithmetic: in the sm_90 TTIR of every kernel,
    every `tt.addptr` (tile loads and stores, row statistics, the batch and head bases) adds an
    i64 offset."""
    ttir = for_an_h100["ttir bf16 d128 causal"]
    assert len(ttir) == 4
    for kernel, text in ttir.items():
        # `%p = tt.addptr %base, %offset : <pointer type>, <offset type> loc(...)`
        offsets = [line.split(" : ")[-1].split(" loc(")[0].rsplit(", ", 1)[-1]
                   for line in text.splitlines() if "tt.addptr" in line]
        assert offsets, kernel
        narrow = [t for t in offsets if not (t == "i64" or t.endswith("xi64>"))]
        assert not narrow, f"{kernel}: {len(narrow)} of {len(offsets)} addresses add a narrower offset: {narrow}"


def test_missing_triton_raises_runtime_error(monkeypatch):
    import ringcheck.ring.backends.triton_backend as glue
    monkeypatch.setattr(glue, "_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match="needs the triton package"):
        get_backend("triton")


@pytest.mark.parametrize("bad,error", [
    (dict(mask="sliding"), ValueError),
    (dict(diagonal=0.5), TypeError),
    (dict(head_dim=320), ValueError),
    (dict(kv_heads=3), ValueError),
    (dict(dtype=torch.float64), TypeError),
])
def test_invalid_blocks_raise(bad, error):
    opts = dict(mask="causal", diagonal=0, head_dim=16, kv_heads=1, dtype=torch.float32) | bad
    q = torch.zeros(1, 4, 2, opts["head_dim"], dtype=opts["dtype"], device=DEVICE)
    kv = torch.zeros(1, 4, opts["kv_heads"], opts["head_dim"], dtype=opts["dtype"], device=DEVICE)
    with pytest.raises(error):
        BACKEND.forward(q, kv, kv, scale=1.0, mask=opts["mask"], diagonal=opts["diagonal"])


# --- the GPU check script, as far as a CPU can run it -------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_skips_cleanly_without_cuda(capsys):
    from benchmarks import gpu_check
    assert gpu_check.main([]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().out


@interpreter_only
def test_gpu_check_timing_table_runs_small_on_the_cpu(capsys):
    from benchmarks import gpu_check
    table = gpu_check.benchmark(1, device="cpu", bench=lambda fn, grads=None: (fn(), 1.0)[1],
                                head_dims=(16,), seq_lens=(24,), tokens=24, width=32)
    assert [(row[2], row[3]) for row in table] == [(False, "triton"), (False, "sdpa"), (True, "triton"), (True, "sdpa")]
    assert all(row[-1] < 2e-2 for row in table), table  # the Triton forward agrees with SDPA
    assert "TFLOP/s" in capsys.readouterr().out


# --- GPU only: the compiled kernels at their own tile sizes ------------------------------------

@on_gpu
@pytest.mark.parametrize("name", TRITON_GPU_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_ring_meets_budget(name, backend):
    case = TRITON_GPU_CASES[name]
    verdict = verdict_of(Case(case.spec, case.ring, case.seed, case.distribution, backend))
    assert verdict.passed, verdict.message()


@on_gpu
@pytest.mark.parametrize("sq,sk,diagonal", [(300, 300, 0), (257, 257, -1), (200, 333, 70), (333, 129, -100)])
def test_gpu_causal_block_matches_float64(sq, sk, diagonal):
    """Masks at the GPU tile sizes."""
    failures = check_block(batch=2, sq=sq, sk=sk, heads=4, kv_heads=1,
                           head_dim=48, dtype=torch.bfloat16, mask="causal", diagonal=diagonal)
    assert not failures, "\n".join(failures)


def test_the_cases_make_test_leaves_to_ci_are_cases_of_the_grid():
    assert _THOROUGH <= set(TRITON_CASES), sorted(_THOROUGH - set(TRITON_CASES))
