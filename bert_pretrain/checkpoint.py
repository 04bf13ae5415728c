"""Checkpoints: `<run_dir>/checkpoints/step-XXXXXXXX/`, written atomically, checksummed, and
loaded without running any code from the files.

A checkpoint is written into `.tmp-step-XXXXXXXX/`, every file fsync'd, then the directory is
renamed to its final name (rename is atomic on POSIX) and the parent fsync'd.  Only names
`step-<8 digits>` that hold `trainer_state.json` count as checkpoints, so a crash or a full disk
mid-save never leaves something that looks valid, and the previous checkpoint is untouched.

Contents: model.safetensors, optimizer.pt, trainer_state.pt (scheduler, grad scaler),
rng_state_rank<R>.pt (one per rank), trainer_state.json (step, tokens seen, data position,
elapsed seconds, model config, tokenizer hash), config.yaml (the resolved run config) and a copy
of the tokenizer, so a checkpoint directory is self-contained (export needs nothing else).

Integrity: trainer_state.json, written last, lists the sha256 of every other file (`files`) and
of its own content (`state_sha256`).  `verify_checkpoint` re-hashes them, so a truncated file,
a flipped bit or a file lost from a copied run is found before anything is loaded;
`latest_checkpoint` (resume=auto) skips such a checkpoint for the newest valid one.  A checksum
is not a signature: it catches damage, not a deliberate edit.

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
import sys
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from .errors import CheckpointError
from .redact import redact

STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_JSON = "trainer_state.json"
# Fields that decide tensor shapes: a checkpoint whose values differ cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "type_vocab_size",
                "position_embedding_type", "pre_layer_norm")
_HASH_CHUNK = 8 << 20


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str) -> list:
    """Complete-looking checkpoints of a run (not yet verified), oldest first, as (step, path)."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, STATE_JSON)):
            found.append((int(m.group(1)), path))
    return sorted(found)


_warned: set = set()


def _warn_once(message: str) -> None:
    """Warnings from code every rank runs: print once, from the main process (RANK is set by
    torchrun / accelerate launch)."""
    if os.environ.get("RANK", "0") == "0" and message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)


def latest_checkpoint(run_dir: str, verify: bool = True,
                      warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest checkpoint whose files match their checksums (resume=auto); a damaged one is
    skipped with a warning naming it (through `warn`, else once on stderr).  verify=False: the
    newest complete-looking one.

    None when the run has no checkpoint; CheckpointError when it has some and all are damaged
    (starting over would silently discard the run, and keep_last_k would then delete them)."""
    found = list_checkpoints(run_dir)
    for _, path in reversed(found):
        if not verify:
            return path
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as exc:
            (warn or _warn_once)(f"bert-train: warning: skipping damaged checkpoint {path}: "
                                 f"{exc}; falling back to an earlier one")
    if found and verify:
        raise CheckpointError(
            f"all {len(found)} checkpoint(s) in {checkpoints_root(run_dir)} are damaged (see the "
            f"warnings above); restore them from a copy, or move them away to start over")
    return None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
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


# Verified checkpoints of this process, keyed by path and every listed file's (size, mtime,
# inode): the trainer and export may ask twice, and hashing gigabytes twice is a waste.
_verified: dict = {}


def _stat_key(path: str, names) -> tuple:
    key = []
    for name in (STATE_JSON, *names):
        st = os.stat(os.path.join(path, name))
        key.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return (os.path.realpath(path), tuple(key))


def _read_json(path: str) -> dict:
    file = os.path.join(path, STATE_JSON)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_JSON}); pass a "
                              f"<run_dir>/checkpoints/step-XXXXXXXX directory")
    try:
        with open(file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file} ({str(exc).splitlines()[0]}); the checkpoint "
                              f"is corrupt") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is not a bert-train state file; the checkpoint is corrupt")
    return state


def verify_checkpoint(path: str) -> dict:
    """Check every file of checkpoint `path` against the sha256 recorded when it was saved;
    returns its train state.  Raises CheckpointError naming the first bad file.

    Costs one read of the whole checkpoint (sha256 runs at several hundred MB/s per core)."""
    state = _read_json(path)
    files = state.get("files")
    if not isinstance(files, dict) or not files or "state_sha256" not in state:
        raise CheckpointError(f"{path} has no checksums (written by an older bert-train or "
                              f"edited by hand), so it cannot be verified")
    if state["state_sha256"] != _state_digest(state):
        raise CheckpointError(f"{os.path.join(path, STATE_JSON)} does not match its checksum; "
                              f"the checkpoint is corrupt")
    for name in files:
        if not isinstance(name, str) or ".." in name.split("/") or os.path.isabs(name):
            raise CheckpointError(f"{path} lists a file outside the checkpoint ({name!r})")
    try:
        key = _stat_key(path, files)
    except OSError as exc:
        raise CheckpointError(f"{os.path.join(path, os.path.basename(exc.filename or ''))} "
                              f"is missing; the checkpoint is incomplete") from None
    if _verified.get(key):
        return state
    for name, digest in files.items():
        file = os.path.join(path, name)
        try:
            actual = _sha256(file)
        except OSError as exc:
            raise CheckpointError(f"cannot read {file} ({exc.strerror or exc}); the checkpoint "
                                  f"is incomplete") from None
        if actual != digest:
            raise CheckpointError(f"{file} does not match its sha256 (truncated or altered); "
                                  f"the checkpoint is corrupt")
    _verified[key] = True
    return state


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


def save_checkpoint(run_dir: str, step: int, *, model: torch.nn.Module, optimizer_state: dict,
                    extra_state: dict, train_state: dict, config_yaml: str,
                    tokenizer_dir: Optional[str], keep_last_k: int,
                    rank: int = 0, barrier: Callable[[], None] = lambda: None) -> str:
    """Write checkpoint `step` (all ranks call this; rank 0 writes all but its RNG files).

    Raises CheckpointError (with the previous checkpoint intact) on OSError such as ENOSPC.
    """
    root = checkpoints_root(run_dir)
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    ok = True
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    try:
        torch.save(rng_state(), os.path.join(tmp, f"rng_state_rank{rank}.pt"))
    except OSError:
        ok = False
    barrier()
    if rank != 0:
        barrier()
        return final
    try:
        if not ok:
            raise OSError(errno.EIO, "a rank could not write its RNG state")
        save_model(model, os.path.join(tmp, "model.safetensors"))
        torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
        torch.save(extra_state, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(redact(config_yaml))  # a config may interpolate a token from the env
        if tokenizer_dir and os.path.isdir(tokenizer_dir):
            shutil.copytree(tokenizer_dir, os.path.join(tmp, "tokenizer"))
        # trainer_state.json last: it is what marks a checkpoint directory as complete, and it
        # carries the checksums of everything written before it.
        state = {**train_state, "step": step,
                 "files": {name: _sha256(os.path.join(tmp, name)) for name in _files_of(tmp)}}
        state["state_sha256"] = _state_digest(state)
        with open(os.path.join(tmp, STATE_JSON), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2)
        _fsync_tree(tmp)
        if os.path.exists(final):  # re-saving the same step (e.g. the final save after resume)
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir, verify=False)
        kept = f"the previous checkpoint {previous} is intact" if previous else \
            "no earlier checkpoint exists"
        barrier()
        raise CheckpointError(
            f"could not save checkpoint step {step} in {root} ({exc.strerror or exc}); {kept}; "
            f"free disk space and rerun with resume=auto"
        ) from None
    for _, path in list_checkpoints(run_dir)[:-keep_last_k] if keep_last_k > 0 else []:
        _remove(path)
    barrier()
    return final


def _remove(path: str) -> None:
    """Delete a checkpoint so that a crash midway never leaves a half-deleted `step-*` that
    still looks complete: rename it out of the checkpoint namespace first."""
    doomed = os.path.join(os.path.dirname(path), ".del-" + os.path.basename(path))
    try:
        os.rename(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def clean_partial(run_dir: str) -> None:
    """Remove leftovers of interrupted saves and deletions (never valid checkpoints).  A
    `step-X.old` whose `step-X` is missing (killed between the two renames of a re-save) is the
    only copy of that checkpoint: it is put back."""
    root = checkpoints_root(run_dir)
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.endswith(".old") and STEP_DIR.match(name[:-4]) and \
                    not os.path.exists(path[:-4]):
                os.rename(path, path[:-4])
            elif name.startswith((".tmp-step-", ".del-step-")) or name.endswith(".old"):
                shutil.rmtree(path, ignore_errors=True)


def read_train_state(path: str, verify: bool = True) -> dict:
    """The train state of checkpoint `path`, after verifying all its files' checksums
    (verify=False: for a checkpoint another process has just verified)."""
    return verify_checkpoint(path) if verify else _read_json(path)


def check_compatible(path: str, state: dict, model_config: dict,
                     tokenizer_sha256: Optional[str]) -> None:
    """Refuse a checkpoint of another model size or tokenizer, naming the differing fields."""
    saved = state.get("model_config", {})
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs config {model_config.get(k)!r}"
            for k in SHAPE_FIELDS if saved.get(k) != model_config.get(k)]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} is for a different model ({'; '.join(diff)}); use the model "
            f"config it was trained with, or another run_dir"
        )
    saved_sha = state.get("tokenizer_sha256")
    if saved_sha and tokenizer_sha256 and saved_sha != tokenizer_sha256:
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer (sha256 {saved_sha[:12]} vs "
            f"the data's {tokenizer_sha256[:12]}); use data prepared with the same tokenizer"
        )


def load_weights(path: str, model: torch.nn.Module) -> None:
    file = os.path.join(path, "model.safetensors")
    try:
        load_model(model, file, strict=True)
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        raise CheckpointError(f"cannot load {file}: {str(exc).splitlines()[0]}; the checkpoint "
                              f"is corrupt or from another model") from None


def _load_plain(file: str):
    """torch.load that only rebuilds tensors and plain containers: a pickle that would import
    or call anything else (e.g. a `__reduce__` payload) is refused before it runs."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
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
    """(optimizer state, extra state, this rank's RNG state or None)."""
    opt = _load_plain(os.path.join(path, "optimizer.pt"))
    extra = _load_plain(os.path.join(path, "trainer_state.pt"))
    rng_file = os.path.join(path, f"rng_state_rank{rank}.pt")
    rng = _load_plain(rng_file) if os.path.isfile(rng_file) else None
    return opt, extra, rng
