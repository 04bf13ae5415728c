"""Pilot for the in-domain table (docs/finetuning-results.md): linear probing, then fine-tuning
(LP-FT: Kumar, Raghunathan, Jones, Ma and Liang, "Fine-Tuning can Distort Pretrained Features
and Underperform Out-of-Distribution", ICLR 2022), beside bert-finetune's plain fine-tune.

A fine-tune starts with a head from random initialisation (the pooler of an MLM-only model, the
classifier), whose large early gradients flow into the pretrained layers and move them before
the head has learned anything; with few labels that may undo part of what pretraining gave.
LP-FT trains the head alone first (the encoder frozen: its weights take no gradient and no
optimizer step), then everything. Here the first `--probe-epochs` of recipe.epochs train the
head (pooler and classifier) at `--probe-lr` (constant; default: the grid's rate), and the rest
are bert-finetune's fine-tune with its own warmup and decay over the remaining steps, the
encoder joining at the first of them (its optimizer state starts there: a frozen parameter has
no gradient, so AdamW keeps no moments for it).

`--freeze-embeddings` keeps the embeddings (word, position, type and their LayerNorm) as
pretrained throughout; with `--probe-epochs 0` that is bert-finetune's fine-tune with the
embeddings frozen: with 1,000 labels most of the vocabulary is never seen in training, and
frozen embeddings keep the unseen words where pretraining put them, beside the seen ones.

Everything else is bert-finetune's (the grid, seeds, recipe, data subset, scoring; its
overrides follow `--`); the pilot's settings join the results' identity, so its out_dir can
not be mistaken for a plain fine-tune's:

    python bench/lpft_pilot.py --probe-epochs 3 -- task=sst2 data_dir=glue_data \
        model=runs/dom_2l_7500 max_train_samples=1000 'recipe.lrs=[5e-4,1e-3]' \
        'recipe.seeds=[1,2,3]' recipe.epochs=10 recipe.max_length=64 out_dir=ft/lpft/1000

A pilot, not a command of the package: one process; what is frozen is a function of the step
alone, so a fine-tune stopped and resumed through bert-finetune's checkpoints freezes the same
steps (tests/test_bench_lpft_pilot.py).
"""

from __future__ import annotations

import argparse

from benchlib import finetune_with_pilot, patch_finetune


def is_head(name: str, num_layers: int) -> bool:
    """What reads the last layer (pooler, classifier, a pre-LN encoder's final LayerNorm)."""
    from bert_pretrain.finetune.runner import layer_depth

    return layer_depth(name, num_layers) == num_layers + 1


def probe_steps(probe_epochs: float, epochs: float, num_steps: int) -> int:
    """The steps of the probe: the first probe_epochs of epochs, at least one step left."""
    if not 0 <= probe_epochs < epochs:
        raise SystemExit(f"lpft_pilot: --probe-epochs must be in [0, recipe.epochs = {epochs:g})"
                         f", got {probe_epochs:g}")
    return min(int(round(num_steps * probe_epochs / epochs)), num_steps - 1)


def install(args):
    """Patch bert-finetune's job (identity), schedule and step with the pilot's; returns what
    undoes it (a test runs the pilot inside a process that fine-tunes other things after)."""
    from bert_pretrain.finetune import runner
    from bert_pretrain.finetune.runner import layer_depth
    from bert_pretrain.components.optim import Schedule, SchedulerConfig

    settings = {"probe_epochs": args.probe_epochs, "probe_lr": args.probe_lr}
    if args.freeze_embeddings:  # (only when asked: the results of before keep their identity)
        settings["freeze_embeddings"] = True

    class ProbeThenTune:
        """The probe's constant factor, then bert-finetune's linear schedule over the rest."""

        def __init__(self, lr: float, probe_lr: float, probe: int, num_steps: int,
                     warmup_ratio: float):
            self.lr_ratio, self.probe = probe_lr / lr, probe
            rest = num_steps - probe
            self.rest = Schedule(SchedulerConfig(name="linear"), rest,
                                 int(round(warmup_ratio * rest)))

        def factor(self, step: int) -> float:
            return self.lr_ratio if step < self.probe else self.rest.factor(step - self.probe)

    plain_step = runner.FineTune.train_step

    def train_step(self):
        if self.session.world != 1:
            raise SystemExit("lpft_pilot: one process only")
        if not isinstance(self.schedule, ProbeThenTune):
            probe = probe_steps(args.probe_epochs, self.recipe.epochs, self.order.num_steps)
            self.schedule = ProbeThenTune(self.lr, args.probe_lr or self.lr, probe,
                                          self.order.num_steps, self.recipe.warmup_ratio)
            layers = self.raw_model.config.num_hidden_layers
            self.pilot_parts = {part: [p for n, p in self.raw_model.named_parameters()
                                       if part == ("head" if is_head(n, layers) else
                                                   "embeddings" if layer_depth(n, layers) == 0
                                                   else "layers")]
                                for part in ("embeddings", "layers")}
        frozen = self.step < self.schedule.probe
        for p in self.pilot_parts["layers"]:
            p.requires_grad_(not frozen)
        for p in self.pilot_parts["embeddings"]:
            p.requires_grad_(not (frozen or args.freeze_embeddings))
        return plain_step(self)

    return patch_finetune("lpft_pilot", settings, train_step,
                          lambda job, s, pretrained, say: say(f"lpft_pilot: {settings}"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe-epochs", type=float, default=3.0,
                   help="the first epochs of recipe.epochs, training the head alone")
    p.add_argument("--probe-lr", type=float, default=None,
                   help="the head's constant rate in the probe (default: the grid's rate)")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="the embeddings stay as pretrained throughout (with --probe-epochs 0: "
                        "a plain fine-tune of everything else)")
    finetune_with_pilot("lpft_pilot", p, install, argv)


if __name__ == "__main__":
    main()
