"""A write that failed because the disk is full, however the writer reported it.

Python's own writes raise OSError(ENOSPC or EDQUOT); numpy's `tofile` (under np.save) raises a
bare OSError "N requested and M written"; safetensors raises SafetensorError("... No space left
on device ..." / "StorageFull"); torch.save raises RuntimeError("... file write failed").  Each
then reads as a bug (a traceback, or "OSError: fix the cause") where the user's fix is to free
space.  bert-train's checkpoint save and bert-prep's shard writer say so in one line.
"""

from __future__ import annotations

import errno
import re
import shutil

_FULL = re.compile(r"No space left on device|Disk quota exceeded|StorageFull|QuotaExceeded|"
                   r"\d+ requested and \d+ written")
# torch.save's writer keeps no errno: a failed write there is a full disk when the disk is.
_WRITE_FAILED = re.compile(r"file write failed|failed writing file")
NEARLY_FULL_BYTES = 64 * 2**20


def free_bytes(folder: str):
    """Free space on `folder`'s disk for this user (None if it cannot be read)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, folder: str) -> bool:
    """Whether `exc`, raised writing into `folder`, means the disk (or the quota) is full."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if _FULL.search(text):
        return True
    free = free_bytes(folder)
    return bool(_WRITE_FAILED.search(text)) and free is not None and free < NEARLY_FULL_BYTES


def free_text(folder: str) -> str:
    """'N MB free on the disk of <folder>' (the folder alone if its disk cannot be read)."""
    free = free_bytes(folder)
    return (f"{free / 2**20:.0f} MB free on the disk of {folder}" if free is not None
            else f"the disk of {folder}")
