"""Precision drift: how the error of a ring grows with ring size, per dtype and distribution.

`run_drift` sweeps dtypes x ring sizes x distributions x modes x backends x accumulations x
seeds. For every case it runs the ring forward and backward and measures each tensor (out,
lse, dq, dk, dv) against the float64 truth and against the same-dtype single-device peer
(`ringcheck.judge.verdict.judge`, the budget rule). During the forward an observer records the
running float32 partial (out, lse) of every rank after every ring step, which is compared
with the float64 attention of that rank's queries over the K/V shards it has seen so far
(`step_truths`): the per-step drift.

Then, per group (implementation, backend, mode, dtype, distribution, accumulation, tensor), a
model: the least-squares slope of ln(error) on ln(P) (`fit_slope`), one point per ring size
P >= 2 and seed, error the normwise relative error, with one-sided 99% Student-t bounds. The
expected slope depends on the precision of the output (`expected_model`): about 0 for an
output narrower than float32 (the one final cast dominates a float32 merge), up to 0.5 for a
float32 output (float32 inputs, and lse: the merge rounds at the output's own precision, a
random walk of P roundings). Flags (`RULES`):

- ``slope``: the slope's lower bound is over the threshold of the output precision (0.25 for
  bfloat16/float16 outputs, 0.8 for float32 ones); where the bounds straddle it, or there are
  too few ring sizes or seeds to fit, the fit is "too weak to judge" (no flag, counted in the
  summary; `seeds_for_fit` is the seed count the command raises a sweep to);
- ``budget``: any P where any seed is over budget (error > k x peer error + slack);
- ``bias``: a mean signed error that grows with P, is a visible part of the error and shifts the
  tensor by at least one rounding of its output dtype (see `RULES["bias"]`);
- ``nonfinite``: NaN/Inf where the truth is finite.

The summary (`ringcheck.commands.drift.summary.summarise`) counts per accumulation the groups
flagged, judged and too weak to judge, and gives the verdict on the ring under test: "flagged",
"pass" (no flag, and at least one slope decided), or "no verdict" (no group could be judged:
never a PASS; the command exits 2 and names the ring sizes and seeds that would judge it).

The ring under test is our simulated ring (`SIMULATED`, with the per-hop round trip as its
control) or any implementation under the `--impl` contract on real process groups
(`ring_implementation`: local gloo rings or the torchrun world's sub-groups; one accumulation,
`AS_IMPLEMENTED`; no per-step observer; forward only when asked, the backward "not run").

The result is a plain JSON-ready document (schema "ringcheck.drift", documented in
`ringcheck.documents`, which saves, loads and diffs it); `ringcheck.render` presents it. No
rich or plotting imports here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

from ...documents import DRIFT_SCHEMA, header
from ...harness import ImplOptions, Mesh, Runner
from ...harness.embedding import check_witnesses, default_mesh, group_inputs
from ...judge.check import (
    MODES,
    TENSORS,
    Case,
    Results,
    peer,
    run_whole,
    simulated_impl,
    truth,
)
from ...judge.distributions import DISTRIBUTIONS
from ...judge.inputs import Inputs, make_inputs
from ...judge.variant_options import VariantOptions
from ...ring.backends import BACKENDS
from ...ring.layouts import positions
from ...ring.loops import ACCUMULATIONS, StepObserver
from ...spec import DTYPES, AttentionSpec, Budget, RingSpec
from .model import (
    FIT_MIN_P,
    PER_HEAD_RULE,
    RULES,
    StepRecorder,
    aggregate_seeds,
    fit_group,
    geometric_mean,
    significant,
    step_errors,
    step_truths,
    tensor_metrics,
)
from .summary import AS_IMPLEMENTED, UNDER_TEST, fit_seeds, summarise

DEFAULT_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_RING_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DISTRIBUTIONS = ("normal", "near-uniform")
DEFAULT_MODES = ("bidirectional", "causal", "zigzag")
# the modes of validate and the suites, plus per-document zig-zag (needs --documents)
DRIFT_MODES = {**MODES, "zigzag_docs": (True, "zigzag_docs")}
DEFAULT_BACKENDS = ("torch",)
DEFAULT_TOKENS_PER_RANK = 8
# "float32" is the ring under test (the default merge); "input" rounds the running output to
# the input dtype at every hop, a control that shows what per-hop rounding looks like
DEFAULT_ACCUMULATIONS = (UNDER_TEST, "input")

def _names(what: str, values: Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
    values, known = tuple(values), list(known)
    if not values:
        raise ValueError(f"{what}: give at least one of {known}")
    for v in values:
        if v not in known:
            raise ValueError(f"{what}: {v!r} is unknown; choose from {known}")
    if len(set(values)) != len(values):
        raise ValueError(f"{what}: {list(values)} names one value twice")
    return values


@dataclass(frozen=True)
class DriftSpec:
    """What a drift sweep covers. Ring sizes are either weak scaling (`tokens_per_rank` fixed,
    seq_len = P x tokens_per_rank: the ring grows with the context, as context parallelism is
    used) or strong scaling (`seq_len` fixed for every P: the same problem on more ranks)."""

    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    ring_sizes: tuple[int, ...] = DEFAULT_RING_SIZES
    distributions: tuple[str, ...] = DEFAULT_DISTRIBUTIONS
    modes: tuple[str, ...] = DEFAULT_MODES
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    accumulations: tuple[str, ...] = DEFAULT_ACCUMULATIONS
    seeds: int = 2
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    tokens_per_rank: int | None = None  # DEFAULT_TOKENS_PER_RANK unless seq_len is given
    seq_len: int | None = None
    softmax_scale: float | None = None
    budget: Budget = field(default_factory=Budget)
    # documents, padding, window, softcap, sinks, value head dim (`VariantOptions`)
    variants: VariantOptions = field(default_factory=VariantOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtypes", _names("dtypes", self.dtypes, DTYPES))
        object.__setattr__(self, "distributions", _names("distributions", self.distributions, DISTRIBUTIONS))
        object.__setattr__(self, "modes", _names("modes", self.modes, DRIFT_MODES))
        object.__setattr__(self, "backends", _names("backends", self.backends, BACKENDS))
        object.__setattr__(self, "accumulations", _names("accumulations", self.accumulations,
                                                         (*ACCUMULATIONS, AS_IMPLEMENTED)))
        sizes = tuple(self.ring_sizes)
        if not sizes:
            raise ValueError("ring_sizes: give at least one ring size")
        for p in sizes:
            RingSpec(p)  # type and range, with RingSpec's message
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"ring_sizes: {list(sizes)} names one size twice")
        object.__setattr__(self, "ring_sizes", tuple(sorted(sizes)))
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"seeds must be a count >= 1, got {self.seeds!r}")
        if self.tokens_per_rank is not None and self.seq_len is not None:
            raise ValueError(f"give tokens_per_rank (weak scaling) or seq_len (strong scaling), not both; got "
                             f"tokens_per_rank={self.tokens_per_rank}, seq_len={self.seq_len}")
        if self.tokens_per_rank is None and self.seq_len is None:
            object.__setattr__(self, "tokens_per_rank", DEFAULT_TOKENS_PER_RANK)
        for p in self.ring_sizes:  # every case is laid out before any runs
            for mode in self.modes:
                RingSpec(p, DRIFT_MODES[mode][1]).check_seq_len(self.seq_len_for(p))
                self.attention_spec(mode, self.dtypes[0], p)

    def seq_len_for(self, world_size: int) -> int:
        return self.seq_len if self.seq_len is not None else self.tokens_per_rank * world_size

    def attention_spec(self, mode: str, dtype: str, world_size: int) -> AttentionSpec:
        causal, layout = DRIFT_MODES[mode]
        seq_len = self.seq_len_for(world_size)
        variant, sinks, v_head_dim = self.variants.resolve(seq_len, RingSpec(world_size, layout))
        if layout == "zigzag_docs":  # the documents' layout checks, before any run
            positions(layout=layout, rank=0, world_size=world_size, seq_len=seq_len, cu_seqlens=variant.cu_seqlens)
        return AttentionSpec(batch=self.batch, heads=self.heads, kv_heads=self.kv_heads,
                             seq_len=seq_len, head_dim=self.head_dim, dtype=dtype,
                             causal=causal, softmax_scale=self.softmax_scale, variant=variant, sinks=sinks,
                             v_head_dim=v_head_dim)

    def to_json(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("budget", "variants")}
        for name, value in doc.items():
            if isinstance(value, tuple):
                doc[name] = list(value)
        doc["budget"] = {"k_forward": self.budget.k_forward, "k_backward": self.budget.k_backward}
        if self.variants.used:  # documents of plain attention stay as they were
            doc["variants"] = self.variants.to_json()
        return doc


# --- the implementation under test ---------------------------------------------------------

# (case, inputs, accumulation, observer or None) -> whole-sequence results, forward and backward
RunFn = Callable[[Case, Inputs, str, "StepObserver | None"], Results]


@dataclass(frozen=True)
class Implementation:
    """A ring the sweep can drive. `ring_sizes` narrows the requested sizes to those it can
    run (a distributed ring: the world's size); `observes_steps` says whether it calls the
    per-step observer; `accumulations` are the switches it has."""

    name: str
    run: RunFn
    observes_steps: bool = True
    accumulations: tuple[str, ...] = ACCUMULATIONS
    ring_sizes: Callable[[Sequence[int]], Sequence[int]] = tuple
    forward_only: bool = False  # dq, dk and dv are not run: "not run" in the report, never "pass"


def run_simulated(case: Case, inputs: Inputs, accumulation: str, observer: StepObserver | None) -> Results:
    return run_whole(simulated_impl(case, accumulate=accumulation, observer=observer), inputs)


SIMULATED = Implementation("simulated", run_simulated)
IMPLEMENTATIONS: dict[str, Implementation] = {"simulated": SIMULATED}


def ring_implementation(spec: str, processes, *, forward_only: bool = False, stand_in: bool = False,
                        max_ring_size: int | None = None, mesh: Mesh | None = None,
                        sinks_grad: str = "partial") -> Implementation:
    """An implementation under the `--impl` contract (`ringcheck.adapters.load_impl`, `spec` as
    --impl spells it) run on real process groups (`ringcheck.harness.Runner` on `processes`:
    local gloo rings, or the torchrun world, whose size `max_ring_size` bounds the ring sizes),
    each ring inside a mesh (`mesh` with its cp dim set to the ring size, else cp=P,tp=2 where
    it fits): the sweep measures group 0, on the case's own inputs; the other groups, each on
    its own data, must pass the budget rule where the ring passes alone
    (`ringcheck.harness.embedding.EmbeddingFailure` otherwise). No accumulation
    switch (`AS_IMPLEMENTED`), no per-step observer."""
    options = ImplOptions(spec, forward_only=forward_only, stand_in=stand_in, sinks_grad=sinks_grad)
    runner = Runner(processes, options)
    world_only = options.load().world_only is not None

    def run_case(case: Case, inputs: Inputs, accumulation: str, observer: StepObserver | None) -> Results:
        where = default_mesh(case.ring.world_size, room=max_ring_size, world_only=world_only, template=mesh)
        everyone = group_inputs(case, inputs, where.rings)
        runs = runner.run(case, everyone, where)
        check_witnesses(runner, case, runs, everyone)
        return runs[0].calls["contiguous"]

    def sizes(requested: Sequence[int]) -> tuple[int, ...]:
        return tuple(p for p in requested if max_ring_size is None or p <= max_ring_size)

    return Implementation(spec, run_case, observes_steps=False, accumulations=(AS_IMPLEMENTED,), ring_sizes=sizes,
                          forward_only=forward_only)


# --- the sweep -------------------------------------------------------------------------------------


def case_key(implementation: str, backend: str, mode: str, dtype: str, distribution: str,
             accumulation: str, world_size: int | None = None, tensor: str | None = None) -> str:
    """The stable key of a case (with world_size) or of a fit group (with tensor)."""
    parts = [implementation, backend, mode, dtype, distribution, f"acc={accumulation}"]
    if world_size is not None:
        parts.append(f"P={world_size}")
    if tensor is not None:
        parts.append(tensor)
    return "/".join(parts)


Progress = Callable[[str], None]


def _plan(spec: DriftSpec, implementation: Implementation) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The accumulations and ring sizes of `spec` that `implementation` can run."""
    accumulations = tuple(a for a in spec.accumulations if a in implementation.accumulations)
    if not accumulations:
        raise ValueError(f"implementation {implementation.name!r} has none of the accumulations "
                         f"{list(spec.accumulations)}; it has {list(implementation.accumulations)}")
    sizes = tuple(implementation.ring_sizes(spec.ring_sizes))
    if not sizes:
        raise ValueError(f"implementation {implementation.name!r} can run none of the ring sizes "
                         f"{list(spec.ring_sizes)}")
    return accumulations, sizes


def seeds_for_fit(spec: DriftSpec, implementation: Implementation = SIMULATED) -> int:
    """The seed count a sweep needs for MIN_FIT_SAMPLES points per slope fit (ring sizes
    P >= 2 that `implementation` runs, times seeds): at least `spec.seeds`; `spec.seeds` when
    there are fewer than MIN_FIT_SIZES such ring sizes. The command raises
    a sweep to it (and says so); a fit with fewer points is reported as too weak to judge."""
    return fit_seeds(sum(1 for p in _plan(spec, implementation)[1] if p >= FIT_MIN_P), spec.seeds)


def count_runs(spec: DriftSpec, implementation: Implementation = SIMULATED) -> int:
    """How many ring runs (forward and backward) `run_drift` makes: the progress total."""
    accumulations, sizes = _plan(spec, implementation)
    return (len(spec.modes) * len(spec.dtypes) * len(spec.distributions) * len(sizes) * spec.seeds
            * len(spec.backends) * len(accumulations))


def run_drift(spec: DriftSpec, *, implementation: Implementation = SIMULATED,
              progress: Progress | None = None) -> dict:
    """Run the sweep; returns the drift document without `meta` (`ringcheck.documents`).
    `progress` is called after every ring run with the case's key and seed."""
    accumulations, sizes = _plan(spec, implementation)
    raw: dict[tuple, list[dict]] = {}
    steps: dict[tuple, list[dict]] = {}
    not_run = {t: "not run (--forward-only)" for t in ("dq", "dk", "dv") if implementation.forward_only}
    for mode, dtype, distribution, p, seed in itertools.product(
            spec.modes, spec.dtypes, spec.distributions, sizes, range(spec.seeds)):
        att = spec.attention_spec(mode, dtype, p)
        ring = RingSpec(p, DRIFT_MODES[mode][1])
        # inputs and references are shared by every backend and accumulation
        inputs = make_inputs(att, seed=seed, distribution=distribution, ring=ring)
        true, peer_results = truth(att, inputs), peer(att, inputs)
        # per-step truths are those of plain attention: with variants only the final results
        observes = implementation.observes_steps and not spec.variants.used
        stepped = step_truths(att, ring, inputs) if observes else None
        for backend, acc in itertools.product(spec.backends, accumulations):
            key = (backend, mode, dtype, distribution, acc, p)
            case = Case(att, ring, seed=seed, distribution=distribution, backend=backend)
            n = att.seq_len // p
            recorder = (StepRecorder(p, (att.batch, n, att.heads, att.dv), (att.batch, att.heads, n))
                        if stepped is not None else None)
            got = implementation.run(case, inputs, acc, recorder)
            if got.lse is None:  # the contract lets an implementation return out alone
                not_run["lse"] = "not returned by the implementation"
            present = tuple(t for t in TENSORS if got.get(t) is not None)
            raw.setdefault(key, []).append(tensor_metrics(case, got, true, peer_results, spec.budget, inputs,
                                                          tensors=present))
            if recorder is not None:
                recorder.check_complete()
                steps.setdefault(key, []).append(step_errors(recorder, *stepped))
            if progress is not None:
                progress(case_key(implementation.name, *key) + f" seed={seed}")
    # order: backend, mode, dtype, distribution, accumulation, P, each as the spec lists them
    order = (spec.backends, spec.modes, spec.dtypes, spec.distributions, accumulations)
    raw = dict(sorted(raw.items(), key=lambda kv: tuple(o.index(k) for o, k in zip(order, kv[0])) + (kv[0][-1],)))
    return build_document(spec, implementation.name, raw, steps, not_run)


def build_document(spec: DriftSpec, implementation: str, raw: dict[tuple, list[dict]],
                   steps: dict[tuple, list[dict]], not_run: dict[str, str] | None = None) -> dict:
    """Aggregate seeds, fit the model per group and summarise; raw is keyed by (backend,
    mode, dtype, distribution, accumulation, P) with one metrics dict per seed, in the order
    the document keeps; `not_run`: tensor -> why it has no measurement (the summary says so)."""
    cases = {}
    for key, per_seed in raw.items():
        backend, mode, dtype, distribution, acc, p = key
        entry = {"implementation": implementation, "backend": backend, "mode": mode, "dtype": dtype,
                 "distribution": distribution, "accumulation": acc, "P": p,
                 "seq_len": spec.seq_len_for(p), "seeds": len(per_seed),
                 "tensors": aggregate_seeds(per_seed)}
        if key in steps:
            runs = steps[key]
            entry["steps"] = {name: [geometric_mean([r[name][i] for r in runs]) for i in range(p)]
                              for name in runs[0]}
        cases[case_key(implementation, *key)] = entry
    groups: dict[tuple, dict[int, dict]] = {}
    samples: dict[tuple, dict[int, list[float]]] = {}  # every seed's normwise relative error
    for key, per_seed in raw.items():
        backend, mode, dtype, distribution, acc, p = key
        entry = cases[case_key(implementation, *key)]
        for tensor, m in entry["tensors"].items():
            gkey = (backend, mode, dtype, distribution, acc, tensor)
            groups.setdefault(gkey, {})[p] = m
            samples.setdefault(gkey, {})[p] = [s[tensor]["rel_norm"] for s in per_seed]
    fits = {}
    for gkey, points in groups.items():
        backend, mode, dtype, distribution, acc, tensor = gkey
        fit = {"implementation": implementation, "backend": backend, "mode": mode, "dtype": dtype,
               "distribution": distribution, "accumulation": acc, "tensor": tensor}
        fit.update(significant(fit_group(points, per_token=tensor != "dsinks", dtype=dtype, tensor=tensor,
                                         samples=samples[gkey])))
        fits[case_key(implementation, backend, mode, dtype, distribution, acc, tensor=tensor)] = fit
    cases = significant(cases)
    return {**header(DRIFT_SCHEMA), "spec": spec.to_json(),
            "implementation": implementation,
            "rules": {**RULES, **({"per_head": PER_HEAD_RULE} if any(g[-1] == "dsinks" for g in groups) else {})},
            "cases": cases, "fits": fits,
            "summary": {**summarise(fits, ring_sizes=sorted({key[-1] for key in raw}), seeds=spec.seeds),
                        "not_run": dict(not_run or {})}}
