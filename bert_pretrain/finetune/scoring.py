"""GLUE's metrics, computed by scikit-learn and SciPy, and how a task's metrics make its score.

Per task GLUE reports (Wang et al. 2019): CoLA Matthews correlation; STS-B Pearson and Spearman
correlation; MRPC and QQP F1 (of the positive class) and accuracy; MNLI accuracy on the matched
and the mismatched dev set; the others accuracy.  A task with several numbers scores their
unweighted mean, and the GLUE score is the mean of the task scores (WNLI left out, as is
customary).  Values are fractions here (0.85); tables print them as percentages.
"""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np


def predictions_of(logits: np.ndarray) -> np.ndarray:
    """Class ids ([N, C] logits, C > 1) or the regression values ([N, 1])."""
    logits = np.asarray(logits, dtype=np.float64)
    return logits[:, 0] if logits.shape[1] == 1 else logits.argmax(axis=1)


def metric(name: str, predictions: np.ndarray, labels: np.ndarray) -> float:
    """One GLUE metric. A correlation with a constant side (a model that predicts one value)
    is undefined; it scores 0, as scikit-learn's Matthews correlation does for that case."""
    from scipy import stats
    from sklearn import metrics as skm

    if name == "accuracy":
        return float(skm.accuracy_score(labels, predictions))
    if name == "f1":
        return float(skm.f1_score(labels, predictions, pos_label=1, average="binary",
                                  zero_division=0.0))
    if name == "mcc":
        return float(skm.matthews_corrcoef(labels, predictions))
    if name in ("pearson", "spearman"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy's ConstantInputWarning: scored 0 below
            fn = stats.pearsonr if name == "pearson" else stats.spearmanr
            value = float(fn(predictions, labels)[0])
        return 0.0 if math.isnan(value) else value
    raise ValueError(f"unknown metric {name!r}")


def compute(names, splits: dict) -> dict:
    """{metric[_split]: value} for `splits` = {split key: (logits, labels)}; the split key is
    '' for a task with one evaluation split (MNLI: 'm', 'mm')."""
    out = {}
    for key, (logits, labels) in splits.items():
        predictions = predictions_of(logits)
        for name in names:
            out[f"{name}_{key}" if key else name] = metric(name, predictions, np.asarray(labels))
    return out


def task_score(metrics: dict) -> float:
    """The task's GLUE score: the mean of its metrics."""
    return float(statistics.fmean(metrics.values()))


def glue_average(scores: dict, excluded=("wnli",)) -> float | None:
    """The mean of the task scores, `excluded` tasks left out; None if no task counts."""
    counted = [v for k, v in scores.items() if k not in excluded and v is not None]
    return float(statistics.fmean(counted)) if counted else None
