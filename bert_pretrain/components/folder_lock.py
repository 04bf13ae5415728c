"""One writer per output folder: bert-train's run folder, bert-prep's output_dir.

Two commands writing one folder at once would each report success over the other's files.  The
writer holds an exclusive `flock` on a lock file inside the folder for as long as it runs; a
second command finds it held and stops with one line.  The kernel releases the lock when its
process ends in any way (kill -9 included), so a restart is never blocked by a stale lock, and
the file left behind (empty, or the pid of a killed holder) means nothing by itself; it is never
deleted, as a deleted lock file lets a third command lock a new one while the second still
holds the old.  (flock over NFS is only as good as the NFS
client: on such a folder two hosts must still not be pointed at one run.)

    lock = lock_folder(run_dir, "bert-train")   # raises FolderBusy: another one writes it
    ...
    lock.release()                              # or let the process end
"""

from __future__ import annotations

import fcntl
import os

from ..errors import UserError

LOCK_FILE = ".lock"


class FolderBusy(UserError):
    """Another live process writes the folder."""


class FolderLock:
    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            try:  # empty again: a folder's files stay the same bytes from run to run
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)  # (closing the descriptor drops the flock)
            self.fd = None

    def __del__(self):  # a holder dropped without release() (a test's trainer never fitted)
        self.release()


def first_missing(path: str):
    """The outermost folder of `path` that does not exist yet (None: it all exists): what a
    command that makes `path` and is then refused removes to leave nothing behind."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (process {text})" if text.isdigit() else ""


def lock_folder(folder: str, command: str, name: str = LOCK_FILE) -> FolderLock:
    """Hold `folder`'s lock (creating the folder and the lock file if needed) or raise
    FolderBusy naming the process that holds it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise FolderBusy(f"{folder} is being written by another {command}{holder}; wait for it "
                         f"to finish, or choose another folder") from None
    except OSError:  # a file system without flock: run unguarded rather than not at all
        os.close(fd)
        return FolderLock(None, path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the other's message
    return FolderLock(fd, path)
