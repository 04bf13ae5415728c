"""Damaged checkpoints, end to end through bert-train and bert-export: resume=auto
falls back to the previous valid checkpoint and continues exactly; an explicit corrupt checkpoint
(resume= or init_from=) and bert-export of one are one-line errors; no torch.load in the code can
execute a pickle.
(tests/test_untrusted.py and tests/test_checkpoint.py test the checkpoint functions directly.)"""

import os
import shutil
import subprocess
import sys

import pytest

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.errors import CheckpointError
from train_support import REPO, read_metrics, train_in_process, write_prepared



@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=32, num_valid=8)


@pytest.fixture(scope="module")
def trained(synthetic, tmp_path_factory):
    """A run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}",
                      "trainer.max_steps=4", "trainer.checkpoint_every=2",
                      "trainer.keep_last_k=5", "trainer.eval_every=0"])
    return run


def copy_run(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def resume(synthetic, run, *extra):
    return train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}",
                             "trainer.max_steps=6", "trainer.checkpoint_every=2",
                             "trainer.keep_last_k=5", "trainer.eval_every=0", *extra])


# --------------------------------------------------------------------------- integrity



@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(trained, synthetic, tmp_path,
                                                              capsys, damage):
    run = copy_run(trained, tmp_path)
    target = run / "checkpoints" / "step-00000004" / ("model.safetensors" if damage != "flip"
                                                      else "optimizer.pt")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(CheckpointError, match="step-00000004"):
        ckpt.verify_checkpoint(str(target.parent))
    capsys.readouterr()
    resume(synthetic, run, "resume=auto")
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and "step-00000004" in warnings[0], err
    # It resumed from step 2 and re-did steps 3..6, identical to the undamaged run's 3 and 4.
    records = {r["step"]: r for r in read_metrics(run) if "loss" in r}
    original = {r["step"]: r for r in read_metrics(trained) if "loss" in r}
    assert sorted(records) == list(range(1, 7))
    assert records[3]["loss"] == original[3]["loss"] and records[4]["loss"] == original[4]["loss"]


def test_an_explicit_corrupt_checkpoint_is_refused(trained, synthetic, tmp_path):
    run = copy_run(trained, tmp_path)
    bad = run / "checkpoints" / "step-00000004"
    (bad / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(CheckpointError, match=r"config.yaml does not match its sha256"):
        resume(synthetic, tmp_path / "other", f"resume={bad}")
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        train_in_process(["experiment=smoke", f"data.dir={synthetic}",
                          f"run_dir={tmp_path / 'phase2'}", f"trainer.init_from={bad}"])


def test_bert_export_refuses_a_corrupt_checkpoint(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    bad = run / "checkpoints" / "step-00000004"
    (bad / "model.safetensors").write_bytes(b"\0" * 64)
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export", str(bad),
                        str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "model.safetensors does not match its sha256" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- no code execution



def test_every_torch_load_in_the_project_is_weights_only():
    """A new torch.load / pickle.load anywhere in the code must not bring execution back."""
    offenders = []
    for folder in ("bert_pretrain", "data_prep"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                text = open(os.path.join(root, name), encoding="utf-8").read()
                for line in text.splitlines():
                    code = line.split("#")[0]
                    if ("torch.load(" in code and "weights_only=True" not in code) or \
                            "pickle.load" in code or "allow_pickle=True" in code:
                        offenders.append(f"{name}: {line.strip()}")
    assert offenders == []
