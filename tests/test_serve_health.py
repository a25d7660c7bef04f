"""loko serve: a learner that cannot die silently (a failing save, a dead thread, a full log), and the probes.

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import errno
import os
import threading
import time

import pytest
from test_serve import call, fitted_checkpoint, label, png, running

from loko_lightning.serve import FeedbackService, Rejected
from loko_lightning.serve import log as log_module
from loko_lightning.serve.service import CHECKPOINT_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


def poll(read, until, seconds=20.0):
    """``read()`` again every 20 ms until ``until(value)``; the last value (the test asserts on it)."""
    deadline = time.monotonic() + seconds
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(0.02)
        value = read()
    return value


# ================================================================ a learner that cannot die silently
def test_a_failing_save_is_reported_retried_and_learning_goes_on(ckpt, tmp_path, capsys):
    """The disk is full while the learner saves: /health says degraded with the reason (200: it still learns), the
    save is retried, and once there is space again the checkpoint is written and the status is ok."""
    service = FeedbackService.open(ckpt, tmp_path, checkpoint_every=2)
    service.save_retry_seconds = 0.05
    save, full = service.learner.save, threading.Event()
    attempts = []

    def save_on_a_full_disk(*args, **kwargs):
        attempts.append(1)
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args, **kwargs)

    service.learner.save = save_on_a_full_disk
    full.set()
    with running(service) as url:
        for i in range(2):
            assert call(url, "/feedback", {"input": png(i), "label": label(i)})[0] == 200
        status, health = poll(lambda: call(url, "/health"), lambda got: got[1]["status"] != "ok")
        assert status == 200 and health["status"] == "degraded", health
        assert "No space left on device" in health["reason"] and "checkpoint" in health["reason"]
        assert 'loko_status{status="degraded"} 1' in call(url, "/metrics")[1]
        for i in range(2, 4):  # learning goes on
            assert call(url, "/feedback", {"input": png(i), "label": label(i)})[0] == 200
        assert poll(lambda: call(url, "/health")[1], lambda h: h["learned"] == 4)["learned"] == 4
        tries = len(attempts)
        assert poll(lambda: len(attempts), lambda n: n > tries + 1) > tries + 1  # retried while idle
        full.clear()
        health = poll(lambda: call(url, "/health")[1], lambda h: h["status"] == "ok")
        assert health["status"] == "ok" and "reason" not in health
        assert (tmp_path / CHECKPOINT_NAME).is_file()
    assert "No space left on device" in capsys.readouterr().err


def test_a_dead_learner_thread_is_failed_with_503_and_feedback_is_refused_in_json(ckpt, tmp_path):
    service = FeedbackService.open(ckpt, tmp_path)

    def broken(record):
        raise RuntimeError("a bug in the learner loop")

    service._learn = broken
    with running(service) as url:
        assert call(url, "/feedback", {"input": png(0), "label": "cat"})[0] == 200
        status, health = poll(lambda: call(url, "/health"), lambda got: got[0] != 200)
        assert status == 503 and health["status"] == "failed" and "RuntimeError" in health["reason"], health
        assert call(url, "/livez")[0] == 503 and call(url, "/readyz")[0] == 503
        assert 'loko_status{status="failed"} 1' in call(url, "/metrics")[1]
        status, answer = call(url, "/feedback", {"input": png(1), "label": "dog"})
        assert status == 503 and answer["field"] == "feedback" and "restart" in answer["error"], answer
        assert service.log.count == 1  # nothing written that cannot be learned
        assert call(url, "/predict", {"inputs": [png(0)]})[0] == 200  # predictions are still answered


def test_feedback_that_cannot_be_logged_is_a_json_503(ckpt, tmp_path):
    service = FeedbackService.open(ckpt, tmp_path)

    def append_on_a_full_disk(record):
        raise OSError(errno.ENOSPC, "No space left on device")

    with running(service) as url:
        append = service.log.append
        service.log.append = append_on_a_full_disk
        status, answer = call(url, "/feedback", {"input": png(0), "label": "cat"})
        assert status == 503 and answer["field"] == "feedback", answer
        assert "No space left on device" in answer["error"] and "state_dir" in answer["error"]
        health = call(url, "/health")[1]
        assert health["status"] == "degraded" and "log" in health["reason"], health
        assert call(url, "/readyz")[0] == 503 and call(url, "/livez")[0] == 200
        service.log.append = append
        assert call(url, "/feedback", {"input": png(0), "label": "cat"})[1]["seq"] == 1
        assert call(url, "/health")[1]["status"] == "ok" and call(url, "/readyz")[0] == 200


def test_probes_answer_and_may_be_exempted_from_the_token(ckpt, tmp_path):
    service = FeedbackService.open(ckpt, tmp_path)
    with running(service, token="s3cret") as url:
        assert call(url, "/livez")[0] == 401 and call(url, "/readyz")[0] == 401
        assert call(url, "/livez", token="s3cret") == (200, {"status": "alive"})
        assert call(url, "/readyz", token="s3cret") == (200, {"status": "ready"})
    service = FeedbackService.open(ckpt, tmp_path)
    with running(service, token="s3cret", public_probes=True) as url:
        assert call(url, "/livez") == (200, {"status": "alive"}) and call(url, "/readyz")[0] == 200
        assert call(url, "/health")[0] == 401  # the counters still need the token


def test_a_log_write_cut_by_a_full_disk_leaves_the_log_whole(ckpt, tmp_path, monkeypatch):
    """The disk fills in the middle of an append (half the line written, then ENOSPC): the answer is a 503, the
    half line is cut off, and once there is space the next feedback is record 2, the log readable to its end."""
    service = FeedbackService.open(ckpt, tmp_path)
    assert service.feedback({"input": png(0), "label": "cat"})["seq"] == 1
    size = (tmp_path / "feedback.log").stat().st_size
    full = threading.Event()

    class FullDisk:
        def __getattr__(self, name):
            return getattr(os, name)

        def write(self, fd, data):
            if not full.is_set():
                return os.write(fd, data)
            if len(data) > 10:
                return os.write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log_module, "os", FullDisk())
    full.set()
    with pytest.raises(Rejected) as info:
        service.feedback({"input": png(1), "label": "dog"})
    assert (info.value.status, info.value.field) == (503, "feedback") and "No space left" in info.value.message
    assert (tmp_path / "feedback.log").stat().st_size == size and service.status[0] == "degraded"
    full.clear()
    assert service.feedback({"input": png(1), "label": "dog"})["seq"] == 2
    assert [r["seq"] for r in service.log.records()] == [1, 2] and service.status[0] == "ok"
    service.stop()
