"""loko serve: every answer JSON (deep nesting, lone surrogates, an unexpected error).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import json

import pytest
from test_serve import call, fitted_checkpoint, png, running

from loko_lightning.serve import FeedbackService

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


# ================================================================ every answer JSON
@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    service = FeedbackService.open(ckpt, tmp_path_factory.mktemp("state"))
    with running(service) as url:
        yield url, service


SURROGATE = b'"\\ud800"'
ODD_BODIES = [
    ("/feedback", b"[" * 100_000 + b"]" * 100_000, "body"),
    ("/predict", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    ("/feedback", b'{"input": "%s", "label": "cat", "key": %s}' % (png(0).encode(), SURROGATE), "key"),
    ("/feedback", b'{"input": %s, "label": "cat"}' % SURROGATE, "input"),
    ("/predict", b'{"inputs": ["%s", %s]}' % (png(0).encode(), SURROGATE), "inputs[1]"),
    ("/feedback", b'{"input": "%s", "label": "cat", %s: 1}' % (png(0).encode(), SURROGATE), "body"),
]


@pytest.mark.parametrize(
    ("path", "raw", "field"), ODD_BODIES, ids=["deep", "deep-inputs", "key", "input", "inputs", "name"]
)
def test_deep_nesting_and_lone_surrogates_are_clear_400s(server, path, raw, field):
    url, service = server
    logged = service.log.count
    status, answer = call(url, path, raw=raw)
    assert (status, answer.get("field")) == (400, field), answer
    assert set(answer) == {"error", "field"} and "\n" not in answer["error"]
    assert service.log.count == logged


def test_an_unexpected_error_is_a_one_line_json_500_naming_nothing_internal(server, monkeypatch):
    url, service = server

    def crash(body):
        raise RuntimeError("secret detail at /srv/models/key.pem")

    monkeypatch.setattr(service, "predict", crash)
    status, answer = call(url, "/predict", {"inputs": [png(0)]})
    assert status == 500 and isinstance(answer, dict) and answer["field"] == "server", answer
    assert "secret" not in json.dumps(answer) and "RuntimeError" not in json.dumps(answer)
    monkeypatch.undo()
    assert call(url, "/predict", {"inputs": [png(0)]})[0] == 200
