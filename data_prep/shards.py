"""Shard directories, their statistics, and the manifest (see docs/prepared-format.md).

A shard is written into ``<split>/.tmp-shard-NNNNN-<host>-<pid>/`` and renamed to
``<split>/shard-NNNNN/`` when every file is on disk, so an existing shard directory is always
complete: a resumed run skips it.  Each shard also carries `stats.json` (its counts, a length
histogram and the prep's fingerprint), from which the final step computes the manifest's
statistics without reading the arrays again, and checks that every shard belongs to this prep.
`manifest.json` is written last, through a temp file and an atomic rename.
"""
from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np

from data_prep.errors import os_error

SHARD_FILES = ("input_ids", "lengths", "segment_a_lengths", "masked_positions",
               "masked_labels", "next_sentence_labels")
# MLM-only (packed) shards: one segment, no NSP label.
PACKED_FILES = ("input_ids", "lengths", "masked_positions", "masked_labels")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_path(output_dir: str, split: str, index: int) -> str:
    return os.path.join(output_dir, split, shard_name(index))


def is_done(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "stats.json"))


def _tmp_prefix(index: int) -> str:
    return f".tmp-{shard_name(index)}-"


def remove_stale_tmp(output_dir: str, split: str, indices: set[int]) -> None:
    """Delete half-written shards left by a crash (only those this run is about to build, so
    a host never deletes another host's shard in progress)."""
    d = os.path.join(output_dir, split)
    if not os.path.isdir(d):
        return
    for name in os.listdir(d):
        if name.startswith(".tmp-shard-"):
            try:
                index = int(name[len(".tmp-shard-"):].split("-")[0])
            except ValueError:
                continue
            if index in indices:
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)


def tmp_suffix() -> str:
    """``.tmp-<host>-<pid>``: who writes a temp file, so a later run can tell a crashed
    writer's leftovers (this host, process gone) from another host's work in progress."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def write_shard(path: str, index: int, arrays: dict, stats: dict) -> None:
    parent = os.path.dirname(path)
    tmp = os.path.join(parent, _tmp_prefix(index) + tmp_suffix()[len(".tmp-"):])
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name in SHARD_FILES:
            if name in arrays:
                np.save(os.path.join(tmp, name + ".npy"), arrays[name])
        with open(os.path.join(tmp, "stats.json"), "w") as f:
            json.dump(stats, f)
    except OSError as e:
        # A full disk mid-shard: drop the half-written shard (freeing its space); the
        # finished shards stay, and a re-run builds this one again.
        shutil.rmtree(tmp, ignore_errors=True)
        split = os.path.basename(parent)
        raise os_error(e, f"writing {split}/{shard_name(index)}",
                       os.path.dirname(os.path.abspath(parent))) from None
    try:
        os.rename(tmp, path)
    except OSError:  # another host finished the same shard first: both are identical
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:       # EPERM: someone else's live process
        return True
    return True


def remove_crash_leftovers(directory: str) -> None:
    """Delete temp files and dirs (``*.tmp-[<host>-]<pid>``) whose writer was a process of this
    host that no longer exists: what a killed run left behind.  Others' are never touched."""
    if not os.path.isdir(directory):
        return
    host = socket.gethostname()
    for name in os.listdir(directory):
        if ".tmp-" not in name:
            continue
        tag = name.rsplit(".tmp-", 1)[1]
        if name.startswith(".tmp-shard-"):          # .tmp-shard-NNNNN-<host>-<pid>
            tag = tag.split("-", 2)[2] if tag.count("-") >= 2 else ""
        who, _, pid = tag.rpartition("-")
        if not pid.isdigit() or (who and who != host) or _pid_alive(int(pid)):
            continue
        p = os.path.join(directory, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.remove(p)
            except OSError:
                pass


def read_stats(path: str) -> dict:
    with open(os.path.join(path, "stats.json")) as f:
        return json.load(f)


def shard_stats(lengths: np.ndarray, counts: dict, max_seq_length: int, fingerprint: str) -> dict:
    """`counts`: the masking counts, and num_random_next (NSP pairs) or num_doc_boundaries
    (packed instances)."""
    return {"fingerprint": fingerprint, "num_instances": int(len(lengths)),
            "num_tokens": int(lengths.sum()), **counts,
            "length_hist": np.bincount(lengths, minlength=max_seq_length + 1).tolist()}


def add_stats(total: list, part: dict) -> None:
    """Fold one shard's stats into `total`, a list holding at most one running sum (same keys
    as a shard's stats; summarize() accepts it as it accepts the parts)."""
    keys = [k for k, v in part.items() if isinstance(v, int) and not isinstance(v, bool)]
    hist = np.asarray(part["length_hist"], np.int64)
    if not total:
        total.append({**{k: part[k] for k in keys}, "length_hist": hist})
        return
    t = total[0]
    for k in keys:
        t[k] += part[k]
    t["length_hist"] = t["length_hist"] + hist


def summarize(parts: list[dict], max_seq_length: int, packed: bool = False) -> dict:
    """The manifest's `stats` object from per-shard counts (`packed`: MLM-only instances)."""
    def total(key):
        return sum(p[key] for p in parts)
    n = total("num_instances")
    hist = np.zeros(max_seq_length + 1, np.int64)
    for p in parts:
        hist += np.asarray(p["length_hist"], np.int64)
    predicted = total("predicted")

    def frac(a, b):
        return round(a / b, 6) if b else 0.0
    p50 = int(np.searchsorted(np.cumsum(hist), (n + 1) // 2)) if n else 0
    stats = {"num_instances": n,
             "num_tokens": total("num_tokens"),
             "num_predicted": predicted,
             "masked_fraction": frac(predicted, total("num_tokens")),
             "mask_token_fraction": frac(total("mask"), predicted),
             "random_token_fraction": frac(total("random"), predicted),
             "kept_fraction": frac(total("kept"), predicted)}
    # Packed (MLM-only) shards count the documents an instance spans instead of NSP labels.
    if packed:
        stats["documents_per_instance"] = frac(n + total("num_doc_boundaries"), n)
    else:
        stats["nsp_random_fraction"] = frac(total("num_random_next"), n)
    stats.update({"mean_seq_length": frac(total("num_tokens"), n),
                  "p50_seq_length": p50,
                  "fraction_at_max_length": frac(int(hist[max_seq_length]), n)})
    return stats


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + tmp_suffix()
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise os_error(e, f"writing {os.path.basename(path)}",
                       os.path.dirname(os.path.abspath(path))) from None


STAT_ROWS = [("instances", "num_instances", "{:,}"), ("tokens", "num_tokens", "{:,}"),
             ("predicted / tokens", "masked_fraction", "{:.2%}"),
             ("  [MASK]", "mask_token_fraction", "{:.2%}"),
             ("  random token", "random_token_fraction", "{:.2%}"),
             ("  kept", "kept_fraction", "{:.2%}"),
             ("NSP random-next", "nsp_random_fraction", "{:.2%}"),
             ("documents / instance", "documents_per_instance", "{:.2f}"),
             ("mean length", "mean_seq_length", "{:.1f}"),
             ("median length", "p50_seq_length", "{}"),
             ("at max length", "fraction_at_max_length", "{:.2%}")]


def stats_table(columns: dict[str, dict]) -> str:
    names = list(columns)
    width = max(len(r[0]) for r in STAT_ROWS)
    lines = [" " * width + "".join(f"{n:>14}" for n in names)]
    for label, key, fmt in STAT_ROWS:
        if not any(key in columns[n] for n in names):
            continue   # a row of the other format (NSP pairs / packed)
        lines.append(f"{label:<{width}}" + "".join(
            f"{fmt.format(columns[n].get(key, 0)):>14}" for n in names))
    return "\n".join(lines)
