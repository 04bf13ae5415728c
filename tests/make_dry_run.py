"""The commands a Makefile target runs, as `make -n` expands them (variables, `$(if ...)`), for
the tests that hold the README and the demo to the Makefile."""

import os
import shlex
import subprocess

from train_support import REPO


def make_commands(target: str, *variables: str) -> list:
    """[words] of each command that `make TARGET VARIABLES...` runs from .venv/bin/ (the
    project's console scripts, with that prefix taken off), in order. The install step is left
    out (`-o`: taken as made, whether or not .venv exists), and so are make's own `echo`s."""
    r = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", target,
                        *variables], cwd=REPO, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert r.returncode == 0, r.stderr
    prefix = ".venv/bin/"
    return [shlex.split(line[len(prefix):]) for line in r.stdout.splitlines()
            if line.startswith(prefix)]
