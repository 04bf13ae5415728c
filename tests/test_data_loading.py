"""The prepared-data reader: manifest checks, order, per-rank slices, collation, dynamic masks."""

import json
import os

import numpy as np
import pytest
import torch

from bert_pretrain.components.data import (DataConfig, Masker, PreparedData, TrainStream, collate,
                                eval_batches, unmasked_ids)
from bert_pretrain.errors import DataError
from train_support import write_prepared


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=50, num_valid=10,
                          shards=3)


def _stream(root, world=1, rank=0, global_batch=12, micro=None, masking="static", pos=0):
    data = PreparedData(root)
    return TrainStream(data, DataConfig(dir=root, masking=masking), seed=7,
                       global_batch_size=global_batch,
                       micro_batch_size=micro or global_batch // world,
                       world_size=world, rank=rank, samples_consumed=pos)


def _rows(batches):
    """The (unmasked) token rows of a list of micro-batches, for identity comparisons."""
    out = []
    for b in batches:
        ids = b["input_ids"].clone()
        keep = b["labels"] != -100
        ids[keep] = b["labels"][keep]
        for row, n in zip(ids, b["attention_mask"].sum(1)):
            out.append(tuple(row[:n].tolist()))
    return out


def test_refuses_missing_and_incomplete_data(tmp_path, prepared):
    with pytest.raises(DataError, match="does not exist; run bert-prep"):
        PreparedData(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="has no manifest.json"):
        PreparedData(str(empty))
    half = write_prepared(str(tmp_path / "half"), num_train=8, num_valid=4)
    manifest = json.load(open(os.path.join(half, "manifest.json")))
    manifest["complete"] = False
    json.dump(manifest, open(os.path.join(half, "manifest.json"), "w"))
    with pytest.raises(DataError, match="incomplete"):
        PreparedData(half)
    gone = write_prepared(str(tmp_path / "gone"), num_train=8, num_valid=4)
    os.remove(os.path.join(gone, "train", "shard-00001", "masked_labels.npy"))
    with pytest.raises(DataError, match="masked_labels.npy is missing"):
        PreparedData(gone).split("train")


def test_static_collation_reproduces_the_prepared_instances(prepared):
    data = PreparedData(prepared)
    split = data.split("train")
    idx = np.array([3, 41, 17, 0])
    rows = split.gather(idx)
    batch = collate(rows, pad_to_multiple_of=8)
    shard0 = np.load(os.path.join(prepared, "train/shard-00000/input_ids.npy"))
    assert batch["input_ids"][0, :4].tolist() == shard0[3, :4].tolist()
    for i in range(len(idx)):
        n = int(rows["lengths"][i])
        assert batch["attention_mask"][i].sum() == n
        a = int(rows["segment_a_lengths"][i])
        assert batch["token_type_ids"][i, :a].sum() == 0 and batch["token_type_ids"][i, a:n].all()
        labelled = (batch["labels"][i] != -100).nonzero().squeeze(1).tolist()
        k = int((rows["masked_positions"][i] > 0).sum())
        assert labelled == rows["masked_positions"][i, :k].tolist()
        assert batch["labels"][i, labelled].tolist() == rows["masked_labels"][i, :k].tolist()
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[1] <= 32


def test_order_is_seeded_covers_each_epoch_once_and_crosses_epochs(prepared):
    s = _stream(prepared, global_batch=10)
    first = [r for _ in range(5) for r in _rows(s.next_step())]   # exactly one epoch (50)
    assert len(first) == 50
    data = PreparedData(prepared)
    all_rows = set(_rows([collate(data.split("train").gather(np.arange(50)), 8)]))
    assert set(first) == all_rows
    again = _stream(prepared, global_batch=10)
    assert [r for _ in range(5) for r in _rows(again.next_step())] == first
    second = [r for _ in range(5) for r in _rows(s.next_step())]
    assert set(second) == all_rows and second != first          # a new permutation per epoch
    other_seed = TrainStream(data, DataConfig(dir=prepared), seed=8, global_batch_size=10,
                             micro_batch_size=10, world_size=1, rank=0)
    assert _rows(other_seed.next_step()) != first[:10]


def test_ranks_take_disjoint_slices_that_equal_single_process_micro_batches(prepared):
    single = _stream(prepared, world=1, global_batch=12, micro=3)
    ranks = [_stream(prepared, world=2, rank=r, global_batch=12, micro=3) for r in range(2)]
    assert single.accumulation_steps == 4 and ranks[0].accumulation_steps == 2
    for _ in range(7):  # crosses the epoch boundary at 50 samples
        one = single.next_step()
        two = [b for r in ranks for b in r.next_step()]
        assert len(one) == len(two) == 4
        for a, b in zip(one, two):
            for key in a:
                if key == "num_tokens":
                    assert a[key] == b[key]
                else:
                    assert torch.equal(a[key], b[key])
        r0, r1 = _rows(two[:2]), _rows(two[2:])
        assert len(r0) == len(r1) == 6


def test_position_resume_is_o1_and_world_size_independent(prepared):
    s = _stream(prepared, global_batch=12, micro=4)
    for _ in range(3):
        s.next_step()
    expected = s.next_step()
    # resume at the same global sample count, with 3 processes instead of 1
    resumed = [_stream(prepared, world=3, rank=r, global_batch=12, micro=4, pos=36)
               for r in range(3)]
    got = [b for r in resumed for b in r.next_step()]
    assert _rows(got) == _rows(expected)


def test_global_batch_must_divide(prepared):
    with pytest.raises(DataError, match="not divisible"):
        _stream(prepared, world=2, global_batch=10, micro=4)


def test_dynamic_masking_follows_bert_rules_statistically(tmp_path):
    root = write_prepared(str(tmp_path / "p"), num_train=400, num_valid=4, seq=64, max_pred=20,
                          vocab_size=200)
    data = PreparedData(root)
    split = data.split("train")
    rows = split.gather(np.arange(400))
    ids = unmasked_ids(rows)
    lengths = rows["lengths"].astype(np.int64)
    masker = Masker(data, seed=3, masked_lm_prob=0.15)
    out, labels = masker(ids, lengths, np.zeros(400, np.int64), np.arange(400))
    chosen = labels != -100
    # count per row: round(length * 0.15), at least 1, at most max_predictions
    expected = np.minimum(20, np.maximum(1, np.rint(lengths * 0.15)))
    assert (chosen.sum(1) == expected).all()
    # never special tokens or padding; labels are the original tokens
    assert (ids[chosen] > 4).all()
    assert (labels[chosen] == ids[chosen]).all()
    n = chosen.sum()
    frac_mask = (out[chosen] == 4).mean()
    frac_kept = (out[chosen] == ids[chosen]).mean()
    assert abs(frac_mask - 0.8) < 0.03, frac_mask
    assert abs(frac_kept - 0.1) < 0.025 + 1 / 200, frac_kept  # random may hit the same id
    assert n > 1500
    assert (out[~chosen] == ids[~chosen]).all()
    # positions are spread over the sequence, not biased to the front
    pos = np.nonzero(chosen)[1]
    rel = pos / lengths[np.nonzero(chosen)[0]]
    assert 0.4 < rel.mean() < 0.6
    # deterministic, a new mask per epoch
    out2, labels2 = masker(ids, lengths, np.zeros(400, np.int64), np.arange(400))
    assert (out2 == out).all() and (labels2 == labels).all()
    _, labels3 = masker(ids, lengths, np.ones(400, np.int64), np.arange(400))
    assert ((labels3 != -100) != chosen).any(axis=1).mean() > 0.9


def test_dynamic_masking_identical_across_world_sizes(prepared):
    one = _stream(prepared, world=1, global_batch=10, micro=5, masking="dynamic")
    two = [_stream(prepared, world=2, rank=r, global_batch=10, micro=5, masking="dynamic")
           for r in range(2)]
    for _ in range(6):
        a = one.next_step()
        b = [x for r in two for x in r.next_step()]
        for x, y in zip(a, b):
            assert torch.equal(x["input_ids"], y["input_ids"])
            assert torch.equal(x["labels"], y["labels"])


def test_whole_word_masking_takes_whole_words(tmp_path):
    root = write_prepared(str(tmp_path / "w"), num_train=200, num_valid=4, seq=64, max_pred=20,
                          vocab_size=200, whole_word=True)
    data = PreparedData(root)
    rows = data.split("train").gather(np.arange(200))
    ids = unmasked_ids(rows)
    lengths = rows["lengths"].astype(np.int64)
    masker = Masker(data, seed=1, masked_lm_prob=0.15)
    assert masker.whole_word
    _, labels = masker(ids, lengths, np.zeros(200, np.int64), np.arange(200))
    cont = np.array([t.startswith("##") for t in data.vocab()])
    chosen = labels != -100
    for i in range(200):
        n = lengths[i]
        budget = min(20, max(1, int(np.rint(n * 0.15))))
        words, current = [], None  # (start, length) of each maskable word
        for j in range(1, n):
            if ids[i, j] <= 4:
                current = None
                continue
            if current is not None and cont[ids[i, j]]:
                current[1] += 1
            else:
                current = [j, 1]
                words.append(current)
        taken = 0
        for s, length in words:  # each word entirely in or entirely out
            assert chosen[i, s:s + length].all() or not chosen[i, s:s + length].any()
            taken += length if chosen[i, s] else 0
        assert taken == chosen[i].sum() <= budget
        # greedy: no unchosen word would still have fit
        assert all(chosen[i, s] or taken + length > budget for s, length in words)


def test_eval_batches_cover_split_once_across_ranks(prepared):
    data = PreparedData(prepared)
    cfg = DataConfig(dir=prepared)
    one = [b for b in eval_batches(data, cfg, 3, 1, 0, None)]
    two = [b for r in range(2) for b in eval_batches(data, cfg, 3, 2, r, None)]
    assert sorted(_rows(one)) == sorted(_rows(two))
    assert sum(len(b["input_ids"]) for b in one) == 10
    subset = list(eval_batches(data, cfg, 4, 1, 0, 6))
    assert sum(len(b["input_ids"]) for b in subset) == 6
    # evenly spaced over the split, not its first 6 rows
    expected = collate(data.split("validation").gather(np.array([0, 1, 3, 5, 6, 8])), 8)
    assert _rows(subset) == _rows([expected])


def _disk(root, split="train"):
    """Every array of a split, read straight from the .npy files in manifest order."""
    manifest = json.load(open(os.path.join(root, "manifest.json")))
    shards = manifest["splits"][split]["shards"]
    return {key: np.concatenate([np.load(os.path.join(root, s["path"], key + ".npy"))
                                 for s in shards])
            for key in ("input_ids", "lengths", "segment_a_lengths", "masked_positions",
                        "masked_labels", "next_sentence_labels")}


def _expected_batch(disk, idx, seq):
    """What the model must see for rows `idx`, built from the arrays by hand."""
    n = len(idx)
    ids = disk["input_ids"][idx, :seq].astype(np.int64)
    labels = np.full((n, seq), -100)
    types = np.zeros((n, seq), np.int64)
    mask = np.zeros((n, seq), np.int64)
    for r, i in enumerate(idx):
        length, a = int(disk["lengths"][i]), int(disk["segment_a_lengths"][i])
        mask[r, :length] = 1
        types[r, a:length] = 1
        for p, lab in zip(disk["masked_positions"][i], disk["masked_labels"][i]):
            if p > 0:
                labels[r, p] = lab
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels,
            "next_sentence_label": disk["next_sentence_labels"][idx].astype(np.int64)}


@pytest.mark.parametrize("world", [1, 2])
def test_training_batches_equal_the_arrays_on_disk(prepared, world):
    """Every field of every micro-batch, next_sentence_label included, against the .npy files
    (rows in the seeded epoch order, cut per rank and micro-batch)."""
    from bert_pretrain.components.data import epoch_permutation
    disk = _disk(prepared)
    assert 0 < disk["next_sentence_labels"].mean() < 1      # both labels occur
    perm = epoch_permutation(7, 0, 50)
    streams = [_stream(prepared, world=world, rank=r, global_batch=12, micro=3)
               for r in range(world)]
    for step in range(4):
        got = [b for s in streams for b in s.next_step()]
        order = perm[step * 12:(step + 1) * 12]
        assert len(got) == 4
        for j, batch in enumerate(got):
            want = _expected_batch(disk, order[3 * j:3 * j + 3], batch["input_ids"].shape[1])
            assert set(batch) == set(want) | {"num_tokens"}
            for key, value in want.items():
                assert batch[key].tolist() == value.tolist(), (step, j, key)
            assert batch["num_tokens"] == int(want["attention_mask"].sum())


def test_eval_batches_equal_the_arrays_on_disk(prepared):
    disk = _disk(prepared, "validation")
    data = PreparedData(prepared)
    batches = list(eval_batches(data, DataConfig(dir=prepared), 4, 1, 0, None))
    start = 0
    for batch in batches:
        idx = np.arange(start, start + len(batch["input_ids"]))
        want = _expected_batch(disk, idx, batch["input_ids"].shape[1])
        for key, value in want.items():
            assert batch[key].tolist() == value.tolist(), key
        start += len(idx)
    assert start == 10


def test_dynamic_whole_word_masking_decides_80_10_10_per_word(tmp_path):
    """Each chosen word is all [MASK], all kept or all random tokens, and words split
    80/10/10 (Google's whole-word rule; deciding per token would mix them inside words)."""
    root = write_prepared(str(tmp_path / "w"), num_train=600, num_valid=4, seq=64, max_pred=20,
                          vocab_size=400, whole_word=True)
    data = PreparedData(root)
    rows = data.split("train").gather(np.arange(600))
    ids = unmasked_ids(rows)
    lengths = rows["lengths"].astype(np.int64)
    cont = np.array([t.startswith("##") for t in data.vocab()])
    out, labels = Masker(data, seed=5, masked_lm_prob=0.15)(
        ids, lengths, np.zeros(600, np.int64), np.arange(600))
    chosen = labels != -100
    kinds = {"mask": 0, "kept": 0, "random": 0}
    mixed = multi = 0
    for i in range(600):
        j = 1
        while j < lengths[i]:
            end = j + 1
            while end < lengths[i] and ids[i, end] > 4 and cont[ids[i, end]]:
                end += 1
            if chosen[i, j]:
                word = {"mask" if o == 4 else "kept" if o == t else "random"
                        for o, t in zip(out[i, j:end], ids[i, j:end])}
                if end - j > 1:
                    multi += 1
                    mixed += len(word) > 1
                kinds[sorted(word)[0]] += 1
            j = end
    total = sum(kinds.values())
    assert multi > 300 and total > 1500
    assert mixed <= 0.01 * multi         # a random pick can equal the original (1 in ~400)
    assert kinds["mask"] / total == pytest.approx(0.8, abs=0.03)
    assert kinds["kept"] / total == pytest.approx(0.1, abs=0.025)
    assert kinds["random"] / total == pytest.approx(0.1, abs=0.025)


@pytest.mark.parametrize("prob", [0.15, 0.3, 0.4])
def test_dynamic_masking_rate_is_not_capped_by_the_prep_budget(tmp_path, prob):
    """Data prepared with max_predictions_per_seq=20 at 15% (Google's 128/20): the dynamic
    rate data.masked_lm_prob is what the model gets, not min(20, ...) per row."""
    root = write_prepared(str(tmp_path / "p"), num_train=300, num_valid=4, seq=128, max_pred=20,
                          vocab_size=200)
    data = PreparedData(root)
    rows = data.split("train").gather(np.arange(300))
    ids = unmasked_ids(rows)
    lengths = rows["lengths"].astype(np.int64)
    assert (np.rint(lengths * prob) > 20).mean() > 0.3 or prob == 0.15   # rows a cap of 20 clips
    _, labels = Masker(data, seed=3, masked_lm_prob=prob)(ids, lengths, np.zeros(300, np.int64),
                                                          np.arange(300))
    per_row = (labels != -100).sum(1)
    assert (per_row == np.maximum(1, np.rint(lengths * prob))).all()
    assert per_row.sum() / lengths.sum() == pytest.approx(prob, abs=0.005)


def test_masked_lm_prob_is_refused_with_static_masking():
    with pytest.raises(ValueError, match="data.masked_lm_prob=0.2 only applies to data.masking="
                                         "dynamic"):
        DataConfig(dir="x", masking="static", masked_lm_prob=0.2)
    assert DataConfig(dir="x", masking="dynamic", masked_lm_prob=0.2).masked_lm_prob == 0.2
