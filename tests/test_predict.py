"""bert-predict: fill-mask and NSP on a run dir, a checkpoint and an export give the model's own
probabilities; bad input is one line, exit 2."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.tools.export import export
from bert_pretrain.tools.model_loading import load_model
from bert_pretrain.tools.predict import IS_NEXT, Predictor, main
from train_support import REPO, train_in_process, write_prepared


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    prepared = write_prepared(str(root / "prep"), num_train=32, num_valid=8)
    run = str(root / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "model.hidden_act=gelu"])
    return run


def _run_main(capsys, *argv):
    main(list(argv))
    return capsys.readouterr().out


def test_fill_mask_reports_the_models_probabilities(run, capsys):
    out = _run_main(capsys, "fill-mask", run, "w1 [MASK] w3 [MASK]", "--top-k", "3", "--json")
    result = json.loads(out)
    assert [m["position"] for m in result["masks"]] == [2, 4]  # [CLS] w1 [MASK] w3 [MASK] [SEP]
    model = load_model(run).model
    ids = torch.tensor([[2, 6, 4, 8, 4, 3]])
    with torch.no_grad():
        probs = model(ids).prediction_logits[0].softmax(-1)
    vocab = open(os.path.join(cm.latest_checkpoint(run), "tokenizer", "vocab.txt")).read() \
        .split("\n")
    for m in result["masks"]:
        expected = probs[m["position"]].topk(3)
        assert [p["token"] for p in m["predictions"]] == [vocab[i] for i in expected.indices]
        assert [p["probability"] for p in m["predictions"]] == pytest.approx(
            expected.values.tolist(), abs=1e-6)
    text = _run_main(capsys, "fill-mask", run, "w1 [MASK] w3")
    assert text.splitlines()[0] == "w1 [MASK] w3"
    assert text.splitlines()[1].startswith("  [MASK]: ")


def test_same_answers_from_run_checkpoint_and_export(run, tmp_path):
    exported = str(tmp_path / "hf")
    checkpoint = export(run, exported)
    answers = [Predictor(m).fill_mask("w4 w5 [MASK] w7", 5)["masks"] for m in
               (run, checkpoint, exported)]
    assert answers[0] == answers[1]
    for a, b in zip(answers[0][0]["predictions"], answers[2][0]["predictions"]):
        assert a["token"] == b["token"] and a["probability"] == pytest.approx(b["probability"],
                                                                             abs=1e-5)


def test_nsp_probability_is_the_is_next_class(run):
    """bert-prep stores next_sentence_labels = is_random_next, so class 0 = 'B follows A'
    (tests/test_prep_instances.py checks the labels against the documents)."""
    assert IS_NEXT == 0
    predictor = Predictor(run)
    with torch.no_grad():
        predictor.model.cls.seq_relationship.bias.copy_(torch.tensor([8.0, -8.0]))
        predictor.model.cls.seq_relationship.weight.zero_()
    assert predictor.nsp("w1 w2", "w3 w4")["is_next_probability"] > 0.999
    with torch.no_grad():
        predictor.model.cls.seq_relationship.bias.copy_(torch.tensor([-8.0, 8.0]))
    assert predictor.nsp("w1 w2", "w3 w4")["is_next_probability"] < 0.001


def test_nsp_uses_segment_b_token_types(run):
    predictor = Predictor(run)
    enc, ids, types = predictor._encode("w1 w2", "w3")
    assert ids.tolist() == [[2, 6, 7, 3, 8, 3]] and types.tolist() == [[0, 0, 0, 0, 1, 1]]
    model = predictor.model
    with torch.no_grad():
        logits = model(ids, token_type_ids=types).seq_relationship_logits[0]
    assert predictor.nsp("w1 w2", "w3")["is_next_probability"] == pytest.approx(
        logits.softmax(-1)[0].item(), abs=1e-6)


def test_input_from_files(run, tmp_path, capsys):
    sentences = tmp_path / "s.txt"
    sentences.write_text("w1 [MASK]\n\nw2 [MASK] w3\n")
    lines = _run_main(capsys, "fill-mask", run, "--file", str(sentences), "--json").splitlines()
    assert [json.loads(ln)["text"] for ln in lines] == ["w1 [MASK]", "w2 [MASK] w3"]
    pairs = tmp_path / "p.tsv"
    pairs.write_text("w1 w2\tw3\nw4\tw5 w6\n")
    lines = _run_main(capsys, "nsp", run, "--file", str(pairs), "--json").splitlines()
    assert [json.loads(ln)["b"] for ln in lines] == ["w3", "w5 w6"]


@pytest.mark.parametrize("argv, message", [
    (["fill-mask", "{run}", "w1 w2"], "no [MASK] in 'w1 w2'"),
    (["fill-mask", "{tmp}/nope", "w1 [MASK]"], "no such directory"),
    (["fill-mask", "{tmp}", "w1 [MASK]"], "neither a run directory"),
    (["nsp", "{run}", "--file", "{tmp}/bad.tsv"], "line 1: expected 'sentence A<TAB>sentence B'"),
    (["fill-mask", "{run}", "w1 " * 200 + "[MASK]"], "the model takes at most 128"),
])
def test_bad_input_is_one_line(run, tmp_path, capsys, argv, message):
    (tmp_path / "bad.tsv").write_text("only one field\n")
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("bert-predict: error:"), err
    assert message in err and err.count("\n") == 1, err


def test_command_line(run):
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.predict", "nsp", run, "w1 w2"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "nsp takes two sentences" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.predict", "nsp", run, "w1 w2",
                        "w3"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("P(B follows A) = "), r.stderr
