"""`ringcheck validate`: is this ring attention exact, on this ring, at this configuration?

The target (`Target`) names the implementation (`--impl`), the attention shape at its full
length, the dtype, the layout and the ring size. `validate_on_rank` runs on every rank of a
process group (a torchrun world, or a local gloo ring the CLI starts) and returns the same
list of `CheckRow` s on every rank:

- forward and backward of the implementation against float64 and the same-dtype peer, at
  scaled-down shapes of the target's family (same heads, kv_heads, head_dim, dtype, layout,
  causal) for every named logit distribution and several ring-local lengths;
- at the full target length, sampled query rows against the row-sampled reference (never an
  N x N matrix): dout is zero except on those rows, so dq of the rows and dk, dv of every key
  have an exact O(rows x N) reference too;
- NaN/Inf anywhere; determinism (two runs, same bits); output shape and dtype; the layout's
  per-rank work balance (information, not a gate).

Verdicts are computed on the group's rank 0 and broadcast, so every rank reports the same.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from reference import mp_attention

from ..documents import VALIDATE_SCHEMA, header
from ..judge.check import (
    Case,
    Results,
    reference_kwargs,
    row_results,
)
from ..judge.distributions import DISTRIBUTIONS
from ..judge.inputs import Inputs, make_inputs, sample_rows, with_sampled_rows
from ..judge.precision import judge_with_class
from ..judge.variant_options import VariantOptions
from ..judge.verdict import TENSORS, Verdict
from ..ring.layouts import positions, unshard
from ..spec import AttentionSpec, Budget, RingSpec, is_custom_layout
from .adapters import Impl, load_impl, require_variant_keywords
from .impl_shards import ContractError, run_shards  # noqa: F401 - ContractError: validate's name for it too
from .peer_adapters import stand_in_row
from .validate_rows import (
    BACKWARD,
    CheckRow,
    backward_row,
    balance_row,
    class_rows,
    finite_row,
    judge_rows,
    shape_row,
    summarise,
)


@dataclass(frozen=True)
class Target:
    """What to validate. Defaults: our ring on a CPU-sized causal zig-zag bf16 problem."""

    seq_len: int = 2048
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    causal: bool = True
    layout: str = "zigzag"
    softmax_scale: float | None = None
    world_size: int = 4
    impl: str = "ringcheck"
    backend: str = "torch"
    seed: int = 0
    sample_rows: int = 16
    local_lengths: tuple[int, ...] = (2, 6, 16)
    distributions: tuple[str, ...] | None = None  # None: every registered distribution
    # attention variants (`VariantOptions`; none by default): the training configuration
    documents: str | None = None
    pad: int = 0
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    head_dim_v: int | None = None
    # `import flash_attn` resolves to ringcheck's CPU stand-in on every rank (when the real one is absent)
    flash_attn_stand_in: bool = False
    forward_only: bool = False  # an inference ring: no backward is run, backward rows say "not run"

    def __post_init__(self) -> None:
        if isinstance(self.window, list):
            object.__setattr__(self, "window", tuple(self.window))
        ring = RingSpec(self.world_size, self.layout)
        ring.check_seq_len(self.seq_len)
        self.full_spec()  # validates shape, dtype, heads / kv_heads and the variant at full length
        for n in self.local_lengths:  # and at every scaled length
            if n >= 1 and not (self.layout in ("zigzag", "zigzag_docs") and n % 2):
                self.spec(n * self.world_size)
        if self.sample_rows < 1:
            raise ValueError(f"sample_rows must be >= 1, got {self.sample_rows}")
        if self.sample_rows > self.seq_len:
            raise ValueError(f"sample_rows={self.sample_rows} is more than the seq_len={self.seq_len} query rows of "
                             f"the target; pass --sample-rows {self.seq_len} (every row) or fewer, or a longer --seq-len")
        for n in self.local_lengths:
            if n < 1 or (self.layout in ("zigzag", "zigzag_docs") and n % 2):
                raise ValueError(f"local length {n} does not fit the {self.layout} layout "
                                 f"(zigzag needs an even number of tokens per rank)")
        for name in self.distributions or ():
            if name not in DISTRIBUTIONS:
                raise ValueError(f"distribution {name!r} is unknown; choose from {sorted(DISTRIBUTIONS)}")

    def full_spec(self) -> AttentionSpec:
        return self.spec(self.seq_len, self.batch)

    @property
    def variants(self) -> VariantOptions:
        return VariantOptions(documents=self.documents, pad=self.pad, window=self.window, softcap=self.softcap,
                              sinks=self.sinks, head_dim_v=self.head_dim_v)

    def spec(self, seq_len: int, batch: int = 1, seed: int | None = None) -> AttentionSpec:
        """The target's problem at `seq_len`: at the full length with the variant as given, at a
        scaled-down length with it scaled (`scaled_variants`); `seed` places random documents."""
        options = self.variants.scaled(seq_len, self.seq_len, self.ring)
        variant, sinks, v_head_dim = options.resolve(seq_len, self.ring, self.seed if seed is None else seed)
        spec = AttentionSpec(batch=batch, heads=self.heads, kv_heads=self.kv_heads, seq_len=seq_len,
                             head_dim=self.head_dim, dtype=self.dtype, causal=self.causal,
                             softmax_scale=self.softmax_scale, variant=variant, sinks=sinks, v_head_dim=v_head_dim)
        if self.layout == "zigzag_docs" or is_custom_layout(self.layout):  # documents cut into 2P chunks; a
            # custom layout's ranks partition the sequence (checked here, before any rank starts)
            positions(layout=self.layout, rank=0, world_size=self.world_size, seq_len=seq_len,
                      cu_seqlens=variant.cu_seqlens)
        return spec

    @property
    def ring(self) -> RingSpec:
        return RingSpec(self.world_size, self.layout)

    def describe(self) -> str:
        return " ".join([
            f"--impl {self.impl} --world-size {self.world_size} --layout {self.layout} "
            f"--seq-len {self.seq_len} --batch {self.batch} --heads {self.heads} "
            f"--kv-heads {self.kv_heads} --head-dim {self.head_dim} --dtype {self.dtype}"
            + (" --causal" if self.causal else "")
            + (f" --softmax-scale {self.softmax_scale}" if self.softmax_scale is not None else ""),
            *self.variants.flags()])

    @classmethod
    def from_mapping(cls, values: dict[str, Any], *, source: str = "config") -> "Target":
        names = {f.name for f in dataclasses.fields(cls)}
        normalised = {key.replace("-", "_"): value for key, value in values.items()}
        unknown = sorted(set(normalised) - names)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(names)}")
        for key in ("local_lengths", "distributions"):
            if isinstance(normalised.get(key), list):
                normalised[key] = tuple(normalised[key])
        return cls(**normalised)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ rank side

def _rank_info(group) -> tuple[int, int, int]:
    return dist.get_rank(group), dist.get_world_size(group), dist.get_global_rank(group, 0)



def check_variant_keywords(impl: Impl, target: Target) -> None:
    """ValueError naming the keyword and its flag when the target uses a variant keyword the
    implementation does not accept (nor **kwargs): before any rank starts."""
    if impl.check_target is not None:  # a built-in adapter's own rules (variants, heads)
        impl.check_target(target)
    require_variant_keywords(impl.fn, impl.name, target.full_spec())


def _gather(local: dict, group, world_size: int) -> list[dict]:
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, local, group=group)
    return everyone


def _whole(parts: list[dict], layout: str, cu_seqlens=None) -> Results | None:
    """Unshard every rank's shards into whole tensors (lse may be missing: then zeros, unjudged);
    dsinks is rank 0's (every rank must hold the whole sequence's: the contract)."""
    def cat(name, dim):
        return unshard([p[name] for p in parts], layout=layout, dim=dim, cu_seqlens=cu_seqlens)
    lse = cat("lse", 2) if parts[0]["lse"] is not None else None
    out = cat("out", 1)
    ran = parts[0]["dq"] is not None  # --forward-only: no gradients (unjudged)
    return Results(out, lse if lse is not None else torch.zeros(out.shape[0], out.shape[2], out.shape[1]),
                   *((cat("dq", 1), cat("dk", 1), cat("dv", 1)) if ran else (None, None, None)),
                   parts[0].get("dsinks"))


# distributions that place every row's maximum on one key per ring step that every row of a
# group sees: with documents or a window no such key exists, so they are left out there
WHOLE_SEQUENCE_ONLY = ("late-max",)


def scaled_cases(target: Target) -> list[Case]:
    dists = target.distributions or tuple(DISTRIBUTIONS)
    if target.full_spec().variant.masks_tokens:
        dists = tuple(d for d in dists if d not in WHOLE_SEQUENCE_ONLY) or ("normal",)
    cases = []
    for i, (dist_name, n) in enumerate(itertools.product(dists, target.local_lengths)):
        spec = target.spec(n * target.world_size, seed=target.seed + i)
        cases.append(Case(spec, target.ring, seed=target.seed + i, distribution=dist_name, backend=target.backend))
    return cases


@dataclass
class _Rank:
    """This rank's view of one validate run: the target, the loaded implementation and the
    group, with the collective helpers every step uses."""

    target: Target
    impl: Impl
    group: Any
    rank: int
    world: int
    root: int
    budget: Budget
    progress: Callable[[str], None] | None
    device: torch.device = torch.device("cpu")

    def note(self, text: str) -> None:
        if self.progress is not None and self.rank == 0:
            self.progress(text)

    def on_root(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on the group's rank 0, its result broadcast to every rank."""
        payload = [compute() if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=self.root, group=self.group)
        return payload[0]

    def run(self, inputs: Inputs, spec: AttentionSpec, ring: RingSpec) -> list[dict]:
        """The implementation on every rank's shards; every rank's results, in rank order."""
        local = run_shards(self.impl, Case(spec, ring), inputs, self.rank, self.group, self.device,
                           forward_only=self.target.forward_only)
        return _gather(local, self.group, self.world)


@dataclass
class _FirstRun:
    case: Case
    inputs: Inputs
    parts: list[dict]


def _judged_tensors(returns_lse: bool, forward_only: bool = False) -> tuple[str, ...]:
    return tuple(t for t in TENSORS if (returns_lse or t != "lse") and not (forward_only and t in BACKWARD))


def _check_scaled_cases(ctx: _Rank) -> tuple[list[CheckRow], list[Verdict], bool, _FirstRun]:
    """Scaled-down shapes, every distribution, several local lengths: a forward and a
    backward row per distribution; also whether the implementation returns lse."""
    target, by_dist, classes = ctx.target, {}, []
    returns_lse, first = True, None
    for case in scaled_cases(target):
        ctx.note(f"{case.distribution}, {case.spec.seq_len // ctx.world} tokens per rank")
        inputs = make_inputs(case.spec, seed=case.seed, distribution=case.distribution, ring=case.ring)
        parts = ctx.run(inputs, case.spec, case.ring)
        returns_lse = parts[0]["lse"] is not None
        first = first or _FirstRun(case, inputs, parts)
        tensors = _judged_tensors(returns_lse, target.forward_only)
        verdict, precision = ctx.on_root(lambda: judge_with_class(  # the budget rule and the precision class
            case, _whole(parts, case.ring.layout, case.spec.variant.cu_seqlens), inputs, budget=ctx.budget,
            tensors=tensors))
        by_dist.setdefault(case.distribution, []).append(verdict)
        classes.append(precision)
    lengths = ",".join(str(n) for n in target.local_lengths)
    rows = []
    for name, verdicts in by_dist.items():
        rows.append(summarise(f"forward  {name} (local {lengths})", verdicts, ("out", "lse")))
        rows.append(backward_row(f"backward {name} (local {lengths})", verdicts, target.forward_only))
    rows += class_rows(classes, lengths, target.forward_only)
    return rows, [v for vs in by_dist.values() for v in vs], returns_lse, first


def validate_steps(target: Target) -> int:
    """The progress notes of a run: each scaled case, the full length, its reference, determinism."""
    return len(scaled_cases(target)) + 3


def _sparse_full_inputs(target: Target, spec: AttentionSpec) -> tuple[Inputs, torch.Tensor]:
    """Full-length inputs whose dout is zero except on the sampled rows, and those rows."""
    rows = sample_rows(spec.seq_len, target.sample_rows, target.seed)
    return with_sampled_rows(make_inputs(spec, seed=target.seed + 100003, distribution="normal", ring=target.ring),
                             rows), rows


def _certify_row_reference(spec: AttentionSpec, sparse: Inputs, rows: torch.Tensor) -> CheckRow:
    """The float64 row reference itself, against mpmath at 30 certified digits, on a few rows."""
    few = rows[torch.linspace(0, len(rows) - 1, min(4, len(rows))).round().long().unique()]
    true = row_results(spec, sparse, few, low=False)
    mp = mp_attention(sparse.q, sparse.k, sparse.v, sparse.dout, rows=few, cache=False,
                      **reference_kwargs(spec, sparse))
    worst = 0.0
    for a, b in ((true.out, mp.out), (true.lse, mp.lse), (true.dq, mp.dq)):
        ok = torch.isfinite(b)
        worst = max(worst, float((a[ok] - b[ok]).norm() / b[ok].norm().clamp_min(1e-300)))
    return CheckRow(f"reference: float64 rows vs mpmath ({mp.certified_digits:.0f} digits, {len(few)} rows)",
                    "pass" if worst <= 1e-12 else "fail", worst, 1e-12,
                    f"normwise relative difference of out, lse, dq at rows {few.tolist()}")


def _check_full_length(ctx: _Rank, returns_lse: bool) -> tuple[list[CheckRow], Verdict]:
    """The full target length on sampled rows (dq of the rows, dk and dv of every key), and
    the certification of the row reference."""
    spec = ctx.target.full_spec()
    ctx.note(f"full length {spec.seq_len}")
    sparse, rows = _sparse_full_inputs(ctx.target, spec)
    parts = ctx.run(sparse, spec, ctx.target.ring)

    def full_verdict():
        whole = _whole(parts, ctx.target.layout, spec.variant.cu_seqlens)
        got = Results(whole.out[:, rows], whole.lse[:, :, rows], None if whole.dq is None else whole.dq[:, rows],
                      whole.dk, whole.dv, whole.dsinks)
        return judge_rows(spec, ctx.target.ring, got, row_results(spec, sparse, rows, low=False),
                           row_results(spec, sparse, rows, low=True), rows,
                           _judged_tensors(returns_lse, ctx.target.forward_only),
                           ctx.budget, sparse)

    verdict = ctx.on_root(full_verdict)
    ctx.note("the row reference against mpmath")
    return [ctx.on_root(lambda: _certify_row_reference(spec, sparse, rows)),
            summarise(f"forward  full length {spec.seq_len}, {len(rows)} rows", [verdict], ("out", "lse")),
            backward_row(f"backward full length {spec.seq_len}, {len(rows)} rows, all keys", [verdict],
                         ctx.target.forward_only)], verdict


def _determinism_row(ctx: _Rank, first: _FirstRun) -> CheckRow:
    """The first case again: the same bits on every rank."""
    ctx.note("determinism")
    again = ctx.run(first.inputs, first.case.spec, first.case.ring)
    same = all(
        (a[t] is None and b[t] is None) or (a[t] is not None and b[t] is not None and torch.equal(a[t], b[t]))
        for a, b in zip(first.parts, again) for t in (*TENSORS, "dsinks") if t in a)
    return CheckRow("determinism (two runs, same bits)", "pass" if same else "fail",
                    detail=f"[{first.case.describe()}]")


def validate_on_rank(target: Target, group=None, *, budget: Budget = Budget(),
                     progress: Callable[[str], None] | None = None) -> list[CheckRow]:
    """Run every check of `target` on this rank (a collective over `group`)."""
    group = group if group is not None else dist.group.WORLD
    rank, world, root = _rank_info(group)
    if world != target.world_size:
        raise ValueError(f"the ring has {world} ranks but the target says world_size={target.world_size}; "
                         f"launch with torchrun --nproc-per-node={target.world_size} or pass --world-size {world}")
    stand_in = stand_in_row(target.flash_attn_stand_in)  # before the implementation is imported, on every rank
    impl = load_impl(target.impl, layout=target.layout, backend=target.backend)
    impl.check_layout(target.layout, target.causal)
    check_variant_keywords(impl, target)
    ctx = _Rank(target, impl, group, rank, world, root, budget, progress)
    scaled_rows, scaled_verdicts, returns_lse, first = _check_scaled_cases(ctx)
    full_rows, full_verdict = _check_full_length(ctx, returns_lse)
    return [*([stand_in] if stand_in else []), *scaled_rows, *full_rows, finite_row([*scaled_verdicts, full_verdict]),
            _determinism_row(ctx, first), shape_row(returns_lse), balance_row(target, world)]



# ------------------------------------------------------------------------------- reports

def report_dict(target: Target, rows: list[CheckRow], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The validate document (schema "ringcheck.validate", see `ringcheck.documents`); `meta`
    from `ringcheck.documents.meta`. `ringcheck.render.markdown` presents it."""
    return {
        **header(VALIDATE_SCHEMA),
        "passed": all(r.passed for r in rows),
        "target": target.to_dict(),
        "variants": target.variants.describe(),
        "command": f"ringcheck validate {target.describe()}",
        "checks": [dataclasses.asdict(r) for r in rows],
        "meta": meta or {},
    }


def validate_task(member, target: Target, progress: Callable[[str], None] | None = None) -> list[CheckRow]:
    """`validate_on_rank` as a ring task (`ringcheck.launch`): member carries the group; `progress`
    (picklable in a local ring: `ringcheck.launch.ProgressFile`) gets rank 0's notes."""
    return validate_on_rank(target, member.group, progress=progress)
