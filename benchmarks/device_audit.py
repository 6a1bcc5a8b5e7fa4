"""The device audit on the catalogue: every ring validated at the quick defaults with and without
`RINGCHECK_DEVICE_AUDIT`, the rows each fails compared (issue 59).

Under the audit a mutant must still fail for its own bug (the same failing rows as without it,
never a device error), the correct rings must still pass, and the `device placement` row (run
under the audit by default) fails only the ring that makes its mask without a device. Writes a
Markdown table (and its JSON) with the command that regenerates it:

    python -m benchmarks.device_audit [--out reports/device_audit] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

from ringcheck.catalogue.mutants import CATALOGUES
from ringcheck.commands.validate import Target, validate
from ringcheck.commands.validate.device import DEVICE_ROW
from ringcheck.launch import LocalRings, RingError

COMMAND = "python -m benchmarks.device_audit"
CONTROLS = ("ringcheck", "ringcheck.catalogue.mutants:textbook", "torch_cp")
# the catalogues whose rings run at validate's defaults (the variant and precision catalogues
# need their own flags and ring sizes; their suites run under the audit in CI)
DEFAULT_CATALOGUES = ("ringcheck.catalogue.mutants", "ringcheck.catalogue.length_mutants",
                      "ringcheck.catalogue.embedded_mutants", "ringcheck.catalogue.wrapped_mutants",
                      "ringcheck.catalogue.promise_mutants")


def rings() -> list[str]:
    names = list(CONTROLS)
    for module in DEFAULT_CATALOGUES:
        names += [f"{module}:{n}" for n in getattr(importlib.import_module(module), CATALOGUES[module])]
    return names


def failing(impl: str, audit: bool) -> tuple[str, list[str]]:
    """(outcome, the rows it fails) of `ringcheck validate --quick --impl impl`."""
    try:
        with LocalRings(timeout=120, audit=audit) as processes:
            rows = validate(Target(impl=impl, local_lengths=(2, 6)), processes, promises=("memory", "communication"))
    except RingError as exc:
        return "no verdict (raised)", [str(exc).splitlines()[0][:120]]
    except Exception as exc:  # a DeviceDefect (ringcheck's own code) or a contract error: no verdict
        return f"no verdict ({type(exc).__name__})", [str(exc).splitlines()[0][:160]]
    bad = [r.check for r in rows if not r.passed]
    return ("fail" if bad else "pass"), bad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="reports/device_audit")
    parser.add_argument("--only", default=None, help="comma-separated --impl names (default: every ring)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else rings()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for impl in names:
        start = time.perf_counter()
        plain, plain_rows = failing(impl, audit=False)
        audited, audited_rows = failing(impl, audit=True)
        same = (plain, [r for r in plain_rows if r != DEVICE_ROW]) == (audited, [r for r in audited_rows
                                                                                  if r != DEVICE_ROW])
        results.append({"impl": impl, "without": plain, "with": audited, "failed_rows_without": plain_rows,
                        "failed_rows_with": audited_rows, "same_verdict": same,
                        "device_row_fails": DEVICE_ROW in audited_rows, "seconds": time.perf_counter() - start})
        print(f"{impl}: {plain} / {audited} (same: {same}) {audited_rows}", flush=True)
        (out / "catalogue.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# The catalogue under the device audit\n\nRegenerate: `{COMMAND}` (validate --quick per ring, "
             "with and without `RINGCHECK_DEVICE_AUDIT=1`).\n",
             "| ring | without the audit | with it | same verdict | device placement row | rows failed with it |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r['impl']}` | {r['without']} | {r['with']} | {'yes' if r['same_verdict'] else 'NO'} | "
                     f"{'FAIL' if r['device_row_fails'] else 'pass'} | {'; '.join(r['failed_rows_with']) or '-'} |")
    (out / "catalogue.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
