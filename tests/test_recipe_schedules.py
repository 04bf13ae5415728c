"""Schedules over a run: the dynamic masking rate (30% -> 15%), the batch-size warmup, and the
warmup-stable-decay learning rate; values at chosen points, statistics with tolerances, and the
exactness that resumes and N processes rely on."""

import math

import numpy as np
import pytest
import torch

from bert_pretrain.config import settings
from bert_pretrain.components.data import DataConfig, PreparedData, TrainStream
from bert_pretrain.components.data_schedules import BatchRamp, batch_ramp, masking_rate
from bert_pretrain.errors import DataError, UserError
from bert_pretrain.components.optim import Schedule, SchedulerConfig
from train_support import compose, write_prepared


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """Rows of up to 128 tokens (15% of 128 is 19: rounding hides little)."""
    return write_prepared(str(tmp_path_factory.mktemp("rows")), num_train=512, num_valid=4,
                          seq=128, max_pred=20, vocab_size=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=200, num_valid=4)


def _stream(root, world=1, rank=0, micro=2, global_batch=32, position=0, **data):
    cfg = DataConfig(dir=root, **data)
    return TrainStream(PreparedData(root), cfg, seed=5, global_batch_size=global_batch,
                       micro_batch_size=micro, world_size=world, rank=rank,
                       samples_consumed=position)


# ---------------------------------------------------------------------------------- masking rate


@pytest.mark.parametrize("shape, until, points", [
    ("linear", 1.0, {0.0: 0.3, 0.25: 0.2625, 0.5: 0.225, 1.0: 0.15, 1.5: 0.15}),
    ("cosine", 1.0, {0.0: 0.3, 0.25: 0.3 - 0.15 * (1 - math.cos(math.pi / 4)) / 2, 0.5: 0.225,
                     1.0: 0.15}),
    ("step", 0.5, {0.0: 0.3, 0.49: 0.3, 0.5: 0.15, 0.9: 0.15}),
    ("linear", 0.5, {0.25: 0.225, 0.5: 0.15, 0.75: 0.15}),
])
def test_masking_rate_at_chosen_points(shape, until, points):
    for progress, rate in points.items():
        assert masking_rate(0.3, 0.15, shape, until, progress) == pytest.approx(rate, abs=1e-12)


def test_masking_rate_settings():
    plain = DataConfig(dir="x", masking="dynamic")
    assert plain.masking_rate(0.15, None) == 0.15          # bert-prep's rate, no schedule
    scheduled = DataConfig(dir="x", masking="dynamic", masked_lm_prob_start=0.3)
    assert scheduled.masking_rate(0.15, 0.5) == pytest.approx(0.225)
    with pytest.raises(ValueError, match="the trainer must pass each step's progress"):
        scheduled.masking_rate(0.15, None)
    with pytest.raises(ValueError, match="masked_lm_prob_start=0.3 needs data.masking=dynamic"):
        DataConfig(dir="x", masked_lm_prob_start=0.3)
    with pytest.raises(ValueError, match="masked_lm_prob_schedule must be one of linear, cosine, "
                                         "step"):
        DataConfig(dir="x", masking="dynamic", masked_lm_prob_start=0.3,
                   masked_lm_prob_schedule="exp")


def _measure(batches, mask_id=4):
    """Predicted share of the tokens, and the [MASK] / kept / random split of the predicted."""
    chosen = shown = original = None
    tokens = 0
    for b in batches:
        keep = b["labels"] != -100
        parts = (b["input_ids"][keep], b["labels"][keep])
        shown = parts[0] if shown is None else torch.cat([shown, parts[0]])
        original = parts[1] if original is None else torch.cat([original, parts[1]])
        tokens += b["num_tokens"]
    chosen = len(shown)
    is_mask = shown == mask_id
    kept = shown == original
    return (chosen / tokens, is_mask.float().mean().item(), kept.float().mean().item(),
            (~is_mask & ~kept).float().mean().item())


def test_scheduled_rates_are_what_the_batches_get_with_80_10_10(long_rows):
    stream = _stream(long_rows, global_batch=512, micro=128, masking="dynamic",
                     masked_lm_prob_start=0.3, masked_lm_prob=0.15)
    for progress, rate in ((0.0, 0.3), (0.5, 0.225), (1.0, 0.15)):
        predicted, mask, kept, random = _measure(stream.micro_batches(0, progress))
        assert predicted == pytest.approx(rate, abs=0.006), progress
        assert mask == pytest.approx(0.8, abs=0.025)
        assert kept == pytest.approx(0.1, abs=0.02)
        assert random == pytest.approx(0.1, abs=0.02)


def test_a_lower_rate_masks_a_subset_of_the_same_draws(long_rows):
    """The rate changes only how many of an instance's ranked positions are taken: resumes and
    N processes, which agree on the step's progress, agree on the masks."""
    stream = _stream(long_rows, global_batch=64, micro=64, masking="dynamic",
                     masked_lm_prob_start=0.3)
    high, low = (stream.micro_batches(0, p)[0]["labels"] != -100 for p in (0.0, 1.0))
    assert (low <= high).all() and low.sum() < 0.6 * high.sum()
    two = [_stream(long_rows, world=2, rank=r, global_batch=64, micro=32, masking="dynamic",
                   masked_lm_prob_start=0.3) for r in range(2)]
    def padded(labels):       # micro-batches are cut to their longest row
        return torch.nn.functional.pad(labels, (0, 128 - labels.shape[1]), value=-100)
    split = torch.cat([padded(s.micro_batches(0, 0.4)[0]["labels"]) for s in two])
    assert torch.equal(split, padded(stream.micro_batches(0, 0.4)[0]["labels"]))


# ---------------------------------------------------------------------------------- batch warmup


def test_ramp_sizes_and_lr_factors_at_chosen_points():
    ramp = BatchRamp(8, 32, 100, "sqrt")
    sizes = {0: 8, 33: 8, 34: 16, 66: 16, 67: 24, 99: 24, 100: 32, 10**9: 32}
    assert {s: ramp.size_at(s) for s in sizes} == sizes
    steps, at = [], 0
    while at < 130:
        steps.append(ramp.size_at(at))
        at += steps[-1]
    assert steps == [8, 8, 8, 8, 8, 16, 16, 24, 24, 32]
    assert ramp.lr_factor(0) == 0.5 and ramp.lr_factor(100) == 1.0
    assert BatchRamp(8, 32, 100, "linear").lr_factor(50) == 0.5
    assert BatchRamp(8, 32, 100, "none").lr_factor(0) == 1.0
    # The config's tokens are sequence slots: 1000 tokens of 128-token rows = 8 samples.
    assert batch_ramp(8, 1000, "none", 32, 128) == BatchRamp(8, 32, 8, "none")
    assert batch_ramp(None, 0, "none", 32, 128).size_at(0) == 32


@pytest.mark.parametrize("start, world, micro, message", [
    (12, 1, 4, "data.batch_warmup_start=12 must divide trainer.global_batch_size=32 .*e.g. 8"),
    (64, 1, 4, "data.batch_warmup_start=64 must divide trainer.global_batch_size=32"),
    (8, 2, 8, "data.batch_warmup_start=8 is not divisible by world_size \\(2\\) x "
              "trainer.micro_batch_size \\(8\\).*multiple of its start"),
])
def test_impossible_ramps_are_refused_in_one_line(prepared, start, world, micro, message):
    with pytest.raises(DataError, match=message):
        _stream(prepared, world=world, micro=micro, batch_warmup_start=start,
                batch_warmup_tokens=1000)


def test_ramp_settings_are_checked_before_training(prepared):
    with pytest.raises(ValueError, match="needs the warmup's length: set data.batch_warmup_tokens"):
        DataConfig(dir="x", batch_warmup_start=8)
    with pytest.raises(ValueError, match="batch_warmup_lr_scaling must be one of none, sqrt, "
                                         "linear"):
        DataConfig(dir="x", batch_warmup_lr_scaling="cubic")
    with pytest.raises(UserError, match="batch_warmup_start=12 must divide"):
        settings(compose([f"data.dir={prepared}", "trainer.global_batch_size=32",
                          "data.batch_warmup_start=12", "data.batch_warmup_tokens=1000"]))


def _rows(batches):
    """(unmasked token rows, masked input rows) of micro-batches, for identity comparisons."""
    plain, shown = [], []
    for b in batches:
        ids = b["input_ids"].clone()
        keep = b["labels"] != -100
        ids[keep] = b["labels"][keep]
        for row, masked, n in zip(ids, b["input_ids"], b["attention_mask"].sum(1)):
            plain.append(tuple(row[:n].tolist()))
            shown.append(tuple(masked[:n].tolist()))
    return plain, shown


RAMP = dict(masking="dynamic", batch_warmup_start=8, batch_warmup_tokens=32 * 120)  # 120 samples


def test_one_and_n_processes_take_identical_global_batches_through_the_ramp(prepared):
    one = _stream(prepared, **RAMP)
    sizes = []
    groups = {w: [_stream(prepared, world=w, rank=r, **RAMP) for r in range(w)] for w in (2, 4)}
    for _ in range(14):
        size = one.batch_size()
        sizes.append(size)
        want = _rows(one.next_step())
        for world, ranks in groups.items():
            assert {s.batch_size() for s in ranks} == {size}
            per_rank = [s.next_step() for s in ranks]
            assert {len(b) for b in per_rank} == {size // (world * 2)}   # micro-batches each
            assert _rows([b for bs in per_rank for b in bs]) == want
    assert sizes == [8] * 5 + [16] * 3 + [24] * 2 + [32] * 4
    assert one.position.samples_consumed == sum(sizes)


def test_resume_mid_ramp_continues_with_the_same_batches(prepared):
    first = _stream(prepared, **RAMP)
    for _ in range(6):                      # into the ramp's 16-sample steps
        first.next_step()
    position = first.position.samples_consumed
    assert first.batch_size() == 16 and position == 56
    resumed = _stream(prepared, position=position, **RAMP)
    resumed_two = [_stream(prepared, world=2, rank=r, position=position, **RAMP)
                   for r in range(2)]
    for _ in range(5):
        want = _rows(first.next_step())
        assert _rows(resumed.next_step()) == want
        assert _rows([b for s in resumed_two for b in s.next_step()]) == want


# ---------------------------------------------------------------------------------- wsd


def _wsd(shape="linear", max_steps=100, warmup=10, budget=None, **kw):
    kw.setdefault("decay_steps", None if budget else 20)
    return Schedule(SchedulerConfig(name="wsd", decay_shape=shape, **kw), max_steps, warmup,
                    budget)


@pytest.mark.parametrize("shape, at_85, at_99", [
    ("linear", 0.75, 0.05),
    ("cosine", 0.5 * (1 + math.cos(math.pi / 4)), 0.5 * (1 + math.cos(0.95 * math.pi))),
    ("1-sqrt", 0.5, 1 - math.sqrt(0.95)),
])
def test_wsd_values_at_chosen_steps(shape, at_85, at_99):
    s = _wsd(shape)
    assert s.factor(0) == 0.1 and s.factor(9) == 1.0          # warmup
    assert s.factor(10) == s.factor(50) == s.factor(80) == 1.0  # stable, decay starts at 80
    assert s.factor(85) == pytest.approx(at_85, abs=1e-12)
    assert s.factor(99) == pytest.approx(at_99, abs=1e-12)
    floor = _wsd(shape, end_lr_ratio=0.1)
    assert floor.factor(85) == pytest.approx(0.1 + 0.9 * at_85, abs=1e-12)
    # decay_fraction instead of decay_steps: 0.2 of 100 steps, the same curve
    by_fraction = _wsd(shape, decay_steps=None, decay_fraction=0.2)
    assert [by_fraction.factor(k) for k in range(100)] == [s.factor(k) for k in range(100)]


def test_a_decay_branched_from_a_stable_checkpoint_continues_the_run_exactly():
    """The run (max_steps 1000) and its branch from checkpoint 300 (max_steps 300 + 100): the same
    rate at every step before 300, then the run's own decay, 600 steps early."""
    run = _wsd("1-sqrt", max_steps=1000, decay_steps=100)
    branch = _wsd("1-sqrt", max_steps=400, decay_steps=100)
    assert [branch.factor(k) for k in range(300)] == [run.factor(k) for k in range(300)]
    assert [branch.factor(300 + k) for k in range(100)] == [run.factor(900 + k)
                                                             for k in range(100)]
    assert branch.factor(300) == 1.0 and branch.factor(399) < 0.11


def test_wsd_in_budget_mode_decays_over_the_last_share_of_the_time():
    s = _wsd("1-sqrt", budget=100.0, decay_fraction=0.2)
    assert s.factor(10, elapsed=50.0) == s.factor(10, elapsed=80.0) == 1.0
    assert s.factor(10, elapsed=90.0) == pytest.approx(1 - math.sqrt(0.5), abs=1e-12)


def test_wsd_settings_are_checked(prepared):
    with pytest.raises(ValueError, match="scheduler.decay_steps is for scheduler=wsd"):
        SchedulerConfig(name="linear", decay_steps=10)
    with pytest.raises(ValueError, match="drop scheduler.hold_fraction"):
        SchedulerConfig(name="wsd", hold_fraction=0.5)
    with pytest.raises(ValueError, match="decay_shape must be one of linear, cosine, 1-sqrt"):
        SchedulerConfig(name="wsd", decay_shape="sqrt")
    base = [f"data.dir={prepared}", "scheduler=wsd"]
    assert settings(compose(base + ["scheduler.decay_shape=1-sqrt", "trainer.warmup_steps=10",
                                    "scheduler.decay_steps=100"])).scheduler.decay_steps == 100
    for extra, message in (
            ([], "scheduler=wsd needs trainer.warmup_steps"),
            (["trainer.warmup_steps=10", "scheduler.decay_steps=995"],
             "warmup \\(10 steps\\) and decay \\(995\\) do not fit in trainer.max_steps=1000"),
            (["trainer.warmup_steps=10", "scheduler.decay_steps=10", "trainer.budget_hours=1"],
             "decay_steps=10 counts steps, but trainer.budget_hours measures the run in time")):
        with pytest.raises(UserError, match=message):
            settings(compose(base + extra))


def test_every_ramp_size_is_world_independent():
    """No ramp size depends on the number of processes: they are multiples of the start."""
    ramp = BatchRamp(24, 240, 5000)
    sizes = {ramp.size_at(s) for s in range(0, 6000, 7)}
    assert sizes == set(range(24, 241, 24))
    assert all(np.gcd(size, 24) == 24 for size in sizes)
