"""tests/time_limits.py: a subprocess gets the rest of its test's pytest-timeout budget, and no
test waits a fixed number of seconds that a slow or busy machine trips (issue 24)."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

import time_limits

TESTS = os.path.dirname(os.path.abspath(__file__))


needs_pytest_timeout = pytest.mark.skipif(importlib.util.find_spec("pytest_timeout") is None,
                                          reason="pytest-timeout is not installed")


class FakeClock:
    """time.monotonic() that moves only when the test says so: a stall of the machine between
    two readings changes nothing."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@needs_pytest_timeout
@pytest.mark.timeout(200)
def test_the_tests_budget_is_recorded_as_it_starts():
    # conftest.py's hook started this test's budget: 200 s from a moment already past
    left = time_limits.hang_limit()
    assert left is not None and 0 < left <= 200 - time_limits.MARGIN_S


def test_a_subprocess_gets_the_rest_of_the_tests_budget(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time_limits, "time", clock)
    monkeypatch.setattr(time_limits, "_deadline", None)
    time_limits.start_budget(200)
    assert time_limits.hang_limit() == 200 - time_limits.MARGIN_S
    clock.now += 0.2
    assert time_limits.hang_limit() == pytest.approx(200 - time_limits.MARGIN_S - 0.2)
    assert time_limits.hang_deadline() == clock.now + time_limits.hang_limit()
    clock.now += 200  # past the budget: still a positive limit, so a child gets to start
    assert time_limits.hang_limit() == 1.0


@needs_pytest_timeout
def test_slow_tests_get_a_larger_budget(request, monkeypatch):
    """A test that trains for minutes must not hit the hang budget of a quick one on a slow
    machine: the slow ones get SLOW_BUDGET_FACTOR x pyproject's timeout (conftest.py's hook,
    on stand-in items), unless the user or the test chose a timeout."""
    import conftest

    class Item:
        def __init__(self, *marks):
            self.marks = {m.name: m for m in marks}

        def get_closest_marker(self, name):
            return self.marks.get(name)

        def add_marker(self, mark):
            self.marks[mark.name] = mark.mark

    monkeypatch.delenv("PYTEST_TIMEOUT", raising=False)
    monkeypatch.setattr(request.config.option, "timeout", None)
    quick, slow, own = Item(), Item(pytest.mark.slow.mark), \
        Item(pytest.mark.slow.mark, pytest.mark.timeout(5).mark)
    conftest.pytest_collection_modifyitems(request.config, [quick, slow, own])
    base = float(request.config.getini("timeout"))
    assert base >= 60 and quick.get_closest_marker("timeout") is None
    assert slow.get_closest_marker("timeout").args == (conftest.SLOW_BUDGET_FACTOR * base,)
    assert own.get_closest_marker("timeout").args == (5,)
    monkeypatch.setenv("PYTEST_TIMEOUT", "60")  # the user's choice wins
    later = Item(pytest.mark.slow.mark)
    conftest.pytest_collection_modifyitems(request.config, [later])
    assert later.get_closest_marker("timeout") is None


def test_without_a_budget_there_is_no_limit(monkeypatch):
    monkeypatch.setattr(time_limits, "time", FakeClock())
    monkeypatch.setattr(time_limits, "_deadline", None)
    time_limits.start_budget(None)
    assert time_limits.hang_limit() is None and time_limits.hang_deadline() == float("inf")
    time_limits.start_budget(10)  # less left than the margin: still a positive limit
    assert time_limits.hang_limit() == 1.0


def test_no_test_waits_a_fixed_number_of_seconds():
    """`timeout=300` on a subprocess, `deadline = time.time() + 60`: each failed `make test` on
    a busy or bf16-less machine (issue 24).  Limits come from time_limits, or are scaled from a
    time measured in the test."""
    fixed = re.compile(r"timeout=\d|(?:time|monotonic|perf_counter)\(\) \+ \d|"
                       r"(?:time|monotonic|perf_counter)\(\) - \w+ < \d")
    found = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py") and name != os.path.basename(__file__):
            with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                          if fixed.search(line)]
    assert not found, "\n".join(found)
