"""loko serve --follow: read-only replicas that predict with the learner's newest checkpoint and reload it when it
changes; one learner and two followers on loopback converge to the same predictions.

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import time

import pytest
from test_serve import call, fitted_checkpoint, label, png, running

from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.serve import FeedbackService
from loko_lightning.serve.follower import FollowerService

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


def test_one_learner_and_two_followers_converge(ckpt, tmp_path):
    learner = FeedbackService.open(ckpt, tmp_path, checkpoint_every=2)
    followers = [FollowerService(tmp_path, follow_seconds=0.05) for _ in range(2)]  # base.json: version 0
    files = {p.name for p in tmp_path.iterdir()}
    probe = {"inputs": [png(7), png(8)]}
    with running(learner) as url, running(followers[0]) as first, running(followers[1]) as second:
        start = call(url, "/predict", probe)[1]
        for follower in (first, second):
            answers = call(follower, "/predict", probe)[1]
            assert [a["probabilities"] for a in answers] == [a["probabilities"] for a in start]
            assert {a["version"] for a in answers} == {0} and {a["id"] for a in answers} == {None}
        for i in range(4):
            assert call(url, "/feedback", {"input": png(i), "label": label(i)})[0] == 200
        assert learner.wait_learned(60) and learner.position == 4  # checkpoints at 2 and 4
        for follower in (first, second):
            deadline = time.monotonic() + 30
            while call(follower, "/health")[1]["version"] != 4:
                assert time.monotonic() < deadline, call(follower, "/health")[1]
                time.sleep(0.05)
        expected = call(url, "/predict", probe)[1]
        assert {a["version"] for a in expected} == {4}
        assert expected[0]["probabilities"] != start[0]["probabilities"]  # it did learn
        for follower in (first, second):
            answers = call(follower, "/predict", probe)[1]
            assert [a["probabilities"] for a in answers] == [a["probabilities"] for a in expected], ([(a["version"], a["probabilities"]["cat"]) for a in answers], [(a["version"], a["probabilities"]["cat"]) for a in expected], follower, first)
            status, answer = call(follower, "/feedback", {"input": png(0), "label": "cat"})
            assert (status, answer["field"]) == (409, "feedback") and "learner" in answer["error"]
            health = call(follower, "/health")[1]
            assert health["role"] == "follower" and health["status"] == "ok" and health["reloads"] >= 1
        assert learner.log.count == 4
    assert {p.name for p in tmp_path.iterdir()} - files <= {"learner.ckpt"}  # the followers wrote nothing


def test_a_follower_keeps_its_checkpoint_when_the_new_one_is_damaged(ckpt, tmp_path):
    learner = FeedbackService.open(ckpt, tmp_path, checkpoint_every=1)
    learner.start()
    learner.feedback({"input": png(0), "label": "cat"})
    assert learner.wait_learned(60)
    learner.stop()
    follower = FollowerService(tmp_path, follow_seconds=0.05)
    follower.start()
    assert follower.learner.version == 1
    saved = tmp_path / "learner.ckpt"
    saved.write_bytes(saved.read_bytes()[:1000])
    deadline = time.monotonic() + 30
    while follower.status[0] == "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
    status, reason = follower.status
    assert status == "degraded" and "could not be loaded" in reason and follower.learner.version == 1
    assert follower.predict({"inputs": [png(0)]})[0]["version"] == 1
    follower.stop()


def test_follow_needs_a_started_folder_and_excludes_ckpt_path(ckpt, tmp_path, capsys):
    with pytest.raises(ConfigError, match="start the learner on it first") as info:
        FollowerService(tmp_path)
    assert info.value.field == "follow"
    for args in (["--follow", str(tmp_path), "--ckpt_path", str(ckpt)], []):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", *args])
        assert exit_info.value.code == 2
        assert "--ckpt_path CKPT (a learner) or --follow STATE_DIR" in capsys.readouterr().err
