"""The drift model: per-step truth, the metrics of one case, their aggregation over seeds,
and the slope fit with its flags (`RULES`, stated once here; the reports print them).

`ringcheck.commands.drift` runs the sweep and builds the document from these pieces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...judge.check import TENSORS, Case, Results, judge_results
from ...judge.inputs import Inputs
from ...judge.metrics import abs_error, max_ulp_error, relative_to_roundoff
from ...ring.layouts import positions
from ...spec import AttentionSpec, Budget, RingSpec

# The model and its flags. Stated once, here; the reports print these texts and numbers.
FIT_MIN_P = 2
FLAT_BELOW = 0.25
# the slope thresholds, per output precision (`expected_model`): a tensor whose output dtype is
# narrower than float32 (out, dq, dk, dv of bfloat16/float16 inputs) is flat under a float32
# merge (its roundings are ~2^-16 of the one final cast), so growth beyond flat is a finding; a
# float32 output (float32 inputs; lse of every dtype) takes the merge's roundings at its own
# precision, a random walk of P roundings (slope up to 0.5), so only linear growth is one
SLOPE_FLAG = 0.8
LOW_PRECISION_SLOPE_FLAG = FLAT_BELOW
# the slope's confidence bounds: one-sided, this level each (hundreds of groups per sweep)
CONFIDENCE = 0.99
# a fit needs this many ring sizes P >= FIT_MIN_P and samples (ring sizes x seeds) for a
# standard error at all; the command raises the seed count to reach MIN_FIT_SAMPLES
MIN_FIT_SIZES = 3
MIN_FIT_POINTS = 4
MIN_FIT_SAMPLES = 8
BIAS_SLOPE_FLAG = 0.5
BIAS_SHARE_FLAG = 0.25
# ... and it must shift the tensor by at least this many unit roundoffs of the output dtype
# (relative to the tensor's RMS): a smaller bias is the output's own rounding, not drift
BIAS_U_FLAG = 1.0
PER_HEAD_RULE = ("dsinks has one value per head, a sum over every row of the sequence: a handful of numbers "
                 "whose slope and mean signed error over a few ring sizes are noise, not drift, so its groups "
                 "are flagged only for budget and non-finite values (slope and bias are shown, not flagged)")
RULES = {
    "fit": (f"least squares of ln(error) on ln(P) over the ring sizes P >= {FIT_MIN_P} (P = 1 runs no "
            "merge and no hop, a different regime; it is shown but not fitted), one point per ring size "
            "and seed; error = normwise relative error ||got - truth|| / ||truth|| of the tensor. The "
            f"slope's bounds are one-sided {CONFIDENCE:.0%} Student-t bounds from its standard error; a fit "
            f"needs {MIN_FIT_SIZES} ring sizes and {MIN_FIT_POINTS} points (the command raises the seed "
            f"count to reach {MIN_FIT_SAMPLES} points)"),
    "expected": ("per output precision. Output narrower than float32 (out, dq, dk, dv of bfloat16 and "
                 "float16 inputs): the float32 merge's roundings are ~2^-16 of the one final cast, so the "
                 "error is flat, slope about 0. Output in float32 (every tensor of float32 inputs, and lse "
                 "of every dtype): the merge rounds at the output's own precision, a random walk of P "
                 "roundings, slope up to 0.5, is correct"),
    "slope": (f"flag: the slope's lower bound is over the threshold of its output precision: "
              f"{LOW_PRECISION_SLOPE_FLAG} (growth beyond flat, e.g. a rounding per hop) for an output "
              f"narrower than float32, {SLOPE_FLAG} (linear or worse: a systematic error per hop) for a "
              "float32 output. Too weak to judge: the bounds straddle the threshold, or too few ring "
              "sizes or points to fit (no flag; raise --seeds or add ring sizes)"),
    "budget": ("flag: any P where any seed is over budget, error > k x peer error + slack per element "
               "(k = spec.budget: k_forward for out and lse, k_backward for dq, dk, dv; slack = rounding "
               "floor of the output dtype; see ringcheck.verdict)"),
    "bias": (f"flag: the mean signed error grows with P: the slope of ln|mean signed error| on ln(P) "
             f"(P >= {FIT_MIN_P}, signed error averaged over seeds) is >= {BIAS_SLOPE_FLAG} AND at the "
             f"largest P |mean signed error| >= {BIAS_SHARE_FLAG} x RMSE (the bias is a visible part "
             "of the error; unbiased errors average out, their mean falls like 1/sqrt(numel)) AND there "
             f"|mean signed error| >= {BIAS_U_FLAG:g} u x RMS(truth), u the unit roundoff of the output dtype "
             "(lse: float32; a smaller shift is within one rounding of the output, not drift)"),
    "nonfinite": "flag: NaN or Inf where the truth is finite, at any P",
    "projected": ("information, not a flag: the ring size where the fitted line of ln(error / budget) "
                  "on ln(P) reaches 1 (the worst seed's max abs error against the budget), extrapolated"),
    "metrics": ("per tensor against the float64 truth: max abs error, normwise relative error, RMSE, max "
                "ULP error in the output dtype (lse: float32; elements below 2^-10 of the tensor's largest "
                "magnitude are measured at that magnitude, so exactly cancelling gradient elements do not "
                "read as billions of ULPs), normwise relative error / u (u = unit roundoff of the output "
                "dtype; one rounding is about 0.3 to 0.6), mean signed error (bias), and the ratio of the "
                "max abs error to that of the same-dtype single-device peer"),
    "diagnosis": (f"slope < {FLAT_BELOW}: flat; {FLAT_BELOW} <= slope < {SLOPE_FLAG}: sqrt-like "
                  f"(a random walk of roundings, e.g. one per hop); >= {SLOPE_FLAG}: linear or worse"),
}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# measured numbers are kept to this many significant digits in the document (enough for any
# comparison of errors; halves the size of the JSON). Fits are made before the rounding.
SIGNIFICANT_DIGITS = 6
# max ULP error: elements smaller than this fraction of the tensor's largest are measured at
# that magnitude (see `max_ulp_error`): an exactly cancelling gradient element is not a ULP story
ULP_FLOOR = 2.0 ** -10
FLAGS = ("slope", "budget", "bias", "nonfinite")
SUMMARY_METRICS = ("max_abs", "rel_norm", "rmse", "max_ulp", "rel_over_u", "mean_signed",
                   "peer_max_abs", "peer_rel_norm", "peer_ratio", "budget", "budget_ratio",
                   "over_budget", "passed", "nonfinite")



# --- per-step truth ----------------------------------------------------------------------------


def step_truths(spec: AttentionSpec, ring: RingSpec, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out, lse) of every rank's queries over the K/V shards seen up to every step.

    At step s rank r holds the shard of rank (r - s) mod P, which holds the global tokens
    `positions(layout, src, P, seq_len)`; the truth after step s is attention over the union
    of the shards of steps 0..s, with the global causal mask. Computed as exact float64
    partials per (rank, shard) merged in step order. Returns out (P, P, batch, n, heads,
    head_dim) and lse (P, P, batch, heads, n), indexed [rank, step].
    """
    p_, layout = ring.world_size, ring.layout
    n = ring.check_seq_len(spec.seq_len)
    pos = torch.stack([positions(layout=layout, rank=r, world_size=p_, seq_len=spec.seq_len)
                       for r in range(p_)])                                   # (P, n)
    g = spec.group_size
    q = inputs.q.double()[:, pos]                                             # (b, P, n, h, d)
    k = inputs.k.double()[:, pos].repeat_interleave(g, dim=3)
    v = inputs.v.double()[:, pos].repeat_interleave(g, dim=3)
    s = torch.einsum("brihd,btjhd->bhritj", q, k) * spec.scale                # (b, h, P, n, P, n)
    if spec.causal:
        visible = pos[:, :, None, None] >= pos[None, None, :, :]
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                          # (b, h, P, n, P)
    prob = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    out = torch.einsum("bhritj,btjhd->bhritd", prob, v)                       # (b, h, P, n, P, d)
    b, h = lse.shape[:2]
    src = (torch.arange(p_)[:, None] - torch.arange(p_)[None, :]) % p_         # [rank, step]
    lse = torch.gather(lse, 4, src[None, None, :, None, :].expand(b, h, p_, n, p_))
    out = torch.gather(out, 4, src[None, None, :, None, :, None].expand(b, h, p_, n, p_, out.shape[-1]))
    m = torch.full((b, h, p_, n), float("-inf"), dtype=torch.float64)
    acc, l = torch.zeros_like(out[:, :, :, :, 0]), torch.zeros_like(m)
    outs, lses = [], []
    for step in range(p_):
        new_m = torch.maximum(m, lse[..., step])
        safe = new_m.masked_fill(torch.isneginf(new_m), 0.0)
        keep, add = torch.exp(m - safe), torch.exp(lse[..., step] - safe)
        acc = acc * keep.unsqueeze(-1) + out[:, :, :, :, step] * add.unsqueeze(-1)
        l, m = l * keep + add, new_m
        empty = l == 0
        outs.append(acc / l.masked_fill(empty, 1.0).unsqueeze(-1))
        lses.append((m + torch.log(l.masked_fill(empty, 1.0))).masked_fill(empty, float("-inf")))
    out_steps = torch.stack(outs).permute(3, 0, 1, 4, 2, 5)                  # (P rank, P step, b, n, h, d)
    lse_steps = torch.stack(lses).permute(3, 0, 1, 2, 4)                      # (P rank, P step, b, h, n)
    return out_steps.contiguous(), lse_steps.contiguous()


class StepRecorder:
    """An observer for `simulate_ring` that keeps every rank's running partial per step."""

    def __init__(self, world_size: int, out_shape: Sequence[int], lse_shape: Sequence[int]):
        self.world_size = world_size
        self.out = torch.full((world_size, world_size, *out_shape), float("nan"))
        self.lse = torch.full((world_size, world_size, *lse_shape), float("nan"))
        self.seen = torch.zeros(world_size, world_size, dtype=torch.bool)

    def __call__(self, rank: int, step: int, src_rank: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        if src_rank != (rank - step) % self.world_size:
            raise RuntimeError(f"rank {rank}, ring step {step}: observed the K/V of rank {src_rank}, "
                               f"expected rank {(rank - step) % self.world_size} of {self.world_size}")
        self.out[rank, step] = out
        self.lse[rank, step] = lse
        self.seen[rank, step] = True

    def check_complete(self) -> None:
        if not bool(self.seen.all()):
            missing = [tuple(int(i) for i in ix) for ix in (~self.seen).nonzero()[:4]]
            raise RuntimeError(f"the ring reported no partial for (rank, step) {missing}: the per-step "
                               "observer was not called after every ring step")


def step_errors(recorder: StepRecorder, true_out: torch.Tensor, true_lse: torch.Tensor) -> dict[str, list[float]]:
    """Per ring step, over all ranks: max abs and normwise relative error of the running out,
    max abs error of the running lse. (The running out is always finite: a row with no key
    yet is 0 in both; lse is -inf there in both, which `abs_error` counts as equal.)"""
    dims = (0,) + tuple(range(2, recorder.out.dim()))  # everything but the step axis
    diff = recorder.out.double() - true_out
    if not bool(torch.isfinite(diff).all()):
        diff = abs_error(recorder.out, true_out)[0]
    err_norm = diff.square().sum(dim=dims).sqrt()
    true_norm = true_out.square().sum(dim=dims).sqrt()
    rel = torch.where(true_norm > 0, err_norm / true_norm.clamp(min=1e-300), err_norm)
    diff_lse, _ = abs_error(recorder.lse, true_lse)
    lse_dims = (0,) + tuple(range(2, recorder.lse.dim()))
    return {"out_max_abs": diff.abs().amax(dim=dims).tolist(),
            "out_rel_norm": rel.tolist(),
            "lse_max_abs": diff_lse.amax(dim=lse_dims).tolist()}


# --- metrics of one case -------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def tensor_metrics(case: Case, got: Results, true: Results, peer_results: Results, budget: Budget,
                   inputs: Inputs | None = None, *, tensors: Sequence[str] = TENSORS) -> dict[str, dict]:
    """Every metric of every tensor of one run (one seed); `tensors`: those the run produced."""
    verdict = judge_results(case, got, true, peer_results, budget=budget, inputs=inputs, tensors=tuple(tensors))
    metrics = {}
    for tv in verdict.tensors:
        dtype = torch.float32 if tv.tensor == "lse" else case.spec.torch_dtype
        s = tv.stats
        metrics[tv.tensor] = {
            "max_abs": s.max_abs, "rel_norm": s.rel_norm, "rmse": s.rmse,
            "max_ulp": max_ulp_error(got.get(tv.tensor), true.get(tv.tensor), dtype,
                                     floor=ULP_FLOOR * _max_finite(true.get(tv.tensor))),
            "rel_over_u": relative_to_roundoff(s, dtype), "mean_signed": s.mean_signed,
            "peer_max_abs": tv.peer.max_abs, "peer_rel_norm": tv.peer.rel_norm,
            "peer_ratio": _ratio(s.max_abs, tv.peer.max_abs), "budget": tv.budget,
            "budget_ratio": _ratio(s.max_abs, tv.budget), "over_budget": tv.over_budget,
            "passed": tv.passed, "nonfinite": s.nonfinite,
        }
    return metrics


def _max_finite(t: torch.Tensor) -> float:
    t = t.detach().double().abs()
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def significant(x, digits: int = SIGNIFICANT_DIGITS):
    """`x` rounded to `digits` significant digits (floats only; non-finite and other values as
    they are): what the document keeps of a measured number."""
    if isinstance(x, float) and math.isfinite(x):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: significant(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [significant(v, digits) for v in x]
    return x


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(ln x)) of non-negative values; 0 if any is 0, inf if any is inf."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("geometric_mean of no values")
    if any(math.isnan(v) or v < 0 for v in values):
        return math.nan
    if any(v == 0 for v in values):
        return 0.0
    if any(math.isinf(v) for v in values):
        return math.inf
    return math.exp(sum(math.log(v) for v in values) / len(values))


def aggregate_seeds(per_seed: list[dict[str, dict]]) -> dict[str, dict]:
    """One entry per tensor: magnitudes as geometric means over seeds, the mean signed error
    as the plain mean (a systematic bias survives it, noise cancels), the budget by the worst
    seed (ratio: max; passed: all; counts: sums)."""
    out = {}
    for tensor in per_seed[0]:
        rows = [m[tensor] for m in per_seed]
        agg = {}
        for key in SUMMARY_METRICS:
            vals = [r[key] for r in rows]
            if key == "passed":
                agg[key] = all(vals)
            elif key in ("over_budget", "nonfinite"):
                agg[key] = int(sum(vals))
            elif key == "budget_ratio":
                agg[key] = max(vals)
            elif key == "mean_signed":
                agg[key] = sum(vals) / len(vals)
            else:
                agg[key] = geometric_mean(vals)
        out[tensor] = agg
    return out


# --- the model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlopeFit:
    """ln(y) = intercept + slope ln(P), least squares; `stderr` of the slope (None with 2 points);
    `sizes`: distinct ring sizes fitted, `points`: (ring size, seed) points fitted."""

    slope: float | None
    intercept: float | None
    stderr: float | None
    points: int
    sizes: int = 0


def fit_slope(ring_sizes: Sequence[float], errors: Sequence[float], *, min_p: float = FIT_MIN_P) -> SlopeFit:
    """Least-squares slope of ln(error) on ln(P) over P >= min_p; a ring size may repeat (one
    point per seed). Points whose error is 0 or not finite have no logarithm and are left out.
    Fewer than two distinct ring sizes: no slope."""
    pts = [(math.log(p), math.log(e)) for p, e in zip(ring_sizes, errors)
           if p >= min_p and e is not None and math.isfinite(e) and e > 0]
    n, k = len(pts), len({x for x, _ in pts})
    if k < 2:
        return SlopeFit(None, None, None, n, k)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    stderr = None
    if n > 2:
        rss = sum((y - intercept - slope * x) ** 2 for x, y in pts)
        stderr = math.sqrt(rss / (n - 2) / sxx)
    return SlopeFit(slope, intercept, stderr, n, k)


# one-sided 99% quantiles of Student's t, 1 to 30 degrees of freedom
_T99 = (31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681, 2.650, 2.624,
        2.602, 2.583, 2.567, 2.552, 2.539, 2.528, 2.518, 2.508, 2.500, 2.492, 2.485, 2.479, 2.473, 2.467,
        2.462, 2.457)


def t_quantile(dof: int) -> float:
    """The one-sided `CONFIDENCE` (99%) quantile of Student's t with `dof` degrees of freedom;
    beyond 30, the Cornish-Fisher expansion around the normal quantile (error < 1e-3)."""
    if dof < 1:
        raise ValueError(f"t_quantile needs >= 1 degree of freedom, got {dof}")
    if dof <= len(_T99):
        return _T99[dof - 1]
    z = 2.326348
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def expected_model(dtype: str, tensor: str) -> tuple[float, float]:
    """(expected largest slope, flag threshold) of a tensor of a sweep in `dtype` (`RULES`):
    by the precision of the output, which is float32 for lse whatever the input dtype."""
    if dtype == "float32" or tensor == "lse":
        return 0.5, SLOPE_FLAG
    return 0.0, LOW_PRECISION_SLOPE_FLAG


def judge_slope(fit: SlopeFit, threshold: float) -> tuple[str, float | None, float | None]:
    """("flagged" | "within" | "too weak to judge", lower bound, upper bound) of a slope fit
    against `threshold`: flagged when the lower bound is at or over it, within when the upper
    bound is under it; otherwise, or with fewer than MIN_FIT_SIZES ring sizes or
    MIN_FIT_POINTS points, the evidence does not decide."""
    if fit.slope is None or fit.stderr is None or fit.sizes < MIN_FIT_SIZES or fit.points < MIN_FIT_POINTS:
        return "too weak to judge", None, None
    half = t_quantile(fit.points - 2) * fit.stderr
    lower, upper = fit.slope - half, fit.slope + half
    if lower >= threshold:
        return "flagged", lower, upper
    if upper < threshold:
        return "within", lower, upper
    return "too weak to judge", lower, upper


def diagnose(slope: float | None) -> str:
    if slope is None:
        return "no fit"
    if slope < FLAT_BELOW:
        return "flat"
    if slope < SLOPE_FLAG:
        return "sqrt-like"
    return "linear or worse"


def _projected_crossing(ratio: SlopeFit) -> float | None:
    """The ring size where the fitted error / budget line reaches 1 (extrapolated, for
    information); None where it does not rise."""
    if ratio.slope is None or ratio.slope <= 0:
        return None
    log_p = -ratio.intercept / ratio.slope
    return math.inf if log_p > 700 else math.exp(log_p)


def fit_group(points: dict[int, dict], *, per_token: bool = True, dtype: str = "float32", tensor: str = "out",
              samples: dict[int, Sequence[float]] | None = None) -> dict:
    """The model and flags of one (implementation, backend, mode, dtype, distribution,
    accumulation, tensor) group from its per-P aggregated metrics and, in `samples`, the
    normwise relative error of every seed per P (default: the aggregate, one point per P). The
    slope flag follows `judge_slope` against the threshold of `expected_model(dtype, tensor)`.
    A tensor with one value per head (dsinks, `per_token=False`) gets the budget and non-finite
    flags only (`PER_HEAD_RULE`)."""
    sizes = sorted(points)
    samples = samples if samples is not None else {p: [points[p]["rel_norm"]] for p in sizes}
    pooled = [(p, e) for p in sizes for e in samples[p]]
    rel = fit_slope([p for p, _ in pooled], [e for _, e in pooled])
    abs_fit = fit_slope(sizes, [points[p]["max_abs"] for p in sizes])
    peer_fit = fit_slope(sizes, [points[p]["peer_ratio"] for p in sizes])
    bias = fit_slope(sizes, [abs(points[p]["mean_signed"]) for p in sizes])
    ratio = fit_slope(sizes, [points[p]["budget_ratio"] for p in sizes])
    top = points[sizes[-1]]
    bias_share = _ratio(abs(top["mean_signed"]), top["rmse"]) if top["rmse"] else 0.0
    # the bias at the largest P relative to the tensor's RMS (rmse / rel_norm), in units of u
    out_dtype = "float32" if tensor == "lse" else dtype
    bias_u = (abs(top["mean_signed"]) * top["rel_norm"] / top["rmse"] / UNIT_ROUNDOFF[out_dtype]
              if top["rmse"] and top["rel_norm"] else 0.0)
    over = [p for p in sizes if not points[p]["passed"]]
    nonfinite = [p for p in sizes if points[p]["nonfinite"]]
    expected, threshold = expected_model(dtype, tensor)
    judgement, lower, upper = judge_slope(rel, threshold)
    flags = []
    if per_token and judgement == "flagged":
        flags.append("slope")
    if over:
        flags.append("budget")
    if (per_token and bias.slope is not None and bias.slope >= BIAS_SLOPE_FLAG and bias_share >= BIAS_SHARE_FLAG
            and bias_u >= BIAS_U_FLAG):
        flags.append("bias")
    if nonfinite:
        flags.append("nonfinite")
    return {
        "slope": rel.slope, "slope_stderr": rel.stderr, "intercept": rel.intercept, "points": rel.points,
        "slope_lower": lower, "slope_upper": upper, "slope_threshold": threshold, "expected_slope": expected,
        "slope_judgement": judgement if per_token else "not judged (one value per head)",
        "slope_max_abs": abs_fit.slope, "slope_peer_ratio": peer_fit.slope,
        "bias_slope": bias.slope, "bias_share": bias_share, "bias_u": bias_u,
        "max_budget_ratio": max(points[p]["budget_ratio"] for p in sizes),
        "budget_ratio_slope": ratio.slope, "projected_budget_P": _projected_crossing(ratio),
        "over_budget_at": over, "nonfinite_at": nonfinite,
        "diagnosis": diagnose(rel.slope), "flags": flags,
    }
