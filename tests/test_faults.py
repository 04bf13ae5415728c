"""Fault injection: a training run killed with SIGKILL at random moments (during steps,
checkpoint writes and evaluations), 20 times in a row, each time restarted with resume=auto,
ends with the same weights, bit for bit, as a run that was never interrupted, and loses nothing
beyond the last completed checkpoint.

    pytest -m slow tests/test_faults.py -s     # prints the fault table (README, "Reliability")
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from train_support import REPO, read_metrics, write_prepared

STEPS = 300
ARGS = ["experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every=2",
        "trainer.keep_last_k=2", "trainer.eval_every=5", "trainer.log_every=1",
        "trainer.report=false", "model.hidden_size=64", "model.intermediate_size=128"]
KILLS = 20


def start(run_dir, data):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "bert_pretrain.train", *ARGS,
                             f"data.dir={data}", f"run_dir={run_dir}", "resume=auto"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def steps_logged(run_dir) -> int:
    try:
        return sum(1 for line in open(os.path.join(run_dir, "metrics.jsonl"))
                   if '"loss"' in line)
    except OSError:
        return 0


def last_checkpoint_step(run_dir) -> int:
    root = os.path.join(run_dir, "checkpoints")
    steps = [int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")] \
        if os.path.isdir(root) else []
    return max(steps, default=0)


@pytest.mark.slow
def test_twenty_kills_then_the_uninterrupted_runs_weights(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    reference = tmp_path / "reference"
    proc = start(reference, data)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]

    run = tmp_path / "faulted"
    rng = random.Random(0)
    kills = resumes = lost = 0
    while kills < KILLS:
        before = last_checkpoint_step(run)
        proc = start(run, data)
        # Kill somewhere in the next few steps: after the first new record, a random extra
        # delay lands in forward/backward, checkpoint writes (every 2 steps) or evaluation.
        target = steps_logged(run) + rng.randint(0, 3)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and steps_logged(run) <= target:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        if proc.poll() is not None:  # it finished before the kill: all steps are done
            break
        reached = steps_logged(run)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        kills += 1
        if before:
            assert f"resumed from {os.path.join(run, 'checkpoints')}" in out, out[-2000:]
            resumes += 1
        lost += max(reached - last_checkpoint_step(run), 0)
    proc = start(run, data)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    resumes += 1

    final = f"step-{STEPS:08d}"
    a = load_file(str(reference / "checkpoints" / final / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / final / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key
    ours = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    theirs = {r["step"]: r["loss"] for r in read_metrics(reference) if "loss" in r}
    assert ours == theirs
    state = json.loads((run / "checkpoints" / final / "trainer_state.json").read_text())
    assert state["samples_consumed"] == STEPS * 8
    assert kills >= KILLS, f"only {kills} kills: the run finished first"
    print(f"\nfaults injected: {kills} SIGKILLs; resumes that succeeded: {resumes}/{resumes}; "
          f"steps redone after a kill (work since the last checkpoint): {lost}; final weights "
          f"equal to the uninterrupted run: yes (bit for bit, {len(a)} tensors)")
