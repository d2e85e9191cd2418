"""Anthropic Messages wire format: request parsing (into the canonical chat form), replies
(JSON and the SSE event sequence the SDK expects), errors."""

from __future__ import annotations

import json

from .protocol import ChatRequest, Reply, RequestError, order_tool_results, number, sampling_from, short, stop_strings, want

# Tool-use ids are the reply's tool-call ids behind this prefix; requests map them back (a template
# that renders ids, Mistral's, sees the same id on both protocols).
TOOLU = "toolu_"
# Thinking blocks carry a signature the real API checks when they come back; this server records
# ids, not text, and checks nothing: a fixed marker.
SIGNATURE = "workbench-loopback"
BILLING_HEADER = "x-anthropic-billing-header"


def _call_id(tool_use_id):
    return tool_use_id[len(TOOLU):] if isinstance(tool_use_id, str) and tool_use_id.startswith(TOOLU) else tool_use_id


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content must be a string or a list of content blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise RequestError(400, f"{where}.content[{j}] must be a content block with a 'type'")
        if b["type"] == "text" and not isinstance(b.get("text", ""), str):
            raise RequestError(400, f"{where}.content[{j}].text must be a string")
    return content


def _text_of(content, where: str, sep: str) -> str:
    if content is None:
        return ""
    parts = []
    for j, b in enumerate(_blocks(content, where)):
        if b["type"] != "text":
            raise RequestError(400, f"{where}.content[{j}]: only text blocks are supported here, got {b['type']!r}")
        parts.append(str(b.get("text", "")))
    return sep.join(parts)


def _messages(messages: list, system) -> list[dict]:
    out = []
    if isinstance(system, list):
        # Claude Code's first system block is a billing header with a per-request hash: kept, it
        # changed the system prompt at every request, so every turn sealed (history_rewritten) and
        # re-prefilled the whole history. vLLM's Anthropic server drops it too.
        system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]
    if system:
        # joined as vLLM's Anthropic server joins them: system blocks with "", text blocks of a
        # message and a tool result's blocks with "\n" (an agent's reminder block and its question
        # glued into one word would be trained on as the prompt vLLM never renders)
        out.append({"role": "system", "content": system if isinstance(system, str) else _text_of(system, "system", "")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise RequestError(400, f"{where}.role: unknown role {short(role)} (expected 'user', 'assistant' or 'system')")
        if "content" not in m:
            raise RequestError(400, f"{where}: missing required field 'content'")
        blocks = _blocks(m["content"], where)
        if role == "system":
            # an inline system message (the SDK's MessageParam allows it; Claude Code's per-turn
            # reminders): kept where it stands, its text as vLLM's Anthropic server takes it (billing
            # header dropped, blocks joined with "", none if empty); refused with a 400 before, every
            # such request's episode failed. Not merged into the leading system prompt (vLLM's option
            # for templates that need it): that changes the prefix, and every turn would seal
            for j, b in enumerate(blocks):
                if b["type"] != "text":
                    raise RequestError(400, f"{where}.content[{j}]: a system message holds text blocks only, got {b['type']!r}")
            text = "".join(str(b.get("text") or "") for b in blocks if not str(b.get("text", "")).startswith(BILLING_HEADER))
            if text:
                out.append({"role": "system", "content": text})
            continue
        if role == "assistant":
            text, calls, thinking = [], [], []
            for j, b in enumerate(blocks):
                if b["type"] == "text":
                    if b.get("text"):  # an empty block is skipped, as vLLM does (joined, it added a "\n")
                        text.append(b["text"])
                elif b["type"] == "tool_use":
                    if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                        raise RequestError(400, f"{where}.content[{j}]: tool_use needs a name and an object input")
                    call = {"type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}}
                    if isinstance(b.get("id"), str):
                        call["id"] = _call_id(b["id"])
                    calls.append(call)
                elif b["type"] == "thinking":  # the reasoning the reply carried: the template may render it back
                    if not isinstance(b.get("thinking", ""), str):
                        raise RequestError(400, f"{where}.content[{j}].thinking must be a string")
                    thinking.append(b.get("thinking", ""))
                elif b["type"] != "redacted_thinking":
                    raise RequestError(400, f"{where}.content[{j}]: unsupported block type {b['type']!r}")
            msg = {"role": "assistant", "content": "\n".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if "".join(thinking):
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
            continue
        # user: consecutive text blocks form one user message; each tool_result is a tool message
        pending: list[str] = []
        before = len(out)
        for j, b in enumerate(blocks):
            if b["type"] == "text":
                if b.get("text"):  # (skipped when empty, as vLLM does)
                    pending.append(b["text"])
            elif b["type"] == "tool_result":
                if pending:  # (rendered as a user turn between the calls and their results: a context neither
                    # Anthropic, which refuses it, nor vLLM's server, which puts the results first, gives)
                    raise RequestError(400, f"{where}.content[{j}]: a tool_result after a text block; a message's "
                                            f"tool_result blocks come first, as Anthropic's API requires")
                content = b.get("content", "")
                if not isinstance(b.get("tool_use_id", ""), (str, type(None))):
                    raise RequestError(400, f"{where}.content[{j}].tool_use_id must be a string")
                out.append({"role": "tool", "content": _text_of(content, f"{where}.content[{j}]", "\n"),
                            "tool_call_id": _call_id(b.get("tool_use_id"))})
            else:
                raise RequestError(400, f"{where}.content[{j}]: unsupported block type {b['type']!r} (text and tool_result only)")
        if pending or len(out) == before:  # (a message of empty text stays an empty user message)
            out.append({"role": "user", "content": "\n".join(pending)})
    return out


def parse_request(body: dict) -> ChatRequest:
    messages = want(body, "messages", list, required=True)
    if not messages:
        raise RequestError(400, "'messages' must not be empty", param="messages")
    max_tokens = number(body, "max_tokens", required=True)
    system = want(body, "system", (str, list))
    tools = want(body, "tools", list)
    specs = []
    for j, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(400, f"tools[{j}] needs a 'name'", param="tools")
        if t.get("type", "custom") not in ("custom", None):  # bash_*, text_editor_*, web_search_*: no schema here
            raise RequestError(400, f"tools[{j}] is Anthropic's {t['type']!r} tool, which is not supported: declare it "
                                    f"as a custom tool with its input_schema", param="tools")
        if not isinstance(t.get("description", ""), str) or not isinstance(t.get("input_schema"), dict):
            raise RequestError(400, f"tools[{j}]: 'input_schema' must be an object and 'description' a string", param="tools")
        specs.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t["input_schema"]}})
    choice = want(body, "tool_choice", dict, default={"type": "auto"})
    if choice.get("type") not in ("auto", "none"):
        raise RequestError(400, f"tool_choice {choice.get('type')!r} is not supported (use 'auto' or 'none'): the loopback server does not constrain decoding")
    if choice.get("disable_parallel_tool_use"):
        raise RequestError(400, "tool_choice.disable_parallel_tool_use is not supported: the loopback server does not "
                                "constrain decoding (and a reply cut to one call would leave the others in the model's "
                                "context)", param="tool_choice")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        # a prefill continues the assistant's message; rendered as a closed turn, the model started a
        # new reply behind it, which the agent glued to the prefill
        raise RequestError(400, "a final assistant message (prefill) is not supported: the loopback server always opens a "
                                "new assistant turn", param="messages")
    stop = stop_strings(want(body, "stop_sequences", list, default=[]), "stop_sequences")
    sampling, sent = sampling_from(body, max_tokens, stop)
    return ChatRequest(messages=order_tool_results(_messages(messages, system)), tools=specs or None,
                       sampling=sampling, max_tokens=max_tokens, sent=sent,
                       stream=want(body, "stream", bool, default=False),
                       parse_tools=bool(specs) and choice.get("type") != "none")  # (no tools: text, as openai_api)


def _stop_reason(r: Reply) -> str:
    if r.finish == "length":  # cut, whatever it parsed (the API's own rule): the agent must know
        return "max_tokens"
    if r.tool_calls:
        return "tool_use"
    return {"stop_sequence": "stop_sequence"}.get(r.finish, "end_turn")


def _stop_sequence(r: Reply) -> str | None:  # only where it is the stop reason (a tool call wins), as the API's
    return r.stop_sequence if _stop_reason(r) == "stop_sequence" else None


def _content(r: Reply) -> list[dict]:
    blocks = [{"type": "thinking", "thinking": r.reasoning, "signature": SIGNATURE}] if r.reasoning else []
    blocks += [{"type": "text", "text": r.content}] if r.content or not r.tool_calls else []
    blocks += [{"type": "tool_use", "id": TOOLU + c["id"].split("_")[-1], "name": c["name"], "input": c["arguments"]}
               for c in r.tool_calls]
    return blocks


def response_body(r: Reply, req: ChatRequest, model: str) -> dict:
    return {"id": "msg_" + r.id.split("-")[-1], "type": "message", "role": "assistant", "model": model, "content": _content(r),
            "stop_reason": _stop_reason(r), "stop_sequence": _stop_sequence(r),
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens}}


async def stream_events(head: Reply, parts, req: ChatRequest, model: str):
    """The SSE event sequence the SDK expects, while the reply is sampled: `parts` as
    openai_api.stream_events takes it. Reasoning deltas go to a thinking block (closed with the
    signature), content to a text block, each tool call to a tool_use block, whole."""
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    yield event("message_start", {"message": {
        "id": "msg_" + head.id.split("-")[-1], "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": head.prompt_tokens, "output_tokens": 0}}})
    index, block, texts = -1, None, 0

    def close() -> list[str]:  # the open block's end (a thinking block's signature first, as the real API)
        out = []
        if block == "thinking":
            out.append(event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        if block is not None:
            out.append(event("content_block_stop", {"index": index}))
        return out

    async for part in parts:
        if isinstance(part, Reply):
            r = part
            break
        if part[0] == "error":
            yield f"event: error\ndata: {json.dumps(error_body(part[1], part[2]))}\n\n"
            return
        kind = "thinking" if part[0] == "reasoning" else "text"
        if kind != block:
            for e in close():
                yield e
            index, block = index + 1, kind
            texts += kind == "text"
            yield event("content_block_start", {"index": index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}
                                               if kind == "thinking" else {"type": "text", "text": ""}})
        delta = {"type": "thinking_delta", "thinking": part[1]} if kind == "thinking" else {"type": "text_delta", "text": part[1]}
        yield event("content_block_delta", {"index": index, "delta": delta})
    if not texts and not r.tool_calls:  # an empty reply is one empty text block, as response_body's
        for e in close():
            yield e
        index, block = index + 1, "text"
        yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
        yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": ""}})
    for e in close():
        yield e
    for b in [b for b in _content(r) if b["type"] == "tool_use"]:
        index += 1
        yield event("content_block_start", {"index": index, "content_block": {**b, "input": {}}})
        yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": _stop_reason(r), "stop_sequence": _stop_sequence(r)},
                                  "usage": {"output_tokens": r.completion_tokens}})
    yield event("message_stop", {})


def models_body(model: str, created: int) -> dict:
    import datetime

    at = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()
    return {"data": [{"type": "model", "id": model, "display_name": model, "created_at": at}],
            "has_more": False, "first_id": model, "last_id": model}
