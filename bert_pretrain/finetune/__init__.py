"""Fine-tuning what was pretrained, scored the way the field does (GLUE).

    bert-finetune task=sst2 model=runs/demo          # one task: the lr x seed grid, medians
    bert-glue 'models=[runs/a,runs/b]' tasks=fast    # several tasks and models: one table

tasks.py (what a task is), reading.py (its examples), batches.py (tokens and the batch order),
scoring.py (GLUE's metrics), runner.py (one fine-tune), grid.py (a task's lr x seed grid),
export.py (the fine-tuned model for transformers), cli.py / glue.py (the commands),
downstream.py (a pretraining run's downstream score, for sweeps). The model itself is
bert_pretrain.model.BertForSequenceClassification.
"""
