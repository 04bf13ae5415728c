"""The checkpoint policy of a run, in one place: which checkpoint the run continues from, what a
resume from an older checkpoint does to the newer ones, which checkpoints are kept.

A run's checkpoints are `<run_dir>/checkpoints/step-XXXXXXXX/` (checkpoint.py writes and reads
one).  The run's *line* is the chain of checkpoints its current history went through:
checkpoint_line.py records it (`checkpoints/latest.json`, each checkpoint's `parent`) and states
its invariants.  "Newest" means the end of the line, not the highest step number: after a resume
from step 4 of a run that had reached step 12, the line is 4 -> 8 -> 9, and step 9 is newest.

- resume=auto continues from the newest checkpoint of the line that verifies; damaged ones are
  skipped with a warning naming each.
- Any resume from a checkpoint that is not the newest (an explicit older one, or the fallback past
  a damaged one) starts a branch: the checkpoints newer than it are moved to
  `checkpoints/abandoned-<UTC time>/` with a copy of metrics.jsonl, never deleted, and one
  warning line says which and where.  A resume from another run's checkpoint branches into this
  run directory the same way, and its metrics.jsonl starts with that run's history up to there.
- Retention keeps the `keep_last_k` newest checkpoints of the line that verify, and never the one
  just written; checkpoints outside the line are never deleted.
- Leftovers of interrupted saves are repaired before anything is searched: a `.old-step-N` whose
  `step-N` is missing (killed between the two renames of a re-save) is put back; the other names
  a save leaves behind (`.tmp-step-*`, `.del-step-*`, `.old-step-*`, the pointer's temporary
  file) are removed.  Nothing else in checkpoints/ is touched: a user's `step-N.old` backup
  stays.

Every process calls `save`; only the main process (rank 0) moves, deletes or writes the pointer.
"""

import os
import shutil
import sys
import time
from typing import Callable, Optional

from . import checkpoint as ckpt
from .checkpoint_line import OLD_PREFIX, POINTER, CheckpointLine, Line
from ..errors import CheckpointError, ConfigError

ABANDONED_PREFIX = "abandoned-"
# What an interrupted save, deletion or pointer write leaves behind (all dot names).
LEFTOVER_PREFIXES = (".tmp-step-", ".del-step-", OLD_PREFIX, POINTER + ".tmp-")


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str) -> list:
    """Complete-looking checkpoints directly in the run's checkpoints/ (not yet verified), by
    step, as (step, path)."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        step = ckpt.step_of(name) if ckpt.STEP_DIR.match(name) else None
        path = os.path.join(root, name)
        if step is not None and os.path.isfile(os.path.join(path, ckpt.STATE_JSON)):
            found.append((step, path))
    return sorted(found)


_warned: set = set()


def _warn_once(message: str) -> None:
    """Warnings from code every rank runs: print once, from the main process (RANK is set by
    torchrun / accelerate launch)."""
    if os.environ.get("RANK", "0") == "0" and message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


class CheckpointManager:
    def __init__(self, run_dir: str, keep_last_k: int = 0, rank: int = 0,
                 barrier: Callable[[], None] = lambda: None,
                 warn: Optional[Callable[[str], None]] = None):
        self.run_dir, self.root = run_dir, checkpoints_root(run_dir)
        self.keep_last_k, self.rank, self.barrier = keep_last_k, rank, barrier
        self.warn = warn or _warn_once
        """Called with each warning (one line, without a program prefix)."""
        self.chain = CheckpointLine(self.root, self.warn)  # how the line is recorded and read
        self.line: list = []          # names in checkpoints/, oldest first
        self.line_root: Optional[str] = None  # what the line's first checkpoint continues
        self.parent: Optional[str] = None  # what the next save continues
        self.damaged: set = set()     # names found damaged by `latest`
        self._begun = False

    # ------------------------------------------------------------------ reading
    def _path(self, name: str) -> str:
        return self.chain.path(name)

    def _names(self) -> list:
        return self.chain.names()

    def current_line(self) -> list:
        """The line's names, oldest first (checkpoint_line.py: the pointer's, extended by a
        save that was killed before the pointer was rewritten; without a pointer, every
        checkpoint by step)."""
        return self.chain.read().names

    def latest(self, verify: bool = True) -> Optional[str]:
        """The newest checkpoint of the run's line whose files verify (damaged ones are skipped,
        each named in a warning); verify=False: the line's end as it stands.

        None when the run has no checkpoint; CheckpointError when it has some and all are damaged
        (starting over would silently discard the run)."""
        line = self.current_line()
        if not verify:
            return self._path(line[-1]) if line else None
        for name in reversed(line):
            path = self._path(name)
            try:
                ckpt.verify_checkpoint(path)
                return path
            except CheckpointError as exc:
                self.damaged.add(name)
                self.warn(f"skipping damaged checkpoint {path}: {exc}; "
                          f"falling back to an earlier one")
        if line:
            raise CheckpointError(
                f"all {len(line)} checkpoint(s) in {self.root} are damaged (see the warnings "
                f"above); restore them from a copy, or move them away to start over")
        return None

    # ------------------------------------------------------------------ resuming
    def repair(self) -> None:
        """Main process, before any search: remove what interrupted saves and deletions left
        (never a checkpoint, never anything a save did not write); put back a `.old-step-N`
        whose `step-N` is missing (the only copy of that checkpoint)."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            legacy = name[:-len(".old")] if name.endswith(".old") else ""
            if ckpt.STEP_DIR.match(legacy) and \
                    not os.path.exists(os.path.join(self.root, legacy)):
                # Before .old-step-N, a re-save killed between its renames left step-N.old;
                # a user's backup is named alike, so it is said, never moved or read.
                self.warn(f"{path} has no {legacy} beside it: if it is a checkpoint an earlier "
                          f"version's interrupted re-save left, rename it to {legacy} to resume "
                          f"from it (it is left as it is)")
            if not name.startswith(LEFTOVER_PREFIXES):
                continue
            step_name = name[len(OLD_PREFIX):] if name.startswith(OLD_PREFIX) else None
            if step_name and ckpt.STEP_DIR.match(step_name) and \
                    not os.path.exists(os.path.join(self.root, step_name)):
                os.rename(path, os.path.join(self.root, step_name))
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)

    def find(self, resume: str) -> Optional[str]:
        """The checkpoint to resume from (resume = never | auto | a checkpoint path), verified,
        or None for a fresh run."""
        if resume == "never":
            if self._names():
                raise ConfigError(
                    f"{self.run_dir} already has checkpoints; continue it with resume=auto, or "
                    f"choose another run_dir (or name=...) for a fresh run")
            return None
        if resume == "auto":
            return self.latest()
        if not os.path.isdir(resume):
            raise CheckpointError(f"resume={resume}: no such checkpoint directory; use "
                                  f"resume=auto or a <run_dir>/checkpoints/step-XXXXXXXX path")
        ckpt.verify_checkpoint(resume)
        return resume

    def _inside(self, path: str) -> Optional[str]:
        """The name of `path` when it is a checkpoint directly in this run's checkpoints/."""
        if os.path.realpath(os.path.dirname(os.path.normpath(path))) != \
                os.path.realpath(self.root):
            return None
        name = os.path.basename(os.path.normpath(path))
        return name if ckpt.STEP_DIR.match(name) else None

    def begin(self, source: Optional[str]) -> list:
        """Main process: make the line the one that leads to `source` (the resumed checkpoint,
        or None for a fresh run). Checkpoints newer than `source` that are not on it are moved
        aside (a branch). Returns the names moved."""
        name = self._inside(source) if source else None
        before = self.chain.read()
        self._begun = True
        if name is not None:
            if name in before.names:
                self.line, self.line_root = before.names[:before.names.index(name) + 1], \
                    before.root
            else:
                self.line, self.line_root = [name], self.chain.parent_of(name)
            self.parent = name
        else:
            self.line, self.parent = [], (os.path.abspath(source) if source else None)
            self.line_root = self.parent
            if source:
                self._inherit_metrics(source)
        since = -1 if source is None else ckpt.read_train_state(source, verify=False)["step"]
        newer = [n for n in self._names() if n not in self.line and ckpt.step_of(n) > since]
        if newer:
            self._move_aside(newer, source)
        if source is not None or newer or self.chain.has_pointer():
            self._write_pointer()
        return newer

    def _inherit_metrics(self, source: str) -> None:
        """A branch from another run's checkpoint starts this run's metrics.jsonl with that
        run's history (the trainer cuts it back to the resumed step), so its curves show where
        it came from. The log beside the checkpoint: its run's, or the one an abandoned line
        was moved aside with."""
        mine = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.exists(mine):
            return
        folder = os.path.dirname(os.path.abspath(source))
        for log in (os.path.join(folder, "metrics.jsonl"),
                    os.path.join(os.path.dirname(folder), "metrics.jsonl")):
            if os.path.isfile(log) and not os.path.islink(log):
                os.makedirs(self.run_dir, exist_ok=True)
                shutil.copyfile(log, mine)
                return

    def _move_aside(self, names: list, source: Optional[str]) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = os.path.join(self.root, ABANDONED_PREFIX + stamp)
        n = 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(self.root, f"{ABANDONED_PREFIX}{stamp}-{n}")
        os.makedirs(target)
        for name in names:
            os.rename(self._path(name), os.path.join(target, name))
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.isfile(metrics):  # the abandoned line's log, before it is cut back
            shutil.copyfile(metrics, os.path.join(target, "metrics.jsonl"))
        ckpt._fsync_path(self.root)
        listed = ", ".join(f"{n} (damaged)" if n in self.damaged else n for n in names)
        self.warn(f"resuming from {source} starts a new line: the newer "
                  f"checkpoint(s) {listed} were moved to {target} (not deleted; metrics.jsonl "
                  f"copied there); move them back to continue that line instead")

    def _write_pointer(self) -> None:
        root = self.line_root if isinstance(self.line_root, str) else None
        self.chain.write(Line(self.line, root))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, **payload) -> str:
        """Write checkpoint `step` continuing the line (every process calls this), record it as
        the newest, then apply retention. Returns its path."""
        if self.rank == 0 and not self._begun:  # no begin(): continue the line as it stands
            line, self._begun = self.chain.read(), True
            self.line, self.line_root, self.parent = line.names, line.root, line.end
        name = ckpt.step_dir_name(step)
        parent = self.parent
        if parent == name:  # a re-save of the step resumed from keeps that one's parent
            earlier = self.line[:self.line.index(name)] if name in self.line else []
            parent = earlier[-1] if earlier else \
                (self.line_root if isinstance(self.line_root, str) else None)
        train_state = {**payload.pop("train_state"), "parent": parent}
        try:
            path = ckpt.write_checkpoint(self.root, step, train_state=train_state,
                                         rank=self.rank, barrier=self.barrier, **payload)
        except CheckpointError as exc:
            kept = (f"the previous checkpoint {self._path(self.line[-1])} is intact"
                    if self.line else "no earlier checkpoint exists" if self.rank == 0 else
                    "earlier checkpoints are intact")  # (only the main process knows the line)
            raise CheckpointError(f"{exc}; {kept}; free disk space and rerun with "
                                  f"resume=auto") from None
        if self.rank == 0:
            self.line = [n for n in self.line if n != name] + [name]
            doomed = self._retention(name)
            self.line = [n for n in self.line if n not in doomed]
            self._write_pointer()
            for old in doomed:
                _remove(self._path(old))
        self.parent = name
        self.barrier()
        return path

    def _retention(self, newest: str) -> list:
        """Names of the line to delete: all but the keep_last_k newest that verify (the one just
        written counts as one and is never deleted)."""
        if self.keep_last_k <= 0:
            return []
        kept, doomed = 0, []
        for name in reversed(self.line):
            if kept >= self.keep_last_k:
                doomed.append(name)
            elif name == newest:
                kept += 1
            else:
                try:
                    ckpt.verify_checkpoint(self._path(name))  # cached for those this run wrote
                    kept += 1
                except CheckpointError:
                    pass  # not counted: a damaged one never takes a valid one's place
        return doomed


def _remove(path: str) -> None:
    """Delete a checkpoint so that a crash midway never leaves a half-deleted `step-*` that
    still looks complete: rename it out of the checkpoint namespace first."""
    doomed = os.path.join(os.path.dirname(path), ".del-" + os.path.basename(path))
    try:
        os.rename(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def latest_checkpoint(run_dir: str, verify: bool = True,
                      warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest checkpoint of a run's line that verifies (read-only; see CheckpointManager)."""
    return CheckpointManager(run_dir, warn=warn).latest(verify=verify)


def init_checkpoint(path: str) -> str:
    """The checkpoint trainer.init_from names: a checkpoint itself, or a run directory (its
    newest checkpoint that verifies)."""
    if os.path.isdir(os.path.join(path, "checkpoints")) and \
            not os.path.isfile(os.path.join(path, "trainer_state.json")):
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"trainer.init_from={path}: the run has no complete "
                                  f"checkpoint; pass a checkpoints/step-XXXXXXXX directory")
        return found
    return path
