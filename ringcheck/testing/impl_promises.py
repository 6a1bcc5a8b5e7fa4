"""The ring's promises in the plugin's suite (`pytest --ring-impl`): validate's measurement rows
(`ringcheck.commands.validate.promises`: memory, communication, overlap) as one test each.

A measurement is not a property: a ring off a promise is exact, and a test run must not cry wolf
over a design choice (an all-gather ring is O(N) on purpose). So a test reports what it measured
and fails only when asked:

- the promise holds: the test passes;
- the ring is off it (FLAG): the test is an expected failure (XFAIL, its reason the row's
  detail, in pytest's short summary), unless ``--ring-require`` names the promise: then it fails;
- it could not be measured: the test is skipped with the reason.

The overlap test is collected with ``--ring-overlap`` (it times calls) or when required. The
measurement runs on the largest ring size drawn (``--ring-world-sizes``), at validate's default
shape, the first layout the implementation runs (causal where it can) and bfloat16 where drawn
(else the first dtype drawn), on local rings of at most 8 processes (or the largest ring size),
or on the torchrun world.
"""

from __future__ import annotations

import argparse

PROMISES = ("memory", "communication", "overlap")  # as ringcheck.commands.validate.promises names them


def _require(text: str) -> tuple[str, ...]:
    # start-up time: the measurement rows (and torch) are imported only when the option is given
    from ..commands.validate.promises import parse_require

    try:
        return parse_require(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--require", "--ring-require")) from None


def add_options(group) -> None:
    """The plugin's options of the promise tests (in its --ring-impl group)."""
    group.addoption("--ring-require", type=_require, default=(), metavar="PROMISES",
                    help="promises whose FLAG fails its test: memory, communication, overlap, determinism (a "
                         "second run gives the same bits), comma-separated (default: none; a ring off a promise is "
                         "reported as XFAIL)")
    group.addoption("--ring-overlap", action="store_true", default=False,
                    help="also run the overlap test (it times calls, with every transfer held)")


def check_promise(cfg, processes, promise: str, *, required: bool) -> None:
    """The test of `promise` on the implementation of `cfg` (`ImplConfig`); see the module."""
    __tracebackhide__ = True
    # start-up time: pytest and the measurement rows only where a promise test runs
    import pytest

    from ..commands.validate.promises import FLAG, promise_rows  # start-up time, as above
    from ..commands.validate.target import Target
    from ..harness import ImplOptions, Runner

    p = max(cfg.world_sizes)
    modes = [(layout, causal) for causal in (True, False) for layout in cfg.plain_layouts if cfg.runnable(layout,
                                                                                                       causal)]
    if p < 2 or not modes:
        pytest.skip(f"needs a ring of 2 or more in a layout the implementation runs (ring sizes {cfg.world_sizes}, "
                    f"layouts {cfg.layouts})")
    layout, causal = modes[0]
    dtype = "bfloat16" if "bfloat16" in cfg.dtypes else cfg.dtypes[0]
    target = Target(impl=cfg.spec, world_size=p, layout=layout, causal=causal, dtype=dtype, seq_len=16 * p,
                    forward_only=cfg.forward_only, flash_attn_stand_in=cfg.stand_in, sinks_grad=cfg.sinks_grad)
    runner = Runner(processes, ImplOptions(cfg.spec, layout, forward_only=cfg.forward_only, stand_in=cfg.stand_in,
                                           sinks_grad=cfg.sinks_grad))
    limit = None if processes.size is not None else max(8, p)  # local rings: pools of 8 at most (memory: 4 and 8)
    (row,) = promise_rows(target, runner, (promise,), (promise,) if required else (), limit=limit)
    said = f"{row.check} [{target.describe()}]: {row.detail}"
    if row.status == FLAG:
        if required:
            pytest.fail(f"FLAG {said}", pytrace=False)
        pytest.xfail(f"FLAG (reported; --ring-require {promise} fails it) {said}")
    if row.status != "pass":
        pytest.skip(f"not measured: {said}")
