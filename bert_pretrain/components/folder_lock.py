"""One writer per output folder: bert-train's run folder, bert-prep's output_dir.

Two commands writing one folder at once would each report success over the other's files.  The
writer holds an exclusive `flock` on a lock file inside the folder for as long as it runs; a
second command finds it held and stops with one line.  The kernel releases the lock when its
process ends in any way (kill -9 included), so a restart is never blocked by a stale lock, and
the file left behind (empty, or the pid and stamp of a killed holder) means nothing by itself;
it is never deleted, as a deleted lock file lets a third command lock a new one while the
second still holds the old.  (flock over NFS is only as good as the NFS client: on such a
folder two hosts must still not be pointed at one run.)  bert-train's rank 0 stamps the file
with a random token that every other process must read back (run_setup.check_shared_run_dir):
a run folder that is not the same folder on every machine is refused at start-up.

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

    def stamp(self) -> str:
        """Write a new random token into the lock file, after the holder's pid, and return it:
        a process on another machine that reads it back from its own path to the folder sees
        the same folder (`sees_stamp`)."""
        import uuid

        token = uuid.uuid4().hex
        text = f"{os.getpid()}\n{token}\n".encode()
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text, 0)
            try:
                os.fsync(self.fd)  # (an NFS client sends it to the server now, for the others)
            except OSError:
                pass  # (a file system that cannot: the others' read tells)
        else:  # (a file system without flock: the file is there all the same)
            with open(self.path, "wb") as f:
                f.write(text)
        return token

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
    text = text.splitlines()[0] if text else ""  # (the pid; a stamp may follow)
    return f" (process {text})" if text.isdigit() else ""


def sees_stamp(folder: str, token: str, name: str = LOCK_FILE) -> bool:
    """Whether `folder`'s lock file, read from this process, holds `token` (FolderLock.stamp)."""
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return token.encode() in f.read(256)
    except OSError:
        return False


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
