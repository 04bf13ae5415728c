"""Exact resume: a run stopped at step k and resumed logs the same loss at every later step as an
uninterrupted run, bit for bit on CPU."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from time_limits import hang_deadline, hang_limit
from train_support import (REPO, read_metrics, train_in_process, write_prepared)
from unseeded_steps import without_reseed


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    # 40 training instances and a global batch of 8: an epoch is 5 steps, so a resume at step 3
    # is mid-epoch and the run crosses two epoch boundaries.
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=40, num_valid=8)


def _losses(run_dir):
    return {r["step"]: (r["loss"], r["mlm_loss"], r["nsp_loss"], r["lr"])
            for r in read_metrics(run_dir) if "loss" in r}


# The locality bias fades from step 2.4 to 7.2 of 12: the resume at step 3 is mid-fade.
LOCALITY = ["trainer.attention_locality=1.0", "trainer.attention_locality_hold=0.2",
            "trainer.attention_locality_end=0.6"]


@pytest.mark.parametrize("masking,micro,extra", [("static", 4, []), ("dynamic", 2, []),
                                                 ("static", 4, LOCALITY)],
                         ids=["static", "dynamic", "locality"])
def test_resume_mid_epoch_with_accumulation_is_bit_exact(tmp_path, prepared, masking, micro,
                                                         extra):
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=12",
              "trainer.checkpoint_every=3", "trainer.keep_last_k=10", "trainer.eval_every=0",
              f"trainer.micro_batch_size={micro}", f"data.masking={masking}", *extra]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    final_full = train_in_process(common + [f"run_dir={full}"])
    # The interrupted run: only the step-3 checkpoint exists (as after a crash at step 4 or 5).
    os.makedirs(os.path.join(part, "checkpoints"))
    shutil.copytree(os.path.join(full, "checkpoints", "step-00000003"),
                    os.path.join(part, "checkpoints", "step-00000003"))
    final_part = train_in_process(common + [f"run_dir={part}", "resume=auto"])
    a, b = _losses(full), _losses(part)
    assert sorted(b) == list(range(4, 13))
    for step in b:
        assert a[step] == b[step], f"step {step}: {a[step]} != {b[step]}"
    assert final_full == final_part
    # dropout is on in the smoke model, so equality is not trivial: steps differ from each other
    assert len({a[s][0] for s in a}) == len(a)


def test_resume_restores_the_global_random_state(tmp_path, prepared, monkeypatch):
    """Step 4's dropout masks, drawn from the stream the step-3 checkpoint saved: the test above
    passes even when a resume skips restoring the RNG state, because every step re-seeds
    (unseeded_steps.py)."""
    from bert_pretrain.trainer import Trainer

    without_reseed(monkeypatch, Trainer)
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=5",
              "trainer.checkpoint_every=3", "trainer.eval_every=0"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train_in_process(common + [f"run_dir={full}"])
    os.makedirs(os.path.join(part, "checkpoints"))
    shutil.copytree(os.path.join(full, "checkpoints", "step-00000003"),
                    os.path.join(part, "checkpoints", "step-00000003"))
    train_in_process(common + [f"run_dir={part}", "resume=auto"])
    a, b = _losses(full), _losses(part)
    assert sorted(b) == [4, 5]
    for step in b:
        assert a[step] == b[step], f"step {step}: {a[step]} != {b[step]}"


def test_sigterm_saves_and_resume_equals_uninterrupted(tmp_path, prepared):
    """Preemption: SIGTERM mid-run finishes the step, saves, exits 0; resume=auto continues
    exactly.  A constant schedule makes the lr independent of max_steps, so the interrupted run
    (max_steps=100000) and the reference (max_steps=k+6) see the same learning rates."""
    common = ["experiment=smoke", f"data.dir={prepared}", "scheduler=constant",
              "trainer.checkpoint_every=100000", "trainer.eval_every=0", "trainer.log_every=1",
              "model.hidden_size=16", "model.intermediate_size=16", "trainer.global_batch_size=4"]
    run = str(tmp_path / "run")
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "bert_pretrain.train", *common,
                             f"run_dir={run}", "trainer.max_steps=100000"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = hang_deadline()  # 5 steps logged, however long start-up takes on this machine
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and sum(1 for _ in open(metrics)) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=hang_limit())
    assert proc.returncode == 0, out
    assert "stop requested" in out
    ckpts = sorted(n for n in os.listdir(os.path.join(run, "checkpoints"))
                   if n.startswith("step-"))
    assert len(ckpts) == 1, ckpts
    k = int(ckpts[0].split("-")[1])
    assert 5 <= k < 100000
    train_in_process(common + [f"run_dir={run}", "resume=auto", f"trainer.max_steps={k + 6}"])
    ref = str(tmp_path / "ref")
    train_in_process(common + [f"run_dir={ref}", f"trainer.max_steps={k + 6}"])
    a, b = _losses(ref), _losses(run)
    assert sorted(b) == list(range(1, k + 7))  # records after the checkpoint were replaced
    for step in range(1, k + 7):
        assert a[step] == b[step], f"step {step}"


# bert-train pressed Ctrl-C twice at step 3 (after its first micro-batch's backward): the first
# asks it to save at the end of the step, the second stops it at once.
CTRL_C_TWICE = """
import os, signal, sys
from bert_pretrain.components import fault_point

def reached(phase, step, rank):
    if (phase, step) == ("step", 3):
        os.kill(os.getpid(), signal.SIGINT)  # (its handler runs here, before the next line)
        os.kill(os.getpid(), signal.SIGINT)

fault_point.reached = reached
sys.argv = ["bert-train", *sys.argv[1:]]
from bert_pretrain.train import main
main()
"""


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_resume_continues(tmp_path, prepared):
    """Not Python's traceback of wherever the interrupt landed (inside the backward pass):
    one line saying how to go on, exit 130 as a shell reports a Ctrl-C'd command; the run
    folder is left as a kill leaves it, and resume=auto ends where an uninterrupted run ends."""
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=6",
              "trainer.checkpoint_every=2", "trainer.eval_every=0", "trainer.log_every=1",
              "trainer.progress_bar=false", "trainer.report=false"]
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", CTRL_C_TWICE, *common, f"run_dir={run}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit())
    assert p.returncode == 130, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1] == (
        "bert-train: interrupted; resume=auto continues from the last complete checkpoint (one "
        "Ctrl-C during training saves the step first)")
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.startswith("step-")) == \
        ["step-00000002"]
    for args in ([f"run_dir={run}", "resume=auto"], [f"run_dir={tmp_path / 'ref'}"]):
        # (as the interrupted run: one thread; another count moves the last bits of the sums)
        again = subprocess.run([sys.executable, "-m", "bert_pretrain.train", *common, *args],
                               cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=hang_limit())
        assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(str(tmp_path / "ref")) == _losses(str(run))
