"""A device mesh as training lays it out: named dims, outermost first, exactly one of them `cp`.

`--mesh dp=2,cp=4` and `--mesh cp=4,tp=2` read like `torch.distributed.device_mesh`'s
``init_device_mesh(device, (2, 4), mesh_dim_names=("dp", "cp"))``: global rank r sits at the
C-order index of r in the mesh's shape, and a dim's groups are the lines along that dim. So
dp=2,cp=4 gives the CP groups {0,1,2,3} and {4,5,6,7} (offset ranks), cp=4,tp=2 the strided
{0,2,4,6} and {1,3,5,7}. The `cp` dim is the ring; every other dim (dp, tp, pp, any name)
replicates it: each CP group runs the implementation at the same time on its own inputs.

A `Mesh` is pure arithmetic; `plan()` turns it into the launcher's `GroupPlan` (the CP groups,
and the families of the other dims' groups and of the whole mesh, for tasks that reduce
gradients the way a framework does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..launch import GroupPlan

CP = "cp"          # the ring's dim
REPLICA = "tp"     # the dim of the default embedding: a second, interleaved ring beside the first
MESH_FAMILY = "mesh"  # the family of one group holding every rank of the mesh (`GroupPlan.also`)
REPLICAS = "replicas"  # the family of groups of the ranks at one cp index (every other dim varying)


@dataclass(frozen=True)
class Mesh:
    """Named dims (outermost first), sizes >= 1, exactly one named `cp`."""

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        dims = tuple((str(n), s) for n, s in self.dims)
        object.__setattr__(self, "dims", dims)
        names = [n for n, _ in dims]
        if not dims:
            raise ValueError("a mesh needs at least one dim, e.g. --mesh cp=4 or --mesh dp=2,cp=4")
        for name, size in dims:
            if not name.isidentifier():
                raise ValueError(f"mesh dim name {name!r} is not a name; write DIM=N, e.g. --mesh dp=2,cp=4")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dim {name}={size!r}: a dim's size must be an integer >= 1")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh {self.text}: dim names must differ, got {names}")
        if names.count(CP) != 1:
            raise ValueError(f"mesh {self.text} has {names.count(CP)} dims named {CP!r}; exactly one dim is the ring: "
                             f"name it cp, e.g. --mesh dp=2,cp=4 or --mesh cp=4,tp=2")

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`DIM=N,DIM=N,...` (e.g. "dp=2,cp=4"); ValueError naming the value and the fix."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"--mesh expects DIM=N,DIM=N,... with one dim named cp (e.g. dp=2,cp=4), got {text!r}")
        dims = []
        for part in text.split(","):
            name, sep, size = part.strip().partition("=")
            try:
                value = int(size.strip())
            except ValueError:
                value = None
            if not sep or not name.strip() or value is None:
                raise ValueError(f"--mesh {text}: {part.strip()!r} is not DIM=N (e.g. --mesh dp=2,cp=4)")
            dims.append((name.strip(), value))
        return cls(tuple(dims))

    @classmethod
    def ring(cls, world_size: int) -> Mesh:
        """One ring that is the whole world: cp=P."""
        return cls(((CP, world_size),))

    @classmethod
    def embedded(cls, world_size: int) -> Mesh:
        """The default embedding: two interleaved rings, cp=P,tp=2 (strided CP groups)."""
        return cls(((CP, world_size), (REPLICA, 2)))

    @property
    def text(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def cp(self) -> int:
        return dict(self.dims)[CP]

    @property
    def rings(self) -> int:
        """How many CP groups run side by side."""
        return self.size // self.cp

    def with_cp(self, world_size: int) -> Mesh:
        """The same mesh with a ring of `world_size` (the other dims as they are)."""
        return Mesh(tuple((n, world_size if n == CP else s) for n, s in self.dims))

    def groups(self, dim: str = CP) -> tuple[tuple[int, ...], ...]:
        """The groups along `dim` in global ranks (as `DeviceMesh` forms them), in C order of the
        other dims."""
        if dim not in self.names:
            raise ValueError(f"mesh {self.text} has no dim {dim!r}")
        ranks = torch.arange(self.size).reshape(self.shape).movedim(self.names.index(dim), -1)
        return tuple(tuple(row) for row in ranks.reshape(-1, dict(self.dims)[dim]).tolist())

    def coords(self, global_rank: int) -> dict[str, int]:
        """A global rank's place in every dim."""
        index = torch.unravel_index(torch.tensor(global_rank), self.shape)
        return {n: int(i) for n, i in zip(self.names, index)}

    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks that hold the same place in their CP group (every dim but cp
        varying): the replicas a data-parallel gradient reduction spans."""
        ranks = torch.arange(self.size).reshape(self.shape).movedim(self.names.index(CP), 0)
        return tuple(tuple(row) for row in ranks.reshape(self.cp, -1).tolist())

    def plan(self, first: int = 0, *, families: bool = True) -> GroupPlan:
        """The launcher's plan: the CP groups as rings, shifted by `first` (a mesh placed on the
        last ranks of a larger world), and with `families` also the groups of every other dim, of
        the replicas (`REPLICAS`) and of the whole mesh (`MESH_FAMILY`), for tasks that reduce
        gradients as a framework does (each group costs every rank a rendezvous: a task that
        calls an implementation alone passes families=False)."""
        def shift(groups):
            return tuple(tuple(r + first for r in g) for g in groups)

        also = []
        if families:
            also = [(MESH_FAMILY, shift((tuple(range(self.size)),))), (REPLICAS, shift(self.replicas()))]
            also += [(n, shift(self.groups(n))) for n in self.names if n != CP]
        return GroupPlan(shift(self.groups()), tuple(also), label=f"mesh {self.text}")

    def describe(self) -> str:
        groups = " | ".join(",".join(map(str, g)) for g in self.groups())
        if self.rings == 1:
            return f"mesh {self.text}: one ring (global ranks {groups})"
        return f"mesh {self.text}: {self.rings} CP groups at once, each on its own data (global ranks {groups})"

    def to_json(self) -> dict:
        return {"text": self.text, "dims": dict(self.dims), "cp_groups": [list(g) for g in self.groups()]}
