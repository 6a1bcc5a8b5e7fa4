"""A pytest plugin: the CPU seconds each test costs, its process and its descendants', from /proc.

Wall time on a shared machine says little; CPU seconds do not depend on the load. For each test
(setup, call and teardown together) it takes user + system CPU of the pytest process (an xdist
worker under -n) and of every live descendant (the local rings' processes, the fork server), and of
the children they have reaped (cutime, cstime), before and after; the difference is the test's.
A descendant that dies between the two readings is counted through its parent's reaped time,
so a ring pool started and closed inside one test is counted too. (A process that leaves the tree,
re-parented to init, takes its CPU with it; module- and session-scoped fixtures are charged to the
first test that uses them, as the time they take is.)

    .venv/bin/python -m pytest suites -q -n auto -m "not cli" -p benchmarks.test_cpu
    ... --cpu-top 30 --cpu-out /tmp/cpu.tsv

At the end, the controller (or the single process) prints the top N test functions by cpu-s
(tests of one function summed, parametrizations together), then the top N single tests, and the
total; --cpu-out writes one line per test (nodeid, cpu-s) for comparing two runs. Linux only;
no psutil (the project does not install it). Under xdist the workers send their figures to the
controller in the test report's user_properties.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_START = pytest.StashKey[float]()


def _stat(pid: int) -> tuple[float, float]:
    """(own user+system, reaped children's user+system) CPU of one process in seconds, or zeros."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    fields = text[text.rindex(")") + 2:].split()  # fields from the third (state) on
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / _TICK, (cutime + cstime) / _TICK


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_cpu(root: int | None = None) -> float:
    """The CPU seconds of a process, its live descendants and the children each has reaped."""
    total, todo, seen = 0.0, [root or os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        own, reaped = _stat(pid)
        total += own + reaped
        todo += _children(pid)
    return total


def pytest_addoption(parser):
    group = parser.getgroup("cpu", "CPU seconds per test (benchmarks.test_cpu)")
    group.addoption("--cpu-top", type=int, default=20, help="how many test functions and tests to list")
    group.addoption("--cpu-out", default=None, help="write nodeid<TAB>cpu-s for every test to this file")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = tree_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _START in item.stash:
        cpu = tree_cpu() - item.stash[_START]
        outcome.get_result().user_properties.append(("cpu_s", cpu))


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == "cpu_s":
            _SEEN[report.nodeid] = value


_SEEN: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    seconds = _SEEN
    if not seconds:
        return
    top = config.getoption("cpu_top")
    functions, counts = defaultdict(float), defaultdict(int)
    for nodeid, cpu in seconds.items():
        name = nodeid.split("[")[0].replace("suites/", "")
        functions[name] += cpu
        counts[name] += 1
    write = terminalreporter.write_line
    write(f"\nCPU seconds per test function (process and descendants), top {top}:")
    write(f"{'cpu-s':>8} {'tests':>6}  test function")
    for name, cpu in sorted(functions.items(), key=lambda kv: -kv[1])[:top]:
        write(f"{cpu:8.1f} {counts[name]:6d}  {name}")
    write(f"\nsingle tests, top {top}:")
    for nodeid, cpu in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        write(f"{cpu:8.2f}  {nodeid}")
    write(f"\ntotal {sum(seconds.values()):.1f} cpu-s in {len(seconds)} tests")
    out = config.getoption("cpu_out")
    if out:
        Path(out).write_text("".join(f"{n}\t{c:.3f}\n" for n, c in sorted(seconds.items())))
