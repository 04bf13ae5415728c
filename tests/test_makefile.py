"""The Makefile's install steps: `make demo` installs the project, the test targets add the test
extras, and each is done once and again only when pyproject.toml changes, in whichever order the
targets run. Run with a stand-in .venv whose python and console scripts only log their
arguments, so that make's own decisions are what is tested, in milliseconds."""

import os
import shutil
import stat
import subprocess
import time

import pytest

from train_support import REPO

LOGGER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"
"""
TORCH = ["TORCH_SPEC=torch==2.13.0", "TORCH_INDEX="]  # the defaults, whatever the environment says


@pytest.fixture
def checkout(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "bert-prep", "bert-train", "bert-predict"):
        (bin_dir / name).write_text(LOGGER)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return tmp_path


def run_make(checkout, *args) -> str:
    """Run make (from a clean environment: no outer make's flags); its standard output."""
    r = subprocess.run(["make", "--no-print-directory", *args, *TORCH], cwd=checkout,
                       capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def make(checkout, *args) -> list:
    """Run make; the calls it made through .venv/bin."""
    log = checkout / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    run_make(checkout, *args)
    return log.read_text().splitlines() if log.exists() else []


def pip_installs(calls) -> list:
    return [c.split("install", 1)[1].strip() for c in calls if c.startswith("python -m pip install")
            and "--upgrade pip" not in c]


def age(checkout, *names, seconds=100):
    past = time.time() - seconds
    for name in names:
        os.utime(checkout / name, (past, past))


def test_demo_installs_the_project_without_the_test_extras_and_test_adds_them(checkout):
    assert pip_installs(make(checkout, "install")) == ['torch==2.13.0', "-e ."]
    calls = make(checkout, "demo")
    assert pip_installs(calls) == []
    assert [c.split()[0] for c in calls] == ["bert-prep", "bert-train", "bert-predict"]
    calls = make(checkout, "test")
    assert pip_installs(calls) == ['-e .[test]'] and calls[-1].startswith("python -m pytest")
    assert pip_installs(make(checkout, "test")) == []  # done once
    assert pip_installs(make(checkout, "demo")) == []


def test_test_first_installs_the_project_then_the_extras(checkout):
    assert pip_installs(make(checkout, "test-slow")) == ['torch==2.13.0', "-e .",
                                                         '-e .[test]']
    assert pip_installs(make(checkout, "demo")) == []


def test_a_changed_pyproject_reinstalls_what_each_target_needs(checkout):
    make(checkout, "install-test")
    age(checkout, ".venv/.installed", ".venv/.installed-test")
    os.utime(checkout / "pyproject.toml")  # edited now
    assert pip_installs(make(checkout, "demo")) == ['torch==2.13.0', "-e ."]
    # the base install was redone since the extras were added: they are added again
    assert pip_installs(make(checkout, "test")) == ['-e .[test]']
    assert pip_installs(make(checkout, "test")) == []


def test_the_demo_says_what_it_installs_and_pip_is_not_quiet(checkout):
    out = run_make(checkout, "install-test")
    assert "190 MB download" in out and "~1.0 GB installed" in out and "~130 MB" in out
    # TORCH_INDEX empty: the CPU build's size and what Linux's default (CUDA) build adds
    assert "~1.8 GB installed with torch's CPU build; on Linux PyPI's default CUDA build adds " \
           "several GB" in out
    installs = [line for line in out.splitlines() if " -m pip install" in line
                and "--upgrade pip" not in line]
    assert len(installs) == 3 and not any(" -q" in line for line in installs)


@pytest.mark.parametrize("cuda", [False, True], ids=["no-gpu", "gpu"])
def test_test_cuda_without_a_gpu_fails_saying_nothing_ran(checkout, cuda):
    """Without CUDA every GPU test would be skipped and pytest would exit 0 (a pass, to the
    eye): make test-cuda fails before pytest, saying so. The stand-in python answers the CUDA
    question as the machine would."""
    python = checkout / ".venv" / "bin" / "python"
    python.write_text(LOGGER + f'case "$*" in *cuda.is_available*) exit {0 if cuda else 1};; '
                               f'esac\n')
    make(checkout, "install-test")  # the install steps are not what is tested here
    r = subprocess.run(["make", "--no-print-directory", "test-cuda", *TORCH], cwd=checkout,
                       capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    calls = (checkout / ".venv" / "calls.log").read_text()
    if cuda:
        assert r.returncode == 0 and "python -m pytest -q --cuda -m cuda" in calls, r.stderr
    else:
        assert r.returncode != 0 and "-m pytest" not in calls
        assert "no GPU test ran (this is not a pass)" in r.stderr


@pytest.mark.parametrize("target", ["test", "test-slow", "test-all"])
def test_the_test_targets_run_in_test_workers_processes(checkout, target):
    """CI's run is `make test` then `make test-slow`: both in 2 xdist processes by default (the
    suite's time halves on 2 cores), TEST_WORKERS=N for another count, 0 for one process."""
    make(checkout, "install-test")
    pytest_call = [c for c in make(checkout, target) if c.startswith("python -m pytest")]
    assert len(pytest_call) == 1 and " -n 2" in pytest_call[0]
    pytest_call = [c for c in make(checkout, target, "TEST_WORKERS=4")
                   if c.startswith("python -m pytest")]
    assert " -n 4" in pytest_call[0]
    pytest_call = [c for c in make(checkout, target, "TEST_WORKERS=0")
                   if c.startswith("python -m pytest")]
    assert " -n " not in pytest_call[0] and "-p no:xdist" in pytest_call[0]
