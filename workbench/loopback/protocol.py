"""What both wire protocols share: the parsed request, the protocol-neutral reply, request
errors, and small field validators that name the offending field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rollout.engine import SamplingConfig


class RequestError(Exception):
    """A bad request: becomes a 4xx JSON error in the protocol's own error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


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
    parse_tools: bool = True  # False for tool_choice "none"


@dataclass
class Reply:
    """One assistant reply, before it is put into either wire format."""

    id: str
    content: str
    tool_calls: list[dict]  # {"id", "name", "arguments" (dict)}
    finish: str  # "stop" | "length" | "stop_sequence" | "abort"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_strs: list[str] = field(default_factory=list)
    created: int = 0

    def assistant_message(self) -> dict:
        """The assistant message as the accumulator records it (and as clients send it back)."""
        return {
            "role": "assistant",
            "content": self.content,
            "tool_calls": [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                           for c in self.tool_calls],
        }


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


def sampling_from(body: dict, max_tokens: int | None, stop: list[str]) -> SamplingConfig | None:
    temperature = want(body, "temperature", (int, float), default=1.0)
    top_p = want(body, "top_p", (int, float), default=1.0)
    seed = want(body, "seed", int)
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise RequestError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    return SamplingConfig(temperature=float(temperature), top_p=float(top_p), max_tokens=max_tokens or 1,
                          stop=stop, seed=seed)
