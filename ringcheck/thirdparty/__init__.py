"""Third-party private surfaces, one door each (issue 60, item 2).

ringcheck calls names its dependencies do not promise to keep: torch's context-parallel
internals and c10d's store and group table, transformers' model-class lookup, DeepSpeed's
sequence-parallel state, flash-attn's backward kernel. Each dependency's private or
version-dependent surface is reached through one module here (`torch_private`,
`transformers_private`, `deepspeed_private`, `flash_attn_private`), and only there. A door reads
the installed version once; when a name has moved it raises `SurfaceMoved`, a RuntimeError of
one line that names the version and the fix, instead of an AttributeError from inside a run;
where ringcheck can do without a name (the c10d store, NCCL's abort) the door says so by
returning None. This room imports nothing else of ringcheck, so every floor may use it.
"""
