"""Reading a prepared dir back in tests: plain numpy, independent of data_prep's code."""
from __future__ import annotations

import json
import os

import numpy as np

FILES = ("input_ids", "lengths", "segment_a_lengths", "masked_positions", "masked_labels",
         "next_sentence_labels")
PACKED_FILES = ("input_ids", "lengths", "masked_positions", "masked_labels")   # MLM-only data


def load_manifest(out) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)


def load_split(out, split="train", files=FILES, shards=None) -> dict:
    """The split's arrays, shards in manifest order (`shards`: a slice of them)."""
    m = load_manifest(out)
    listed = m["splits"][split]["shards"][shards or slice(None)]
    parts = [{f: np.load(os.path.join(out, s["path"], f + ".npy")) for f in files}
             for s in listed]
    return {f: np.concatenate([p[f] for p in parts]) for f in files}


def unmasked(a: dict) -> np.ndarray:
    ids = a["input_ids"].astype(np.int64).copy()
    rows = np.repeat(np.arange(len(ids)), a["masked_positions"].shape[1])
    pos = a["masked_positions"].astype(np.int64).ravel()
    lab = a["masked_labels"].astype(np.int64).ravel()
    keep = pos > 0
    ids[rows[keep], pos[keep]] = lab[keep]
    return ids


def measured_stats(a: dict, mask_id: int) -> dict:
    """The statistics the issue asks for, recomputed from the arrays."""
    pos = a["masked_positions"].astype(np.int64)
    rows = np.repeat(np.arange(len(pos)), pos.shape[1]).reshape(pos.shape)
    sel = pos > 0
    shown = a["input_ids"][rows[sel], pos[sel]].astype(np.int64)
    label = a["masked_labels"][sel].astype(np.int64)
    n_pred = sel.sum()
    is_mask = shown == mask_id
    kept = shown == label
    return {"masked_fraction": n_pred / a["lengths"].astype(np.int64).sum(),
            "mask_token_fraction": is_mask.mean(),
            "kept_fraction": kept.mean(),
            "random_token_fraction": (~is_mask & ~kept).mean(),
            "nsp_random_fraction": a["next_sentence_labels"].mean()}
