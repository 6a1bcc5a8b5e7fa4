"""The peer error of a case that is judged on sampled query rows, measured over the whole tensor.

The budget rule (`verdict.judge`) allows k x the peer's error, and the peer's error is a
tensor's maximum over its elements: the whole tensor's, where a case is judged whole (the
scaled-down cases). A case judged on a few sampled rows (validate's ragged shards) would take
the maximum over those rows alone: a sample of a maximum, smaller than the whole tensor's, and
unrelated to the ring's worst rows where two kernels split the work differently and their
roundings land on different elements. So the peer's error of such a case is measured on every
row of the same shape, as the other rows measure it (`whole_peer_errors`).

Two one-device computations are peers, and the larger error counts, tensor by tensor:

- the naive same-dtype peer (`reference.peer_attention`): every intermediate in the input
  dtype, lse from its scores in float32 (with an accurate exponential);
- PyTorch's own one-device CPU flash kernel on the whole sequence (`precision.kernel_class`
  with one block), where it runs the case: it carries the machine's float32 arithmetic into
  the budget. On AVX2 and AVX-512 its half-precision path computes the probabilities with a
  fast exponential, accurate to about 5e-5: its lse is 5e-5 off where the naive peer's is 2e-5
  (float16, 520 tokens), so a ring of that kernel (PyTorch's context parallel) would fail a
  budget set by the naive peer alone on one machine and pass it on another.

docs/explanation/ragged-lengths.md says why; suites/test_ragged_budget.py holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringcheck.reference import dense_attention, peer_attention

from ..spec import AttentionSpec
from .inputs import Inputs
from .metrics import ErrorStats
from .precision import kernel_class
from .results import Results, reference_kwargs
from .verdict import peer_error_stats

CHUNK_SCORES = 2 ** 24  # scores per float64 forward of a block of query rows (128 MiB): never N x N at once
NAIVE = "the naive peer over every row"
KERNEL = "PyTorch's CPU flash kernel on one device, over every row"


@dataclass(frozen=True)
class PeerError:
    """A tensor's peer error (`stats`, against its float64 truth) and which peer it is, in words."""

    stats: ErrorStats
    words: str


def _forward_whole(spec: AttentionSpec, inputs: Inputs) -> tuple[Results, Results]:
    """out and lse of every query row, float64 truth and naive peer, in blocks of query rows of
    at most `CHUNK_SCORES` scores each."""
    kwargs, n = reference_kwargs(spec, inputs), spec.seq_len
    chunk = max(1, CHUNK_SCORES // (spec.batch * spec.heads * n))
    true_parts, peer_parts = [], []
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(n, start + chunk))
        true_parts.append(dense_attention(inputs.q, inputs.k, inputs.v, return_lse=True, rows=rows, **kwargs))
        peer_parts.append(peer_attention(inputs.q, inputs.k, inputs.v, return_lse=True, rows=rows, **kwargs))

    def whole(parts):
        return Results(torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 2), None, None, None)
    return whole(true_parts), whole(peer_parts)


def whole_peer_errors(spec: AttentionSpec, inputs: Inputs, rows: torch.Tensor, true_rows: Results,
                      peer_rows: Results, tensors) -> dict[str, PeerError]:
    """Per tensor of `tensors`, the larger of the naive peer's and the one-device kernel's error
    over the whole tensor at the case's shape. `inputs` are the case's, with dout kept on `rows`
    only (`inputs.with_sampled_rows`), so the gradients of the row references (`true_rows`,
    `peer_rows`: `check.row_results`) are already whole: dq is zero off the rows on every side,
    and dk, dv (and dsinks) are of every key (head). out and lse are measured on every row."""
    true_fwd, peer_fwd = _forward_whole(spec, inputs)
    errors = {}
    for name in tensors:
        if name in ("out", "lse"):
            errors[name] = PeerError(peer_error_stats(peer_fwd.get(name), true_fwd.get(name)), NAIVE)
        elif peer_rows.get(name) is not None:
            errors[name] = PeerError(peer_error_stats(peer_rows.get(name), true_rows.get(name)), NAIVE)
    kernel = kernel_class(spec, inputs, torch.zeros(spec.seq_len, dtype=torch.int64), max_rows=None)
    if kernel is None:  # softcap, sinks, a value head dim of its own, padding rows: the naive peer alone
        return errors
    for name in errors:
        if name in ("out", "lse"):
            stats = peer_error_stats(kernel.get(name), true_fwd.get(name))
        elif name == "dq":
            stats = peer_error_stats(kernel.dq[:, rows], true_rows.dq)
        elif name in ("dk", "dv"):
            stats = peer_error_stats(kernel.get(name), true_rows.get(name))
        else:
            continue
        if stats.max_abs > errors[name].stats.max_abs:
            errors[name] = PeerError(stats, KERNEL)
    return errors
