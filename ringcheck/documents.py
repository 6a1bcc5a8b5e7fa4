"""Drift documents on disk, and what changed between two of them.

A drift document (`ringcheck.commands.drift.run_drift`) is written as JSON with a schema name and
version. Everything but the `meta` key (date, host, versions, run time, the command) is a
function of the command and its seeds, so two runs of one command on one machine write the
same bytes there; `diff_documents` ignores `meta`. Non-finite numbers (an infinite error of
a ring that produced NaN) are written as the strings "inf", "-inf" and "nan", so the file is
strict JSON.

Schema (`schema` = "ringcheck.drift", `schema_version` = 1), top-level keys in this order:

- `spec`: the sweep (dtypes, ring_sizes, distributions, modes, backends, accumulations,
  seeds, batch, heads, kv_heads, head_dim, tokens_per_rank | seq_len, softmax_scale,
  budget {k_forward, k_backward});
- `implementation`: the ring driven ("simulated");
- `rules`: the model and flag rules in words (what the reports print);
- `cases`: key "impl/backend/mode/dtype/distribution/acc=A/P=N" -> {implementation, backend,
  mode, dtype, distribution, accumulation, P, seq_len, seeds, tensors: {out|lse|dq|dk|dv:
  {max_abs, rel_norm, rmse, max_ulp, rel_over_u, mean_signed, peer_max_abs, peer_rel_norm,
  peer_ratio, budget, budget_ratio, over_budget, passed, nonfinite}}, steps: {out_max_abs,
  out_rel_norm, lse_max_abs: one value per ring step}};
- `fits`: key "impl/backend/mode/dtype/distribution/acc=A/tensor" -> {the same labels,
  tensor, slope, slope_stderr, intercept, points, slope_max_abs, slope_peer_ratio,
  bias_slope, bias_share, max_budget_ratio, budget_ratio_slope, projected_budget_P,
  over_budget_at, nonfinite_at, diagnosis, flags};
- `summary`: {under_test, accumulations: {acc: {groups, flagged, flags, max_slope}},
  settings: {"backend/mode/dtype/distribution": {flagged, separated, out_slope,
  out_projected_budget_P, ...}}, passed};
- `meta` (written by the command, ignored by diff): command, created, host, platform,
  python, torch, ringcheck, threads, elapsed_s.

Magnitudes are geometric means over seeds, the mean signed error a plain mean, the budget
numbers the worst seed's (see `ringcheck.commands.drift.aggregate_seeds`); measured numbers keep 6
significant digits. A change to any key or meaning bumps `schema_version`.

No rich or plotting here; `ringcheck.render.terminal` renders both documents and diffs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .commands.drift import SCHEMA, SCHEMA_VERSION

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# per case and tensor, the error measures whose growth counts as a regression
DIFF_METRICS = ("max_abs", "rel_norm")


def _encode(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode(x: Any) -> Any:
    if isinstance(x, str) and x in _NONFINITE:
        return _NONFINITE[x]
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x


def _compact(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), allow_nan=False)


def dumps(doc: dict) -> str:
    """The JSON text of a drift document: strict JSON in the document's key order, one line
    per top-level value and per entry of the dict sections (a case, a fit, a rule), so a
    line diff of two reports shows which cases changed."""
    doc = _encode(doc)
    lines = ["{"]
    for i, (key, value) in enumerate(doc.items()):
        end = "," if i < len(doc) - 1 else ""
        if isinstance(value, dict) and key in ("rules", "cases", "fits", "summary", "meta") and value:
            lines.append(f" {_compact(key)}: {{")
            items = list(value.items())
            for j, (k, v) in enumerate(items):
                lines.append(f"  {_compact(k)}: {_compact(v)}" + ("," if j < len(items) - 1 else ""))
            lines.append(" }" + end)
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def loads(text: str, *, source: str = "<text>") -> dict:
    """Parse and check a drift document; ValueError names the source and what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{source} is not a ringcheck drift report (schema {found!r}, expected {SCHEMA!r})")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{source} has drift schema version {doc.get('schema_version')!r}; this ringcheck "
                         f"reads version {SCHEMA_VERSION}: regenerate it with the command in its meta "
                         f"({(doc.get('meta') or {}).get('command', 'unknown')!r})")
    for key in ("spec", "cases", "fits", "summary"):
        if not isinstance(doc.get(key), dict):
            raise ValueError(f"{source}: drift report without its {key!r} section")
    return _decode(doc)


def save(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(doc), encoding="utf-8")
    return path


def load(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no drift report at {str(path)!r}")
    return loads(path.read_text(encoding="utf-8"), source=str(path))


def without_meta(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "meta"}


# --- diff ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One difference between report A (before) and B (after) at a stable key."""

    kind: str      # "error", "budget", "flag", "slope"
    key: str       # case key (with P) or fit key (with tensor)
    what: str      # the metric or flag
    before: Any
    after: Any

    def describe(self) -> str:
        if self.kind == "error":
            return (f"{self.key} {self.what}: {self.before:.3e} -> {self.after:.3e} "
                    f"(x{_ratio(self.after, self.before):.2f})")
        if self.kind == "budget":
            return (f"{self.key}: {'within' if self.before else 'over'} budget -> "
                    f"{'within' if self.after else 'over'} budget")
        if self.kind == "flag":
            return f"{self.key}: flags {self.before or []} -> {self.after or []}"
        return f"{self.key} {self.what}: {_fmt(self.before)} -> {_fmt(self.after)}"


def _fmt(x: Any) -> str:
    return "n/a" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def _ratio(after: float, before: float) -> float:
    if before == 0:
        return 1.0 if after == 0 else math.inf
    return after / before


@dataclass
class Diff:
    worse: list[Change] = field(default_factory=list)
    better: list[Change] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)  # cases and fits B no longer has
    only_in_b: list[str] = field(default_factory=list)
    identical: bool = False
    threshold: float = 1.5
    slope_rise: float = 0.25

    @property
    def got_worse(self) -> bool:
        return bool(self.worse)


def diff_documents(a: dict, b: dict, *, threshold: float = 1.5, slope_rise: float = 0.25) -> Diff:
    """What got worse from A to B, matched by stable keys (`meta` is ignored).

    Worse: a case's max abs or normwise relative error grew by more than `threshold` times
    (or became non-finite); a case that was within budget is over it; a fit group gained a
    flag; a fitted slope rose by more than `slope_rise`. The mirror images are listed as
    better. Cases or groups present in only one report are listed, not judged.
    """
    if not (isinstance(threshold, (int, float)) and threshold > 1):
        raise ValueError(f"threshold must be a number > 1 (an error ratio), got {threshold!r}")
    if not (isinstance(slope_rise, (int, float)) and slope_rise > 0):
        raise ValueError(f"slope_rise must be a positive number, got {slope_rise!r}")
    diff = Diff(threshold=threshold, slope_rise=slope_rise)
    diff.identical = without_meta(a) == without_meta(b) or dumps(without_meta(a)) == dumps(without_meta(b))
    for section in ("cases", "fits"):
        diff.only_in_a += sorted(set(a[section]) - set(b[section]))
        diff.only_in_b += sorted(set(b[section]) - set(a[section]))
    for key in sorted(set(a["cases"]) & set(b["cases"])):
        ta, tb = a["cases"][key]["tensors"], b["cases"][key]["tensors"]
        for tensor in [t for t in ta if t in tb]:
            ma, mb = ta[tensor], tb[tensor]
            name = f"{key}/{tensor}"
            for metric in DIFF_METRICS:
                before, after = ma[metric], mb[metric]
                r = _ratio(after, before)
                if math.isnan(after) and not math.isnan(before):
                    diff.worse.append(Change("error", name, metric, before, after))
                elif r > threshold:
                    diff.worse.append(Change("error", name, metric, before, after))
                elif r < 1.0 / threshold:
                    diff.better.append(Change("error", name, metric, before, after))
            if ma["passed"] and not mb["passed"]:
                diff.worse.append(Change("budget", name, "passed", True, False))
            elif mb["passed"] and not ma["passed"]:
                diff.better.append(Change("budget", name, "passed", False, True))
    for key in sorted(set(a["fits"]) & set(b["fits"])):
        fa, fb = a["fits"][key], b["fits"][key]
        new = [f for f in fb["flags"] if f not in fa["flags"]]
        gone = [f for f in fa["flags"] if f not in fb["flags"]]
        if new:
            diff.worse.append(Change("flag", key, "+" + ",".join(new), fa["flags"], fb["flags"]))
        if gone:
            diff.better.append(Change("flag", key, "-" + ",".join(gone), fa["flags"], fb["flags"]))
        sa, sb = fa["slope"], fb["slope"]
        if sa is not None and sb is not None:
            if sb - sa > slope_rise:
                diff.worse.append(Change("slope", key, "slope", sa, sb))
            elif sa - sb > slope_rise:
                diff.better.append(Change("slope", key, "slope", sa, sb))
    return diff


def exact_differences(a: dict, b: dict, *, limit: int = 20) -> list[str]:
    """Paths where A and B (without meta) differ at all, up to `limit`: for reproducibility."""
    found: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if len(found) >= limit:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in list(x) + [k for k in y if k not in x]:
                if k not in x or k not in y:
                    found.append(f"{path}/{k}: only in {'B' if k not in x else 'A'}")
                else:
                    walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (xi, yi) in enumerate(zip(x, y)):
                walk(xi, yi, f"{path}[{i}]")
        elif _compact(_encode(x)) != _compact(_encode(y)):
            found.append(f"{path}: {x!r} != {y!r}")

    walk(without_meta(a), without_meta(b), "")
    return found
