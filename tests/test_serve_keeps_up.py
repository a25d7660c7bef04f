"""loko serve's learner keeps up while predictions run: a step does not wait for a prediction in progress (the
parameters are published to a spare copy and swapped in), and concurrent requests are predicted in one pass.

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import threading
import time

import pytest
import torch
from test_serve import fitted_checkpoint, image, label, png

from loko_lightning.serve import FeedbackService, ServingLearner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


def test_a_step_does_not_wait_for_a_prediction_in_progress(ckpt):
    """A prediction held inside its forward pass: a step is learned and published meanwhile (into the other copy);
    the held prediction then answers with the version it started from, bit for bit that version's probabilities."""
    learner = ServingLearner.from_checkpoint(ckpt)
    probe = image(9)
    before = learner.predict([probe])
    inside, release = threading.Event(), threading.Event()
    held = {}
    for copy in getattr(learner, "_copies", [learner._serving]):
        forward = copy.predict_step

        def held_step(*args, forward=forward, **kwargs):
            if threading.current_thread().name == "held":
                inside.set()
                assert release.wait(60)
            return forward(*args, **kwargs)

        copy.predict_step = held_step
    predictor = threading.Thread(target=lambda: held.setdefault("answer", learner.predict_with_version([probe])))
    predictor.name = "held"
    predictor.start()
    assert inside.wait(60)
    stepper = threading.Thread(target=lambda: learner.learn([image(0)], [label(0)]))
    stepper.start()
    stepper.join(30)
    learned_meanwhile = not stepper.is_alive()
    release.set()
    predictor.join(60)
    stepper.join(60)
    assert learned_meanwhile, "the step waited for the prediction in progress"
    assert learner.version == 1
    probabilities, version = held["answer"]
    assert version == 0 and torch.equal(probabilities, before)
    assert not torch.equal(learner.predict([probe]), before)  # the new version is served


def test_concurrent_requests_are_predicted_in_one_pass(ckpt, tmp_path):
    """Five requests that arrive while a pass runs are the next pass, together; each gets its own rows, equal to a
    prediction of its inputs alone (to float rounding)."""
    service = FeedbackService.open(ckpt, tmp_path)
    calls, inside, release = [], threading.Event(), threading.Event()
    predict = service.learner.predict_with_version

    def counted(inputs):
        calls.append(len(inputs))
        if len(calls) == 1:
            inside.set()
            assert release.wait(60)
        return predict(inputs)

    service.learner.predict_with_version = counted
    answers = {}

    def client(i):
        answers[i] = service.predict({"inputs": [png(i)] * (1 + i % 2)})

    first = threading.Thread(target=client, args=(0,))
    first.start()
    assert inside.wait(60)
    others = [threading.Thread(target=client, args=(i,)) for i in range(1, 6)]
    for thread in others:
        thread.start()
    deadline = time.monotonic() + 10
    while getattr(getattr(service, "_batcher", None), "waiting", len(calls) - 1) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for thread in [first, *others]:
        thread.join(60)
    assert calls == [1, 2 + 1 + 2 + 1 + 2], calls  # the first alone, then the five together
    for i in range(6):
        (alone,) = service.predict({"inputs": [png(i)]})
        assert len(answers[i]) == 1 + i % 2
        for got in answers[i]:
            assert got["version"] == 0 and got["label"] == alone["label"]
            for name, p in alone["probabilities"].items():
                assert abs(got["probabilities"][name] - p) < 1e-5
    service.stop()
