"""DeepSpeed's private surface, the one door to it: the sequence-parallel state of
`deepspeed.runtime.sequence_parallel.parallel_state_sp` that `--glue deepspeed_ulysses` hands
ringcheck's CP group (its module-level groups and their release). DeepSpeed is optional; it is
imported by the glue. A moved name raises `SurfaceMoved`: "deepspeed 0.20.0 moved ...:
ringcheck supports deepspeed 0.19.8 here; pip install deepspeed==0.19.8 or upgrade ringcheck".
"""

from __future__ import annotations

from .door import Door

DEEPSPEED = Door("deepspeed", supported="0.19.8", fix="pip install deepspeed==0.19.8")
STATE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
GROUPS = ("_SEQUENCE_PARALLEL_GROUP", "_SEQUENCE_DATA_PARALLEL_GROUP")


def release_sequence_parallel_groups() -> None:
    """DeepSpeed forgets the sequence-parallel groups it holds."""
    DEEPSPEED.reach(STATE, "_release_sequence_parallel_groups")()


def hand_sequence_parallel_group(group) -> None:
    """DeepSpeed's sequence-parallel group (and its sequence-data-parallel group) become `group`."""
    state = DEEPSPEED.reach(STATE)
    for name in GROUPS:
        if not hasattr(state, name):
            raise DEEPSPEED.moved(f"{STATE}.{name}")
        setattr(state, name, group)
