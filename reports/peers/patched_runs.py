"""One target through validate on a kept local ring, as shipped and after a patch task has run
on every rank: the shared driver of the patched-copy confirmations in this folder."""
from ringcheck.commands.validate import validate_task
from ringcheck.launch import LocalRings


def as_shipped_and_patched(world: int, target, patch_task, keep) -> None:
    """Print each row `keep(row)` selects (status, check, its tensors' ratios), first as shipped,
    then after `patch_task(member)` ran on every rank of the same ring."""
    with LocalRings(timeout=120) as rings:
        for label in ("as shipped", "patched"):
            if label == "patched":
                print(rings.run(world, patch_task))
            for r in rings.run(world, validate_task, target, None)[0]:
                if keep(r):
                    print(label, r.status, r.check[:50], {k: round(v["ratio"], 3) for k, v in r.tensors.items()})
