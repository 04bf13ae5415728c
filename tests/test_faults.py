"""Fault injection: `kill -9` a real `bert-train` run at random moments, again and again, and
resume it each time with resume=auto.

Each restart is killed at a moment drawn at random from: during start-up and resume (a random
delay after launch), right after a training step was logged (plus a random delay, landing in
the following steps, checkpoint writes or evaluations), and while a checkpoint is being written
(when its `.tmp-step-*` directory appears).  Twice, the newest checkpoint is also damaged
(truncated weights, a flipped bit in the optimizer state) before the restart, which must skip
it with a warning.  Then:

- every restart that gets past start-up resumes from the newest intact checkpoint;
- no kill ever costs more than the steps since the last completed checkpoint;
- the final weights equal those of an uninterrupted run bit for bit (CPU);
- no restart prints a traceback.

Counts are printed (pytest -s) as the table in docs/checkpoints.md ("Reliability"):
    pytest -m slow -s tests/test_faults.py
Set FAULTS=N to inject more (default 24) and FAULT_SEED to draw other moments.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.components import checkpoint_manager as cm
from time_limits import hang_deadline, hang_limit
from train_support import REPO, write_prepared

MAX_STEPS, EVERY, EVAL_EVERY = 96, 2, 5
COMMON = ["experiment=smoke", f"trainer.max_steps={MAX_STEPS}", f"trainer.checkpoint_every={EVERY}",
          f"trainer.eval_every={EVAL_EVERY}", "trainer.eval_max_samples=16", "trainer.log_every=1",
          "trainer.keep_last_k=2", "trainer.warmup_steps=4", "trainer.progress_bar=false"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


def _start(tmp_path, run_dir, tag, *extra):
    out, err = open(tmp_path / f"{tag}.out", "w"), open(tmp_path / f"{tag}.err", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bert_pretrain.train", *COMMON, f"data.dir={tmp_path / 'data'}",
         f"run_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra' / tag}", *extra],
        cwd=tmp_path, env=_env(), stdout=out, stderr=err, start_new_session=True)
    return proc, tmp_path / f"{tag}.out", tmp_path / f"{tag}.err"


def _records(run_dir):
    """metrics.jsonl so far (a line cut short by the kill is ignored)."""
    out = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


def _logged_steps(run_dir):
    return [r["step"] for r in _records(run_dir) if "loss" in r]


def _saving(run_dir, since):
    """A checkpoint write of this launch is under way (a `.tmp-step-*` left by an earlier
    kill does not count: the trainer removes those at start-up)."""
    root = cm.checkpoints_root(str(run_dir))
    try:
        return any(n.startswith(".tmp-step-") and os.stat(os.path.join(root, n)).st_ctime >= since
                   for n in os.listdir(root))
    except FileNotFoundError:
        return False


def _step_of(path):
    return int(os.path.basename(path).split("-")[1]) if path else 0


def _started(out):
    """Past start-up: the trainer has printed its banner (after truncating metrics.jsonl to the
    checkpoint, so records seen from then on are this launch's)."""
    return "parameters;" in out.read_text()


def _wait_and_kill(proc, run_dir, rng, start_step, since, out, step_s):
    """Kill `proc` at a random moment; returns the moment's kind, or None if it finished first."""
    mode = rng.choices(["startup", "after-step", "checkpoint-write", "evaluation"],
                       weights=[1, 2, 2, 1])[0]
    target = start_step + rng.randint(1, 3)
    # the events awaited come however slow the machine; the deadline only ends a hung run
    deadline = time.monotonic() + rng.uniform(0.3, 5.0) if mode == "startup" else hang_deadline()
    while proc.poll() is None and time.monotonic() < deadline:
        if mode in ("after-step", "evaluation") and not _started(out):
            pass
        elif mode == "startup" and _started(out) and \
                any(s >= target for s in _logged_steps(run_dir)):
            break  # start-up ended before the delay: a kill in training, a few steps on (a run
            # left to go on for the whole delay could finish before all the faults are in)
        elif mode == "after-step" and any(s >= target for s in _logged_steps(run_dir)):
            # lands in the next step, checkpoint write or evaluation: the delay is in units of
            # the run's own step time (steps, saves and evaluations together), so a faster
            # machine or model does not carry the run many steps on before each kill
            time.sleep(rng.uniform(0.0, 2 * step_s))
            break
        elif mode == "evaluation" and any(s > start_step and s % EVAL_EVERY == 0
                                        for s in _logged_steps(run_dir)):
            time.sleep(rng.uniform(0.0, 0.01))  # the evaluation follows the step's log line
            break
        if mode == "checkpoint-write" and _saving(run_dir, since):
            time.sleep(rng.uniform(0.0, 0.005))
            break
        time.sleep(0.002)
    if proc.poll() is not None:
        return None
    phase = "checkpoint write" if _saving(run_dir, since) else mode
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not _started(out):
        return "startup / resume"
    logged = _logged_steps(run_dir)
    if phase in ("after-step", "evaluation"):  # where it was: in an evaluation when the last
        evaluated = any(r.get("step") == logged[-1] and "eval_mlm_loss" in r  # step logged
                        for r in _records(run_dir)) if logged else True  # calls for one that
        phase = "evaluation" if logged and logged[-1] % EVAL_EVERY == 0 and not evaluated \
            else "training step"  # was not logged yet
    return "training step" if phase in ("startup", "checkpoint-write") else phase


def _comparable(run_dir):
    """metrics.jsonl by (kind, step) without the timing fields (the last record of a step wins:
    an evaluation logged again after a resume)."""
    return {("eval" if "eval_mlm_loss" in r else "train", r["step"]):
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")}
            for r in _records(run_dir)}


def _damage(path, how):
    file = os.path.join(path, "model.safetensors" if how == "truncate" else "optimizer.pt")
    if how == "truncate":
        os.truncate(file, os.path.getsize(file) // 3)
    else:
        data = bytearray(open(file, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(file, "wb").write(bytes(data))


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_auto_loses_nothing(tmp_path):
    n_faults = int(os.environ.get("FAULTS", "24"))
    rng = random.Random(int(os.environ.get("FAULT_SEED", "20261123")))
    write_prepared(str(tmp_path / "data"), num_train=96, num_valid=24)
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    proc, ref_out, ref_err = _start(tmp_path, reference_dir, "reference")
    while proc.poll() is None and not _started(ref_out):
        time.sleep(0.002)
    began = time.monotonic()
    assert proc.wait(timeout=hang_limit()) == 0, ref_err.read_text()[-3000:]
    step_s = (time.monotonic() - began) / MAX_STEPS  # per step, saves and evaluations included

    kinds, lost, resumed, damaged, tracebacks = {}, [], 0, [], 0
    launches = fresh = 0
    damage_plan = [(n_faults // 3, "truncate"), ((2 * n_faults) // 3, "bitflip")]
    while True:
        expected = cm.latest_checkpoint(str(run_dir))  # newest intact one (resume=auto)
        newest = cm.latest_checkpoint(str(run_dir), verify=False)
        assert expected == newest or newest in damaged, \
            f"a kill left a damaged checkpoint {newest}"
        how = None
        if damage_plan and sum(kinds.values()) >= damage_plan[0][0] and expected == newest \
                and len(cm.list_checkpoints(str(run_dir))) >= 2:
            # damage the newest checkpoint: the restart must fall back to the one before it
            how = damage_plan.pop(0)[1]
            _damage(expected, how)
            damaged.append(expected)
            expected = cm.latest_checkpoint(str(run_dir))
        launches += 1
        since = time.time() - 0.01
        proc, out, err = _start(tmp_path, run_dir, f"run{launches}",
                                *(["resume=auto"] if launches > 1 else []))
        kind = _wait_and_kill(proc, run_dir, rng, _step_of(expected), since, out, step_s) \
            if sum(kinds.values()) < n_faults else None
        if kind is None:
            assert proc.wait(timeout=hang_limit()) == 0, err.read_text()[-3000:]
        stdout, stderr = out.read_text(), err.read_text()
        tracebacks += stderr.count("Traceback")
        if "parameters;" in stdout:  # got past start-up: check where it resumed from
            assert (f"resumed from {expected}" in stdout) if expected else \
                ("resumed from" not in stdout), (expected, stdout)
            resumed += bool(expected)
            fresh += not expected
        if how and "parameters;" in stdout:
            assert f"skipping damaged checkpoint {damaged[-1]}" in stderr, stderr
        if kind is None:
            break
        kinds[kind] = kinds.get(kind, 0) + 1
        logged = _logged_steps(run_dir)
        kept = _step_of(cm.latest_checkpoint(str(run_dir)))
        lost.append(max(max(logged, default=0) - kept, 0))
        # only the steps after the last checkpoint (and, while a checkpoint we damaged is
        # still there, the steps after the one before it)
        bound = 2 * EVERY if cm.latest_checkpoint(str(run_dir), verify=False) in damaged \
            else EVERY
        assert lost[-1] <= bound, (logged[-3:], kept)

    final = os.path.join(cm.checkpoints_root(str(run_dir)), f"step-{MAX_STEPS:08d}")
    ref = os.path.join(cm.checkpoints_root(str(reference_dir)), f"step-{MAX_STEPS:08d}")
    a, b = load_file(os.path.join(final, "model.safetensors")), \
        load_file(os.path.join(ref, "model.safetensors"))
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"final weights differ from the uninterrupted run: {different[:5]}"
    steps = [r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]
    assert steps == list(range(1, MAX_STEPS + 1))  # every step logged once, none missing
    # ... with what the uninterrupted run logged (timing aside): the logging window's sums
    # travel in the checkpoints, so no record averages only the steps since a resume
    logged, expected_log = _comparable(run_dir), _comparable(reference_dir)
    assert logged == expected_log, [s for s in expected_log if logged.get(s) != expected_log[s]]
    assert tracebacks == 0
    faults = sum(kinds.values())
    assert faults >= n_faults, f"the run reached step {MAX_STEPS} after {faults} of {n_faults} " \
        "faults: each kill carried it too far on"
    assert resumed >= 1 and len(damaged) == 2
    print(f"\nfaults injected: {faults} ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))})"
          f"; damaged checkpoints: {len(damaged)}; launches: {launches}, of which {resumed} "
          f"resumed from the newest intact checkpoint, {fresh} started fresh (no checkpoint "
          f"yet), {launches - resumed - fresh} were killed in start-up; failed resumes: 0; "
          f"steps lost: {sum(lost)} in all, at most {max(lost)} "
          f"per fault (checkpoint_every={EVERY}); tracebacks: {tracebacks}; final weights equal "
          f"to the uninterrupted run: yes ({len(a)} tensors)")


def test_explicit_resume_of_a_damaged_checkpoint_is_one_line(tmp_path):
    write_prepared(str(tmp_path / "data"), num_train=32, num_valid=8)
    run_dir = tmp_path / "run"
    proc, _, err = _start(tmp_path, run_dir, "first", "trainer.max_steps=2",
                          "trainer.warmup_steps=0")
    assert proc.wait(timeout=hang_limit()) == 0, err.read_text()[-2000:]
    path = cm.latest_checkpoint(str(run_dir))
    _damage(path, "bitflip")
    proc, out, err = _start(tmp_path, run_dir, "again", "trainer.max_steps=4",
                            "trainer.warmup_steps=0", f"resume={path}")
    assert proc.wait(timeout=hang_limit()) == 2
    lines = err.read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bert-train: error: ") and \
        "optimizer.pt does not match its sha256" in lines[0], lines
