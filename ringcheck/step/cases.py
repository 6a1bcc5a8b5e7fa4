"""The cases of `ringcheck step`: one table, read top to bottom (TransformerEngine's habit).

Each case is the global micro-batches every rank is given (seeded: the same on every rank and
in the reference), and how the step is called (trained, evaluated under no_grad, or under
activation checkpointing). The sequence is `SEQ_LEN` tokens (a multiple of 2 x 8: every ring up
to 8 in every layout), except the case whose length no ring of more than one rank divides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract import IGNORE

SEQ_LEN = 64
ODD_LEN = 61  # divisible by no 2 x P: the recipe must pad (or say it cannot)
DOCUMENTS = (0, 21, 45, 64)  # packed: three documents, boundaries inside shards and on none of them


@dataclass(frozen=True)
class Case:
    name: str
    words: str
    rows: int = 1                      # per data-parallel replica
    micro: int = 1                     # micro-batches
    seq_len: int = SEQ_LEN
    packed: bool = False
    mask: str = "none"                 # "none", "uneven" (one shard almost empty), "rows" (rows differ)
    evaluate: bool = False             # forward only, under no_grad: the loss alone
    checkpoint: str | None = None      # activation checkpointing the step is asked for
    fix: str = ""                      # what a step that cannot run the case must do (a not-run case's fix)
    documents: tuple[tuple[int, ...], ...] | None = None  # packed: each micro-batch's boundaries (default DOCUMENTS)


CASES = {c.name: c for c in (
    Case("one_sequence", "one sequence, every target counted"),
    Case("packed", "packed documents: positions restart, no target across a document end", packed=True),
    Case("uneven", "-100 spans: the shards hold very different counts (rank 0 almost none)", mask="uneven"),
    Case("batch2", "batch 2, the rows with different counts", rows=2, mask="rows"),
    Case("two_micro_batches", "two micro-batches with different counts (gradient accumulation)", micro=2,
         mask="rows"),
    Case("not_divisible", f"{ODD_LEN} tokens, divisible by no 2 x P: the recipe pads", seq_len=ODD_LEN,
         fix="pad every tensor to a multiple of cp.multiple before sharding (cp.pad(x, value): -100 for the labels, "
             "so the pads count nowhere), or leave the case out if your loader always pads (--cases)"),
    Case("evaluation", "evaluation: forward under no_grad, the loss alone", evaluate=True),
    Case("checkpoint_non_reentrant", "activation checkpointing (non-reentrant): the ring again in backward",
         checkpoint="non_reentrant"),
    Case("checkpoint_reentrant", "activation checkpointing (reentrant)", checkpoint="reentrant"),
)}


def case_names(text: str | None, checkpointing=(), evaluate: bool = True) -> tuple[str, ...]:
    """The cases of `--cases` (comma-separated; default every case the recipe offers)."""
    if text is None:
        return tuple(n for n, c in CASES.items() if (c.checkpoint is None or c.checkpoint in checkpointing)
                     and (evaluate or not c.evaluate))
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in CASES]
    if bad or not names:
        raise ValueError(f"--cases {text!r}: unknown case(s) {bad}; choose from {', '.join(CASES)}")
    return names


def micro_batches(case: Case, *, vocab: int, seed: int, dp: int, rank0_positions: torch.Tensor | None = None
                  ) -> list[dict]:
    """The case's global micro-batches (every replica's rows): `rank0_positions`, the positions
    rank 0 of the ring holds, are where the uneven case leaves almost nothing to count."""
    gen = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, case.name)))
    rows, n = case.rows * dp, case.seq_len
    out = []
    for m in range(case.micro):
        ids = torch.randint(0, vocab, (rows, n), generator=gen)
        labels = ids.clone()
        cu = (case.documents[m] if case.documents else DOCUMENTS) if case.packed else None
        if cu is None:
            pos = torch.arange(n).expand(rows, n).clone()
        else:
            pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]).expand(rows, n).clone()
            labels[:, list(cu[1:-1])] = IGNORE  # a document's last token predicts nothing across the end
        if case.mask == "uneven":
            labels[:, torch.rand(n, generator=gen) < 0.3] = IGNORE
            if rank0_positions is not None:
                after = rank0_positions[1:] + 1  # the labels of rank 0's targets but its first
                labels[:, after[after < n]] = IGNORE
        elif case.mask == "rows":
            for r in range(rows):
                share = 0.2 + 0.5 * ((r + m) % 3) / 2
                labels[r, torch.rand(n, generator=gen) < share] = IGNORE
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu})
    return out


def fix_of(name: str) -> str:
    """What a step that cannot run the case `name` must do to run it."""
    return CASES[name].fix or f"make the step run the {name} case, or leave it out (--cases)"
