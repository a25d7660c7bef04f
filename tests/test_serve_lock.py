"""loko serve: one owner per state folder (an flock held for the server's life, its pid named to a second).

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import os
import signal
import subprocess
import sys

import pytest
from test_serve import ROOT, fitted_checkpoint, png

from loko_lightning.cli import main
from loko_lightning.errors import ConfigError
from loko_lightning.serve import FeedbackService

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


# ================================================================ one owner per state folder
def test_a_second_server_on_one_state_folder_is_refused_naming_the_holder(ckpt, tmp_path, capsys):
    first = FeedbackService.open(ckpt, tmp_path)
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()}\b") as info:
        FeedbackService.open(ckpt, tmp_path)
    assert info.value.field == "state_dir"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--ckpt_path", str(ckpt), "--state_dir", str(tmp_path), "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loko: error: --state_dir: ") and f"pid {os.getpid()}" in err[0], err
    assert first.feedback({"input": png(0), "label": "cat"})["seq"] == 1  # the owner goes on
    first.stop()
    second = FeedbackService.open(ckpt, tmp_path)  # stopped: the folder is free again
    assert second.log.count == 1
    second.stop()


def test_a_lock_left_by_a_killed_process_does_not_block_a_restart(ckpt, tmp_path):
    """A process holding the folder (its pid in the lock file) is named while it lives; SIGKILLed, the kernel frees
    its lock and the next server opens the folder, though the lock file (with the dead pid) is still there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (
        "import sys, time; from loko_lightning.serve.lock import StateLock; StateLock(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by pid {holder.pid}\b"):
            FeedbackService.open(ckpt, tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
    locks = [p for p in tmp_path.iterdir() if "lock" in p.name]
    assert locks and str(holder.pid) in locks[0].read_text()  # stale: the dead holder's pid is still written
    service = FeedbackService.open(ckpt, tmp_path)
    assert str(os.getpid()) in locks[0].read_text()
    service.stop()
