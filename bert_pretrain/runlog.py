"""The run's console record: every message bert-train prints also goes, timestamped, to
`<run_dir>/train.log`, so a run that was watched by nobody can be read afterwards.

Messages go through the `bert_pretrain` logger. On the main process it prints them as they are
(information to stdout, warnings to stderr; through tqdm, so a progress bar is not torn) and
appends them to train.log; on the other processes it prints only warnings and errors, prefixed
with the rank.
"""

import logging
import os
import sys

LOGGER = "bert_pretrain"


class _TqdmConsole(logging.Handler):
    """Information to stdout, warnings and errors to stderr, around any open progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # never let logging stop training
            self.handleError(record)


def open_run_log(run_dir: str, main: bool, rank: int = 0) -> logging.Logger:
    """Set up the `bert_pretrain` logger for one run (replacing a previous run's handlers)."""
    log = logging.getLogger(LOGGER)
    close_run_log()
    log.setLevel(logging.INFO)
    log.propagate = False  # Hydra's root handlers would print every line a second time
    console = _TqdmConsole()
    if main:
        console.setFormatter(logging.Formatter("%(message)s"))
        os.makedirs(run_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(run_dir, "train.log"), encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file)
    else:
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    log.addHandler(console)
    return log


def close_run_log() -> None:
    log = logging.getLogger(LOGGER)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
