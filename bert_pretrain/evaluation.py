"""Held-out evaluation: token-weighted MLM loss/accuracy and NSP loss/accuracy, summed over every
process, and the most-frequent-token baseline a model must beat."""

import numpy as np
import torch
import torch.nn.functional as F


def model_inputs(batch: dict, device) -> dict:
    """A collated batch on `device`, without the bookkeeping fields the model does not take."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "num_tokens"}


@torch.no_grad()
def evaluate(model, accelerator, batches, progress=None) -> dict:
    """Token-weighted MLM loss/accuracy and NSP loss/accuracy over the held-out batches.

    Sums are reduced over processes, so the result is the same for any number of processes.
    `progress`: an optional tqdm bar advanced once per batch.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=accelerator.device)
    for batch in batches:
        inputs = model_inputs(batch, accelerator.device)
        with accelerator.autocast():
            out = model(**inputs)
        if out.mlm_labels is not None:  # sparse: rows are the labelled positions
            logits, labels = out.prediction_logits, out.mlm_labels
        else:
            labels = inputs["labels"].reshape(-1)
            keep = labels != -100
            logits = out.prediction_logits.reshape(labels.shape[0], -1)[keep]
            labels = labels[keep]
        nsp_logits, nsp_labels = out.seq_relationship_logits, inputs["next_sentence_label"]
        sums += torch.stack([
            F.cross_entropy(logits.float(), labels, reduction="sum").double(),
            (logits.argmax(-1) == labels).sum().double(),
            torch.tensor(labels.numel(), dtype=torch.float64, device=sums.device),
            F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="sum").double(),
            (nsp_logits.argmax(-1) == nsp_labels).sum().double(),
            torch.tensor(nsp_labels.numel(), dtype=torch.float64, device=sums.device),
        ])
        if progress is not None:
            progress.update(1)
    sums = accelerator.reduce(sums, reduction="sum")
    model.train(was_training)
    mlm_n, nsp_n = max(sums[2].item(), 1.0), max(sums[5].item(), 1.0)
    return {"eval_mlm_loss": sums[0].item() / mlm_n, "eval_mlm_accuracy": sums[1].item() / mlm_n,
            "eval_nsp_loss": sums[3].item() / nsp_n, "eval_nsp_accuracy": sums[4].item() / nsp_n}


def majority_baseline(data, split_name: str) -> float:
    """MLM accuracy of always predicting the most frequent masked token of the held-out split:
    the bar a model must clear to have learned anything beyond unigram frequencies."""
    shards = data.split(split_name).shards
    labels = [shard["masked_labels"][shard["masked_positions"][:] > 0] for shard in shards]
    counts = np.bincount(np.concatenate(labels).astype(np.int64))
    return float(counts.max() / max(counts.sum(), 1))
