"""bench/uda_pilot.py: reads only the unlabeled file's text column, replaces about the asked
share of tokens (the uninformative ones more often, special tokens never), anneals the
supervised signal, and runs bert-finetune's grid with its settings in the results' identity."""

import json
import os
import sys

import numpy as np
import pytest
import torch

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import uda_pilot  # noqa: E402

transformers = pytest.importorskip("transformers")

WORDS = "the a film was good bad dull fine plot cast i liked it great awful movie".split()


def test_reads_the_text_column_only(tmp_path):
    tsv = tmp_path / "train.tsv"
    tsv.write_text("sentence\tlabel\na good film\tLEAKED_LABEL\n\t1\na bad plot\tLEAKED_LABEL\n")
    assert uda_pilot.read_column(str(tsv), "sentence") == ["a good film", "a bad plot"]
    csv_file = tmp_path / "t.csv"
    csv_file.write_text('text,label\n"fine, dull",LEAKED_LABEL\n')
    assert uda_pilot.read_column(str(csv_file), "text") == ["fine, dull"]
    with pytest.raises(SystemExit, match="has no 'text' column .*set --column"):
        uda_pilot.read_column(str(tsv), "text")


def test_noise_replaces_the_asked_share_and_frequent_tokens_more():
    rng = np.random.default_rng(0)
    special = {0, 1}  # [CLS], [SEP]
    # token 2 is in every sentence (low IDF), tokens 3..41 in one sentence each (high IDF)
    ids = [np.array([0, 2, 3 + i % 39, 3 + (i + 7) % 39, 1]) for i in range(200)]
    noise = uda_pilot.TfidfNoise(ids, 64, special, replace=0.3)
    replaced = np.zeros(5)
    for x in ids:
        replaced += noise(x, rng) != x
    assert replaced[0] == 0 and replaced[4] == 0  # [CLS] and [SEP] never
    share = replaced[1:4].sum() / (3 * len(ids))
    assert 0.24 < share < 0.36
    assert replaced[1] > 2 * max(replaced[2], replaced[3])  # the uninformative token most
    # what replaces a token is drawn from the corpus, never a special or unseen id
    drawn = np.concatenate([noise(x, rng) for x in ids])
    assert set(np.unique(drawn)) <= set(range(42))
    assert np.array_equal(uda_pilot.TfidfNoise(ids, 64, special, 0.0)(ids[0], rng), ids[0])


def test_annealing_and_consistency():
    assert uda_pilot.tsa_threshold("linear", 0, 100, 2) == 0.5
    assert uda_pilot.tsa_threshold("linear", 100, 100, 2) == 1.0
    assert uda_pilot.tsa_threshold("none", 0, 100, 2) == 1.0
    assert uda_pilot.tsa_threshold("exp", 50, 100, 2) < uda_pilot.tsa_threshold("log", 50, 100, 2)
    clean = torch.tensor([[3.0, 0.0], [0.1, 0.0]])
    same, kept = uda_pilot.consistency(clean, clean, temperature=1.0, threshold=0.6)
    assert kept == 1 and abs(float(same)) < 1e-6  # the unsure second row is left out
    flipped, _ = uda_pilot.consistency(clean, clean.flip(-1), temperature=1.0, threshold=0.6)
    sharp, _ = uda_pilot.consistency(clean, clean, temperature=0.5, threshold=0.6)
    assert float(flipped) > 2.0 and float(sharp) > 0.0


def _tiny_encoder(path):
    path.mkdir()
    (path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    config = transformers.BertConfig(vocab_size=5 + len(WORDS), hidden_size=16,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    return path  # vocab.txt is the tokenizer (a WordPiece vocabulary, as bert-export writes)


def _task(tmp_path) -> list:
    """A labelled CSV task, an unlabeled file and a tiny encoder: bert-finetune's overrides."""
    rows = [(f"{WORDS[i % 16]} {WORDS[(i * 3) % 16]} film", i % 2) for i in range(24)]
    for name in ("train", "dev"):
        (tmp_path / f"{name}.csv").write_text(
            "text,label\n" + "\n".join(f"{t},{y}" for t, y in rows) + "\n")
    (tmp_path / "unlabeled.csv").write_text(
        "text\n" + "\n".join(f"{WORDS[(i * 5) % 16]} {WORDS[i % 16]} movie" for i in range(40)))
    model = _tiny_encoder(tmp_path / "enc")
    return ["task=custom", f"task.train_file={tmp_path / 'train.csv'}",
            f"task.validation_file={tmp_path / 'dev.csv'}", "task.text_columns=[text]",
            f"model={model}", "recipe.lrs=[1e-3]", "recipe.seeds=[1]", "recipe.epochs=2",
            "recipe.batch_size=8", "trainer.save_model=none", "trainer.progress_bar=false"]


def test_runs_bert_finetunes_grid_with_its_settings_in_the_identity(tmp_path):
    common = _task(tmp_path)
    out = tmp_path / "ft"
    uda_pilot.main(["--unlabeled", str(tmp_path / "unlabeled.csv"), "--column", "text", "--",
                    *common, f"out_dir={out}"])
    from bert_pretrain.finetune import grid, runner

    # bert-finetune is itself again afterwards (the patch is the pilot's, for its run only)
    assert runner.FineTune.train_step.__qualname__ == "FineTune.train_step"
    assert grid.prepare_job.__qualname__ == "prepare_job"
    (result,) = [json.loads(p.read_text()) for p in out.rglob("result.json")]
    assert result["identity"]["uda_pilot"]["weight"] == 1.0
    assert result["steps"] == 6 and 0.0 <= result["score"] <= 100.0
    with pytest.raises(SystemExit, match="has 40 non-empty rows .* = 48: give more"):
        uda_pilot.main(["--unlabeled", str(tmp_path / "unlabeled.csv"), "--column", "text",
                        "--ratio", "6", "--", *common, f"out_dir={tmp_path / 'ft2'}"])
    with pytest.raises(SystemExit, match="after `--`"):
        uda_pilot.main(["--unlabeled", "x.csv"])


def test_an_interrupted_pilot_fine_tune_resumes_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """The pilot's step (its unlabeled draw seeded per step) under bert-finetune's checkpoints
    (threshold 0: every unlabeled row counts, so a draw that differed would show)."""
    from finetune_support import check_interrupted_fine_tune_resumes

    common = [*_task(tmp_path), "trainer.log_every=1", "trainer.checkpoint_every=2",
              "trainer.mixed_precision=no"]
    pilot = ["--unlabeled", str(tmp_path / "unlabeled.csv"), "--column", "text",
             "--threshold", "0", "--"]
    check_interrupted_fine_tune_resumes(
        lambda out: uda_pilot.main([*pilot, *common, f"out_dir={out}"]), tmp_path / "ft",
        monkeypatch)
