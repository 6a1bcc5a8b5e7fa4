"""The sums of the catalogue's rings that do not give the same bits twice, as GPU kernels with
atomic adds do: ``ringcheck.catalogue.mutants:nondeterministic_sum`` (correct) and
``ringcheck.catalogue.mutants:nondeterministic_noise`` (run-to-run difference far beyond
rounding). The rings themselves are in `mutants` (they are the textbook ring's forward with a
backward of their own); what they add, and how much, is here.

- ``nondeterministic_sum`` is correct: the textbook ring (`mutants.textbook`, its forward as it
  is) whose backward sums dq, and dK/dV, over the ring steps in a random order on each call,
  as flash-attn's and SDPA's backward accumulate dq with atomic adds whose order varies. dq is
  the sum of every ring step's float32 term grouped at random (each added to one of two partial
  sums, chosen on each call: the memory of two accumulators); dK/dV travel the ring as
  the textbook's do, and the home rank adds its own term either first or when they come home
  (at random). On a ring of 2 the order of two terms changes no float sum; from 3 ranks on the
  float32 roundings change from call to call. A GPU kernel adds thousands of terms per element,
  a ring of 4 four, so in bfloat16 or float16 the float32 roundings of so few would round away:
  there each term enters as two parts of opposite sign, up to `spread` times its size (as a long
  accumulation's partial sums, far larger than the result), which moves the float32 sum by up to
  about 1/16 of one rounding of the output dtype: within rounding, and enough that some of its
  roundings change on every call. validate reports it as not deterministic (FLAG) and passes it.
- ``nondeterministic_noise`` is wrong: the textbook ring whose dq is off by up to 100x the
  output dtype's rounding, at random on each call (a kernel whose run-to-run difference is
  beyond rounding: a race, not an order of additions). validate fails it.

This module stands for someone else's code: it uses nothing of ringcheck.
"""

from __future__ import annotations

import os

import torch

NOISE_ROUNDINGS = 100.0  # nondeterministic_noise: dq off by up to this many roundings of the output dtype
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def spread(dtype: torch.dtype) -> float:
    """How large the parts of each term are, in times its size: 0 (the term itself) in float32;
    in a narrower dtype such that the float32 roundings of the sum reach ~1/16 of its rounding."""
    return 0.0 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype] / UNIT_ROUNDOFF[torch.float32] / 16


def generator() -> torch.Generator:
    """A CPU generator seeded anew on each call (the order and the parts change every call)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "big"))


def parts(term: torch.Tensor, size: float, gen: torch.Generator) -> list[torch.Tensor]:
    """`term` as parts whose exact sum it is: itself (`size` 0), else two of opposite sign, up to
    `size` times it."""
    if not size:
        return [term]
    big = term * (size * torch.rand(term.shape, generator=gen)).to(term.device)
    return [term + big, -big]


def add_at_random(sums: list[torch.Tensor], term: torch.Tensor, size: float, gen: torch.Generator) -> None:
    """Each of `term`'s `parts` added to one of the two partial sums `sums`, chosen at random: the
    sum of the ring steps' terms, sums[0] + sums[1] at the end, grouped in a random order (with the
    memory of two accumulators, not one per step)."""
    for part in parts(term, size, gen):
        i = int(torch.randint(2, (), generator=gen))
        sums[i] = sums[i] + part


def first_and_last(term: torch.Tensor, size: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The home rank's own term of a sum that travels the ring: the part it adds as the sum sets out,
    and the rest, added when the sum comes home (which part goes first: at random)."""
    split = [*parts(term, size, gen), torch.zeros_like(term)]
    first = int(torch.randint(len(split), (), generator=gen))
    return split[first], sum(p for i, p in enumerate(split) if i != first)


def noisy(dq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dq` off by up to `NOISE_ROUNDINGS` roundings of `dtype` (relative), at random, in `dtype`."""
    noise = (2 * torch.rand(dq.shape, generator=generator()) - 1).to(dq.device)
    return (dq.float() * (1 + NOISE_ROUNDINGS * UNIT_ROUNDOFF[dtype] * noise)).to(dtype)
