"""Rings that are right when called plainly and wrong as training wraps them: inside activation
checkpointing, or under `torch.compile`. Each is `mutants.textbook` with one bug class switched
on, and each passes every other row of validate (one call and its backward, two calls before
one backward, the mesh, the views, determinism, the full length):

- ``recompute_slot``: q, k and v saved on the autograd context, but out and the lse kept in
  one of two module-level slots, taken in turn by each forward (so that two layers in flight
  keep theirs), the slot noted on the context. Under ``torch.utils.checkpoint`` (non-reentrant)
  the backward's recompute runs the forward again and takes the next slot: the second layer's
  recompute overwrites the first layer's slot before the first layer's backward reads it.
- ``compile_path_mask``: a branch taken only while dynamo traces (``torch.compiler.is_compiling()``,
  the kind a library adds to avoid what does not compile) whose causal mask treats zig-zag
  shards as contiguous: eager is right, the compiled function is not.

`textbook_nondeterministic` is a correct control: the textbook ring with other float32 roundings
of dq in every run, as a GPU kernel's atomic adds give (a random value added and taken away
again: 2^-23 of dq in float32, 2^-16 in bf16). It is not deterministic (the determinism row FLAGs it), so these
rows judge it by the budget rule, and pass it, instead of by its bits.

This module stands for someone else's code: it does not use ringcheck's ring.
"""

from __future__ import annotations

import torch

from .mutants import mutant_of, textbook

WRAPPED_MUTANTS = {
    "recompute_slot": "out and the lse kept in two module-level slots taken in turn (two layers in flight), not on "
                      "the autograd context: a checkpoint's recompute overwrites a slot before its backward reads it",
    "compile_path_mask": "a branch taken only under torch.compile whose causal mask treats zig-zag shards as "
                         "contiguous",
}

recompute_slot = mutant_of("recompute_slot", WRAPPED_MUTANTS["recompute_slot"])
_CONTIGUOUS_MASK = mutant_of("contiguous_mask_on_zigzag", "the textbook ring with a contiguous causal mask")
textbook_nondeterministic = mutant_of("nondeterministic_dq", "A correct ring that is not deterministic: the textbook "
                                                             "ring with other float32 roundings of dq in every run (as "
                                                             "atomic adds give).")
textbook_nondeterministic.__name__ = textbook_nondeterministic.__qualname__ = "textbook_nondeterministic"


def compile_path_mask(q, k, v, *, causal, softmax_scale, group=None):
    """The textbook ring in eager; under torch.compile, its compile-only branch, whose causal mask
    treats zig-zag shards as contiguous."""
    ring = _CONTIGUOUS_MASK if torch.compiler.is_compiling() else textbook
    return ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group)
