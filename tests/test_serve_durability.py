"""loko serve's durability promises, seen directly: the feedback is fsynced before it is answered (the calls are
recorded), and a resent ``key`` is a duplicate at accept, sequentially and while the first is still being written
(held there, not raced).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import os
import threading

import pytest
from test_serve import call, fitted_checkpoint, label, png, running

from loko_lightning.serve import FeedbackService
from loko_lightning.serve import log as log_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


class RecordingOs:
    """``os`` for the log module, with its writes and fsyncs recorded in ``events`` (then done for real)."""

    def __init__(self, events):
        self.events = events

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        self.events.append(("write", fd))
        return os.write(fd, data)

    def fsync(self, fd):
        self.events.append(("fsync", fd))
        return os.fsync(fd)


def test_every_feedback_is_fsynced_before_it_is_answered(ckpt, tmp_path, monkeypatch):
    events = []
    service = FeedbackService.open(ckpt, tmp_path)
    monkeypatch.setattr(log_module, "os", RecordingOs(events))
    with running(service) as url:
        fd = service.log._fd
        answers = call(url, "/predict", {"inputs": [png(0), png(1)]})[1]
        requests = [{"id": answers[0]["id"], "label": "cat"}, {"input": png(2), "label": "owl", "key": "k"}]
        requests.append({"id": answers[1]["id"], "label": "dog"})
        for body in requests:
            start = len(events)
            status, answer = call(url, "/feedback", body)
            assert status == 200 and not answer["duplicate"]
            mine = [event for event in events[start:] if event[1] == fd]  # the server's, before this answer came
            assert mine and mine[0][0] == "write" and mine[-1][0] == "fsync", mine
            events.append(("answered", answer["seq"]))
    assert service.log.count == 3


def test_a_resent_key_is_a_duplicate_at_accept(ckpt, tmp_path):
    """Sent again after its answer, and sent again while the first is held inside the log's append: both times
    the first one's seq with ``duplicate``, and the log holds it once."""
    service = FeedbackService.open(ckpt, tmp_path)
    first = service.feedback({"input": png(0), "label": "cat", "key": "k0"})
    assert first == {"seq": 1, "duplicate": False}
    assert service.feedback({"input": png(0), "label": "cat", "key": "k0"}) == {"seq": 1, "duplicate": True}
    assert service.feedback({"input": png(1), "label": "cat", "key": "k0"})["duplicate"]  # the key decides

    append, inside, release = service.log.append, threading.Event(), threading.Event()

    def held_append(record):
        seq = append(record)  # on disk, not answered yet
        inside.set()
        assert release.wait(60)
        return seq

    service.log.append = held_append
    answers = {}
    body = {"input": png(2), "label": label(2), "key": "k2"}
    writer = threading.Thread(target=lambda: answers.setdefault("first", service.feedback(body)))
    writer.start()
    assert inside.wait(60)
    service.log.append = append
    resender = threading.Thread(target=lambda: answers.setdefault("resent", service.feedback(body)))
    resender.start()
    resender.join(0.3)  # it waits for the first to be answered: one appender at a time
    release.set()
    writer.join(60)
    resender.join(60)
    assert answers == {"first": {"seq": 2, "duplicate": False}, "resent": {"seq": 2, "duplicate": True}}
    assert service.log.count == 2 and [r["key"] for r in service.log.records()] == ["k0", "k2"]
    service.start()
    assert service.wait_learned(60) and service.learner.learned == 2
    service.stop()
