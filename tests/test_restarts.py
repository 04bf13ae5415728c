"""Restarts after a lost process, for real: two processes on CPU (gloo) under torchrun's agent
with `--max-restarts` and the c10d rendezvous docs/multi-gpu.md recommends (and once under
`bert-launch`, accelerate's flags), one rank SIGKILLs itself at a named point of the run
(BERT_TRAIN_FAULT, components/fault_point.py: a step and phase, not a moment in time), the agent
restarts the group, `resume=auto` continues from the last complete checkpoint, and the run ends
with the same weights, bit for bit, as the run that was never interrupted.  Every launch has a
subprocess timeout and a short process-group timeout, so a restart that hangs fails the test
instead of stalling it.

The same for sharded runs (trainer.sharding=fsdp), killed also inside the sharded save
(tests/kill_during_save.py's points: as a rank writes its shards, as rank 0 writes DCP's
metadata, ...): the restart resumes from the last complete sharded checkpoint and ends with the
uninterrupted FSDP run's weights and optimizer state, bit for bit (the same 2 processes redo the
same reduce-scatters; the FSDP-vs-DDP tolerance of tests/test_fsdp.py is not needed).

Before components/process_group.py, the restarted workers read their peers' addresses of the
attempt before from the agent's store (`connectFullMesh ... Connection refused`, or a hang)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_distributed import free_port
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH_WITH_TESTS, write_prepared

pytestmark = pytest.mark.slow  # ~20-40 s a launch on a shared 2-core machine

REPO = Path(__file__).resolve().parent.parent
# 6 steps, a checkpoint every 2, an evaluation at 3 and 6; a collective that waits 120 s for a
# peer is a hang here (the model is tiny), and becomes the run's error instead of the test's
# timeout.
RUN = ["experiment=smoke", "trainer.max_steps=6", "trainer.global_batch_size=8",
       "trainer.mixed_precision=no", "trainer.log_every=1", "trainer.eval_every=3",
       "trainer.checkpoint_every=2", "trainer.keep_last_k=0", "trainer.progress_bar=false",
       "trainer.report=false", "trainer.process_group_timeout_s=120", "trainer.cpu=true",
       "resume=auto"]


def launch(launcher: list[str], run_dir: Path, data: str, fault: str | None = None,
           *overrides: str, kill_point: str | None = None) -> subprocess.CompletedProcess:
    """bert-train under `launcher`; `fault`: BERT_TRAIN_FAULT; `kill_point`: a point of a sharded
    save (KILL_POINT of tests/kill_during_save.py, which then runs bert-train)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_SILENT": "true"}
    for name in ("BERT_TRAIN_FAULT", "KILL_POINT"):
        env.pop(name, None)
    program = ["-m", "bert_pretrain.train"]
    if fault:
        env["BERT_TRAIN_FAULT"] = fault
    if kill_point:
        env.update(KILL_POINT=kill_point, KILL_RUN_DIR=str(run_dir),
                   PYTHONPATH=CHILD_PYTHONPATH_WITH_TESTS)
        program = [str(REPO / "tests" / "kill_during_save.py")]
    cmd = [*launcher, *program, *RUN, f"data.dir={data}", f"run_dir={run_dir}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=hang_limit())


def torchrun(restarts: int = 2, logs: Path | None = None) -> list[str]:
    """torchrun of 2 processes; `logs`: the agent's --log-dir (its processes' error files)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}", *(["--log-dir", str(logs)] if logs else [])]


def bert_launch() -> list[str]:
    """bert-launch (accelerate launch) of 2 CPU processes, accelerate's restart flags."""
    return [sys.executable, "-m", "bert_pretrain.tools.launch", "--config_file",
            str(REPO / "conf" / "accelerate" / "cpu_2proc.yaml"), "--max_restarts", "2",
            "--rdzv_backend", "c10d", "--main_process_port", str(free_port())]


def failures(r: subprocess.CompletedProcess) -> list[str]:
    """The exit codes of the failed attempts, as torch elastic's agent logs them."""
    return re.findall(r"failed \(exitcode: (-?\d+)\)", r.stderr)


def weights(run_dir: Path, step: int = 6) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def sharded_state(run_dir: Path, step: int = 6) -> dict:
    """Every tensor of a sharded checkpoint (model and optimizer state, keyed as DCP keys them:
    `model.<name>`, `optim.state.<name>.exp_avg`, ...), whole, read on this one process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from bert_pretrain.components import sharded_checkpoint

    folder = str(run_dir / "checkpoints" / f"step-{step:08d}" / sharded_checkpoint.SHARDED_DIR)
    entries = sharded_checkpoint.read_metadata(folder).state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in entries.items() if isinstance(entry, TensorStorageMetadata)}
    sharded_checkpoint._load(folder, state, collective=False, allow_partial=True)
    return state


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=40)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = launch(torchrun(restarts=0), run_dir, data)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# (rank, phase, step) -> the checkpoint the restart resumes from (None: from the start)
KILL_POINTS = {
    "1:step:5": 4,     # mid-step, after the first micro-batch's backward
    "0:step:1": None,  # before any checkpoint exists: the restart starts over
    "0:saved:4": 4,    # right after a complete checkpoint
    "0:save:4": 2,     # during a save: rank 0 wrote its RNG state into the unfinished step 4
    "1:save:4": 2,     # during a save: rank 1 dies while rank 0 waits for it
    "1:eval:3": 2,     # during an evaluation
}


@pytest.mark.parametrize("fault", list(KILL_POINTS))
def test_sigkilled_rank_restarts_and_ends_bit_equal(data, uninterrupted, tmp_path, fault):
    run_dir = tmp_path / "run"
    r = launch(torchrun(logs=tmp_path / "logs"), run_dir, data, fault)
    assert_restarted_once(r, run_dir, KILL_POINTS[fault], tmp_path / "logs")
    assert_bit_equal(weights(uninterrupted), weights(run_dir))


def lost_lines(r: subprocess.CompletedProcess, logs: Path) -> list[str]:
    """bert-train's lost-peer lines: printed by local rank 0, in every process's error file
    (torch elastic's `<logs>/<run id>/attempt_<n>/<local rank>/error.json`)."""
    text = r.stderr + "".join(p.read_text() for p in logs.glob("*/attempt_*/*/error.json"))
    return re.findall(r"\[rank \d\] lost the other processes after step \d+", text)


def assert_restarted_once(r: subprocess.CompletedProcess, run_dir: Path,
                          resumed_from: int | None, logs: Path) -> None:
    assert r.returncode == 0, r.stderr[-4000:]
    # the kill happened, the first restart came up (no attempt failed joining the group: before
    # process_group.py about every other restart did), and resumed where the test expects
    # (the agent names the first process it finds gone: the killed one, or the other, which
    # lost its peer and ended in one line, exit status 1, before the agent looked: printed when
    # it is local rank 0, in its error file always)
    assert failures(r) in (["-9"], ["1"]), r.stderr[-3000:]
    if failures(r) == ["1"]:
        assert lost_lines(r, logs), r.stderr[-3000:]
    # the process left without its peer ended in one line (or was stopped by the agent first)
    assert "Traceback" not in r.stderr and "Error executing job" not in r.stderr, r.stderr[-4000:]
    if resumed_from is None:
        assert "resumed from" not in r.stdout
    else:
        assert r.stdout.count(f"resumed from {run_dir / 'checkpoints'}/step-{resumed_from:08d}") \
            == 1, r.stdout
    assert r.stdout.count("bert-train: finished at step 6") == 1
    assert steps_saved(run_dir) == [2, 4, 6]  # no unfinished save left counting as one
    final = json.loads((run_dir / "checkpoints" / "step-00000006" / "trainer_state.json")
                       .read_text())
    assert final["samples_consumed"] == 48


@pytest.fixture(scope="module")
def uninterrupted_fsdp(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted_fsdp") / "run"
    r = launch(torchrun(restarts=0), run_dir, data, None, "trainer.sharding=fsdp")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sharding: FSDP2 over 2 process(es)" in r.stdout, r.stdout
    return run_dir


# Sharded runs: (BERT_TRAIN_FAULT, or a KILL_POINT of kill_during_save.py) -> the checkpoint
# the restart resumes from.  Every kill of step 4's save before its rename leaves step 2.
FSDP_KILL_POINTS = {
    "fault=1:step:5": 4,          # mid-step, after the first micro-batch's backward
    "fault=0:saved:4": 4,         # right after a complete sharded checkpoint
    "fault=1:save:4": 2,          # rank 1 wrote its RNG state; rank 0 waits in DCP's save
    "fault=1:eval:3": 2,          # a sharded evaluation (every forward gathers parameters)
    "kill=shard-write:1:4": 2,    # rank 1 as it starts writing its shards
    "kill=metadata:0:4": 2,       # rank 0 (DCP's coordinator) writing .metadata after all shards
    "kill=gather:1:4": 2,         # rank 1 handing its shards' checksums to rank 0
    "kill=rename:0:4": 2,         # rank 0 renaming the finished folder into place
    "kill=pointer:0:4": 4,        # rank 0 after the rename: step 4 is complete
}


@pytest.mark.parametrize("point", list(FSDP_KILL_POINTS))
def test_sigkilled_rank_of_a_sharded_run_restarts_and_ends_bit_equal(data, uninterrupted_fsdp,
                                                                      tmp_path, point):
    run_dir = tmp_path / "run"
    how, _, spec = point.partition("=")
    r = launch(torchrun(logs=tmp_path / "logs"), run_dir, data, spec if how == "fault" else None,
               "trainer.sharding=fsdp", kill_point=spec if how == "kill" else None)
    assert_restarted_once(r, run_dir, FSDP_KILL_POINTS[point], tmp_path / "logs")
    assert "sharding: FSDP2 over 2 process(es)" in r.stdout
    # model and optimizer state: the difference measured was 0 at every point, so bit-equal
    # is asserted (not a tolerance: the same 2 processes redo the same sums)
    expected, got = sharded_state(uninterrupted_fsdp), sharded_state(run_dir)
    assert any(k.startswith("optim.state.") for k in expected)
    assert_bit_equal(expected, got)


def test_bert_launch_restarts_with_accelerates_flags(data, uninterrupted, tmp_path):
    """The same under `bert-launch` (accelerate launch): --max_restarts and --rdzv_backend c10d."""
    run_dir = tmp_path / "run"
    r = launch(bert_launch(), run_dir, data, "1:step:5")
    assert r.returncode == 0, r.stderr[-4000:]
    assert failures(r) in (["-9"], ["1"]) and r.stdout.count("resumed from") == 1, \
        r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert_bit_equal(weights(uninterrupted), weights(run_dir))


def test_sigterm_to_one_rank_saves_once_on_every_rank_and_exits_0(data, uninterrupted, tmp_path):
    """A preempted node: rank 1 gets SIGTERM after step 2; the stop request reaches rank 0 in
    step 3's reduction, so both save step 3 (each its RNG state) and exit 0, with no restart;
    resume=auto then ends where the uninterrupted run ends."""
    run_dir = tmp_path / "run"
    r = launch(torchrun(), run_dir, data, "1:logged:2:TERM")
    assert r.returncode == 0, r.stderr[-4000:]
    assert failures(r) == []  # no process failed, nothing restarted
    assert r.stdout.count("stop requested: saving at step 3") == 1, r.stdout
    assert steps_saved(run_dir) == [2, 3]
    ckpt = run_dir / "checkpoints" / "step-00000003"
    assert sorted(p.name for p in ckpt.glob("rng_state_rank*.pt")) == [
        "rng_state_rank0.pt", "rng_state_rank1.pt"]
    assert "finished at step" not in r.stdout
    r = launch(torchrun(restarts=0), run_dir, data)
    assert r.returncode == 0, r.stderr[-4000:]
    assert_bit_equal(weights(uninterrupted), weights(run_dir))


def _saved_by_both_at_step_3(r: subprocess.CompletedProcess, run_dir: Path) -> None:
    """Both ranks stopped at step 3 and saved it (each its RNG state), nothing restarted."""
    assert failures(r) == [], r.stderr[-3000:]
    assert r.stdout.count("stop requested: saving at step 3") == 1, r.stdout
    assert steps_saved(run_dir) == [2, 3]
    ckpt = run_dir / "checkpoints" / "step-00000003"
    assert sorted(p.name for p in ckpt.glob("rng_state_rank*.pt")) == [
        "rng_state_rank0.pt", "rng_state_rank1.pt"]


def test_sigterm_to_the_launcher_saves_once_on_every_rank(data, uninterrupted, tmp_path):
    """A preempted job whose scheduler signals the launcher (torchrun's agent): rank 0 sends its
    parent SIGTERM after step 2 (BERT_TRAIN_FAULT ...:LAUNCHER, which waits until the agent has
    passed it on); both ranks save step 3 and exit, and resume=auto ends where the run that
    was never stopped ends. With the batches read ahead by a worker process per rank (the
    default on GPUs): the workers ignore the SIGTERM, and their ranks stop them."""
    run_dir = tmp_path / "run"
    r = launch(torchrun(), run_dir, data, "0:logged:2:LAUNCHER", "trainer.prefetch=true")
    assert r.returncode != 0  # (torchrun's own: it re-raises the signal as an exception)
    assert "Received 15 death signal" in r.stderr, r.stderr[-3000:]
    _saved_by_both_at_step_3(r, run_dir)
    r = launch(torchrun(restarts=0), run_dir, data, None, "trainer.prefetch=true")
    assert r.returncode == 0, r.stderr[-4000:]
    assert_bit_equal(weights(uninterrupted), weights(run_dir))


def test_bert_launch_stopped_by_sigterm_says_so_in_one_line(data, tmp_path):
    """The same under bert-launch: its exit is one line and 128 + SIGTERM's 15, not torch
    elastic's traceback of the agent."""
    run_dir = tmp_path / "run"
    r = launch(bert_launch(), run_dir, data, "0:logged:2:LAUNCHER")
    assert r.returncode == 143, r.stderr[-4000:]
    _saved_by_both_at_step_3(r, run_dir)
    assert "Traceback" not in r.stderr and "SignalException" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (
        "bert-launch: stopped by SIGTERM: every process was asked to save at the end of its "
        "step and exit; continue with the same command and resume=auto")
