"""The search profiles of the property suites: a Hypothesis example count bound to the size
bounds of the drawn cases, ``ci`` (the default; minutes on 2 CPU cores), ``nightly`` and
``deep``. Hypothesis only (no torch): the pytest plugin registers them when any pytest run
starts (`ringcheck.testing.strategies` draws the cases within them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings


@dataclass(frozen=True)
class Bounds:
    """Largest sizes a strategy draws (every lower bound is 1)."""

    max_world_size: int = 32
    max_tokens_per_rank: int = 8
    max_batch: int = 2
    max_heads: int = 4
    max_head_dim: int = 32
    # where larger than max_tokens_per_rank (nightly, deep: past two tiles of 64), a third of the
    # draws take tokens per rank up to this, leaning to a tile +/- a few (`strategies.tile_tokens`),
    # the sequence kept within max_world_size x max_tokens_per_rank; the ragged tests draw above
    # 64 up to it (at least 72)
    max_ragged_tokens: int = 8

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class Profile:
    """A named search depth: examples per property and size bounds."""

    name: str
    max_examples: int
    bounds: Bounds = field(default_factory=Bounds)

    def settings(self, *, torchrun: bool = False) -> settings:
        """The Hypothesis settings of this profile. Under torchrun every rank must draw the
        same examples in the same order: derandomized and without an example database (a
        database replays a rank's own past failures, which other ranks do not have)."""
        common = dict(
            max_examples=self.max_examples,
            deadline=None,  # an example is a ring run: its time depends on the machine's load
            # slow examples are the nature of these suites (a ring run per example), not a
            # sign of a bad strategy; generation itself is cheap (a handful of integers)
            suppress_health_check=[HealthCheck.too_slow],
            print_blob=True,
        )
        if torchrun:
            return settings(derandomize=True, database=None, **common)
        return settings(**common)


PROFILES: dict[str, Profile] = {
    # ~1 minute for the property suites on a busy 2-core machine
    "ci": Profile("ci", 40, Bounds(max_world_size=32, max_tokens_per_rank=8, max_batch=2,
                                   max_heads=4, max_head_dim=32)),
    "nightly": Profile("nightly", 200, Bounds(max_world_size=32, max_tokens_per_rank=32,
                                              max_batch=2, max_heads=8, max_head_dim=128, max_ragged_tokens=136)),
    # seq_len up to 2048: the float64 truth holds a few (batch, heads, seq, seq) float64 tensors
    "deep": Profile("deep", 1000, Bounds(max_world_size=64, max_tokens_per_rank=32, max_batch=2,
                                         max_heads=8, max_head_dim=256, max_ragged_tokens=264)),
}
