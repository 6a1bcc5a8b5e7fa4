"""The property suites on an implementation under the `--impl` contract, shipped in the package.

The ringcheck pytest plugin collects this module when pytest is given ``--ring-impl``:

    pytest --ring-impl my_pkg.attn:ring_fn --ring-layout zigzag            # local gloo rings
    torchrun --nproc-per-node=8 -m pytest --ring-impl my_pkg.attn:ring_fn  # the torchrun world
    ringcheck test --impl my_pkg.attn:ring_fn [pytest args...]             # the same, as a command

Hypothesis draws cases (ring size from ``--ring-world-sizes``, layout from ``--ring-layout``,
dtype from ``--ring-dtypes``, mode, shape, distribution, seed) within the ``--profile``'s
bounds; each property body (`ringcheck.testing.properties`, `variant_properties`) runs the
implementation on real process groups (`ringcheck.testing.impl_runner`) and judges the whole,
gathered results. A failure names the shrunk case and a command that replays it against the
implementation (`ringcheck.testing.impl_check`).

What applies to any ring: the budget against float64 for every tensor, dtype and
distribution; no NaN/Inf; the metamorphic properties (linear in V, V -> -V, causal prefix,
batch and head independence, K/V permutation, GQA = MHA on repeated K/V); invariance under
ring size and layout; determinism (XFAIL for a ring whose second run changes bits within
rounding, as GPU kernels with atomic adds do; where it does, the bit-exact properties judge it
within the two runs' budgets); the variants the implementation takes keywords for
(packed documents with padding, windows, softcap, sinks), and a value head dim of its own
(d_v != d_qk, which the contract allows without a keyword: its own test, so an implementation
that does not support it fails that test alone); as training wraps it, two layers under
activation checkpointing (the same bits as without) and torch.compile (one case: the same
results as eager; a ring that does not compile is skipped, saying what raised).
Properties of our ring's internals (the distributed ring equals its simulation bit for bit)
run for ``--ring-impl ringcheck`` only. With ``--ring-forward-only`` every property checks
out and lse, and its backward half (dq, dk, dv) is reported as a skipped test "not run".
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from ..judge.check import Case
from ..spec import AttentionSpec, RingSpec
from . import embedded_properties as eprops
from . import properties as props
from . import variant_properties as vprops
from . import wrapped_properties as wprops
from .impl_draws import plain as _plain
from .impl_draws import ragged as _ragged
from .impl_draws import ragged_examples
from .impl_draws import variants as _variants
from .impl_promises import PROMISES, check_promise
from .impl_runner import Refused
from .variant_strategies import variant_bounds, with_variant_options

NOT_RUN = "not run: --ring-forward-only (the backward half of this property: dq, dk, dv)"
A = (1.0, -1.0, 0.5, 2.0)  # coefficients of the linearity property


def pytest_generate_tests(metafunc):
    """`part`: one test per property, or under --ring-forward-only a forward test and a backward
    test skipped as not run (never reported as passed)."""
    if "promise" in metafunc.fixturenames:  # overlap times calls: only when asked for
        get = metafunc.config.getoption
        metafunc.parametrize("promise", [p for p in PROMISES if p != "overlap" or get("--ring-overlap")
                                         or p in get("--ring-require")])
    if "part" in metafunc.fixturenames:
        if metafunc.config.getoption("--ring-forward-only"):
            params = [pytest.param("forward", id="forward"),
                      pytest.param("backward", id="backward", marks=pytest.mark.skip(reason=NOT_RUN))]
        else:
            params = [pytest.param("forward+backward", id="forward+backward")]
        metafunc.parametrize("part", params)


# ---- helpers -----------------------------------------------------------------------------------

_REFUSALS: list[str] = []  # the adapter's refusals during the current search


def _search(body, max_examples: int | None = None) -> None:
    """Run `body(data)` under Hypothesis with the loaded profile (--profile; derandomized under
    torchrun, so every rank draws the same examples), at most `max_examples` examples where
    given. Cases the implementation's own rules refuse are drawn again; a property whose every
    case is refused is skipped with the reason.

    A failure shows the shrunk case and the `reproduce:` line of `_holds`, and nothing meant for
    ringcheck's own developers: no `@reproduce_failure` blob (a user cannot decorate a test of
    the package) and no explain phase (its "Explanation" lists lines of ringcheck's files)."""
    __tracebackhide__ = True
    _REFUSALS.clear()
    profile = settings.default
    search = settings(profile, suppress_health_check=[*profile.suppress_health_check, HealthCheck.filter_too_much],
                      print_blob=False, phases=[phase for phase in profile.phases if phase is not Phase.explain],
                      max_examples=min(profile.max_examples, max_examples or profile.max_examples))
    try:
        search(given(data=st.data())(body))()
    except Unsatisfiable:
        if not _REFUSALS:
            raise
        pytest.skip(f"every case drawn was refused: {_REFUSALS[-1]}")


def _holds(cfg, check, name: str, case, **params) -> None:
    """`check(case, **params)`; a failure ends with the command that replays it against the
    implementation (the bodies' own `reproduce:` line replays our simulated ring instead)."""
    __tracebackhide__ = True
    try:
        check(case, **params)
    except Refused as exc:  # not this implementation's to run: draw another case
        _REFUSALS.append(str(exc))
        reject()
    except AssertionError as exc:
        said = "\n".join(line for line in str(exc).splitlines() if "reproduce:" not in line)
        raise AssertionError(f"{said}\n  reproduce: {cfg.repro(name, case, **params)}") from None
    except (RuntimeError, ValueError, TypeError) as exc:  # the implementation raised, died or broke the contract
        raise AssertionError(f"{name} could not run {case.describe()}: {type(exc).__name__}: {exc}\n"
                             f"  reproduce: {cfg.repro(name, case, **params)}") from None


@pytest.fixture(scope="module")
def cfg(ring_impl_config):
    if ring_impl_config is None:
        pytest.skip("pass --ring-impl MOD:FN (the implementation under test)")
    return ring_impl_config


@pytest.fixture(scope="module")
def vbounds(search_profile):
    return variant_bounds(search_profile)


# ---- the properties of any ring -----------------------------------------------------------------

def test_budget_against_float64(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: props.check_budget(c, impl=ring_impl), "check_budget", case)
    _search(body)


def test_no_nan_or_inf(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: props.check_finite(c, impl=ring_impl), "check_finite", case)
    _search(body)


def test_determinism(cfg, ring_impl, search_profile, part, request):
    """Two runs of one case: the same bits. A ring whose second run changes bits within rounding
    (as atomic adds make GPU kernels) is reported as an expected failure (XFAIL) naming a case;
    it fails under --ring-require determinism, or where torch.use_deterministic_algorithms(True)
    was on when the plugin configured. A second run beyond rounding fails. It runs before the
    bit-exact properties, which then know the ring is not deterministic where it showed that."""
    required = "determinism" in request.config.getoption("--ring-require") or cfg.deterministic_algorithms
    params, differed = ({"required": True} if required else {}), []

    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c, **p: props.check_determinism(c, **p, impl=ring_impl) or differed.append(c),
               "check_determinism", case, **params)
    _search(body)
    if differed:
        pytest.xfail(f"not deterministic (reported; --ring-require determinism fails it): a second run of "
                     f"{differed[0].describe()} changed bits, within rounding")


def test_linear_in_v(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        a, b = data.draw(st.sampled_from(A), label="a"), data.draw(st.sampled_from(A), label="b")
        _holds(cfg, lambda c, **p: props.check_linear_in_v(c, **p, impl=ring_impl), "check_linear_in_v", case,
               a=a, b=b)
    _search(body)


def test_v_negation_is_exact(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: props.check_v_negation(c, impl=ring_impl), "check_v_negation", case)
    _search(body)


def test_bidirectional_invariant_under_kv_permutation(cfg, ring_impl, search_profile, part):
    strategy = _plain(cfg, search_profile.bounds, causal=(False,))

    def body(data):
        case = data.draw(strategy, label="case")
        perm = data.draw(st.permutations(list(range(case.spec.seq_len))), label="permutation")
        _holds(cfg, lambda c, **p: props.check_kv_permutation(c, **p, impl=ring_impl), "check_kv_permutation",
               case, permutation=perm)
    _search(body)


def test_causal_prefix_independence_is_exact(cfg, ring_impl, search_profile, part):
    strategy = _plain(cfg, search_profile.bounds, causal=(True,))

    def body(data):
        case = data.draw(strategy, label="case")
        cut = data.draw(st.integers(1, max(1, case.spec.seq_len - 1)), label="cut")
        _holds(cfg, lambda c, **p: props.check_causal_prefix(c, **p, impl=ring_impl), "check_causal_prefix", case,
               cut=cut)
    _search(body)


def test_batch_and_head_independence_is_exact(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: props.check_batch_and_head_independence(c, impl=ring_impl),
               "check_batch_and_head_independence", case)
    _search(body)


def test_gqa_equals_mha_with_repeated_kv(cfg, ring_impl, search_profile, part):
    strategy = _plain(cfg, search_profile.bounds, min_group=2)

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: props.check_gqa_is_mha_with_repeated_kv(c, impl=ring_impl),
               "check_gqa_is_mha_with_repeated_kv", case)
    _search(body)


def test_ring_size_and_layout_invariance(cfg, ring_impl, search_profile, part):
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        others = cfg.other_rings(case)
        if not others:
            return  # no other ring of this run holds the case (one ring size and one layout given)
        world_size, layout = data.draw(st.sampled_from(others), label="other ring")
        _holds(cfg, lambda c, **p: props.check_ring_invariance(c, **p, impl=ring_impl), "check_ring_invariance",
               case, world_size=world_size, layout=layout)
    if len(cfg.world_sizes) * len(cfg.plain_layouts) < 2:
        pytest.skip("one ring size and one layout: give --ring-world-sizes or --ring-layout more than one")
    _search(body)


def test_budget_at_ragged_shards(cfg, ring_impl, search_profile, part):
    """Shards longer than a tile and not a multiple of it (above 64 tokens per rank, leaning to
    a tile +/- a few): where a kernel's last, partial tile is dropped or masked wrong. Every
    run, at every profile (ci too)."""
    strategy = _ragged(cfg, search_profile.bounds)

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: props.check_budget(c, impl=ring_impl), "check_budget", case)
    _search(body, max_examples=ragged_examples(search_profile))


def test_calls_that_change_length(cfg, ring_impl, search_profile, part):
    """One process calls the ring at a ragged shard, then a shorter one, then the long one
    again: each within budget (a workspace kept from an earlier, longer call fails it)."""
    strategy = _ragged(cfg, search_profile.bounds)

    def body(data):
        case = data.draw(strategy, label="case")
        step = case.ring.chunks // case.ring.world_size
        tokens = case.spec.seq_len // case.ring.world_size
        shorter = step * data.draw(st.integers(1, (tokens - 1) // step), label="shorter tokens per rank")
        _holds(cfg, lambda c, **p: props.check_changing_lengths(c, **p, impl=ring_impl), "check_changing_lengths",
               case, shorter=shorter)
    _search(body, max_examples=ragged_examples(search_profile))


def test_distributed_equals_simulated_bit_for_bit(cfg, ring_impl, search_profile, part):
    if not ring_impl.is_ours:
        pytest.skip(f"needs our ring's internals (its simulation, the same float32 operations): not a property of "
                    f"--ring-impl {cfg.spec}")

    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: props.check_distributed_equals_simulated(c, impl=ring_impl),
               "check_distributed_equals_simulated", case)
    _search(body)


# ---- the variants it takes keywords for -----------------------------------------------------------

def test_variant_budget_against_float64(cfg, ring_impl, vbounds, variant_options, part):
    strategy = _variants(cfg, vbounds)
    if variant_options is not None:
        strategy = strategy.map(lambda c: with_variant_options(c, variant_options, seed=c.seed)).filter(
            lambda c: c is not None)

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: vprops.check_variant_budget(c, impl=ring_impl), "check_variant_budget", case)
    _search(body)


def test_value_head_dim_of_its_own(cfg, ring_impl, vbounds, part):
    """d_v != d_qk (MLA-style): no keyword, the contract's out has v's head dim."""
    strategy = _variants(cfg, vbounds, own_v_dim=(True,))

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: vprops.check_variant_budget(c, impl=ring_impl), "check_variant_budget", case)
    _search(body)


def test_packed_documents_equal_separate_documents(cfg, ring_impl, vbounds, part):
    strategy = _variants(cfg, vbounds, needs=("cu_seqlens",), documents=(True,))

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: vprops.check_documents_are_separate(c, impl=ring_impl), "check_documents_are_separate",
               case)
    _search(body)


def test_padding_is_inert_and_its_rows_are_nan_free(cfg, ring_impl, vbounds, part):
    strategy = _variants(cfg, vbounds, needs=("cu_seqlens",))

    def body(data):
        case = data.draw(strategy, label="case")
        extra = case.ring.chunks * data.draw(st.integers(1, 2), label="padding chunks")
        _holds(cfg, lambda c, **p: vprops.check_padding_is_inert(c, **p, impl=ring_impl, our_plan=ring_impl.is_ours),
               "check_padding_is_inert", case, extra=extra)
    _search(body)


def test_a_window_covering_everything_is_no_window(cfg, ring_impl, vbounds, part):
    strategy = _variants(cfg, vbounds, needs=("window",))

    def body(data):
        case = data.draw(strategy, label="case")
        n = case.spec.seq_len
        side = st.one_of(st.just(-1), st.integers(n - 1, 2 * n + 3))
        left, right = data.draw(st.tuples(side, side).filter(lambda w: w != (-1, -1)), label="window")
        _holds(cfg, lambda c, **p: vprops.check_full_window_is_no_window(c, **p, impl=ring_impl,
                                                                         our_plan=ring_impl.is_ours),
               "check_full_window_is_no_window", case, left=left, right=right)
    _search(body)


def test_softcap_to_infinity_is_no_softcap(cfg, ring_impl, vbounds, part):
    strategy = _variants(cfg, vbounds, needs=("softcap",), softcapped=(False,))

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: vprops.check_softcap_to_infinity(c, impl=ring_impl), "check_softcap_to_infinity", case)
    _search(body)


def test_sinks_of_minus_infinity_are_no_sinks(cfg, ring_impl, vbounds, part):
    strategy = _variants(cfg, vbounds, needs=("sinks",), sinks=(None,))

    def body(data):
        case = data.draw(strategy, label="case")
        _holds(cfg, lambda c: vprops.check_sink_minus_inf(c, impl=ring_impl), "check_sink_minus_inf", case)
    _search(body)


# ---- the ring as training embeds it ------------------------------------------------------------
# (every property above already runs each ring beside a second one, on its own data: the mesh)

def test_inputs_as_views_of_fused_projections(cfg, ring_impl, search_profile, part):
    """q, k, v as views of one fused projection (or k from a fused K/V buffer and v transposed,
    of other strides), dout a view: within budget, as with contiguous inputs."""
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        layout = data.draw(st.sampled_from(("fused_qkv", "kv_strides")), label="input layout")
        _holds(cfg, lambda c, **p: eprops.check_input_layout(c, **p, impl=ring_impl), "check_input_layout", case,
               layout=layout)
    _search(body)


def test_two_calls_before_one_backward(cfg, ring_impl, search_profile, part):
    """Two attention layers' worth: the forward of one input, then of another, then one backward
    of both; each call within budget."""
    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: eprops.check_two_calls_before_backward(c, impl=ring_impl),
               "check_two_calls_before_backward", case)
    _search(body)


# ---- the ring as training wraps it ---------------------------------------------------------------

def test_recompute_under_activation_checkpointing(cfg, ring_impl, search_profile):
    """Two layers' worth, each call inside torch.utils.checkpoint (use_reentrant False and True):
    the same bits as the two layers without checkpointing (a ring that is not deterministic:
    within budget)."""
    if cfg.forward_only:
        pytest.skip("not run: --ring-forward-only (checkpointing recomputes the forward inside the backward)")

    def body(data):
        case = data.draw(_plain(cfg, search_profile.bounds), label="case")
        _holds(cfg, lambda c: wprops.check_recompute(c, impl=ring_impl), "check_recompute", case)
    _search(body)


def _one_case(cfg) -> Case:
    """One small case: causal where the implementation runs a causal mask, on the run's smallest
    ring of two ranks or more, in its first dtype."""
    modes = [(layout, c) for c in (True, False) for layout in cfg.plain_layouts if cfg.runnable(layout, c)]
    if not modes:
        pytest.skip(f"--ring-impl {cfg.spec} runs none of the layouts {list(cfg.plain_layouts)}")
    layout, causal = modes[0]
    ring = RingSpec(min([p for p in cfg.world_sizes if p > 1] or cfg.world_sizes), layout)
    spec = AttentionSpec(batch=2, heads=4, kv_heads=2, seq_len=2 * ring.chunks, head_dim=32, dtype=cfg.dtypes[0],
                         causal=causal)
    return Case(spec, ring, seed=0)


def test_torch_compile_equals_eager(cfg, ring_impl):
    """torch.compile of a function calling the ring, on one small case (dynamo takes seconds per
    rank): the same bits as eager under aot_eager, else within budget. A ring that does not
    compile is skipped with what raised: a limit, not a wrong result."""
    case = _one_case(cfg)
    try:
        info = wprops.check_compile(case, impl=ring_impl)
    except Refused as exc:
        pytest.skip(str(exc))
    except AssertionError as exc:  # the replay line against the implementation, as `_holds` gives it
        said = "\n".join(line for line in str(exc).splitlines() if "reproduce:" not in line)
        raise AssertionError(f"{said}\n  reproduce: {cfg.repro('check_compile', case)}") from None
    if info["error"]:
        pytest.skip(f"does not compile with {info['backend']} (information, not a failure): {info['error']}")


# ---- the ring's other promises, measured (`impl_promises`: XFAIL when off one, FAIL under --ring-require) ----

def test_promise(cfg, ring_processes, request, promise):
    """validate's memory, communication and overlap rows on the implementation: a pass, an XFAIL
    naming what was measured when it is off the promise, a failure only under --ring-require."""
    get = request.config.getoption
    check_promise(cfg, ring_processes, promise, required=promise in get("--ring-require"))
