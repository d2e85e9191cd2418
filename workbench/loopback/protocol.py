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
    sent: dict = field(default_factory=dict)  # distribution fields the request sent (protocol.sampling_from)
    retry: bool = False  # the client says this is a retry of its previous request (x-stainless-retry-count >= 1)


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
    truncated: bool = False  # cut by the context: max_tokens clamped to the room left and hit, or no room at all

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


def sampling_from(body: dict, max_tokens: int | None, stop: list[str]) -> tuple[SamplingConfig, dict]:
    """The request's SamplingConfig, and the distribution fields it *sent* ({name: value}; a
    field that is absent or null is not in it), which the server checks against the policy."""
    temperature = want(body, "temperature", (int, float), default=1.0)
    top_p = want(body, "top_p", (int, float), default=1.0)
    seed = want(body, "seed", int)
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise RequestError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    sent = {}
    for name in DISTRIBUTION_FIELDS:
        if body.get(name) is not None:
            sent[name] = want(body, name, dict if name == "logit_bias" else (int, float))
    return SamplingConfig(temperature=float(temperature), top_p=float(top_p), max_tokens=max_tokens or 1,
                          stop=stop, seed=seed), sent


def policy_value(policy: SamplingConfig, name: str):
    """What the policy's sampling means for a distribution field (None: not applied)."""
    return getattr(policy, name) if name in ("temperature", "top_p") else None


def differs(name: str, sent, policy: SamplingConfig) -> bool:
    """Whether a sent distribution field asks for something other than the policy's sampling."""
    if name in ("temperature", "top_p"):
        return abs(float(sent) - getattr(policy, name)) > 1e-9
    return sent not in DISTRIBUTION_FIELDS[name]
