"""bench/bench_prefetch.py compares what it names: one trainer (or stream) whose batches a
worker process reads ahead, one reading them on the training thread, the same losses; and the
two comparison benches give a time budget's run one clock for both trainers."""
import json
import os
import sys

import pytest

from train_support import REPO, write_prepared

sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_defer_reads  # noqa: E402
import bench_prefetch  # noqa: E402

TINY = ["--experiment", "smoke", "--steps", "6", "--window", "2", "--skip", "2", "--runs", "2",
        "--set", "trainer.mixed_precision=no", "data.masking=dynamic",
        "data.masked_lm_prob_start=0.4"]
# A time budget moves the lr and the masking rate with each trainer's own clock.
BUDGET = ["trainer.budget_hours=0.01", "trainer.max_steps=1000000"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=48, num_valid=8)


def test_both_trainers_take_steps_and_are_compared(tmp_path, data, capsys):
    out = tmp_path / "prefetch.json"
    bench_prefetch.main(["--data", data, *TINY, *BUDGET, "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2
    for row in result["runs"]:
        assert row["prefetch_ms"] > 0 and row["inline_ms"] > 0
        assert row["ratio"] == pytest.approx(row["prefetch_ms"] / row["inline_ms"])
        assert row["final_loss_relative_difference"] == 0.0  # a CPU: bit for bit
        assert row["prefetch_input_ms"] > 0 and row["inline_input_ms"] > 0
    printed = capsys.readouterr().out
    assert "| prefetching / not |" in printed
    assert "| input pipeline on the training thread, prefetching |" in printed
    assert "| step, read ahead by a worker (trainer.prefetch=true) |" in printed


def test_the_host_thread_mode_times_streams_without_a_model(tmp_path, data):
    out = tmp_path / "host.json"
    bench_prefetch.main(["--data", data, "--experiment", "smoke", "--host-calls", "50",
                         "--steps", "8", "--skip", "2", "--runs", "1", "--out", str(out)])
    row = json.loads(out.read_text())["runs"][0]
    assert row["device"] == "cpu, 50 torch calls a step on one thread"
    assert row["prefetch_ms"] > row["prefetch_input_ms"] > 0
    assert row["inline_ms"] > row["inline_input_ms"] > 0


def test_trainers_whose_losses_part_are_refused(tmp_path, data, monkeypatch):
    make = bench_prefetch.make_trainer

    def reseeded(args, run_dir, defer, **kw):
        if "trainer.prefetch=true" in args.set:
            args = type(args)(**{**vars(args), "set": [*args.set, "seed=7"]})
        return make(args, run_dir, defer, **kw)

    monkeypatch.setattr(bench_prefetch, "make_trainer", reseeded)
    with pytest.raises(SystemExit, match=r"losses differ \(.*allowed 0 on cpu\)"):
        bench_prefetch.main(["--data", data, *TINY, "--out", str(tmp_path / "x.json")])


def test_a_budgeted_run_is_compared_on_one_clock(tmp_path, data):
    """Without one clock, two trainers of a time budget end apart on a CPU (their lr and
    masking rate follow each one's own elapsed time); the benches compare them on a step count."""
    bench_defer_reads.main(["--data", data, *TINY, *BUDGET, "--out", str(tmp_path / "d.json")])
    row = json.loads((tmp_path / "d.json").read_text())["runs"][0]
    assert row["final_loss_relative_difference"] == 0.0

    args = bench_prefetch.argparse.Namespace(data=data, experiment="smoke",
                                             set=TINY[TINY.index("--set") + 1:] + BUDGET)
    apart = [bench_defer_reads.make_trainer(args, str(tmp_path / f"own{i}"), True)
             for i in range(2)]
    try:
        assert all(t.tc.budget_hours == 0.01 for t in apart)
        one = [bench_defer_reads.make_trainer(args, str(tmp_path / f"one{i}"), True,
                                              same_clock=True) for i in range(2)]
        assert all(t.tc.budget_hours is None and t.tc.max_steps == 1000000 for t in one)
        for t in one:
            t.close()
    finally:
        for t in apart:
            t.close()
