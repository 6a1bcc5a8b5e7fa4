"""Named case tables: every hand-picked case the suites run, in one place, read top to bottom.

In the manner of TransformerEngine's context-parallel tests (``model_configs = {"cp_1_0":
ModelConfig(...), ...}``): one constructor, `case`, and one table per purpose, each a dict
name -> `Case`; a test parametrizes over a table's names and looks its case up::

    @pytest.mark.parametrize("name", RING_CASES)
    def test_ring_within_budget_of_float64(name):
        verdict = run_case(RING_CASES[name])

Names: sweeps are keyed by `case_id` (built with `named`), so a name always spells its case;
tables whose entries tests pick by hand have short literal names and a comment.

Which tables:
    RING_CASES, RING_PLAIN_CASES, RING_NEAR_UNIFORM_CASES  suites/test_ring.py
    PLANTED_CASES                                          suites/test_planted_bugs.py
    SEARCH_BENIGN_CASES                                    suites/test_properties_search.py
    BUDGET_FINDINGS                                        suites/test_properties_budget_findings.py
    TRITON_CASES, TRITON_PLANTED_CASES, TRITON_GPU_CASES   suites/test_triton_backend.py
    DISTRIBUTED_CASES, DISTRIBUTED_LSE_CASES,
    DISTRIBUTED_FAULT_CASES                                suites/test_distributed.py
    FLASH_STAND_IN_CASES, FLASH_CASES                      suites/test_flash_attn_backend.py
"""

from __future__ import annotations

import itertools

from ..judge.check import MODES, Case
from ..judge.distributions import DISTRIBUTIONS
from ..ring.backends import BACKENDS
from ..spec import DTYPES, AttentionSpec, RingSpec, check_positive_int

__all__ = [
    "case", "case_id", "named",
    "RING_CASES", "RING_PLAIN_CASES", "RING_NEAR_UNIFORM_CASES", "PLANTED_CASES", "SEARCH_BENIGN_CASES",
    "BUDGET_FINDINGS", "TRITON_CASES", "TRITON_PLANTED_CASES", "TRITON_GPU_CASES", "DISTRIBUTED_CASES",
    "DISTRIBUTED_LSE_CASES", "DISTRIBUTED_FAULT_CASES", "FLASH_STAND_IN_CASES", "FLASH_CASES",
]

DEFAULT_TOKENS = 4  # tokens per zig-zag chunk when neither `tokens` nor `seq_len` is given


def case(mode: str, *, world_size: int, dtype: str = "float32", heads: int = 4, kv_heads: int = 2,
         head_dim: int = 16, tokens: int | None = None, seq_len: int | None = None, batch: int = 1,
         seed: int = 0, distribution: str = "normal", backend: str = "torch") -> Case:
    """One case of the simulated ring.

    mode: a key of `ringcheck.judge.check.MODES` ("bidirectional", "causal", "zigzag",
        "striped"): it sets both the mask and the layout.
    world_size: ranks in the ring.
    tokens: tokens per zig-zag chunk (default 4), i.e. seq_len = 2 x world_size x tokens,
        which every layout can hold.
    seq_len: the sequence length itself, instead of `tokens` (e.g. one that is not a multiple
        of 2 x world_size); it must still suit the layout: a multiple of world_size, or of
        2 x world_size for zig-zag.
    heads, kv_heads, head_dim, batch, dtype: the attention problem (q has `heads` heads, k and
        v `kv_heads`).
    seed, distribution, backend: as in `Case`.

    Raises ValueError (TypeError for a non-int size) on an argument no case can have.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {list(MODES)}")
    check_positive_int("world_size", world_size)
    if tokens is not None and seq_len is not None:
        raise ValueError(f"give tokens (per zig-zag chunk) or seq_len, not both (got tokens={tokens}, "
                         f"seq_len={seq_len})")
    if seq_len is None:
        seq_len = 2 * world_size * check_positive_int("tokens", DEFAULT_TOKENS if tokens is None else tokens)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r} is unknown; choose one of {list(DISTRIBUTIONS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {list(BACKENDS)}")
    causal, layout = MODES[mode]
    spec = AttentionSpec(batch=batch, heads=heads, kv_heads=kv_heads, seq_len=seq_len, head_dim=head_dim,
                         dtype=dtype, causal=causal)
    ring = RingSpec(world_size, layout)
    ring.check_seq_len(spec.seq_len)
    return Case(spec, ring, seed=seed, distribution=distribution, backend=backend)


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
assert set(_SHORT_DTYPES) == set(DTYPES)


def case_id(case: Case) -> str:
    """A pytest id that spells `case` the way `case(...)` would build it: ring size, mode and
    dtype always, then only what differs from `case`'s defaults, e.g.
    ``p2_zigzag_bf16_h2kv1_d40_s3_near-uniform_triton`` (heads 2 / kv_heads 1, head_dim 40,
    seed 3, near-uniform inputs, the Triton backend). ``t<n>`` is tokens per zig-zag chunk,
    ``n<n>`` a seq_len that is not a multiple of 2 x world_size. Distinct cases get distinct ids."""
    s, ring = case.spec, case.ring
    modes = {value: name for name, value in MODES.items()}
    mode = modes.get((s.causal, ring.layout),
                     f"{'causal' if s.causal else 'bidirectional'}-{ring.layout}")
    parts = [f"p{ring.world_size}", mode, _SHORT_DTYPES[s.dtype]]
    if (s.heads, s.kv_heads) != (4, 2):
        parts.append(f"h{s.heads}kv{s.kv_heads}")
    if s.head_dim != 16:
        parts.append(f"d{s.head_dim}")
    chunks = 2 * ring.world_size
    if s.seq_len % chunks:
        parts.append(f"n{s.seq_len}")
    elif s.seq_len // chunks != DEFAULT_TOKENS:
        parts.append(f"t{s.seq_len // chunks}")
    if s.batch != 1:
        parts.append(f"b{s.batch}")
    if s.softmax_scale is not None:
        parts.append(f"scale{s.softmax_scale:g}")
    if case.seed != 0:
        parts.append(f"s{case.seed}")
    if case.distribution != "normal":
        parts.append(case.distribution)
    if case.backend != "torch":
        parts.append(case.backend)
    return "_".join(parts)


def named(*cases: Case) -> dict[str, Case]:
    """A table of `cases` keyed by `case_id`, in the order given; a case given twice is an error."""
    table: dict[str, Case] = {}
    for c in cases:
        name = case_id(c)
        if name in table:
            raise ValueError(f"case {name} is in the table twice")
        table[name] = c
    return table


# ----------------------------------------------------------------------- the simulated ring
# suites/test_ring.py: every mode, every dtype, MHA and GQA, ring sizes 1 to 16; the seed is
# the ring size.
RING_CASES = named(*(
    case(mode, world_size=p, dtype=dtype, heads=4, kv_heads=kv_heads, seed=p)
    for p in (1, 2, 3, 4, 8, 16)
    for dtype in ("float32", "bfloat16", "float16")
    for mode in MODES
    for kv_heads in (4, 2)  # MHA, GQA
))

# the same through the plain-matmul block backend (GQA only)
RING_PLAIN_CASES = named(*(
    case(mode, world_size=p, dtype=dtype, seed=p, backend="torch_plain")
    for p in (1, 3, 8)
    for dtype in ("float32", "bfloat16", "float16")
    for mode in MODES
))

# near-tied softmax rows on the largest ring: the rounding of 16 merges adds up
RING_NEAR_UNIFORM_CASES = named(*(
    case(mode, world_size=16, dtype=dtype, tokens=8, head_dim=32, distribution="near-uniform")
    for dtype in ("bfloat16", "float32")
    for mode in MODES
))

# ----------------------------------------------------------------------- planted bugs
# suites/test_planted_bugs.py: the cases each planted bug must fail (and the real ring pass)
PLANTED_CASES = {
    "p4_bidirectional": case("bidirectional", world_size=4, seed=11),   # merge, home check
    "p4_zigzag": case("zigzag", world_size=4, seed=11),                 # the zig-zag diagonal
    "p16_near_uniform": case("bidirectional", world_size=16, dtype="bfloat16", tokens=8, head_dim=32,
                             seed=11, distribution="near-uniform"),     # bf16 partial output per hop
}

# suites/test_properties_search.py: hand-picked cases in the style of test_ring.py (normal
# inputs, power-of-two shapes) that miss the search's planted bugs; the seed is the ring size
SEARCH_BENIGN_CASES = named(
    case("bidirectional", world_size=4, dtype="bfloat16", seed=4),
    case("causal", world_size=4, dtype="bfloat16", seed=4),
    case("zigzag", world_size=4, dtype="bfloat16", seed=4),
    case("zigzag", world_size=8, dtype="bfloat16", seed=8),
)

# ----------------------------------------------------------------------- budget findings
# suites/test_properties_budget_findings.py: cases where flash-attention's bare budget rule
# failed the correct ring (and the ring of one); the float32 floors now pass them. The test
# file holds each finding's explanation and failing tensors.
BUDGET_FINDINGS = {
    "wide_fp32_p4": case("bidirectional", world_size=4, heads=2, kv_heads=1, seq_len=16, seed=2,
                         distribution="wide"),                        # float32 peer as precise as we are
    "wide_fp32_p1": case("bidirectional", world_size=1, heads=2, kv_heads=1, seq_len=16, seed=2,
                         distribution="wide"),                        # ... and on a ring of one
    "one_key_fp16_p1": case("bidirectional", world_size=1, dtype="float16", heads=1, kv_heads=1, seq_len=1,
                            head_dim=9, seed=2),                      # dq = dk = 0 exactly
    "sink_fp16_p4": case("bidirectional", world_size=4, dtype="float16", batch=2, seq_len=16,
                         distribution="sink"),                        # saturated rows
    "sink_fp16_p1": case("bidirectional", world_size=1, dtype="float16", batch=2, seq_len=16,
                         distribution="sink"),                        # ... and on a ring of one
    "late_max_bf16_p3": case("striped", world_size=3, dtype="bfloat16", batch=2, seq_len=15, head_dim=32,
                             seed=1, distribution="late-max"),        # saturated rows, striped
    "repeated_max_bf16_p1": case("bidirectional", world_size=1, dtype="bfloat16", heads=2, kv_heads=2,
                                 seq_len=2, head_dim=30, seed=801,
                                 distribution="repeated-max"),        # every key tied
}

# ----------------------------------------------------------------------- Triton blocks
# suites/test_triton_backend.py, trimmed for a 2-core CPU (the interpreter runs every kernel
# program in Python): bf16 GQA (heads 2 / kv_heads 1) unless said otherwise.
TRITON_CASES = named(
    # ring sizes 1, 2, 4, 8 in every mode (striped up to P=4)
    *(case(mode, world_size=p, dtype="bfloat16", heads=2, kv_heads=1, backend="triton")
      for p in (1, 2, 4, 8) for mode in MODES if not (mode == "striped" and p == 8)),
    # float32 and float16 at P=4
    *(case(mode, world_size=4, dtype=dtype, heads=2, kv_heads=1, backend="triton")
      for dtype in ("float32", "float16") for mode in MODES),
    # odd head dims and GQA groups at P=2
    case("zigzag", world_size=2, dtype="bfloat16", heads=4, kv_heads=2, head_dim=40, backend="triton"),
    case("causal", world_size=2, dtype="float16", heads=3, kv_heads=1, head_dim=59, backend="triton"),
    case("zigzag", world_size=2, dtype="bfloat16", heads=2, kv_heads=2, head_dim=80, batch=2, backend="triton"),
    case("striped", world_size=2, dtype="bfloat16", heads=4, kv_heads=1, head_dim=96, backend="triton"),
    case("bidirectional", world_size=2, dtype="float32", heads=2, kv_heads=1, head_dim=111, backend="triton"),
    case("zigzag", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, head_dim=256, tokens=2, backend="triton"),
    # local chunks longer than one interpreter tile (16 rows), with ragged tails
    case("causal", world_size=1, dtype="bfloat16", heads=2, kv_heads=1, head_dim=24, tokens=19,
         backend="triton"),                                           # 38 rows, 3 tiles
    case("zigzag", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, tokens=13,
         backend="triton"),                                           # 26 rows per rank
    case("striped", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, tokens=17,
         backend="triton"),                                           # diagonal -1 over 2+ tiles
    case("causal", world_size=2, dtype="float32", heads=2, kv_heads=1, tokens=9,
         backend="triton"),                                           # 18 rows per rank, float32
    # validate's ragged shard of 66 per rank (issue 43): past the tiles 16, 32, 64, a multiple of none
    # (130 per rank, past 128: `python -m benchmarks.lengths` runs validate --backend triton)
    case("zigzag", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, tokens=33,
         backend="triton"),                                           # 66 per rank, chunks of 33
)

# the cases the Triton planted bugs (no upcast of bf16 dots, a shifted causal offset) must fail
TRITON_PLANTED_CASES = {
    "p2_causal": case("causal", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, backend="triton"),
    "p2_striped": case("striped", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, backend="triton"),
    "p2_zigzag": case("zigzag", world_size=2, dtype="bfloat16", heads=2, kv_heads=1,
                      backend="triton"),                              # the backward's offset alone
}

# GPU only: the compiled kernels at their own tile sizes; the test runs each case on both the
# triton and the torch block backend (it sets the backend)
TRITON_GPU_CASES = named(
    case("causal", world_size=1, dtype="bfloat16", head_dim=128, tokens=300),
    case("zigzag", world_size=2, dtype="bfloat16", head_dim=64, tokens=161),
    case("striped", world_size=4, dtype="float16", head_dim=96, tokens=100),
    case("causal", world_size=2, dtype="float32", head_dim=59, tokens=130),
    case("bidirectional", world_size=2, dtype="bfloat16", head_dim=256, tokens=70),
    case("zigzag", world_size=8, dtype="bfloat16", head_dim=128, tokens=64),
)

# ----------------------------------------------------------------------- torch.distributed
# suites/test_distributed.py: ring_attention on a process group against the simulated ring,
# bit for bit. For every ring size: every mode, float32 and bfloat16, GQA (4/2) and MHA (2/2),
# batch 2, seeds 0..15 in that order.
DISTRIBUTED_CASES = named(*(
    case(mode, world_size=p, dtype=dtype, batch=2, heads=heads, kv_heads=kv_heads, seed=seed)
    for p in (8, 4, 3, 2, 1)
    for seed, (mode, dtype, (heads, kv_heads)) in enumerate(
        itertools.product(MODES, ("float32", "bfloat16"), ((4, 2), (2, 2))))
))

# a gradient flowing into lse as well as out
DISTRIBUTED_LSE_CASES = named(*(
    case(mode, world_size=p, dtype="bfloat16", batch=2)
    for p in (4, 3) for mode in ("bidirectional", "zigzag")
))

# collective failures
DISTRIBUTED_FAULT_CASES = {
    "wrong_result_p4": case("zigzag", world_size=4, batch=2),   # one rank's output made wrong
    "raises_p3": case("causal", world_size=3, batch=2),         # one rank raises before its first send
}

# ----------------------------------------------------------------------- flash-attn blocks
# suites/test_flash_attn_backend.py: the backend's glue in the ring on a CPU stand-in for
# flash-attn (the test says which entries use flash-attn 2.5's backward signature)
FLASH_STAND_IN_CASES = named(
    case("bidirectional", world_size=2, dtype="bfloat16", heads=2, kv_heads=1, backend="flash_attn"),
    case("causal", world_size=4, dtype="bfloat16", head_dim=40, backend="flash_attn"),
    case("zigzag", world_size=4, dtype="float16", heads=2, kv_heads=1, head_dim=59, backend="flash_attn"),
    case("striped", world_size=4, dtype="bfloat16", heads=2, kv_heads=2, head_dim=96, backend="flash_attn"),
    case("striped", world_size=2, dtype="float16", heads=3, kv_heads=1, head_dim=20, tokens=6,
         backend="flash_attn"),
)

# the real flash-attn on CUDA: every mode at P = 1, 2, 4, 8; float16 too at P = 2 and 8
FLASH_CASES = named(*(
    case(mode, world_size=p, dtype=dtype, batch=2, head_dim=72, tokens=96, backend="flash_attn")
    for p in (1, 2, 4, 8) for mode in MODES for dtype in ("bfloat16", "float16")
    if p in (2, 8) or dtype == "bfloat16"
))
