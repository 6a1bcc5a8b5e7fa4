"""The precision class of a tensor near the subnormal range (issue 58, item 3).

`ringcheck validate --layout contiguous --causal --sinks --quick` (bfloat16) has a late-max case
(P = 4, 6 tokens per rank) whose dsinks truth lies wholly among float32's subnormals (norm
7.5e-41; bfloat16 shares float32's range, its spacing there 9.2e-41). Rounded once to bfloat16 it
errs by 3.758e-41, so a correct ring that returned 0 (error 7.524e-41, 2.00x) failed its budget
of 7.519e-41 by the last bit. Below a dtype's smallest normal number rounding is absolute, and the
class error is now never below one such rounding per element (`precision.one_rounding`):

- that ring passes, and so does any dsinks exactly 2.00x the class error at that size;
- a dsinks off by a few of bfloat16's subnormal spacings still fails;
- at a normal size the rule is unchanged: 2.05x the class error fails.
"""

from __future__ import annotations

import dataclasses

import torch

from ringcheck.commands.validate.target import Target, scaled_cases
from ringcheck.judge.check import truth
from ringcheck.judge.inputs import make_inputs
from ringcheck.judge.metrics import unit_roundoff
from ringcheck.judge.precision import GENERIC_ROUNDING, class_reference, judge_class, judge_precision, one_rounding

BF16 = torch.finfo(torch.bfloat16)
SPACING = BF16.eps * BF16.tiny  # bfloat16's spacing below its smallest normal number: 9.2e-41


def _case(distribution: str):
    target = Target(layout="contiguous", causal=True, sinks=True, local_lengths=(2, 6))  # validate --quick's
    case = next(c for c in scaled_cases(target) if c.distribution == distribution and c.spec.seq_len == 24)
    x = make_inputs(case.spec, seed=case.seed, distribution=case.distribution, ring=case.ring)
    true = truth(case.spec, x)
    return case, x, true, class_reference(case.spec, x, true)


def _dsinks_verdict(case, x, true, reference, dsinks):
    got = dataclasses.replace(reference, dsinks=dsinks.float())  # every other tensor one rounding off
    return judge_precision(case, got, true, x, tensors=("out", "lse", "dq", "dk", "dv"))["dsinks"]


def test_a_dsinks_among_the_subnormals_is_judged_on_one_rounding():
    case, x, true, reference = _case("late-max")
    t = true.dsinks
    assert float(t.abs().max()) < BF16.tiny and float(t.norm()) < SPACING  # the case: norm 7.5e-41
    class_error = float((reference.dsinks - t).norm())
    assert 3.7e-41 < class_error < 3.8e-41
    assert one_rounding(t, torch.bfloat16) > class_error  # the floor reflects the range: 5.3e-41
    zero = _dsinks_verdict(case, x, true, reference, torch.zeros_like(t))
    assert zero.passed and zero.ratio < 0.8, zero.describe()  # 2.00x the lucky class error: 0.71
    twice = _dsinks_verdict(case, x, true, reference, t + 2.0 * (reference.dsinks - t))
    assert twice.passed, twice.describe()
    off = _dsinks_verdict(case, x, true, reference, t + 3 * SPACING)  # three spacings on every head
    assert not off.passed and off.ratio > 2, off.describe()


def test_a_normal_sized_dsinks_is_judged_as_before():
    _, _, true, reference = _case("normal")
    t = true.dsinks
    assert float(t.abs().min()) > 1e-2
    generic = GENERIC_ROUNDING * unit_roundoff(torch.bfloat16) * float(t.norm())
    assert abs(one_rounding(t, torch.bfloat16) - generic) <= 1e-12 * generic  # the relative rule alone
    class_error = max(float((reference.dsinks - t).norm()), generic)
    direction = (reference.dsinks - t) / float((reference.dsinks - t).norm())
    for times, passes in ((1.99, True), (2.05, False)):
        verdict = judge_class("dsinks", t + times * class_error * direction, t, reference.dsinks, k=2.0,
                              dtype=torch.bfloat16)
        assert verdict.passed is passes, verdict.describe()
