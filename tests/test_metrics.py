"""Tests for fedderm.metrics against hand-computed values."""

import math

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix

from fedderm.metrics import METRIC_NAMES, classification_metrics, mean_over_clients


def probs_from_pred(y_pred, num_classes, high=0.6):
    """Softmax-like rows whose argmax is y_pred."""
    low = (1.0 - high) / (num_classes - 1)
    prob = np.full((len(y_pred), num_classes), low)
    prob[np.arange(len(y_pred)), y_pred] = high
    return prob


def test_metric_names_fixed():
    assert METRIC_NAMES == (
        "balanced_accuracy",
        "precision",
        "recall",
        "f1",
        "specificity",
        "auc",
        "accuracy",
        "ap",
    )


def test_three_class_by_hand():
    y_true = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    y_pred = np.array([0, 0, 1, 2, 1, 1, 0, 2, 2, 2])
    # Confusion matrix written out by hand (rows = true, cols = predicted):
    #   true 0: pred 0,0,1,2 -> [2, 1, 1]
    #   true 1: pred 1,1,0   -> [1, 2, 0]
    #   true 2: pred 2,2,2   -> [0, 0, 3]
    cm = np.array([[2, 1, 1], [1, 2, 0], [0, 0, 3]])
    assert (confusion_matrix(y_true, y_pred) == cm).all()
    # recall    = 2/4, 2/3, 3/3                      -> macro 13/18
    # precision = 2/3 (col 3), 2/3 (col 3), 3/4 (col 4) -> macro 25/36
    # f1        = 4/7, 2/3, 6/7                      -> macro 44/63
    # specificity: c0 TN=5 FP=1 -> 5/6; c1 TN=6 FP=1 -> 6/7; c2 TN=6 FP=1 -> 6/7
    #                                                -> macro 107/126
    # accuracy  = 7/10
    m = classification_metrics(y_true, probs_from_pred(y_pred, 3), num_classes=3)
    assert set(m) == set(METRIC_NAMES)
    assert "loss" not in m
    assert m["recall"] == pytest.approx(13 / 18)
    assert m["balanced_accuracy"] == pytest.approx(13 / 18)
    assert m["precision"] == pytest.approx(25 / 36)
    assert m["f1"] == pytest.approx(44 / 63)
    assert m["specificity"] == pytest.approx(107 / 126)
    assert m["accuracy"] == pytest.approx(7 / 10)
    assert all(isinstance(v, float) for v in m.values())


def test_auc_binary_perfect():
    y_true = np.array([0, 0, 1, 1])
    p1 = np.array([0.1, 0.2, 0.8, 0.9])
    m = classification_metrics(y_true, np.stack([1 - p1, p1], axis=1), num_classes=2)
    assert m["auc"] == pytest.approx(1.0)
    assert m["accuracy"] == pytest.approx(1.0)


def test_auc_binary_three_quarters():
    # Positives 0.35, 0.8 vs negatives 0.1, 0.4: pairs won 0.35>0.1, 0.8>0.1, 0.8>0.4,
    # lost 0.35<0.4 -> 3/4 for class 1; class 0 (scores 1-p) is the mirror -> 3/4.
    y_true = np.array([0, 0, 1, 1])
    p1 = np.array([0.1, 0.4, 0.35, 0.8])
    m = classification_metrics(y_true, np.stack([1 - p1, p1], axis=1), num_classes=2)
    assert m["auc"] == pytest.approx(0.75)
    # AP of class 1, scores ranked 0.8 (+), 0.4 (-), 0.35 (+), 0.1 (-):
    # Σ (R_n − R_{n−1}) P_n = 0.5·1 + 0.5·(2/3) = 5/6; class 0 (scores 0.9 +, 0.65 -, 0.6 +, 0.2 -)
    # has the same ranking pattern -> 5/6; macro AP = 5/6
    assert m["ap"] == pytest.approx(5 / 6)


def test_auc_nan_with_single_class():
    y_true = np.array([1, 1, 1])
    m = classification_metrics(y_true, probs_from_pred(np.array([1, 1, 0]), 3), num_classes=3)
    assert math.isnan(m["auc"])
    # one class in y_true: a balanced accuracy is undefined (NaN), not that class's recall
    assert math.isnan(m["balanced_accuracy"])
    assert m["accuracy"] == pytest.approx(2 / 3)


def test_one_class_all_correct_is_not_a_perfect_balanced_accuracy():
    y_true = np.array([0, 0, 0, 0])
    m = classification_metrics(y_true, probs_from_pred(y_true, 3), num_classes=3)
    assert math.isnan(m["balanced_accuracy"])
    assert m["accuracy"] == 1.0


def test_confusion_and_per_class_metrics_match_sklearn():
    from sklearn.metrics import confusion_matrix as sk_cm
    from sklearn.metrics import precision_score, recall_score

    from fedderm.metrics import confusion, per_class_metrics

    y_true = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 0])
    y_pred = np.array([0, 1, 0, 1, 2, 2, 2, 0, 2, 0])
    cm = confusion(y_true, y_pred, 4)  # class 3 never occurs: a row and a column of zeros
    assert cm.shape == (4, 4)
    assert (cm == sk_cm(y_true, y_pred, labels=[0, 1, 2, 3])).all()
    assert cm.tolist() == [[3, 1, 0, 0], [0, 1, 1, 0], [1, 0, 3, 0], [0, 0, 0, 0]]
    per = per_class_metrics(cm, ["a", "b", "c", "d"])
    assert list(per) == ["a", "b", "c", "d"]
    recall = recall_score(y_true, y_pred, labels=[0, 1, 2], average=None)
    precision = precision_score(y_true, y_pred, labels=[0, 1, 2], average=None)
    for i, name in enumerate("abc"):
        assert per[name]["recall"] == pytest.approx(recall[i])
        assert per[name]["precision"] == pytest.approx(precision[i])
    # class c: 4 true c, FP 1 (a b predicted c), TN = 10 - 4 - 1 = 5 -> 5/6; class a likewise (one c -> a)
    assert per["c"]["specificity"] == pytest.approx(5 / 6)
    assert per["a"]["specificity"] == pytest.approx(5 / 6)
    assert [per[n]["support"] for n in "abcd"] == [4, 2, 4, 0]
    assert math.isnan(per["d"]["recall"]) and math.isnan(per["d"]["precision"])
    assert per["d"]["specificity"] == 1.0


def test_class_missing_from_y_true_but_predicted():
    # num_classes = 3, class 2 never occurs in y_true but is predicted once.
    y_true = np.array([0, 0, 1, 1])
    y_prob = np.array(
        [
            [0.8, 0.1, 0.1],
            [0.3, 0.2, 0.5],  # predicted 2 (wrong)
            [0.1, 0.8, 0.1],
            [0.2, 0.7, 0.1],
        ]
    )
    # labels = {0,1} ∪ {0,1,2} = {0,1,2}; confusion matrix by hand:
    cm = np.array([[1, 0, 1], [0, 2, 0], [0, 0, 0]])
    assert (confusion_matrix(y_true, y_prob.argmax(1), labels=[0, 1, 2]) == cm).all()
    m = classification_metrics(y_true, y_prob, num_classes=3)
    # balanced accuracy over classes in y_true only: (1/2 + 1) / 2
    assert m["balanced_accuracy"] == pytest.approx(3 / 4)
    # recall over {0,1,2}: 1/2, 1, 0 (zero_division) ; precision: 1, 1, 0
    assert m["recall"] == pytest.approx(1 / 2)
    assert m["precision"] == pytest.approx(2 / 3)
    # f1: 2/3, 1, 0
    assert m["f1"] == pytest.approx(5 / 9)
    # specificity: c0 TN=2 FP=0 -> 1; c1 TN=2 FP=0 -> 1; c2 TN=3 FP=1 -> 3/4
    assert m["specificity"] == pytest.approx(11 / 12)
    assert m["accuracy"] == pytest.approx(3 / 4)
    # AUC over classes 0 and 1 only; both perfectly ranked
    assert m["auc"] == pytest.approx(1.0)


def test_class_absent_everywhere_is_not_averaged():
    # class 1 is neither in y_true nor predicted: it must not drag macro means down.
    y_true = np.array([0, 0, 2, 2])
    y_prob = probs_from_pred(np.array([0, 0, 2, 2]), 3)
    m = classification_metrics(y_true, y_prob, num_classes=3)
    for name in METRIC_NAMES:
        assert m[name] == pytest.approx(1.0), name


def test_auc_hand_computed_three_class():
    # One-vs-rest, classes present: 0 and 2 (class 1 absent from y_true).
    y_true = np.array([0, 0, 2, 2])
    y_prob = np.array([[0.6, 0.1, 0.3], [0.3, 0.3, 0.4], [0.4, 0.1, 0.5], [0.1, 0.1, 0.8]])
    # class 0: pos scores 0.6, 0.3 vs neg 0.4, 0.1 -> wins 0.6>0.4, 0.6>0.1, 0.3>0.1 = 3/4
    # class 2: pos scores 0.5, 0.8 vs neg 0.3, 0.4 -> 4/4
    m = classification_metrics(y_true, y_prob, num_classes=3)
    assert m["auc"] == pytest.approx((3 / 4 + 1) / 2)


def test_empty_input_gives_nan():
    m = classification_metrics(np.array([], dtype=int), np.zeros((0, 3)), num_classes=3)
    assert all(math.isnan(m[k]) for k in METRIC_NAMES)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        classification_metrics(np.array([0, 1]), np.zeros((2, 3)), num_classes=2)
    with pytest.raises(ValueError):
        classification_metrics(np.array([0, 1, 1]), np.zeros((2, 2)), num_classes=2)


def test_mean_over_clients_nan_and_non_metric_keys():
    per_client = {
        "0": {"balanced_accuracy": 0.5, "auc": float("nan"), "loss": 1.0, "num-examples": 10},
        "1": {"balanced_accuracy": 0.7, "auc": 0.8, "loss": 2.0, "num-examples": 30},
        "2": {"balanced_accuracy": 0.9, "auc": 0.6, "loss": 3.0, "num-examples": 5},
    }
    mean = mean_over_clients(per_client)
    assert "num-examples" not in mean
    assert mean["balanced_accuracy"] == pytest.approx((0.5 + 0.7 + 0.9) / 3)  # unweighted
    assert mean["auc"] == pytest.approx((0.8 + 0.6) / 2)  # NaN ignored
    assert mean["loss"] == pytest.approx(2.0)
    assert list(mean)[:2] == ["balanced_accuracy", "auc"]


def test_mean_over_clients_all_nan():
    mean = mean_over_clients({"0": {"auc": float("nan")}, "1": {"auc": float("nan")}})
    assert math.isnan(mean["auc"])
    assert mean_over_clients({}) == {}
