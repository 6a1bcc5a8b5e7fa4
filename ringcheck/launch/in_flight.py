"""The point-to-point messages a rank's code leaves in flight when it raises.

A ring posts its next K/V exchange (`torch.distributed.batch_isend_irecv`) before it computes the
current block. When that computation raises (a trainer's ring on a configuration it cannot carry),
the posted requests are dropped with the stack: the peer's matching send then never completes,
and the next run on the same groups (the next case of a `step --model` task) waits on a channel
that is out of step. It timed out, or worse, could have read the last case's K/V as its own.

`InFlight` records the requests that `batch_isend_irecv` hands out while it is entered (rings post
through it: ring-flash-attn's, ms-swift's, ringcheck's), keeps them alive, and `settle` waits for
those not yet complete: every rank posted the same exchange before it raised, so they complete,
and the channel is in step again. Where they do not complete within the timeout, `settle` says so,
and the caller runs nothing more on those groups. Single sends and receives (`isend`, `irecv`) are
not recorded: `batch_isend_irecv` checks them by identity, so they cannot be wrapped.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class InFlight:
    """Within `with InFlight() as flight:`, every request `batch_isend_irecv` returns is kept;
    `clear()` forgets the settled ones (between runs), `settle(seconds)` waits for the rest."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> InFlight:
        for module in (dist, c10d):  # each wraps its own: a caller may have replaced one of them
            original = module.batch_isend_irecv
            self._saved.append((module, original))
            module.batch_isend_irecv = self._recording(original)
        return self

    def _recording(self, original):
        def recorded(p2p_op_list):
            requests = original(p2p_op_list)
            self.requests.extend(r for r in requests or () if r is not None)
            return requests
        return recorded

    def __exit__(self, *exc) -> None:
        for module, saved in reversed(self._saved):
            module.batch_isend_irecv = saved
        self._saved.clear()
        self.requests.clear()

    def clear(self) -> None:
        self.requests.clear()

    def settle(self, seconds: float) -> str | None:
        """Wait up to `seconds` in all for the requests left incomplete; None when all completed,
        else what did not (the channel is then out of step)."""
        left = [r for r in self.requests if not r.is_completed()]
        self.requests.clear()
        deadline = time.monotonic() + seconds
        for i, request in enumerate(left):
            try:
                request.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as exc:  # gloo's timeout, a closed pair: the channel cannot be trusted
                words = str(exc).strip().splitlines()
                return (f"{len(left) - i} of the {len(left)} point-to-point requests it left in flight did not "
                        f"complete ({type(exc).__name__}: {words[-1][:160] if words else ''})")
        return None
