"""Checkpoints: `<run_dir>/checkpoints/step-XXXXXXXX/`, written atomically.

A checkpoint is written into `.tmp-step-XXXXXXXX/`, every file fsync'd, then the directory is
renamed to its final name (rename is atomic on POSIX) and the parent fsync'd.  Only names
`step-<8 digits>` that hold `trainer_state.json` count as checkpoints, so a crash or a full disk
mid-save never leaves something that looks valid, and the previous checkpoint is untouched.

Contents: model.safetensors, optimizer.pt, trainer_state.pt (scheduler, grad scaler),
rng_state_rank<R>.pt (one per rank), trainer_state.json (step, tokens seen, data position,
elapsed seconds, model config, tokenizer hash, and the sha256 of every other file), config.yaml
(the resolved run config) and a copy of the tokenizer, so a checkpoint directory is
self-contained (export needs nothing else).

Loading never executes code: weights through safetensors, the other state through
`torch.load(weights_only=True)` (tensors, numbers, strings, lists, dicts only: RNG states are
stored in that form) or JSON. A file whose sha256 differs from the one recorded is refused, and
`resume=auto` falls back to the newest checkpoint that verifies.
"""

import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from .errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_JSON = "trainer_state.json"
# Fields that decide tensor shapes: a checkpoint whose values differ cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings", "type_vocab_size",
                "position_embedding_type", "pre_layer_norm")


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str) -> list:
    """Valid checkpoints of a run, oldest first, as (step, path)."""
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


def latest_valid_checkpoint(run_dir: str) -> tuple:
    """(the newest checkpoint whose files verify or None, [(skipped path, reason), ...])."""
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path, skipped
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
    return None, skipped


def latest_checkpoint(run_dir: str, warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest valid checkpoint of a run; a corrupt newer one is skipped with a warning that
    names it (to stderr unless `warn` is given)."""
    path, skipped = latest_valid_checkpoint(run_dir)
    for bad, reason in skipped:
        message = (f"warning: skipping corrupt checkpoint {bad} ({reason}); "
                   f"{'using ' + path if path else 'no valid checkpoint is left'}")
        if warn is None:
            print(message, file=sys.stderr, flush=True)
        else:
            warn(message)
    return path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checksums(root: str) -> dict:
    """sha256 of every file under `root` (but the marker file), by relative path."""
    sums = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if rel != STATE_JSON:
                sums[rel] = _sha256(full)
    return dict(sorted(sums.items()))


def verify_checkpoint(path: str) -> dict:
    """Check every file of a checkpoint against the sha256 recorded when it was written; returns
    its trainer state. Raises CheckpointError naming the first missing, truncated or altered
    file. (Checkpoints written before checksums existed are accepted as they are.)"""
    state = read_train_state(path)
    recorded = state.get("files")
    if recorded is None:
        return state
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{path}/{STATE_JSON} has a malformed file list; the checkpoint is "
                              f"corrupt")
    for rel, digest in recorded.items():
        full = os.path.normpath(os.path.join(path, rel))
        if not full.startswith(os.path.normpath(path) + os.sep):
            raise CheckpointError(f"{path}/{STATE_JSON} names a file outside the checkpoint "
                                  f"({rel}); the checkpoint is corrupt")
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing; the checkpoint is incomplete")
        if _sha256(full) != digest:
            raise CheckpointError(f"{full} does not match its recorded sha256 (truncated or "
                                  f"altered); the checkpoint is corrupt")
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
    """Every RNG this process uses, as tensors, numbers and lists only (so that it loads with
    `weights_only=True`). CUDA: the current device's generator only, the one this rank uses;
    saving all would fail to restore on a node with fewer visible GPUs."""
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": list(py_state), "gauss": gauss},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
            f.write(config_yaml)
        if tokenizer_dir and os.path.isdir(tokenizer_dir):
            shutil.copytree(tokenizer_dir, os.path.join(tmp, "tokenizer"))
        # trainer_state.json last: it is what marks a checkpoint directory as complete, and it
        # records the sha256 of every other file (ranks' RNG files included).
        with open(os.path.join(tmp, STATE_JSON), "w", encoding="utf-8") as f:
            json.dump({**train_state, "step": step, "files": _checksums(tmp)}, f, indent=2)
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
        previous = latest_checkpoint(run_dir)
        kept = f"the previous checkpoint {previous} is intact" if previous else \
            "no earlier checkpoint exists"
        barrier()
        raise CheckpointError(
            f"could not save checkpoint step {step} in {root} ({exc.strerror or exc}); {kept}; "
            f"free disk space and rerun with resume=auto"
        ) from None
    for _, path in list_checkpoints(run_dir)[:-keep_last_k] if keep_last_k > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    barrier()
    return final


def clean_partial(run_dir: str) -> None:
    """Remove leftovers of interrupted saves (never valid checkpoints). A `step-X.old` without its
    `step-X` is a checkpoint whose re-save was killed between the two renames: put it back."""
    root = checkpoints_root(run_dir)
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.endswith(".old") and not os.path.exists(path[:-4]):
                os.rename(path, path[:-4])
            elif name.startswith(".tmp-step-") or name.endswith(".old"):
                shutil.rmtree(path, ignore_errors=True)


def read_train_state(path: str) -> dict:
    file = os.path.join(path, STATE_JSON)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_JSON}); pass a "
                              f"<run_dir>/checkpoints/step-XXXXXXXX directory")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file} ({exc}); the checkpoint is corrupt") from None


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
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot load {file}: {str(exc).splitlines()[0]}; the checkpoint "
                              f"is corrupt or from another model") from None


def _safe_load(file: str):
    """torch.load without code execution: tensors, numbers, strings, lists and dicts only."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"refusing to load {file}: it holds Python objects other than tensors and plain "
            f"data, which loading would execute; it was not written by bert-train (or was "
            f"altered): delete this checkpoint to fall back to an older one") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot load {file} ({str(exc).splitlines()[0]}); the checkpoint "
                              f"is corrupt, delete it to fall back to an older one") from None


def load_states(path: str, rank: int) -> tuple:
    """(optimizer state, extra state, this rank's RNG state or None)."""
    opt = _safe_load(os.path.join(path, "optimizer.pt"))
    extra = _safe_load(os.path.join(path, "trainer_state.pt"))
    rng_file = os.path.join(path, f"rng_state_rank{rank}.pt")
    rng = _safe_load(rng_file) if os.path.isfile(rng_file) else None
    return opt, extra, rng
