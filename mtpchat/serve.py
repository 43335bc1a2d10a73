"""`mtpchat serve`: the engine behind an OpenAI-compatible HTTP API, for editors, scripts and web UIs.

One engine holds one decode state, so the server runs one generation at a time: a request that
arrives while one runs waits its turn, and once `max_waiting` wait, the next gets 429 with a body
that says so. The engine runs on a thread of its own; its text goes to the event loop through a
queue, so a client that goes away (mid-stream, or before a whole answer is ready) only sets a
flag, which the thread passes to `engine.cancel()` at the next step, and the gate opens when that
thread has ended, not before.

Routes: POST /v1/chat/completions (streamed as server-sent events, or one JSON object),
GET /v1/models, GET /metrics (Prometheus text, with vLLM's names for the speculative decoding
counters so the same dashboards and `mtpchat --server` read it), GET /health.

serve_request.py checks what a request asks; serve_metrics.py is what the server reports of its
speculative decoding (per request, and on /metrics).

Starlette rather than FastAPI: four routes whose bodies are checked by hand in a few lines, and
FastAPI's request models would add pydantic for nothing here. Nothing of this module's
dependencies is imported before `build_app` runs, so `mtpchat --help` stays instant.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from mtpchat.chat.engine import ChatEngine
from mtpchat.chat.prompt import Switches, build_prompt
from mtpchat.chat.reply import Piece, Reply
from mtpchat.engine.events import Step
from mtpchat.errors import UserError
from mtpchat.serve_metrics import FINISH, Counters, spec_metrics, usage
from mtpchat.serve_request import BadRequest, Request, parse_request

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_WAITING = 8


@dataclass
class Outcome:
    """What one generation produced, as the thread left it."""
    reason: str = "stop"
    stats: object = None
    error: str | None = None
    thinking: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)


def produce(engine: ChatEngine, req: Request, put, cancelled) -> Outcome:
    """Run one generation on the calling thread: text goes out through `put(thinking, answer)` as it
    is decoded; the finished outcome is returned. `cancelled()` is checked at every step."""
    ids, keep_at = build_prompt(engine.tokenizer, req.messages, req.think, req.switches.keep_thinking,
                                req.switches.effort)
    if len(ids) + 1 >= engine.max_context:
        raise BadRequest(f"the prompt is {len(ids):,} tokens; this server's context is {engine.max_context:,}",
                         "messages")
    reply = Reply(engine, ids, req.params, stops=req.stops, cancelled=cancelled, snapshot_at=keep_at)
    out = Outcome()

    def emit(pieces: list[Piece]) -> None:
        think, answer = "".join(p.thinking for p in pieces), "".join(p.answer for p in pieces)
        if think or answer:
            out.thinking.append(think)
            out.answer.append(answer)
            put(think, answer)
    for ev in reply:
        if isinstance(ev, Step):
            emit(reply.take())
    emit(reply.finish())
    out.reason, out.stats = reply.reason, reply.stats
    return out


class Gate:
    """One generation at a time; at most `max_waiting` requests wait for it."""

    def __init__(self, max_waiting: int):
        self.lock = asyncio.Lock()
        self.max_waiting = max_waiting
        self.waiting = 0

    async def enter(self) -> bool:
        if self.lock.locked() and self.waiting >= self.max_waiting:
            return False
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1
        return True


def error_body(status: int, message: str, kind: str, param: str | None = None):
    from starlette.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_app(engine, *, model: str, api_key: str | None = None, think: bool = True,
              max_waiting: int = DEFAULT_MAX_WAITING, switches: Switches | None = None):
    """The ASGI app serving `engine` under the name `model`; `switches`: the chat template's defaults
    (thinking, preserve_thinking, reasoning_effort) that a request's own override."""
    defaults = switches or Switches(think=think)
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    counters = Counters(model)
    created = int(time.time())
    state: dict = {}

    def gate() -> Gate:   # made on the server's own event loop, at the first request
        if "gate" not in state:
            state["gate"] = Gate(max_waiting)
        return state["gate"]

    def refused(request):
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error_body(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              "authentication_error")
        return None

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        counters.waiting.labels(model).set(gate().waiting)
        return Response(counters.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request):
        if (no := refused(request)) is not None:
            return no
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "mtpchat",
             "max_model_len": engine.max_context}]})

    async def chat(request):
        if (no := refused(request)) is not None:
            return no
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_body(400, "the body is not valid JSON", "invalid_request_error")
        try:
            req = parse_request(body, engine, think, defaults)
        except (BadRequest, ValueError) as exc:
            return error_body(400, str(exc), "invalid_request_error", getattr(exc, "param", None))
        if not await gate().enter():
            return error_body(429, f"the server is busy: one generation runs and {max_waiting} requests wait; "
                                   "retry in a moment", "rate_limit_error")
        return await run(request, req)

    async def run(request, req: Request):
        """Start the generation thread; the gate opens when it ends, whatever the client does."""
        loop, queue, gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
        counters.running.labels(model).set(1)

        def work():
            try:
                out = produce(engine, req, lambda t, a: put(("text", t, a)), gone.is_set)
                if out.stats is not None:
                    counters.count(out.stats, out.reason)
                put(("done", out))
            except BadRequest as exc:
                put(("bad", exc))
            except Exception as exc:   # the engine failed: the client hears it, the server stays up
                put(("done", Outcome(reason="error", error=f"{type(exc).__name__}: {exc}")))
            finally:
                counters.running.labels(model).set(0)
                loop.call_soon_threadsafe(gate().lock.release)
        threading.Thread(target=work, name="mtpchat-generate", daemon=True).start()
        rid, stamp = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        watch = asyncio.create_task(until_gone(request, gone))
        try:
            if not req.stream:
                return await whole(queue, rid, stamp)
            first = await queue.get()      # a prompt too long is a 400, not a broken stream
        except BaseException:
            gone.set()                     # this handler was cancelled (the server stopping): so is the work
            raise
        finally:
            watch.cancel()                 # a stream listens for the client leaving by itself
        if first[0] == "bad":
            return error_body(400, str(first[1]), "invalid_request_error", first[1].param)
        return StreamingResponse(events(first, queue, gone, req, rid, stamp), media_type="text/event-stream")

    async def until_gone(request, gone):
        """Until a stream begins, nothing else hears the client leave, and the one generation would
        run on for no one (a whole answer, or a long prefill)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    async def whole(queue, rid, stamp):
        while (item := await queue.get())[0] == "text":
            pass
        if item[0] == "bad":
            return error_body(400, str(item[1]), "invalid_request_error", item[1].param)
        out = item[1]
        if out.error:
            return error_body(500, f"the engine failed: {out.error}", "server_error")
        thinking, answer = "".join(out.thinking), "".join(out.answer)
        message = {"role": "assistant", "content": answer}
        if thinking:
            message |= {"reasoning": thinking, "reasoning_content": thinking}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": stamp, "model": model,
                             "choices": [{"index": 0, "message": message, "finish_reason": FINISH[out.reason]}],
                             "usage": usage(out.stats), "metrics": spec_metrics(out.stats)})

    async def events(item, queue, gone, req: Request, rid: str, stamp: int):
        def chunk(delta: dict | None, finish=None, **extra) -> str:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            body = {"id": rid, "object": "chat.completion.chunk", "created": stamp, "model": model,
                    "choices": choices, **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        try:
            yield chunk({"role": "assistant", "content": ""})
            while item[0] == "text":
                _, think, answer = item
                item = None
                while item is None and not queue.empty():
                    # what piled up while the engine held the interpreter goes out as one event
                    nxt = queue.get_nowait()
                    if nxt[0] != "text" or (nxt[1] and answer):
                        item = nxt
                    else:
                        think, answer = think + nxt[1], answer + nxt[2]
                delta = {"reasoning": think, "reasoning_content": think} if think else {}
                if answer:
                    delta["content"] = answer
                yield chunk(delta)
                item = item or await queue.get()
            out = item[1]
            if out.error:   # the stream has begun: the error goes in it, and it ends without [DONE]
                failed = {"message": f"the engine failed: {out.error}", "type": "server_error", "code": 500}
                yield f"data: {json.dumps({'error': failed})}\n\n"
                return
            # the figures ride the usage chunk, as vLLM sends them, or the last one where none is asked for
            spec = {"metrics": spec_metrics(out.stats)}
            yield chunk({}, FINISH[out.reason], **({} if req.include_usage else spec))
            if req.include_usage:
                yield chunk(None, usage=usage(out.stats), **spec)
            yield "data: [DONE]\n\n"
        finally:
            gone.set()     # the client left (or the reply ended): the thread cancels at its next step

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"])])


def check_bind(host: str, api_key: str | None) -> None:
    if host not in LOCAL_HOSTS and not api_key:
        raise UserError(f"binding to {host} lets other machines use the model: pass --api-key KEY "
                        "(clients send it as a Bearer token), or bind to 127.0.0.1", exit_code=2)


def serve(engine, *, model: str, host: str, port: int, api_key: str | None, think: bool,
          max_waiting: int, announce, switches: Switches | None = None) -> None:
    """Bind first (port 0 picks a free one), say where, then serve until interrupted."""
    import uvicorn
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port") from None
    sock.listen(64)
    bound = sock.getsockname()[1]
    app = build_app(engine, model=model, api_key=api_key, think=think, max_waiting=max_waiting, switches=switches)
    shown = f"[{host}]" if ":" in host else host
    announce(f"mtpchat serve: {model} at http://{shown}:{bound}/v1 (one generation at a time; Ctrl-C stops)")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
