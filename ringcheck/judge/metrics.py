"""Error statistics of a computed tensor against its float64 truth."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ErrorStats:
    """How far `got` is from `truth` (all errors in float64, over the compared elements).

    Elements where both are the same infinity (lse = -inf of an empty row) compare equal;
    an element that is NaN or Inf in `got` but finite in `truth` (or vice versa) is counted in
    `nonfinite` and makes the error infinite.
    """

    max_abs: float
    worst_index: tuple[int, ...]
    mean_signed: float
    rmse: float
    rel_norm: float
    nonfinite: int
    numel: int

    @property
    def finite(self) -> bool:
        return self.nonfinite == 0


def abs_error(got: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise |got - truth| in float64 (0 where both are the same infinity, inf where
    exactly one side is not finite) and the mask of elements that are wrong non-finites."""
    if got.shape != truth.shape:
        raise ValueError(f"shape mismatch: got {tuple(got.shape)}, truth {tuple(truth.shape)}")
    g, t = got.detach().double(), truth.detach().double()
    finite_g, finite_t = torch.isfinite(g), torch.isfinite(t)
    if bool(finite_g.all()) and bool(finite_t.all()):  # the usual case: no infinity to match, nothing wrong
        return (g - t).abs(), torch.zeros_like(finite_g)
    same_inf = torch.isinf(g) & torch.isinf(t) & (g == t)
    bad = ~(finite_g & finite_t) & ~same_inf
    diff = (g - t).abs().masked_fill(same_inf, 0.0).masked_fill(bad, float("inf"))
    return diff, bad


def error_stats(got: torch.Tensor, truth: torch.Tensor,
                diff_bad: tuple[torch.Tensor, torch.Tensor] | None = None) -> ErrorStats:
    """Statistics of got against truth (`diff_bad`: `abs_error(got, truth)` if already computed)."""
    diff, bad = abs_error(got, truth) if diff_bad is None else diff_bad
    numel = diff.numel()
    if numel == 0:
        return ErrorStats(0.0, (), 0.0, 0.0, 0.0, 0, 0)
    flat = int(diff.argmax())
    worst, rest = [], flat
    for size in reversed(diff.shape):  # the flat index as an index per dimension (row-major)
        rest, i = divmod(rest, size)
        worst.insert(0, i)
    ok = ~bad & torch.isfinite(truth.detach().double())
    g, t = got.detach().double()[ok], truth.detach().double()[ok]
    signed = (g - t)
    tnorm = float(t.norm())
    return ErrorStats(
        max_abs=float(diff.flatten()[flat]),
        worst_index=tuple(worst),
        mean_signed=float(signed.mean()) if signed.numel() else 0.0,
        rmse=float(signed.pow(2).mean().sqrt()) if signed.numel() else 0.0,
        rel_norm=float(signed.norm() / tnorm) if tnorm > 0 else float(signed.norm()),
        nonfinite=int(bad.sum()),
        numel=numel,
    )


def rounding_floor(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attention's slack: 2 * max |(ref + 0.3 - 0.3) - ref| with ref in `dtype`, the
    rounding step of `dtype` at the magnitude of the values (finite entries only). The float32
    rounding a ring adds on top is bounded per element by `verdict.float32_floors`."""
    t = truth.detach()
    t = t[torch.isfinite(t)]
    if t.numel() == 0:
        return 0.0
    ref = t.to(dtype)
    return 2.0 * float(((ref + 0.3 - 0.3) - ref).abs().max())


# --- precision in units of a dtype (drift reports) -------------------------------------------


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of `dtype`: the largest relative error of rounding one real number to it."""
    return torch.finfo(dtype).eps / 2.0


def ulp(truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each (exact, float64) value of `truth`, in float64.

    For |t| in [2^e, 2^(e+1)) that is eps x 2^e; below the smallest normal number the
    spacing is the subnormal one, eps x tiny. Non-finite entries get an infinite spacing.
    """
    info = torch.finfo(dtype)
    t = truth.detach().double().abs()
    _, exponent = torch.frexp(t)  # t = mantissa x 2^exponent, mantissa in [0.5, 1)
    binade = torch.ldexp(torch.ones_like(t), exponent - 1).masked_fill(t == 0, 0.0)
    spacing = info.eps * torch.clamp(binade, min=info.tiny)
    return spacing.masked_fill(~torch.isfinite(t), float("inf"))


def max_ulp_error(got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, *,
                  floor: float = 0.0) -> float:
    """max |got - truth| / ulp(max(|truth|, floor)) in `dtype`: 0.5 is a correctly rounded
    result.

    With floor = 0 every element is measured at its own magnitude; near a zero of the truth
    (an exactly cancelling gradient) the ULP is tiny and any algorithm that does not compute
    that zero exactly is billions of ULPs off. A floor (e.g. a small fraction of max |truth|)
    measures such elements at the tensor's scale instead. Elements where both are the same
    infinity count 0; a wrong non-finite counts inf."""
    diff, bad = abs_error(got, truth)
    if diff.numel() == 0:
        return 0.0
    units = diff / ulp(truth.detach().double().abs().clamp(min=floor), dtype)
    units = units.masked_fill(diff == 0, 0.0).masked_fill(bad, float("inf"))
    return float(units.max())


def relative_to_roundoff(stats: ErrorStats, dtype: torch.dtype) -> float:
    """The normwise relative error in units of u of `dtype` (one rounding of a vector: about
    0.3 to 0.6)."""
    return stats.rel_norm / unit_roundoff(dtype)
