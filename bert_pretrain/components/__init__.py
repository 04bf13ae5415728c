"""The training loop's parts, each owning one policy (torchtitan's components/): checkpoint
files, the checkpoint line and its manager, precision and loss scaling, optimizers and schedules,
metrics, evaluation, the prepared data and its schedules, what a resume may change, the run's
set-up steps and console record, stop requests, CPU settings, progress display and the trainer's
settings.  `bert_pretrain/trainer.py` calls them; `tools/` and `finetune/` reuse them."""
