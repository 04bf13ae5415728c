"""Untrusted files: loading a checkpoint or prepared data never runs code from it.

A pickle can name any callable to run at load time (`__reduce__`).  Every place bert-train
reads a file gets a planted payload that would create a file when unpickled; the loader must
refuse it with one line and the file must not exist afterwards.  The checksums in
trainer_state.json are re-signed first, as an attacker who edits a checkpoint would do: a
checksum detects damage, the loaders must be safe on their own.
"""
import json
import os
import pickle

import numpy as np
import pytest
import torch

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.errors import CheckpointError, DataError
from bert_pretrain.model import BertConfig, BertForPreTraining
from test_checkpoint import SMALL, _save
from train_support import run_bert_train, write_prepared


class Payload:
    """Unpickling this calls open(marker, "w"): it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def resign(path):
    """Recompute a checkpoint's checksums after editing it (what a tamperer would do)."""
    file = os.path.join(path, ckpt.STATE_JSON)
    state = json.load(open(file))
    state["files"] = {n: ckpt._sha256(os.path.join(path, n)) for n in ckpt._files_of(path)}
    state["state_sha256"] = ckpt._state_digest(state)
    json.dump(state, open(file, "w"))


def test_the_payload_runs_when_loaded_unsafely(tmp_path):
    """The payload is real: an unrestricted torch.load executes it (so the tests below can fail)."""
    marker = tmp_path / "pwned"
    torch.save({"state": Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.pt", "rng_state_rank0.pt"])
def test_planted_pickle_in_checkpoint_state_is_refused(tmp_path, name):
    path = _save(str(tmp_path / "run"), 1, BertForPreTraining(BertConfig(**SMALL)))
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": Payload(marker)}, os.path.join(path, name))
    resign(path)
    ckpt.verify_checkpoint(path)  # the checksums pass: only the loader stands in the way
    with pytest.raises(CheckpointError) as err:
        ckpt.load_states(path, 0)
    message = str(err.value)
    assert "\n" not in message and name in message and "refusing to load" in message
    assert not marker.exists()


def test_raw_pickle_as_weights_is_refused(tmp_path):
    path = _save(str(tmp_path / "run"), 1, BertForPreTraining(BertConfig(**SMALL)))
    marker = tmp_path / "pwned"
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        pickle.dump(Payload(marker), f)
    resign(path)
    with pytest.raises(CheckpointError, match="model.safetensors") as err:
        ckpt.load_weights(path, BertForPreTraining(BertConfig(**SMALL)))
    assert "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("as_object_array", [True, False])
def test_planted_pickle_in_prepared_data_is_refused(tmp_path, as_object_array):
    from bert_pretrain.components.data import PreparedData

    root = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    marker = tmp_path / "pwned"
    target = os.path.join(root, "train", "shard-00000", "input_ids.npy")
    if as_object_array:  # a valid .npy whose dtype is object: its payload is a pickle
        np.save(target, np.array([Payload(marker)] * 8, dtype=object), allow_pickle=True)
    else:                # a bare pickle under the .npy name
        with open(target, "wb") as f:
            pickle.dump(Payload(marker), f)
    with pytest.raises(DataError, match="input_ids.npy") as err:
        PreparedData(root).split("train")
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_rng_state_loads_with_weights_only_and_restores_exactly(tmp_path):
    import random

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.normal()  # cached gaussians are part of the state
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
                np.random.normal(), torch.rand(3).tolist())
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
            np.random.normal(), torch.rand(3).tolist()) == expected


def test_cuda_rng_saves_and_restores_the_current_device_only(monkeypatch):
    """A rank restores its own device's generator: a node that sees fewer GPUs than the one that
    saved (get_rng_state_all -> set_rng_state_all) would fail or seed the wrong devices."""
    calls = []

    def all_devices(*a, **k):
        raise AssertionError("must not touch every device's generator")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    saved = torch.tensor([7], dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": calls.append(s))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", all_devices)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", all_devices)
    state = ckpt.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([7], dtype=torch.uint8))
    ckpt.set_rng_state(state)
    assert len(calls) == 1 and torch.equal(calls[0], state["cuda"])


def test_bert_train_refuses_a_planted_pickle_on_resume(tmp_path):
    """Through the real command: resume=auto on a checkpoint with a planted optimizer.pt is one
    line, exit 2, and the payload never ran."""
    data = write_prepared(str(tmp_path / "data"), num_train=32, num_valid=8)
    run_dir = tmp_path / "run"
    common = ["experiment=smoke", f"data.dir={data}", f"run_dir={run_dir}", "trainer.max_steps=3",
              "trainer.checkpoint_every=3", "hydra.run.dir=" + str(tmp_path / "hydra")]
    first = run_bert_train(common, cwd=str(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    path = cm.latest_checkpoint(str(run_dir))
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [Payload(marker)]}, os.path.join(path, "optimizer.pt"))
    resign(path)
    again = run_bert_train([*common[:-2], "trainer.max_steps=6", "resume=auto",
                            "hydra.run.dir=" + str(tmp_path / "hydra2")], cwd=str(tmp_path))
    assert again.returncode == 2, again.stderr[-2000:]
    # (the resume's own warning names the longer max_steps; then the one error line)
    lines = [ln for ln in again.stderr.strip().splitlines() if "warning: resuming" not in ln]
    assert len(lines) == 1 and lines[0].startswith("bert-train: error: refusing to load"), lines
    assert "Traceback" not in again.stderr + again.stdout
    assert not marker.exists()
