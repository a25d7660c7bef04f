import pytest
import torch

from loko_lightning.learner.metrics import MovingAverage, OnlineAccuracy


def test_online_accuracy_top_k_and_weights_on_a_known_stream():
    predictions = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]])
    labels = torch.tensor([1, 2, 1, 0])
    weights = [1.0, 1.0, 1.0, 0.0]  # the last sample was skipped: it must not count
    top1, top2, top5 = OnlineAccuracy(top_k=1), OnlineAccuracy(top_k=2), OnlineAccuracy(top_k=5)
    for prediction, label, weight in zip(predictions, labels, weights, strict=True):
        for metric in (top1, top2, top5):
            metric.update(prediction, label, weight)
    assert top1.compute().item() == pytest.approx(1 / 3)  # only the first is right
    assert top2.compute().item() == pytest.approx(2 / 3)  # the third's label is second
    assert top5.compute().item() == 1.0  # top_k above m = 3 is capped at m: every label is among the top 3
    assert top1.weight.item() == top5.weight.item() == 3  # the skipped sample has no weight


def test_online_accuracy_resumes_exactly_from_its_state_dict():
    metric = OnlineAccuracy()
    for label in (0, 1, 1):
        metric.update(torch.tensor([0.6, 0.4]), torch.tensor(label))
    resumed = OnlineAccuracy()
    resumed.load_state_dict(metric.state_dict())
    for m in (metric, resumed):
        m.update(torch.tensor([0.2, 0.8]), torch.tensor(1))
    assert torch.equal(metric.compute(), resumed.compute()) and metric.compute().item() == 0.5


def test_moving_average_keeps_the_last_window_and_resumes():
    metric = MovingAverage(window=3)
    for value in (1.0, 2.0, 3.0, 10.0):
        metric.update(torch.tensor(value))
    metric.update(torch.tensor(100.0), keep=torch.tensor(False))  # a skipped value leaves the window alone
    assert metric.compute().item() == pytest.approx(5.0)
    resumed = MovingAverage(window=3)
    resumed.load_state_dict(metric.state_dict())
    assert torch.equal(resumed.compute(), metric.compute())


@pytest.mark.parametrize("top_k", [0, -1, 1.5])
def test_online_accuracy_rejects_a_bad_top_k(top_k):
    with pytest.raises(ValueError, match="Invalid top_k"):
        OnlineAccuracy(top_k=top_k)
