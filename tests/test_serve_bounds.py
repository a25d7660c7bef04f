"""loko serve: bounds in pixels and bytes (huge images, kept predictions, the queue).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import base64
import io
import time

import pytest
from PIL import Image
from test_serve import fitted_checkpoint, png

from loko_lightning.serve import FeedbackService, Rejected

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


def encoded(picture, kind="PNG", **options):
    buffer = io.BytesIO()
    picture.save(buffer, kind, **options)
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_huge_image_is_refused_before_it_is_decoded(ckpt, tmp_path):
    """A 1-bit 13000x13000 PNG is a few KB on the wire and 169 Mpx decoded: refused from its header, fast."""
    huge = encoded(Image.new("1", (13000, 13000)))
    assert len(huge) < 100_000
    service = FeedbackService.open(ckpt, tmp_path, max_pixels=4096 * 4096)
    start = time.perf_counter()
    with pytest.raises(Rejected) as info:
        service.predict({"inputs": [png(0), huge]})
    assert time.perf_counter() - start < 0.5
    assert (info.value.status, info.value.field) == (413, "inputs[1]") and "--max_pixels" in info.value.message
    with pytest.raises(Rejected) as info:
        service.feedback({"input": huge, "label": "cat"})
    assert (info.value.status, info.value.field) == (413, "input") and service.log.count == 0
    small = FeedbackService.open(ckpt, tmp_path / "small", max_pixels=31 * 31)  # a 32x32 image is over it
    with pytest.raises(Rejected) as info:
        small.predict({"inputs": [png(0)]})
    assert info.value.status == 413
    service.stop()
    small.stop()


def test_pending_predictions_and_the_queue_are_bounded_in_bytes(ckpt, tmp_path):
    """Kept predictions: the oldest forgotten once their inputs pass ``pending_bytes``; the queue refuses (429)
    feedback whose input would pass ``queue_bytes``, before anything is written."""
    one = len(png(0))
    service = FeedbackService.open(ckpt, tmp_path, pending_bytes=int(2.5 * one), queue_bytes=int(1.5 * one))
    answers = service.predict({"inputs": [png(i) for i in range(4)]})
    assert service.pending_bytes_used <= 2.5 * one
    with pytest.raises(Rejected) as info:
        service.feedback({"id": answers[0]["id"], "label": "cat"})
    assert info.value.status == 404
    assert service.feedback({"id": answers[3]["id"], "label": "fox"})["seq"] == 1  # held: the learner is not started
    with pytest.raises(Rejected) as info:
        service.feedback({"id": answers[2]["id"], "label": "owl"})
    assert (info.value.status, info.value.field) == (429, "feedback") and "queue_bytes" in info.value.message
    assert service.log.count == 1
    service.start()
    assert service.wait_learned(60) and service.queue_bytes_used == 0
    assert service.feedback({"id": answers[2]["id"], "label": "owl"})["seq"] == 2
    service.stop()


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped(ckpt, tmp_path):
    """A 16-bit greyscale PNG of mid grey (32768 of 65535) is mid grey (128 of 255), not white; its prediction is
    the 8-bit PNG's."""
    service = FeedbackService.open(ckpt, tmp_path)
    wide = Image.new("I;16", (32, 32))
    wide.putdata([32768 + 64 * (i % 32) for i in range(32 * 32)])
    narrow = Image.new("L", (32, 32))
    narrow.putdata([(32768 + 64 * (i % 32)) * 255 // 65535 for i in range(32 * 32)])
    decoded = service.learner.decode(encoded(wide))
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (127, 127, 127)
    assert abs(decoded.getpixel((31, 0))[0] - narrow.getpixel((31, 0))) <= 1
    (a,), (b,) = (service.predict({"inputs": [encoded(x)]}) for x in (wide, narrow))
    assert max(abs(a["probabilities"][c] - b["probabilities"][c]) for c in a["probabilities"]) < 0.02
    service.stop()
