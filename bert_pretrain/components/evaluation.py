"""Held-out evaluation: token-weighted MLM loss/accuracy and NSP loss/accuracy (when the data has
NSP labels and the model an NSP head), summed over every process, and the most-frequent-token
baseline a model must beat."""

import numpy as np
import torch
import torch.nn.functional as F


def model_inputs(batch: dict, device, next_sentence_prediction: bool = True) -> dict:
    """A collated batch on `device`, without the bookkeeping fields the model does not take.
    For an MLM-only model (`next_sentence_prediction=False`) the NSP labels of pair data are
    left out too: it trains and is scored on the masked tokens alone."""
    skip = ("num_tokens",) if next_sentence_prediction else ("num_tokens", "next_sentence_label")
    # To a GPU from page-locked memory: a copy from pageable memory may wait for the work
    # queued before it, which would undo the training step's deferred reads (trainer.py).
    pin = torch.device(device).type == "cuda"
    return {k: (v.pin_memory() if pin and v.device.type == "cpu" else v).to(device,
                                                                            non_blocking=True)
            for k, v in batch.items() if k not in skip}


def evaluate(model, accelerator, batches, progress=None, mask_id=None, autocast=None,
             lockstep=None) -> dict:
    """`_evaluate`'s result. A model with an ELECTRA generator samples the replacements it
    scores: from a fixed seed, on a forked generator, so that the result is a function of the
    weights and the data alone (a resumed run evaluates as the uninterrupted one) and the
    training's random stream is left as it was."""
    if getattr(model, "generator", None) is None:
        return _evaluate(model, accelerator, batches, progress, mask_id, autocast, lockstep)
    cuda = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        return _evaluate(model, accelerator, batches, progress, mask_id, autocast, lockstep)


@torch.no_grad()
def _evaluate(model, accelerator, batches, progress=None, mask_id=None, autocast=None,
              lockstep=None) -> dict:
    """Token-weighted MLM loss/accuracy and NSP loss/accuracy over the held-out batches.

    Sums are reduced over processes, so the result is the same for any number of processes.
    `progress`: an optional tqdm bar advanced once per batch.  With `mask_id` (the [MASK]
    token), also the accuracy on the positions the input shows as [MASK] (80% of those
    predicted): the 10% left unchanged are answered by copying the input, which a model learns
    long before it uses the context, so the overall accuracy flatters an early model.
    `eval_nsp_accuracy_balanced` is the mean of the accuracies on true-next and on random-next
    pairs: the accuracy the split would give if it held both in equal numbers (held-out
    documents are few, and short ones give more random-next pairs, so a split can be 56/44).
    `autocast`: a context-manager factory (the run's precision policy); default accelerate's.
    `lockstep`: (forward passes, a filler batch) for a sharded model, whose every forward is a
    collective: a process that ran out of batches runs the filler until it has made as many
    passes as the others, and drops those results (sharding.eval_forward_passes).
    With an ELECTRA generator also `eval_rtd_loss`, `eval_rtd_accuracy` (its baseline, always
    answering "not replaced": `eval_rtd_accuracy_baseline`) and `eval_rtd_recall` (the share of
    replaced tokens flagged): the encoder's replaced-token detection over every real token
    (`eval_mlm_*` are then the generator's).
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(17, dtype=torch.float64, device=accelerator.device)
    # An MLM-only model (no NSP head) is scored on the masked tokens of any data; its result
    # has no eval_nsp_* keys, nor has any model's on MLM-only data (no NSP labels).
    nsp = getattr(getattr(model, "config", None), "next_sentence_prediction", True)
    passes = 0
    for batch in batches:
        passes += 1
        inputs = model_inputs(batch, accelerator.device, nsp)
        with (autocast or accelerator.autocast)():
            out = model(**inputs)
        keep = inputs["labels"].reshape(-1) != -100
        # (sparse rows are the labelled positions in row-major order, as this selection)
        shown = inputs["input_ids"].reshape(-1)[keep]
        if out.mlm_labels is not None:  # sparse: rows are the labelled positions
            logits, labels = out.prediction_logits, out.mlm_labels
        else:
            labels = inputs["labels"].reshape(-1)[keep]
            logits = out.prediction_logits.reshape(keep.shape[0], -1)[keep]
        right = logits.argmax(-1) == labels
        masked = shown == mask_id if mask_id is not None else torch.zeros_like(right)
        sums[:3] += torch.stack([
            F.cross_entropy(logits.float(), labels, reduction="sum").double(),
            right.sum().double(), right.new_tensor(labels.numel(), dtype=torch.float64)])
        sums[6:8] += torch.stack([(right & masked).sum().double(), masked.sum().double()])
        if "next_sentence_label" in inputs:
            sums[[3, 4, 5, 8, 9, 10, 11]] += _nsp_sums(out.seq_relationship_logits,
                                                       inputs["next_sentence_label"])
        if out.rtd_loss is not None:  # an ELECTRA generator: replaced-token detection
            guess = out.rtd_logits > 0
            replaced = out.rtd_labels.bool()
            sums[12:17] += torch.stack([
                F.binary_cross_entropy_with_logits(out.rtd_logits.float(), out.rtd_labels,
                                                   reduction="sum").double(),
                (guess == replaced).sum().double(),
                guess.new_tensor(guess.numel(), dtype=torch.float64),
                replaced.sum().double(), (guess & replaced).sum().double()])
        if progress is not None:
            progress.update(1)
    if lockstep is not None:
        total, filler = lockstep
        for _ in range(total - passes):
            with (autocast or accelerator.autocast)():
                model(**model_inputs(filler, accelerator.device, nsp))
    sums = accelerator.reduce(sums, reduction="sum")
    model.train(was_training)
    mlm_n, nsp_n = max(sums[2].item(), 1.0), max(sums[5].item(), 1.0)
    result = {"eval_mlm_loss": sums[0].item() / mlm_n,
              "eval_mlm_accuracy": sums[1].item() / mlm_n}
    if sums[5].item() > 0:   # some process scored NSP (the sums are global)
        result.update({
            "eval_nsp_loss": sums[3].item() / nsp_n,
            "eval_nsp_accuracy": sums[4].item() / nsp_n,
            "eval_nsp_accuracy_balanced": 0.5 * (sums[8].item() / max(sums[9].item(), 1.0) +
                                                 sums[10].item() / max(sums[11].item(), 1.0))})
    if sums[14].item() > 0:
        result.update({"eval_rtd_loss": sums[12].item() / sums[14].item(),
                       "eval_rtd_accuracy": sums[13].item() / sums[14].item(),
                       # the accuracy of always answering "not replaced", and the share of the
                       # replaced tokens found: a detector stuck at the base rate finds none
                       "eval_rtd_accuracy_baseline": 1.0 - sums[15].item() / sums[14].item(),
                       "eval_rtd_recall": sums[16].item() / max(sums[15].item(), 1.0)})
    if mask_id is not None:
        result["eval_mlm_accuracy_masked"] = sums[6].item() / max(sums[7].item(), 1.0)
    return result


def _nsp_sums(nsp_logits: torch.Tensor, nsp_labels: torch.Tensor) -> torch.Tensor:
    """NSP loss sum, right, count, and right/count on true-next and on random-next pairs."""
    nsp_labels = nsp_labels.reshape(-1)
    nsp_right = nsp_logits.argmax(-1) == nsp_labels
    random_next = nsp_labels == 1
    return torch.stack([
        F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="sum").double(),
        nsp_right.sum().double(), nsp_right.new_tensor(nsp_labels.numel(), dtype=torch.float64),
        (nsp_right & ~random_next).sum().double(), (~random_next).sum().double(),
        (nsp_right & random_next).sum().double(), random_next.sum().double()])


def majority_baseline(data, split_name: str) -> float:
    """MLM accuracy of always predicting the most frequent masked token of the held-out split:
    the bar a model must clear to have learned anything beyond unigram frequencies."""
    shards = data.split(split_name).shards
    labels = [shard["masked_labels"][shard["masked_positions"][:] > 0] for shard in shards]
    counts = np.bincount(np.concatenate(labels).astype(np.int64))
    return float(counts.max() / max(counts.sum(), 1))
