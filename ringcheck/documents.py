"""Every document a command writes, on disk: one strict JSON writer and loader, one `meta`,
and what changed between two drift documents.

Five kinds, each with a schema name and version (`KINDS`); a change to any key or meaning
of a kind bumps its `schema_version`. Every document starts with `schema` and
`schema_version` and ends with `meta` (built by `meta`, the same keys in all). The
writer (`dumps`, `save`) writes strict JSON: non-finite numbers (an infinite error of a ring
that produced NaN) become the strings "inf", "-inf" and "nan", never the literals `Infinity`
or `NaN`; the loader (`loads`, `load`) turns them back into floats and checks the schema
name, the version and the sections of the kind. The layout is one line per top-level value
and one line per entry of the larger sections, so a line diff of two documents shows which
entries changed.

`ringcheck.drift`, version 1 (`ringcheck.commands.drift.run_drift`, `ringcheck drift`).
Everything but `meta` is a function of the command and its seeds, so two runs of one command
on one machine write the same bytes there; `diff_documents` ignores `meta`. Top-level keys in
this order:

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
- `summary`: {under_test, accumulations: {acc: {groups, flagged, flags, max_slope, judged,
  too_weak, per_head}}, settings: {"backend/mode/dtype/distribution": {flagged, separated,
  out_slope, out_projected_budget_P, ...}}, verdict ("pass", "flagged" or "no verdict": no
  group of the ring under test could be judged; the exit code follows it), passed (verdict
  is "pass"), to_judge (null, or {why, flags, ring_sizes, seeds}: what would judge the groups
  too weak to judge), not_run, notes} (`ringcheck.commands.drift.summarise`; the reports of
  a document from before `verdict` take it from `passed`);
- `meta` (ignored by diff).

Magnitudes are geometric means over seeds, the mean signed error a plain mean, the budget
numbers the worst seed's (see `ringcheck.commands.drift.aggregate_seeds`); measured numbers
keep 6 significant digits.

`ringcheck.validate`, version 2 (`ringcheck.commands.validate.report_dict`, `ringcheck
validate --report DIR` writes it as validate.json; version 2 added `figures`, `promise`, `required`,
the status "flag" and `flagged`). Keys: `passed` (no check failed, no FLAG required: the exit code
follows it), `flagged` ("flag" checks), `target` (`Target`'s fields, named as the flags), `command`
(the command line that names the target), `checks`: one {check, status ("pass", "fail", "info",
"not run", "flag"), error, budget, detail, tensors, failing_ranks, failing_groups, figures, promise,
required} per row, in the table's order (error, budget null where a row has none; `tensors`: per
judged tensor {passed, ratio (worst error / budget), ranks over budget}; `failing_ranks` their
union; `failing_groups`: the CP groups whose results failed; `detail` locates the worst element
or says what was measured; `figures`: what the recompute, compile and determinism rows measured
beyond the tensors; `promise`: memory, communication, overlap or determinism, its figure and FLAG
threshold as error and budget; `required`: --require, or torch's deterministic algorithms), and `meta`.

`ringcheck.bench`, version 2 (`ringcheck.commands.bench.run_bench`, `ringcheck bench --json
FILE`; version 2: overlap and memory measured by `ringcheck.measure`). Top-level keys in this
order, the sections only when they ran:

- `spec`: the grid (`BenchSpec`'s fields);
- `speed`: one row per case and system: {key, dtype, ring_size, tokens, mode, passes, heads,
  head_dim, sample_rows, seed, system, layout, median_s, times, errors {out, dq, dk, dv},
  threads, na (why a system did not run), fastest_peer, ratio};
- `overlap`: {key, dtype, ring_size, tokens, mode, passes, system, bytes_per_step, step_s (per
  pass), held: [{fraction, delay_s, hidden, injected_s, grew_s}] | na} per case and system;
- `balance`: {ring_size, layout, tokens, dtype, work, work_max_over_mean, time_s,
  time_max_over_mean} per ring size and layout;
- `memory`: {rows: [{system, mode, passes, ring_size, tokens, tokens_per_rank, peak_mib (tensor
  storage beyond the shards), na, nxn_mib}], fits: [{system, mode, passes, slope, slope_upper}]};
- `harness`: what -> {wall_s, exit, last_line, failed} or {rows_per_s, median_s};
- `meta`, then bench's keys: machine, cpu, cores, load_1_5_15 (before the run), parent_threads,
  worker_threads, ring_backend, load_after.

`ringcheck.train`, version 1 (`ringcheck.commands.train.report_dict`, `ringcheck train --report
DIR`): verdict ("pass", "fail", "no verdict"), passed, why, command, model, mesh, config, rule
{k_grad, k_loss, reference, noise_runs, gradients, loss}, summary, timing, `gradients` (one row
per parameter: step-0 error, spread, floor, budget, ratio) and `steps` (one row per step: the
losses, spread, envelope, band, gap, gradient norms), meta (`ringcheck.train.verdict`).

`ringcheck.step`, version 1 (`ringcheck.commands.step.report_dict`): verdict, passed, why, command, config, mesh,
reference_mesh, rule, noise (a narrowed ring's: unit, k, rows; else null), convention, data, has_logits, found (lines:
what ringcheck found out itself), cases (one the step raised in: verdict "not run", why, fix), meta.

`ringcheck.plan`, version 1 (`ringcheck.plan.plan_document`): verdict ("fits" or "does not fit"), fits, why,
settings, model, hardware (with sources), memory (bytes per GPU), smallest_cp, ring, step, conventions, notes, meta.

`meta` (every kind, `meta`): command (the command line run), created (UTC, ISO 8601), host, platform,
python, torch, ringcheck (versions), threads (the process's torch CPU threads), elapsed_s; then a command's own.

No rich or plotting here; `ringcheck.render` presents the documents and diffs.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__

DRIFT_SCHEMA, DRIFT_SCHEMA_VERSION = "ringcheck.drift", 1
VALIDATE_SCHEMA, VALIDATE_SCHEMA_VERSION = "ringcheck.validate", 2
BENCH_SCHEMA, BENCH_SCHEMA_VERSION = "ringcheck.bench", 2
TRAIN_SCHEMA, TRAIN_SCHEMA_VERSION = "ringcheck.train", 1
STEP_SCHEMA, STEP_SCHEMA_VERSION = "ringcheck.step", 1
PLAN_SCHEMA, PLAN_SCHEMA_VERSION = "ringcheck.plan", 1


@dataclass(frozen=True)
class Kind:
    """What the writer and the loader know of one kind of document."""

    schema: str
    version: int
    name: str                        # in messages: "not a ringcheck drift report"
    sections: dict[str, type]        # keys a document must have, with their JSON type
    expanded: tuple[str, ...]        # sections written one entry per line


KINDS = {kind.schema: kind for kind in (
    Kind(DRIFT_SCHEMA, DRIFT_SCHEMA_VERSION, "drift", {"spec": dict, "cases": dict, "fits": dict, "summary": dict},
         ("rules", "cases", "fits", "summary", "meta")),
    Kind(VALIDATE_SCHEMA, VALIDATE_SCHEMA_VERSION, "validate", {"passed": bool, "target": dict, "checks": list},
         ("target", "checks", "meta")),
    Kind(BENCH_SCHEMA, BENCH_SCHEMA_VERSION, "bench", {"spec": dict},
         ("spec", "speed", "overlap", "balance", "memory", "harness", "meta")),
    Kind(TRAIN_SCHEMA, TRAIN_SCHEMA_VERSION, "train",
         {"verdict": str, "config": dict, "summary": dict, "gradients": list, "steps": list},
         ("config", "rule", "summary", "gradients", "steps", "meta")),
    Kind(STEP_SCHEMA, STEP_SCHEMA_VERSION, "step", {"verdict": str, "config": dict, "cases": list},
         ("config", "rule", "cases", "meta")),
    Kind(PLAN_SCHEMA, PLAN_SCHEMA_VERSION, "plan", {"verdict": str, "settings": dict, "memory": dict},
         ("settings", "memory", "ring", "conventions", "meta")),
)}

META_KEYS = ("command", "created", "host", "platform", "python", "torch", "ringcheck", "threads", "elapsed_s")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# per case and tensor, the error measures whose growth counts as a regression
DIFF_METRICS = ("max_abs", "rel_norm")


def header(schema: str) -> dict[str, Any]:
    """The first two keys of a document of this kind: {"schema": ..., "schema_version": ...}."""
    return {"schema": schema, "schema_version": _kind(schema).version}


def meta(command: str, *, elapsed_s: float, threads: int | None = None, **extra: Any) -> dict[str, Any]:
    """The `meta` of every document: the command line, when and where it ran, the versions,
    torch's CPU threads (default: this process's) and the run time; then `extra`, the keys
    one command adds (they may not replace the common ones)."""
    clash = sorted(set(extra) & set(META_KEYS))
    if clash:
        raise ValueError(f"meta: {clash} are common keys; a command adds only its own")
    return {
        "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "ringcheck": __version__,
        "threads": torch.get_num_threads() if threads is None else threads,
        "elapsed_s": round(elapsed_s, 1),
        **extra,
    }


def _kind(schema: Any) -> Kind:
    if not isinstance(schema, str) or schema not in KINDS:
        raise ValueError(f"{schema!r} is not a ringcheck document schema; known: {sorted(KINDS)}")
    return KINDS[schema]


# --- strict JSON ---------------------------------------------------------------------------------


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


def _expanded(key: Any, value: Any, end: str) -> list[str]:
    """A section one entry per line: a dict's items, a list's elements."""
    if isinstance(value, dict):
        entries = [f"{_compact(k)}: {_compact(v)}" for k, v in value.items()]
        opening, closing = "{", "}"
    else:
        entries = [_compact(v) for v in value]
        opening, closing = "[", "]"
    lines = [f" {_compact(key)}: {opening}"]
    lines += [f"  {entry}" + ("," if j < len(entries) - 1 else "") for j, entry in enumerate(entries)]
    return lines + [f" {closing}{end}"]


def dumps(doc: dict) -> str:
    """The JSON text of a document (of a kind in `KINDS`): strict JSON in the document's key
    order, one line per top-level value and per entry of the kind's larger sections (a case,
    a fit, a check, a speed row), so a line diff of two documents shows which entries
    changed."""
    kind = _kind(doc.get("schema"))
    doc = _encode(doc)
    lines = ["{"]
    for i, (key, value) in enumerate(doc.items()):
        end = "," if i < len(doc) - 1 else ""
        if key in kind.expanded and isinstance(value, (dict, list)) and value:
            lines += _expanded(key, value, end)
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


class _Literal(ValueError):
    """NaN, Infinity or -Infinity in a text: JSON as Python writes it, not strict JSON."""


def _refuse_literal(name: str) -> Any:
    raise _Literal(name)


def loads(text: str, *, source: str = "<text>", schema: str | None = None) -> dict:
    """Parse and check a document: of the kind `schema`, or of any kind in `KINDS` (None).
    ValueError names the source and what is wrong."""
    expected = None if schema is None else _kind(schema)
    try:
        doc = json.loads(text, parse_constant=_refuse_literal)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from None
    except _Literal as exc:
        raise ValueError(f"{source} is not strict JSON: it holds the literal {exc} (ringcheck writes "
                         f"non-finite numbers as \"inf\", \"-inf\", \"nan\")") from None
    found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
    if expected is not None and found != expected.schema:
        raise ValueError(f"{source} is not a ringcheck {expected.name} report "
                         f"(schema {found!r}, expected {expected.schema!r})")
    if not isinstance(found, str) or found not in KINDS:
        raise ValueError(f"{source} is not a ringcheck report (schema {found!r}; known: {sorted(KINDS)})")
    kind = KINDS[found]
    if doc.get("schema_version") != kind.version:
        raise ValueError(f"{source} has {kind.name} schema version {doc.get('schema_version')!r}; this "
                         f"ringcheck reads version {kind.version}: regenerate it with the command in its meta "
                         f"({(doc.get('meta') or {}).get('command', 'unknown')!r})")
    for key, type_ in kind.sections.items():
        if not isinstance(doc.get(key), type_):
            raise ValueError(f"{source}: {kind.name} report without its {key!r} section")
    return _decode(doc)


def save(doc: dict, path: str | Path) -> Path:
    """Write `dumps(doc)` to `path` (creating its folder); returns the path."""
    path, text = Path(path), dumps(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def load(path: str | Path, *, schema: str | None = None) -> dict:
    """`loads` of the file at `path`."""
    path = Path(path)
    if not path.is_file():
        what = "ringcheck" if schema is None else _kind(schema).name
        raise ValueError(f"no {what} report at {str(path)!r}")
    return loads(path.read_text(encoding="utf-8"), source=str(path), schema=schema)


def without_meta(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "meta"}


# --- diff of two drift documents -----------------------------------------------------------------


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
    # the settings A and B were measured with that differ (`spec_differences`): then the
    # changes compare different measurements
    spec_differences: list[str] = field(default_factory=list)

    @property
    def got_worse(self) -> bool:
        return bool(self.worse)


def diff_documents(a: dict, b: dict, *, threshold: float = 1.5, slope_rise: float = 0.25) -> Diff:
    """What got worse from A to B, matched by stable keys (`meta` is ignored).

    Worse: a case's max abs or normwise relative error grew by more than `threshold` times
    (or became non-finite); a case that was within budget is over it; a fit group gained a
    flag; a fitted slope rose by more than `slope_rise`. The mirror images are listed as
    better. Cases or groups present in only one report are listed, not judged. When the two
    sweeps differ in their settings, `spec_differences` names them (a warning: the two runs
    measured different things).
    """
    if not (isinstance(threshold, (int, float)) and threshold > 1):
        raise ValueError(f"threshold must be a number > 1 (an error ratio), got {threshold!r}")
    if not (isinstance(slope_rise, (int, float)) and slope_rise > 0):
        raise ValueError(f"slope_rise must be a positive number, got {slope_rise!r}")
    diff = Diff(threshold=threshold, slope_rise=slope_rise, spec_differences=spec_differences(a, b))
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


def spec_differences(a: dict, b: dict) -> list[str]:
    """The settings two drift documents were measured with that differ, one entry each:
    'name: A <value>, B <value>' for every key of `spec` (a nested one as 'budget.k_forward')
    and for `implementation`; empty when both runs measured the same sweep."""
    found = []

    def compare(x: Any, y: Any, name: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in list(x) + [k for k in y if k not in x]:
                compare(x.get(k), y.get(k), f"{name}.{k}" if name else k)
        elif _compact(_encode(x)) != _compact(_encode(y)):
            found.append(f"{name}: A {_compact(_encode(x))}, B {_compact(_encode(y))}")

    compare(a.get("spec", {}), b.get("spec", {}), "")
    compare(a.get("implementation"), b.get("implementation"), "implementation")
    return found


def require_same_spec(a: dict, b: dict) -> None:
    """Refuse (ValueError) two drift documents measured with different settings: for a
    reproducibility check (`report diff --exact`), which compares runs of one command."""
    found = spec_differences(a, b)
    if found:
        raise ValueError(f"the two reports measured different settings ({'; '.join(found)}); --exact checks that "
                         f"one command reproduces bit for bit: rerun one report with the other's command "
                         f"(its meta.command), or drop --exact to see what changed")


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
