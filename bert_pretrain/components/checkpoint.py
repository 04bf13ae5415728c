"""One checkpoint directory: written atomically, checksummed, read safely, loaded without running
code from its files.  Which checkpoint a run continues from, and which are kept, is the
checkpoint manager's business (checkpoint_manager.py); this module knows one directory at a time.

A checkpoint is written into `.tmp-step-XXXXXXXX/`, every file fsync'd, then the directory is
renamed to its final name (rename is atomic on POSIX) and the parent fsync'd.  Only names
`step-<8 digits>` that hold `trainer_state.json` count as checkpoints, so a crash or a full disk
mid-save never leaves something that looks valid, and the previous checkpoint is untouched.

Contents: model.safetensors, optimizer.pt, trainer_state.pt (scheduler, grad scaler, logging
window), rng_state_rank<R>.pt (one per rank), trainer_state.json (step, tokens seen, data
position, elapsed seconds, model config, tokenizer hash, the checkpoint it continues), config.yaml
(the resolved run config) and a copy of the tokenizer files, so a checkpoint directory is
self-contained (export needs nothing else).  A sharded (FSDP2) run's checkpoint holds
`sharded/` (every process's own shards of the model and optimizer, sharded_checkpoint.py) in
place of model.safetensors and optimizer.pt; everything else, atomicity and checksums included,
is the same, and `load_weights` reads either.

A checkpoint is the files its state lists, and nothing else.  trainer_state.json, written last,
lists every other file with its sha256 and size (`files`) and carries the sha256 of its own content
(`state_sha256`).  `verify_checkpoint` refuses a symlink or anything but a regular file anywhere in
the directory (a link `tokenizer/added_tokens.json -> ~/.ssh/id_rsa` would otherwise be copied out
by an export; a `config.yaml -> /dev/zero` would be hashed forever), refuses listed paths that
leave the directory, reads no file past its recorded size, and re-hashes every listed file, so a
truncated file, a flipped bit or a file lost from a copied run is found before anything is loaded.
Readers (loading, export) then use listed files only.  A checksum is not a signature: it catches
damage, not a deliberate edit.

Untrusted files: nothing here unpickles arbitrary objects.  Weights go through safetensors, the
other state through `torch.load(weights_only=True)` (tensors and plain containers only) or JSON,
so a planted pickle whose `__reduce__` runs code is refused, not executed.  RNG states are
therefore stored as tensors and plain numbers, not as numpy/python state objects.
"""

import errno
import hashlib
import json
import os
import random
import re
import shutil
import stat
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from ..errors import CheckpointError
from . import fault_point
from .redact import redact

STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_JSON = "trainer_state.json"
# Where a re-save of the same step keeps the previous copy until the new one is in place
# (`.old-step-XXXXXXXX`): a dot name, like everything a save leaves behind, so that a user's own
# `step-XXXXXXXX.old` backup is never taken for one.
OLD_PREFIX = ".old-"
TOKENIZER_DIR = "tokenizer"
# Fields that decide tensor shapes: a checkpoint whose values differ cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "type_vocab_size",
                "position_embedding_type", "pre_layer_norm", "next_sentence_prediction")
# What a field missing from an older checkpoint's model config meant then.
_SHAPE_DEFAULTS = {"next_sentence_prediction": True}
# trainer_state.json holds a few numbers and one line per file: anything this large is not one.
MAX_STATE_BYTES = 16 << 20
_HASH_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: str) -> Optional[int]:
    m = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ safe reading
def _check_name(path: str, name) -> str:
    """A listed name: a relative path inside the checkpoint, '/'-separated, no '..'."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or \
            any(part in ("", ".", "..") for part in name.split("/")):
        raise CheckpointError(f"{path} lists a file outside the checkpoint ({name!r}); the "
                              f"checkpoint was edited or is corrupt")
    return name


def _regular(path: str, rel: str) -> os.stat_result:
    """lstat of `rel` inside checkpoint `path`; refuses a symlink or a non-regular file on the
    way (every directory component is checked, so a linked `tokenizer/` is refused too)."""
    current = path
    parts = rel.split("/")
    for i, part in enumerate(parts):
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            raise CheckpointError(f"{current} is missing; the checkpoint is incomplete") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {current} ({exc.strerror}); the checkpoint is "
                                  f"unreadable") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{current} is a symbolic link; a checkpoint holds only its own "
                                  f"regular files: replace the link by the file or remove it")
        if last and not stat.S_ISREG(st.st_mode) or not last and not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{current} is not a regular file; a checkpoint holds only its "
                                  f"own regular files: remove it")
    return st


def _open_regular(file: str):
    """Open a file already checked by `_regular`, refusing a symlink swapped in since."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    return os.fdopen(fd, "rb")


def _sha256(path: str, limit: Optional[int] = None) -> str:
    """sha256 of the file; with `limit`, of at most its first limit + 1 bytes (a file longer than
    recorded then mismatches without being read to its end)."""
    h = hashlib.sha256()
    left = float("inf") if limit is None else limit + 1
    with _open_regular(path) as f:
        while left > 0:
            chunk = f.read(int(min(_HASH_CHUNK, left)))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _state_digest(state: dict) -> str:
    """sha256 of trainer_state.json's content without its own `state_sha256` field."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _files_of(directory: str) -> list:
    """Relative paths of every file under `directory` except trainer_state.json, sorted."""
    out = []
    for dirpath, _, files in os.walk(directory):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), directory)
            if rel != STATE_JSON:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _listed(state: dict) -> dict:
    """{name: (sha256, size or None)} from the state's `files` (older checkpoints list the
    sha256 alone)."""
    out = {}
    for name, entry in state["files"].items():
        if isinstance(entry, str):
            out[name] = (entry, None)
        elif isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and \
                isinstance(entry.get("size"), int):
            out[name] = (entry["sha256"], entry["size"])
        else:
            raise CheckpointError(f"{STATE_JSON} lists {name!r} without a checksum")
    return out


def is_our_checkpoint(path: str) -> bool:
    """A directory with a bert-train trainer_state.json (not, e.g., a transformers Trainer
    checkpoint, whose trainer_state.json has global_step and log_history instead)."""
    try:
        state = _read_json(path)
    except CheckpointError:
        return os.path.lexists(os.path.join(path, STATE_JSON)) and \
            not os.path.isfile(os.path.join(path, "config.json"))
    return any(key in state for key in ("files", "model_config", "state_sha256"))


def _read_json(path: str) -> dict:
    file = os.path.join(path, STATE_JSON)
    if not os.path.lexists(file):
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_JSON}); pass a "
                              f"<run_dir>/checkpoints/step-XXXXXXXX directory")
    st = _regular(path, STATE_JSON)
    if st.st_size > MAX_STATE_BYTES:
        raise CheckpointError(f"{file} is {st.st_size} bytes, not a bert-train state file; the "
                              f"checkpoint is corrupt")
    try:
        with _open_regular(file) as f:
            state = json.loads(f.read(MAX_STATE_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file} ({str(exc).splitlines()[0]}); the checkpoint "
                              f"is corrupt") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is not a bert-train state file; the checkpoint is corrupt")
    return state


# Verified checkpoints of this process, keyed by path and every listed file's (size, mtime,
# inode): the trainer, retention and export may ask several times, and hashing gigabytes twice
# is a waste.
_verified: dict = {}


def _stat_key(path: str, names) -> tuple:
    key = []
    for name in (STATE_JSON, *names):
        st = os.lstat(os.path.join(path, name))
        key.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return (os.path.realpath(path), tuple(key))


def _check_tree(path: str) -> None:
    """Nothing in the checkpoint directory is a symlink, a device, a pipe or a socket."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(f"{full} is a symbolic link; a checkpoint holds only its own "
                                      f"regular files: replace the link by the file or remove it")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(f"{full} is not a regular file; a checkpoint holds only its "
                                      f"own regular files: remove it")


def verify_checkpoint(path: str) -> dict:
    """Check every file of checkpoint `path` against the sha256 and size recorded when it was
    saved; returns its train state.  Raises CheckpointError naming the first bad file.

    Costs one read of the whole checkpoint (sha256 runs at several hundred MB/s per core)."""
    state = _read_json(path)
    files = state.get("files")
    if not isinstance(files, dict) or not files or "state_sha256" not in state:
        raise CheckpointError(f"{path} has no checksums (written by an older bert-train or "
                              f"edited by hand), so it cannot be verified")
    if state["state_sha256"] != _state_digest(state):
        raise CheckpointError(f"{os.path.join(path, STATE_JSON)} does not match its checksum; "
                              f"the checkpoint is corrupt")
    try:
        listed = _listed(state)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}; the checkpoint is corrupt") from None
    for name in listed:
        _check_name(path, name)
    try:
        _check_tree(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} ({exc.strerror}); the checkpoint is "
                              f"unreadable") from None
    sizes = {name: _regular(path, name).st_size for name in listed}
    key = _stat_key(path, listed)
    if _verified.get(key):
        return state
    for name, (digest, size) in listed.items():
        file = os.path.join(path, name)
        if size is not None and sizes[name] != size:
            raise CheckpointError(f"{file} does not match its sha256 (it is {sizes[name]} bytes, "
                                  f"{size} were saved: truncated or altered); the checkpoint is "
                                  f"corrupt")
        try:
            actual = _sha256(file, size)
        except OSError as exc:
            raise CheckpointError(f"cannot read {file} ({exc.strerror or exc}); the checkpoint "
                                  f"is incomplete") from None
        if actual != digest:
            raise CheckpointError(f"{file} does not match its sha256 (truncated or altered); "
                                  f"the checkpoint is corrupt")
    _verified[key] = True
    return state


def listed_files(state: dict, under: str = "") -> list:
    """The names the state lists (below `under`, e.g. "tokenizer/"), sorted."""
    return sorted(name for name in state.get("files", {}) if name.startswith(under))


def _link_roots(directory: str) -> list:
    """Where a link in `directory` may point and still be the directory's own file: inside the
    directory itself, and for a Hugging Face hub cache snapshot (`models--org--name/snapshots/
    <revision>/`, every file a link into the repository's `blobs/`) that repository's blobs."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _own_target(directory: str, name: str) -> Optional[str]:
    """The real path of `name` in `directory` if it is the directory's own regular file (itself,
    or a link to a regular file under `_link_roots`), else None."""
    path = os.path.join(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return path
    if not stat.S_ISLNK(mode):
        return None
    target = os.path.realpath(path)
    inside = any(os.path.commonpath([target, root]) == root for root in _link_roots(directory))
    try:
        return target if inside and stat.S_ISREG(os.lstat(target).st_mode) else None
    except OSError:
        return None


def own_files(directory: str, names) -> tuple:
    """(regular, refused): of `names`, those directly in `directory` that are its own regular
    files, and those that are something else there (a link out of it, a folder, a device).
    What a format lists and this returns as regular is all an export may copy out of a
    directory: never a file a link points elsewhere to (a `special_tokens_map.json ->
    ~/.ssh/id_rsa` would ship a private key).  A link that stays inside the directory, or a hub
    cache snapshot's link into its own `blobs/` (how every downloaded model is laid out), is
    the directory's own file."""
    regular, refused = [], []
    for name in names:
        if not os.path.lexists(os.path.join(directory, name)):
            continue
        (regular if _own_target(directory, name) else refused).append(name)
    return regular, refused


def refusal(directory: str, name: str) -> str:
    """Why `name` in `directory` is not copied (own_files refused it), for one warning line."""
    try:
        link = stat.S_ISLNK(os.lstat(os.path.join(directory, name)).st_mode)
    except OSError:
        link = False
    what = "a symbolic link" if link else "not a regular file"
    return (f"{os.path.join(directory, name)} is {what}: not copied (a model directory ships "
            f"only its own files; put the file itself in its place to ship it)")


def copy_own_files(directory: str, names, dest: str) -> list:
    """Copy the own files `names` of `directory` (own_files) into `dest`: each opened at its
    real path without following a link (one swapped in since is left out), written as new files (never over
    one already in `dest`) with the user's umask.  The one copy every export makes
    (bert-export, a fine-tuned model).  Returns the names written."""
    written = []
    for name in names:
        target = _own_target(directory, name)
        if target is None:
            continue
        try:
            src = _open_regular(target)  # (the link's target itself: no link left to follow)
        except OSError:  # ELOOP: a link now
            continue
        with src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                continue
            with open(os.path.join(dest, name), "xb") as out:
                shutil.copyfileobj(src, out)
        written.append(name)
    return written


def read_config_yaml(path: str) -> Optional[str]:
    """The verified checkpoint's config.yaml text, or None if it has none listed."""
    state = _read_json(path)
    if "config.yaml" not in state.get("files", {}):
        return None
    _regular(path, "config.yaml")
    with _open_regular(os.path.join(path, "config.yaml")) as f:
        return f.read(MAX_STATE_BYTES).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ writing
def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            _fsync_path(os.path.join(dirpath, f))
        _fsync_path(dirpath)


def write_json_atomic(file: str, content: dict) -> None:
    """Write a small JSON file so that a crash leaves the old one or the new one, never half."""
    tmp = f"{file}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    _fsync_path(os.path.dirname(file) or ".")


def rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers (loadable with weights_only=True).

    CUDA: only the current device's generator.  A rank drives one device; saving all visible
    devices' states (get_rng_state_all) would fail to restore on a node that sees fewer GPUs."""
    version, mt, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"key": str(key), "state": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["key"], npy["state"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # this rank's current device


def tokenizer_files(tokenizer_dir: str) -> list:
    """The tokenizer's own files: the regular files directly in `tokenizer_dir`. A symlink or
    anything else there is refused: a checkpoint copies these and an export ships them."""
    out = []
    for name in sorted(os.listdir(tokenizer_dir)):
        full = os.path.join(tokenizer_dir, name)
        mode = os.lstat(full).st_mode
        if stat.S_ISLNK(mode) or not stat.S_ISREG(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise CheckpointError(f"{full} is {what}; the tokenizer directory must hold only its "
                                  f"own files: remove it (or copy the file in its place)")
        out.append(name)
    return out


def _own_digests(tmp: str, names: list) -> dict:
    """{name: {sha256, size}} of files a process wrote into the temporary checkpoint."""
    return {name: {"sha256": _sha256(os.path.join(tmp, name)),
                   "size": os.path.getsize(os.path.join(tmp, name))} for name in names}


def write_checkpoint(root: str, step: int, *, model: Optional[torch.nn.Module],
                     optimizer_state: Optional[dict], extra_state: dict, train_state: dict,
                     config_yaml: str, tokenizer_dir: Optional[str], rank: int = 0,
                     barrier: Callable[[], None] = lambda: None,
                     shards: Optional[Callable[[str], list]] = None,
                     gather: Callable[[object], list] = lambda x: [x]) -> str:
    """Write checkpoint `step` into `root` (all ranks call this; rank 0 writes all but its RNG
    files).  Keeps nothing else in mind: no pointer, no retention (the manager's job).

    Sharded (`shards` given, model and optimizer_state None): every rank calls
    `shards(folder)`, which writes its own shards of the model and optimizer into `folder`
    (sharded_checkpoint.py) and returns their names; each rank hashes what it wrote and `gather`
    brings the checksums to rank 0 (a list on rank 0), so nothing is read twice and no process
    holds another's shards.  The rename into place stays rank 0's, after every rank is done.

    Raises CheckpointError (with every other checkpoint intact) on OSError such as ENOSPC; the
    caller adds what the user can do."""
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    ok = True
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    rng_name = f"rng_state_rank{rank}.pt"
    try:
        torch.save(rng_state(), os.path.join(tmp, rng_name))
    except OSError:
        ok = False
    fault_point.reached("save", step, rank)  # a test's kill with the save half written
    digests = {}
    if shards is not None:
        from .sharded_checkpoint import SHARDED_DIR

        try:
            written = shards(os.path.join(tmp, SHARDED_DIR))  # collective
            if ok:
                digests = _own_digests(tmp, [rng_name] + [f"{SHARDED_DIR}/{n}" for n in written])
        except OSError:
            ok = False
        digests = gather({"ok": ok, "files": digests})
        if not all(d["ok"] for d in digests):  # every process knows: all fail the save alike
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not save checkpoint step {step} in {root} (a process "
                                  f"could not write its shards or its RNG state)")
        digests = {name: entry for d in digests for name, entry in d["files"].items()}
    barrier()
    if rank != 0:
        barrier()
        return final
    try:
        if not ok:
            raise OSError(errno.EIO, "a rank could not write its RNG state or its shards")
        if model is not None:
            save_model(model, os.path.join(tmp, "model.safetensors"))
            torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
        torch.save(extra_state, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(redact(config_yaml))  # a config may interpolate a token from the env
        if tokenizer_dir and os.path.isdir(tokenizer_dir):
            os.makedirs(os.path.join(tmp, TOKENIZER_DIR))
            for name in tokenizer_files(tokenizer_dir):
                shutil.copyfile(os.path.join(tokenizer_dir, name),
                                os.path.join(tmp, TOKENIZER_DIR, name), follow_symlinks=False)
        # trainer_state.json last: it is what marks a checkpoint directory as complete, and it
        # carries the checksums of everything written before it.
        names = _files_of(tmp)
        state = {**train_state, "step": step, "files": {
            **_own_digests(tmp, [n for n in names if n not in digests]),
            **{n: digests[n] for n in names if n in digests}}}
        state["state_sha256"] = _state_digest(state)
        with open(os.path.join(tmp, STATE_JSON), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2)
        _fsync_tree(tmp)
        if os.path.exists(final):  # re-saving the same step
            old = os.path.join(root, OLD_PREFIX + step_dir_name(step))
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
    except Exception as exc:  # (safetensors and torch.save report a full disk in their own ways)
        from .disk_space import free_text, is_disk_full

        full = is_disk_full(exc, root)
        if not full and not isinstance(exc, (OSError, CheckpointError)):
            raise  # a bug, not the disk: keep its traceback
        shutil.rmtree(tmp, ignore_errors=True)  # (frees what the half-written one took)
        barrier()
        reason = f"No space left on device, {free_text(root)}" if full else \
            getattr(exc, "strerror", None) or exc
        raise CheckpointError(
            f"could not save checkpoint step {step} in {root} ({reason})") from None
    _verified[_stat_key(final, state["files"])] = True  # just hashed while writing
    barrier()
    return final


# ------------------------------------------------------------------------------ loading
def read_train_state(path: str, verify: bool = True) -> dict:
    """The train state of checkpoint `path`, after verifying all its files' checksums
    (verify=False: for a checkpoint another process has just verified)."""
    return verify_checkpoint(path) if verify else _read_json(path)


# The parts a model has only with next-sentence prediction: continued pretraining
# (trainer.init_from) on data of the other kind drops them, or starts them fresh.
# An ELECTRA run's generator and detection head likewise: continuing an MLM model with a
# generator starts them fresh; continuing an ELECTRA run as a plain MLM drops them.
INIT_OPTIONAL_PARTS = ("bert.pooler.", "cls.seq_relationship.", "generator.",
                       "discriminator_predictions.")


def check_compatible(path: str, state: dict, model_config: dict,
                     tokenizer_sha256: Optional[str], init: bool = False) -> None:
    """Refuse a checkpoint of another tokenizer or model size, naming the differing fields.
    `init` (trainer.init_from: weights only) lets the NSP head differ: the data decides it."""
    saved_sha = state.get("tokenizer_sha256")
    if saved_sha and tokenizer_sha256 and saved_sha != tokenizer_sha256:
        # first: a corpus prepared with its own vocabulary is the common mistake, and a model
        # size that also differs (vocab_size) is its consequence, not the cause
        fix = (f"prepare the corpus with the model's vocabulary: bert-prep "
               f"tokenizer.vocab_file={os.path.join(path, 'tokenizer')} ..." if init else
               "use data prepared with the same tokenizer")
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer (sha256 {saved_sha[:12]} vs "
            f"the data's {tokenizer_sha256[:12]}); {fix}"
        )
    saved = state.get("model_config", {})
    def value(config, k):
        return config.get(k, _SHAPE_DEFAULTS.get(k))

    diff = [f"{k}: checkpoint {value(saved, k)!r} vs config {value(model_config, k)!r}"
            for k in SHAPE_FIELDS if value(saved, k) != value(model_config, k)
            and not (init and k == "next_sentence_prediction")]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} is for a different model ({'; '.join(diff)}); use the model "
            f"config it was trained with, or another run_dir"
        )


def is_sharded(state: dict) -> bool:
    """Whether the checkpoint of train state `state` holds its model as shards (FSDP)."""
    from .sharded_checkpoint import is_sharded_checkpoint

    return is_sharded_checkpoint(state)


def load_weights(path: str, model: torch.nn.Module, nsp_may_differ: bool = False) -> None:
    """The checkpoint's weights into `model`, every one of them; with `nsp_may_differ`
    (trainer.init_from) the pooler and NSP head may be missing on either side: a saved one the
    model lacks is dropped, one the model has and the checkpoint lacks keeps its fresh init.
    Whole or sharded, whatever wrote the checkpoint (shards: every tensor, as saved)."""
    state = _read_json(path)
    if is_sharded(state):
        from .sharded_checkpoint import SHARDED_DIR, load_model_shards

        _regular(path, SHARDED_DIR + "/.metadata")
        load_model_shards(os.path.join(path, SHARDED_DIR), model)
        return
    file = os.path.join(path, "model.safetensors")
    _regular(path, "model.safetensors")
    try:
        if not nsp_may_differ:
            load_model(model, file, strict=True)
            return
        from safetensors.torch import load_file

        state = load_file(file)
        own = model.state_dict()
        extra = [k for k in state if k not in own and not k.startswith(INIT_OPTIONAL_PARTS)]
        if extra:
            raise ValueError(f"unexpected weight {extra[0]}")
        result = model.load_state_dict({k: v for k, v in state.items() if k in own},
                                       strict=False)
        # tied weights are saved once (save_model): the other name is filled through the tie
        unfilled = [k for k in result.missing_keys if not k.startswith(INIT_OPTIONAL_PARTS)
                    and not _tied(model, k, state)]
        if unfilled:
            raise ValueError(f"missing weight {unfilled[0]}")
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        raise CheckpointError(f"cannot load {file}: {str(exc).splitlines()[0]}; the checkpoint "
                              f"is corrupt or from another model") from None


def _tied(model: torch.nn.Module, key: str, state: dict) -> bool:
    """Whether parameter `key` shares its storage with one the file holds (a tied weight)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    ptr = params[key].data_ptr()
    return any(k in state and p.data_ptr() == ptr for k, p in params.items() if k != key)


def _load_plain(file: str):
    """torch.load that only rebuilds tensors and plain containers: a pickle that would import
    or call anything else (e.g. a `__reduce__` payload) is refused before it runs."""
    try:
        _regular(os.path.dirname(file), os.path.basename(file))
        with _open_regular(file) as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # UnpicklingError (refused object), EOFError, RuntimeError, OSError
        text = str(exc)
        if "weights_only" in text or "Unsupported global" in text or "Unsupported operand" in text:
            raise CheckpointError(
                f"refusing to load {file}: it holds Python objects other than tensors and plain "
                f"data, which could run code; it was not written by bert-train (or was tampered "
                f"with): delete this checkpoint") from None
        reason = text.splitlines()[0] if text.strip() else type(exc).__name__
        raise CheckpointError(f"cannot load {file} ({reason}); the checkpoint is corrupt, delete "
                              f"it to fall back to an older one") from None


def load_states(path: str, rank: int) -> tuple:
    """(optimizer state, extra state, this rank's RNG state or None).  The RNG state is read
    only when trainer_state.json lists it (a checkpoint is the files its state lists): a rank
    the saving run did not have, or a file left over or planted beside them, gets None.  A
    sharded checkpoint's optimizer state is in its shards: None here
    (sharded_checkpoint.load_training_shards reads it)."""
    state = _read_json(path)
    opt = None if is_sharded(state) else _load_plain(os.path.join(path, "optimizer.pt"))
    extra = _load_plain(os.path.join(path, "trainer_state.pt"))
    rng_name = f"rng_state_rank{rank}.pt"
    listed = rng_name in state.get("files", {})
    rng = _load_plain(os.path.join(path, rng_name)) if listed else None
    return opt, extra, rng
