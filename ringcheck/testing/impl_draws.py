"""How the in-package suite (`ringcheck.testing.impl_suite`) draws its cases for an
implementation under the `--impl` contract: plain cases on the run's ring sizes, layouts and
dtypes in the modes the implementation runs (`plain`), the variants it takes keywords for
(`variants`), and ragged shards above a tile of 64 (`ragged`). A draw the implementation cannot
run skips the test with the reason."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from ..spec import DOC_LAYOUTS
from .strategies import cases, ragged_cases
from .variant_strategies import variant_cases


def plain(cfg, bounds, *, causal=(False, True), min_group=1):
    """Plain cases on the run's ring sizes, layouts and dtypes, in the modes the implementation runs."""
    modes = [(layout, c) for layout in cfg.plain_layouts for c in causal if cfg.runnable(layout, c)]
    if not modes:
        pytest.skip(f"--ring-impl {cfg.spec} runs none of the layouts {list(cfg.plain_layouts)} "
                    f"{'causal' if causal == (True,) else 'bidirectional' if causal == (False,) else ''}")
    if min_group > bounds.max_heads:
        pytest.skip(f"grouped-query cases need max_heads >= {min_group} (profile bounds {bounds})")

    @st.composite
    def draw(d):
        p = d(st.sampled_from(cfg.world_sizes), label="ring size")
        layout, c = d(st.sampled_from(modes), label="mode")
        return d(cases(bounds, dtypes=cfg.dtypes, layouts=(layout,), causal=(c,), world_size=p, min_group=min_group))
    return draw()


def variants(cfg, bounds, needs=(), **features):
    """Variant cases with only the features whose keywords the implementation takes."""
    took = cfg.accepts(("cu_seqlens", "window", "softcap", "sinks"))
    missing = [n for n in needs if n not in took]
    if missing:
        pytest.skip(f"--ring-impl {cfg.spec} takes no {', '.join(missing)}= keyword (the --impl contract's "
                    f"optional variant keywords)")
    features.setdefault("documents", (False, True) if "cu_seqlens" in took else (False,))
    features.setdefault("windowed", (False, True) if "window" in took else (False,))
    features.setdefault("softcapped", (False, True) if "softcap" in took else (False,))
    features.setdefault("sinks", (None, "normal") if "sinks" in took else (None,))
    features.setdefault("own_v_dim", (False,))  # a value head dim of its own: its own test
    layouts = tuple(x for x in cfg.layouts if x not in DOC_LAYOUTS or "cu_seqlens" in took)
    modes = [(layout, c) for layout in layouts for c in (False, True)
             if cfg.runnable("zigzag" if layout in DOC_LAYOUTS else layout, c)]
    if not modes:
        pytest.skip(f"--ring-impl {cfg.spec} runs none of the layouts {list(cfg.layouts)}")

    @st.composite
    def draw(d):
        p = d(st.sampled_from(cfg.world_sizes), label="ring size")
        layout, c = d(st.sampled_from(modes), label="mode")
        return d(variant_cases(bounds, dtypes=cfg.dtypes, layouts=(layout,), causal=(c,), world_size=p, **features))
    return draw()


def ragged_examples(profile) -> int:
    """Examples of each ragged-length test: a tenth of the profile's (a ragged shard costs a dozen
    small cases), 3 at least (ci: 4)."""
    return max(3, profile.max_examples // 10)


def ragged(cfg, bounds):
    """Plain cases at ragged shards above 64 tokens per rank (`ragged_cases`), in the modes the
    implementation runs."""
    modes = [(layout, c) for layout in cfg.plain_layouts for c in (False, True) if cfg.runnable(layout, c)]
    if not modes:
        pytest.skip(f"--ring-impl {cfg.spec} runs none of the layouts {list(cfg.plain_layouts)}")

    @st.composite
    def draw(d):
        p = d(st.sampled_from([q for q in cfg.world_sizes if q <= 4] or [min(cfg.world_sizes)]), label="ring size")
        layout, c = d(st.sampled_from(modes), label="mode")
        return d(ragged_cases(bounds, dtypes=cfg.dtypes, layouts=(layout,), causal=(c,), world_size=p))
    return draw()
