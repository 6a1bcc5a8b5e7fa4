"""One target through validate on local rings, as shipped and after a patch task has run on every
rank (every pool's processes run it first): the shared driver of the patched-copy confirmations
in this folder."""
from ringcheck.commands.validate import validate
from ringcheck.launch import LocalRings


def as_shipped_and_patched(world: int, target, patch_task, keep) -> None:
    """Print each row `keep(row)` selects (status, check, its tensors' ratios), first as shipped,
    then with `patch_task(member)` run on every rank of every ring first. (`world`: the ring
    size, kept for the callers; the target's world_size is the ring.)"""
    for label, setup in (("as shipped", None), ("patched", patch_task)):
        with LocalRings(timeout=120, setup=setup) as rings:
            for r in validate(target, rings):
                if keep(r):
                    print(label, r.status, r.check[:50], {k: round(v["ratio"], 3) for k, v in r.tensors.items()})
