"""How long a test waits for a subprocess (or for an event in one) before it calls it hung.

No test here bounds work by a fixed number of seconds: a laptop, a shared CI runner, a CPU that
emulates bf16 or a machine busy with other work runs the same steps several times slower than
an idle development machine, and a limit tuned on the latter fails there (issue 24: four
subprocess timeouts failed `make test` on a busy 2-core machine).  Work is bounded by steps and
events; the wall clock only ends a test whose process hangs.

One budget per test does that: pytest-timeout's (`timeout` in pyproject.toml, `--timeout`,
PYTEST_TIMEOUT, or a `timeout` marker), recorded by conftest.py when the test starts.
`hang_limit()` gives a subprocess what is left of it, less a margin, so that a hung child is
killed with the test's own failure message (and its output) before pytest-timeout dumps
stacks.  Without pytest-timeout there is no limit, as in a plain pytest run.
"""
from __future__ import annotations

import time

# The test's own assertions and clean-up after its last subprocess, and the gap between
# the child being killed and pytest-timeout firing.
MARGIN_S = 30.0
_deadline: float | None = None


def start_budget(seconds: float | None) -> None:
    """Called by conftest.py as each test's pytest-timeout timer starts."""
    global _deadline
    _deadline = None if not seconds else time.monotonic() + seconds


def hang_limit() -> float | None:
    """Seconds a subprocess may still take before the test calls it hung (None: no limit)."""
    if _deadline is None:
        return None
    return max(_deadline - time.monotonic() - MARGIN_S, 1.0)


def hang_deadline() -> float:
    """The time.monotonic() by which an awaited event counts as never coming (inf: none)."""
    left = hang_limit()
    return float("inf") if left is None else time.monotonic() + left
