"""bert-attention: the maps are the model's attention probabilities, drawn one panel per head."""

import os

import pytest
import torch

from bert_pretrain.tools.attention_maps import attention_maps, main, parse_indices
from bert_pretrain.errors import UserError
from bert_pretrain.tools.model_loading import load_model
from train_support import train_in_process, write_prepared


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention")
    prepared = write_prepared(str(root / "prep"), num_train=32, num_valid=8)
    run = str(root / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "trainer.max_steps=3", "model.position_embedding_type=relative_key",
                      "model.pre_layer_norm=true"])
    return run


def test_maps_are_the_models_attention(run):
    maps, tokens, layers, heads, _ = attention_maps(run, "w1 w2", "w3", "1", "0,1")
    assert tokens == ["[CLS]", "w1", "w2", "[SEP]", "w3", "[SEP]"]
    assert layers == [1] and heads == [0, 1]
    model = load_model(run).model
    ids = torch.tensor([[2, 6, 7, 3, 8, 3]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1]])
    with torch.no_grad():
        expected = model.bert(ids, None, types, output_attentions=True).attentions[1][0]
    for j in range(2):
        torch.testing.assert_close(torch.from_numpy(maps[0][j]), expected[j])
        torch.testing.assert_close(torch.from_numpy(maps[0][j]).sum(-1), torch.ones(6))


def test_picture_has_one_panel_per_head(run, tmp_path, capsys):
    import matplotlib.image

    one = str(tmp_path / "one.png")
    four = str(tmp_path / "four.png")
    main([run, "w1 w2 w3", "--layers", "0", "--heads", "0", "-o", one])
    main([run, "w1 w2 w3", "--layers", "all", "--heads", "all", "-o", four])
    # each success says where the picture went, in one line
    assert capsys.readouterr().out.splitlines() == [
        f"bert-attention: wrote {one} (1 layer(s) x 1 head(s), 5 tokens)",
        f"bert-attention: wrote {four} (2 layer(s) x 2 head(s), 5 tokens)"]
    h1, w1 = matplotlib.image.imread(one).shape[:2]
    h4, w4 = matplotlib.image.imread(four).shape[:2]
    assert 1.6 < w4 / w1 < 2.4 and 1.6 < h4 / h1 < 2.4  # a 2 x 2 grid of the same panels


def test_parse_indices():
    assert parse_indices("all", 3, "layers") == [0, 1, 2]
    assert parse_indices("2,0", 3, "layers") == [0, 2]
    assert parse_indices("0-1", 3, "heads") == [0, 1]
    with pytest.raises(UserError, match="has 3 layers"):
        parse_indices("3", 3, "layers")
    with pytest.raises(UserError, match="expected 'all'"):
        parse_indices("x", 3, "heads")


def test_bad_input_is_one_line(run, tmp_path, capsys):
    for argv, message in (([run, "w1", "--heads", "5"], "the model has 2 heads"),
                          ([str(tmp_path / "nope"), "w1"], "no such directory"),
                          ([run, "w1", "-o", str(tmp_path)], "is a directory")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "attention.png")
