"""What both wire protocols share: the parsed request, the protocol-neutral reply, request
errors, the bounded JSON reader, and small field validators that name the offending field and
the bound it broke.

Every bound below is what the engine accepts (vLLM 0.32: `SamplingParams._verify_args` and its
OpenAI server's request models), so a request the engine would refuse is refused here with a
400 that names the field, before anything is planned or sampled."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..rollout.engine import SamplingConfig

# The JSON a request body may hold. Real agent requests nest 5-15 levels (tool schemas the most);
# Python's json module recurses in C and raises RecursionError at ~1000 levels, and deep
# structures that parse still break later code (templates, deep copies). Number literals are
# bounded in characters before they are converted (Python refuses ints over 4300 digits with a
# ValueError; a 300-digit int overflows float()).
MAX_JSON_DEPTH = 64
MAX_NUMBER_CHARS = 100
# What vLLM accepts. seed: vLLM's OpenAI server validates -2**63 <= seed <= 2**63-1 (its samplers
# hold seeds as int64; -1 means "no seed"); max_tokens the same range (clamped to the context).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Stop strings: vLLM refuses an empty one; a request may send at most MAX_STOP of at most
# MAX_STOP_CHARS characters each (vLLM checks every stop string against the tail of the output at
# every step: unbounded lists would slow every other request on the engine).
MAX_STOP, MAX_STOP_CHARS = 64, 1024


class RequestError(Exception):
    """A request the server refuses: a 4xx (or a 503 with `Retry-After` when no engine can
    serve it) in the protocol's own error shape. `message` is shown to the client: it names
    the field and the bound, never a traceback or a process, host or actor id."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def short(value, n: int = 40) -> str:
    """A value for an error message: its repr, cut to about n characters."""
    if isinstance(value, int) and not isinstance(value, bool) and len(s := str(value)) > n:
        return f"{s[:12]}... ({len(s.lstrip('-'))} digits)"
    r = repr(value)
    return r if len(r) <= n else f"{r[:n]}... ({type(value).__name__} of {len(value) if hasattr(value, '__len__') else '?'})"


def _number_literal(kind):
    def parse(s: str):
        if len(s) > MAX_NUMBER_CHARS:
            raise RequestError(400, f"the request body holds a number literal of {len(s)} characters; at most "
                                    f"{MAX_NUMBER_CHARS} are accepted", code="number_too_long")
        return kind(s)
    return parse


def _no_constant(s: str):
    raise RequestError(400, f"the request body is not valid JSON: {s} is not a JSON number")


_parse_int, _parse_float = _number_literal(int), _number_literal(float)


def loads(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, what: str = "the request body"):
    """JSON text to Python, or a RequestError(400) naming what is wrong: invalid UTF-8 or JSON,
    nesting deeper than `max_depth` (also when Python's own parser gives up on it first), a
    number literal longer than MAX_NUMBER_CHARS, NaN/Infinity, a string with a lone surrogate."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(400, f"{what} is not valid UTF-8: {e.reason} at byte {e.start}")
    try:
        obj = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, f"{what} nests JSON deeper than {max_depth} levels", code="json_too_deep") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, f"{what} is not valid JSON: {e}") from None
    # a lone surrogate can only come from a \uD800-\uDFFF escape (strict UTF-8 decoding refuses
    # encoded ones): without such an escape in the text, no string needs checking
    check_tree(obj, max_depth, what, strings="\\ud" in raw or "\\uD" in raw)
    return obj


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_tree(obj, max_depth: int = MAX_JSON_DEPTH, what: str = "the request body", strings: bool = True) -> None:
    """Iteratively (no recursion to exhaust): containers nest at most `max_depth` levels and,
    with `strings`, every string (keys too) is valid Unicode (JSON's \\ud800 escapes decode to
    lone surrogates, which neither the tokenizer nor the engine's transport can encode)."""
    if not isinstance(obj, (dict, list)):
        if strings and isinstance(obj, str) and not _utf8(obj):
            raise _surrogate_error(obj, what)
        return
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > max_depth:
            raise RequestError(400, f"{what} nests JSON deeper than {max_depth} levels", code="json_too_deep")
        if isinstance(o, dict):
            if strings and not all(map(_utf8, o)):
                raise _surrogate_error(obj, what)
            o = o.values()
        for v in o:
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))
            elif strings and isinstance(v, str) and not _utf8(v):
                raise _surrogate_error(obj, what)


def _surrogate_error(obj, what: str) -> RequestError:
    """Where the first string that is not valid Unicode sits (a second, path-keeping walk: errors only)."""
    stack = [(obj, "")]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            if not _utf8(o):
                break
        elif isinstance(o, dict):
            for k, v in o.items():
                if not _utf8(k):
                    break
                stack.append((v, f"{path}.{k}" if path else k))
            else:
                continue
            break
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
    else:
        path = ""
    where = f"'{path}'" if path else what
    return RequestError(400, f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): strings must be "
                             f"valid Unicode", param=path or None, code="invalid_unicode")


@dataclass
class ChatRequest:
    """A request in the canonical chat form the accumulator takes (OpenAI-style messages:
    role/content/tool_calls; tools as OpenAI function specs)."""

    messages: list[dict]
    tools: list[dict] | None
    sampling: SamplingConfig | None  # max_tokens may be None: the server fills the default
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    parse_tools: bool = True  # False for tool_choice "none" and for a request that declares no tools
    sent: dict = field(default_factory=dict)  # distribution fields the request sent (protocol.sampling_from)
    retry: bool = False  # the client says this is a retry of its previous request (x-stainless-retry-count >= 1)
    size: int = 0  # bytes of the request body (or characters of its messages): large ones are planned in a thread
    feed: object = None  # a streamed request's streaming.TokenFeed: the engine call reports sampled ids to it
    # () -> bool, or an awaitable of one: whether the client has gone (the server asks before it
    # records the reply: one the agent never received must not train); None: never asked
    client_gone: object = None
    # the request's own stop strings, where the server merged the policy's into `sampling` (a recorded
    # turn); None: every stop string in `sampling` is the request's. A policy's stop string ends the
    # text, but is no stop_sequence the agent sent (Anthropic's stop_sequence is one of the request's)
    own_stop: tuple | None = None


@dataclass
class Reply:
    """One assistant reply, before it is put into either wire format."""

    finish: str  # "stop" | "length" | "stop_sequence" | "abort"; "" in a stream's head
    prompt_tokens: int
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments" (dict)}
    stop_sequence: str | None = None
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_strs: list[str] = field(default_factory=list)  # each token's text (a split character's part: U+FFFD)
    token_bytes: list[bytes] = field(default_factory=list)  # ... and its own bytes (joined: the text)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    truncated: bool = False  # cut by the context (max_tokens clamped to the room left and hit, or no room) or the policy's max_tokens
    reasoning: str | None = None  # the reasoning the profile's reasoning parser split off (None: none)

    def assistant_message(self) -> dict:
        """The assistant message as the accumulator records it (and as clients send it back:
        canonical_message keeps of it what the profile's template renders)."""
        msg = {
            "role": "assistant",
            "content": self.content,
            "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                           for c in self.tool_calls],
        }
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        return msg


# Streamed replies carry reasoning and content in pieces of at most this many characters, as a
# token-by-token stream would (a tool call goes whole, in one delta); the SDKs assemble them.
PIECE_CHARS = 16


def pieces(text: str, n: int = PIECE_CHARS) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Each assistant turn's tool results in the order of its calls, matched by id. OpenAI and
    Anthropic match a result to its call by id, in any order; templates render results in the
    order sent, with no id: results sent as they finished (parallel tools) gave each call the other's
    result in the trained context. Where the calls and their results all carry ids, the results
    are put in call order (a stable rule: later requests extend the same text), and a call left
    unanswered, a result for no call or a call answered twice is refused, as both APIs refuse it.
    Results without ids keep their places (matched by position, as the template renders them)."""
    out, i = list(messages), 0
    while i < len(out):
        calls = out[i].get("tool_calls") if out[i].get("role") == "assistant" else None
        j = i + 1
        while j < len(out) and out[j].get("role") == "tool":
            j += 1
        ids = [c.get("id") for c in calls or ()]
        got = [r.get("tool_call_id") for r in out[i + 1:j]]
        if calls and got and all(isinstance(x, str) for x in ids + got) and len(set(ids)) == len(ids):
            unknown = [x for x in got if x not in ids]
            twice = sorted({x for x in got if got.count(x) > 1})
            missing = [x for x in ids if x not in got]
            if unknown or twice or missing:
                what = "; ".join(f"{label} {xs}" for label, xs in (("results for no call of it:", unknown),
                                 ("calls answered twice:", twice), ("calls left unanswered:", missing)) if xs)
                raise RequestError(400, f"the tool results after the assistant turn calling {ids} do not answer its "
                                        f"calls one each ({what}): each call needs exactly one result with its id",
                                   param="messages")
            out[i + 1:j] = sorted(out[i + 1:j], key=lambda r: ids.index(r["tool_call_id"]))
        i = j if calls else i + 1
    return out


def want(body: dict, name: str, types, required: bool = False, default=None):
    """body[name] checked against `types`, or a RequestError naming the field."""
    if name not in body or body[name] is None:
        if required:
            raise RequestError(400, f"missing required field '{name}'", param=name)
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise RequestError(400, f"field '{name}' has the wrong type: got a boolean", param=name)
    if not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise RequestError(400, f"field '{name}' must be {expected}, got {type(value).__name__}", param=name)
    return value


# Request fields that change the per-token distribution the engine samples from, with the value
# that means "not applied". The engine implements temperature and top_p; the others it cannot
# honour. On recorded turns the policy's sampling replaces all of them (server.py); on the side
# route temperature/top_p are the agent's and the others are refused unless they are "off".
DISTRIBUTION_FIELDS = {"temperature": None, "top_p": None, "top_k": (None, -1, 0), "min_p": (None, 0),
                       "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                       "repetition_penalty": (None, 1), "logit_bias": (None, {})}
SAMPLING_MODES = ("override", "strict")


def check_sampling_mode(mode: str) -> str:
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling_mode {mode!r} unknown: 'override' (the policy's sampling replaces an agent's, "
                         f"counted as sampling_overridden) or 'strict' (such a request gets a 400)")
    return mode


# Numeric request fields and what the engine accepts for each: (low, high, low excluded?,
# integers only?). vLLM 0.32 SamplingParams._verify_args: temperature in [0, 2], top_p in (0, 1],
# top_k -1, 0 (off) or >= 1 (an integer), min_p in [0, 1], presence/frequency penalties in
# [-2, 2], repetition_penalty > 0; its OpenAI server: seed a signed 64-bit integer, top_logprobs
# in [0, 20], logit_bias values in [-100, 100]. top_p takes OpenAI's and Anthropic's [0, 1]: 0 (an agent's
# "deterministic") was a 400 on every request, its episodes dropped, where the policy's sampling replaces
# it anyway; where it reaches an engine (the side route) it is the smallest nucleus (GREEDY_TOP_P).
NUMBER_BOUNDS = {
    "temperature": (0, 2, False, False), "top_p": (0, 1, False, False), "top_k": (-1, INT64_MAX, False, True),
    "min_p": (0, 1, False, False), "presence_penalty": (-2, 2, False, False), "frequency_penalty": (-2, 2, False, False),
    "repetition_penalty": (0, None, True, False), "seed": (INT64_MIN, INT64_MAX, False, True),
    "max_tokens": (1, INT64_MAX, False, True), "max_completion_tokens": (1, INT64_MAX, False, True),
    "n": (1, INT64_MAX, False, True), "top_logprobs": (0, 20, False, True),
}


GREEDY_TOP_P = 1e-9  # top_p 0 as an engine takes it (vLLM refuses 0): the most likely token alone


def _bound(b) -> str:
    return {INT64_MAX: "2**63-1", INT64_MIN: "-2**63"}.get(b, str(b))


def number(body: dict, name: str, required: bool = False, default=None):
    """body[name] as a number within what the engine accepts (NUMBER_BOUNDS), or a RequestError
    naming the field and the bound. Absent or null: `default`."""
    lo, hi, lo_open, integer = NUMBER_BOUNDS[name]
    value = want(body, name, int if integer else (int, float), required=required)
    if value is None:
        return default
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a finite number, got {value}", param=name)
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        span = f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi) + ']' if hi is not None else 'inf)'}"
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{name}' must be {kind} in {span}, got {short(value)}", param=name, code="out_of_range")
    return value


def stop_strings(value, name: str) -> list[str]:
    """Stop strings as the engine accepts them: non-empty valid strings, at most MAX_STOP of at
    most MAX_STOP_CHARS characters."""
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(400, f"'{name}' must be a string or a list of strings", param=name)
    if len(value) > MAX_STOP:
        raise RequestError(400, f"'{name}' holds {len(value)} stop strings; at most {MAX_STOP} are accepted", param=name)
    for i, s in enumerate(value):
        if not s:
            raise RequestError(400, f"'{name}[{i}]' is empty: the engine refuses an empty stop string", param=name)
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(400, f"'{name}[{i}]' has {len(s)} characters; at most {MAX_STOP_CHARS} are accepted",
                               param=name)
        if not _utf8(s):
            raise RequestError(400, f"'{name}[{i}]' holds a lone surrogate: stop strings must be valid Unicode",
                               param=name, code="invalid_unicode")
    return value


def _logit_bias(body: dict) -> dict:
    bias = want(body, "logit_bias", dict)
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 19):
            raise RequestError(400, f"'logit_bias' keys must be token ids (decimal strings), got {short(k)}", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(400, f"'logit_bias[{k}]' must be a number in [-100, 100], got {short(v)}", param="logit_bias")
    return bias


# Request fields that ask the engine to constrain or reshape decoding (structured output, one tool
# call at most, vLLM's extras), with the values that ask for nothing. Nothing here constrains
# decoding, and cutting a reply to fit would leave ids the agent never saw in the model's context:
# any other value gets a 400 naming the field, where it used to be ignored.
DECODING_FIELDS = {"parallel_tool_calls": (None, True), "functions": (None, []), "function_call": (None,),
                   "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
                   "guided_choice": (None,), "guided_grammar": (None,), "min_tokens": (None, 0),
                   "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
                   "skip_special_tokens": (None, True),
                   # vLLM's sampling extras that constrain or reshape decoding (they were accepted and
                   # ignored: `bad_words: ["y"]` got "y" back), and its prompt extras that change the ids
                   "allowed_token_ids": (None, []), "bad_words": (None, []), "use_beam_search": (None, False),
                   "length_penalty": (None, 1, 1.0), "thinking_token_budget": (None,), "watermarking": (None, False),
                   "repetition_detection": (None,), "truncate_prompt_tokens": (None,), "add_special_tokens": (None, False)}


def check_decoding_controls(body: dict) -> None:
    for name, off in DECODING_FIELDS.items():
        value = body.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise RequestError(400, f"'{name}' is {short(value)}, which is not supported: the loopback server samples "
                                    f"without constraining decoding (omit it)", param=name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError(400, "'response_format' other than {'type': 'text'} is not supported: the loopback server does "
                                "not constrain decoding (ask for JSON in the prompt and parse the reply)", param="response_format")


def check_template_controls(body: dict, template_kwargs: dict, thinks: bool = False, same_render=None) -> None:
    """vLLM's request extras that change how the prompt renders (the SDKs send them through
    extra_body), and Anthropic's thinking and effort. Every turn renders with the profile's
    template and kwargs, so the prompt the policy is trained on is one template's: a request
    asking for another gets a 400 naming the field, where it used to be ignored (an agent
    turning Qwen3's thinking off got thinking). `thinks`: whether the policy's turns carry
    reasoning as the profile renders them (ModelProfile.thinks). `same_render(kwargs)`: whether those
    template kwargs over the profile's render as the profile's do (ChatFormat.renders_the_same_with):
    such a request asks for the render it gets, and is served."""
    check_decoding_controls(body)
    thinking = want(body, "thinking", dict)
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError(400, f"thinking.type must be 'enabled', 'disabled' or 'adaptive', got {short(kind)}", param="thinking")
        if (kind != "disabled") != thinks:
            # (budget_tokens is not enforced apart: a turn's thinking and answer share max_tokens)
            raise RequestError(400, f"thinking.type is {kind!r}, but the policy's profile renders every turn "
                                    f"{'with' if thinks else 'without'} reasoning (set it in the model profile: "
                                    f"chat_template_kwargs)", param="thinking")
    output = want(body, "output_config", dict, default={}) or {}
    if output.get("format") is not None:
        raise RequestError(400, "output_config.format is not supported: the loopback server does not constrain decoding",
                           param="output_config")
    kwargs = want(body, "chat_template_kwargs", dict, default={}) or {}
    # (typed: 0 == False, and a template's `is false` reads 0 as thinking on)
    other = {k: v for k, v in kwargs.items() if k not in template_kwargs or type(template_kwargs[k]) is not type(v)
             or template_kwargs[k] != v}
    if other and not (same_render is not None and same_render(other)):
        k = next(iter(other))
        have = f"renders with {template_kwargs[k]!r}" if k in template_kwargs else "does not set it"
        raise RequestError(400, f"chat_template_kwargs.{k} is {other[k]!r}, but the policy's profile {have}: every turn "
                                f"renders with the profile's template kwargs {template_kwargs} (set them in the model "
                                f"profile, e.g. profile={{'chat_template_kwargs': ...}})", param="chat_template_kwargs")
    if want(body, "chat_template", str) is not None:
        raise RequestError(400, "a per-request chat_template is not supported: every turn renders with the policy's "
                                "template", param="chat_template")
    # vLLM renders these two into the template as well (reasoning_effort "none" turns Qwen3's
    # thinking off; gpt-oss writes "Reasoning: <effort>"): ignored, they changed nothing here
    # (Anthropic's output_config.effort is the same control)
    name = "reasoning_effort" if body.get("reasoning_effort") is not None else "output_config.effort"
    effort = body.get("reasoning_effort", output.get("effort"))
    # (vLLM renders an effort with enable_thinking = effort != "none" where the request's kwargs do not
    # set it: "none" turns Qwen3's thinking off, "medium" on)
    as_vllm = {"reasoning_effort": effort, **({} if "enable_thinking" in kwargs else {"enable_thinking": effort != "none"})}
    if effort is not None and template_kwargs.get("reasoning_effort") != effort and not (
            same_render is not None and same_render(as_vllm)):
        have = (f"renders with {template_kwargs['reasoning_effort']!r}" if "reasoning_effort" in template_kwargs
                else "does not set it")
        raise RequestError(400, f"{name} is {short(effort)}, but the policy's profile {have} (reasoning_effort): every "
                                f"turn renders with the profile's template kwargs (set it there: chat_template_kwargs)",
                           param=name)
    if body.get("documents"):
        raise RequestError(400, "'documents' is not supported: every turn renders the conversation's messages and tools "
                                "only", param="documents")
    # Anthropic's server-side extras that change the prompt or the tools (accepted and ignored, the
    # agent believed old tool results cleared, or MCP tools offered, which the policy never saw)
    if body.get("mcp_servers"):
        raise RequestError(400, "'mcp_servers' is not supported: declare the tools the agent runs in 'tools'",
                           param="mcp_servers")
    if body.get("context_management"):
        raise RequestError(400, "'context_management' is not supported: every turn renders the messages sent (edit "
                                "them in the agent to clear old tool results)", param="context_management")
    if want(body, "continue_final_message", bool, default=False) or not want(body, "add_generation_prompt", bool, default=True):
        name = "continue_final_message" if body.get("continue_final_message") else "add_generation_prompt"
        raise RequestError(400, f"'{name}' is not supported: a turn always opens a new assistant message "
                                f"(a final assistant message is rendered as a closed turn)", param=name)


def sampling_from(body: dict, max_tokens: int | None, stop: list[str]) -> tuple[SamplingConfig, dict]:
    """The request's SamplingConfig, and the distribution fields it *sent* ({name: value}; a
    field that is absent or null is not in it), which the server checks against the policy.
    Every numeric field is checked against what the engine accepts (NUMBER_BOUNDS); `stop` is
    already checked (stop_strings, under the protocol's field name)."""
    temperature = number(body, "temperature", default=1.0)
    top_p = number(body, "top_p", default=1.0)
    seed = number(body, "seed")
    if max_tokens is not None and not 1 <= max_tokens <= INT64_MAX:
        raise RequestError(400, f"'max_tokens' must be an integer in [1, 2**63-1], got {short(max_tokens)}", param="max_tokens")
    sent = {}
    for name in DISTRIBUTION_FIELDS:
        if body.get(name) is not None:
            sent[name] = _logit_bias(body) if name == "logit_bias" else number(body, name)
    return SamplingConfig(temperature=float(temperature), top_p=float(top_p) or GREEDY_TOP_P, max_tokens=max_tokens or 1,
                          stop=stop, seed=seed), sent


def policy_value(policy: SamplingConfig, name: str):
    """What the policy's sampling means for a distribution field (None: not applied)."""
    return getattr(policy, name) if name in ("temperature", "top_p") else None


def differs(name: str, sent, policy: SamplingConfig) -> bool:
    """Whether a sent distribution field asks for something other than the policy's sampling."""
    if name in ("temperature", "top_p"):
        return abs(float(sent) - getattr(policy, name)) > 1e-9
    return sent not in DISTRIBUTION_FIELDS[name]
