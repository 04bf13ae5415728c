"""What a directory of fine-tuning results holds, and for what: one rule for every such directory
(a fine-tune's run folder, a grid's out_dir, the kept model, a pretraining run's downstream
scores), used by grid.py, runner.py, the downstream objective and bert-glue.

A directory records the identity of what it holds in `identity.json` (the pretrained model's
content hash, the task and its data's hash, the recipe, the learning rate and seed...), written
before anything else goes in.  It is reused only for that identity: a rerun with the same
settings continues or reads back what is there, and results of any other identity are written
beside it (`<dir>-2`, `<dir>-3`, ...), never over it, with one line that says where and why.

    out_dir = claim(out_dir, identity, "a fine-tune", say)
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

from ..errors import UserError

IDENTITY_FILE = "identity.json"
# The record of a command, which earlier versions let Hydra write into out_dir before any of our
# code ran (now command_record.py writes it after the claim): not results.
HYDRA_OUTPUT = ".hydra"


def _normal(identity: dict) -> dict:
    """As it reads back from JSON (tuples become lists), so that a saved one compares equal."""
    return json.loads(json.dumps(identity, sort_keys=True))


def read_identity(directory: str) -> Optional[dict]:
    """The identity `directory` records, or None (none recorded, or unreadable)."""
    file = os.path.join(directory, IDENTITY_FILE)
    if not os.path.isfile(file) or os.path.islink(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def holds(directory: str, identity: dict) -> bool:
    """Whether `directory` records `identity`."""
    return read_identity(directory) == _normal(identity)


def record(directory: str, identity: dict) -> None:
    """Write `directory`'s identity.json (atomically: a crash leaves the old one or the new)."""
    from ..components.checkpoint import write_json_atomic

    write_json_atomic(os.path.join(directory, IDENTITY_FILE), _normal(identity))


def differences(saved: Optional[dict], wanted: dict) -> list:
    """The top-level keys whose values differ, sorted."""
    saved, wanted = saved or {}, _normal(wanted)
    return sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))


def _unclaimed(names) -> bool:
    """A folder with nothing but Hydra's record of the command, or the temporary file of an
    identity.json whose writing was killed: nothing has been written for any identity."""
    return all(n == HYDRA_OUTPUT or n.startswith(f"{IDENTITY_FILE}.tmp-") for n in names)


def _take(directory: str, identity: dict) -> bool:
    """Record `identity` in `directory` unless some identity is recorded there already, in one
    step: the whole file is written aside and hard-linked in, and link() fails when the name
    exists.  Of two commands that found the folder new at once, one takes it and the other
    learns here that it did not (a check, then a write, would let both take it)."""
    from ..components.checkpoint import write_json_atomic

    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, IDENTITY_FILE)
    tmp = os.path.join(directory, f"{IDENTITY_FILE}.tmp-claim-{os.getpid()}")
    write_json_atomic(tmp, identity)
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create-if-absent, then fill it in
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(identity, f, indent=2)
        return True
    finally:
        os.unlink(tmp)


def claim(base: str, identity: dict, what: str = "results",
          say: Optional[Callable[[str], None]] = None) -> str:
    """The directory for results of `identity`: `base` when it is new (absent, or empty but
    for an old record of the command) or holds `identity`; otherwise the first of `base-2`,
    `base-3`, ... that is.  A new one is created with its identity recorded first, atomically:
    of two commands claiming one new folder at once, the second goes beside (or shares it when
    it is for the same identity).  `say` gets one line when the results go beside `base`.
    Main process only (the others get the path from it)."""
    base = os.path.normpath(base)
    wanted = _normal(identity)
    first = read_identity(base)
    n = 1
    while True:
        candidate = base if n == 1 else f"{base}-{n}"
        if os.path.isdir(candidate) and read_identity(candidate) == wanted:
            break
        if not os.path.lexists(candidate) or (os.path.isdir(candidate) and
                                               not os.path.islink(candidate) and
                                               _unclaimed(os.listdir(candidate))):
            try:
                if _take(candidate, wanted):
                    break
            except OSError as exc:
                raise UserError(f"cannot write {what} to {candidate} ({exc.strerror or exc}); "
                                f"choose another directory") from None
            first = read_identity(base)
            continue  # another command took it just now: look at what it holds
        n += 1
    if candidate != base and say is not None:
        held = (f"{what} with other settings ({', '.join(differences(first, wanted))} differ)"
                if first is not None else f"other files (no {IDENTITY_FILE})")
        say(f"{base} holds {held}; writing to {candidate}")
    return candidate
