"""GLUE's metrics on fixed predictions: equal to scikit-learn / SciPy and to the formulas
written out; a task's score is the mean of its metrics, the GLUE average leaves out WNLI."""

import math

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from bert_pretrain.finetune import scoring
from bert_pretrain.finetune.tasks import FAST_SUBSET, TABLE_ORDER, resolve_tasks

LABELS = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1])
PREDS = np.array([1, 0, 0, 1, 1, 0, 1, 0, 1, 0])
# confusion: tp 4, tn 3, fp 1, fn 2


def _logits(preds, classes=2):
    out = np.zeros((len(preds), classes))
    out[np.arange(len(preds)), preds] = 1.0
    return out


def test_classification_metrics_equal_the_formulas_and_sklearn():
    tp, tn, fp, fn = 4, 3, 1, 2
    got = scoring.compute(("accuracy", "f1", "mcc"), {"": (_logits(PREDS), LABELS)})
    assert got["accuracy"] == pytest.approx((tp + tn) / 10) == skm.accuracy_score(LABELS, PREDS)
    assert got["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert got["f1"] == pytest.approx(skm.f1_score(LABELS, PREDS))
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert got["mcc"] == pytest.approx(mcc) == pytest.approx(skm.matthews_corrcoef(LABELS, PREDS))


def test_regression_metrics_equal_scipy():
    rng = np.random.default_rng(0)
    labels = rng.uniform(0, 5, 50)
    preds = labels + rng.normal(0, 1.5, 50)
    got = scoring.compute(("pearson", "spearman"), {"": (preds[:, None], labels)})
    assert got["pearson"] == pytest.approx(stats.pearsonr(preds, labels)[0])
    assert got["spearman"] == pytest.approx(stats.spearmanr(preds, labels)[0])
    assert got["pearson"] == pytest.approx(np.corrcoef(preds, labels)[0, 1])
    assert 0.3 < got["spearman"] < 0.95


def test_mnli_scores_each_split_and_constant_predictions_score_zero():
    three = np.array([0, 1, 2, 2, 1, 0])
    got = scoring.compute(("accuracy",), {"m": (_logits(three, 3), three),
                                          "mm": (_logits(np.zeros(6, int), 3), three)})
    assert got == {"accuracy_m": 1.0, "accuracy_mm": pytest.approx(2 / 6)}
    flat = scoring.compute(("pearson", "mcc"), {"": (np.zeros((6, 1)), three.astype(float))})
    assert flat["pearson"] == 0.0
    assert scoring.metric("mcc", np.zeros(6, int), three) == 0.0


def test_task_score_and_glue_average():
    assert scoring.task_score({"f1": 0.9, "accuracy": 0.8}) == pytest.approx(0.85)
    scores = {"sst2": 0.9, "rte": 0.6, "wnli": 0.1}
    assert scoring.glue_average(scores) == pytest.approx(0.75)  # WNLI left out
    assert scoring.glue_average({"wnli": 0.5}) is None


def test_task_choices():
    assert resolve_tasks("all") == list(TABLE_ORDER) and TABLE_ORDER[0] == "mnli"
    assert resolve_tasks("fast") == [t for t in TABLE_ORDER if t in FAST_SUBSET]
    assert resolve_tasks(["rte", "sst2"]) == ["sst2", "rte"]  # the table's order
    with pytest.raises(ValueError, match="use all, fast"):
        resolve_tasks(["sst2", "sts"])
