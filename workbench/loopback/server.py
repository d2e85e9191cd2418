"""The loopback server: OpenAI Chat Completions and Anthropic Messages over the exact
token accumulator (workbench.tokens). An agent points a stock SDK at a session's base URL and
never knows it is being trained.

    POST /s/{session}/v1/chat/completions   OpenAI, recorded      base_url = .../s/{session}/v1
    POST /s/{session}/v1/messages           Anthropic, recorded   base_url = .../s/{session}
    POST /side/v1/chat/completions          OpenAI, NOT recorded (judges, reference calls)
    POST /side/v1/messages                  Anthropic, NOT recorded
    GET  /s/{session}/v1/models, /side/v1/models, /v1/models
    GET  /health                            no key needed

Binds 127.0.0.1 on a free port by default and checks a per-run API key (`Authorization:
Bearer` or `x-api-key`). Bad input gets a 4xx in the protocol's own error shape and changes
nothing already recorded; the server keeps serving.

The policy owns the sampling of recorded turns. The engine samples them with the server's
`policy_sampling` (temperature, top_p: whatever changes the per-token distribution the trainer
must reproduce); the agent's max_tokens, stop strings, seed and ignore_eos are honoured. A
request that *sends* a distribution field (protocol.DISTRIBUTION_FIELDS) with another value
than the policy's is, with `sampling_mode="override"` (default), sampled at the policy's and
counted (Segment.stats["sampling_overridden"], one per recorded turn; summary()), or, with
"strict", refused with a 400 naming the field and the policy's value, recording nothing. An
absent field is no override. The side route keeps the agent's temperature and top_p.

Retries: a request that repeats the session's last request (same messages and tools) is served
from the cache only when the client marks it as a retry, `x-stainless-retry-count` >= 1 (the
stock openai and anthropic SDKs send this header on every request: 0 first, k on their k-th
retry). Without it (or with 0) it is a new sample: n identical requests give n samples.

Context: max_tokens is clamped to the room the context (`max_model_len`) leaves. When the clamp
cut a recorded turn (finish "length") or no room is left at all (then the engine is not called,
the reply is empty with finish "length" and nothing is recorded for the turn), the session is
marked truncated (close_session(..., details=True), Reply.truncated). A side request with no
room left gets a 400.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import secrets
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..rollout.engine import SamplingConfig
from ..tokens import Accumulator, ChatFormat, Segment, segment_stats
from . import anthropic_api, openai_api
from .protocol import ChatRequest, Reply, RequestError, check_sampling_mode, differs, policy_value
from .toolcalls import get_tool_parser

PROTOCOLS = {"openai": openai_api, "anthropic": anthropic_api}


@dataclass
class ServerStats:
    requests: Counter = field(default_factory=Counter)  # by route kind
    errors: Counter = field(default_factory=Counter)  # by HTTP status
    retries_served_from_cache: int = 0
    seals: Counter = field(default_factory=Counter)  # by reason, over closed sessions
    identity_mismatch: int = 0
    retokenization_drift: int = 0
    sampled_tokens: int = 0
    sampling_overridden: int = 0  # recorded turns, over closed sessions
    truncated_sessions: int = 0  # closed sessions cut by the context
    sampling_refused: Counter = field(default_factory=Counter)  # strict mode: 400s by field
    overhead_s: list = field(default_factory=list)  # per request: server time minus engine time
    engine_s: list = field(default_factory=list)  # per request: time waiting for the engine


async def call_engine(engine, prompt_ids, sampling, session_id=None, return_routed_experts=False):
    """`engine`: an EngineRouter (gets the session id, for stickiness), a Ray actor handle
    (EngineHost), or any object with an async `generate(prompt_ids, sampling)`."""
    if getattr(engine, "routes_sessions", False):
        return await engine.generate(prompt_ids, sampling, session_id=session_id, return_routed_experts=return_routed_experts)
    gen = engine.generate
    if hasattr(gen, "remote"):
        return await gen.remote(prompt_ids, sampling, None, return_routed_experts)
    if return_routed_experts:
        return await gen(prompt_ids, sampling, return_routed_experts=True)
    return await gen(prompt_ids, sampling)


def retry_count(request: Request) -> int:
    """The client's retry count (`x-stainless-retry-count`, sent by the stock openai and
    anthropic SDKs on every request); 0 when absent or unreadable."""
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0


class LoopbackServer:
    def __init__(self, engine, tokenizer, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "workbench-policy", max_model_len: int | None = None, default_max_tokens: int = 256,
                 tool_parser: str | None = None, side_engine=None, accumulator_cls=Accumulator,
                 return_routed_experts: bool = False, policy_sampling: SamplingConfig | None = None,
                 sampling_mode: str = "override", profile=None):
        """`profile` (workbench.profiles.ModelProfile; None: the toy's defaults) gives the chat
        template's kwargs, the end of turn, the tool parser and the context; `max_model_len` and
        `tool_parser`, when given, win over it."""
        self.engine, self.side_engine = engine, side_engine or engine
        self.policy_sampling = policy_sampling or SamplingConfig()  # what recorded turns are sampled with
        self.sampling_mode = check_sampling_mode(sampling_mode)
        self.profile = profile
        self.fmt = ChatFormat(tokenizer) if profile is None else ChatFormat.for_profile(tokenizer, profile)
        max_model_len = max_model_len or (profile.max_model_len if profile is not None else 1024)
        tool_parser = tool_parser or (profile.tool_parser if profile is not None else "hermes")
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host, self.port = host, port
        self.model_name, self.max_model_len, self.default_max_tokens = model_name, max_model_len, default_max_tokens
        self.parse_tools = get_tool_parser(tool_parser, tokenizer)  # ours (hermes) or vLLM's of that name
        self.accumulator_cls = accumulator_cls
        self.return_routed_experts = return_routed_experts  # MoE: record routing for replay
        self.sessions: dict[str, Accumulator] = {}
        self.stats = ServerStats()
        self.created = int(time.time())
        self._thread = self._server = self.loop = None
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/side/v1/models", self._models, methods=["GET"]),
                Route("/s/{sid}/v1/models", self._models, methods=["GET"]),
                Route("/s/{sid}/v1/chat/completions", self._openai, methods=["POST"]),
                Route("/s/{sid}/v1/messages", self._anthropic, methods=["POST"]),
                Route("/side/v1/chat/completions", self._openai, methods=["POST"]),
                Route("/side/v1/messages", self._anthropic, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_found},
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "LoopbackServer":
        """Serve in a background thread (its own event loop); returns once it accepts requests."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)

        def serve():
            try:  # uvloop when present (it comes with uvicorn[standard]): less CPU per request
                import uvloop

                self.loop = uvloop.new_event_loop()
            except ImportError:
                self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=serve, name=f"loopback:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("loopback server failed to start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session_id: str | None, protocol: str = "openai") -> str:
        """The base_url to hand a stock SDK: session None is the non-recording side route."""
        root = f"{self.url}/side" if session_id is None else f"{self.url}/s/{session_id}"
        return root + "/v1" if protocol == "openai" else root

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", sid):
            raise ValueError(f"session id {sid!r} must be 1-128 of [A-Za-z0-9_.-]")
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        self.sessions[sid] = self.accumulator_cls(self.fmt)
        return sid

    def close_session(self, session_id: str, wait: bool = True, details: bool = False):
        """End a session and return its segments. wait=True waits for a turn in flight;
        wait=False (a timed-out episode) returns what is recorded now, and a late reply is dropped.
        details=True returns (segments, {"truncated": bool}): whether a turn was cut by the context."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        if self.loop is not None and self.loop.is_running():
            out = asyncio.run_coroutine_threadsafe(self._close(session_id, wait), self.loop).result()
        else:
            out = self._finish(session_id)
        return out if details else out[0]

    async def close_session_async(self, session_id: str, wait: bool = True, details: bool = False):
        """close_session for callers on another event loop (runner actors): does not block it."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(session_id, wait), self.loop))
        return out if details else out[0]

    async def _close(self, session_id: str, wait: bool) -> tuple[list[Segment], dict]:
        if not wait:
            return self._finish(session_id)
        async with self.sessions[session_id].lock:
            return self._finish(session_id)

    def _finish(self, session_id: str) -> tuple[list[Segment], dict]:
        if hasattr(self.engine, "release"):
            self.engine.release(session_id)
        acc = self.sessions.pop(session_id)
        segments = acc.close()
        s = segment_stats(segments)
        self.stats.seals.update(s["seals"])
        self.stats.identity_mismatch += s["identity_mismatch"]
        self.stats.retokenization_drift += s["retokenization_drift"]
        self.stats.sampled_tokens += s["sampled_tokens"]
        self.stats.sampling_overridden += s["sampling_overridden"]
        self.stats.truncated_sessions += int(acc.truncated)
        return segments, {"truncated": acc.truncated}

    # ------------------------------------------------------------------ HTTP plumbing
    def _error(self, protocol: str, status: int, message: str, param=None, code=None) -> JSONResponse:
        self.stats.errors[status] += 1
        return JSONResponse(PROTOCOLS[protocol].error_body(status, message, param, code), status_code=status)

    def _authorized(self, request: Request) -> bool:
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        return secrets.compare_digest(key.encode(), self.api_key.encode())

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        protocol = "anthropic" if request.url.path.endswith("/messages") else "openai"
        status = getattr(exc, "status_code", 404)
        return self._error(protocol, status, f"no route {request.method} {request.url.path}")

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            return self._error("openai", 401, "invalid API key")
        # One body that both SDKs' model lists accept (each ignores the other's fields).
        o, a = openai_api.models_body(self.model_name, self.created), anthropic_api.models_body(self.model_name, self.created)
        return JSONResponse({**o, **a, "data": [{**x, **y} for x, y in zip(o["data"], a["data"])]})

    async def _openai(self, request: Request):
        return await self._handle(request, "openai")

    async def _anthropic(self, request: Request):
        return await self._handle(request, "anthropic")

    async def _handle(self, request: Request, protocol: str):
        t0 = time.perf_counter()
        api = PROTOCOLS[protocol]
        sid = request.path_params.get("sid")
        self.stats.requests[f"{protocol}:{'side' if sid is None else 'session'}"] += 1
        if not self._authorized(request):
            return self._error(protocol, 401, "invalid API key")
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"request body is not valid JSON: {e}")
            if not isinstance(body, dict):
                raise RequestError(400, "request body must be a JSON object")
            if sid is not None and sid not in self.sessions:
                raise RequestError(404, f"unknown session {sid!r}: the framework opens sessions before handing out base URLs")
            req = api.parse_request(body)
            req.retry = retry_count(request) >= 1
            reply, engine_s = await (self._side_turn(req) if sid is None else self._session_turn(sid, req))
        except RequestError as e:
            return self._error(protocol, e.status, e.message, e.param, e.code)
        except Exception as e:  # the engine failed: nothing was recorded
            return self._error(protocol, 503 if "actor" in type(e).__name__.lower() else 500, f"generation failed: {type(e).__name__}: {e}")
        self.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
        self.stats.engine_s.append(engine_s)
        if req.stream:
            return StreamingResponse(api.stream_events(reply, req, self.model_name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(api.response_body(reply, req, self.model_name))

    # ------------------------------------------------------------------ turns
    def _fit(self, req: ChatRequest, sampling: SamplingConfig, prompt_len: int) -> tuple[bool, bool]:
        """Set sampling.max_tokens: the request's (or the default), clamped to the room the
        context leaves. Returns (room left?, clamped?)."""
        room = self.max_model_len - prompt_len
        wanted = req.max_tokens or self.default_max_tokens
        if room < 1:
            return False, True
        sampling.max_tokens = min(wanted, room)
        return True, sampling.max_tokens < wanted

    def _policy_sampling(self, req: ChatRequest) -> tuple[SamplingConfig, list[str]]:
        """The sampling of a recorded turn: the policy's distribution, the agent's max_tokens,
        stop strings, seed and ignore_eos. Also the sent fields that differ from the policy's
        (override mode counts them; strict mode refuses the request here)."""
        p, a = self.policy_sampling, req.sampling
        differing = [n for n, v in req.sent.items() if differs(n, v, p)]
        if differing and self.sampling_mode == "strict":
            n = differing[0]
            self.stats.sampling_refused[n] += 1
            value = policy_value(p, n)
            policy = f"the policy's {n} {value}" if value is not None else f"the policy's sampling, which does not apply {n}"
            fix = f"omit '{n}' or send {value}" if value is not None else f"omit '{n}'"
            raise RequestError(400, f"'{n}' is {req.sent[n]!r}, but recorded turns are sampled with {policy} "
                                    f"(sampling='strict'): {fix}", param=n, code="sampling_not_policy")
        return SamplingConfig(temperature=p.temperature, top_p=p.top_p, max_tokens=1,
                              stop=list(dict.fromkeys(p.stop + a.stop)),
                              stop_token_ids=list(dict.fromkeys(p.stop_token_ids + a.stop_token_ids)),
                              ignore_eos=a.ignore_eos or p.ignore_eos, seed=a.seed if a.seed is not None else p.seed), differing

    async def turn(self, session_id: str, messages: list[dict], tools: list | None, sampling) -> Reply:
        """One recorded turn without HTTP, for the framework-owned Env loop: the same
        accumulator and bookkeeping as a request through the SDKs (`sampling` counts as sent:
        its temperature and top_p meet the policy's like a request's). Callable from any loop."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        req = ChatRequest(messages=messages, tools=tools, sampling=copy.copy(sampling), max_tokens=sampling.max_tokens,
                          sent={"temperature": sampling.temperature, "top_p": sampling.top_p})
        fut = asyncio.run_coroutine_threadsafe(self._session_turn(session_id, req), self.loop)
        reply, _ = await asyncio.wrap_future(fut)
        return reply

    async def _session_turn(self, sid: str, req: ChatRequest):
        acc = self.sessions[sid]
        async with acc.lock:
            sampling, differing = self._policy_sampling(req)  # strict mode refuses here: nothing recorded
            req.sampling = sampling  # stop strings are applied to the reply from here
            plan = self._plan(acc, req)
            if plan.cached is not None:
                self.stats.retries_served_from_cache += 1
                return plan.cached, 0.0
            room, clamped = self._fit(req, sampling, len(plan.prompt_ids))
            if not room:  # the conversation has outgrown the context: end the turn, record nothing
                acc.truncated = True
                return Reply(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", content="", tool_calls=[], finish="length",
                             stop_sequence=None, prompt_tokens=len(plan.prompt_ids), completion_tokens=0,
                             created=int(time.time()), truncated=True), 0.0
            t = time.perf_counter()
            try:
                sample = await call_engine(self.engine, plan.prompt_ids, sampling, sid, self.return_routed_experts)
            except BaseException:
                acc.forget_last_request()  # its retry must not get an older identical request's reply
                raise
            engine_s = time.perf_counter() - t
            if self.sessions.get(sid) is not acc:  # closed meanwhile (episode timed out): drop
                raise RequestError(404, f"session {sid!r} was closed while this request was in flight")
            reply = self._reply(sample, req, len(plan.prompt_ids))
            if clamped and sample.finish_reason == "length":  # cut by the context, not by the agent's max_tokens
                reply.truncated = acc.truncated = True
            acc.record(plan, sample, reply.assistant_message(), reply=reply, sampling_overridden=bool(differing))
            return reply, engine_s

    def _plan(self, acc: Accumulator, req: ChatRequest):
        try:
            return acc.plan(req.messages, req.tools, retry=req.retry)
        except Exception as e:  # template errors (e.g. a role it refuses) are the request's fault
            raise RequestError(400, f"the chat template cannot render these messages: {e}", param="messages")

    async def _side_turn(self, req: ChatRequest):
        for n, v in req.sent.items():  # the agent's temperature/top_p are honoured; others cannot be
            if n not in ("temperature", "top_p") and differs(n, v, self.policy_sampling):
                raise RequestError(400, f"'{n}' is not supported: the engine samples with temperature and top_p only", param=n)
        try:
            ids = self.fmt.encode(self.fmt.render(req.messages, req.tools, add_generation_prompt=True))
        except Exception as e:
            raise RequestError(400, f"the chat template cannot render these messages: {e}", param="messages")
        room, _ = self._fit(req, req.sampling, len(ids))
        if not room:
            raise RequestError(400, f"the prompt is {len(ids)} tokens, but the context is {self.max_model_len} tokens",
                               param="messages", code="context_length_exceeded")
        t = time.perf_counter()
        sample = await call_engine(self.side_engine, ids, req.sampling)
        return self._reply(sample, req, len(ids)), time.perf_counter() - t

    def _reply(self, sample, req: ChatRequest, prompt_len: int) -> Reply:
        text = self.fmt.decode(sample.token_ids, skip_special_tokens=True)
        finish, stop_seq = sample.finish_reason, None
        hits = [(text.find(s), s) for s in req.sampling.stop if s and s in text]
        if hits:  # a stop string ends the text (the ids that produced it stay recorded)
            cut, stop_seq = min(hits)
            text, finish = text[:cut], "stop_sequence"
        content, calls = self.parse_tools(text) if req.parse_tools else (text, [])
        return Reply(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}", content=content,
            tool_calls=[{"id": f"call_{uuid.uuid4().hex[:16]}", **c} for c in calls],
            finish=finish, stop_sequence=stop_seq, prompt_tokens=prompt_len, completion_tokens=len(sample.token_ids),
            token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
            token_strs=[self.fmt.decode([i]) for i in sample.token_ids] if req.logprobs else [],
            created=int(time.time()),
        )

    def summary(self) -> dict:
        """Server-wide measurements, open sessions included."""
        open_stats = segment_stats([s for acc in self.sessions.values() for s in acc.segments])
        ov = sorted(self.stats.overhead_s)
        pct = (lambda q: ov[min(len(ov) - 1, int(q * len(ov)))] if ov else None)
        return {
            "requests": dict(self.stats.requests), "errors": dict(self.stats.errors),
            "retries_served_from_cache": self.stats.retries_served_from_cache,
            "seals": dict(self.stats.seals + Counter(open_stats["seals"])),
            "identity_mismatch": self.stats.identity_mismatch + open_stats["identity_mismatch"],
            "retokenization_drift": self.stats.retokenization_drift + open_stats["retokenization_drift"],
            "sampled_tokens": self.stats.sampled_tokens + open_stats["sampled_tokens"],
            "sampling_overridden": self.stats.sampling_overridden + open_stats["sampling_overridden"],
            "sampling_refused": dict(self.stats.sampling_refused),
            "truncated_sessions": self.stats.truncated_sessions + sum(acc.truncated for acc in self.sessions.values()),
            "overhead_p50_s": pct(0.5), "overhead_p99_s": pct(0.99),
        }
