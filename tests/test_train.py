"""bert-train end to end: real bert-prep output in, checkpoint + metrics + logs out; the user's
mistakes get one-line errors (exit 2); faults (non-finite loss) stop cleanly; wandb offline."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from bert_pretrain.errors import CheckpointError, ConfigError, DataError, TrainingError
from time_limits import hang_limit
from train_support import (REPO, needs_wandb, read_metrics, run_bert_train, train_in_process,
                           write_prepared)

EVAL_KEYS = {"eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy"}
TRAIN_KEYS = {"step", "loss", "mlm_loss", "nsp_loss", "lr", "tokens_per_s"}


@pytest.fixture(scope="module")
def real_prep(tmp_path_factory):
    """The built-in corpus through the real bert-prep (small vocab, seq 64, one dupe)."""
    out = str(tmp_path_factory.mktemp("bertprep") / "builtin64")
    r = subprocess.run(
        [sys.executable, "-m", "data_prep.build", "corpus=builtin", f"output_dir={out}",
         "max_seq_length=64", "max_predictions_per_seq=10", "dupe_factor=1",
         "tokenizer.vocab_size=2000", "validation_fraction=0.05", "progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=48, num_valid=8)


def test_end_to_end_on_real_bert_prep_output(tmp_path, real_prep):
    run = str(tmp_path / "run")
    r = run_bert_train(["experiment=smoke", f"data.dir={real_prep}", f"run_dir={run}",
                        "trainer.max_steps=40", "trainer.warmup_steps=4", "optim.lr=3e-3",
                        "trainer.eval_every=20", "trainer.checkpoint_every=20",
                        "trainer.global_batch_size=16", "trainer.log_every=5"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    final = os.path.join(run, "checkpoints", "step-00000040")
    assert f"checkpoint: {final}" in r.stdout
    assert os.path.join(run, "metrics.jsonl") in r.stdout
    assert os.path.isfile(os.path.join(run, "train.log"))            # the run's log
    assert os.path.isfile(os.path.join(run, ".hydra", "config.yaml"))
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "config.yaml",
                 "tokenizer/vocab.txt", "rng_state_rank0.pt"):
        assert os.path.exists(os.path.join(final, name)), name
    records = read_metrics(run)
    train = [x for x in records if "loss" in x]
    evals = [x for x in records if "eval_mlm_loss" in x]
    assert [x["step"] for x in train] == list(range(5, 41, 5))
    assert all(TRAIN_KEYS <= set(x) for x in train)
    assert [x["step"] for x in evals] == [20, 40] and all(EVAL_KEYS <= set(x) for x in evals)
    # The loss falls (ln 2000 = 7.6 at the start).  That only shows the updates reach the model:
    # word frequencies alone lower it; tests/test_learning.py checks learning from context.
    assert train[-1]["mlm_loss"] < train[0]["mlm_loss"] - 0.5
    assert evals[-1]["eval_mlm_loss"] < 7.0
    state = json.load(open(os.path.join(final, "trainer_state.json")))
    assert state["samples_consumed"] == 40 * 16 and state["step"] == 40
    assert state["tokens_seen"] > 40 * 16 * 10  # non-padding tokens of 640 rows of <= 64
    # the checkpoint exports with bert-prep's real tokenizer files
    out = str(tmp_path / "hf")
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export", final, out], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    transformers = pytest.importorskip("transformers")
    tok = transformers.BertTokenizerFast.from_pretrained(out)
    assert tok.vocab_size == 2000
    model = transformers.BertForPreTraining.from_pretrained(out)
    assert model.config.hidden_size == 32


def test_user_errors_are_one_line_exit_2(tmp_path, synthetic):
    cases = [
        (["experiment=smoke", f"data.dir={tmp_path / 'missing'}"], "does not exist; run bert-prep"),
        (["experiment=smoke"], "data.dir is not set"),
        (["experiment=smoke", f"data.dir={synthetic}", "trainer.max_stepz=3"],
         "did you mean trainer.max_steps?"),
        (["experiment=smoke", f"data.dir={synthetic}", "trainer.mixed_precision=fp8"],
         "trainer.mixed_precision must be one of auto, no, bf16, fp16"),
        (["experiment=smoke", f"data.dir={synthetic}", "optim=sgd"],
         "Available options in 'optim'"),
    ]
    for args, message in cases:
        r = run_bert_train(args + [f"run_dir={tmp_path / 'r'}"], cwd=str(tmp_path))
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert r.stderr.startswith("bert-train: error: ") and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_text_file_as_data_dir_gets_the_bert_prep_command_that_makes_the_folder(tmp_path):
    """A newcomer's first try, `bert-train data.dir=notes.txt`: the error says it is a text file
    and gives the bert-prep command that makes the folder bert-train reads; run as given, that
    command and the bert-train one it names work."""
    import re
    import shlex

    words = "the a cat dog sat ran on in mat house tree big red blue old new".split()
    paragraphs = [" ".join(f"{words[(d + s) % 16].capitalize()} {words[(3 * s + d) % 16]} "
                           f"{words[(5 * s + 2 * d) % 16]} {words[(7 * d + s) % 16]}."
                           for s in range(6)) for d in range(24)]
    (tmp_path / "notes.txt").write_text("\n\n".join(paragraphs) + "\n")
    r = run_bert_train(["experiment=smoke", "data.dir=notes.txt"], cwd=str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "data.dir 'notes.txt' is a text file" in r.stderr and "does not exist" not in r.stderr
    prep, train = re.search(r": (bert-prep .*), then (bert-train \S+)", r.stderr).groups()
    prep_bin = os.path.join(os.path.dirname(sys.executable), "bert-prep")
    p = subprocess.run([prep_bin, *shlex.split(prep)[1:], "tokenizer.vocab_size=200",
                        "max_seq_length=32", "max_predictions_per_seq=5", "progress=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=hang_limit())
    assert p.returncode == 0, p.stderr
    t = run_bert_train([*shlex.split(train)[1:], "experiment=smoke", "trainer.max_steps=3",
                        "trainer.progress_bar=false", "run_dir=run"], cwd=str(tmp_path))
    assert t.returncode == 0, t.stderr[-2000:]
    # bert-prep's manifest itself: its folder is named
    manifest = str(tmp_path / "prepared" / "notes" / "manifest.json")
    with pytest.raises(DataError, match=f"point data.dir at the folder that holds it: "
                                        f"data.dir={re.escape(os.path.dirname(manifest))}$"):
        train_in_process(["experiment=smoke", f"data.dir={manifest}"])


def test_data_and_model_mismatches_are_refused(tmp_path, synthetic):
    base = ["experiment=smoke", f"data.dir={synthetic}", f"run_dir={tmp_path / 'a'}"]
    with pytest.raises(DataError, match="model.vocab_size=999 but the data .* 64-token"):
        train_in_process(base + ["model.vocab_size=999"])
    with pytest.raises(DataError, match=r"max_seq_length \(32\) exceeds model.max_position_emb"):
        train_in_process(base + ["model.max_position_embeddings=16"])
    with pytest.raises(ConfigError, match="model.hidden_size .* divisible"):
        train_in_process(base + ["model.num_attention_heads=3"])
    with pytest.raises(DataError, match="not divisible"):
        train_in_process(base + ["trainer.global_batch_size=8", "trainer.micro_batch_size=3"])
    half = str(tmp_path / "half")
    shutil.copytree(synthetic, half)
    os.remove(os.path.join(half, "manifest.json"))
    with pytest.raises(DataError, match="no manifest.json"):
        train_in_process(["experiment=smoke", f"data.dir={half}", f"run_dir={tmp_path / 'b'}"])


def test_resume_rules_and_other_model_size(tmp_path, synthetic):
    run = str(tmp_path / "run")
    base = ["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}"]
    first = train_in_process(base + ["trainer.max_steps=3"])
    before = read_metrics(run)
    # resuming a finished run re-reports it: no training, no second evaluation of the same weights
    assert train_in_process(base + ["trainer.max_steps=3", "resume=auto"]) == first
    assert read_metrics(run) == before
    with pytest.raises(ConfigError, match="already has checkpoints; continue it with resume=auto"):
        train_in_process(base)
    with pytest.raises(CheckpointError, match=r"different model \(hidden_size: checkpoint 32 vs "
                                              r"config 64"):
        train_in_process(base + ["resume=auto", "model.hidden_size=64"])
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        train_in_process(base + [f"resume={tmp_path / 'nowhere'}"])
    # resume=auto in an empty run dir starts fresh
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", "resume=auto",
                      f"run_dir={tmp_path / 'fresh'}", "trainer.max_steps=3"])
    assert os.path.isdir(os.path.join(tmp_path, "fresh", "checkpoints", "step-00000003"))


def test_nonfinite_loss_stops_with_last_good_checkpoint(tmp_path, synthetic):
    run = str(tmp_path / "run")
    with pytest.raises(TrainingError, match=r"non-finite for 3 consecutive steps .* last good "
                                            r"checkpoint: .*step-00000001"):
        # lr 1e30 turns every weight into inf after the first update
        train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}",
                          "optim.lr=1e30", "trainer.max_grad_norm=null",
                          "trainer.warmup_steps=0", "trainer.max_steps=50",
                          "trainer.checkpoint_every=1", "trainer.max_nonfinite_steps=3",
                          "trainer.eval_every=0"])
    assert [os.path.basename(p) for p in glob.glob(os.path.join(run, "checkpoints", "step-*"))] \
        == ["step-00000001"]
    records = read_metrics(run)
    assert records[0]["loss"] is not None and records[1]["loss"] is None
    assert records[2]["nonfinite_steps"] == 2


def test_init_from_takes_weights_only(tmp_path, synthetic):
    """Phase 2 style: weights from a checkpoint, fresh optimizer, schedule and data position."""
    from safetensors.torch import load_file

    first = str(tmp_path / "first")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={first}",
                      "trainer.max_steps=4"])
    source = os.path.join(first, "checkpoints", "step-00000004")
    second = str(tmp_path / "second")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={second}",
                      f"trainer.init_from={source}", "trainer.max_steps=3",
                      "optim.lr=1e-12", "trainer.warmup_steps=0", "optim.weight_decay=0"])
    after = os.path.join(second, "checkpoints", "step-00000003")
    state = json.load(open(os.path.join(after, "trainer_state.json")))
    assert state["step"] == 3 and state["samples_consumed"] == 3 * 8   # its own position
    a, b = load_file(os.path.join(source, "model.safetensors")), \
        load_file(os.path.join(after, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # lr 1e-12: the weights are the source's (fresh Adam moves them by ~1e-12)
        torch.testing.assert_close(a[k], b[k], atol=1e-9, rtol=0)
    opt = torch.load(os.path.join(after, "optimizer.pt"), weights_only=False)
    assert float(next(iter(opt["state"].values()))["step"]) == 3.0          # a fresh optimizer


def test_init_from_a_run_dir_onto_data_of_the_other_kind(tmp_path, synthetic):
    """Continued pretraining (DAPT) of an MLM + NSP run on MLM-only data, and back: a run
    directory names its newest checkpoint; the encoder and MLM head carry over exactly, the
    pooler and NSP head are dropped (or start fresh); data tokenized with another vocabulary
    is one line that names bert-prep's option for the model's own."""
    import hashlib
    import shutil

    from safetensors.torch import load_file

    from bert_pretrain.errors import CheckpointError

    first = str(tmp_path / "first")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={first}",
                      "trainer.max_steps=4", "trainer.checkpoint_every=2"])
    source = os.path.join(first, "checkpoints", "step-00000004")   # the newest of 2 and 4
    frozen = ["trainer.max_steps=2", "optim.lr=1e-12", "trainer.warmup_steps=0",
              "optim.weight_decay=0"]
    mlm = str(tmp_path / "mlm")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={mlm}",
                      f"trainer.init_from={first}", "+model.next_sentence_prediction=false",
                      *frozen])
    a = load_file(os.path.join(source, "model.safetensors"))
    b = load_file(os.path.join(mlm, "checkpoints", "step-00000002", "model.safetensors"))
    nsp_parts = [k for k in a if k.startswith(("bert.pooler.", "cls.seq_relationship."))]
    assert nsp_parts and set(b) == set(a) - set(nsp_parts)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-9, rtol=0)
    # back to MLM + NSP from the MLM-only run: the encoder carries over, NSP starts fresh
    both = str(tmp_path / "both")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={both}",
                      f"trainer.init_from={mlm}", *frozen])
    c = load_file(os.path.join(both, "checkpoints", "step-00000002", "model.safetensors"))
    assert set(c) == set(a)
    for k in b:
        torch.testing.assert_close(b[k], c[k], atol=1e-9, rtol=0)
    # the same data tokenized with another vocabulary
    other = str(tmp_path / "other_vocab")
    shutil.copytree(synthetic, other)
    vocab_file = os.path.join(other, "tokenizer", "vocab.txt")
    vocab = open(vocab_file).read().split("\n")
    vocab[10] = "renamed"
    open(vocab_file, "w").write("\n".join(vocab))
    manifest = json.load(open(os.path.join(other, "manifest.json")))
    manifest["tokenizer"]["sha256"] = hashlib.sha256("\n".join(vocab).strip().encode()
                                                     ).hexdigest()
    json.dump(manifest, open(os.path.join(other, "manifest.json"), "w"))
    with pytest.raises(CheckpointError, match=r"another tokenizer .*; prepare the corpus with "
                       r"the model's vocabulary: bert-prep tokenizer.vocab_file=.*step-00000002"
                       r"/tokenizer"):
        train_in_process(["experiment=smoke", f"data.dir={other}",
                          f"run_dir={tmp_path / 'refused'}", f"trainer.init_from={mlm}",
                          *frozen])


@needs_wandb
def test_wandb_offline_writes_a_run_directory(tmp_path, synthetic, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = str(tmp_path / "run")
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}",
                      "logger=wandb", "logger.mode=offline", "logger.group=g1",
                      "logger.tags=[a,b]", "trainer.max_steps=3"])
    runs = glob.glob(os.path.join(run, "wandb", "offline-run-*"))
    assert len(runs) == 1, os.listdir(run)
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert os.path.isfile(os.path.join(run, "wandb_run_id"))


def test_eval_metrics_dense_and_sparse_heads_agree_with_a_direct_computation(synthetic):
    """evaluate() handles the sparse head ([M, V] logits + mlm_labels) and the dense one
    ([B, L, V]); both equal a hand computation over every labelled position."""
    from accelerate import Accelerator

    from bert_pretrain.components.data import DataConfig, PreparedData, eval_batches
    from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl
    from bert_pretrain.trainer import evaluate

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    sparse = BertForPreTraining(cfg, ModelImpl(sparse_prediction=True))
    dense = BertForPreTraining(cfg, ModelImpl(sparse_prediction=False))
    dense.load_state_dict(sparse.state_dict())
    data = PreparedData(synthetic)
    batches = list(eval_batches(data, DataConfig(dir=synthetic), 3, 1, 0, None))
    accelerator = Accelerator(cpu=True)
    a, b = (evaluate(m, accelerator, batches, mask_id=4) for m in (sparse, dense))
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert "eval_mlm_accuracy_masked" not in evaluate(sparse, accelerator, batches)
    loss = correct = count = nsp_correct = masked_correct = masked_count = 0.0
    per_class = {0: [0, 0], 1: [0, 0]}  # NSP label -> [right, seen]
    with torch.no_grad():
        for batch in batches:
            out = dense.eval()(**{k: v for k, v in batch.items() if k != "num_tokens"})
            keep = batch["labels"] != -100
            logits, labels = out.prediction_logits[keep], batch["labels"][keep]
            loss += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
            count += labels.numel()
            shown_mask = batch["input_ids"][keep] == 4  # [MASK] in the synthetic vocabulary
            masked_correct += (logits.argmax(-1) == labels)[shown_mask].sum().item()
            masked_count += shown_mask.sum().item()
            nsp_correct += (out.seq_relationship_logits.argmax(-1)
                            == batch["next_sentence_label"]).sum().item()
            for guess, label in zip(out.seq_relationship_logits.argmax(-1).tolist(),
                                    batch["next_sentence_label"].tolist()):
                per_class[label][0] += guess == label
                per_class[label][1] += 1
    assert a["eval_mlm_loss"] == pytest.approx(loss / count, rel=1e-5)
    assert a["eval_mlm_accuracy"] == pytest.approx(correct / count)
    assert a["eval_nsp_accuracy"] == pytest.approx(nsp_correct / 8)
    assert min(seen for _, seen in per_class.values()) > 0  # both kinds of pair are scored
    assert a["eval_nsp_accuracy_balanced"] == pytest.approx(
        0.5 * sum(right / seen for right, seen in per_class.values()))
    assert 0.6 * count < masked_count < 0.95 * count  # ~80% of the predicted positions
    assert a["eval_mlm_accuracy_masked"] == pytest.approx(masked_correct / masked_count)


def test_stall_warning_names_a_run_still_at_the_unigram_level():
    from bert_pretrain.components.runlog import STALL_WARNING_STEP, stall_warning

    stuck = {"eval_mlm_accuracy": 0.043}
    assert stall_warning(STALL_WARNING_STEP - 1, stuck, 0.045) is None   # too early to say
    line = stall_warning(STALL_WARNING_STEP, stuck, 0.045)
    assert line.startswith(f"bert-train: warning: step {STALL_WARNING_STEP}: held-out MLM "
                           f"accuracy 0.0430 is no better than always predicting the most "
                           f"frequent token (0.0450)")
    assert "lower optim.lr" in line and "\n" not in line
    assert stall_warning(STALL_WARNING_STEP, {"eval_mlm_accuracy": 0.09}, 0.045) is None


def test_a_run_that_learns_nothing_is_warned_once(tmp_path, synthetic, monkeypatch, capsys):
    """Wired into bert-train's evaluations: at a learning rate of almost nothing the model never
    leaves chance; the warning comes once, at the first evaluation from the threshold on, and
    goes to the run's log too."""
    from bert_pretrain.components import runlog

    monkeypatch.setattr(runlog, "STALL_WARNING_STEP", 4)
    run = tmp_path / "run"
    train_in_process(["experiment=smoke", f"data.dir={synthetic}", f"run_dir={run}",
                      "optim.lr=1e-9", "trainer.max_steps=8", "trainer.eval_every=2",
                      "trainer.warmup_steps=1"])
    warned = [line for line in capsys.readouterr().err.splitlines()
              if "no better than always" in line]
    assert len(warned) == 1 and warned[0].startswith("bert-train: warning: step 4: "), warned
    assert warned[0] in (run / "train.log").read_text()
