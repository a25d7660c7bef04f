"""The web layer of ``loko serve``: FastAPI routes over a :class:`~loko_lightning.serve.service.FeedbackService`.

The routes read a request's JSON (at most ``max_body_bytes``), hand it to the service in a worker thread, and write
its answer; every refusal is one JSON line ``{"error": ..., "field": ...}`` with a 4xx status. With a token, every
request needs ``Authorization: Bearer <token>``. FastAPI and uvicorn come with the ``serve`` extra.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``Request``) when it builds them.
import contextlib
import hmac
import json
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from loko_lightning.errors import ConfigError
from loko_lightning.serve.follower import FollowerService
from loko_lightning.serve.limits import MAX_BODY_BYTES
from loko_lightning.serve.service import FeedbackService, Rejected

INSTALL = 'pip install "loko-lightning[serve]"'
# A request body larger than this is refused (413) before it is read whole.
# The probes: what ``public_probes`` exempts from the token.
PROBES = ("/livez", "/readyz")
# A request nested deeper than this (lists and objects) is refused: no route reads more than 3 levels.
MAX_DEPTH = 32


def require_server() -> None:
    """Check that FastAPI and uvicorn are installed.

    Raises:
        ConfigError: one of them is missing; the message names the extra to install.
    """
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConfigError(f"loko serve needs {' and '.join(missing)}: {INSTALL}", field=None)


def create_app(
    service: FeedbackService | FollowerService,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_ready: Callable[[], None] | None = None,
    public_probes: bool = False,
) -> Any:
    """The FastAPI app: ``POST /predict``, ``/feedback``; ``GET /health``, ``/metrics``, ``/livez``, ``/readyz``.

    Its lifespan starts the service's learner thread (then calls ``on_ready``) and, at shutdown, lets it learn what
    is queued and save a checkpoint.

    Args:
        service: what answers the requests (a learner, or a read-only follower of one).
        token: the bearer token every request must carry; ``None``: no authentication (loopback binds only).
        max_body_bytes: a larger request body is refused with 413.
        on_ready: called once the learner thread runs.
        public_probes: ``/livez`` and ``/readyz`` answer without the token (they say nothing but a status).
    """
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}", field="max_body_bytes")
    require_server()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        service.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await run_in_threadpool(service.stop)

    app = FastAPI(title="loko serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def refusal(status: int, field: str, message: str, headers: dict[str, str] | None = None) -> Any:
        return JSONResponse({"error": " ".join(message.split()), "field": field}, status_code=status, headers=headers)

    @app.exception_handler(Rejected)
    async def rejected(request: Request, err: Rejected) -> Any:
        return refusal(err.status, err.field, err.message, {"Retry-After": "1"} if err.status in (429, 503) else None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> Any:
        # A bug, not the client's doing: one JSON line that names nothing internal; the traceback goes to the log.
        print(f"loko serve: {request.method} {request.url.path} failed:", file=sys.stderr)
        traceback.print_exception(err, file=sys.stderr)
        return refusal(500, "server", "the server failed on this request (its log has the details): retry, or report")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Any:
        return refusal(err.status_code, "path", f"{request.method} {request.url.path}: {err.detail}")

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if token is not None and not (public_probes and request.url.path in PROBES):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                return refusal(
                    401,
                    "authorization",
                    "this server needs the header Authorization: Bearer <token>",
                    {"WWW-Authenticate": 'Bearer realm="loko serve"'},
                )
        return await call_next(request)

    async def read_json(request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise Rejected(413, "body", f"the payload is {length} bytes; at most {max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise Rejected(413, "body", f"the payload is over {max_body_bytes} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
        if not data.strip():
            raise Rejected(400, "body", "the payload is empty: send a JSON object")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise Rejected(400, "body", f"malformed JSON ({err})") from None
        except RecursionError:
            raise Rejected(400, "body", f"the JSON is nested too deeply: at most {MAX_DEPTH} levels") from None
        if not isinstance(body, dict):
            raise Rejected(400, "body", f"the payload must be a JSON object, got a {type(body).__name__}")
        check_values(body)
        return body

    @app.post("/predict")
    async def predict(request: Request) -> Any:
        return JSONResponse(await run_in_threadpool(service.predict, await read_json(request)))

    @app.post("/feedback")
    async def feedback(request: Request) -> Any:
        return JSONResponse(await run_in_threadpool(service.feedback, await read_json(request)))

    @app.get("/health")
    async def health() -> Any:
        answer = service.health()
        return JSONResponse(answer, status_code=503 if answer["status"] == "failed" else 200)

    @app.get("/livez")
    async def livez() -> Any:
        if service.alive:
            return JSONResponse({"status": "alive"})
        return JSONResponse({"status": "failed", "reason": service.status[1]}, status_code=503)

    @app.get("/readyz")
    async def readyz() -> Any:
        ready, reason = service.ready
        if ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(service.metrics(), media_type="text/plain; version=0.0.4")

    return app


def check_values(body: dict[str, Any]) -> None:
    r"""Refuse JSON that parses but cannot be a request.

    That is, nested deeper than :data:`MAX_DEPTH`, or a string (a name or a value) with a lone surrogate (``"\ud800"``:
    not Unicode, it can be neither logged nor tokenized).

    Raises:
        Rejected: (400) the field it is in (``body`` for a name).
    """
    stack: list[tuple[str, Any, int]] = []
    for name, value in body.items():
        if not _is_unicode(name):
            raise Rejected(400, "body", "a field name holds a lone surrogate (like \\ud800): send valid Unicode")
        stack.append((name, value, 1))
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                raise Rejected(400, path, f"{path} holds a lone surrogate (like \\ud800): send valid Unicode text")
            continue
        if depth > MAX_DEPTH and isinstance(value, (list, dict)):
            raise Rejected(400, "body", f"the JSON is nested too deeply: at most {MAX_DEPTH} levels")
        if isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for name, item in value.items():
                if not _is_unicode(name):
                    raise Rejected(400, path, f"{path} has a name with a lone surrogate: send valid Unicode")
                stack.append((f"{path}.{name}", item, depth + 1))


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
