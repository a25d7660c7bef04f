"""loko serve --follow: read-only replicas that predict with the learner's newest checkpoint and reload it when it
changes; one learner and two followers on loopback converge to the same predictions.

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
from test_serve import ROOT, Server, assert_same_state, call, fitted_checkpoint, label, png, running

from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.serve import FeedbackService, ServingLearner
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
            assert [a["probabilities"] for a in answers] == [a["probabilities"] for a in expected], (
                [(a["version"], a["probabilities"]["cat"]) for a in answers],
                [(a["version"], a["probabilities"]["cat"]) for a in expected],
                follower,
                first,
            )
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


class Follower:
    """``loko serve --follow STATE_DIR`` in a subprocess on a free port."""

    def __init__(self, state_dir, log):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "loko_lightning.cli", "serve", "--follow", str(state_dir), "--port", "0"]
        command += ["--follow_seconds", "0.1"]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "listening on http" not in log.read_text():
            assert self.process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the follower did not start in 2 minutes"
            time.sleep(0.05)
        self.url = log.read_text().split("listening on ")[1].split()[0]


@pytest.mark.slow
def test_a_learner_killed_in_a_burst_with_two_followers_loses_nothing_and_they_converge(ckpt, tmp_path):
    """A real learner and two real followers; the learner is SIGKILLed in a burst of keyed feedback, restarted, sent
    the rest (a resent logged one is a duplicate) and stopped. Every acknowledged feedback is in the log once, the
    final state equals the log learned in order from the base checkpoint, and both followers end on that state's
    version with its predictions, bit for bit."""
    state = tmp_path / "state"
    learner = Server(ckpt, state, tmp_path / "learner-1.log")
    followers = [Follower(state, tmp_path / f"follower-{i}.log") for i in range(2)]
    acknowledged = {}

    def send(first):
        for i in range(first, 24):
            try:
                status, answer = call(learner.url, "/feedback", {"input": png(i), "label": label(i), "key": f"k{i}"})
            except (urllib.error.URLError, ConnectionError):
                return  # killed
            assert status == 200, answer
            acknowledged[i] = answer

    sender = threading.Thread(target=send, args=(0,))
    sender.start()
    deadline = time.monotonic() + 120
    while len(acknowledged) < 10:
        assert time.monotonic() < deadline and sender.is_alive()
        time.sleep(0.001)
    learner.process.send_signal(signal.SIGKILL)
    assert learner.process.wait() == -signal.SIGKILL
    sender.join()
    killed_at = len(acknowledged)
    assert 10 <= killed_at < 24
    for follower in followers:  # the followers go on predicting while the learner is down
        assert call(follower.url, "/predict", {"inputs": [png(0)]})[0] == 200
    learner = Server(ckpt, state, tmp_path / "learner-2.log")
    print(learner.log.read_text().strip().splitlines()[-1], f"(acknowledged before the kill: {killed_at})")
    send(killed_at)
    assert all(not acknowledged[i]["duplicate"] for i in range(killed_at + 1, 24))
    assert learner.wait_learned()["learned"] == 24
    learner.stop()
    assert learner.process.returncode == 0

    records = [json.loads(line) for line in (state / "feedback.log").read_text().splitlines()]
    assert [r["key"] for r in records] == [f"k{i}" for i in range(24)]  # every acknowledged one, once, in order
    for i, answer in acknowledged.items():
        assert records[answer["seq"] - 1]["key"] == f"k{i}"
    final = ServingLearner.from_checkpoint(state / "learner.ckpt")
    replay = ServingLearner.from_checkpoint(ckpt)
    replay.learn([replay.decode(r["input"]) for r in records], [r["label"] for r in records])
    assert_same_state(final.state(), replay.state())
    probe = [png(50), png(51)]
    expected = final.predict([final.decode(x) for x in probe]).tolist()
    for follower in followers:
        deadline = time.monotonic() + 60
        while (health := call(follower.url, "/health")[1])["version"] != 24:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        answers = call(follower.url, "/predict", {"inputs": probe})[1]
        assert [list(a["probabilities"].values()) for a in answers] == expected
        follower.process.send_signal(signal.SIGTERM)
        assert follower.process.wait(60) == 0
