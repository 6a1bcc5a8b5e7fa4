"""The `device placement` row: the first case once more, under the device audit.

On a GPU a tensor made without naming its device lands on the CPU, and the first op that mixes it
with the rank's CUDA tensors raises. On a CPU nothing shows it, so a ring that builds a mask or
a workspace with `torch.arange(n)` passes every row here and crashes on its first GPU run. This
row runs the first scaled case's contiguous call on every rank under `ringcheck.launch.audit`
(whatever `RINGCHECK_DEVICE_AUDIT` says) and fails such a ring, naming the line that made the
tensor. A defect found in ringcheck's own code is not the implementation's: it raises
`DeviceDefect`, which the command turns into exit 2.
"""

from __future__ import annotations

from ...harness.runner import AUDITED
from ...launch import RingError
from ...launch.audit import OWN_CODE, DeviceDefect
from .rows import CheckRow

DEVICE_ROW = "device placement: no tensor left on the default device (audit)"


def device_row(run) -> CheckRow:
    """The first case's contiguous call under the device audit (`run`: validate's `steps.Run`)."""
    run.note("device placement")
    case, inputs, second, _ = run.first
    try:
        run.runner.run(case, inputs, run.mesh, (AUDITED,), second=second)
    except RingError as exc:
        said = sorted({str(t).strip().splitlines()[0] for t in (getattr(exc, "failures", None) or {}).values()
                       if str(t).strip()}) or [str(exc).splitlines()[0]]
        if any(OWN_CODE in s for s in said):
            raise DeviceDefect(next(s for s in said if OWN_CODE in s)) from exc
        audit = [s for s in said if "device audit" in s]
        detail = audit[0] if audit else f"raised only under the device audit: {said[0]}"
        return CheckRow(DEVICE_ROW, "fail", detail=f"{detail} [{case.describe()}]")
    return CheckRow(DEVICE_ROW, "pass", detail=f"[{case.describe()}]")
