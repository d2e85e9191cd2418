"""OpenAI Chat Completions wire format: request parsing, replies (JSON and SSE), errors."""

from __future__ import annotations

import json
import math

from .protocol import ChatRequest, Reply, RequestError, order_tool_results, loads, number, sampling_from, short, stop_strings, want

# ipython: Llama 3.1's role for a tool's output (Meta's docs send it; its template renders it as a tool
# result). A template that does not render it is refused by ChatFormat.render, naming the role
ROLES = {"system", "developer", "user", "assistant", "tool", "ipython"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    code = code or {413: "request_too_large", 503: "engine_unavailable"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _content(m: dict, i: int):
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
        return "\n".join(p["text"] for p in c)  # as vLLM's renderer joins text parts
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def _arguments(args, where: str):
    """A tool call's arguments: a JSON string (the wire form; text that is not JSON is kept
    verbatim, the template renders it as is) or an object. JSON inside the string is held to
    the body's bounds (depth, number sizes), as the accumulator parses it to compare turns."""
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise RequestError(400, f"{where} must be a JSON string, got {type(args).__name__}", param=where)
    try:
        loads(args, what=where)
    except RequestError as e:
        if e.code is not None:  # too deep, a number too long, a lone surrogate: refused
            raise RequestError(400, e.message, param=where, code=e.code) from None
    return args or "{}"


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise RequestError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise RequestError(400, f"messages[{i}].role: unknown role {short(role)} (expected one of {sorted(ROLES)})", param=f"messages[{i}].role")
    out = {"role": "system" if role == "developer" else role, "content": _content(m, i) or ""}
    if role == "assistant" and m.get("function_call") is not None:  # (the legacy form of tool_calls)
        raise RequestError(400, f"messages[{i}].function_call (the legacy functions API) is not supported: "
                                f"send tool_calls", param=f"messages[{i}].function_call")
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
        out["tool_calls"] = []
        for j, tc in enumerate(calls):
            f = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise RequestError(400, f"messages[{i}].tool_calls[{j}] needs function.name", param=f"messages[{i}].tool_calls")
            args = _arguments(f.get("arguments") or "{}", f"messages[{i}].tool_calls[{j}].function.arguments")
            call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
            if isinstance(tc.get("id"), str):  # kept where the profile's template renders ids (Mistral)
                call["id"] = tc["id"]
            out["tool_calls"].append(call)
    if role == "assistant":  # the reasoning a reply carried (reasoning_content; `reasoning` in newer servers)
        for key in ("reasoning_content", "reasoning"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise RequestError(400, f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
                out["reasoning_content"] = m[key]
                break
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise RequestError(400, f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def check_tools(tools: list | None) -> None:
    """OpenAI function specs, as the chat template renders them (a RequestError naming the first that is
    not). Also an Env's tools (RolloutRunner): a bare {"name", "parameters"} or an Anthropic spec
    (input_schema) was rendered as it was, a tool block no server shows the policy."""
    for j, t in enumerate(tools or ()):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise RequestError(400, f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        f = t["function"]
        if not isinstance(f.get("description", ""), (str, type(None))) or not isinstance(f.get("parameters", {}), (dict, type(None))):
            raise RequestError(400, f"tools[{j}].function: 'description' must be a string and 'parameters' an object", param="tools")


def parse_request(body: dict) -> ChatRequest:
    messages = want(body, "messages", list, required=True)
    if not messages:
        raise RequestError(400, "'messages' must not be empty", param="messages")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    n = number(body, "n", default=1)
    if n != 1:
        raise RequestError(400, "n > 1 is not supported: send n separate requests (each is its own sample)", param="n")
    tools = want(body, "tools", list)
    check_tools(tools)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice {choice!r} is not supported (use 'auto' or 'none'): the loopback server does not constrain decoding", param="tool_choice")
    max_tokens = number(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = number(body, "max_tokens")
    stop = want(body, "stop", (str, list), default=[])
    stop = stop_strings([stop] if isinstance(stop, str) else stop, "stop")
    top_logprobs = number(body, "top_logprobs", default=0)
    if top_logprobs:
        raise RequestError(400, "top_logprobs > 0 is not supported; logprobs=true returns each sampled token's log-prob", param="top_logprobs")
    opts = want(body, "stream_options", dict, default={})
    if not isinstance(opts.get("include_usage", False), (bool, type(None))):
        raise RequestError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    sampling, sent = sampling_from(body, max_tokens, stop)
    # vLLM's OpenAI server accepts ignore_eos as an extra field (SDK: extra_body); so do we
    sampling.ignore_eos = want(body, "ignore_eos", bool, default=False)
    return ChatRequest(
        messages=order_tool_results(msgs), tools=tools or None, sampling=sampling, max_tokens=max_tokens, sent=sent,
        stream=want(body, "stream", bool, default=False), include_usage=bool(opts.get("include_usage")),
        # a request without tools gets its reply as text, tool-call syntax included, as from vLLM
        # (an agent describing its tools in the prompt parses them itself)
        logprobs=want(body, "logprobs", bool, default=False), parse_tools=bool(tools) and choice != "none",
    )


def _finish(r: Reply) -> str:
    if r.finish == "length":  # cut, whatever it parsed (as the API and vLLM report it)
        return "length"
    return "tool_calls" if r.tool_calls else "stop"


def _tool_calls(r: Reply) -> list[dict]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in r.tool_calls]


def _logprobs(r: Reply) -> dict:
    # a non-finite log-prob (a diverging run's NaN logits) is -9999, as vLLM clamps: JSON has no NaN, and
    # the body failed to render after the turn was recorded (a 500, then the same from every retry)
    return {"content": [{"token": s, "logprob": lp if math.isfinite(lp) and lp > -9999.0 else -9999.0, "bytes": list(b), "top_logprobs": []}
                        for s, b, lp in zip(r.token_strs, r.token_bytes or [s.encode() for s in r.token_strs], r.logprobs)]}


def _usage(r: Reply) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


# vLLM 0.32 sends a reply's reasoning as `reasoning` (`reasoning_content` is its deprecated name, read
# on input only); older vLLM, SGLang and DeepSeek's API send `reasoning_content`. Both go out: an agent
# that read the other one carried no reasoning forward, and every tool turn sealed (assistant_changed)
REASONING_FIELDS = ("reasoning", "reasoning_content")


def response_body(r: Reply, req: ChatRequest, model: str) -> dict:
    message = {"role": "assistant", "content": r.content if (r.content or not r.tool_calls) else None}
    if r.reasoning:  # what the reasoning parser split off, under both names agents read it by
        message.update(dict.fromkeys(REASONING_FIELDS, r.reasoning))
    if r.tool_calls:
        message["tool_calls"] = _tool_calls(r)
    return {
        "id": r.id, "object": "chat.completion", "created": r.created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(r),
                     "logprobs": _logprobs(r) if req.logprobs else None}],
        "usage": _usage(r),
    }


async def stream_events(head: Reply, parts, req: ChatRequest, model: str):
    """SSE `data:` lines while the reply is sampled. `parts` (server._stream_parts) yields
    ("reasoning" | "content", text) deltas, then the finished Reply (its tool calls, each whole
    in one delta; the finish reason; every token's log-prob, on the finishing chunk), or
    ("error", status, message) for a turn that failed after the stream began."""
    def chunk(delta: dict, finish=None, logprobs=None, usage=None, choices=True) -> str:
        body = {"id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}] if choices else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    # the role alone first: a content "" there made a call-only reply's content '' in the SDK's assembled
    # message where the unstreamed reply (and OpenAI's stream) has None; "" is sent at the end where
    # the reply has neither text nor a call, as the unstreamed one has
    yield chunk({"role": "assistant"})
    content = False
    async for part in parts:
        if isinstance(part, Reply):
            r = part
            break
        if part[0] == "error":
            yield f"data: {json.dumps(error_body(part[1], part[2]))}\n\n"
            return
        content = content or part[0] == "content"
        yield chunk(dict.fromkeys(REASONING_FIELDS, part[1]) if part[0] == "reasoning" else {"content": part[1]})
    calls = _tool_calls(r)
    if not calls and not content:
        yield chunk({"content": ""})
    for i, tc in enumerate(calls):  # a call whole, in one delta
        yield chunk({"tool_calls": [{"index": i, **tc}]})
    yield chunk({}, finish=_finish(r), logprobs=_logprobs(r) if req.logprobs else None)
    if req.include_usage:
        yield chunk({}, usage=_usage(r), choices=False)
    yield "data: [DONE]\n\n"


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "workbench"}]}
