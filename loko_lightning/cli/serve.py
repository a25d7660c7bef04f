"""``loko serve``: a checkpoint served over HTTP that keeps learning from the labels it is sent.

The options are read here; the service is :mod:`loko_lightning.serve` (FastAPI and uvicorn from the ``serve``
extra).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import signal
import socket
import stat
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.serve.limits import MAX_BODY_BYTES, MAX_PIXELS, PENDING_BYTES, QUEUE_BYTES


def serve_main(args: list[str]) -> None:
    """``loko serve --ckpt_path CKPT``: predict, take feedback, learn it; see ``loko serve --help``."""
    parser = argparse.ArgumentParser(
        prog="loko serve",
        description=(
            "Serve a loko fit checkpoint: POST /predict answers class probabilities and an id per input; "
            "POST /feedback takes a label for an id (or an input with its label), writes it to the feedback log on "
            "disk before answering, and one learner thread learns it (one LoKO step per sample, in order). "
            "GET /health, GET /metrics (Prometheus). A restart continues from the state folder's checkpoint and log. "
            "--follow STATE_DIR serves a read-only replica that predicts with that learner's newest checkpoint."
        ),
        exit_on_error=False,
    )
    parser.add_argument("--ckpt_path", help="a checkpoint written by loko fit (a LoKO run); required unless --follow")
    parser.add_argument(
        "--follow",
        metavar="STATE_DIR",
        help="predict only, with the newest checkpoint of the learner serving STATE_DIR, reloaded when it changes "
        "(read-only: no feedback, no lock, nothing written)",
    )
    parser.add_argument(
        "--follow_seconds", type=float, default=1.0, help="with --follow: how often to look for a new checkpoint"
    )
    parser.add_argument(
        "--state_dir",
        help="folder of the feedback log and the serving checkpoint (default: serve/ beside the checkpoint); "
        "a restart with the same folder continues where the server stopped",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    parser.add_argument(
        "--token-file",
        "--token_file",
        dest="token_file",
        help="file holding the bearer token every request must carry; required for a non-loopback --host",
    )
    parser.add_argument("--queue_size", type=int, default=1000, help="feedback waiting to be learned, at most (429)")
    parser.add_argument("--checkpoint_every", type=int, default=100, help="save the learner every N learned samples")
    parser.add_argument("--max_batch", type=int, default=32, help="inputs per /predict request, at most")
    parser.add_argument("--max_body_bytes", type=int, default=MAX_BODY_BYTES, help="request size, at most (413)")
    parser.add_argument("--pending_size", type=int, default=10000, help="predictions kept for a later label")
    parser.add_argument("--pending_seconds", type=float, default=3600.0, help="how long a prediction is kept")
    parser.add_argument(
        "--pending_bytes",
        type=int,
        default=PENDING_BYTES,
        help="bytes of kept predictions' inputs, at most (the oldest forgotten first; default 256 MiB)",
    )
    parser.add_argument(
        "--queue_bytes",
        type=int,
        default=QUEUE_BYTES,
        help="bytes of queued feedback's inputs, at most (429 beyond; default 256 MiB)",
    )
    parser.add_argument(
        "--max_pixels",
        type=int,
        default=MAX_PIXELS,
        help=f"an input image's width x height, at most, checked before decoding (413 beyond; default {MAX_PIXELS})",
    )
    parser.add_argument(
        "--predict_batch",
        type=int,
        default=64,
        help="inputs in one forward pass, at most: concurrent /predict requests are predicted together (default 64)",
    )
    parser.add_argument(
        "--public_probes",
        action="store_true",
        help="GET /livez and /readyz answer without the token (for a load balancer's or orchestrator's probes)",
    )
    try:
        options = parser.parse_args(args)
    except ArgumentError as err:
        raise ValueError(f"{err.message}. See `loko serve --help`.") from None
    check_options(options)
    token = read_token(options.token_file)
    check_bind(options.host, token)
    # The server's modules import torch (seconds): only once the options are known to be good.
    from loko_lightning.serve.app import require_server
    from loko_lightning.serve.follower import FollowerService
    from loko_lightning.serve.service import FeedbackService

    require_server()

    if options.follow is not None:
        service: Any = FollowerService(
            options.follow,
            max_batch=options.max_batch,
            max_pixels=options.max_pixels,
            predict_batch=options.predict_batch,
            follow_seconds=options.follow_seconds,
        )
        run(service, options, token, f"following {options.follow}, version {service.learner.version}")
        return
    state_dir = options.state_dir or str(Path(options.ckpt_path).expanduser().parent / "serve")
    service = FeedbackService.open(
        options.ckpt_path,
        state_dir,
        queue_size=options.queue_size,
        checkpoint_every=options.checkpoint_every,
        max_batch=options.max_batch,
        pending_size=options.pending_size,
        pending_seconds=options.pending_seconds,
        pending_bytes=options.pending_bytes,
        queue_bytes=options.queue_bytes,
        max_pixels=options.max_pixels,
        predict_batch=options.predict_batch,
    )
    replayed = f", {service.replayed} replayed from the log" if service.replayed else ""
    run(service, options, token, f"{service.position} feedback learned{replayed}; state in {state_dir}")


def run(service: Any, options: argparse.Namespace, token: str | None, what: str) -> None:
    """Serve ``service`` over HTTP until SIGTERM or Ctrl-C; exit status 1 if its learner failed."""
    import uvicorn

    from loko_lightning.serve.app import create_app

    sock = bound_socket(options.host, options.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def ready() -> None:
        print(f"loko serve: listening on {url} ({what})", flush=True)

    app = create_app(
        service,
        token=token,
        max_body_bytes=options.max_body_bytes,
        on_ready=ready,
        public_probes=options.public_probes,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            if sig == signal.SIGTERM:  # the drain is the answer to it: exit 0, not the signal raised again (143)
                self._captured_signals.remove(sig)

    Server(config).run(sockets=[sock])
    status, reason = service.status
    if status == "failed":
        print(f"loko serve: stopped with the learner failed: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1)


POSITIVE = (
    "queue_size",
    "checkpoint_every",
    "max_batch",
    "max_body_bytes",
    "pending_size",
    "pending_bytes",
    "queue_bytes",
    "max_pixels",
    "predict_batch",
)


def check_options(options: argparse.Namespace) -> None:
    """Refuse a port outside 0-65535 and a limit that is not positive, before anything is loaded.

    Raises:
        ConfigError: (the option's field) the value and what to give instead.
    """
    if (options.ckpt_path is None) == (options.follow is None):
        raise ConfigError(
            "give --ckpt_path CKPT (a learner) or --follow STATE_DIR (a read-only replica of one), not both",
            field="ckpt_path" if options.ckpt_path is None else "follow",
        )
    if not 0 <= options.port <= 65535:
        raise ConfigError(f"port {options.port} is not a TCP port: give 0 to 65535 (0: any free port)", field="port")
    for name in POSITIVE:
        value = getattr(options, name)
        if value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}", field=name)
    if not 0 < options.pending_seconds < math.inf:
        raise ConfigError(
            f"pending_seconds must be positive and finite, got {options.pending_seconds}", field="pending_seconds"
        )


def read_token(path: str | None) -> str | None:
    """The bearer token in ``path`` (surrounding whitespace removed), or ``None`` without a file.

    Raises:
        ConfigError: (field ``token-file``) no such file, or an empty one.
    """
    if path is None:
        return None
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"cannot read the token file {path!r} ({err.__class__.__name__})", field="token-file"
        ) from None
    if not token:
        raise ConfigError(f"the token file {path!r} is empty", field="token-file")
    mode = Path(path).expanduser().stat().st_mode
    if mode & stat.S_IROTH:
        print(
            f"loko serve: warning: the token file {path!r} is readable by every user (mode {stat.filemode(mode)}): "
            f"chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )
    return token


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback ``host`` without a token: feedback changes the model, so only its owner may send it.

    Raises:
        ConfigError: (field ``host``) a non-loopback address and no token.
    """
    if token is not None or is_loopback(host):
        return
    raise ConfigError(
        f"host {host!r} is reachable from other machines, and feedback changes the model: give --token-file "
        "(every request then needs Authorization: Bearer <token>), or bind 127.0.0.1",
        field="host",
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, read back from the socket).

    Raises:
        ConfigError: (field ``port``) the address cannot be bound (in use, not this machine's).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror or err})", field="port") from None
    sock.set_inheritable(True)
    return sock
