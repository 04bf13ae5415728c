"""Inputs at the edges, each one line or handled: a transformers `Trainer` checkpoint folder
(it has a trainer_state.json of its own), `bert-predict --file` line numbers after blank lines,
`model.type_vocab_size=1` with sentence-pair data, a global batch smaller than the number of
processes or that does not split over them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bert_pretrain.tools.model_loading import load_model
from bert_pretrain.tools.predict import main as predict_main
from train_support import REPO, run_bert_train, train_in_process, write_prepared

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=32, num_valid=8)


def _trainer_checkpoint(path, data):
    """What transformers' Trainer writes as checkpoint-N/: the model, the tokenizer, and its
    own trainer_state.json (global_step, log_history)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=64)
    model = transformers.BertForPreTraining(config).eval()
    model.save_pretrained(path)
    transformers.BertTokenizerFast(os.path.join(data, "tokenizer", "vocab.txt"),
                                   do_lower_case=True).save_pretrained(path)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 500, "epoch": 1.0, "log_history": [{"loss": 3.2, "step": 500}],
                   "best_metric": None}, f)
    return model


def test_a_transformers_trainer_checkpoint_is_a_model_directory(data, tmp_path, capsys):
    path = str(tmp_path / "checkpoint-500")
    theirs = _trainer_checkpoint(path, data)
    loaded = load_model(path)  # bert-predict
    ids = torch.tensor([[2, 7, 4, 9, 3]])
    with torch.no_grad():
        ours = loaded.model(ids).prediction_logits
        torch.testing.assert_close(ours, theirs(input_ids=ids).prediction_logits,
                                   atol=1e-5, rtol=1e-5)
    predict_main(["fill-mask", path, "w2 [MASK] w4"])
    assert "[MASK]:" in capsys.readouterr().out
    run = tmp_path / "run"  # continued pretraining from it
    train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                      f"trainer.init_from={path}", "trainer.max_steps=2",
                      "trainer.warmup_steps=1", "trainer.eval_every=0"])
    assert "weights from" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export", path,
                        str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "is already a transformers model directory" in r.stderr


def test_predict_file_errors_name_the_files_own_line_numbers(data, tmp_path, capsys):
    run = tmp_path / "run"
    train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                      "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.eval_every=0"])
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("w1 w2\tw3 w4\n\n\nw5 w6 without a tab\n")
    with pytest.raises(SystemExit) as exit_:
        predict_main(["nsp", str(run), "--file", str(pairs)])
    assert exit_.value.code == 2
    assert f"{pairs} line 4: expected 'sentence A<TAB>sentence B'" in capsys.readouterr().err


def test_one_token_type_with_sentence_pair_data_is_one_line(data, tmp_path):
    r = run_bert_train(["experiment=smoke", f"data.dir={data}", f"run_dir={tmp_path / 'run'}",
                        "model.type_vocab_size=1", f"hydra.run.dir={tmp_path / 'h'}"],
                       cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("bert-train: error: model.type_vocab_size=1") and \
        "set model.type_vocab_size=2" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("size, line", [
    (1, "trainer.global_batch_size=1 is smaller than the number of processes (2): every "
        "process needs at least one sample per step; raise it to a multiple of 2 or launch "
        "fewer processes"),
    # (micro_batch_size unset: it used to say "not divisible by world_size (2) x
    # trainer.micro_batch_size (4)", a size the user never set)
    (9, "trainer.global_batch_size=9 does not split over the 2 processes; make it a multiple "
        "of 2 (e.g. 10) or launch a number of processes that divides it"),
], ids=["smaller", "odd"])
def test_a_global_batch_the_processes_cannot_share_is_one_line(data, tmp_path, size, line):
    from test_distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled"}
    r = subprocess.run(
        [sys.executable, "-m", "bert_pretrain.tools.launch", "--config_file",
         os.path.join(REPO, "conf", "accelerate", "cpu_2proc.yaml"), "--main_process_port",
         str(free_port()), "-m", "bert_pretrain.train", "experiment=smoke", f"data.dir={data}",
         f"run_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'h'}",
         f"trainer.global_batch_size={size}"], cwd=REPO, env=env, capture_output=True,
        text=True)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert lines == [f"bert-train: error: {line}"], lines
