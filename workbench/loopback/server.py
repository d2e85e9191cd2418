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
Bearer` or `x-api-key`). docs/ARCHITECTURE.md, "The loopback server", has the rules this module
implements: the policy owns the sampling of recorded turns, retries (`x-stainless-retry-count`),
context length and truncated episodes, and bad input as a 4xx / outages as a 503 that change
nothing recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..rollout.actor import stream_generate
from ..rollout.engine import Sample, SamplingConfig
from ..tokens import (Accumulator, ChatFormat, Segment, SEGMENT_TOTALS, canonical_message, new_tool_call_id, request_key,
                      segment_stats)
from . import anthropic_api, openai_api
from .parsing import ReplyParser, ids_before, reply_text, sampled_call_ids
from .protocol import ChatRequest, Reply, RequestError, check_sampling_mode, check_template_controls, differs, loads, order_tool_results, policy_value
from .streaming import ReplyStream, TokenFeed

PROTOCOLS = {"openai": openai_api, "anthropic": anthropic_api}
log = logging.getLogger(__name__)


TIMINGS_KEPT = 100_000
# how often a side call's handler asks whether its client has gone (_side_turn)
CLIENT_POLL_S = 0.25


@dataclass
class ServerStats:
    requests: Counter = field(default_factory=Counter)  # by route kind
    errors: Counter = field(default_factory=Counter)  # by HTTP status
    retries_served_from_cache: int = 0
    seals: Counter = field(default_factory=Counter)  # by reason, over closed sessions
    segment_totals: Counter = field(default_factory=Counter)  # tokens.SEGMENT_TOTALS over closed sessions
    truncated_sessions: int = 0  # closed sessions cut by the context or the policy's max_tokens
    sampling_refused: Counter = field(default_factory=Counter)  # strict mode: 400s by field
    # per request, the last TIMINGS_KEPT (kept for a whole run, they grew by a float a request in
    # the runner: ~640 MB at 10M requests, each summary() sorting them all on the server's GIL)
    overhead_s: deque = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))  # server time minus engine time
    engine_s: deque = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))  # time waiting for the engine
    # failures no check foresaw, by where: "parse" (answered 400), "internal" (answered 500).
    # Logged with their traceback; 0 is the expectation (tests/test_loopback_faults.py).
    unexpected_errors: Counter = field(default_factory=Counter)
    # replies sampled for a client that had gone before they were done (its own timeout, a
    # cancelled call): not recorded (the agent never saw them)
    undelivered: int = 0


class EngineAborted(RuntimeError):
    """The engine ended the request unfinished: finish_reason "abort" (its shutdown, an abort),
    or any other than "stop" and "length" (vLLM's "error": a failed KV load, a grammar error;
    "repetition": its repetition detection cut the reply). Answered 503 and recorded nothing,
    where it was recorded as a trainable, finished turn and answered "stop" (and the reply cache
    then gave the SDK's retry that broken reply instead of a fresh sample)."""


def finished(sample):
    if sample.finish_reason not in ("stop", "length"):
        raise EngineAborted(f"the engine ended the request with finish_reason {sample.finish_reason!r} "
                            f"after {len(sample.token_ids)} tokens")
    return sample


async def call_engine(engine, prompt_ids, sampling, session_id=None, return_routed_experts=False, feed=None):
    """`engine`: an EngineRouter (gets the session id, for stickiness), a Ray actor handle
    (EngineHost), or any object with an async `generate(prompt_ids, sampling)`. With `feed` (a
    streamed request's TokenFeed) the engine's generate_stream is used where it has one: the ids
    go to the feed as they are sampled, and the Sample returned is the one generate() returns."""
    if feed is not None:
        return await stream_engine(engine, prompt_ids, sampling, session_id, return_routed_experts, feed)
    if getattr(engine, "routes_sessions", False):
        return await engine.generate(prompt_ids, sampling, session_id=session_id, return_routed_experts=return_routed_experts)
    gen = engine.generate
    if hasattr(gen, "remote"):
        return await gen.remote(prompt_ids, sampling, None, return_routed_experts)
    if return_routed_experts:
        return await gen(prompt_ids, sampling, return_routed_experts=True)
    return await gen(prompt_ids, sampling)


async def stream_engine(engine, prompt_ids, sampling, session_id, return_routed_experts, feed):
    feed.prompt(prompt_ids)
    if getattr(engine, "routes_sessions", False):
        items = engine.generate_stream(prompt_ids, sampling, session_id=session_id, return_routed_experts=return_routed_experts)
    elif hasattr(engine.generate, "remote"):
        items = stream_generate(engine, prompt_ids, sampling, return_routed_experts)
    elif hasattr(engine, "generate_stream"):
        items = engine.generate_stream(prompt_ids, sampling, **({"return_routed_experts": True} if return_routed_experts else {}))
    else:  # an engine that only answers whole: its ids come with the finished sample
        return await call_engine(engine, prompt_ids, sampling, session_id, return_routed_experts)
    sample = None
    async for item in items:
        if isinstance(item, Sample):
            sample = item
        else:
            feed.extend(item)
    if sample is None:
        raise RuntimeError("the engine's stream ended without its finished sample")
    return sample


# Engine failures, by the names of the exception's classes (Ray's, vLLM's, the router's; no import
# needed). Unavailable: the engine (or every engine) is gone or not answering now; a later
# attempt may find one: 503 with Retry-After. Refused: the engine's own validation (vLLM's
# VLLMClientError family, VLLMValidationError among it, "errors caused by the client request
# (4xx)"; a ValueError / OverflowError, as the reference engine raises): the request's fault, 400.
# Anything else: 500.
ENGINE_REFUSED = {"VLLMClientError", "ValueError", "OverflowError"}
ENGINE_UNAVAILABLE = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError",
                      "WorkerCrashedError", "NodeDiedError", "ObjectLostError", "OwnerDiedError", "OutOfMemoryError",
                      "RaySystemError", "GetTimeoutError", "EngineUnavailable", "EngineDeadError", "EngineAborted",
                      "EngineCoreDead", "TornWeights"}
_SCRUB = [(re.compile(p), r) for p, r in [
    (r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b", "<ip>"), (r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:|:){2,7}[0-9a-fA-F]{1,4}(?![\w:])", "<ip>"),
    (r"(?i)\bpid[=: ]*\d+", "pid <n>"), (r"\b(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b", "<id>"), (r"ray::\S+", "<task>"),
]]


def scrub(text: str, n: int = 300) -> str:
    """An exception's message as a client may see it: its first line, without addresses,
    process ids, actor/task ids; at most n characters."""
    text = (str(text).strip().splitlines() or [""])[0]
    for pattern, repl in _SCRUB:
        text = pattern.sub(repl, text)
    return text if len(text) <= n else text[:n] + "..."


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def unwrap(e: BaseException) -> BaseException:
    """The exception a Ray task error wraps (the engine's own), else e."""
    while "RayTaskError" in _names(e) and isinstance(getattr(e, "cause", None), BaseException):
        e = e.cause
    return e


def engine_error(e: Exception, retry_after_s: float) -> RequestError | None:
    """The client's view of an exception from an engine call: RequestError(503, Retry-After)
    when no engine can serve it now, RequestError(400) when the engine refused the request,
    None (a 500) otherwise. A Ray task error is judged by the exception it wraps."""
    e = unwrap(e)
    names = _names(e)
    if names & ENGINE_UNAVAILABLE or isinstance(e, (TimeoutError, ConnectionError)):
        return RequestError(503, f"no rollout engine can serve this request now ({type(e).__name__}); retry later",
                            code="engine_unavailable", headers={"Retry-After": f"{retry_after_s:g}"})
    if names & ENGINE_REFUSED:
        return RequestError(400, f"the engine refused the request: {scrub(e)}", code="engine_refused")
    return None


class _ThreadedFormat:
    """The server's ChatFormat as turns use it from worker threads. tokenizers' `encode` holds
    the GIL for the whole call (2.4 s on a 1 MB prompt: the event loop, and every other session,
    would stall), `encode_batch` releases it and gives the same ids. Used only for ChatFormat's
    own `encode` (a format class that overrides it is used as it is), and only for texts of at
    least `min_chars`: a thread that releases the GIL waits to get it back until the holder
    (the agents' event loop shares the process) yields it, up to the switch interval (5 ms),
    while a turn's delta encodes in ~0.1 ms."""

    def __init__(self, fmt: ChatFormat, min_chars: int, prompts: "PromptMemo"):
        self._fmt, self._min_chars, self._prompts = fmt, min_chars, prompts

    def __getattr__(self, name):
        return getattr(self._fmt, name)

    def prompt(self, messages: list[dict], tools: list | None) -> tuple[str, list[int]]:
        return self._prompts.get(self, messages, tools)

    def encode(self, text: str) -> list[int]:
        if len(text) < self._min_chars:
            return self._fmt.encode(text)
        return self._fmt._backend.encode_batch([text], add_special_tokens=False)[0].ids


class EngineCallFailed(Exception):
    """An engine call raised `error`; nothing was recorded for the request. The HTTP routes
    answer it by engine_error(); turn() re-raises `error` itself."""

    def __init__(self, error: Exception):
        super().__init__(type(error).__name__)
        self.error = error


def threaded_format(fmt, min_chars: int, prompts: "PromptMemo"):
    return _ThreadedFormat(fmt, min_chars, prompts) if type(fmt).encode is ChatFormat.encode else fmt


class PromptMemo:
    """The server's last `size` new-segment prompts (ChatFormat.prompt: render + ids), by their
    canonical messages and tools. Why: a group's G episodes open with the same messages within
    milliseconds, and each would render the template and encode the same text (on the toy's
    quickstart ~40% of the runner's CPU per Env episode; with the memo 1 of each per group, not
    8). The ids are the same either way (a template renders the same messages the same); a
    request whose key is over `max_chars` (its JSON) is rendered as it is, not kept."""

    def __init__(self, size: int = 64, max_chars: int = 16 * 2**10):
        self.size, self.max_chars = size, max_chars
        self._memo: dict[tuple, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()  # plans of large requests run in worker threads
        self.hits = 0

    def get(self, fmt, messages: list[dict], tools: list | None) -> tuple[str, list[int]]:
        key = request_key(messages, tools)
        if len(key[0]) + len(key[1]) > self.max_chars:
            return ChatFormat.prompt(fmt, messages, tools)
        with self._lock:
            got = self._memo.get(key)
        if got is None:
            got = ChatFormat.prompt(fmt, messages, tools)
            with self._lock:
                if len(self._memo) >= self.size:
                    self._memo.pop(next(iter(self._memo)))  # the oldest
                self._memo[key] = got
        else:
            self.hits += 1
        return got[0], list(got[1])  # the caller's own list


def retry_count(request: Request) -> int:
    """The client's retry count (`x-stainless-retry-count`, sent by the stock openai and
    anthropic SDKs on every request); 0 when absent or unreadable."""
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0


def session_seed(seed: int | None, session_id: str, call: int = 0) -> int | None:
    """A recorded turn's seed: the agent's (or the policy's) mixed with its session id and the
    number of engine calls the session made before (`call`). Why the id: a group's G episodes send
    the same first request, and one seed would draw the same sample G times: a group with no
    reward variance, so no signal, that no statistic names. Why the call: vLLM draws a seeded
    request's noise from a generator of that seed, so every turn of a session sent one seed
    shared the noise of each step with every other turn (two turns on similar logits picked the
    same token 83% of the time, vs 2% with independent seeds): the episode was no draw from the
    policy the trainer's log-probs describe. Mixed, a session still samples reproducibly from
    its seed, each turn and each session independently of the others."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"{seed}:{session_id}:{call}".encode(), digest_size=8).digest(), "big") >> 1


class LoopbackServer:
    # Limits, per instance (server.max_request_bytes = ...) or per subclass. A body over
    # max_request_bytes gets a 413 (read incrementally: never buffered beyond the limit; the rest
    # is read and dropped, up to drain_request_bytes, so the client sees the 413 rather than a
    # reset connection). A 503 (no engine can serve now) carries Retry-After: retry_after_s.
    # Bodies over thread_json_bytes are parsed, and turns of requests over thread_plan_bytes
    # rendered and tokenized, in a worker thread (smaller ones cost less than the thread hop).
    max_request_bytes: int = 4 * 2**20
    drain_request_bytes: int = 64 * 2**20
    retry_after_s: float = 1.0
    thread_json_bytes: int = 64 * 2**10
    thread_plan_bytes: int = 16 * 2**10

    def __init__(self, engine, tokenizer, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "workbench-policy", max_model_len: int | None = None, default_max_tokens: int = 256,
                 tool_parser: str | None = None, side_engine=None, accumulator_cls=Accumulator,
                 return_routed_experts: bool = False, policy_sampling: SamplingConfig | None = None,
                 sampling_mode: str = "override", profile=None, max_request_bytes: int | None = None):
        """`profile` (workbench.profiles.ModelProfile; None: the toy's defaults) gives the chat
        template's kwargs, the end of turn, the tool and reasoning parsers (workbench.loopback.parsing),
        the shape of tool-call ids, what canonical messages keep, and the context; `max_model_len`
        and `tool_parser`, when given, win over it. `max_request_bytes` (None: the class's 4 MiB):
        a larger body gets a 413."""
        if max_request_bytes is not None:
            if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
                raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
            self.max_request_bytes = max_request_bytes
        self.engine, self.side_engine = engine, side_engine or engine
        # what recorded turns are sampled with; its max_tokens is theirs where the agent sends none
        self.policy_sampling = policy_sampling or SamplingConfig(max_tokens=default_max_tokens)
        if profile is not None and not self.policy_sampling.ignore_eos:  # its stop tokens (Llama's <|eom_id|>), as a
            # runner's sampling has them (unless told to run on: ignore_eos): a
            # reply ending on one is read without it (parsing.reply_text), not with it as the text's end
            stops = [i for i in profile.stop_token_ids(tokenizer) if i not in self.policy_sampling.stop_token_ids]
            self.policy_sampling = dataclasses.replace(self.policy_sampling,
                                                       stop_token_ids=[*self.policy_sampling.stop_token_ids, *stops])
        self.sampling_mode = check_sampling_mode(sampling_mode)
        self.profile = profile
        self.fmt = ChatFormat(tokenizer) if profile is None else ChatFormat.for_profile(tokenizer, profile)
        self.prompts = PromptMemo()
        max_model_len = max_model_len or (profile.max_model_len if profile is not None else 1024)
        tool_parser = tool_parser or (profile.tool_parser if profile is not None else "hermes")
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host, self.port = host, port
        self.model_name, self.max_model_len, self.default_max_tokens = model_name, max_model_len, default_max_tokens
        # reasoning (vLLM's parser of the profile's name), content and tool calls (ours: hermes, or vLLM's)
        self.reply_parser = ReplyParser(tokenizer, tool_parser, profile.reasoning_parser if profile is not None else None,
                                        profile.chat_template_kwargs if profile is not None else None)
        self.tool_call_ids = profile.tool_call_ids if profile is not None else None  # the shape handed out
        self.accumulator_cls = accumulator_cls
        self.return_routed_experts = return_routed_experts  # MoE: record routing for replay
        self.sessions: dict[str, Accumulator] = {}
        # session -> (request key, reply, record) of a reply sampled for a client that had gone:
        # recorded only if that request's retry takes it (_session_turn)
        self._undelivered: dict[str, tuple] = {}
        # session -> the tasks of its turns waiting for the engine: cancelled when the session closes
        # without waiting for them (a timed-out episode, a turn its agent left behind), so that the
        # engine stops sampling them (uvicorn does not cancel a request whose client has gone)
        self._engine_waits: dict[str, set] = {}
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
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", sid) or not sid.strip("."):
            # ('.' and '..' are path segments an HTTP client removes: /s/../v1 reached /v1, every request 404)
            raise ValueError(f"session id {sid!r} must be 1-128 of [A-Za-z0-9_.-], not dots alone")
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        # turns of large requests are planned in worker threads; new segments' prompts are memoized
        self.sessions[sid] = self.accumulator_cls(threaded_format(self.fmt, self.thread_plan_bytes, self.prompts))
        return sid

    def close_session(self, session_id: str, wait: bool | float = True, details: bool = False):
        """End a session and return its segments. wait=True waits for a turn in flight, a number
        that many seconds at most (then as False); wait=False (a timed-out episode) returns what is
        recorded now, and a late reply is dropped.
        details=True returns (segments, {"truncated": bool}): whether a turn was cut by the context or the policy's max_tokens."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        if self.loop is not None and self.loop.is_running():
            out = asyncio.run_coroutine_threadsafe(self._close(session_id, wait), self.loop).result()
        else:
            out = self._finish(session_id)
        return out if details else out[0]

    async def close_session_async(self, session_id: str, wait: bool | float = True, details: bool = False):
        """close_session for callers on another event loop (runner actors): does not block it."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(session_id, wait), self.loop))
        return out if details else out[0]

    async def _close(self, session_id: str, wait: bool | float) -> tuple[list[Segment], dict]:
        if wait is False:
            return self._finish(session_id)
        lock = self.sessions[session_id].lock
        try:  # (a free lock is taken at once within the bound: wait_for with a timeout of 0 gave it no chance.
            # An unlocked lock was taken unbounded, but it can be unlocked with a woken turn queued ahead:
            # the close waited out that turn's whole engine call, and recorded a turn its agent had left)
            await (lock.acquire() if wait is True else asyncio.wait_for(lock.acquire(), max(1e-3, float(wait))))
        except asyncio.TimeoutError:  # a turn its agent left behind: not recorded (as a timed-out episode's)
            return self._finish(session_id)
        try:
            return self._finish(session_id)
        finally:
            lock.release()

    def _finish(self, session_id: str) -> tuple[list[Segment], dict]:
        if hasattr(self.engine, "release"):
            self.engine.release(session_id)
        for call in self._engine_waits.pop(session_id, ()):  # turns nobody will record: the engine stops them
            call.cancel()
        acc = self.sessions.pop(session_id)
        if self._undelivered.pop(session_id, None) is not None:  # a reply its client never took
            self.stats.undelivered += 1
        segments = acc.close()
        s = segment_stats(segments)
        self.stats.seals.update(s["seals"])
        self.stats.segment_totals.update({k: s[k] for k in SEGMENT_TOTALS})
        self.stats.truncated_sessions += int(acc.truncated)
        return segments, {"truncated": acc.truncated}

    # ------------------------------------------------------------------ HTTP plumbing
    def _error(self, protocol: str, status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
        self.stats.errors[status] += 1
        return JSONResponse(PROTOCOLS[protocol].error_body(status, message, param, code), status_code=status, headers=headers)

    async def _read_body(self, request: Request) -> bytes:
        """The request body, read chunk by chunk and refused (413) once it exceeds
        max_request_bytes; nothing beyond the limit is kept. The rest of a refused body is read
        and dropped up to drain_request_bytes, so that a client still sending reads the 413
        instead of a reset connection; a larger declared Content-Length is refused unread."""
        limit = self.max_request_bytes
        too_large = RequestError(413, f"the request body exceeds this server's limit of {limit} bytes "
                                      f"(max_request_bytes)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared and (not declared.isdigit() or len(declared) > 18 or int(declared) > self.drain_request_bytes):
            raise too_large if declared.isdigit() else RequestError(400, "the Content-Length header is not a number")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks = None  # over the limit: drop what was read, drain the rest
                if size > self.drain_request_bytes:
                    break  # the connection is closed after the response
            else:
                chunks.append(chunk)
        if chunks is None:
            raise too_large
        return b"".join(chunks)

    def _parse_request(self, api, body: dict, protocol: str) -> ChatRequest:
        """api.parse_request; a failure its checks did not foresee is still the request's fault
        (it depends on nothing else): a 400, logged and counted (unexpected_errors["parse"])."""
        try:
            req = api.parse_request(body)
            check_template_controls(body, self.fmt.template_kwargs, self.profile is not None and self.profile.thinks(),
                                    getattr(self.fmt, "renders_the_same_with", None))
            return req
        except RequestError:
            raise
        except Exception as e:
            self.stats.unexpected_errors["parse"] += 1
            log.warning("loopback %s request: unforeseen parse failure", protocol, exc_info=True)
            raise RequestError(400, f"the request does not follow the {protocol} schema ({type(e).__name__})") from None

    async def _parse_json(self, raw: bytes):
        """protocol.loads (bounded depth, number sizes, valid Unicode), in a worker thread for
        large bodies."""
        if len(raw) > self.thread_json_bytes:
            return await asyncio.to_thread(loads, raw)
        return loads(raw)

    def _authorized(self, request: Request) -> bool:
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        return secrets.compare_digest(key.encode(), self.api_key.encode())

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        # (/v1/messages/count_tokens, /v1/messages/batches: Anthropic's shape too, which its SDK reads)
        protocol = "anthropic" if "/messages" in request.url.path else "openai"
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
                raw = await self._read_body(request)
            except ClientDisconnect:
                raise RequestError(400, "the client disconnected while sending the request") from None
            body = await self._parse_json(raw)
            if not isinstance(body, dict):
                raise RequestError(400, "request body must be a JSON object")
            if sid is not None and sid not in self.sessions:
                raise RequestError(404, f"unknown session {sid!r}: the framework opens sessions before handing out base URLs")
            req = self._parse_request(api, body, protocol)
            req.retry, req.size = retry_count(request) >= 1, len(raw)
            req.client_gone = request.is_disconnected  # (a streamed request's is its response's: _stream)
            if req.stream:
                return await self._stream(api, req, sid, t0)
            reply, engine_s = await (self._side_turn(req) if sid is None else self._session_turn(sid, req))
        except RequestError as e:
            return self._error(protocol, e.status, e.message, e.param, e.code, e.headers)
        except EngineCallFailed as f:  # nothing was recorded; the client sees no traceback, pid, host or actor id
            e = engine_error(f.error, self.retry_after_s)
            if e is not None:
                log.log(logging.WARNING if e.status >= 500 else logging.INFO, "loopback %s request: engine call failed, "
                        "answered %d (session %s)", protocol, e.status, sid, exc_info=f.error)
                return self._error(protocol, e.status, e.message, e.param, e.code, e.headers)
            error_id = uuid.uuid4().hex[:12]
            self.stats.unexpected_errors["internal"] += 1
            log.error("loopback %s request: engine call failed (error %s, session %s)", protocol, error_id, sid, exc_info=f.error)
            return self._error(protocol, 500, f"generation failed: internal engine error {type(unwrap(f.error)).__name__} "
                                              f"(error id {error_id}); the detail is in the server's log")
        except Exception:  # a failure no check foresaw: nothing was recorded; the detail goes to the log only
            error_id = uuid.uuid4().hex[:12]
            self.stats.unexpected_errors["internal"] += 1
            log.error("loopback %s request failed (error %s, session %s)", protocol, error_id, sid, exc_info=True)
            return self._error(protocol, 500, f"internal server error (error id {error_id}); the detail is in the "
                                              f"server's log")
        self.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
        self.stats.engine_s.append(engine_s)
        return JSONResponse(api.response_body(reply, req, self.model_name))

    # ------------------------------------------------------------------ streaming (loopback/streaming.py)
    async def _stream(self, api, req: ChatRequest, sid: str | None, t0: float):
        """A streamed request: the turn (the same one an unstreamed request runs) is a task that
        reports the sampled ids to req.feed. The response starts with the first sampled ids (or the
        turn's end), so that a request that fails before any token gets its status as unstreamed."""
        feed = req.feed = TokenFeed()
        # Once the response streams, its own task reads the client's disconnect (Starlette's
        # StreamingResponse) and _stream_parts marks the feed when it is cancelled; a client that
        # left before the first ids never gets a response (its body never starts): the request asks
        http_gone = req.client_gone

        async def gone() -> bool:
            return feed.gone or (http_gone is not None and bool(await http_gone()))

        req.client_gone = gone
        turn = asyncio.ensure_future(self._side_turn(req) if sid is None else self._session_turn(sid, req))
        turn.add_done_callback(lambda t: t.cancelled() or t.exception())  # a client gone mid-stream: no warning
        while not (turn.done() or feed.ids):
            await self._changed(feed, turn)
        prompt_tokens = feed.prompt_tokens if not turn.done() else turn.result()[0].prompt_tokens  # raises its error
        head = Reply(finish="", prompt_tokens=prompt_tokens or 0)
        return StreamingResponse(api.stream_events(head, self._stream_parts(req, turn, sid, t0), req, self.model_name),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @staticmethod
    async def _changed(feed: TokenFeed, turn) -> None:
        feed.changed.clear()
        waiter = asyncio.ensure_future(feed.changed.wait())
        try:
            await asyncio.wait([turn, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:  # (cancelled here, a client gone mid-stream: the waiter was left pending, logged at its end)
            waiter.cancel()

    async def _stream_parts(self, req: ChatRequest, turn, sid, t0):
        """("reasoning" | "content", text) deltas as the ids arrive, the rest once the turn is
        done, then its Reply; or ("error", status, message) when the turn failed after the start."""
        feed = req.feed
        text = ReplyStream(self.fmt, self.reply_parser, req, feed.prompt_tail)
        k = 0
        try:
            while k < len(feed.ids) or not turn.done():
                if k < len(feed.ids):
                    new, k = feed.ids[k:], len(feed.ids)
                    for part in text.feed(new):
                        yield part
                else:
                    await self._changed(feed, turn)
        except (GeneratorExit, asyncio.CancelledError):
            # the client left mid-stream: no SDK retries a stream that started, so nothing of the turn
            # is kept for one; it is cancelled (it sampled on to max_tokens holding the session's lock,
            # and the agent's next request waited for the reply nobody would read)
            feed.gone = True
            if not turn.done():
                # (its reply, never finished, is not recorded; a side call's is never recorded: not counted)
                self.stats.undelivered += sid is not None
                turn.cancel()
            raise
        try:
            reply, engine_s = turn.result()
        except Exception as e:
            status, message = self._stream_failure(e, sid)
            self.stats.errors[status] += 1
            yield ("error", status, message)
            return
        self.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
        self.stats.engine_s.append(engine_s)
        for part in text.finish(reply):
            yield part
        yield reply

    def _stream_failure(self, e: Exception, sid) -> tuple[int, str]:
        """What a streamed turn that failed after its response started tells the client, in an
        error event (the status went out with the first ids): as _handle answers the same error."""
        if isinstance(e, RequestError):
            return e.status, e.message
        if isinstance(e, EngineCallFailed):
            known = engine_error(e.error, self.retry_after_s)
            if known is not None:
                log.log(logging.WARNING, "loopback streamed request: engine call failed (session %s)", sid, exc_info=e.error)
                return known.status, known.message
            # one no check foresaw: counted and logged as the unstreamed path does (it went uncounted)
            error_id = uuid.uuid4().hex[:12]
            self.stats.unexpected_errors["internal"] += 1
            log.error("loopback streamed request: engine call failed (error %s, session %s)", error_id, sid, exc_info=e.error)
            return 500, (f"generation failed: internal engine error {type(unwrap(e.error)).__name__} (error id {error_id}); "
                         f"the detail is in the server's log")
        error_id = uuid.uuid4().hex[:12]
        self.stats.unexpected_errors["internal"] += 1
        log.error("loopback streamed request failed (error %s, session %s)", error_id, sid, exc_info=e)
        return 500, f"internal server error (error id {error_id}); the detail is in the server's log"

    # ------------------------------------------------------------------ turns
    def _fit(self, req: ChatRequest, sampling: SamplingConfig, prompt_len: int, default: int) -> tuple[bool, bool]:
        """Set sampling.max_tokens: the request's (or `default`), clamped to the room the
        context leaves. Returns (room left?, clamped?)."""
        room = self.max_model_len - prompt_len
        wanted = req.max_tokens or default
        if room < 1:
            return False, True
        sampling.max_tokens = min(wanted, room)
        return True, sampling.max_tokens < wanted

    def _policy_sampling(self, req: ChatRequest, sid: str, call: int = 0) -> tuple[SamplingConfig, list[str]]:
        """The sampling of a recorded turn: the policy's distribution, the agent's max_tokens,
        stop strings, seed (made the session's and the turn's own: session_seed, with the
        session's engine calls so far, `call`) and ignore_eos (which leaves the family's turn-ending
        tokens stopping the turn: the runner makes them stop tokens of the policy's sampling). Also the sent
        fields that differ from the policy's (override mode counts them; strict mode refuses
        the request here)."""
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
                              ignore_eos=a.ignore_eos or p.ignore_eos,
                              seed=session_seed(a.seed if a.seed is not None else p.seed, sid, call)), differing

    async def turn(self, session_id: str, messages: list[dict], tools: list | None, sampling) -> Reply:
        """One recorded turn without HTTP, for the framework-owned Env loop: the same
        accumulator and bookkeeping as a request through the SDKs (`sampling` counts as sent:
        its temperature and top_p meet the policy's like a request's). Callable from any loop."""
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        req = ChatRequest(messages=order_tool_results(messages), tools=tools, sampling=copy.copy(sampling), max_tokens=sampling.max_tokens,
                          sent={"temperature": sampling.temperature, "top_p": sampling.top_p}, parse_tools=bool(tools),
                          size=sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 1024 for m in messages))
        # counted and logged as a request's are (an Env run's summary read no requests and no errors,
        # every engine call failing included)
        self.stats.requests["env:session"] += 1
        fut = asyncio.run_coroutine_threadsafe(self._session_turn(session_id, req), self.loop)
        try:
            reply, _ = await asyncio.wrap_future(fut)
        except EngineCallFailed as e:
            mapped = engine_error(e.error, self.retry_after_s)
            self.stats.errors[mapped.status if mapped is not None else 500] += 1
            log.warning("loopback Env turn: engine call failed (session %s)", session_id, exc_info=e.error)
            raise e.error from None  # the framework's own loop sees the engine's exception
        return reply

    async def _session_turn(self, sid: str, req: ChatRequest):
        acc = self.sessions.get(sid)
        if acc is None:  # closed between the request's check and this turn (a streamed turn is a task): not a 500
            raise RequestError(404, f"unknown session {sid!r}: it was closed")
        async with acc.lock:
            if self.sessions.get(sid) is not acc:  # closed while it waited behind the session's turn in flight
                raise RequestError(404, f"session {sid!r} was closed")
            # strict mode refuses here: nothing recorded
            sampling, differing = self._policy_sampling(req, sid, acc.engine_calls)
            req.own_stop = tuple(req.sampling.stop)
            req.sampling = sampling  # stop strings are applied to the reply from here
            held = self._undelivered.pop(sid, None)
            if held is not None:  # a reply sampled for a client that had gone (below)
                key, reply, record = held
                if req.retry and key == request_key([getattr(acc.fmt, "canonical", canonical_message)(m) for m in req.messages],
                                                    req.tools):
                    if await self._client_gone(req):  # this retry's client is gone too: still held
                        self._undelivered[sid] = held
                        raise RequestError(499, "the client disconnected before the reply: held for its retry")
                    record()  # its SDK's retry (rule 4): delivered now, so recorded now
                    self.stats.retries_served_from_cache += 1
                    return reply, 0.0
                self.stats.undelivered += 1  # never delivered: not recorded
            plan = await self._plan(acc, req)  # render + encode in a worker thread
            if plan.cached is not None:
                self.stats.retries_served_from_cache += 1
                return plan.cached, 0.0
            # an agent that sends no max_tokens gets the policy's (the loop's SamplingConfig)
            room, clamped = self._fit(req, sampling, len(plan.prompt_ids), self.policy_sampling.max_tokens)
            if not room:  # the conversation has outgrown the context: end the turn, record nothing
                acc.context_cut = True
                return Reply(finish="length", prompt_tokens=len(plan.prompt_ids), truncated=True), 0.0
            if self.sessions.get(sid) is not acc:  # closed while it planned: no engine call that nobody records
                raise RequestError(404, f"session {sid!r} was closed")
            t = time.perf_counter()
            acc.engine_calls += 1  # the next turn's seed differs (session_seed)
            # a task of its own, which a session closed under it cancels (_finish): the request's
            # handler then answers a 404 (cancelled itself, uvicorn logged an ASGI error and sent a 500)
            call = asyncio.ensure_future(call_engine(self.engine, plan.prompt_ids, sampling, sid, self.return_routed_experts, req.feed))
            waiting = self._engine_waits.setdefault(sid, set())
            waiting.add(call)
            try:
                sample = finished(await call)
            except asyncio.CancelledError:
                acc.forget_last_request(plan)
                if call.cancelled() and not asyncio.current_task().cancelling():
                    raise RequestError(404, f"session {sid!r} was closed while this request was in flight") from None
                raise
            except BaseException as e:
                acc.forget_last_request(plan)  # its retry must not get an older identical request's reply
                if isinstance(e, Exception):
                    raise EngineCallFailed(e) from e
                raise
            finally:
                waiting.discard(call)
            engine_s = time.perf_counter() - t
            if self.sessions.get(sid) is not acc:  # closed meanwhile (episode timed out): drop
                raise RequestError(404, f"session {sid!r} was closed while this request was in flight")
            try:
                reply = self._reply(sample, req, plan.prompt_ids)
            except BaseException:
                acc.forget_last_request(plan)  # nothing recorded for it either: as for a failed engine call
                raise

            def record():
                # cut by the context; or by a budget at least the policy's (SamplingConfig.max_tokens,
                # the generation budget the loop sets: TRL's max_completion_length, what DAPO's
                # overlong filtering masks), which counts where the episode ends on it (a later reply
                # clears it); an agent's own smaller max_tokens is its choice (it sees "length"). A
                # recorded reply the context did not cut clears an earlier context cut: the agent
                # went on, compacted, and this reply, not that one, is where its episode stands.
                cut = sample.finish_reason == "length"
                acc.context_cut = cut and clamped
                acc.last_reply_cut = cut and not clamped and sampling.max_tokens >= self.policy_sampling.max_tokens
                reply.truncated = cut and (clamped or acc.last_reply_cut)
                acc.record(plan, sample, reply.assistant_message(), reply=reply, sampling_overridden=bool(differing),
                           temperature=sampling.temperature, top_p=sampling.top_p)

            if await self._client_gone(req):
                # The client left before the reply was done (its own timeout, a cancelled call). It
                # is held, not recorded: its SDK's retry of the request takes it (and records it);
                # any other next request (the agent's own re-ask: a new sample) or the session's end
                # drops it. Recorded at once, a reply the agent never received stayed in the
                # trajectory beside its re-ask's, under the episode's reward (and the replies slow
                # enough to time out are the long, run-on ones).
                acc.forget_last_request(plan)
                self._undelivered[sid] = (request_key(plan.messages, plan.tools), reply, record)
                raise RequestError(499, "the client disconnected before the reply was done: held for its retry")
            record()
            return reply, engine_s

    @staticmethod
    async def _client_gone(req: ChatRequest) -> bool:
        if req.client_gone is None:
            return False
        gone = req.client_gone()
        return bool(await gone) if inspect.isawaitable(gone) else bool(gone)

    async def _plan(self, acc: Accumulator, req: ChatRequest):
        """acc.plan (template render + encode); for a request over thread_plan_bytes in a worker
        thread, so that a huge request does not stall the event loop and every other session
        (the session's lock, held by the caller, keeps its turns in order; plan records nothing,
        but may switch the session's current conversation: a request cancelled meanwhile, its
        client gone, waits for its thread, so that the lock is not released while it runs)."""
        try:
            if req.size > self.thread_plan_bytes:
                planned = asyncio.ensure_future(asyncio.to_thread(acc.plan, req.messages, req.tools, retry=req.retry))
                try:
                    return await asyncio.shield(planned)
                except asyncio.CancelledError:
                    while not planned.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.shield(planned)
                    raise
            return acc.plan(req.messages, req.tools, retry=req.retry)
        except Exception as e:  # template errors (e.g. a role it refuses) are the request's fault
            import jinja2

            if not (isinstance(e, jinja2.TemplateError) or getattr(acc.fmt, "is_refusal", lambda _: False)(e)):
                # not the template's refusal: maybe the messages' shape, maybe a bug of the recording
                # code (Accumulator.plan); still the request's 400, but counted and logged, where a
                # regression there showed only as agents' BadRequestErrors
                self.stats.unexpected_errors["plan"] += 1
                log.warning("loopback: planning a turn raised %s (answered 400)", type(e).__name__, exc_info=True)
            raise RequestError(400, f"the chat template cannot render these messages: {scrub(e)}", param="messages")

    async def _side_turn(self, req: ChatRequest):
        for n, v in req.sent.items():  # the agent's temperature/top_p are honoured; others cannot be
            if n not in ("temperature", "top_p") and differs(n, v, self.policy_sampling):
                raise RequestError(400, f"'{n}' is not supported: the engine samples with temperature and top_p only", param=n)
        if not req.sampling.ignore_eos:
            # the family's turn-ending tokens, as for a recorded turn (the runner adds them to the
            # policy's sampling): a Qwen3 judge's reply ending on <|endoftext|> kept the literal token
            # in its text ("10<|endoftext|>": the judge agent's score parsed as none, the reward 0)
            req.sampling.stop_token_ids = list(dict.fromkeys(self.policy_sampling.stop_token_ids + req.sampling.stop_token_ids))
        fmt = threaded_format(self.fmt, self.thread_plan_bytes, self.prompts)
        try:
            if req.size > self.thread_plan_bytes:
                _, ids = await asyncio.to_thread(fmt.prompt, req.messages, req.tools)
            else:
                _, ids = fmt.prompt(req.messages, req.tools)
        except Exception as e:
            raise RequestError(400, f"the chat template cannot render these messages: {scrub(e)}", param="messages")
        # without max_tokens the room the context leaves, as the OpenAI API and vLLM give (the server's 256
        # cut a judge that reasons before its score: paid 0)
        room, _ = self._fit(req, req.sampling, len(ids), self.max_model_len)
        if not room:
            raise RequestError(400, f"the prompt is {len(ids)} tokens, but the context is {self.max_model_len} tokens",
                               param="messages", code="context_length_exceeded")
        t = time.perf_counter()
        # a task, cancelled once its client has gone (uvicorn does not cancel a handler whose client left, and a
        # side call has no session whose end cancels it): a judge call of an episode that timed out sampled on to
        # its max_tokens (the room left in the context), holding a batch slot beside the live episodes
        call = asyncio.ensure_future(call_engine(self.side_engine, ids, req.sampling, feed=req.feed))
        try:
            while not (await asyncio.wait([call], timeout=CLIENT_POLL_S))[0]:
                if await self._client_gone(req):
                    raise RequestError(499, "the client disconnected before the reply was done")
            sample = finished(call.result())
        except Exception as e:
            if isinstance(e, RequestError):
                raise
            raise EngineCallFailed(e) from e
        finally:
            call.cancel()
        return self._reply(sample, req, ids), time.perf_counter() - t

    def _reply(self, sample, req: ChatRequest, prompt_ids: list[int]) -> Reply:
        parser = self.reply_parser  # special tokens kept where vLLM's parser asks for them (not the turn's end)
        text, ids = reply_text(self.fmt, sample.token_ids, sample.finish_reason, parser.skip_special_tokens,
                               req.sampling.stop_token_ids)
        finish, stop_seq = sample.finish_reason, None
        hits = [(text.find(s), s) for s in req.sampling.stop if s and s in text]
        if hits:  # a stop string ends the text (the ids that produced it stay recorded)
            cut, hit = min(hits)
            text = text[:cut]
            # the request's own: its stop_sequence; the policy's (LoopConfig's stop strings) ends the turn as a
            # plain stop (Anthropic's stop_sequence names one the agent sent: it read one it never had)
            own = hit in (req.sampling.stop if req.own_stop is None else req.own_stop)
            stop_seq, finish = (hit, "stop_sequence") if own else (None, "stop")
            ids = ids_before(self.fmt, ids, cut, parser.skip_special_tokens)  # (a parser that reads the ids)
        # a reply cut by max_tokens is not read for tool calls (its last may be half written: vLLM's
        # qwen3_coder parser returned a cut call with {} arguments, which an Env then ran): its markup
        # stays content, and both protocols say it was cut
        opened = parser.prompt_opens_reasoning(self.fmt, prompt_ids[-8:])
        parsed = parser.parse(text, ids, parse_tools=req.parse_tools and finish != "length", tools=req.tools, opened=opened)
        # Mistral's templates render the ids: the ones the model wrote where it wrote valid ones,
        # so that each tool result names a call id that is in the context
        written = sampled_call_ids(text, parsed.calls) if self.tool_call_ids == "alnum9" else [None] * len(parsed.calls)
        reply = Reply(
            content=parsed.content, reasoning=parsed.reasoning,
            tool_calls=[{"id": cid or new_tool_call_id(self.tool_call_ids), **c} for cid, c in zip(written, parsed.calls)],
            finish=finish, stop_sequence=stop_seq, prompt_tokens=len(prompt_ids), completion_tokens=len(sample.token_ids),
            token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
        )
        if req.logprobs:  # each token's bytes from its vocabulary piece (decoded alone, a split character's
            # part was U+FFFD and a SentencePiece piece lost its leading space)
            reply.token_bytes = self.fmt.token_bytes(sample.token_ids)
            reply.token_strs = [b.decode("utf-8", "replace") for b in reply.token_bytes]
        if len(reply.tool_calls) > 1 and not self._renders_back(req, reply):
            # parallel calls the template cannot render as history (Llama 3.1: "only supports single
            # tool-calls at once"): handed out, every later request of the episode was a 400, the
            # episode failed and was dropped, so replies with parallel calls never trained. As text,
            # as a call the agent could not send back is (counted)
            parser.failures += 1
            plain = parser.as_text(text, ids, req.tools, opened)
            reply = dataclasses.replace(reply, content=plain.content, reasoning=plain.reasoning, tool_calls=[])
        return reply

    def _renders_back(self, req: ChatRequest, reply: Reply) -> bool:
        """Whether the template renders the conversation with this reply in it (the agent's next request)."""
        canonical = getattr(self.fmt, "canonical", canonical_message)  # (as Accumulator.plan renders them)
        try:
            self.fmt.render([canonical(m) for m in [*req.messages, reply.assistant_message()]], req.tools,
                            add_generation_prompt=False)
            return True
        except Exception:
            return False

    def summary(self) -> dict:
        """Server-wide measurements, open sessions included. Callable from any thread: the
        server's loop opens and closes sessions meanwhile, so the open ones are copied first
        (one C-level copy under the GIL; iterating the dict raised 'changed size')."""
        open_accs = list(self.sessions.values())
        open_stats = segment_stats([s for acc in open_accs for s in list(acc.segments)])
        ov = sorted(self.stats.overhead_s)
        pct = (lambda q: ov[min(len(ov) - 1, int(q * len(ov)))] if ov else None)
        return {
            "requests": dict(self.stats.requests), "errors": dict(self.stats.errors),
            "retries_served_from_cache": self.stats.retries_served_from_cache,
            "seals": dict(self.stats.seals + Counter(open_stats["seals"])),
            **{k: self.stats.segment_totals[k] + open_stats[k] for k in SEGMENT_TOTALS},
            "sampling_refused": dict(self.stats.sampling_refused),
            "truncated_sessions": self.stats.truncated_sessions + sum(acc.truncated for acc in open_accs),
            "unexpected_errors": dict(self.stats.unexpected_errors),
            # replies a tool/reasoning parser raised on, handed to the agent as plain content (a
            # tool call in them never reached it): counted, where only the log said so
            "parser_failures": self.reply_parser.failures,
            # requests whose tools the chat template left out of the prompt (ChatFormat._renders_tools)
            "tools_unrendered": getattr(self.fmt, "tools_unrendered", 0),
            "overhead_p50_s": pct(0.5), "overhead_p99_s": pct(0.99),
            "open_sessions": len(open_accs),  # episodes in flight (a leaked one stays counted)
            "undelivered": self.stats.undelivered,  # replies whose client had gone: not recorded
        }
