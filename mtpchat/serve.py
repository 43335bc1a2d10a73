"""`mtpchat serve`: the engine behind an OpenAI-compatible HTTP API, for coding agents, editors and
scripts.

One engine holds one decode state, so the server runs one generation at a time; requests wait
their turn first in, first out (as vLLM and llama-server queue), up to `max_waiting`, past which
the next gets 429 with Retry-After. A waiting client that leaves leaves the queue before its
prefill. The engine runs on a thread of its own; its text goes to the event loop through a queue,
so a client that goes away only sets a flag, which the thread passes to `engine.cancel()` at the
next step, and the turn passes on when that thread has ended, not before.

Safe by default on loopback: without an API key, a request is served only with a Host header
naming a loopback address (or the --host bound; DNS rebinding sends the attacker's name) and a POST
only as application/json (a web page's cross-site "simple" request cannot send that without a
preflight this server never grants). With a key, every /v1 route needs it, compared in constant time.

Routes: POST /v1/chat/completions (tools, streamed as server-sent events or one JSON object),
POST /v1/completions (a prompt string, text out), GET /v1/models, GET /metrics (Prometheus text
under vLLM's names, so its dashboards and `mtpchat --server` read it), GET /health. Every error is
an OpenAI-style JSON object, unknown routes and methods too.

SIGINT / SIGTERM: the running generation is cancelled, a stream ends with an error event, waiting
and non-streamed clients get a JSON 503, the generation thread is joined, and the process exits
130 / 143. serve_request.py checks what a request asks; serve_metrics.py is what the server reports.

Starlette rather than FastAPI: a few routes whose bodies are checked by hand (serve_request.py), and
FastAPI's request models would add pydantic for nothing here. Nothing of this module's
dependencies is imported before `build_app` runs, so `mtpchat --help` stays instant.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from mtpchat.chat.engine import ChatEngine
from mtpchat.chat.prompt import build_prompt, fewest_tokens
from mtpchat.chat.reply import Piece, Reply
from mtpchat.chat.tools import ToolCall, ToolCallStream
from mtpchat.engine.events import Step
from mtpchat.errors import UserError
from mtpchat.serve_metrics import FINISH, Counters, Timing, spec_metrics, usage
from mtpchat.serve_request import BadRequest, Defaults, Request, parse_request, read_json

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_WAITING = 256
HEADER_TIMEOUT = 10.0      # seconds a client has to send a request's headers (loopback clients need milliseconds)
BODY_TIMEOUT = 30.0        # seconds a client may pause while sending a body
log = logging.getLogger("mtpchat.serve")


@dataclass
class Outcome:
    """What one generation produced, as the thread left it."""
    reason: str = "stop"
    stats: object = None
    error: str | None = None
    thinking: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0
    timing: Timing = field(default_factory=Timing)
    logprobs: list[dict] | None = None   # per token, where the request asked for them


def prompt_of(engine: ChatEngine, req: Request) -> tuple[list[int], tuple]:
    """The prompt ids and snapshot positions; a prompt that cannot fit is refused before the
    prefill, and one surely too long before it is even tokenized."""
    texts = [m["content"] for m in req.messages] or [req.prompt]
    if fewest_tokens(engine.tokenizer, texts) >= engine.max_context:
        raise BadRequest(f"the prompt is at least {fewest_tokens(engine.tokenizer, texts):,} tokens; this server's "
                         f"context is {engine.max_context:,}", "messages" if req.kind == "chat" else "prompt")
    if req.kind == "completion":
        ids, keep = engine.tokenizer.encode(req.prompt), ()
    else:
        try:
            ids, keep = build_prompt(engine.tokenizer, req.messages, req.think, req.keep_thinking, req.effort,
                                     tools=req.tools, prefix=req.prefix)
        except Exception as exc:     # the template refused the conversation (raise_exception)
            raise BadRequest(f"the chat template refused these messages: {exc}", "messages") from None
    if len(ids) + 1 >= engine.max_context:
        raise BadRequest(f"the prompt is {len(ids):,} tokens; this server's context is {engine.max_context:,}",
                         "messages" if req.kind == "chat" else "prompt")
    return ids, keep


def produce(engine: ChatEngine, req: Request, put, cancelled, arrived: float | None = None,
            began: float | None = None) -> Outcome:
    """Run one generation on the calling thread: ("text", thinking, answer, logprob entries) and
    ("call", ToolCall) go out through `put` as they are decoded; the finished outcome is returned. `cancelled()` is
    checked at every step. `arrived` and `began` (monotonic seconds: the request came, its turn
    came) are what its timing counts from."""
    began = time.monotonic() if began is None else began
    arrived = began if arrived is None else arrived
    ids, keep_at = prompt_of(engine, req)
    params = req.params if req.top_logprobs is None else replace(req.params, logprobs=req.top_logprobs)
    reply = Reply(engine, ids, params, stops=req.stops, cancelled=cancelled, snapshot_at=keep_at,
                  think_open=False if req.kind == "completion" else None)
    tools = ToolCallStream(req.types, req.prefix) if req.tools else None
    out, t = Outcome(logprobs=[] if req.top_logprobs is not None else None), Timing(queue=began - arrived)
    last = None

    def send(think: str, parts: list) -> None:
        text = "".join(p for p in parts if isinstance(p, str))
        entries = reply.take_logprobs() if out.logprobs is not None else []
        if think or text or entries:
            out.thinking.append(think)
            out.answer.append(text)
            out.logprobs is not None and out.logprobs.extend(entries)
            put(("text", think, text, entries))
        for call in (p for p in parts if isinstance(p, ToolCall)):
            out.calls.append(call)
            put(("call", call))

    def emit(pieces: list[Piece]) -> None:
        think, answer = "".join(p.thinking for p in pieces), "".join(p.answer for p in pieces)
        send(think, tools.push(answer) if tools is not None and answer else [answer] if answer else [])
    for ev in reply:
        if isinstance(ev, Step):
            now = time.monotonic()
            if last is None:
                t.ttft, t.prefill = now - arrived, now - began
            else:
                t.gaps.append(now - last)
            last = now
            emit(reply.take())
    emit(reply.finish())
    if tools is not None:
        send("", tools.flush())
    end = time.monotonic()
    t.decode, t.e2e = (end - last if last else 0.0), end - arrived
    out.reason, out.stats, out.timing = reply.reason, reply.stats, t
    out.reasoning_tokens = reasoning_tokens(engine, ids, reply)
    return out


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    return None if entries is None else {"content": entries}


def completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
    """A completion choice's legacy `logprobs`: parallel lists, the alternatives as {token: logprob},
    `text_offset` each token's place in the generated text (from `offset`, where a stream has got to)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def reasoning_tokens(engine: ChatEngine, prompt_ids: list[int], reply: Reply) -> int:
    """The reply's tokens before its </think> (all of them where it never closed the thinking)."""
    end = getattr(engine.tokenizer, "think_end_id", None)
    generated = list(reply.finished.token_ids) if reply.finished else []
    if end is None or not reply.split.seen_think:
        return 0
    return generated.index(end) if end in generated else len(generated)


class Gate:
    """One generation at a time; up to `max_waiting` requests wait for it, first in, first out
    (asyncio.Lock wakes its waiters in order). A waiter whose client leaves, or that the server's
    stop reaches, is taken out of the queue."""

    def __init__(self, max_waiting: int):
        self.lock = asyncio.Lock()
        self.max_waiting = max_waiting
        self.waiting = 0
        self.stopping = asyncio.Event()

    def full(self) -> bool:
        return self.lock.locked() and self.waiting >= self.max_waiting

    async def enter(self, gone: asyncio.Future) -> str:
        """"in" once it is this request's turn; "gone" where the client left first, "stopping"
        where the server is stopping."""
        self.waiting += 1
        turn = asyncio.ensure_future(self.lock.acquire())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([turn, gone, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
            stop.cancel()
        if turn.done() and not turn.cancelled() and not self.stopping.is_set():
            return "in"
        if turn.done() and not turn.cancelled():
            self.lock.release()      # it got its turn as the server stopped: give the turn back
        turn.cancel()
        return "stopping" if self.stopping.is_set() else "gone"


def error_body(status: int, message: str, kind: str, param: str | None = None, code=None, headers=None):
    from starlette.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code or status}},
                        status, headers=headers)


def bad(exc: BadRequest):
    kind = "NotFoundError" if exc.status == 404 else "invalid_request_error"
    return error_body(exc.status, str(exc), kind, exc.param, exc.code)


def loopback_name(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.") or host.endswith(".localhost")


def host_of(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "a:80" -> "a"."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def build_app(engine, *, model: str, defaults: Defaults, api_key: str | None = None, host: str = "127.0.0.1",
              max_waiting: int = DEFAULT_MAX_WAITING, max_body: int | None = None):
    """The ASGI app serving `engine` under the name `model`; `app.state.stop()` is the server's stop."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    counters = Counters(model, engine.max_context)
    created = int(time.time())
    max_body = max_body or max(8 << 20, 32 * engine.max_context)
    state: dict = {"running": None}         # the running generation's `gone` flag and thread

    def gate() -> Gate:   # made on the server's own event loop, at the first request
        if "gate" not in state:
            state["gate"] = Gate(max_waiting)
        return state["gate"]

    def stop() -> None:
        """The server is stopping (a signal): cancel the generation, wake every waiter."""
        gate().stopping.set()
        if state["running"] is not None:
            state["running"][0].set()

    def refused(request):
        """Why this request is not served, as a response; None where it is."""
        if api_key:
            scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return error_body(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error")
            return None
        name = host_of(request.headers.get("host", ""))
        if not (loopback_name(name) or name == host):
            return error_body(403, f"the Host header names '{name}', not this machine: a keyless server answers "
                                   "only requests for localhost (start it with --api-key to serve other names)",
                              "permission_error")
        if request.method == "POST" and \
                request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return error_body(415, "send the body as JSON, with 'Content-Type: application/json'",
                              "invalid_request_error")
        return None

    async def read_body(request) -> bytes:
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > max_body:
            raise BadRequest(f"the body is {int(size):,} bytes; this server takes at most {max_body:,}", None, 413)
        chunks, total = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), BODY_TIMEOUT)
            except StopAsyncIteration:
                return b"".join(chunks)
            except asyncio.TimeoutError:
                raise BadRequest(f"the body did not arrive within {BODY_TIMEOUT:.0f} s", None, 408) from None
            total += len(chunk)
            if total > max_body:
                raise BadRequest(f"the body is over {max_body:,} bytes, the most this server takes", None, 413)
            chunks.append(chunk)

    async def health(request):
        if (no := refused(request)) is not None:
            return no
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        if (no := refused(request)) is not None:
            return no
        counters.waiting.labels(model).set(gate().waiting)
        return Response(counters.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request):
        if (no := refused(request)) is not None:
            return no
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "mtpchat",
             "max_model_len": engine.max_context}]})

    async def chat(request):
        return await serve_one(request, "chat")

    async def completions(request):
        return await serve_one(request, "completion")

    async def serve_one(request, kind: str):
        arrived = time.monotonic()
        if (no := refused(request)) is not None:
            return no
        try:
            req = parse_request(read_json(await read_body(request)), kind, defaults, engine.tokenizer)
        except BadRequest as exc:
            return bad(exc)
        if gate().stopping.is_set():
            return error_body(503, "the server is stopping", "server_error")
        if gate().full():
            return error_body(429, f"the server is busy: one generation runs and {max_waiting} requests wait; "
                                   "retry in a moment", "rate_limit_error", headers={"Retry-After": "1"})
        gone = asyncio.ensure_future(until_gone(request))
        entered = await gate().enter(gone)
        if entered != "in":
            gone.cancel()
            return error_body(503, "the server is stopping", "server_error") if entered == "stopping" else \
                Response(status_code=499)
        return await run(request, req, gone, arrived)

    async def run(request, req: Request, gone_task, arrived: float):
        """Start the generation thread; the gate opens when it ends, whatever the client does."""
        loop, queue, gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        gone_task.add_done_callback(lambda task: task.cancelled() or gone.set())
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
        counters.running.labels(model).set(1)
        began = time.monotonic()

        def work():
            try:
                out = produce(engine, req, put, gone.is_set, arrived, began)
                if out.stats is not None:
                    counters.count(out.stats, out.reason)
                    counters.observe(out.stats, out.timing)
                put(("done", out))
            except BadRequest as exc:
                put(("bad", exc))
            except Exception as exc:   # the engine failed: the client hears it, the server stays up
                log.exception("the engine failed")
                put(("done", Outcome(reason="error", error=f"{type(exc).__name__}: {exc}")))
            finally:
                counters.running.labels(model).set(0)
                loop.call_soon_threadsafe(release)

        def release():
            state["running"] = None
            gate().lock.release()
        worker = threading.Thread(target=work, name="mtpchat-generate", daemon=True)
        state["running"] = (gone, worker)
        worker.start()
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        stamp = int(time.time())
        try:
            if not req.stream:
                return await whole(queue, req, rid, stamp)
            first = await queue.get()      # a prompt too long is a 400, not a broken stream
        except BaseException:
            gone.set()                     # this handler was cancelled (the server stopping): so is the work
            raise
        finally:
            gone_task.cancel()             # a stream listens for the client leaving by itself
        if first[0] == "bad":
            note(req, 400, None)
            return bad(first[1])
        return StreamingResponse(events(first, queue, gone, req, rid, stamp), media_type="text/event-stream")

    async def until_gone(request):
        """Until a stream begins, nothing else hears the client leave, and the one generation would
        run on for no one (a whole answer, or a long prefill), or wait its turn for no one."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def note(req: Request, status: int, out: Outcome | None) -> None:
        """The request's one line in the log."""
        line = f"{'chat' if req.kind == 'chat' else 'completion'} {status}"
        if out is not None and out.stats is not None:
            s, t = out.stats, out.timing
            per = 1000 * t.decode / max(s.new_tokens - 1, 1)
            line += (f" {FINISH.get(out.reason, out.reason)} in={s.prompt_tokens} (cached {s.reused_tokens}) "
                     f"out={s.new_tokens} ttft={1000 * t.ttft:.0f}ms {per:.1f}ms/token queue={1000 * t.queue:.0f}ms")
            if s.drafted:
                line += f" acceptance={s.draft_acceptance_rate:.0%} length={s.mean_acceptance_length:.2f}"
            if out.calls:
                line += f" tool_calls={len(out.calls)}"
        log.info(line)

    def finish_reason(out: Outcome) -> str:
        return "tool_calls" if out.calls and out.reason in ("stop", "cancelled") else FINISH[out.reason]

    def stopping_reply(out: Outcome) -> bool:
        return gate().stopping.is_set() and out.reason == "cancelled"

    async def whole(queue, req: Request, rid, stamp):
        while (item := await queue.get())[0] in ("text", "call"):
            pass
        if item[0] == "bad":
            note(req, 400, None)
            return bad(item[1])
        out = item[1]
        if out.error:
            note(req, 500, out)
            return error_body(500, f"the engine failed: {out.error}", "server_error")
        if stopping_reply(out):
            note(req, 503, out)
            return error_body(503, "the server is stopping: the reply was cut short", "server_error")
        note(req, 200, out)
        thinking, answer = "".join(out.thinking), "".join(out.answer)
        extra = {"usage": usage(out.stats, out.reasoning_tokens), "metrics": spec_metrics(out.stats)}
        if req.kind == "completion":
            return JSONResponse({"id": rid, "object": "text_completion", "created": stamp, "model": model,
                                 "choices": [{"index": 0, "text": answer,
                                              "logprobs": completion_logprobs(out.logprobs, 0),
                                              "finish_reason": FINISH[out.reason]}], **extra})
        message = {"role": "assistant", "content": answer or (None if out.calls else "")}
        if thinking:
            message |= {"reasoning": thinking, "reasoning_content": thinking}
        if out.calls:
            message["tool_calls"] = [c.openai(call_id()) for c in out.calls]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": stamp, "model": model,
                             "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(out),
                                          "logprobs": chat_logprobs(out.logprobs)}],
                             **extra})

    async def events(item, queue, gone, req: Request, rid: str, stamp: int):
        chat_kind = req.kind == "chat"

        offset = 0

        def chunk(delta: dict | None, finish=None, entries=None, **extra) -> str:
            nonlocal offset
            if delta is None:
                choices = []
            elif chat_kind:
                choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
                if entries is not None:
                    choices[0]["logprobs"] = chat_logprobs(entries)
            else:
                lp = completion_logprobs(entries, offset)
                offset += sum(len(e["token"]) for e in entries or ())
                choices = [{"index": 0, "text": delta.get("content", ""), "logprobs": lp, "finish_reason": finish}]
            body = {"id": rid, "object": "chat.completion.chunk" if chat_kind else "text_completion",
                    "created": stamp, "model": model, "choices": choices, **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        calls = 0
        try:
            if chat_kind:
                yield chunk({"role": "assistant", "content": ""})
            while item[0] in ("text", "call"):
                if item[0] == "call":
                    yield chunk({"tool_calls": [{"index": calls, **item[1].openai(call_id())}]})
                    calls += 1
                    item = await queue.get()
                    continue
                _, think, answer, entries = item
                item = None
                while item is None and not queue.empty():
                    # what piled up while the engine held the interpreter goes out as one event
                    nxt = queue.get_nowait()
                    if nxt[0] != "text" or (nxt[1] and answer):
                        item = nxt
                    else:
                        think, answer, entries = think + nxt[1], answer + nxt[2], entries + nxt[3]
                delta = {"reasoning": think, "reasoning_content": think} if think else {}
                if answer:
                    delta["content"] = answer
                if delta or entries:
                    yield chunk(delta, entries=entries if req.top_logprobs is not None else None)
                item = item or await queue.get()
            if item[0] == "bad":
                note(req, 400, None)
                failed = {"message": str(item[1]), "type": "invalid_request_error", "code": 400}
                yield f"data: {json.dumps({'error': failed})}\n\n"
                return
            out = item[1]
            if out.error or stopping_reply(out):   # the stream has begun: the error goes in it, and no [DONE]
                note(req, 500 if out.error else 503, out)
                failed = {"message": f"the engine failed: {out.error}", "type": "server_error", "code": 500} \
                    if out.error else {"message": "the server is stopping: the reply was cut short",
                                       "type": "server_error", "code": 503}
                yield f"data: {json.dumps({'error': failed})}\n\n"
                return
            note(req, 200, out)
            # the figures ride the usage chunk, as vLLM sends them, or the last one where none is asked for
            spec = {"metrics": spec_metrics(out.stats)}
            yield chunk({}, finish_reason(out), **({} if req.include_usage else spec))
            if req.include_usage:
                yield chunk(None, usage=usage(out.stats, out.reasoning_tokens), **spec)
            yield "data: [DONE]\n\n"
        finally:
            gone.set()     # the client left (or the reply ended): the thread cancels at its next step

    async def not_found(request, exc):
        if exc.status_code == 405:
            return error_body(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error")
        return error_body(exc.status_code, f"no route {request.method} {request.url.path} here; this server has "
                          "/v1/chat/completions, /v1/completions, /v1/models, /metrics and /health",
                          "invalid_request_error" if exc.status_code != 404 else "NotFoundError")

    app = Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", completions, methods=["POST"])],
        exception_handlers={HTTPException: not_found})
    app.state.stop = stop
    app.state.running = lambda: state["running"]
    return app


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_bind(host: str, api_key: str | None) -> None:
    if host not in LOCAL_HOSTS and not api_key:
        raise UserError(f"binding to {host} lets other machines use the model: pass --api-key KEY "
                        "(clients send it as a Bearer token), or bind to 127.0.0.1", exit_code=2)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (minutes for a large one) so a taken port
    fails at once. On loopback the other family's loopback must be free too: a client that asks
    for "localhost" may reach either one, and would find another server there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind((host, port))
        bound = sock.getsockname()[1]
        twin = {"127.0.0.1": "::1", "::1": "127.0.0.1", "localhost": "::1"}.get(host)
        if twin and port:
            probe_free(twin, bound)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): another server has it; "
                        "stop it or pick another --port") from None
    sock.listen(128)
    return sock


def probe_free(host: str, port: int) -> None:
    """Raise OSError where something listens on host:port; a host this machine lacks is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return
    with probe:
        try:
            probe.settimeout(0.5)
            if probe.connect_ex((host, port)) == 0:
                raise OSError(98, "the port is in use on " + host)
        except socket.gaierror:
            return


def serve(engine, sock: socket.socket, *, model: str, defaults: Defaults, host: str, api_key: str | None,
          max_waiting: int, announce) -> int:
    """Serve on the bound socket until a signal; the exit status (130 for SIGINT, 143 for SIGTERM)."""
    app = build_app(engine, model=model, defaults=defaults, api_key=api_key, host=host, max_waiting=max_waiting)
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    announce(f"mtpchat serve: {model} at http://{shown}:{port}/v1 (one generation at a time; Ctrl-C stops)")
    server = http_server(app)
    server.run(sockets=[sock])
    running = app.state.running()
    if running is not None:       # a generation on its thread: it ends at its next step
        running[0].set()
        running[1].join(30)
    return 128 + server.signal if server.signal else 0


def http_server(app):
    """uvicorn around `build_app`'s app as `serve` runs it: quiet, a deadline for each request's
    headers, the app told first when it stops. `run(sockets=[sock])` serves until a signal (on the
    main thread) or until `should_exit` is set (anywhere)."""
    import uvicorn
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            http=timed_protocol(), lifespan="off")
    return Server(config, app.state.stop)


def timed_protocol():
    """uvicorn's h11 protocol with a deadline for a request's headers: a client that connects and
    trickles (or never sends) them is closed after HEADER_TIMEOUT, instead of holding a connection."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Timed(H11Protocol):
        header_timeout = HEADER_TIMEOUT

        def connection_made(self, transport):
            super().connection_made(transport)
            self._deadline = self.loop.call_later(self.header_timeout, self._late)

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and self._deadline is None:
                self._deadline = self.loop.call_later(self.header_timeout, self._late)
            elif self.conn.their_state is not h11.IDLE and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc):
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _late(self):
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()
    return Timed


def Server(config, on_stop):   # noqa: N802 - built lazily so uvicorn is imported only when serving
    import uvicorn

    class Stopping(uvicorn.Server):
        """uvicorn's server that tells the app first (so clients hear why) and exits with the
        signal's status instead of raising it again."""
        signal = 0

        def handle_exit(self, sig, frame):
            self.signal = self.signal or sig
            on_stop()
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()
    return Stopping(config)
