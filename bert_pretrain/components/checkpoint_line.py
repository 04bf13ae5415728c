"""A run's checkpoint line: the chain of checkpoints its current history went through, as an
object with its rules stated once.  The checkpoint manager (checkpoint_manager.py) decides what a
resume and a save do to it; this module knows how it is recorded and how it is read back.

The line has
- a *root*: what its first checkpoint continues: None for a run that started from scratch, or
  the absolute path of another run's checkpoint this run was resumed from;
- its *names*: its checkpoints in `<run_dir>/checkpoints/`, oldest first;
- a *pointer*, `checkpoints/latest.json`, written atomically:

      {"format": 1, "root": null, "line": [{"name": "step-00000004", "state_sha256": "..."}]}

Invariants (tests/test_checkpoint_line.py kills a save at every one of its writes and checks
them):
1. Every checkpoint's trainer_state.json names its `parent`: the previous name of its line, or
   the line's root for the first one.
2. A save renames its checkpoint into place (atomic), then rewrites the pointer.  So the line is
   always the pointer's names that still exist, followed by the chain of children of its *end*
   (its last name, or its root while it has none): a save killed between the two is found, on
   a fresh line, a branched one and one that starts in another run alike.
3. Without a usable pointer (an older bert-train, a lost or damaged file) the line is every
   complete-looking checkpoint, by step.
4. A re-save of the same step moves the old copy to `.old-step-XXXXXXXX` first: while its
   `step-XXXXXXXX` is missing (killed between the two renames) that copy *is* the checkpoint
   (read in its place; repair puts it back).  The names a save leaves behind all start with a
   dot; nothing else in checkpoints/ is ever its.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import checkpoint as ckpt
from ..errors import CheckpointError

POINTER = "latest.json"
POINTER_FORMAT = 1
OLD_PREFIX = ckpt.OLD_PREFIX  # a re-save's previous copy (checkpoint.write_checkpoint)
_UNKNOWN = object()


@dataclass
class Line:
    names: list = field(default_factory=list)
    """Checkpoints in this run's checkpoints/, oldest first."""
    root: Optional[str] = None
    """What the first one continues: None (a fresh start) or another run's checkpoint."""

    @property
    def end(self) -> Optional[str]:
        """What the next save continues: the newest name, or the root."""
        return self.names[-1] if self.names else self.root


class CheckpointLine:
    """The line of the run whose checkpoints are in `folder` (`<run_dir>/checkpoints`)."""

    def __init__(self, folder: str, warn: Callable[[str], None]):
        self.folder, self.warn = folder, warn

    # ------------------------------------------------------------------ one checkpoint
    def path(self, name: str) -> str:
        """The directory of checkpoint `name`; its `.old-` copy while `name` is missing
        (invariant 4)."""
        path = os.path.join(self.folder, name)
        old = os.path.join(self.folder, OLD_PREFIX + name)
        if not os.path.isdir(path) and os.path.isdir(old):
            return old
        return path

    def exists(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.path(name), ckpt.STATE_JSON))

    def parent_of(self, name: str):
        """The checkpoint `name` continues (None: a fresh start); an unreadable state's parent
        is unknown and matches nothing."""
        try:
            return ckpt.read_train_state(self.path(name), verify=False).get("parent")
        except CheckpointError:
            return _UNKNOWN

    def names(self) -> list:
        """Every complete-looking checkpoint (not yet verified), by step."""
        if not os.path.isdir(self.folder):
            return []
        found = set()
        for entry in os.listdir(self.folder):
            name = entry[len(OLD_PREFIX):] if entry.startswith(OLD_PREFIX) else entry
            if ckpt.STEP_DIR.match(name) and self.exists(name):
                found.add(name)
        return sorted(found, key=ckpt.step_of)

    # ------------------------------------------------------------------ the line
    def read(self) -> Line:
        """The line as it stands (invariants 2 and 3)."""
        pointer = self._read_pointer()
        if pointer is None:
            return Line(self.names())
        entries, root, has_root = pointer
        line = Line([e["name"] for e in entries if self.exists(e["name"])], root)
        if not line.names and not has_root:
            # a pointer of an older bert-train, which did not record the root: an empty line
            # is read as the checkpoints by step (what a missing pointer gives)
            return Line(self.names())
        present = self.names()
        while True:
            children = [n for n in present if n not in line.names and
                        self.parent_of(n) == line.end]
            if not children:
                return line
            line.names.append(max(children, key=ckpt.step_of))

    def write(self, line: Line) -> None:
        """Record `line` as the pointer (atomically)."""
        entries = []
        for name in line.names:
            try:
                sha = ckpt.read_train_state(self.path(name), verify=False).get("state_sha256")
            except CheckpointError:
                sha = None
            entries.append({"name": name, "state_sha256": sha})
        os.makedirs(self.folder, exist_ok=True)
        ckpt.write_json_atomic(os.path.join(self.folder, POINTER),
                               {"format": POINTER_FORMAT, "root": line.root, "line": entries})

    def has_pointer(self) -> bool:
        return os.path.lexists(os.path.join(self.folder, POINTER))

    def _read_pointer(self) -> Optional[tuple]:
        """(entries, root, whether the root was recorded), or None without a usable pointer."""
        file = os.path.join(self.folder, POINTER)
        if not os.path.lexists(file):
            return None
        try:
            if not os.path.isfile(file) or os.path.islink(file) or \
                    os.path.getsize(file) > ckpt.MAX_STATE_BYTES:
                raise ValueError("not a regular file of a sensible size")
            with open(file, encoding="utf-8") as f:
                content = json.load(f)
            entries, root = content["line"], content.get("root")
            if content.get("format") != POINTER_FORMAT or not isinstance(entries, list) or \
                    not all(isinstance(e, dict) and isinstance(e.get("name"), str) and
                            ckpt.STEP_DIR.match(e["name"]) for e in entries) or \
                    not (root is None or isinstance(root, str)):
                raise ValueError("unexpected content")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.warn(f"{file} is unreadable ({str(exc).splitlines()[0]}); "
                      f"finding the newest checkpoint by step number instead")
            return None
        return entries, root, "root" in content
