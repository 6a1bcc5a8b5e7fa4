"""The context-parallel glues that training frameworks ship, run as they ship (issue 49): one
module per trainer, each the adapter that calls the trainer's own public entry (its patch of
transformers, its own sharding of the batch) under ringcheck's glue contract
(`ringcheck.glues.contract.Glue`), and a shim only where the trainer's code cannot run on a CPU,
each named in the glue's `shims` (the report prints them).

| `--glue` | trainer | entry | kind |
|---|---|---|---|
| `deepspeed_ulysses` | DeepSpeed (ALST) | `UlyssesSPAttentionHF.register_with_transformers`, `UlyssesSPDataLoaderAdapter` | Ulysses |
"""

TRAINER_GLUES = ("deepspeed_ulysses",)
