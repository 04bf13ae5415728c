"""`pytest --cuda` (make test-cuda) runs the GPU tests only: every CPU test is skipped there,
because it asserts CPU results and the GPU is no longer hidden (tests/conftest.py).  Checked
in a pytest subprocess, which needs no GPU: CPU tests are skipped whatever the machine has."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import time_limits

TESTS = os.path.dirname(os.path.abspath(__file__))
# Quick CPU tests (none marked cuda): what --cuda must skip.
CPU_FILE = os.path.join(TESTS, "test_time_limits.py")


def _pytest(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           *args, CPU_FILE], cwd=os.path.dirname(TESTS), capture_output=True,
                          text=True, timeout=time_limits.hang_limit())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_cuda_option_skips_every_cpu_test():
    collected = _pytest("--collect-only")
    count = int(re.search(r"(\d+) tests? collected", collected).group(1))
    assert count >= 3
    out = _pytest("--cuda", "-rs")
    assert re.search(rf"\b{count} skipped\b", out), out
    assert "passed" not in out and "failed" not in out, out
    skipped = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\] .*a CPU test: run without "
                                               r"--cuda", out))
    assert skipped == count, out
