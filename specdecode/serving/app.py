"""The OpenAI-compatible HTTP server: FastAPI routes over a `ContinuousEngine`, SSE streaming, /metrics, and
a live page at / that colors each streamed token by the draft position it was accepted at.

The engine runs in its own thread; its callbacks hand text and results to the event loop with
`call_soon_threadsafe`, so a slow client never stalls a step. A stream whose client goes away is cancelled
(its `finally` cancels the engine requests, which free their slots before the next step). On SIGTERM uvicorn
stops accepting connections and lets the open ones finish; then the lifespan drains the engine and the
process exits 0.
"""

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdecode.engine.continuous import ContinuousEngine, RequestHandle
from specdecode.engine.decode import Completion
from specdecode.errors import SpecDecodeError
from specdecode.serving.protocol import (
    ApiError,
    GenerationRequest,
    choice,
    chunk_choice,
    envelope,
    parse_request,
    response_id,
    spec_decode_stats,
    usage,
)
from specdecode.serving.schema import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    add_request_schemas,
    request_body,
)

PAGE = Path(__file__).with_name("static") / "index.html"  # the live page served at /


def _error_response(status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(engine: ContinuousEngine, model_name: str, aliases: tuple[str, ...] = ()) -> FastAPI:
    """The app serves `engine` under the model name `model_name`, which its responses carry, and answers requests
    for any of `aliases` too (vLLM's `--served-model-name`); its lifespan starts and drains the engine."""
    names = (model_name, *[a for a in aliases if a != model_name])

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, True)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(SpecDecodeError)
    async def refused(_request: Request, error: SpecDecodeError):
        with engine.metrics.lock:
            engine.metrics.requests["refused"] += 1
        if isinstance(error, ApiError):
            return JSONResponse(error.body(), error.status)
        return _error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(error.status_code, str(error.detail), kind)

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "drafter": engine.drafter.name}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "specdecode"} for name in names],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/completions",
        openapi_extra=request_body(CompletionRequest),
        responses={200: {"model": CompletionResponse, "description": "the completion (or an SSE stream of chunks)"}},
    )
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=request_body(ChatCompletionRequest),
        responses={200: {"model": ChatCompletionResponse, "description": "the reply (or an SSE stream of chunks)"}},
    )
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = add_request_schemas(document, (CompletionRequest, ChatCompletionRequest))
        return app.openapi_schema

    app.openapi = openapi

    async def _generate(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON ({e})") from e
        req = parse_request(body, chat, engine.target, names, engine.config.max_len)
        events: asyncio.Queue = asyncio.Queue()
        handles = _submit(req, events, asyncio.get_running_loop())
        prompt_tokens = sum(len(p) for p in req.prompts)
        if req.stream:
            stream = _stream(chat, req, handles, events, prompt_tokens)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await _collect(chat, handles, events, prompt_tokens)

    def _submit(req: GenerationRequest, events: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> list[RequestHandle]:
        def post(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

        handles = []
        try:
            choices = [(prompt, seed) for prompt in req.prompts for seed in req.seeds]
            for i, (prompt, seed) in enumerate(choices):
                handles.append(
                    engine.submit(
                        prompt,
                        req.params,
                        req.max_tokens,
                        req.stop,
                        seed,
                        on_text=(lambda text, i=i: post((i, text))) if req.stream else None,
                        on_done=lambda outcome, i=i: post((i, outcome)),
                        on_round=(lambda info, i=i: post((i, info))) if req.stream else None,
                        speculate=req.speculate,
                    )
                )
        except SpecDecodeError:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def _collect(chat: bool, handles: list[RequestHandle], events: asyncio.Queue, prompt_tokens: int):
        done: dict[int, Completion] = {}
        try:
            while len(done) < len(handles):
                i, item = await events.get()
                if isinstance(item, Exception):
                    return _error_response(500, f"generation failed: {item}", "server_error")
                if isinstance(item, Completion):
                    done[i] = item
        finally:
            for handle in handles:
                handle.cancel()
        completions = [done[i] for i in range(len(handles))]
        return envelope(
            chat,
            response_id(chat),
            model_name,
            [choice(chat, i, c.text, c.finish_reason) for i, c in enumerate(completions)],
            stream=False,
            usage=usage(prompt_tokens, completions),
            spec_decode=_spec_decode(handles, completions),
        )

    async def _stream(
        chat: bool, req: GenerationRequest, handles: list[RequestHandle], events: asyncio.Queue, prompt_tokens: int
    ) -> AsyncIterator[str]:
        rid, first = response_id(chat), [True] * len(handles)
        done: dict[int, Completion] = {}
        rounds: dict[int, list[dict]] = {i: [] for i in range(len(handles))}  # not yet sent with a chunk
        try:
            while len(done) < len(handles):
                i, item = await events.get()
                if isinstance(item, Exception):
                    yield _sse({"error": {"message": f"generation failed: {item}", "type": "server_error"}})
                    return
                if isinstance(item, dict):
                    rounds[i].append(item)
                    continue
                if isinstance(item, str):  # the rounds that made this text travel with it
                    spec = {"index": i, "round_spans": rounds[i]}
                    chunk = [chunk_choice(chat, i, item, None, first[i])]
                    yield _sse(envelope(chat, rid, model_name, chunk, True, spec_decode=spec))
                    first[i], rounds[i] = False, []
                    continue
                done[i] = item
                last = chunk_choice(chat, i, None, item.finish_reason, first[i])
                stats = spec_decode_stats(item, i, handles[i].time_to_first_token_s) | {"round_spans": rounds[i]}
                yield _sse(envelope(chat, rid, model_name, [last], True, spec_decode=stats))
            if req.include_usage:
                completions = [done[i] for i in range(len(handles))]
                yield _sse(envelope(chat, rid, model_name, [], True, usage=usage(prompt_tokens, completions)))
            yield _sse("[DONE]")
        finally:  # also when the client went away mid-stream: free the slots
            for handle in handles:
                handle.cancel()

    def _spec_decode(handles: list[RequestHandle], completions: list[Completion]) -> dict:
        return {
            "drafter": engine.drafter.name,
            "scheduler": engine.config.scheduler,
            "draft_length": engine.config.draft_length,
            "choices": [spec_decode_stats(c, i, handles[i].time_to_first_token_s) for i, c in enumerate(completions)],
        }

    return app


class BackgroundServer:
    """uvicorn in a thread on a loopback port (port 0: a free one), for tests and the load generator."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="specdecode-server", daemon=True)
        self.host = host

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise SpecDecodeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()


def check_address(host: str, port: int) -> None:
    """One clear error, before the model loads, where the server could not listen: a port out of range (uvicorn
    raised an OverflowError with a traceback), a port taken or an unknown host (uvicorn logged it after the load
    and exited 3)."""
    if not 0 <= port <= 65535:
        raise SpecDecodeError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        raise SpecDecodeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def serve(
    engine: ContinuousEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000, aliases: tuple[str, ...] = ()
) -> None:
    """Run the server until SIGINT / SIGTERM, which drain the running requests; then return (exit status 0: a
    supervisor reads a non-zero one as a crash).

    uvicorn answers HTTP on a helper thread while this thread, the one that loaded the model, steps the engine
    (`engine/continuous.py` says why that is 1.5-2.6x faster). Off the main thread uvicorn installs no signal
    handlers, so the ones here ask it to shut down: it stops accepting, finishes the open streams, and its
    lifespan stops the engine, which drains. A second SIGINT forces the exit (uvicorn's own `handle_exit`)."""
    app = create_app(engine, model_name, aliases)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine.drive(server.run)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
