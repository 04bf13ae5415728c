"""Checkpoints are atomic: an interrupted or failed save never leaves something that looks valid,
and the previous checkpoint survives."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.errors import CheckpointError
from bert_pretrain.model import BertConfig, BertForPreTraining
from train_support import REPO

SMALL = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=32, max_position_embeddings=64)


def _save(run_dir, step, model, keep=3, tokenizer_dir=None):
    opt = torch.optim.AdamW(model.parameters())
    return cm.CheckpointManager(run_dir, keep_last_k=keep).save(
        step, model=model, optimizer_state=opt.state_dict(),
        extra_state={"schedule": {"warmup_end_elapsed": 0.0}, "scaler": None},
        train_state={"tokens_seen": step * 10, "samples_consumed": step * 4,
                     "elapsed_seconds": 1.0, "model_config": model.config.to_dict(),
                     "tokenizer_sha256": "abc"},
        config_yaml="seed: 1\n", tokenizer_dir=tokenizer_dir)


def test_save_load_roundtrip_and_keep_last_k(tmp_path):
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**SMALL))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.txt").write_text("[PAD]\n")
    run = str(tmp_path / "run")
    for step in (1, 2, 3, 4):
        _save(run, step, model, keep=2, tokenizer_dir=str(tok))
    assert [s for s, _ in cm.list_checkpoints(run)] == [3, 4]
    path = cm.latest_checkpoint(run)
    assert sorted(os.listdir(path)) == sorted([
        "config.yaml", "model.safetensors", "optimizer.pt", "rng_state_rank0.pt", "tokenizer",
        "trainer_state.json", "trainer_state.pt"])
    state = ckpt.read_train_state(path)
    assert state["step"] == 4 and state["samples_consumed"] == 16
    other = BertForPreTraining(BertConfig(**SMALL))
    ckpt.load_weights(path, other)
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    assert other.cls.predictions.decoder.weight is other.bert.embeddings.word_embeddings.weight


def test_disk_full_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    good = _save(run, 1, model)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"No space left on device.*step-00000001 is intact"):
        _save(run, 2, model)
    monkeypatch.undo()
    assert cm.list_checkpoints(run) == [(1, good)]
    assert not [n for n in os.listdir(cm.checkpoints_root(run)) if n.startswith(".tmp")]
    ckpt.load_weights(good, BertForPreTraining(BertConfig(**SMALL)))
    ckpt.load_states(good, 0)


def test_killed_while_saving_never_leaves_a_valid_looking_partial(tmp_path):
    """SIGKILL a process that saves checkpoints back to back: every directory that counts as a
    checkpoint afterwards loads completely."""
    run = str(tmp_path / "run")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
        from test_checkpoint import _save, SMALL
        from bert_pretrain.model import BertConfig, BertForPreTraining
        cfg = dict(SMALL, hidden_size=128, intermediate_size=512, vocab_size=4000)
        model = BertForPreTraining(BertConfig(**cfg))
        step = 0
        while True:
            step += 1
            _save({run!r}, step, model, keep=1000)
            print(step, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # at least one checkpoint exists
    time.sleep(0.37)        # then kill at an arbitrary moment, most likely inside a save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    found = cm.list_checkpoints(run)
    assert found
    for step, path in found:
        cfg = dict(SMALL, hidden_size=128, intermediate_size=512, vocab_size=4000)
        ckpt.load_weights(path, BertForPreTraining(BertConfig(**cfg)))
        ckpt.load_states(path, 0)
        assert ckpt.read_train_state(path)["step"] == step
    cm.CheckpointManager(run).repair()
    assert all(n.startswith("step-") or n == cm.POINTER
               for n in os.listdir(cm.checkpoints_root(run)))


def test_checkpoint_from_another_model_size_is_refused(tmp_path):
    model = BertForPreTraining(BertConfig(**SMALL))
    path = _save(str(tmp_path / "run"), 1, model)
    state = ckpt.read_train_state(path)
    bigger = BertConfig(**dict(SMALL, hidden_size=32)).to_dict()
    with pytest.raises(CheckpointError, match=r"different model \(hidden_size: checkpoint 16 vs "
                                              r"config 32\)"):
        ckpt.check_compatible(path, state, bigger, "abc")
    with pytest.raises(CheckpointError, match="another tokenizer"):
        ckpt.check_compatible(path, state, model.config.to_dict(), "def")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ckpt.read_train_state(str(tmp_path))


def _flip_bit(file):
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(file, "wb").write(bytes(data))


def _truncate(file):
    os.truncate(file, os.path.getsize(file) // 2)


def _edit_step(file):
    import json
    state = json.load(open(file))
    state["step"] += 1  # e.g. a hand edit: the state's own checksum no longer matches
    json.dump(state, open(file, "w"))


DAMAGE = {
    "truncated weights": ("model.safetensors", _truncate),
    "bit flip in optimizer": ("optimizer.pt", _flip_bit),
    "bit flip in RNG state": ("rng_state_rank0.pt", _flip_bit),
    "lost file": ("trainer_state.pt", os.remove),
    "edited state json": ("trainer_state.json", _edit_step),
    "bit flip in tokenizer": ("tokenizer/vocab.txt", _flip_bit),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_detected_and_resume_auto_skips_it(tmp_path, capsys, damage):
    name, spoil = DAMAGE[damage]
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    good = _save(run, 1, model, tokenizer_dir=str(tok))
    bad = _save(run, 2, model, tokenizer_dir=str(tok))
    assert cm.latest_checkpoint(run) == bad  # (and the verification is cached: see below)
    spoil(os.path.join(bad, name))
    with pytest.raises(CheckpointError, match=os.path.basename(name)) as err:
        ckpt.verify_checkpoint(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=os.path.basename(name)):
        ckpt.read_train_state(bad)  # what an explicit resume=<path> and init_from go through
    capsys.readouterr()
    assert cm.latest_checkpoint(run) == good
    assert cm.latest_checkpoint(run) == good
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "skipping damaged checkpoint" in warnings[0] and \
        bad in warnings[0], warnings
    ckpt.verify_checkpoint(good)


def test_checkpoint_without_checksums_is_not_trusted(tmp_path):
    import json
    path = _save(str(tmp_path / "run"), 1, BertForPreTraining(BertConfig(**SMALL)))
    file = os.path.join(path, ckpt.STATE_JSON)
    state = json.load(open(file))
    del state["files"], state["state_sha256"]
    json.dump(state, open(file, "w"))
    with pytest.raises(CheckpointError, match="no checksums"):
        ckpt.verify_checkpoint(path)
    # its only checkpoint is unusable: resume=auto must not quietly start the run over
    with pytest.raises(CheckpointError, match=r"all 1 checkpoint\(s\) in .* are damaged"):
        cm.latest_checkpoint(str(tmp_path / "run"))
    assert cm.latest_checkpoint(str(tmp_path / "empty")) is None


def test_killed_between_the_renames_of_a_resave_keeps_the_checkpoint(tmp_path):
    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    path = _save(run, 1, model)
    old = os.path.join(cm.checkpoints_root(run), ".old-step-00000001")
    os.rename(path, old)  # what a crash between rename(final, old) and
    os.makedirs(path.replace("step-", ".tmp-step-"))  # rename(tmp, final) leaves
    assert cm.latest_checkpoint(run) == old  # (read in its place before the repair)
    cm.CheckpointManager(run).repair()
    assert cm.latest_checkpoint(run) == path
    assert sorted(os.listdir(cm.checkpoints_root(run))) == [cm.POINTER, "step-00000001"]
