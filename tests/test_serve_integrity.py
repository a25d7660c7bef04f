"""loko serve's state folder knows what it belongs to: the base checkpoint (by hash), each log record (by checksum),
and a damaged serving checkpoint is answered with the fix that works (remove it: the log is learned again, exactly).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import json

import pytest
import torch
from test_serve import assert_same_state, fitted_checkpoint, label, png

from loko_lightning.errors import ConfigError
from loko_lightning.serve import FeedbackLog, FeedbackService
from loko_lightning.serve.service import CHECKPOINT_NAME, LOG_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


def learned(ckpt, state_dir, n, **options):
    """A service on ``state_dir`` that learned ``n`` feedbacks and stopped (its checkpoint saved)."""
    service = FeedbackService.open(ckpt, state_dir, **options)
    service.start()
    for i in range(n):
        service.feedback({"input": png(i), "label": label(i)})
    assert service.wait_learned(60)
    state = service.learner.state()
    service.stop()
    return state


def test_a_state_folder_refuses_another_base_checkpoint(ckpt, tmp_path):
    learned(ckpt, tmp_path / "state", 2)
    other = torch.load(ckpt, weights_only=False)
    other["state_dict"] = {k: v + 1 if v.is_floating_point() else v for k, v in other["state_dict"].items()}
    torch.save(other, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError, match="was started from another checkpoint") as info:
        FeedbackService.open(tmp_path / "other.ckpt", tmp_path / "state")
    assert info.value.field == "ckpt_path" and "another --state_dir" in str(info.value)
    service = FeedbackService.open(ckpt, tmp_path / "state")  # its own base still opens it
    assert service.position == 2
    service.stop()


def test_a_log_record_changed_after_it_was_written_is_refused_naming_its_line(ckpt, tmp_path):
    learned(ckpt, tmp_path, 3)
    path = tmp_path / LOG_NAME
    lines = path.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    lines[1] = lines[1].replace(b'"label":%d' % record["label"], b'"label":%d' % ((record["label"] + 1) % 4))
    assert lines[1] != json.dumps(record).encode()  # still valid JSON, seq 2, another label
    path.write_bytes(b"".join(lines))
    with pytest.raises(ConfigError, match=r"damaged at line 2 \(its checksum does not match") as info:
        FeedbackLog(path)
    assert info.value.field == "state_dir" and all(b'"crc":' in line for line in lines)


def test_a_damaged_serving_checkpoint_names_the_fix_that_works(ckpt, tmp_path):
    """Cut in half, learner.ckpt is refused with the advice to remove it; removed, the whole log is learned again
    from the base checkpoint, and the state is the one that was saved, bit for bit."""
    state = learned(ckpt, tmp_path, 4, checkpoint_every=2)
    saved = tmp_path / CHECKPOINT_NAME
    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    with pytest.raises(ConfigError) as info:
        FeedbackService.open(ckpt, tmp_path)
    message = str(info.value)
    assert info.value.field == "state_dir" and str(saved) in message and "remove it" in message, message
    saved.unlink()
    service = FeedbackService.open(ckpt, tmp_path)
    assert service.replayed == 4
    assert_same_state(state, service.learner.state())
    service.stop()
