"""bench/simcse_pilot.py: reads only a .tsv's sentence column (never its labels) and review
pieces of 3-60 words, trains the pooler and encoder with the two-view contrastive loss, and
writes a directory bert-finetune loads, with the source's dropout."""

import json
import os
import sys

import pytest
import torch

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import simcse_pilot  # noqa: E402

transformers = pytest.importorskip("transformers")

WORDS = "the a film was good bad dull fine plot cast i liked it great awful movie".split()


def _text_files(tmp_path):
    tsv = tmp_path / "train.tsv"
    rows = [f"{WORDS[i % 16]} {WORDS[(i * 3) % 16]} {WORDS[(i * 5) % 16]} film\t{i % 2}"
            for i in range(40)]
    tsv.write_text("sentence\tlabel\n" + "\n".join(rows + ["too short\t1"]) + "\n")
    jsonl = tmp_path / "reviews.jsonl"
    long_piece = " ".join(["plot"] * 61)
    jsonl.write_text("\n".join(json.dumps({"sentence": s}) for s in [
        "i liked it. the cast was fine", f"a dull movie. {long_piece}"]) + "\n")
    return tsv, jsonl


def _tiny_encoder(path):
    path.mkdir()
    (path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "."]) + "\n")
    config = transformers.BertConfig(vocab_size=5 + len(WORDS) + 1, hidden_size=16,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    # positional: vocab_file in transformers 4.x, vocab in 5.x (which ignores vocab_file=)
    transformers.BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)
    return path


def test_reads_sentences_not_labels_and_pieces_of_3_to_60_words(tmp_path):
    tsv, jsonl = _text_files(tmp_path)
    text, n_rows, n_pieces = simcse_pilot.read_text(str(tsv), str(jsonl), 0.5, seed=0)
    assert n_rows == 40  # "too short" (2 words) left out
    # 3 pieces of 3-60 words ("i liked it", "the cast was fine", "a dull movie"); the 61-word one dropped
    assert n_pieces == 3 and len(text) == 43
    assert "a dull movie" in text and not any(t.count("plot") > 3 for t in text)
    assert not any(t.strip() in {"0", "1"} or "\t" in t for t in text)


def test_phase_trains_the_pooler_and_writes_a_model_bert_finetune_loads(tmp_path):
    from bert_pretrain.finetune.pretrained import load_pretrained

    tsv, jsonl = _text_files(tmp_path)
    src = _tiny_encoder(tmp_path / "src")
    out = tmp_path / "out"
    simcse_pilot.main([str(src), str(out), "--tsv", str(tsv), "--jsonl", str(jsonl),
                       "--steps", "3", "--batch", "4", "--lr", "1e-2"])
    before, after = load_pretrained(str(src)), load_pretrained(str(out))
    key = "bert.pooler.dense.weight"
    assert not torch.equal(before.encoder_state[key], after.encoder_state[key])
    assert after.config.hidden_dropout_prob == 0.0  # the source's, not the phase's 0.1
    with pytest.raises(SystemExit, match="exists"):
        simcse_pilot.main([str(src), str(out), "--tsv", str(tsv)])


@pytest.mark.parametrize("args, message", [
    (["--tsv", "missing.tsv"], "missing.tsv not found"),
    (["--tsv", "{tsv}", "--steps", "0"], "--steps must be >= 1"),
    (["--tsv", "{tsv}", "--jsonl", "{bad}"], "has no 'sentence' field"),
])
def test_bad_input_gets_one_line_saying_what_to_fix(tmp_path, args, message):
    tsv, _ = _text_files(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a film i liked"}) + "\n")
    src = _tiny_encoder(tmp_path / "src")
    args = [x.format(tsv=tsv, bad=bad) for x in args]
    with pytest.raises(SystemExit, match=message):
        simcse_pilot.main([str(src), str(tmp_path / "out"), *args])
    with pytest.raises(SystemExit, match="no config.json"):
        simcse_pilot.main([str(tmp_path), str(tmp_path / "out"), "--tsv", str(tsv)])
