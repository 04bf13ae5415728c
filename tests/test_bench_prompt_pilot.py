"""bench/prompt_pilot.py: puts the template after the text (the text is cut, never the template),
starts from exactly the masked-LM head's scores for the class words at [MASK], refuses what
would silently start from random weights, and runs bert-finetune's grid with its settings in
the results' identity."""

import json
import os
import sys

import numpy as np
import pytest
import torch

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import prompt_pilot  # noqa: E402

transformers = pytest.importorskip("transformers")

WORDS = "the a film was good bad dull fine plot cast i liked it great awful movie".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]


def test_template_goes_after_the_text_which_is_cut_to_fit():
    from bert_pretrain.finetune.batches import Encoded

    enc = Encoded([np.array([2, 10, 11, 12, 13, 14, 3]), np.array([2, 10, 3])],
                  [np.zeros(7, dtype=np.int64), np.zeros(3, dtype=np.int64)], np.array([0, 1]))
    out = prompt_pilot.with_template(enc, [20, 4, 21], limit=7)
    assert out.ids[0].tolist() == [2, 10, 11, 20, 4, 21, 3]  # text cut to 2, template whole
    assert out.ids[1].tolist() == [2, 10, 20, 4, 21, 3]
    assert [t.tolist() for t in out.types] == [[0] * 7, [0] * 6]
    assert out.labels.tolist() == [0, 1]
    with pytest.raises(SystemExit, match="leaves no room for the text"):
        prompt_pilot.with_template(enc, [20, 4, 21], limit=5)


def _tiny_bert(seed=0):
    from bert_pretrain.model import BertConfig, BertForPreTraining

    config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32,
                        next_sentence_prediction=False, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertForPreTraining(config)
    with torch.no_grad():  # a trained-looking head: not the zero bias it starts with
        model.cls.predictions.bias.normal_()
    return model.eval()


def test_starts_from_the_masked_lm_heads_scores_for_the_words():
    """Before any step, the class scores are the MLM head's logits at [MASK] for the class words
    (the reference: BertForPreTraining's own prediction_logits), in label order."""
    mlm = _tiny_bert()
    state = mlm.state_dict()
    word_ids = [VOCAB.index("awful"), VOCAB.index("great")]
    prompt_pilot.PROMPT.update(mask_id=4, words=["awful", "great"], word_ids=word_ids, mlm_head={
        "transform": {k[len("cls.predictions.transform."):]: v for k, v in state.items()
                      if k.startswith("cls.predictions.transform.")},
        "decoder_weight": state["bert.embeddings.word_embeddings.weight"],
        "bias": state["cls.predictions.bias"]})
    cls = prompt_pilot.prompt_classifier_class()
    torch.manual_seed(1)
    model = cls(mlm.config, 2)
    model.load_encoder(state)
    model.eval()
    # the template's [MASK] at different places; the second row padded; the third's text holds
    # a [MASK] of its own before the template's
    ids = torch.tensor([[2, 7, 8, 4, 9, 3], [2, 4, 10, 3, 0, 0], [2, 4, 7, 4, 9, 3]])
    mask = (ids != 0).long()
    with torch.no_grad():
        got = model(ids, mask).logits
        ref = mlm(ids, mask).prediction_logits
    want = torch.stack([ref[0, 3, word_ids], ref[1, 1, word_ids], ref[2, 3, word_ids]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loss = model(ids, mask, labels=torch.tensor([1, 0, 1])).loss
    assert torch.isfinite(loss) and loss > 0
    with pytest.raises(SystemExit, match="has 3 classes and --words gives 2 words"):
        cls(mlm.config, 3)


def _mlm_dir(path, head=True):
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=16,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config) if head else transformers.BertModel(config)
    model.save_pretrained(path)
    return path


def _task(tmp_path) -> tuple:
    """A labelled CSV task and a tiny masked-LM: bert-finetune's overrides, the model."""
    rows = [(f"{WORDS[i % 16]} {WORDS[(i * 3) % 16]} film", i % 2) for i in range(24)]
    for name in ("train", "dev"):
        (tmp_path / f"{name}.csv").write_text(
            "text,label\n" + "\n".join(f"{t},{y}" for t, y in rows) + "\n")
    model = _mlm_dir(tmp_path / "mlm")
    return ["task=custom", f"task.train_file={tmp_path / 'train.csv'}",
            f"task.validation_file={tmp_path / 'dev.csv'}", "task.text_columns=[text]",
            "recipe.lrs=[1e-3]", "recipe.seeds=[1]", "recipe.epochs=2",
            "recipe.batch_size=8", "trainer.save_model=none", "trainer.progress_bar=false"], model


def test_runs_bert_finetunes_grid_with_its_settings_in_the_identity(tmp_path):
    common, model = _task(tmp_path)
    out = tmp_path / "ft"
    prompt_pilot.main(["--template", "it was [MASK] .", "--words", "awful", "great", "--",
                       *common, f"model={model}", f"out_dir={out}"])
    import bert_pretrain.model as model_pkg
    from bert_pretrain.finetune import grid

    # bert-finetune is itself again afterwards (the patch is the pilot's, for its run only)
    assert model_pkg.BertForSequenceClassification.__name__ == "BertForSequenceClassification"
    assert grid.prepare_job.__qualname__ == "prepare_job"
    (result,) = [json.loads(p.read_text()) for p in out.rglob("result.json")]
    assert result["identity"]["prompt_pilot"] == {"template": "it was [MASK] .",
                                                  "words": ["awful", "great"]}
    assert result["steps"] == 6 and 0.0 <= result["score"] <= 100.0

    def refused(args, match, model_dir=model):
        with pytest.raises(SystemExit, match=match):
            prompt_pilot.main([*args, "--", *common, f"model={model_dir}",
                               f"out_dir={tmp_path / 'refused'}"])

    refused(["--words", "awful", "films"], "'films' is 2 pieces in this vocabulary")
    refused(["--words", "awful", "superb"], "'superb' is not in this vocabulary")
    refused(["--template", "it was .", "--words", "awful", "great"], "must hold one \\[MASK\\]")
    refused(["--words", "awful", "good", "great"], "has 2 classes and --words gives 3 words")
    refused(["--words", "awful", "great"], "has no masked-LM head",
            model_dir=_mlm_dir(tmp_path / "bare", head=False))
    with pytest.raises(SystemExit, match="after `--`"):
        prompt_pilot.main(["--words", "a", "b"])


def test_an_interrupted_pilot_fine_tune_resumes_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """The prompt head (the MLM transform and the words' rows) saved in bert-finetune's
    checkpoints and taken up again by a resume."""
    from finetune_support import check_interrupted_fine_tune_resumes

    common, model = _task(tmp_path)
    common += [f"model={model}", "trainer.log_every=1", "trainer.checkpoint_every=2",
               "trainer.mixed_precision=no"]
    check_interrupted_fine_tune_resumes(
        lambda out: prompt_pilot.main(["--template", "it was [MASK] .", "--words", "awful",
                                       "great", "--", *common, f"out_dir={out}"]),
        tmp_path / "ft", monkeypatch)
