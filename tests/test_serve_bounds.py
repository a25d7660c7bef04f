"""loko serve: bounds in pixels and bytes (huge images, kept predictions, the queue).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import base64
import io
import time

import pytest
import torch
from PIL import Image
from test_serve import fitted_checkpoint, png

from loko_lightning.serve import FeedbackLog, FeedbackService, Rejected

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


def test_a_large_image_is_kept_as_its_preprocessed_tensor_and_learned_exactly(ckpt, tmp_path):
    """A 256x256 noisy PNG (hundreds of KB in base64) for a 32 px model is kept as its 12 KB tensor; labelled by id,
    it is logged as that tensor and learned bit for bit as the image itself would be, also when the log is replayed."""
    from test_serve import assert_same_state

    from loko_lightning.serve import ServingLearner

    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (256, 256, 3), generator=generator, dtype=torch.uint8)
    big = Image.fromarray(pixels.numpy())
    sent = encoded(big)
    service = FeedbackService.open(ckpt, tmp_path / "state")
    (answer,) = service.predict({"inputs": [sent]})
    assert len(sent) > 100_000 and service.pending_bytes_used == 3 * 32 * 32 * 4
    small = png(1)  # a 32x32 PNG is smaller than its tensor: kept as sent
    (other,) = service.predict({"inputs": [small]})
    assert service.pending_bytes_used == 3 * 32 * 32 * 4 + len(small)
    service.start()
    service.feedback({"id": answer["id"], "label": "owl"})
    service.feedback({"id": other["id"], "label": "dog"})
    assert service.wait_learned(60)
    state = service.learner.state()
    service.stop()
    records = list(FeedbackLog(tmp_path / "state" / "feedback.log").records())
    assert set(records[0]["input"]) == {"tensor", "shape", "dtype"} and records[1]["input"] == small

    reference = ServingLearner.from_checkpoint(ckpt)
    reference.learn([big, reference.decode(small)], ["owl", "dog"])
    assert_same_state(state, reference.state())
    (tmp_path / "state" / "learner.ckpt").unlink()  # the whole log learned again, the tensor from the log
    replayed = FeedbackService.open(ckpt, tmp_path / "state")
    assert replayed.replayed == 2
    assert_same_state(state, replayed.learner.state())
    replayed.stop()
