"""Pilot for the in-domain table (docs/finetuning-results.md): prompt-based fine-tuning
(PET: Schick and Schuetze, EACL 2021; LM-BFF: Gao, Fisch and Chen, ACL 2021), which reads the
pretrained model through the head it was trained with, the masked-LM head, instead of a fresh
classifier on an untrained [CLS] vector.

Each example becomes `<text> <template>` with one [MASK] in the template ("it was [MASK] ."),
and the class scores are the MLM head's logits at the [MASK] for one word per class (the
verbalizer, "terrible" / "great"): the head's transform (dense, GELU, LayerNorm) then a
2-row linear layer initialised from those words' output embeddings and biases, all fine-tuned
with cross-entropy. An MLM-only model thus starts fine-tuning from a classifier it already
has, where bert-finetune's cls head starts from random
rows on a pooler it never trained. `init=random` is the same head on a randomly initialised
model: the control. Measured on the in-domain recipe (docs/finetuning-results.md, "Prompt-based
fine-tuning"): +1.2, +0.9 and -1.6 points against the [CLS] head on three pretrainings of
SST-2's 1,000 labels, -0.9 on DBpedia: no consistent gain, so it was not built in.

Everything else is bert-finetune's (the same grid, seeds, recipe, data subset, scoring; its
overrides follow `--`); the pilot's settings join the results' identity, so its out_dir can not
be mistaken for a plain fine-tune's:

    python bench/prompt_pilot.py --template 'it was [MASK] .' --words terrible great -- \
        task=sst2 data_dir=glue_data model=runs/dom_2l_7500 max_train_samples=1000 \
        'recipe.lrs=[1e-4,3e-4,1e-3]' 'recipe.seeds=[1,2,3]' recipe.epochs=10 \
        recipe.max_length=64 out_dir=ft/prompt/1000

A pilot, not a command of the package: single-text tasks, one process; the template is put
after the text (the text is cut, never the template); the fine-tuned model is this pilot's
module, not a transformers class (bert-finetune's export refuses it).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from benchlib import finetune_with_pilot


def with_template(enc, template: list, limit: int):
    """Encoded examples ([CLS] text [SEP]) as [CLS] text template [SEP], the text cut so that
    the whole fits in `limit` tokens."""
    from bert_pretrain.finetune.batches import Encoded

    room = limit - 2 - len(template)
    if room < 1:
        raise SystemExit(f"prompt_pilot: the template has {len(template)} tokens; "
                         f"recipe.max_length={limit} leaves no room for the text")
    ids, types = [], []
    for x in enc.ids:
        text = x[1:-1][:room]
        ids.append(np.concatenate([x[:1], text, np.asarray(template, dtype=np.int64), x[-1:]]))
        types.append(np.zeros(len(ids[-1]), dtype=np.int64))
    return Encoded(ids, types, enc.labels)


def words_error(classes: int, words: int) -> str:
    return (f"prompt_pilot: the task has {classes} classes and --words gives {words} words: "
            f"give one word per class, in label order")


PROMPT = {}
"""What the patched classifier reads (set by install): mask id, word ids, the MLM head."""


def prompt_classifier_class():
    from bert_pretrain.model import BertForSequenceClassification
    from bert_pretrain.model.classifier import ClassificationOutput
    from bert_pretrain.model.heads import BertPredictionHeadTransform
    from bert_pretrain.model.bert import init_bert_weights

    class PromptClassifier(BertForSequenceClassification):
        """The encoder (no pooler), the MLM head's transform and one output row per class."""

        def __init__(self, config, num_labels, impl=None, classifier_dropout=None,
                     pooling="cls"):
            if num_labels != len(PROMPT["words"]):
                raise SystemExit(words_error(num_labels, len(PROMPT["words"])))
            super().__init__(config, num_labels, impl, classifier_dropout, pooling="mean")
            self.transform = BertPredictionHeadTransform(self.config)
            init_bert_weights(self.transform, self.config.initializer_range)

        def load_encoder(self, state_dict: dict) -> bool:
            super().load_encoder(state_dict)
            head = PROMPT["mlm_head"]
            self.transform.load_state_dict(head["transform"])
            words = torch.tensor(PROMPT["word_ids"])
            with torch.no_grad():
                self.classifier.weight.copy_(head["decoder_weight"][words])
                self.classifier.bias.copy_(head["bias"][words])
            return False

        def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
                    loss_reduction="mean"):
            out = self.bert(input_ids, attention_mask, token_type_ids)
            x = out.layout.to_grid(out.sequence_output)
            # the template's [MASK]: the last in the row (a text may hold the word itself)
            is_mask = (input_ids == PROMPT["mask_id"]).int()
            at = input_ids.shape[1] - 1 - is_mask.flip(1).argmax(dim=1)
            h = x[torch.arange(x.shape[0], device=x.device), at]
            logits = self.classifier(self.transform(h))
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits.float(), labels.reshape(-1),
                                       reduction=loss_reduction)
            return ClassificationOutput(loss, logits)

    return PromptClassifier


def install(args):
    """Patch bert-finetune's job (data, identity) and classifier with the pilot's; returns
    what undoes it."""
    import bert_pretrain.model as model_pkg
    from bert_pretrain.finetune import grid
    from bert_pretrain.tools.model_loading import load_model

    prepare_job = grid.prepare_job
    plain_class = model_pkg.BertForSequenceClassification

    def prepare_with_pilot(s, pretrained, config_yaml, say=print, *, precision):
        job = prepare_job(s, pretrained, config_yaml, say, precision=precision)
        if job.data.train.text_b is not None:
            raise SystemExit("prompt_pilot: single-text tasks only")
        job.identity["prompt_pilot"] = {"template": args.template, "words": args.words}
        tokenizer = pretrained.tokenizer()
        template = tokenizer.encode(args.template, add_special_tokens=False).ids
        mask_id = tokenizer.token_to_id("[MASK]")
        if template.count(mask_id) != 1:
            raise SystemExit(f"prompt_pilot: the template {args.template!r} must hold one "
                             f"[MASK] (it tokenizes as "
                             f"{tokenizer.encode(args.template, add_special_tokens=False).tokens})")
        word_ids = []
        for word in args.words:
            ids = tokenizer.encode(word, add_special_tokens=False).ids
            if ids == [tokenizer.token_to_id("[UNK]")]:
                raise SystemExit(f"prompt_pilot: {word!r} is not in this vocabulary ([UNK]); "
                                 f"pick words of the domain's text")
            if len(ids) != 1:
                raise SystemExit(f"prompt_pilot: {word!r} is {len(ids)} pieces in this "
                                 f"vocabulary; pick words that are one piece each")
            word_ids += ids
        if len(word_ids) != job.data.num_labels:
            raise SystemExit(words_error(job.data.num_labels, len(word_ids)))
        limit = min(s.recipe.max_length, pretrained.config.max_position_embeddings)
        job.train = with_template(job.train, template, limit)
        job.evals = {k: with_template(v, template, limit) for k, v in job.evals.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            full = load_model(pretrained.source).model.state_dict()
        if s.init == "pretrained" and any("cls.predictions" in str(w.message) for w in caught):
            raise SystemExit(f"prompt_pilot: {pretrained.source} has no masked-LM head (a "
                             f"bare encoder): the prompt head would start from random weights; "
                             f"give a run directory or a bert-export --head masked-lm directory")
        PROMPT.update(mask_id=mask_id, words=list(args.words), word_ids=word_ids, mlm_head={
            "transform": {k[len("cls.predictions.transform."):]: v for k, v in full.items()
                          if k.startswith("cls.predictions.transform.")},
            "decoder_weight": full["bert.embeddings.word_embeddings.weight"],
            "bias": full["cls.predictions.bias"]})
        say(f"prompt_pilot: template {args.template!r}, words {args.words} (ids {word_ids})")
        return job

    grid.prepare_job = prepare_with_pilot
    model_pkg.BertForSequenceClassification = prompt_classifier_class()

    def uninstall() -> None:
        grid.prepare_job = prepare_job
        model_pkg.BertForSequenceClassification = plain_class

    return uninstall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--template", default="it was [MASK] .")
    p.add_argument("--words", nargs="+", default=["terrible", "great"],
                   help="one word per class, in label order")
    finetune_with_pilot("prompt_pilot", p, install, argv)


if __name__ == "__main__":
    main()
