"""validate's measurement rows: the ring's promises beyond exactness, for any `--impl`.

Ring attention promises more than the right values: activation memory per rank O(N/P), not
O(N); the communication of a ring (each K/V block passed on, hop by hop); and that this
communication hides behind the compute. An all-gather ring is exact and holds O(N); a ring
that sends its K/V twice is exact and moves twice the bytes; a ring that waits for every
transfer before computing is exact and slow. These rows measure each promise on the
implementation's own ranks (`ringcheck.measure`) and say FLAG where it is broken:

- ``memory``: the peak bytes of tensor storage per rank over one forward and backward, at two
  local lengths (the target's two largest, or its one and twice it) on the target's ring, and at
  two ring sizes of 4 or more at the largest (`_Measure.ring_sizes`). FLAG when the peak grows by
  `MEMORY_BLOCKS` K/V blocks or more per rank added at a fixed local length.
- ``communication``: the bytes, messages and collectives of each pass at the target's ring,
  counted at the torch.distributed calls, against the ring's minimum (`measure.model`). FLAG
  when a pass moves `TRAFFIC_RATIO` times its minimum or more.
- ``overlap`` (``--overlap``: it times calls): every transfer held for 0.5 and 2 times one ring
  step's compute; FLAG when the ring hides less than `HIDDEN_SHARE` of the injected time at
  the smaller delay (where a ring that overlaps hides it all but its last transfer).

A FLAG is reported, in the row and in the verdict line, and fails the exit only for the
promises named by ``--require`` (`parse_require`). Exactness stays the gate. ``--require``
also takes ``determinism``: the determinism row (`steps.Run.determinism_row`) is measured with
the exactness checks, not here, and FLAGs a ring whose second run changes bits within rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...harness import Mesh, Runner
from ...judge.check import Case
from ...judge.inputs import make_inputs
from ...launch import RingError
from ...measure.calls import overlap_figures, promise_task
from ...measure.model import Shapes, hops, ideal_bytes, minimum_traffic
from ...spec import RingSpec
from .rows import FLAG, CheckRow
from .steps import DETERMINISM, short
from .target import Target

MEMORY, COMMUNICATION, OVERLAP = "memory", "communication", "overlap"
PROMISES = (MEMORY, COMMUNICATION, OVERLAP)  # measured here
REQUIRABLE = (*PROMISES, DETERMINISM)        # what --require takes
DEFAULT_PROMISES = (MEMORY, COMMUNICATION)   # cheap and exact; overlap times calls (--overlap)
MEMORY_BLOCKS = 0.5      # FLAG: the peak grows by half a K/V block or more per rank added to the ring
TRAFFIC_RATIO = 1.75     # FLAG: a pass moves 1.75x the ring's minimum or more (K/V sent twice: 2x)
HIDDEN_SHARE = 0.25      # FLAG: less than a quarter of the injected communication time hidden
OVERLAP_FRACTIONS = (0.5, 2.0)  # the delays, in units of one ring step's compute

# built-in implementations known to be off a promise (by design, or as shipped): (impl, promise) -> why
KNOWN = {
    ("torch_cp", MEMORY): "PyTorch's context parallel all-gathers K/V in its default rotate method (_cp_options."
                          "rotate_method = ALL_GATHER): O(N) per rank by design; set_rotate_method('alltoall') "
                          "rotates them by all-to-all instead",
    ("torch_cp", COMMUNICATION): "the torch_cp adapter repeats K/V for every query head before the ring (PyTorch's "
                                 "CPU flash kernel takes as many K/V heads as query heads): heads / kv_heads times "
                                 "the bytes of a GQA ring",
    ("ring_flash_attn:llama3", MEMORY): "ring-flash-attn's llama3 variant is Llama 3's context parallelism, which "
                                        "all-gathers K/V by design: O(N) per rank",
    ("ring_flash_attn:llama3", OVERLAP): "ring-flash-attn's llama3 variant all-gathers K/V before it computes",
    ("ring_attention_pytorch", OVERLAP): "ring_attention_pytorch's ring_pass waits for each transfer, then a barrier, "
                                         "before it computes (send_and_receive_ in ring_attention_pytorch/ring.py)",
    ("ring_attention_pytorch", COMMUNICATION): "ring_attention_pytorch's backward moves 3(P - 1) + 1 K/V-sized blocks "
                                               "(float32) where the minimum is 2(P - 1): 2x at P = 2",
}


def parse_require(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The promises named by ``--require`` ("memory,communication", a list, or None: none);
    ValueError naming the choices for any other name."""
    if value is None:
        return ()
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value)]
    unknown = [n for n in names if n not in REQUIRABLE]
    if unknown or not names or "" in names:
        raise ValueError(f"--require {value!r}: choose one or more of {', '.join(REQUIRABLE)}, separated by commas "
                         f"(e.g. --require memory,communication); got {unknown or names}")
    return tuple(dict.fromkeys(names))


def promise_steps(promises: Sequence[str]) -> int:
    """The progress notes the promise rows make: one, where any is measured."""
    return int(any(p in PROMISES for p in promises))


def _mb(x: float) -> str:
    return f"{x / 1e6:.3g} MB"


class _Measure:
    """The cases the promise rows measure, and their dispatch: the target's ring at its two
    largest local lengths (or its one and twice it), and a second ring size at the largest."""

    def __init__(self, target: Target, runner: Runner, limit: int | None = None, cheap: bool = False):
        self.target, self.runner, self.limit, self.cheap = target, runner, limit, cheap
        self.p = target.world_size
        lengths = sorted(set(target.local_lengths))
        self.n = lengths[-1]
        self.other_n = lengths[-2] if len(lengths) > 1 else 2 * self.n

    def case(self, p: int, n: int) -> Case:
        spec = self.target.spec(n * p, self.target.scaled_batch)
        return Case(spec, RingSpec(p, self.target.layout), seed=self.target.seed, backend=self.target.backend)

    def ring_sizes(self) -> tuple[int, int] | None:
        """The memory row's two ring sizes at a fixed local length: P and 2P, else P / 2 and P,
        else 4 and 8 (not when `cheap`: for a ring of 2 or 3 that starts 8 processes no run has
        started); the smaller at least 4, the larger one the processes hold (local rings: a pool of
        its size; `limit`: at most that many). A ring holds a few K/V blocks more as it
        grows from 2 to 3 or 4 ranks (nothing arrives while a ring of 2 computes its last block;
        ring-flash-attn's zig-zag keeps one more at 4 than at 3): that is no growth with N, so
        it is never compared. None where no such pair fits."""
        if self.runner.processes.size is not None and self.runner.options.load().world_only:
            return None  # a ring that must be the whole world: one size only under torchrun

        def fits(size: int) -> bool:
            return self.runner.fits(Mesh.ring(size)) and (self.limit is None or size <= self.limit)

        for small, large in ((self.p, 2 * self.p), (self.p // 2, self.p), *(() if self.cheap else ((4, 8),))):
            if small >= 4 and fits(large):
                return small, large
        return None

    def run(self, case: Case, *, call: bool = True, overlap: dict | None = None) -> list[dict[str, Any]]:
        """Every rank's measurements of `case` on one ring of its size."""
        inputs = [make_inputs(case.spec, seed=case.seed, distribution="normal", ring=case.ring)]
        _, sent = self.runner.submit_task(promise_task, case, inputs, Mesh.ring(case.ring.world_size), call, overlap)
        return sent.result()[0]


def _known(target: Target, promise: str) -> str:
    why = KNOWN.get((target.impl, promise))
    return f" Known: {why}." if why else ""


def memory_row(target: Target, m: _Measure, first: list[dict]) -> CheckRow:
    """Peak per rank at two local lengths on P, and at two ring sizes at the larger one: FLAG when
    it grows with the ring at a fixed local length."""
    label = "memory: peak per rank grows with N/P, not with N"
    p, n, backward = m.p, m.n, not target.forward_only
    tool = first[0]["call"]["instrument"]
    sizes = m.ring_sizes()
    try:
        shorter = m.run(m.case(p, m.other_n))
        at = [first if size == p else m.run(m.case(size, n)) for size in sizes or ()]
    except (RingError, ValueError) as exc:  # a rank raised, or the variant does not scale to this size
        return CheckRow(label, "info", detail=f"not measured: {short(exc)}")
    peak = max(r["call"]["peak_bytes"] for r in first)
    peak_other = max(r["call"]["peak_bytes"] for r in shorter)
    spec = m.case(p, n).spec
    ideal = ideal_bytes(spec, p, backward=backward)["total"]
    said = (f"peak of one {'forward and backward' if backward else 'forward'} ({tool}): {_mb(peak)} at P={p}, local "
            f"length {n}; {_mb(peak_other)} at local length {m.other_n} (x{peak / peak_other:.2f} for "
            f"x{n / m.other_n:.2f} the local length N/P); ideal {_mb(ideal)} (x{peak / ideal:.2f}: this rank's q, k, "
            f"v, out, lse, 2 K/V blocks in flight"
            + (", dout, dq, dk, dv and 2 dK/dV blocks in flight" if backward else "") + ")")
    if sizes is None:
        why = ("rings of 4 and 8 start 8 processes: --require memory measures them" if m.cheap and p < 4 else
               f"{max(8, 2 * p)} ranks do not fit these processes")
        return CheckRow(label, "info", detail=said + f"; its growth with the ring not measured (a ring of {p}: {why})")
    small, large = sizes
    peaks = [max(r["call"]["peak_bytes"] for r in found) for found in at]
    block = Shapes.of(spec, p).kv
    blocks = (peaks[1] - peaks[0]) / ((large - small) * block)
    said += (f"; at local length {n}: {_mb(peaks[0])} at P={small}, {_mb(peaks[1])} at P={large}: {blocks:+.2f} "
             f"K/V blocks ({block} B) per rank added to the ring")
    if blocks >= MEMORY_BLOCKS:
        return CheckRow(label, FLAG, blocks, MEMORY_BLOCKS, said + ": the peak grows with the ring at a fixed local "
                        "length, as an all-gather ring's does (every rank holds the others' K/V: O(N) per rank)."
                        + _known(target, MEMORY))
    return CheckRow(label, "pass", blocks, MEMORY_BLOCKS, said + ": flat in P (O(N/P))")


def communication_row(target: Target, m: _Measure, first: list[dict]) -> CheckRow:
    """Bytes, messages and collectives per pass at (P, n) against the ring's minimum."""
    label = "communication: bytes per rank vs the ring's minimum"
    case = m.case(m.p, m.n)
    far = hops(case.spec, case.ring)
    least = minimum_traffic(case.spec, case.ring, backward=not target.forward_only)
    ratios, parts = {}, []
    for phase, minimum in least.items():
        traffic = [r["call"]["traffic"][phase] for r in first]
        busiest = max(traffic, key=lambda t: t["bytes_sent"])
        ratios[phase] = busiest["bytes_sent"] / minimum if minimum else None
        parts.append(f"{phase}: sent {busiest['bytes_sent']} B, received {busiest['bytes_received']} B in "
                     f"{busiest['messages_sent']} messages and {busiest['collectives']} collectives; minimum "
                     f"{minimum} B" + (f" (x{ratios[phase]:.2f})" if minimum else ""))
    said = (f"the busiest rank of P={m.p}, local length {m.n} ({far} hop{'s' * (far != 1)}: K/V in the input dtype"
            + ("" if target.forward_only else ", dK/dV partial sums in float32") + "); " + "; ".join(parts))
    judged = {k: v for k, v in ratios.items() if v is not None}
    if not judged:
        return CheckRow(label, "info", detail=said + ": no hop needed, nothing to compare")
    phase, worst = max(judged.items(), key=lambda kv: kv[1])
    if worst >= TRAFFIC_RATIO:
        return CheckRow(label, FLAG, worst, TRAFFIC_RATIO, said + f": the {phase} moves {worst:.2f}x the ring's "
                        f"minimum (K/V sent twice would be 2x)." + _known(target, COMMUNICATION))
    return CheckRow(label, "pass", worst, TRAFFIC_RATIO, said)


def overlap_row(target: Target, m: _Measure, found: list[dict]) -> CheckRow:
    """The share of the injected communication time the ring hid, at each delay."""
    label = "overlap: communication hidden behind compute"
    figures = overlap_figures([r["overlap"] for r in found])
    said = f"P={m.p}, local length {m.n}: " + "; ".join(
        f"each transfer held {f['fraction']:g}x a step's compute ("
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in f["delay_s"].items()) + "): "
        + ("no transfer to hold" if f["hidden"] is None else
           f"{f['hidden']:.0%} of {f['injected_s'] * 1e3:.1f} ms per rank and call hidden, the call "
           f"{f['grew_s'] * 1e3:+.1f} ms slower") for f in figures)
    hidden = figures[0]["hidden"]
    if hidden is None:
        return CheckRow(label, "info", detail=said)
    if found[0]["overlap"]["device"].startswith("cuda"):
        return CheckRow(label, "info", 1.0 - hidden, 1.0 - HIDDEN_SHARE, said + ": information on CUDA (the host "
                        "waits at once for any GPU ring; read the overlap from a trace of the device's streams)")
    if hidden < HIDDEN_SHARE:
        return CheckRow(label, FLAG, 1.0 - hidden, 1.0 - HIDDEN_SHARE, said + ": the ring waits for its transfers as "
                        "it posts them; communication does not hide behind compute." + _known(target, OVERLAP))
    return CheckRow(label, "pass", 1.0 - hidden, 1.0 - HIDDEN_SHARE, said)


def promise_rows(target: Target, runner: Runner, promises: Sequence[str] = DEFAULT_PROMISES,
                 require: Sequence[str] = (), note: Callable[[str], None] = lambda text: None,
                 limit: int | None = None, cheap: bool = False) -> list[CheckRow]:
    """The measurement rows of `promises` (and of every required one), in `PROMISES` order;
    `limit`: use rings of at most that many processes (the plugin's pool), else the runner's;
    `cheap` (validate's default run): no pool of its own for the memory row, unless required."""
    wanted = [p for p in PROMISES if p in promises or p in require]
    if not wanted:
        return []
    m = _Measure(target, runner, limit, cheap and MEMORY not in require)
    overlap = dict(fractions=OVERLAP_FRACTIONS) if OVERLAP in wanted else None
    note(f"measuring {', '.join(wanted)}")
    try:
        first = m.run(m.case(m.p, m.n), call=MEMORY in wanted or COMMUNICATION in wanted, overlap=overlap)
    except (RingError, ValueError) as exc:  # a rank raised, or the variant does not scale to this size
        return [CheckRow(f"{p}: not measured", "info", detail=short(exc), promise=p) for p in wanted]
    rows = []
    for name, row_of in ((MEMORY, memory_row), (COMMUNICATION, communication_row), (OVERLAP, overlap_row)):
        if name in wanted:
            row = row_of(target, m, first)
            row.promise, row.required = name, name in require
            rows.append(row)
    return rows
