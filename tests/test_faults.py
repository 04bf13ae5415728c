"""Fault injection: `kill -9` a real `bert-train` run at points of its work drawn at random,
again and again, and resume it each time with resume=auto.

Each restart is killed at a point drawn (seeded) from: start-up and resume (entering the repair
of interrupted saves, the search for the checkpoint, its loading, the start of the line), a
training step (before it, computed but not logged, logged but not yet evaluated or saved), an
evaluation (after its first batch) and a checkpoint write (at one of its file writes, renames
and removals).  The points are named, counted from the launch (tests/fault_points.py kills the
run itself there), so the same seed covers the same points on a fast machine and on a loaded
one.  Twice, the newest checkpoint is also damaged (truncated weights, a flipped bit in the
optimizer state) before the restart, which must skip it with a warning.  Then:

- every restart that gets past start-up resumes from the newest intact checkpoint;
- no kill ever costs more than the steps since the last completed checkpoint;
- the final weights equal those of an uninterrupted run bit for bit (CPU);
- no restart prints a traceback.

Counts are printed (pytest -s) as the table in docs/checkpoints.md ("Reliability"):
    pytest -m slow -s tests/test_faults.py
Set FAULTS=N to inject more (default 24) and FAULT_SEED to draw other points.
"""
import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.components import checkpoint_manager as cm
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO, write_prepared

MAX_STEPS, EVERY, EVAL_EVERY = 96, 2, 5
COMMON = ["experiment=smoke", f"trainer.max_steps={MAX_STEPS}", f"trainer.checkpoint_every={EVERY}",
          f"trainer.eval_every={EVAL_EVERY}", "trainer.eval_max_samples=16", "trainer.log_every=1",
          "trainer.keep_last_k=2", "trainer.warmup_steps=4", "trainer.progress_bar=false"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": CHILD_PYTHONPATH, "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_points.py")


def _start(tmp_path, run_dir, tag, *extra, fault=""):
    """bert-train through tests/fault_points.py, which kills it at the point `fault` names."""
    out, err = open(tmp_path / f"{tag}.out", "w"), open(tmp_path / f"{tag}.err", "w")
    proc = subprocess.Popen(
        [sys.executable, DRIVER, *COMMON, f"data.dir={tmp_path / 'data'}",
         f"run_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra' / tag}", *extra],
        cwd=tmp_path, env={**_env(), "FAULT": fault}, stdout=out, stderr=err,
        start_new_session=True)
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


def _step_of(path):
    return int(os.path.basename(path).split("-")[1]) if path else 0


def _started(out):
    """Past start-up: the trainer has printed its banner (after truncating metrics.jsonl to the
    checkpoint, so records seen from then on are this launch's)."""
    return "parameters;" in out.read_text()


KINDS = {"start": "startup / resume", "step": "training step", "eval": "evaluation",
         "save": "checkpoint write"}


def _draw(rng, resuming, save_writes):
    """A kill point of the next launch (tests/fault_points.py), and its kind."""
    kind = rng.choices(["start", "step", "save", "eval"], weights=[1, 2, 2, 1])[0]
    if kind == "start":
        point = rng.choice(["repair", "find", "begin"] + (["load_states"] if resuming else []))
    elif kind == "step":
        point = f"{rng.randint(1, 3)}:{rng.choice(['before', 'after', 'logged'])}"
    elif kind == "save":  # a save comes every EVERY steps: the 1st or 2nd of the launch
        point = f"{rng.randint(1, 2)}:{rng.randint(1, save_writes)}"
    else:  # an evaluation every EVAL_EVERY steps: the launch's first
        point = "1"
    return f"{kind}:{point}", KINDS[kind]


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
    counts = tmp_path / "writes-per-save"
    proc, ref_out, ref_err = _start(tmp_path, reference_dir, "reference",
                                    fault=f"count:{counts}")
    assert proc.wait(timeout=hang_limit()) == 0, ref_err.read_text()[-3000:]
    save_writes = min(int(n) for n in counts.read_text().split())  # every save makes these
    assert save_writes >= 5

    kinds, lost, resumed, damaged, tracebacks, points = {}, [], 0, [], 0, []
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
        point, kind = _draw(rng, expected is not None, save_writes) \
            if sum(kinds.values()) < n_faults else ("", None)
        proc, out, err = _start(tmp_path, run_dir, f"run{launches}",
                                *(["resume=auto"] if launches > 1 else []), fault=point)
        code = proc.wait(timeout=hang_limit())
        if code == 0:
            kind = None  # it finished before the point came
        else:
            assert code == -signal.SIGKILL, err.read_text()[-3000:]
            assert _started(out) == (kind != "startup / resume"), (point, out.read_text())
            points.append(point)
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
          f"to the uninterrupted run: yes ({len(a)} tensors); points: {', '.join(points)}")


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
