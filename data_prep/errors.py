"""The one error type of data prep.

Every problem a user can fix (a missing file, a bad setting, a vocab without special tokens, a
full disk) is raised as a `PrepError` with a one-line message that names the problem and the
fix; the `bert-prep` entry point prints it as ``bert-prep: error: <message>`` and exits with
status 2, without a traceback.  Anything else escaping is a bug in bert-prep, and keeps its
traceback.
"""
from __future__ import annotations

import errno

RESUME_HINT = "re-run the same command to resume (finished steps are kept)"


class PrepError(Exception):
    """A user-fixable problem with the corpus, the tokenizer or the prep config."""


class PrepIOError(PrepError):
    """A read or write that failed (disk full, permissions): the work done so far is kept, so
    that the same command resumes once the cause is fixed."""


def os_error(exc: OSError, doing: str, folder: str = None) -> PrepIOError:
    """One line for a failed read or write: what was being done, the system's reason, the fix.
    `doing` names the step, e.g. "writing train/shard-00003"; `folder`: where it was written
    (a full disk is then named as such, with the folder, whatever the writer's error said)."""
    from bert_pretrain.components.disk_space import free_text, is_disk_full

    where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in doing else ""
    reason = exc.strerror or type(exc).__name__
    if folder is not None and is_disk_full(exc, folder):  # (numpy's short write has no errno)
        where, reason = "", "No space left on device"
        fix = (f"free some space ({free_text(folder)}) or choose another output_dir, then "
               f"{RESUME_HINT}")
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free some space (or choose another output_dir), then {RESUME_HINT}"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "choose an output_dir you can write to, or fix the permissions"
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG):
        reason = {errno.ENOTDIR: "a part of the path is a file, not a directory"}.get(
            exc.errno, reason)
        fix = "choose another output_dir"
    else:
        fix = f"fix the cause, then {RESUME_HINT}"
    return PrepIOError(f"{doing}{where}: {reason}: {fix}")
