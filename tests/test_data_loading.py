"""The prepared-data reader: manifest checks, order, per-rank slices, collation, dynamic masks."""

import json
import os

import numpy as np
import pytest
import torch

from bert_pretrain.data import (DataConfig, Masker, PreparedData, TrainStream, collate,
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
