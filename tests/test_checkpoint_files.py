"""A checkpoint is the files its state lists, and nothing else, read safely: verification,
loading and export refuse symlinks and non-regular files, refuse listed paths that leave the
folder, read no file past its recorded size, copy only listed files; the tokenizer comes from
the data directory's own files; exports get the user's umask."""

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.errors import CheckpointError, DataError
from train_support import REPO, train_in_process, write_prepared


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    data = write_prepared(str(root / "data"), num_train=32, num_valid=8)
    run = root / "run"
    train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                      "trainer.max_steps=2", "trainer.checkpoint_every=2", "trainer.eval_every=0",
                      "trainer.warmup_steps=1"])
    return run


def _copy(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    ckpt._verified.clear()
    return run, cm.latest_checkpoint(str(run), verify=False)


def _export(source, out):
    return subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export", str(source), str(out)],
                          cwd=REPO, capture_output=True, text=True)


def test_an_unlisted_link_in_the_tokenizer_is_refused_and_never_exported(trained, tmp_path):
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY\n")
    secret.chmod(0o600)
    run, path = _copy(trained, tmp_path)
    link = os.path.join(path, "tokenizer", "added_tokens.json")
    os.symlink(secret, link)
    with pytest.raises(CheckpointError, match="added_tokens.json is a symbolic link") as err:
        ckpt.verify_checkpoint(path)
    assert "\n" not in str(err.value)
    r = _export(path, tmp_path / "out")  # the checkpoint: one line
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("bert-export: error: ") and \
        "added_tokens.json is a symbolic link" in r.stderr
    r = _export(run, tmp_path / "out")   # the run: its only checkpoint is skipped, said why
    assert r.returncode == 2 and "bert-export: warning: skipping damaged checkpoint" in r.stderr
    assert "added_tokens.json is a symbolic link" in r.stderr
    assert not (tmp_path / "out").exists()


def test_export_copies_only_the_listed_files(trained, tmp_path):
    run, path = _copy(trained, tmp_path)
    (tmp_path / "stray").mkdir()
    with open(os.path.join(path, "tokenizer", "notes.txt"), "w") as f:
        f.write("not part of the checkpoint\n")
    r = _export(run, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors",
                                                    "vocab.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_files_get_the_users_umask(trained, tmp_path, umask):
    run, _ = _copy(trained, tmp_path)
    r = subprocess.run(f"umask {umask:03o} && {sys.executable} -m bert_pretrain.tools.export {run} "
                       f"{tmp_path / 'out'}", shell=True, cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for name in os.listdir(out):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name


def test_a_config_linked_to_dev_zero_is_refused_not_read_forever(trained, tmp_path):
    run, path = _copy(trained, tmp_path)
    os.remove(os.path.join(path, "config.yaml"))
    os.symlink("/dev/zero", os.path.join(path, "config.yaml"))
    with pytest.raises(CheckpointError, match="config.yaml is a symbolic link"):
        ckpt.verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="all 1 checkpoint"):
        cm.latest_checkpoint(str(run))  # resume=auto and bert-export RUN_DIR
    r = _export(run, tmp_path / "out")
    assert r.returncode == 2 and "config.yaml is a symbolic link" in r.stderr


def test_a_state_file_linked_to_a_device_is_refused(trained, tmp_path):
    _, path = _copy(trained, tmp_path)
    os.remove(os.path.join(path, ckpt.STATE_JSON))
    os.symlink("/dev/zero", os.path.join(path, ckpt.STATE_JSON))
    with pytest.raises(CheckpointError, match="trainer_state.json is a symbolic link"):
        ckpt.verify_checkpoint(path)


def test_a_file_grown_past_its_recorded_size_is_refused_before_it_is_read(trained, tmp_path,
                                                                          monkeypatch):
    _, path = _copy(trained, tmp_path)
    with open(os.path.join(path, "optimizer.pt"), "ab") as f:
        f.write(b"\0" * 4096)
    read = []
    real = ckpt._sha256
    monkeypatch.setattr(ckpt, "_sha256", lambda file, limit=None: read.append(file) or
                        real(file, limit))
    with pytest.raises(CheckpointError, match=r"optimizer.pt does not match its sha256 \(it is "
                                              r"\d+ bytes, \d+ were saved"):
        ckpt.verify_checkpoint(path)
    assert not any(f.endswith("optimizer.pt") for f in read)  # refused by its size alone


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/passwd", "tokenizer/../../x"])
def test_a_listed_path_that_leaves_the_checkpoint_is_refused(trained, tmp_path, name):
    _, path = _copy(trained, tmp_path)
    file = os.path.join(path, ckpt.STATE_JSON)
    state = json.load(open(file))
    state["files"][name] = {"sha256": "0" * 64, "size": 1}
    state["state_sha256"] = ckpt._state_digest(state)
    json.dump(state, open(file, "w"))
    with pytest.raises(CheckpointError, match="lists a file outside the checkpoint"):
        ckpt.verify_checkpoint(path)


def test_a_fifo_in_the_checkpoint_is_refused(trained, tmp_path):
    _, path = _copy(trained, tmp_path)
    os.mkfifo(os.path.join(path, "tokenizer", "pipe"))
    with pytest.raises(CheckpointError, match="pipe is not a regular file"):
        ckpt.verify_checkpoint(path)


def test_the_tokenizer_must_be_the_data_directorys_own(tmp_path):
    from bert_pretrain.components.data import PreparedData

    elsewhere = write_prepared(str(tmp_path / "other"), num_train=16, num_valid=8)
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    manifest = os.path.join(data, "manifest.json")
    content = json.load(open(manifest))
    for bad in (os.path.join(elsewhere, "tokenizer"), "../other/tokenizer"):
        content["tokenizer"]["path"] = bad
        json.dump(content, open(manifest, "w"))
        with pytest.raises(DataError, match="is not a directory inside"):
            PreparedData(data)
    content["tokenizer"]["path"] = "tokenizer"
    json.dump(content, open(manifest, "w"))
    os.symlink(os.path.join(elsewhere, "manifest.json"),
               os.path.join(data, "tokenizer", "added_tokens.json"))
    with pytest.raises(DataError, match="added_tokens.json is a symbolic link"):
        PreparedData(data)
    os.remove(os.path.join(data, "tokenizer", "added_tokens.json"))
    os.symlink(os.path.join(elsewhere, "tokenizer"), os.path.join(data, "tok2"))
    content["tokenizer"]["path"] = "tok2"  # a link out of the data directory
    json.dump(content, open(manifest, "w"))
    with pytest.raises(DataError, match="is not a directory inside"):
        PreparedData(data)


def test_a_checkpoint_copies_only_the_tokenizers_regular_files(tmp_path):
    from test_checkpoint import SMALL, _save
    from bert_pretrain.model import BertConfig, BertForPreTraining

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.txt").write_text("[PAD]\n")
    os.symlink(tmp_path / "elsewhere", tok / "link.json")
    with pytest.raises(CheckpointError, match="link.json is a symbolic link"):
        _save(str(tmp_path / "run"), 1, BertForPreTraining(BertConfig(**SMALL)),
              tokenizer_dir=str(tok))
    assert cm.list_checkpoints(str(tmp_path / "run")) == []


def test_an_rng_state_the_checkpoint_does_not_list_is_not_loaded(tmp_path):
    """A rank's RNG state is a file of the checkpoint only when trainer_state.json lists it
    (verified like every listed file); one it does not list, left over or planted, is ignored,
    as a rank without a saved state is (it keeps the RNG it has)."""
    import torch

    from test_checkpoint import SMALL, _save
    from bert_pretrain.model import BertConfig, BertForPreTraining

    path = _save(str(tmp_path / "run"), 1, BertForPreTraining(BertConfig(**SMALL)))
    assert ckpt.load_states(path, 0)[2] is not None  # listed: loaded
    torch.save(ckpt.rng_state(), os.path.join(path, "rng_state_rank1.pt"))  # planted
    file = os.path.join(path, ckpt.STATE_JSON)
    state = json.load(open(file))
    del state["files"]["rng_state_rank0.pt"]  # and rank 0's no longer listed
    state["state_sha256"] = ckpt._state_digest(state)
    json.dump(state, open(file, "w"))
    ckpt._verified.clear()
    ckpt.verify_checkpoint(path)  # (unlisted files do not make a checkpoint invalid)
    assert ckpt.load_states(path, 0)[2] is None
    assert ckpt.load_states(path, 1)[2] is None
