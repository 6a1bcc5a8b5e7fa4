"""The catalogue of rings: implementations under the `--impl` contract that stand for someone
else's code, each correct or with one real bug class switched on, so that every check can be
shown to catch what it claims and to pass what is right.

- `mutants`: `textbook` (a correct plain ring) and one mutant per bug class of the ring itself
  (merge, masks, backward, communication); `CATALOGUES` names every public catalogue.
- `variant_textbook`, `variant_mutants`: the same for the attention variants (documents,
  windows, softcap, sinks, a value head dim of its own).
- `precision_mutants`: correct rings with one tensor rounded through a narrower dtype.
- `embedded_mutants`: rings that are right alone and wrong as training embeds them (inside a
  mesh, on views of fused projections, at batch > 1, called twice before a backward, with the
  sinks gradient of the other convention).
- `wrapped_mutants`: rings that are right called plainly and wrong as training wraps them
  (inside activation checkpointing, under torch.compile), and a correct ring that is not
  deterministic.
- `nondeterministic`: what the rings `mutants.nondeterministic_sum` (correct) and
  `mutants.nondeterministic_noise` (beyond rounding) add to the textbook ring's sums, which do
  not give the same bits twice, as GPU kernels with atomic adds.
- `bad_impls`: implementations that break the contract (usage errors), and correct ones that
  use its optional parts.
- `custom_layouts`: example layouts of the `package.module:FN` kind.
- `planted`: planted bugs of our own ring, through its `RingParts` seam.

Nothing in the library imports this room but the test kit.
"""
