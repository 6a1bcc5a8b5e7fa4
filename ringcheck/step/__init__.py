"""`ringcheck step`'s room: the user's own training step at CP=P against the same step at CP=1.

- `contract`: the recipe contract (`load_recipe`), what a step is handed (`CP`: rank, size,
  group, layout, the attention under test, `shard`, `rows`, `pad`), the micro-batch convention,
  `active_cp()` (the `cp` of the hook being called, for a model whose attention is not handed
  one) and the two forms of the logits hook;
- `cases`: the case table (one sequence, packed, uneven masks, batch 2, micro-batches, a
  length no ring divides, evaluation, activation checkpointing);
- `run`: the settings (`StepConfig`) and the tasks every rank runs (the step, the diagnosis);
- `verdict`: the float64 budget and the per-case verdict;
- `noise`: the budget of a ring called in a narrower dtype, measured from noise runs;
- `diagnosis`: the known transformations of a correct step and which one a failure matches.

`ringcheck.commands.step` drives a run; `ringcheck.render.step_report` presents it; the
built-in recipes are in `ringcheck.recipes`, the planted ones in `ringcheck.catalogue.step_mutants`.
"""

from .contract import CP, active_cp

__all__ = ["CP", "active_cp"]
