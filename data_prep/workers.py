"""What every worker process of bert-prep (tokenization, shards) sets up first.

* Ctrl-C: the terminal sends SIGINT to the whole process group.  Workers ignore it, so only the
  main process handles it (one line, exit 130, the pool terminated) instead of every worker
  printing its own KeyboardInterrupt traceback.
* kill -9 of the main process: on Linux, a worker is killed with it (PR_SET_PDEATHSIG), so no
  orphan goes on writing into the output dir while the user re-runs the command.
"""
from __future__ import annotations

import os
import signal

_PR_SET_PDEATHSIG = 1


def init_worker_process() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):      # not Linux: orphans then exit on their closed pipe
        return
    if os.getppid() != parent:             # the parent died before prctl took effect
        os._exit(1)
