"""The findings' minimal scripts run a trainer's code on P spawned processes of a local gloo group:
`run_ranks` starts them on a free port, takes what they report and waits for them, saying which
rank did not answer where none did."""

from __future__ import annotations

import queue
import socket


def run_ranks(target, size: int, *args, results: int = 1, timeout: float = 600) -> list:
    """`target(rank, port, *args, out)` on `size` spawned processes (`port`: a free local port for
    the group's rendezvous); the first `results` items they put on `out` (each minimal script's rank
    0 puts one; a script whose every rank reports, `size`), taken before the join: a process exits
    only once what it put on the queue is taken. RuntimeError with the exit codes where none came."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout) for _ in range(results)]
    except queue.Empty:
        raise RuntimeError(f"no result from the ranks (exit codes {[p.exitcode for p in procs]}); their tracebacks "
                           f"are above") from None
    finally:
        for p in procs:
            p.join(timeout=60)


def confirm_line(ring, model: str, glue: str, world_size: int = 4) -> str:
    """`ringcheck step --model MODEL --glue GLUE` on `ring` (every default case), in one line: the
    verdict, the worst logits' ratio to the budget, the cases that failed (a finding's confirmation,
    as shipped and patched)."""
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.models.step import ModelStepConfig

    judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=world_size), ring)
    failed = [c["case"] for c in judged["cases"] if c["verdict"] == "fail"]
    worst = max((c["logits"]["ratio"] for c in judged["cases"] if "logits" in c), default=float("nan"))
    return f"{judged['verdict']:5s} worst logits {worst:.2g} of the budget; failed: {', '.join(failed) or 'none'}"
