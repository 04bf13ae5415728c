"""bench/bench_defer_reads.py compares what it names: one trainer deferring its reads, one
reading every step, the same losses; a run that can not defer is refused, not timed as one."""
import json
import os
import sys

import pytest

from train_support import REPO, write_prepared

sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_defer_reads  # noqa: E402

TINY = ["--experiment", "smoke", "--steps", "6", "--window", "2", "--skip", "2", "--runs", "2",
        "--set", "trainer.mixed_precision=no"]


def test_both_trainers_take_steps_and_are_compared(tmp_path, capsys):
    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    out = tmp_path / "defer.json"
    bench_defer_reads.main(["--data", data, *TINY, "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2
    for row in result["runs"]:
        assert row["deferred_ms"] > 0 and row["read_ms"] > 0
        assert row["ratio"] == pytest.approx(row["deferred_ms"] / row["read_ms"])
        assert row["final_loss_relative_difference"] == 0.0  # a CPU: bit for bit
    assert "| deferred / read |" in capsys.readouterr().out


def test_trainers_whose_losses_part_are_refused_on_a_cpu(tmp_path, monkeypatch):
    """On a CPU the allowance is none (a GPU's is 1e-3, for its atomic adds): two trainers that
    differ in anything, here their seed, end the bench."""
    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    make = bench_defer_reads.make_trainer

    def reseeded(args, run_dir, defer, **kw):
        if defer:
            args = type(args)(**{**vars(args), "set": [*args.set, "seed=7"]})
        return make(args, run_dir, defer, **kw)

    monkeypatch.setattr(bench_defer_reads, "make_trainer", reseeded)
    with pytest.raises(SystemExit, match=r"losses differ \(.*relative .*, allowed 0 on cpu\)"):
        bench_defer_reads.main(["--data", data, *TINY, "--out", str(tmp_path / "x.json")])


def test_a_run_that_can_not_defer_is_refused(tmp_path):
    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    with pytest.raises(SystemExit, match="can not defer its reads"):
        bench_defer_reads.main(["--data", data, *TINY, "--set", "trainer.mixed_precision=no",
                                "optim.fused=false", "--out", str(tmp_path / "x.json")])


def test_a_deferring_trainer_that_reads_before_the_window_ends_is_refused(tmp_path, monkeypatch):
    """The bench's own check: were the deferring trainer to read every step (as a regression
    of trainer.py might make it), its windows would time the reading mode twice over."""
    from bert_pretrain.trainer import Trainer

    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: step(self).settle())
    with pytest.raises(SystemExit, match="held 0 of 6 steps"):
        bench_defer_reads.main(["--data", data, *TINY, "--out", str(tmp_path / "x.json")])


def test_steps_that_leave_no_window_after_the_warm_up_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="at least one whole window"):
        bench_defer_reads.main(["--data", str(tmp_path), "--steps", "10", "--window", "4",
                                "--skip", "5"])
