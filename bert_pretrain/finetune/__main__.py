"""`python -m bert_pretrain.finetune` = bert-finetune (for `accelerate launch -m ...`)."""

from .cli import main

main()
