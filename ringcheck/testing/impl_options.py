"""What `pytest --ring-impl` runs: the implementation under test and where (`ImplConfig`),
parsed once from the plugin's options, and the command that replays one failing case.

Options (the plugin's `ringcheck implementation under test` group):

- ``--ring-impl MOD:FN|ADAPTER``: the implementation (the `--impl` contract of
  `ringcheck validate`, `ringcheck.commands.adapters.load_impl`);
- ``--ring-layout L[,L...]``: the layouts its shards come in (default: the adapter's own; all
  of contiguous, zigzag and striped for a built-in adapter without a list or a function that
  takes a ``layout`` keyword; zigzag, validate's default, for one that does not);
- ``--ring-world-sizes P[,P...]``: the ring sizes drawn (default 1,2,3,4 on local gloo rings;
  under torchrun the divisors of WORLD_SIZE, so rings fill the world and no rank waits idle
  beside them; each at most the world);
- ``--ring-dtypes D[,D...]``: input dtypes drawn (default float32, bfloat16, float16);
- ``--ring-forward-only``: no backward is run; backward properties say "not run";
- ``--ring-mesh DIM=N,...``: the mesh each ring runs inside, its other dims replicating every
  ring size drawn (default: cp=P,tp=2, two interleaved rings, where the processes hold it);
  under torchrun its size must be the world's, and the ring sizes drawn are at most its cp;
- ``--sinks-grad partial|reduced``: what each rank's sinks.grad holds (the contract's conventions).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import torch

from ..adapters import BUILTIN, Impl, accepted_keywords, load_impl
from ..harness import Mesh
from ..judge.check import Case
from ..ring.loops import check_sinks_grad
from ..spec import ALL_LAYOUTS, DTYPES, LAYOUTS, RingSpec, check_layout, is_custom_layout

LOCAL_WORLD_SIZES = (1, 2, 3, 4)  # local gloo rings: one pool of 4 processes serves them all


def _items(option: str, text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{option} expects a comma-separated list, got {text!r}")
    return items


def _world_sizes(text: str | None, torchrun_size: int | None, mesh: Mesh | None = None) -> tuple[int, ...]:
    if mesh is not None and torchrun_size is not None and mesh.size != torchrun_size:
        raise ValueError(f"--ring-mesh {mesh.text} has {mesh.size} ranks but the torchrun world has {torchrun_size}; "
                         f"launch with --nproc-per-node={mesh.size} or pass a mesh of {torchrun_size} ranks")
    if text is None:
        if mesh is not None:
            return tuple(range(1, mesh.cp + 1))
        if torchrun_size:  # the ring sizes that fill the world with rings: no rank waits idle beside them
            return tuple(p for p in range(1, torchrun_size + 1) if torchrun_size % p == 0)
        return LOCAL_WORLD_SIZES
    try:
        sizes = tuple(int(x) for x in _items("--ring-world-sizes", text))
    except ValueError:
        raise ValueError(f"--ring-world-sizes expects ring sizes like 1,2,4, got {text!r}") from None
    bad = [p for p in sizes if p < 1]
    if bad:
        raise ValueError(f"--ring-world-sizes {text}: ring sizes must be >= 1, got {bad}")
    if mesh is not None and torchrun_size is not None and max(sizes) > mesh.cp:
        raise ValueError(f"--ring-world-sizes {text} asks for a ring of {max(sizes)} ranks but --ring-mesh {mesh.text} "
                         f"holds rings of at most cp={mesh.cp} in the torchrun world of {torchrun_size}")
    if torchrun_size is not None and max(sizes) > torchrun_size:
        raise ValueError(f"--ring-world-sizes {text} asks for a ring of {max(sizes)} ranks but the torchrun world has "
                         f"{torchrun_size}; launch with --nproc-per-node={max(sizes)} or drop the larger sizes")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class ImplConfig:
    """The implementation under test and how the in-package suite draws its cases."""

    spec: str
    impl: Impl = field(compare=False, repr=False)
    layouts: tuple[str, ...]
    world_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    forward_only: bool
    timeout: float
    torchrun_size: int | None = None   # the torchrun world's size, None under plain pytest
    layout_note: str = ""               # how the layouts were chosen, for the header
    stand_in: bool = False              # --ring-flash-attn-stand-in: replays need it too
    mesh: Mesh | None = None            # --ring-mesh: its other dims replicate every ring size
    sinks_grad: str = "partial"         # --sinks-grad
    deterministic_algorithms: bool = False  # torch.use_deterministic_algorithms on at configure: determinism required

    @property
    def plain_layouts(self) -> tuple[str, ...]:
        """The layouts of plain (document-free) cases."""
        return tuple(layout for layout in self.layouts if layout in LAYOUTS or is_custom_layout(layout))

    def runnable(self, layout: str, causal: bool) -> bool:
        """Whether the implementation runs this layout with this mask (`Impl.check_layout`)."""
        try:
            self.impl.check_layout(layout, causal)
        except ValueError:
            return False
        return True

    def accepts(self, names) -> tuple[str, ...]:
        """Of the contract's optional keywords `names`, those the implementation takes."""
        return accepted_keywords(self.impl.fn, names)

    def other_rings(self, case: Case) -> list[tuple[int, str]]:
        """The (ring size, layout) pairs of this run that hold the case's sequence and run its
        mask, other than its own."""
        n = case.spec.seq_len
        return [(p, layout) for layout in self.plain_layouts for p in self.world_sizes
                if n % RingSpec(p, layout).chunks == 0 and self.runnable(layout, case.spec.causal)
                and (p, layout) != (case.ring.world_size, case.ring.layout)]

    def describe(self) -> str:
        where = f"the torchrun world of {self.torchrun_size}" if self.torchrun_size else "local gloo rings"
        if self.impl.world_only:
            where += f"; each ring alone ({self.impl.world_only})"
        elif self.mesh is not None:
            where += f", inside mesh {self.mesh.text} (its cp dim set to each ring size)"
        else:
            if self.torchrun_size is None:
                where += ", each ring beside a second one (mesh cp=P,tp=2)"
            else:
                where += (f", each ring beside the others that fill it (mesh cp=P,tp={self.torchrun_size}/P); a ring "
                          f"of {self.torchrun_size}: one ring only (launch 2P ranks or pass --ring-mesh to check "
                          f"group handling)")
        return (f"ringcheck implementation under test: {self.spec} on {where}; ring sizes "
                f"{','.join(map(str, self.world_sizes))}; layouts {','.join(self.layouts)}{self.layout_note}; dtypes "
                f"{','.join(self.dtypes)}" + ("; forward only (backward properties: not run)" if self.forward_only else ""))

    def repro(self, check: str, case: Case, **params) -> str:
        """A shell command that re-runs one property on one case against the implementation:
        `python -m ringcheck.testing.impl_check` (under torchrun: launched by torchrun)."""
        call = f"{check}({', '.join([repr(case)] + [f'{k}={v!r}' for k, v in params.items()])})"
        head = (f"torchrun --standalone --nproc-per-node={self.torchrun_size} -m ringcheck.testing.impl_check"
                if self.torchrun_size else "python -m ringcheck.testing.impl_check")
        flags = f" --impl {shlex.quote(self.spec)} --timeout {self.timeout:g}"
        quoted = f'"{call}"' if not any(c in call for c in '"$`\\!') else shlex.quote(call)  # reprs quote with '
        return (head + flags + (" --forward-only" if self.forward_only else "")
                + (" --flash-attn-stand-in" if self.stand_in else "")
                + (f" --mesh {self.mesh.text}" if self.mesh is not None else "")
                + (f" --sinks-grad {self.sinks_grad}" if self.sinks_grad != "partial" else "") + " " + quoted)


def impl_config(spec: str, *, layouts: str | None = None, world_sizes: str | None = None, dtypes: str | None = None,
                forward_only: bool = False, timeout: float = 60.0, torchrun_size: int | None = None,
                stand_in: bool = False, mesh: str | None = None, sinks_grad: str = "partial") -> ImplConfig:
    """The `ImplConfig` of the plugin's options (text as given on the command line); raises
    ValueError, TypeError or RuntimeError with what to fix (the plugin makes it a usage error)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--ring-impl expects 'package.module:function' or a built-in adapter name, got {spec!r}")
    chosen = _items("--ring-layout", layouts)
    unknown = [x for x in chosen or () if x not in ALL_LAYOUTS and not is_custom_layout(x)]
    if unknown:
        raise ValueError(f"--ring-layout {layouts}: unknown layout(s) {unknown}; choose from {list(ALL_LAYOUTS)} "
                         f"or a custom layout package.module:FN")
    for x in chosen or ():
        check_layout(x)
    impl = load_impl(spec, layout=(chosen or ("zigzag",))[0])
    note = ""
    if chosen is None:
        if impl.layouts is not None:
            chosen, note = impl.layouts, " (the adapter's)"
        elif spec.partition(":")[0] in BUILTIN:  # a built-in adapter is loaded for the layout it runs
            chosen, note = LAYOUTS, " (the adapter's)"
        elif "layout" in accepted_keywords(impl.fn, ("layout",)):
            chosen, note = LAYOUTS, " (it takes layout=)"
        else:
            chosen, note = ("zigzag",), " (it takes no layout= keyword: pass --ring-layout to choose)"
    for layout in chosen:
        if impl.layouts is not None and layout not in impl.layouts:
            impl.check_layout(layout, True)  # raises ValueError naming the layouts it runs
    picked = _items("--ring-dtypes", dtypes) or impl.dtypes or tuple(DTYPES)
    bad = [d for d in picked if d not in DTYPES]
    if bad:
        raise ValueError(f"--ring-dtypes {dtypes}: unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    if impl.dtypes is not None and set(picked) - set(impl.dtypes):
        raise ValueError(f"--ring-dtypes {dtypes}: --ring-impl {spec} runs {list(impl.dtypes)} only; drop "
                         f"{sorted(set(picked) - set(impl.dtypes))}")
    template = None if mesh is None else Mesh.parse(mesh)
    return ImplConfig(spec.strip(), impl, tuple(chosen), _world_sizes(world_sizes, torchrun_size, template), picked,
                      bool(forward_only), float(timeout), torchrun_size, note, bool(stand_in), template,
                      check_sinks_grad(sinks_grad),
                      torch.are_deterministic_algorithms_enabled())  # read once, after the implementation's import
