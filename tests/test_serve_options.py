"""loko serve's small edges: ports and limits refused in one line, 401 with ``WWW-Authenticate``, a warning for a
token file every user can read, and exit status 0 after a SIGTERM drain.

The checkpoint is the tiny one of ``test_serve`` (timm's ``test_resnet``, rank-2 LoRA, 4 classes, 32 px)."""

import signal
import urllib.error
import urllib.request

import pytest
import torch
from test_serve import Server, call, fitted_checkpoint, label, png, running

from loko_lightning.cli import main
from loko_lightning.cli.serve import read_token
from loko_lightning.serve import FeedbackService
from loko_lightning.serve.service import CHECKPOINT_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The paper's LoKO, 3 steps (``test_serve.fitted_checkpoint``)."""
    return fitted_checkpoint(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--port", "70000"], "--port: port 70000 is not a TCP port"),
        (["--port", "-1"], "--port: port -1 is not a TCP port"),
        (["--max_body_bytes", "-1"], "--max_body_bytes: max_body_bytes must be a positive integer, got -1"),
        (["--queue_bytes", "0"], "--queue_bytes: queue_bytes must be a positive integer, got 0"),
        (["--max_pixels", "0"], "--max_pixels: max_pixels must be a positive integer, got 0"),
        (["--pending_seconds", "inf"], "--pending_seconds: pending_seconds must be positive and finite"),
    ],
)
def test_bad_ports_and_limits_are_refused_in_one_line(ckpt, tmp_path, capsys, flags, start):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--ckpt_path", str(ckpt), "--state_dir", str(tmp_path), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"loko: error: {start}"), err
    assert not (tmp_path / "lock").exists()  # refused before the state folder is touched


def test_401_names_the_scheme(ckpt, tmp_path):
    service = FeedbackService.open(ckpt, tmp_path)
    with running(service, token="s3cret") as url:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_token_file_every_user_can_read_is_warned_about(tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    assert read_token(str(path)) == "s3cret"
    assert f"the token file {str(path)!r} is readable by every user" in capsys.readouterr().err
    path.chmod(0o600)
    assert read_token(str(path)) == "s3cret" and capsys.readouterr().err == ""


@pytest.mark.slow
def test_sigterm_drains_saves_and_exits_0(ckpt, tmp_path):
    server = Server(ckpt, tmp_path / "state", tmp_path / "server.log")
    for i in range(3):
        assert call(server.url, "/feedback", {"input": png(i), "label": label(i)})[0] == 200
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(120) == 0, server.log.read_text()[-2000:]
    saved = torch.load(tmp_path / "state" / CHECKPOINT_NAME, weights_only=True)
    assert saved["serve"]["log_position"] == 3  # everything acknowledged was learned before the exit


@pytest.mark.parametrize("args", [["serve", "--help"], ["serve", "--ckpt_path", "x.ckpt", "--port", "70000"]])
def test_serve_help_and_refusals_import_no_torch(args):
    """`loko serve --help` and a refused option answer before torch is imported (it cost 8 s of every answer)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from loko_lightning.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as stop:\n    code = stop.code\n"
        "print('torch' in sys.modules, 'lightning' in sys.modules, code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split()[-3:] == ["False", "False", "0" if "--help" in args else "2"], done.stdout + done.stderr
