"""Data prep: raw text -> MLM + NSP (or MLM-only) pretraining instances (`bert-prep`).

Pipeline (`pipeline.run`), one module per step:
  config.py          the validated settings (conf/prep/prep.yaml, conf/prep/corpus/*.yaml)
  corpus.py          corpus sources -> a stream of (starts_document, sentence)
  builtin_corpus.py  the no-download corpus: Python's own documentation
  tokenizer.py       WordPiece: train, or reuse a vocab.txt / tokenizer.json; save for transformers
  encoder.py         fast exact corpus encoding (each distinct chunk tokenized once)
  token_store.py     the tokenized corpus as memory-mapped flat arrays
  plan.py            validation hold-out by document; work units (one shard per unit and dupe)
  instances.py       NSP instances of a unit (Google's semantics, minus its bugs)
  packing.py         MLM-only instances of a unit: whole sentences packed (RoBERTa)
  masking.py         [CLS] A [SEP] B [SEP] rows and MLM masks, vectorised over a shard
  shards.py          atomic shard directories, statistics, manifest helpers, crash leftovers
  workers.py         worker processes: Ctrl-C left to the main process, die with it
  build.py           the Hydra entry point
The on-disk result is specified in docs/prepared-format.md.
"""
