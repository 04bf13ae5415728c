"""User errors stay one line (exit 2) under the launchers and with wandb.

- `logger=wandb` online with no login: wandb's ~30-line UsageError traceback becomes one line
  that says what to do.
- Under `accelerate launch` every rank used to print the line, then torch elastic buried it
  under ~35 lines (its shutdown log, the launcher's traceback, a ChildFailedError table) and
  exited 1.  Now only the main process prints it; `python -m bert_pretrain.tools.launch` (accelerate
  launch's arguments) ends with that line alone and exit status 2.
"""
import json
import os
import sys
from pathlib import Path

import pytest

from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO, needs_wandb, write_prepared

ACCELERATE_CONFIG = os.path.join(REPO, "conf", "accelerate", "cpu_2proc.yaml")


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH,
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


@needs_wandb
def test_wandb_online_without_login_is_one_line(tmp_path):
    import subprocess

    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    r = subprocess.run(
        [sys.executable, "-m", "bert_pretrain.train", "experiment=smoke", f"data.dir={data}",
         f"run_dir={tmp_path / 'run'}", "logger=wandb", "logger.mode=online",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("bert-train: error: logger=wandb")
    for advice in ("wandb login", "WANDB_API_KEY", "logger.mode=offline"):
        assert advice in lines[0]


def _launch(tmp_path, launcher, *overrides):
    import subprocess

    from test_distributed import free_port

    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    return subprocess.run(
        [sys.executable, "-m", launcher, "--config_file", ACCELERATE_CONFIG,
         "--main_process_port", str(free_port()), "-m", "bert_pretrain.train",
         "experiment=smoke", f"data.dir={data}", f"run_dir={tmp_path / 'run'}",
         f"hydra.run.dir={tmp_path / 'hydra'}", "trainer.cpu=true", *overrides],
        cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=hang_limit())


BAD = "resume=" + "/nonexistent/step-00000001"


@pytest.mark.slow
@pytest.mark.parametrize("bad, expected", [
    (BAD, f"bert-train: error: {BAD}: no such checkpoint directory; use resume=auto or a "
          f"<run_dir>/checkpoints/step-XXXXXXXX path"),  # found in training set-up
    ("trainer.max_step=3", "bert-train: error: Could not override 'trainer.max_step'; Key "
                           "'max_step' not in 'TrainerConfig'; did you mean trainer.max_steps? "
                           "(see `bert-train --help` or conf/train/ for the keys and "
                           "options)"),  # found in the precheck
])
def test_bert_launch_user_error_is_one_line_exit_2(tmp_path, bad, expected):
    r = _launch(tmp_path, "bert_pretrain.tools.launch", bad)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert out == [expected], out


@pytest.mark.slow
def test_plain_accelerate_launch_prints_the_error_once_and_fails(tmp_path):
    r = _launch(tmp_path, "accelerate.commands.launch", BAD)
    printed = [ln for ln in r.stderr.splitlines() if ln.startswith("bert-train: error:")]
    assert r.returncode != 0
    assert len(printed) == 1, r.stderr  # main process only (it was once per process)
    # the launcher's summary names the error too (from torch elastic's error file)
    assert f"traceback : bert-train: error: {BAD}" in r.stderr


_FAIL_IN_CHILD = """
import atexit, sys
atexit.register(lambda: print("interpreter teardown ran", flush=True))
from bert_pretrain.train import _fail
_fail("resume=/x: no such checkpoint directory")
"""


@pytest.mark.parametrize("launched", [True, False])
def test_user_error_under_a_launcher_leaves_without_interpreter_teardown(tmp_path, launched):
    """A rank that stops at a user error once its gloo group is up skips the teardown in which
    gloo's threads aborted it now and then (SIGABRT: the launcher reported a crash, exit 1,
    instead of the user's mistake, exit 2), yet leaves its error file and exit status 2."""
    import subprocess

    env = _env(tmp_path, RANK="1", TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    if launched:
        env.update(WORLD_SIZE="2", TORCHELASTIC_RUN_ID="test", MASTER_ADDR="127.0.0.1")
    r = subprocess.run([sys.executable, "-c", _FAIL_IN_CHILD], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 2, r.stderr
    # rank 1 of a launch: the main process prints the line; without a launcher's MASTER_ADDR,
    # the process is alone whatever RANK says, and prints it itself
    line = "bert-train: error: resume=/x: no such checkpoint directory"
    assert r.stderr == ("" if launched else line + "\n")
    assert json.loads((tmp_path / "error.json").read_text())["message"] == (
        "bert-train: error: resume=/x: no such checkpoint directory")
    assert ("interpreter teardown ran" in r.stdout) is (not launched)


def _failure(tmp_path, rank, exitcode, message=None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = str(tmp_path / f"error{rank}.json")
    if message:
        Path(error_file).write_text(json.dumps({"message": message, "timestamp": 100 + rank}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=error_file)


@pytest.mark.parametrize("prog", ["bert-train", "bert-finetune", "bert-glue"])
def test_launch_report_when_only_another_rank_hit_the_user_error(tmp_path, capsys, prog):
    """(bert-launch -m bert_pretrain.finetune runs a fine-tune's processes the same way.)"""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from bert_pretrain.tools.launch import _report

    line = f"{prog}: error: cannot read data shard on this node"
    exc = ChildFailedError("bert_pretrain.train", {1: _failure(tmp_path, 1, 2, line),
                                                   0: _failure(tmp_path, 0, -15)})
    assert _report(exc) == 2
    assert capsys.readouterr().err.strip() == line  # rank 0 never printed it: we do
    exc = ChildFailedError("bert_pretrain.train", {0: _failure(tmp_path, 0, 2, line),
                                                   1: _failure(tmp_path, 1, 2, line)})
    assert _report(exc) == 2
    assert capsys.readouterr().err == ""  # rank 0 printed it already


def test_launch_report_when_the_main_rank_was_stopped_on_its_way_to_exit_2(tmp_path, capsys):
    """Seen in CI: rank 1 exited 2 first, the agent's SIGTERM then caught rank 0 after it had
    printed the line and written its error file; rank 0's error file (whole seconds) made it
    the 'first failure', killed by SIGTERM, and the launch reported a crash (exit 1)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from bert_pretrain.tools.launch import _report

    line = "bert-train: error: Could not override 'trainer.max_step'"
    exc = ChildFailedError("bert_pretrain.train", {0: _failure(tmp_path, 0, -15, line),
                                                   1: _failure(tmp_path, 1, 2, line)})
    assert exc.get_first_failure()[0] == 0  # what torch elastic calls the first failure
    assert _report(exc) == 2
    assert capsys.readouterr().err == ""  # rank 0 printed it before its error file


def test_launch_report_for_a_crash_names_the_rank(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from bert_pretrain.tools.launch import _report

    assert _report(ChildFailedError("t", {1: _failure(tmp_path, 1, -9)})) == 1
    assert capsys.readouterr().err.strip() == \
        "bert-launch: error: rank 1 was killed by signal SIGKILL (Signal 9 (SIGKILL) received " \
        "by PID 1001)"
    assert _report(ChildFailedError("t", {0: _failure(tmp_path, 0, 1)})) == 1
    assert "rank 0 exited with status 1 (see its output above)" in capsys.readouterr().err
    # the rank the agent stopped after another one crashed is not named as the cause
    crash = ChildFailedError("t", {0: _failure(tmp_path, 0, -15), 1: _failure(tmp_path, 1, 1)})
    assert _report(crash) == 1
    assert "rank 1 exited with status 1" in capsys.readouterr().err
    # a rank that lost its peer failed because of the one that died, though its error file
    # is older than the time the agent found the dead one: the dead one is named
    lost = ("bert-train: error: [rank 0] lost the other processes after step 4 (gloo: "
            "Connection closed by peer [127.0.0.1]:396): ...")
    died = ChildFailedError("t", {0: _failure(tmp_path, 0, 1, lost), 1: _failure(tmp_path, 1, -9)})
    assert died.get_first_failure()[0] == 0  # what torch elastic calls the first failure
    assert _report(died) == 1
    assert "rank 1 was killed by signal SIGKILL" in capsys.readouterr().err
    # the one that died was on another machine: this machine's line is all there is
    assert _report(ChildFailedError("t", {0: _failure(tmp_path, 0, 1, lost)})) == 1
    assert capsys.readouterr().err.strip() == f"bert-launch: error: rank 0 exited with status 1 " \
                                              f"({lost})"


def test_shutdown_noise_drops_only_the_agents_records_after_a_user_error():
    """The filter on torch elastic's log, fed records as its api module writes them: the agent's
    closing signals and its 'failed' line for exit 2 or its own SIGTERM go; a crash's stays."""
    import logging

    from bert_pretrain.tools.launch import ELASTIC_API, _ShutdownNoise

    def record(msg, *args):
        return logging.LogRecord(ELASTIC_API, logging.ERROR, "api.py", 1, msg, args, None)

    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    keep = _ShutdownNoise().filter
    assert not keep(record("Sending process %s closing signal %s", 1234, "SIGTERM"))
    assert not keep(record(failed, 2, 1, 1234, "bert-train"))
    assert not keep(record(failed, -15, 0, 1234, "bert-train"))
    assert keep(record(failed, 1, 0, 1234, "bert-train"))
    assert keep(record(failed, -9, 1, 1234, "bert-train"))
    assert keep(record("Starting elastic_operator with launch configs:"))


@pytest.mark.parametrize("launched", [True, False])
def test_a_typo_is_printed_by_rank_0_of_a_launch_or_by_a_process_alone(tmp_path, launched):
    """Under a launcher only rank 0 prints the typo's line (every rank finds it); a process no
    launcher started (no MASTER_ADDR) prints it whatever RANK its shell left it, which before
    made a RANK=1 shell's mistake exit 2 without a word."""
    import subprocess

    env = _env(tmp_path, RANK="1")
    env.pop("MASTER_ADDR", None)
    if launched:
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.train", "trainer.max_step=3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 2, r.stderr
    said = "bert-train: error: Could not override 'trainer.max_step'"
    assert (said in r.stderr) is (not launched), r.stderr
    assert len(r.stderr.strip().splitlines()) == (0 if launched else 1), r.stderr
