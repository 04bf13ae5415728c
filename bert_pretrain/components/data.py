"""Reading prepared data (docs/prepared-format.md): manifest checks, a seeded global order, per-rank
slices of each global batch, collation and optional dynamic masking.

Design, and why:
- The position in the data is one integer, the number of GLOBAL samples consumed.  Global sample
  k is instance `perm_e[k % N]` of epoch `e = k // N`, where `perm_e` is a permutation seeded by
  (seed, e).  Resuming is O(1) (no replay of skipped batches) and works with any world size.
- A global batch of G samples is cut into W contiguous rank slices and each slice into
  micro-batches of m; micro-batch j of rank r is micro-batch (r * G/W/m + j) of the global batch.
  So W processes see exactly the micro-batches one process sees with W-times the accumulation,
  and no rank duplicates another.
- Dynamic masking draws its random numbers from a counter-based hash of (seed, epoch, instance
  index, position): no RNG state to save, and identical across world sizes and resumes.  Its
  rate may follow a schedule over training, and the global batch may grow during a warmup
  (data_schedules.py): both are pure functions of the step's progress and the data position.
- Two formats (docs/prepared-format.md): BERT's MLM + NSP pairs (format_version 1) and MLM-only
  packed sentences (format_version 2, `objective: mlm`), whose batches carry no
  next_sentence_label and token type 0 throughout.
"""

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from .data_schedules import LR_SCALINGS, MASK_SCHEDULES, batch_ramp, masking_rate
from ..errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSIONS = (1, 2)
"""1: MLM + NSP pairs (a manifest without `objective`); 2: adds MLM-only data."""
SHARD_FILES = ("input_ids", "lengths", "segment_a_lengths", "masked_positions", "masked_labels",
               "next_sentence_labels")
MLM_ONLY_FILES = ("input_ids", "lengths", "masked_positions", "masked_labels")
OBJECTIVES = {"mlm_nsp": SHARD_FILES, "mlm": MLM_ONLY_FILES}
IGNORE_INDEX = -100  # label of positions that are not predicted (torch cross-entropy default)


@dataclass
class DataConfig:
    """`conf/train/data/`: which prepared directory to train on and how to mask it."""

    dir: str = "???"
    """Output directory of `bert-prep` (it must hold a complete manifest.json)."""
    masking: str = "static"
    """static: the masks written by bert-prep (as Google BERT); dynamic: re-mask every epoch at
    load time with the same 80/10/10 rules (as RoBERTa), seeded by (seed, epoch, instance)."""
    masked_lm_prob: Optional[float] = None
    """Dynamic masking only: fraction of tokens to predict; null = the value bert-prep used.
    With masked_lm_prob_start, the rate the schedule ends at."""
    masked_lm_prob_start: Optional[float] = None
    """Dynamic masking only: a masking-rate schedule (mmBERT and others: 30% early, 15% late).
    The rate starts here and moves to masked_lm_prob along masked_lm_prob_schedule, reached at
    masked_lm_prob_until of training (steps, or time with trainer.budget_hours); 80/10/10 at
    every rate. null: one rate throughout."""
    masked_lm_prob_schedule: str = "linear"
    """linear, cosine (half a cosine wave), or step (the start rate until
    masked_lm_prob_until, then the end rate)."""
    masked_lm_prob_until: float = 1.0
    """Share of training at which the end rate is reached (and kept from then on)."""
    batch_warmup_start: Optional[int] = None
    """Batch-size warmup (Cramming, MosaicBERT, ModernBERT): the global batch starts at this many
    samples and grows, in steps of this size, to trainer.global_batch_size over
    batch_warmup_tokens. It must divide trainer.global_batch_size and be divisible by processes
    x trainer.micro_batch_size. null: the full batch from the first step."""
    batch_warmup_tokens: int = 0
    """Length of the batch warmup, in tokens counted as sequence slots (samples x the data's
    max_seq_length): the batch is a function of the samples consumed, so the data position stays
    one number and resumes and any number of processes see the same batches."""
    batch_warmup_lr_scaling: str = "none"
    """During the batch warmup the learning rate is multiplied by (batch / final batch) ** p:
    none (p = 0), sqrt (0.5) or linear (1)."""
    train_split: str = "train"
    eval_split: str = "validation"
    pad_to_multiple_of: int = 8
    """Each micro-batch is cut to its longest sequence, rounded up to this (tensor-core friendly);
    padding never changes results beyond float rounding."""

    def __post_init__(self) -> None:
        if self.masking not in ("static", "dynamic"):
            raise ValueError(f"data.masking must be static or dynamic, got {self.masking!r}")
        if self.masked_lm_prob is not None and not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"data.masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if self.masked_lm_prob is not None and self.masking != "dynamic":
            raise ValueError(f"data.masked_lm_prob={self.masked_lm_prob} only applies to "
                             f"data.masking=dynamic (static masks were drawn by bert-prep at its "
                             f"masked_lm_prob); set data.masking=dynamic or drop it")
        if self.pad_to_multiple_of < 1:
            raise ValueError("data.pad_to_multiple_of must be >= 1")
        if self.masked_lm_prob_start is not None:
            if self.masking != "dynamic":
                raise ValueError(f"data.masked_lm_prob_start={self.masked_lm_prob_start} needs "
                                 f"data.masking=dynamic (static masks have one rate, drawn by "
                                 f"bert-prep); set data.masking=dynamic or drop it")
            if not 0.0 < self.masked_lm_prob_start < 1.0:
                raise ValueError(f"data.masked_lm_prob_start must be in (0, 1), got "
                                 f"{self.masked_lm_prob_start}")
        if self.masked_lm_prob_schedule not in MASK_SCHEDULES:
            raise ValueError(f"data.masked_lm_prob_schedule must be one of "
                             f"{', '.join(MASK_SCHEDULES)}, got {self.masked_lm_prob_schedule!r}")
        if not 0.0 < self.masked_lm_prob_until <= 1.0:
            raise ValueError(f"data.masked_lm_prob_until must be in (0, 1] (a share of "
                             f"training), got {self.masked_lm_prob_until}")
        if self.batch_warmup_start is not None:
            if self.batch_warmup_start < 1:
                raise ValueError(f"data.batch_warmup_start must be >= 1 or null, got "
                                 f"{self.batch_warmup_start}")
            if self.batch_warmup_tokens < 1:
                raise ValueError(f"data.batch_warmup_start={self.batch_warmup_start} needs the "
                                 f"warmup's length: set data.batch_warmup_tokens (e.g. 1000000)")
        if self.batch_warmup_tokens < 0:
            raise ValueError(f"data.batch_warmup_tokens must be >= 0, got "
                             f"{self.batch_warmup_tokens}")
        if self.batch_warmup_lr_scaling not in LR_SCALINGS:
            raise ValueError(f"data.batch_warmup_lr_scaling must be one of "
                             f"{', '.join(LR_SCALINGS)}, got {self.batch_warmup_lr_scaling!r}")

    def masking_rate(self, prep_rate: float, progress: Optional[float]) -> float:
        """The dynamic masking rate at `progress` (share of training done); `prep_rate` is
        bert-prep's, the end rate when masked_lm_prob is null."""
        end = self.masked_lm_prob or prep_rate
        if self.masked_lm_prob_start is None:
            return end
        if progress is None:
            raise ValueError("data.masked_lm_prob_start schedules the masking rate over "
                             "training: the trainer must pass each step's progress")
        return masking_rate(self.masked_lm_prob_start, end, self.masked_lm_prob_schedule,
                            self.masked_lm_prob_until, progress)


# --------------------------------------------------------------------------------------------
# On-disk data


class Split:
    """One split (train / validation): its shards memory-mapped, addressed by a global index."""

    def __init__(self, root: str, name: str, info: dict, files: tuple = SHARD_FILES):
        self.name = name
        self.shards = []
        for shard in info["shards"]:
            path = os.path.join(root, shard["path"])
            arrays = {}
            for key in files:
                file = os.path.join(path, key + ".npy")
                if not os.path.isfile(file):
                    raise DataError(
                        f"{file} is missing: the prepared data in {root} is incomplete; "
                        f"run bert-prep again into a fresh output_dir"
                    )
                try:
                    arrays[key] = np.load(file, mmap_mode="r")
                except (ValueError, OSError) as exc:
                    raise DataError(f"cannot read {file} ({exc}); re-run bert-prep") from None
            n = int(shard["num_instances"])
            if any(a.shape[0] != n for a in arrays.values()):
                raise DataError(
                    f"{path}: arrays do not hold num_instances={n} rows as manifest.json says; "
                    f"the data is corrupt, re-run bert-prep"
                )
            self.shards.append(arrays)
        self.offsets = np.cumsum([0] + [s["input_ids"].shape[0] for s in self.shards])
        self.num_instances = int(self.offsets[-1])
        if self.num_instances != int(info["num_instances"]):
            raise DataError(f"{root}: split {name!r} shard sizes do not add up to num_instances")

    def gather(self, indices: np.ndarray) -> dict:
        """Rows `indices` (global within the split) of every array, in the order given."""
        shard_of = np.searchsorted(self.offsets, indices, side="right") - 1
        out = {}
        for s in np.unique(shard_of):
            sel = np.nonzero(shard_of == s)[0]
            local = indices[sel] - self.offsets[s]
            # Sorted row reads are sequential on disk; the result is put back in batch order.
            order = np.argsort(local, kind="stable")
            for key, arr in self.shards[s].items():
                rows = np.asarray(arr[local[order]])
                if key not in out:
                    out[key] = np.empty((len(indices),) + rows.shape[1:], dtype=rows.dtype)
                out[key][sel[order]] = rows
        return out


class PreparedData:
    """A `bert-prep` output directory, validated against the manifest contract."""

    def __init__(self, root: str):
        self.root = root
        manifest_path = os.path.join(root, MANIFEST)
        if os.path.isfile(root):
            raise DataError(not_prepared_data(root))
        if not os.path.isdir(root):
            raise DataError(f"data.dir {root!r} does not exist; run bert-prep with "
                            f"output_dir={root} first, or point data.dir at its output")
        if not os.path.isfile(manifest_path):
            raise DataError(f"{root} has no {MANIFEST}: it is not bert-prep output or bert-prep "
                            f"did not finish; run bert-prep again")
        try:
            with open(manifest_path, encoding="utf-8") as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {manifest_path} ({exc}); run bert-prep again") from None
        m = self.manifest
        if m.get("complete") is not True:
            raise DataError(f"{manifest_path} says the data is incomplete (complete != true); "
                            f"let bert-prep finish or run it again")
        if m.get("format_version") not in FORMAT_VERSIONS:
            raise DataError(f"{manifest_path} has format_version {m.get('format_version')!r}, this "
                            f"trainer reads {' and '.join(map(str, FORMAT_VERSIONS))}; re-run "
                            f"bert-prep with this version")
        self.objective = m.get("objective", "mlm_nsp")
        if self.objective not in OBJECTIVES:
            raise DataError(f"{manifest_path} has objective {self.objective!r}, this trainer "
                            f"reads {' and '.join(OBJECTIVES)}; re-run bert-prep with this "
                            f"version")
        try:
            self.max_seq_length = int(m["max_seq_length"])
            self.max_predictions = int(m["max_predictions_per_seq"])
            self.vocab_size = int(m["vocab_size"])
            self.special = {k: int(v) for k, v in m["special_token_ids"].items()}
            self.tokenizer_dir = _own_dir(root, m["tokenizer"]["path"], manifest_path)
            self.tokenizer_sha256 = m["tokenizer"].get("sha256")
            self.masking = m.get("masking", {})
            splits = m["splits"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{manifest_path} lacks a required key ({exc}); re-run bert-prep") \
                from None
        self._splits_info = splits
        self._split_cache: dict = {}

    def split(self, name: str) -> Split:
        if name not in self._splits_info:
            raise DataError(f"split {name!r} is not in {self.root}/{MANIFEST} (it has "
                            f"{sorted(self._splits_info)}); set data.train_split/eval_split")
        if name not in self._split_cache:
            split = Split(self.root, name, self._splits_info[name], OBJECTIVES[self.objective])
            if split.num_instances == 0:
                raise DataError(f"split {name!r} of {self.root} is empty; prepare more text")
            self._split_cache[name] = split
        return self._split_cache[name]

    @property
    def has_nsp(self) -> bool:
        """Whether instances are sentence pairs with NSP labels (False: MLM-only data)."""
        return self.objective == "mlm_nsp"

    def next_sentence_prediction(self, requested: Optional[bool]) -> bool:
        """The model's `next_sentence_prediction` for this data: `requested` (model.* setting)
        or, when null, whether the data has NSP labels.  An NSP head needs NSP labels; an
        MLM-only model may train on pair data (its NSP labels are left unused)."""
        if requested is None:
            return self.has_nsp
        if requested and not self.has_nsp:
            raise DataError(f"model.next_sentence_prediction=true but {self.root} is MLM-only "
                            f"data (bert-prep packing={self.manifest.get('packing')}, no NSP "
                            f"labels); set model.next_sentence_prediction=null (take it from the "
                            f"data) or prepare the data with packing=nsp_pairs")
        return bool(requested)

    def vocab(self) -> list:
        """The tokenizer's vocabulary (token strings by id) from tokenizer/vocab.txt."""
        vocab_file = os.path.join(self.tokenizer_dir, "vocab.txt")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = [line.rstrip("\n") for line in f]
        except OSError as exc:
            raise DataError(f"cannot read {vocab_file} ({exc}); re-run bert-prep") from None
        if len(vocab) < self.vocab_size:
            raise DataError(f"{vocab_file} has {len(vocab)} tokens but manifest.json says "
                            f"vocab_size={self.vocab_size}; re-run bert-prep")
        return vocab[:self.vocab_size]


def not_prepared_data(path: str) -> str:
    """The error for a data.dir that is a file: bert-train reads the folder bert-prep writes,
    and a text file is what bert-prep reads, so say how to make one from the other."""
    folder = os.path.dirname(path) or "."
    if os.path.basename(path) == MANIFEST:
        return (f"data.dir {path!r} is bert-prep's {MANIFEST}; point data.dir at the folder "
                f"that holds it: data.dir={folder}")
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        import codecs

        codecs.getincrementaldecoder("utf-8")().decode(head)  # (a cut character is no error)
        text = b"\0" not in head
    except (OSError, UnicodeDecodeError):
        text = False
    if not text:
        return (f"data.dir {path!r} is a file, not a folder; bert-train reads the folder "
                f"bert-prep writes ({MANIFEST} and shards): point data.dir at it")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.splitext(os.path.basename(path))[0]) or "text"
    return (f"data.dir {path!r} is a text file; bert-train reads the folder bert-prep makes from "
            f"text: bert-prep corpus=documents corpus.document_per=blank_line "
            f"corpus.paths='[{path}]' output_dir=prepared/{name}, then bert-train "
            f"data.dir=prepared/{name} (corpus=text instead of corpus=documents "
            f"corpus.document_per=blank_line if the file is one sentence a line)")


def _own_dir(root: str, rel, manifest_path: str) -> str:
    """The tokenizer directory the manifest names, which must be the data directory's own: a
    path that leaves it (absolute, '..', a link out) or holds links would be copied into every
    checkpoint and shipped by every export."""
    import stat

    path = os.path.join(root, rel) if isinstance(rel, str) else None
    if path is None or os.path.isabs(rel) or not os.path.realpath(path).startswith(
            os.path.join(os.path.realpath(root), "")):
        raise DataError(f"{manifest_path}: tokenizer.path {rel!r} is not a directory inside "
                        f"{root}; the tokenizer must be the data directory's own files (re-run "
                        f"bert-prep, or copy the tokenizer into {root} and name it relatively)")
    if os.path.isdir(path):
        for name in os.listdir(path):
            mode = os.lstat(os.path.join(path, name)).st_mode
            if not stat.S_ISREG(mode):
                raise DataError(f"{os.path.join(path, name)} is "
                                f"{'a symbolic link' if stat.S_ISLNK(mode) else 'not a file'}; "
                                f"the tokenizer directory must hold only its own files (it is "
                                f"copied into every checkpoint): replace it by the file or "
                                f"remove it")
    return path


# --------------------------------------------------------------------------------------------
# Counter-based randomness (splitmix64): a pure function of its inputs, vectorised in numpy.

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


def hash_uniform(seed: int, stream: int, epoch: np.ndarray, index: np.ndarray,
                 position: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from (seed, stream, epoch, index, position), broadcast."""
    with np.errstate(over="ignore"):
        h = _mix(np.full((), (seed << 8) ^ stream, dtype=np.uint64))
        h = _mix(h ^ np.asarray(epoch, dtype=np.uint64))
        h = _mix(h ^ np.asarray(index, dtype=np.uint64))
        h = _mix(h ^ np.asarray(position, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Masking and collation


class Masker:
    """Dynamic MLM masking with the rules bert-prep uses (data_prep/masking.py), vectorised over a
    batch, with counter-based randomness instead of a sequential RNG.

    Per sequence: predict min(cap, max(1, rint(length * prob))) tokens (length counts
    [CLS]/[SEP], as Google) among non-special tokens ([CLS] [SEP] [PAD] [MASK] [UNK] and bracketed
    placeholders like [unused0] are never predicted); of those, 80% become [MASK], 10% a random
    non-special token, 10% stay.  With whole-word masking, words (a token and its '##' pieces) are
    taken whole in random order while they fit the budget, and the 80/10/10 choice is per word.

    The cap is bert-prep's max_predictions_per_seq scaled by prob / bert-prep's masked_lm_prob:
    at bert-prep's own rate it is the same budget as the static masks, and a higher rate raises
    it (prep at 128/20 with a fixed cap of 20 would predict 15.9% of tokens at prob 0.4).

    The rate is `masked_lm_prob` unless a call passes its own (a schedule over training): the
    draws do not depend on it, so a rate is all that differs between two calls' choices.
    """

    def __init__(self, data: PreparedData, seed: int, masked_lm_prob: Optional[float]):
        self.seed = seed
        self.prep_prob = float(data.masking.get("masked_lm_prob", 0.15))
        self.prep_max_predictions = data.max_predictions
        self.prob = masked_lm_prob or self.prep_prob
        self.mask_id = data.special["mask"]
        vocab = data.vocab()
        self.special = np.array([bool(re.fullmatch(r"\[[^\[\]\s]+\]", t)) for t in vocab])
        self.special[list(data.special.values())] = True
        self.whole_word = bool(data.masking.get("whole_word_mask", False))
        self.continuation = np.array([t.startswith("##") for t in vocab])
        self.random_pool = np.nonzero(~self.special)[0]

    def max_predictions(self, prob: float) -> int:
        return int(np.ceil(self.prep_max_predictions * prob / self.prep_prob - 1e-9))

    def __call__(self, ids: np.ndarray, lengths: np.ndarray, epoch: np.ndarray,
                 index: np.ndarray, prob: Optional[float] = None):
        """Returns (masked ids [B, L], labels [B, L] with IGNORE_INDEX where not predicted);
        `prob`: this call's masking rate (default: the masker's)."""
        return self.apply(self.draw(ids, lengths, epoch, index), prob)

    def draw(self, ids: np.ndarray, lengths: np.ndarray, epoch: np.ndarray,
             index: np.ndarray) -> dict:
        """Everything of a masking that does not depend on the rate: which tokens may be
        predicted, their order of choice, and what each would become. `apply` then takes a
        rate; the split lets a worker process draw the next steps' masks before their rates
        are known (a time budget sets them from the clock), with the same result. Its arrays
        are kept in the narrowest types that hold them: they cross to the trainer in shared
        memory (prefetch.py)."""
        b, seq = ids.shape
        pos = np.arange(seq)[None, :]
        e, i = epoch[:, None], index[:, None]
        token = np.uint16 if len(self.special) <= 1 << 16 else np.int32
        place = np.int16 if seq < 1 << 15 else np.int64
        candidate = (pos < lengths[:, None]) & ~self.special[ids]
        out = {"ids": ids.astype(token), "lengths": lengths, "candidate": candidate,
               "candidates": candidate.sum(1)}
        decide_at = np.broadcast_to(pos, (b, seq))
        if self.whole_word:
            words, decide_at = self._word_order(ids, candidate, e, i, pos)
            out["words"] = tuple(w.astype(place) for w in words)
        else:
            score = hash_uniform(self.seed, 1, e, i, pos)
            score = np.where(candidate, score, np.inf)
            rank = np.empty((b, seq), dtype=np.int64)
            np.put_along_axis(rank, np.argsort(score, axis=1, kind="stable"),
                              np.broadcast_to(pos, (b, seq)), axis=1)
            out["rank"] = rank.astype(place)
        action = hash_uniform(self.seed, 2, e, i, decide_at)
        pick = hash_uniform(self.seed, 3, e, i, pos)
        replacement = self.random_pool[(pick * len(self.random_pool)).astype(np.int64)]
        # What a chosen token becomes: 80% [MASK], 10% a random token, 10% itself.
        out["swapped"] = np.where(action < 0.8, self.mask_id,
                                  np.where(action >= 0.9, replacement, ids)).astype(token)
        return out

    def apply(self, drawn: dict, prob: Optional[float] = None):
        """`draw`'s masking at rate `prob` (default: the masker's): (masked ids, labels)."""
        prob = self.prob if prob is None else prob
        ids, lengths = drawn["ids"].astype(np.int64), drawn["lengths"]
        num_predict = np.minimum(self.max_predictions(prob),
                                 np.maximum(1, np.rint(lengths * prob))).astype(np.int64)
        num_predict = np.minimum(num_predict, drawn["candidates"])
        if self.whole_word:
            chosen = self._choose_words(drawn["candidate"], num_predict, *drawn["words"])
        else:
            chosen = drawn["candidate"] & (drawn["rank"] < num_predict[:, None])
        out = np.where(chosen, drawn["swapped"].astype(np.int64), ids)
        labels = np.where(chosen, ids, IGNORE_INDEX)
        return out, labels

    def _word_order(self, ids, candidate, e, i, pos):
        """Whole-word masking's draw: ((each token's word start, words' random order, their
        lengths in that order), each token's word start, where its 80/10/10 is decided)."""
        b, seq = ids.shape
        is_start = candidate & ~(self.continuation[ids] & np.roll(candidate, 1, axis=1))
        start = np.maximum.accumulate(np.where(is_start | ~candidate, pos, 0), axis=1)
        rows = np.arange(b)[:, None]
        word_len = np.zeros((b, seq), dtype=np.int64)
        np.add.at(word_len, (np.broadcast_to(rows, (b, seq))[candidate], start[candidate]), 1)
        score = np.where(is_start, hash_uniform(self.seed, 1, e, i, pos), np.inf)
        order = np.argsort(score, axis=1, kind="stable")
        sorted_len = np.take_along_axis(np.where(is_start, word_len, 0), order, axis=1)
        return (start, order, sorted_len), start

    @staticmethod
    def _choose_words(candidate, num_predict, start, order, sorted_len):
        """Google's rule: words in random order, each taken whole if it still fits the budget
        (a word that does not fit is skipped, later shorter ones may still fit).  The loop runs
        over word ranks, vectorised over the batch."""
        b, seq = candidate.shape
        taken = np.zeros((b, seq), dtype=bool)
        count = np.zeros(b, dtype=np.int64)
        for k in range(seq):
            length = sorted_len[:, k]
            if not length.any():
                break
            fits = (length > 0) & (count + length <= num_predict)
            count += np.where(fits, length, 0)
            taken[:, k] = fits
        chosen_start = np.zeros((b, seq), dtype=bool)
        np.put_along_axis(chosen_start, order, taken, axis=1)
        return candidate & np.take_along_axis(chosen_start, start, axis=1)


def collate(rows: dict, pad_to_multiple_of: int, masked=None) -> dict:
    """numpy rows from `Split.gather` -> model inputs (torch, long), cut to the longest row.

    `masked`: optional (input_ids, labels) from dynamic masking; otherwise the static masks.
    MLM-only rows (no segment_a_lengths, no next_sentence_labels) give token type 0 everywhere
    (one segment, as RoBERTa) and no next_sentence_label.
    """
    lengths = rows["lengths"].astype(np.int64)
    seq = int(lengths.max())
    seq = min(rows["input_ids"].shape[1], -(-seq // pad_to_multiple_of) * pad_to_multiple_of)
    pos = np.arange(seq)[None, :]
    if masked is None:
        ids = rows["input_ids"][:, :seq].astype(np.int64)
        labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
        mpos = rows["masked_positions"].astype(np.int64)
        valid = mpos > 0  # position 0 is [CLS], never predicted: 0 marks padding slots
        r, c = np.nonzero(valid)
        labels[r, mpos[r, c]] = rows["masked_labels"][r, c]
    else:
        ids, labels = masked[0][:, :seq].astype(np.int64), masked[1][:, :seq].astype(np.int64)
    real = pos < lengths[:, None]
    if "segment_a_lengths" in rows:
        types = (pos >= rows["segment_a_lengths"].astype(np.int64)[:, None]) & real
    else:
        types = np.zeros(ids.shape, dtype=bool)
    batch = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(real.astype(np.int64)),
        "token_type_ids": torch.from_numpy(types.astype(np.int64)),
        "labels": torch.from_numpy(labels),
    }
    if "next_sentence_labels" in rows:
        batch["next_sentence_label"] = torch.from_numpy(
            rows["next_sentence_labels"].astype(np.int64))
    return batch


def unmasked_ids(rows: dict) -> np.ndarray:
    """The original sequence: static masks undone by writing the labels back."""
    ids = rows["input_ids"].astype(np.int64)
    mpos = rows["masked_positions"].astype(np.int64)
    r, c = np.nonzero(mpos > 0)
    ids[r, mpos[r, c]] = rows["masked_labels"][r, c]
    return ids


# --------------------------------------------------------------------------------------------
# The training stream


@dataclass
class DataPosition:
    """Where the stream is: global samples consumed since the start of training."""

    samples_consumed: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)


class TrainStream:
    """Yields, per optimizer step, this rank's micro-batches of the next global batch.

    The global batch is trainer.global_batch_size, or during a batch warmup (data.batch_warmup_*)
    `ramp.size_at(samples consumed)`: then a step has `size / (world x micro)` micro-batches,
    a number that grows during the warmup and is the same on every process."""

    def __init__(self, data: PreparedData, cfg: DataConfig, seed: int, global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int, samples_consumed: int = 0,
                 prefetch: bool = False, warn: Optional[Callable[[str], None]] = None):
        self.ramp = batch_ramp(cfg.batch_warmup_start, cfg.batch_warmup_tokens,
                               cfg.batch_warmup_lr_scaling, global_batch_size,
                               data.max_seq_length)
        self.ramp.check_divisible(world_size, micro_batch_size)
        self.split = data.split(cfg.train_split)
        self.cfg = cfg
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.world_size, self.rank = world_size, rank
        self.accumulation_steps = global_batch_size // (world_size * micro_batch_size)
        """Micro-batches per process of a full-size step (fewer during a batch warmup)."""
        self.position = DataPosition(samples_consumed)
        self.masker = Masker(data, seed, cfg.masked_lm_prob) if cfg.masking == "dynamic" else None
        self._perm_epoch, self._perm = -1, None
        self.prefetch = prefetch
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=2))
        """Where a lost prefetching worker is reported (the trainer: its log)."""
        self.data_root = data.root
        self._ahead, self._held = None, None

    @property
    def epoch(self) -> float:
        return self.position.samples_consumed / self.split.num_instances

    def batch_size(self, samples_consumed: Optional[int] = None) -> int:
        """The global batch of the step that starts at `samples_consumed` (default: the next)."""
        at = self.position.samples_consumed if samples_consumed is None else samples_consumed
        return self.ramp.size_at(at)

    def lr_factor(self, samples_consumed: Optional[int] = None) -> float:
        """The batch warmup's learning-rate multiplier for that step (1 without a warmup)."""
        at = self.position.samples_consumed if samples_consumed is None else samples_consumed
        return self.ramp.lr_factor(at)

    def masking_rate(self, progress: Optional[float] = None) -> Optional[float]:
        """The dynamic masking rate at `progress`; None with static masks."""
        if self.masker is None:
            return None
        return self.cfg.masking_rate(self.masker.prep_prob, progress)

    def _instances(self, start: int, count: int):
        """(epoch, instance index) of global samples start .. start+count-1."""
        n = self.split.num_instances
        k = np.arange(start, start + count, dtype=np.int64)
        epochs = k // n
        index = np.empty_like(k)
        for e in np.unique(epochs):
            if e != self._perm_epoch:
                self._perm_epoch, self._perm = int(e), epoch_permutation(self.seed, int(e), n)
            sel = epochs == e
            index[sel] = self._perm[k[sel] % n]
        return epochs, index

    def micro_batches(self, start: int, progress: Optional[float] = None) -> list:
        """This rank's micro-batches of the global batch starting at global sample `start`;
        `progress` (share of training done) sets a scheduled masking rate."""
        return self._finish(self._prepare(start), self.masking_rate(progress))

    def _prepare(self, start: int) -> list:
        """What the batches at `start` are made of before a masking rate is known: the rows
        read from the shards and the masks' draws (Masker.draw)."""
        per_rank = self.ramp.size_at(start) // self.world_size
        epochs, index = self._instances(start + self.rank * per_rank, per_rank)
        out = []
        for j in range(0, per_rank, self.micro_batch_size):
            e, idx = epochs[j:j + self.micro_batch_size], index[j:j + self.micro_batch_size]
            rows = self.split.gather(idx)
            drawn = None
            if self.masker is not None:
                drawn = self.masker.draw(unmasked_ids(rows), rows["lengths"].astype(np.int64),
                                         e, idx)
            out.append((rows, drawn))
        return out

    def _finish(self, prepared: list, prob: Optional[float]) -> list:
        out = []
        for rows, drawn in prepared:
            masked = None if drawn is None else self.masker.apply(drawn, prob)
            batch = collate(rows, self.cfg.pad_to_multiple_of, masked)
            batch["num_tokens"] = int(rows["lengths"].astype(np.int64).sum())
            out.append(batch)
        return out

    def next_step(self, progress: Optional[float] = None) -> list:
        """Micro-batches for the next optimizer step; advances the position by its global batch.
        `progress`: the step's share of training (step / max_steps, or elapsed / budget), the
        same on every process; needed only by a masking-rate schedule.

        With `prefetch`, a worker process reads the following steps' rows and draws their masks
        (prefetch.py) while this one trains; only the rate is applied here. The batches are the
        same either way, bit for bit."""
        start = self.position.samples_consumed
        held, self._held = self._held, None
        prepared = held[1] if held is not None and held[0] == start else None
        if prepared is None and self._ahead is not None:
            prepared = self._take_ahead(start)
        if prepared is None:  # the first step, or the position moved (a resume)
            prepared = self._prepare(start)
            if self.prefetch:
                self._start_worker(start, prepared)
        self.position.samples_consumed = start + self.ramp.size_at(start)
        return self._finish(prepared, self.masking_rate(progress))

    def _take_ahead(self, start: int):
        """The worker's step at `start`, or None. A worker that died (the OOM killer, an
        operator) is not restarted: the steps from here on are read on this thread, the same
        batches, and the run goes on (a resumed run starts a new worker)."""
        from .prefetch import WorkerLost

        try:
            return self._ahead.take(start)
        except WorkerLost as exc:
            self.close()
            self.prefetch = False
            self.warn(f"the process reading batches ahead stopped ({exc}); the training thread "
                      f"reads them from here on (the same batches; a resumed run starts a new "
                      f"worker)")
            return None

    def start_prefetching(self) -> None:
        """With `prefetch`, start the worker now, before the first step needs it: its start-up
        (a fresh interpreter importing torch, seconds) then overlaps the trainer's last set-up
        and first step. The step at the position is prepared here and kept for next_step."""
        if self.prefetch and self._ahead is None:
            start = self.position.samples_consumed
            prepared = self._prepare(start)
            self._start_worker(start, prepared)
            self._held = (start, prepared)

    def _start_worker(self, start: int, prepared: list) -> None:
        """A worker reading from the step after `start` (whose `prepared` batches size its
        shared memory)."""
        from .prefetch import Prefetcher, slot_bytes

        self.close()
        rows = self.ramp.size_at(start) // self.world_size
        self._ahead = Prefetcher(self._params(), start + self.ramp.size_at(start),
                                 self.ramp.size_at,
                                 slot_bytes(prepared, rows, self.ramp.final // self.world_size))

    def _params(self) -> dict:
        """What a worker needs to make this stream again (prefetch.py): small and picklable."""
        return {"root": self.data_root, "cfg": self.cfg, "seed": self.seed,
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size,
                "rank": self.rank}

    def close(self) -> None:
        """Stop the prefetching worker, if one runs."""
        ahead, self._ahead, self._held = self._ahead, None, None
        if ahead is not None:
            ahead.close()


def eval_batches(data: PreparedData, cfg: DataConfig, batch_size: int, world_size: int,
                 rank: int, max_samples: Optional[int]):
    """The held-out split with its static masks (comparable across runs), split over ranks (no
    padding duplicates: ranks may get one batch fewer, the metrics are token-weighted sums).
    With max_samples, an evenly spaced subset: instances are stored in document order, so the
    first N would all come from the first few documents."""
    split = data.split(cfg.eval_split)
    total = split.num_instances
    if max_samples is None or max_samples >= total:
        chosen = np.arange(total, dtype=np.int64)
    else:
        chosen = np.floor(np.arange(max_samples) * (total / max_samples)).astype(np.int64)
    for start in range(rank * batch_size, len(chosen), world_size * batch_size):
        yield collate(split.gather(chosen[start:start + batch_size]), cfg.pad_to_multiple_of)
