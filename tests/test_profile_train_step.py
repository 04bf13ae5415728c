"""bench/profile_train_step.py: where a training step's time goes, the input pipeline timed on
its own and the profiler's tables written; bad arguments refused in one line."""
import json
import os
import re
import sys

import pytest

from train_support import REPO, write_prepared

sys.path.insert(0, os.path.join(REPO, "bench"))
import profile_train_step  # noqa: E402


def test_a_step_is_split_into_the_input_pipeline_and_the_rest(tmp_path, capsys):
    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    out = tmp_path / "profile.json"
    profile_train_step.main(["--data", data, "--experiment", "smoke", "--warmup", "1",
                             "--steps", "4", "--window", "2", "--profile", "2",
                             "--set", "trainer.mixed_precision=no", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["device_busy_ms"] is None
    assert 0 < result["data_ms"] < result["wall_ms"]
    assert result["data_share"] == pytest.approx(result["data_ms"] / result["wall_ms"])
    tables = out.with_suffix(".txt").read_text()
    assert "smoke on cpu, 2 steps: by the host's own time" in tables and "aten::" in tables
    assert "the input pipeline" in capsys.readouterr().out


def test_steps_below_one_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--steps, --window and --profile must be at least 1"):
        profile_train_step.main(["--data", str(tmp_path), "--steps", "0"])


def test_missing_data_and_an_unknown_key_are_one_line(tmp_path, capsys):
    """bert-train's own messages (its check of the overrides, with 'did you mean'), one line
    and exit status 2, no traceback (both bench scripts build their trainer the same way,
    bench_defer_reads.make_trainer)."""
    with pytest.raises(SystemExit) as exit_:
        profile_train_step.main(["--data", str(tmp_path / "nope"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"error: data.dir '.*nope' does not exist; run bert-prep", err), err
    with pytest.raises(SystemExit) as exit_:
        profile_train_step.main(["--data", str(tmp_path), "--set", "trainer.max_step=1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Could not override 'trainer.max_step'" in err, err
    assert "did you mean trainer.max_steps?" in err, err


def test_the_profiler_writes_no_kineto_lines_on_stderr(tmp_path):
    """libkineto's start/stop lines ("USDT:<date> <pid>:<tid> <file>.cpp:<line>] ...") are
    gone: the script sets KINETO_LOG_LEVEL before torch loads. (A subprocess: this test process
    loaded torch long before. On the CPU, so a visible GPU changes nothing; only kineto's own
    line format is looked for, so another library's warning does not change the verdict.)"""
    import subprocess

    from time_limits import hang_limit

    data = write_prepared(str(tmp_path / "prep"), num_train=48, num_valid=8)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "profile_train_step.py"), "--data", data,
         "--experiment", "smoke", "--warmup", "1", "--steps", "2", "--window", "1",
         "--profile", "1", "--set", "trainer.mixed_precision=no", "trainer.cpu=true",
         "--out", str(tmp_path / "profile.json")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=hang_limit())
    assert done.returncode == 0, done.stderr
    kineto = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\]", re.M)
    assert not kineto.search(done.stderr), done.stderr
    assert "on cpu:" in done.stdout and "the input pipeline" in done.stdout
