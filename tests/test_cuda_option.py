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


def test_cuda_option_skips_every_cpu_test():
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v",
                           "-rs", "--cuda", CPU_FILE], cwd=os.path.dirname(TESTS),
                          capture_output=True, text=True, timeout=time_limits.hang_limit())
    # -v: one line per collected test, each with its outcome (the exit status is left alone:
    # a run in which nothing ran may well say so by its status)
    outcomes = re.findall(r"^tests/test_time_limits\.py::\S+ (\w+)", done.stdout, re.M)
    assert len(outcomes) >= 3 and set(outcomes) == {"SKIPPED"}, done.stdout + done.stderr
    skipped = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\] .*a CPU test: run without "
                                               r"--cuda", done.stdout))
    assert skipped == len(outcomes), done.stdout
