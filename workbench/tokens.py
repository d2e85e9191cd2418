"""Invariant 1, token identity: never train on a token the policy did not sample.

The sampled ids returned by the engine ARE the trajectory; text is only a view of them.
`Accumulator` is the only code that appends ids to a trajectory. For each request of a
session with messages M (DESIGN.md, "Token identity"):

1. M extends the session (earlier messages unchanged, the last assistant message the one the
   server returned): the engine prompt is `accumulated_ids + delta_ids`, where the delta is
   the template text the new messages add (ALL messages after the last assistant turn),
   preceded by the template's closing text after the sampled end-of-turn token (e.g. "\n").
2. Otherwise, where M rewrites the conversation (its first non-system message is one of the
   conversation's), a new segment starts from the full render of M, and the old one is set aside
   open: a later request that extends it again goes on with it, else it is sealed with the
   rewrite's reason at the episode's end or eviction; where M opens otherwise (a summarizer or sub-agent called through the same
   client, under its own system prompt or the agent's), it starts a conversation of its own beside the open ones, and a
   later request extends whichever open conversation it extends (`Accumulator.open_conversations`).
3. A reply cut by max_tokens has no end-of-turn token: the template's closing tokens
   (end-of-turn included) enter the next delta as non-trainable tokens. A reply a stop string
   ended holds the string's text, which the message sent back does not: unless the template
   renders the sampled text back (Qwen3's `</tool_call>`), the next request re-renders
   (`stop_string`); closed by an end of turn, the text stood in a context no server builds.
4. A retry returns the cached reply and records nothing twice. A request is a retry when it
   repeats the last request's messages and tools AND the client says it is one: the stock
   Stainless-generated SDKs (openai, anthropic) send `x-stainless-retry-count` on every request,
   0 on the first attempt and k on their k-th retry (timeouts, 5xx, lost connections). An
   identical request without that (count 0 or no header) is a new sample: it does not extend the
   conversation, so the sample starts a new segment (the open one set aside as in rule 2,
   `history_rewritten`); n identical requests give n samples. Turns of one session are serialised by a lock, so a
   retry sent while its original is still in flight waits for it and gets its reply.

Measured per segment: `identity_mismatch` (trainable ids that differ from the engine's sampled
ids; 0 whenever this mechanism works), `retokenization_drift` (sampled ids that a
retokenization of their decoded text would change: the damage a text-based pipeline would do)
and `sampling_overridden` (recorded turns whose request asked for other sampling than the
policy's; the server replaced it). A session whose turn was cut by the context, or whose last
reply was cut by the policy's max_tokens, is `truncated`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import functools
import hashlib
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Why a segment was sealed. Keys are what Segment.seal_reason holds.
SEAL_REASONS = {
    "history_rewritten": "earlier messages were changed or removed (a changed system prompt, a compaction that kept the task)",
    "assistant_changed": "the assistant message sent back differs from the one the server returned, and as returned "
                         "the request would have extended the conversation",
    "template_rewrite": "the chat template renders earlier turns differently once new messages are added",
    "tools_changed": "the request's tools differ from the previous request's, and with those the request would have "
                     "extended the conversation (the template renders them before the history)",
    "stop_string": "the last reply ended on a stop string: the recorded ids hold its text, the message sent back "
                   "does not, and the template's render cannot extend them (an agent's stop=['Observation:'] "
                   "seals every turn; a stop string the template renders back, Qwen3's '</tool_call>', does not)",
    "episode_end": "the session was closed (normal end of an episode)",
    "evicted": "the session opened more conversations than the accumulator keeps open "
               "(Accumulator.open_conversations): the least recently extended one was closed",
}

# Seals that say the agent changed what the model was shown (compaction, an edited reply): the
# audit flags them. The others are by design: a template that rewrites earlier turns (Qwen3 with
# thinking at every user turn) and eviction beyond the kept conversations are no fault of the run;
# token identity holds across every seal (each segment trains on its own sampled ids).
UNEXPECTED_SEALS = ("history_rewritten", "assistant_changed", "tools_changed")

# What one open conversation of a session holds (Accumulator swaps these when a request extends
# another open conversation than the last one)
_CONVERSATION_STATE = ("_segment", "_conversation", "_conversation_text", "_window_start", "_closing_text",
                       "_last_turn", "_last_turn_moved", "_unrendered", "_last_request", "_last_reply", "_last_stop_sequence")


@dataclass
class Segment:
    """A run of token ids that one prompt-extension chain produced. Per token: `loss_mask`
    (1 = sampled by the policy), `logprobs` (behaviour log-prob; 0.0 where not sampled),
    `versions` (policy version that sampled it; -1 for prompt/template/tool tokens).
    `routed_experts`: [T, moe_layers, top_k] int16, -1 = not captured (vLLM's: a row per decoder
    layer, dense ones included; replay.router_layers reads it)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    messages: list[dict] = field(default_factory=list)
    seal_reason: str | None = None  # None while the segment is open
    stats: dict = field(default_factory=lambda: {"identity_mismatch": 0, "retokenization_drift": 0, "sampled_tokens": 0,
                                                 "turns": 0, "sampling_overridden": 0})
    tools: list | None = None  # the tools the requests declared: the template renders them (drift views re-render)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, ids, trainable: bool, logprobs=None, versions=None) -> None:
        n = len(ids)
        self.token_ids += list(ids)
        self.loss_mask += [int(trainable)] * n
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
        self.versions += list(versions) if versions is not None else [-1] * n

    def copy(self) -> "Segment":
        """An independent copy. (copy.deepcopy walks every id one object at a time: ~1 ms per
        short episode on the loopback's event loop; the number columns copy flat.)"""
        ex = self.routed_experts
        return Segment(list(self.token_ids), list(self.loss_mask), list(self.logprobs), list(self.versions),
                       None if ex is None else ex.copy(), copy.deepcopy(self.messages), self.seal_reason, dict(self.stats),
                       copy.deepcopy(self.tools))

    def check(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("segment columns have different lengths")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n:
            raise ValueError(f"routed_experts covers {self.routed_experts.shape[0]} positions, segment has {n}")


@dataclass
class Trajectory:
    """One agent episode: its segments plus reward, ids, info and error (None when it ran).
    `truncated`: a turn was cut by the context (the conversation outgrew max_model_len), or the
    episode's last reply ran out of the policy's max_tokens (the loop's generation budget: an
    agent's own smaller max_tokens is its choice; a cut reply the episode went on from is not its
    end), or an Env's episode was truncated (its step said so, or max_turns ran out); what was
    recorded is exact, the episode was just cut short (LoopConfig.on_truncated decides its reward:
    "mask" is DAPO's overlong filtering)."""

    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    group_id: str = ""
    episode_id: str = ""
    info: dict = field(default_factory=dict)
    error: str | None = None
    truncated: bool = False


# ------------------------------------------------------------------ on-disk format (parquet)
# One row per segment, trajectory fields repeated on each row. Why parquet (through pyarrow):
# columnar, with typed list columns that load straight into numpy/torch without parsing, good
# compression of id runs, appendable as one file per batch, and readable by pandas/duckdb/Ray
# Data for analysis. JSON lines would parse every id; pickles are neither portable nor safe.
def _schema():
    import pyarrow as pa

    return pa.schema([
        ("episode_id", pa.string()), ("group_id", pa.string()), ("segment_index", pa.int32()),
        ("reward", pa.float64()), ("error", pa.string()), ("info", pa.string()),
        ("seal_reason", pa.string()), ("messages", pa.string()), ("stats", pa.string()),
        ("token_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())), ("versions", pa.list_(pa.int32())),
        ("routed_experts", pa.list_(pa.int16())), ("routed_experts_shape", pa.list_(pa.int32())),
        ("truncated", pa.bool_()), ("tools", pa.string()),
    ])


def write_trajectories(trajectories: list[Trajectory], path: str | Path) -> Path:
    """Write trajectories to one parquet file (format documented in docs/ARCHITECTURE.md)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [t.episode_id for t in trajectories]
    if len(set(ids)) < len(ids):
        # read back by episode id: two episodes of one id became one (the second's reward, error and
        # info gone, its segments the first's), and a revisited group's baseline changed
        twice = sorted({i for i in ids if ids.count(i) > 1})[:3]
        raise ValueError(f"episode ids must be unique in a trajectories file: {twice} appear more than once "
                         f"(a Trajectory built by hand keeps episode_id '' unless given one)")
    rows = []
    for t in trajectories:
        episode = {"episode_id": t.episode_id, "group_id": t.group_id, "reward": float(t.reward), "error": t.error,
                   "info": json.dumps(t.info, default=json_value), "truncated": bool(t.truncated)}
        if not t.segments:
            # an episode that recorded nothing (it crashed or ran out of context before its first
            # turn) still counted in its group's baseline: one row without tokens keeps it, so a
            # reread step (wb.revisit) computes the advantages the run trained with
            rows.append({**episode, "segment_index": -1, "seal_reason": None, "messages": "[]", "stats": "{}",
                         "token_ids": [], "loss_mask": [], "logprobs": [], "versions": [],
                         "routed_experts": None, "routed_experts_shape": None})
        for i, s in enumerate(t.segments):
            s.check()
            ex = s.routed_experts
            rows.append({
                **episode, "segment_index": i,
                "seal_reason": s.seal_reason, "messages": json.dumps(s.messages, default=json_value),
                "stats": json.dumps(s.stats), "token_ids": s.token_ids, "loss_mask": s.loss_mask,
                "logprobs": s.logprobs, "versions": s.versions,
                "routed_experts": None if ex is None else ex.reshape(-1).tolist(),
                "routed_experts_shape": None if ex is None else list(ex.shape),
                "tools": None if s.tools is None else json.dumps(s.tools, default=json_value),
            })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside, then renamed: a step's untrained file is rewritten at a run's end (its
    # leftovers added), and a kill or a full disk mid-write left a cut file that failed every later
    # audit of the run; now the old file or the new one
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), staged)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)
    return path


def read_trajectories(path: str | Path) -> list[Trajectory]:
    import pyarrow.parquet as pq

    out: dict[str, Trajectory] = {}
    for r in pq.read_table(path).to_pylist():
        t = out.setdefault(r["episode_id"], Trajectory(
            reward=r["reward"], group_id=r["group_id"], episode_id=r["episode_id"],
            info=json.loads(r["info"]), error=r["error"], truncated=bool(r.get("truncated"))))  # older files: no column
        if r["segment_index"] < 0:  # an episode without segments (see write_trajectories)
            continue
        ex = None
        if r["routed_experts"] is not None:
            ex = np.asarray(r["routed_experts"], dtype=np.int16).reshape(r["routed_experts_shape"])
        t.segments.append(Segment(r["token_ids"], r["loss_mask"], r["logprobs"], r["versions"], ex,
                                  json.loads(r["messages"]), r["seal_reason"], json.loads(r["stats"]),
                                  json.loads(r["tools"]) if r.get("tools") else None))  # older files: no column
    return list(out.values())


def training_tensors(segments: list[Segment], pad_id: int = 0) -> dict[str, Any]:
    """Right-padded training tensors, one row per segment. Index i of every column describes
    token i: `logprobs[i]`/`versions[i]`/`loss_mask[i]` belong to `input_ids[i]`, whose
    log-prob the trainer reads from the logits at position i - 1 (shift by one there)."""
    import torch

    n, width = len(segments), max((len(s) for s in segments), default=0)
    out = {
        "input_ids": torch.full((n, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((n, width), dtype=torch.long),
        "loss_mask": torch.zeros((n, width), dtype=torch.float32),
        "behaviour_logprobs": torch.zeros((n, width), dtype=torch.float32),
        "versions": torch.full((n, width), -1, dtype=torch.long),
        "routed_experts": None,
    }
    shapes = {s.routed_experts.shape[1:] for s in segments if s.routed_experts is not None}
    if len(shapes) > 1:
        raise ValueError(f"segments disagree on routed-expert shape: {shapes}")
    if shapes:
        out["routed_experts"] = torch.full((n, width, *shapes.pop()), -1, dtype=torch.int16)
    for i, s in enumerate(segments):
        s.check()
        if len(s) and s.loss_mask[0]:
            # the trainer reads token i's log-prob from position i - 1: token 0 has none (its column
            # is 0), so a trainable first token would train on a made-up ratio
            raise ValueError(f"segment {i}'s first token is marked trainable: it has no context to be predicted "
                             f"from (a segment starts with its prompt)")
    # every column filled by one copy of its concatenated rows (a boolean mask fills in row-major
    # order: row i's first len(segment i) positions): per-row tensor copies took ~10 ms of the
    # driver's critical path a step at 128 episodes
    real = torch.arange(width) < torch.tensor([len(s) for s in segments], dtype=torch.long)[:, None]
    out["attention_mask"][real] = 1
    for key, field_name, dtype in (("input_ids", "token_ids", torch.long), ("loss_mask", "loss_mask", torch.float32),
                                   ("behaviour_logprobs", "logprobs", torch.float32), ("versions", "versions", torch.long)):
        out[key][real] = torch.tensor([x for s in segments for x in getattr(s, field_name)], dtype=dtype)
    if out["routed_experts"] is not None:
        from .replay import latest_version_routing  # (torch-only module; imported here, like torch)

        for i, s in enumerate(segments):
            if s.routed_experts is not None:  # a segment spanning versions replays its latest one's routing
                replayed = latest_version_routing(s.routed_experts, s.versions, s.loss_mask)
                out["routed_experts"][i, :len(s)] = torch.from_numpy(replayed.astype(np.int16))
    return out


# ------------------------------------------------------------------ messages and the template
def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")  # as vLLM joins parts


# What canonical_message may keep, per model profile field (workbench.profiles.ModelProfile).
MESSAGE_FORMS = {"tool_call_ids": (None, "alnum9"), "tool_arguments": ("object", "json"),
                 "reasoning_field": (None, "reasoning_content", "thinking")}
# Where an incoming assistant message may carry its reasoning: vLLM's and DeepSeek's
# `reasoning_content`, the newer `reasoning`, gpt-oss's (HF) `thinking`; the loopback's Anthropic
# route puts the text of `thinking` blocks into `reasoning_content`.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def canonical_message(m: dict, *, tool_call_ids: str | None = None, tool_arguments: str = "object",
                      reasoning_field: str | None = None) -> dict:
    """The parts of a chat message the template renders, in one comparable form. Wire-format
    noise (`refusal: null`, argument JSON spacing, content as parts) is dropped; what the
    template renders is kept where the model profile says it does (ModelProfile.message_form,
    passed explicitly; the defaults keep what the toy's template renders):

    tool_call_ids "alnum9": tool-call ids and tool results' `tool_call_id` (Mistral's templates
        render them and refuse any other shape than 9 alphanumeric characters); None drops them.
    tool_arguments "json": arguments as JSON text, `json.dumps` of the parsed object (templates
        that concatenate them as a string: DeepSeek V3.1); "object": the parsed object.
    reasoning_field: the key the template renders an assistant turn's reasoning from (Qwen3
        `reasoning_content`, gpt-oss `thinking`), filled from any of REASONING_KEYS; None drops it."""
    out = {"role": m["role"], "content": _text(m.get("content"))}
    calls = []
    for tc in m.get("tool_calls") or []:
        f = tc.get("function", tc)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # keep the raw string; the template renders it verbatim
        if tool_arguments == "json" and not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call = {"type": "function", "function": {"name": f.get("name", ""), "arguments": args}}
        if tool_call_ids is not None and tc.get("id") is not None:
            call["id"] = str(tc["id"])
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    if tool_call_ids is not None and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    if reasoning_field is not None and m["role"] == "assistant":
        reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str) and m[k]), None)
        # gpt-oss's template renders one analysis message before a tool call, from content or from
        # thinking, and refuses both: a harmony preamble (content) with reasoning keeps the content
        if reasoning and not (reasoning_field == "thinking" and calls and out["content"]):
            out[reasoning_field] = reasoning
    return out


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_tool_call_id(style: str | None = None) -> str:
    """A fresh tool-call id in the shape a profile's template needs (ModelProfile.tool_call_ids):
    "alnum9" 9 alphanumeric characters (Mistral); None the OpenAI-like `call_<16 hex>`."""
    import secrets

    if style == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(8)}"


# The date a template that prints today's date renders (transformers gives templates strftime_now,
# the clock's): a prompt is then the same on any day, and an episode that ran past midnight sealed
# its segment (template_rewrite: the first line of gpt-oss's system message changed), as did a
# group's sampled prompts against the server's memo of them. Llama's profile pins its date_string too.
TEMPLATE_DATE = datetime.datetime(2026, 1, 1)


# apply_chat_template's own parameters: a request's template kwargs must not name them (a
# `chat_template` of its own would run the client's Jinja on the server's loop)
_TEMPLATE_CALL_PARAMETERS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                                       "strftime_now"})
_PROBE_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
# conversations ChatFormat.renders_the_same_with renders both ways: (messages, tools)
TEMPLATE_PROBES = (
    ([{"role": "user", "content": "."}, {"role": "assistant", "content": ".", "reasoning_content": "."},
      {"role": "user", "content": "."}], None),
    ([{"role": "system", "content": "."}, {"role": "user", "content": "."}], [_PROBE_TOOL]),
    ([{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": [{"id": "call00001", "type": "function",
      "function": {"name": "lookup", "arguments": {"word": "a"}}}]},
      {"role": "tool", "tool_call_id": "call00001", "name": "lookup", "content": "."}], [_PROBE_TOOL]),
)


def _template_strftime(fmt: str) -> str:
    return TEMPLATE_DATE.strftime(fmt)


class ChatFormat:
    """The tokenizer and chat template as the accumulator uses them."""

    def __init__(self, tokenizer, end_of_turn: str | None = None, template_kwargs: dict | None = None,
                 turn_ends: tuple[str, ...] = (), message_form: dict | None = None, tool_description: str | None = None):
        self.tokenizer = tokenizer
        self.tool_description = tool_description  # the profile's: a missing tool description rendered as this
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        # every token that ends an assistant turn: the end of turn first, then the profile's turn_ends
        # (gpt-oss's <|call|>); a sampled one closes the turn (Accumulator.record)
        self.turn_end_tokens = tuple(dict.fromkeys((self.end_of_turn, *turn_ends)))
        self.turn_end_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in self.turn_end_tokens)
        # the tokenizer's special tokens: a turn that ends on one that is no turn end ended on an
        # engine stop id (Llama's <|eom_id|>, an EOS), which the template may render otherwise
        self.special_ids = frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        self.template_kwargs = dict(template_kwargs or {})  # the model profile's (Qwen3's enable_thinking, ...)
        # what canonical_message keeps (the profile's tool_call_ids, tool_arguments, reasoning_field)
        self.message_form = dict(message_form or {})
        self._backend = tokenizer.backend_tokenizer
        self._piece_bytes = None  # token_bytes' per-id function, made on first use
        # requests whose tools the template leaves out of the prompt (DeepSeek V3.1's and SmolLM2's
        # templates render no tools=): the policy sampled its calls without their schemas, every
        # episode looking healthy. Counted per prompt render (the server's summary) and said once
        self.tools_unrendered = 0
        self._tools_rendered: dict[str, bool] = {}  # per tools list (its JSON): does the template show them?
        self._same_with: dict[str, bool] = {}  # per extra template kwargs (their JSON): same render as the profile's?
        self._variables: set | None = None  # the names the chat template reads (_template_variables)

    @classmethod
    def for_profile(cls, tokenizer, profile) -> "ChatFormat":
        """The format a model profile (workbench.profiles) describes: its end of turn (and the other
        tokens that end a turn), template kwargs and what canonical messages keep. A Tekken profile
        (chat_format="tekken") gets workbench.tekken.TekkenFormat: mistral-common renders, no template."""
        if getattr(profile, "chat_format", "template") == "tekken" and cls is ChatFormat:
            from .tekken import TekkenFormat

            return TekkenFormat.for_profile(tokenizer, profile)
        return cls(tokenizer, profile.end_of_turn, profile.chat_template_kwargs, profile.turn_ends, profile.message_form,
                   profile.tool_description)

    def canonical(self, m: dict) -> dict:
        """canonical_message with this format's message form."""
        return canonical_message(m, **self.message_form)

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool,
               refuse_dropped: bool = True) -> str:
        # strftime_now: templates that print today's date (gpt-oss's "Current date:") get TEMPLATE_DATE
        text = self.tokenizer.apply_chat_template(
            messages, tools=self._template_tools(tools), add_generation_prompt=add_generation_prompt, tokenize=False,
            strftime_now=_template_strftime, **self.template_kwargs,
        )
        if tools and refuse_dropped and not self._renders_tools(tools):
            self.tools_unrendered += 1
        for i, m in enumerate(messages if refuse_dropped else ()):  # (a display re-rendering a record may not)
            # a template may render only a leading system message and skip any later one (gpt-oss's:
            # a developer message after the system prompt, a mid-conversation reminder): the policy
            # was prompted, trained and rewarded without the agent's instructions, silently
            # A role the template may not know (Llama 3.1's `ipython`, which other templates skip) likewise
            content, role = m.get("content"), m.get("role")
            if not (isinstance(content, str) and content.strip() and content.strip() not in text):
                continue
            if json.dumps(content.strip(), ensure_ascii=False)[1:-1] in text:  # rendered as JSON (Llama's tojson)
                continue
            import jinja2

            if i and role == "system":
                raise jinja2.TemplateError(f"this chat template does not render a system message after the first "
                                           f"(message {i}: {content.strip()[:60]!r}); put those instructions in the "
                                           f"first system message")
            if role not in ("system", "user", "assistant", "tool"):
                raise jinja2.TemplateError(f"this chat template does not render a message of role {role!r} (message {i}: "
                                           f"{content.strip()[:60]!r}); send it as a 'tool' or 'user' message")
        return text

    def _template_tools(self, tools: list | None) -> list | None:
        """The tools as the template is given them: as sent (and recorded), a missing or null
        description filled with the profile's tool_description where it has one."""
        if not tools or self.tool_description is None:
            return tools or None
        return [{**t, "function": {**t["function"], "description": self.tool_description}}
                if isinstance(t.get("function"), dict) and t["function"].get("description") is None else t for t in tools]

    def _renders_tools(self, tools: list) -> bool:
        """Whether the template puts `tools` in a prompt at all (a one-message render with and without
        them, once per tools list)."""
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._tools_rendered:
            if len(self._tools_rendered) >= 256:  # (a dataset with tools of its own per record: bounded)
                self._tools_rendered.clear()
            probe = [{"role": "user", "content": "."}]
            self._tools_rendered[key] = shown = self.render(probe, tools, True, False) != self.render(probe, None, True, False)
            if not shown and not self.tools_unrendered:  # (said once: the count goes on)
                import logging

                logging.getLogger(__name__).warning(
                    "this chat template does not render tools= (%s): the policy is prompted without the tools' "
                    "schemas; describe them in the system message, or give a chat template that renders them "
                    "(the server's summary counts these renders: tools_unrendered)", [t.get("function", t).get("name") for t in tools])
        return self._tools_rendered[key]

    def renders_the_same_with(self, extra: dict) -> bool:
        """Whether template kwargs `extra` (a request's) over the profile's render conversations as
        the profile's do. A request asking for them asks for nothing else: gpt-oss's template writes
        "Reasoning: medium" whether or not the profile says so, Qwen3's reads no reasoning_effort;
        refused, every such agent's episodes failed. A key that is one of apply_chat_template's own
        parameters (`chat_template`: a template of the client's, run on the server's loop) is never
        the same; a variable the template does not read renders nothing (not rendered); the others
        are rendered on probe conversations both ways (with and without tools, a tool call and its
        result: Llama 3.1's tools_in_user_message changes only a render with tools), once per `extra`."""
        if set(extra) & _TEMPLATE_CALL_PARAMETERS or not isinstance(self.tokenizer.chat_template, str):
            return False
        variables = self._template_variables()
        read = {k: v for k, v in extra.items() if variables is None or k in variables}
        if not read:
            return True
        text = json.dumps(read, sort_keys=True, default=str)
        if len(text) > 4096:  # (a template kwarg is a flag or a word: a client's megabytes are neither probed nor kept)
            return False
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in self._same_with:
            if len(self._same_with) >= 256:
                self._same_with.clear()
            self._same_with[key] = all(self._probe_render(p, t, self.template_kwargs) ==
                                       self._probe_render(p, t, {**self.template_kwargs, **read}) for p, t in TEMPLATE_PROBES)
        return self._same_with[key]

    def _template_variables(self) -> set | None:
        """The names the chat template reads from its context (jinja2's undeclared variables, parsed
        with the environment transformers renders it in: its loop controls, {% break %}, and
        {% generation %} are no syntax errors there); None where it does not parse."""
        if self._variables is None:
            from jinja2 import meta
            from transformers.utils.chat_template_utils import _compile_jinja_template

            try:
                env = _compile_jinja_template(self.tokenizer.chat_template).environment
                self._variables = meta.find_undeclared_variables(env.parse(self.tokenizer.chat_template))
            except Exception:  # noqa: BLE001  (every key then probed)
                self._variables = False
        return self._variables or None

    def _probe_render(self, messages: list, tools: list | None, kwargs: dict) -> str:
        """A probe's render, or the kind of error the template raised on it (the same either way: the same)."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self._template_tools(tools), add_generation_prompt=True,
                                                      tokenize=False, strftime_now=_template_strftime, **kwargs)
        except Exception as e:  # noqa: BLE001  (a template refusing the shape, or the value)
            return f"\0{type(e).__name__}"

    def prompt(self, messages: list[dict], tools: list | None) -> tuple[str, list[int]]:
        """A new segment's prompt: the whole conversation rendered with the generation prompt,
        and its ids (the loopback server memoizes it per request, see PromptMemo)."""
        text = self.render(messages, tools, add_generation_prompt=True)
        return text, self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Tokenize *template* text (never generated text) into ids. (The fast tokenizer's
        backend directly: same ids, a third of the per-call cost of the transformers wrapper.)"""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes, from its vocabulary piece: joined they are the text, a character
        split over byte tokens included (what the OpenAI API's logprob `bytes` are for). One token
        decoded alone gave U+FFFD for such a part, and dropped a SentencePiece piece's leading space."""
        if self._piece_bytes is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            # byte-level BPE (GPT-2's table: every byte a printable character) or SentencePiece ('▁' a
            # space, <0xNN> a byte); the added tokens are their own text
            byte_level = "ByteLevel" in repr(self._backend.decoder)
            table = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
            added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}

            def piece_bytes(i: int) -> bytes:
                if i in added:
                    return added[i].encode()
                piece = self._backend.id_to_token(i) or ""
                if table is not None and all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    with contextlib.suppress(ValueError):
                        return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode()

            self._piece_bytes = functools.lru_cache(maxsize=65536)(piece_bytes)
        return [self._piece_bytes(int(i)) for i in ids]


_MAX_PENDING = 16  # tokens without a complete character; a UTF-8 character spans at most 4 byte tokens


def text_units(fmt: ChatFormat, ids: list[int]) -> list[tuple[int, int, tuple]] | None:
    """The ids cut into units at character boundaries: (start, end, ids) where text[start:end]
    is what those ids decode to, in order. A unit is one token, or a run of tokens that only
    together complete a character (byte-level BPE splits multi-byte characters). One streaming
    decode step per token (tokenizers' DecodeStream keeps a window of a few ids): linear time.
    None when the stream cannot be cut this way (a long run of undecodable bytes)."""
    if hasattr(fmt, "text_units"):  # a format without an HF tokenizers backend (TekkenFormat) cuts its own
        return fmt.text_units(ids)
    from tokenizers.decoders import DecodeStream

    step = DecodeStream(skip_special_tokens=False).step
    units, pos, start = [], 0, 0
    for k, i in enumerate(ids):
        try:
            chunk = step(fmt._backend, i)
        except Exception:  # tokenizers' stream refuses some byte runs (SentencePiece's byte fallback: "\n" as
            # <0x0A>, then a cut character, then a word: "Invalid prefix encountered"): not cut this way
            return None
        if chunk is None:  # an incomplete character: the unit goes on
            if k + 1 - start > _MAX_PENDING:
                return None
            continue
        own = fmt.decode([i]) if k > start else ""
        if own and len(chunk) > len(own) and chunk.endswith(own):
            # a run of bytes that never made a character, then a token complete on its own: two units
            # (one, the token was counted as drift with the bytes: "Hi" after F0 9F, retokenized alike)
            cut = pos + len(chunk) - len(own)
            units += [(pos, cut, tuple(ids[start:k])), (cut, pos + len(chunk), (i,))]
        else:
            units.append((pos, pos + len(chunk), tuple(ids[start : k + 1])))
        pos += len(chunk)
        start = k + 1
    if start < len(ids):  # trailing bytes that never completed a character
        units.append((pos, -1, tuple(ids[start:])))
    return units


def retokenization_drift(fmt: ChatFormat, sampled: list[int]) -> int:
    """How many sampled ids a retokenization of their decoded text would not reproduce: both
    the sampled ids and `encode(decode(sampled))` are cut into character-aligned units
    (`text_units`), and a sampled token drifts when its unit (character span and ids) is not
    among the retokenization's units. Linear in the number of tokens (difflib, used before, was
    quadratic on repetitive output: ~7 s at 16k tokens, on the server's event loop). Where the
    tokenizer normalizes the text (Qwen3's NFC: a decomposed accent composed, one character
    fewer), the spans of the two texts no longer line up past the change, and every later unit,
    retokenized alike, counted as drift (97 of 99 tokens where 48 changed): there the units are
    matched in order by their ids instead (_drift_walk)."""
    if not sampled:
        return 0
    decode = getattr(fmt, "escaped_decode", fmt.decode)  # (Tekken: text spelling a control name stays text)
    text = decode(sampled)
    again = fmt.encode(text)
    if again == sampled:
        return 0
    mine, theirs = text_units(fmt, sampled), text_units(fmt, again)
    if mine is None or theirs is None:  # undecodable runs: count what differs between the common ends
        n, m = len(sampled), len(again)
        head = next((k for k in range(min(n, m)) if sampled[k] != again[k]), min(n, m))
        tail = next((k for k in range(min(n, m) - head) if sampled[n - 1 - k] != again[m - 1 - k]), min(n, m) - head)
        return n - head - tail
    if decode(again) != text:
        return _drift_walk(mine, theirs, len(decode(again)) - len(text))
    theirs = set(theirs)
    return sum(len(u[2]) for u in mine if u not in theirs)


def _drift_walk(mine: list, theirs: list, grown: int = 0) -> int:
    """retokenization_drift's count where the retokenized text differs from the sampled one
    (`grown` characters longer: negative where normalizing shortened it): a merge walk over the two
    unit lists, a unit matched by the next one of the other with the same ids. Where the two
    differ, a unit whose next neighbour matches the other's unit moves on (the sampled "e" + U+0301
    against the composed "é": the accent's unit drifts, the newline after it matches; compared by
    ends alone, the tie let the retokenized newline go first and every later unit drifted), at a
    shift the texts' lengths allow; else the one that ends first, in the sampled text's characters
    as of the last match."""
    end = lambda u: math.inf if u[1] < 0 else u[1]  # noqa: E731 (trailing bytes that never made a character)
    possible = lambda a, b: min(0, grown) <= b[0] - a[0] <= max(0, grown)  # noqa: E731 (theirs b against mine a)
    i = j = drift = 0
    shift = 0  # the retokenized text's position minus the sampled one's, at the last match
    while i < len(mine):
        if j < len(theirs) and mine[i][2] == theirs[j][2]:
            shift = theirs[j][0] - mine[i][0]
            i, j = i + 1, j + 1
        elif j < len(theirs) and i + 1 < len(mine) and mine[i + 1][2] == theirs[j][2] and possible(mine[i + 1], theirs[j]):
            drift += len(mine[i][2])
            i += 1
        elif j + 1 < len(theirs) and theirs[j + 1][2] == mine[i][2] and possible(mine[i], theirs[j + 1]):
            j += 1
        elif j < len(theirs) and end(theirs[j]) - shift <= end(mine[i]):
            j += 1
        else:
            drift += len(mine[i][2])
            i += 1
    return drift


@dataclass
class TurnPlan:
    """What the accumulator decided for one request: the engine prompt and how it was built."""

    prompt_ids: list[int]
    messages: list[dict]  # canonical request messages
    tools: list | None
    prompt_text: str  # render of the request's window (Accumulator.window) with the generation prompt
    delta_len: int  # ids added to the segment before sampling
    new_segment: bool
    seal_reason: str | None
    cached: Any = None  # the previous reply, for a retried request
    window_start: int = 0  # the rendered window: leading system messages + messages[window_start:] (0: all)
    beside: bool = False  # a new segment for a conversation of its own, beside the open ones (none sealed)


def _more_than_closing(rest: str, end_tokens) -> bool:
    """True when `rest` holds more than ends of turn and whitespace (a turn's closing)."""
    for e in end_tokens:
        rest = rest.replace(e, "")
    return bool(rest.strip())


def _ends_the_same(old: str, new: str) -> bool:
    """Whether `new`, a render of a shorter window, is `old`'s end past the head both share (the
    leading system messages): the messages the window keeps render as they did in the wider one."""
    return old.endswith(new[_common_prefix_len(old, new):])


def _common_prefix_len(a: str, b: str) -> int:
    """The length of the head a and b share, by halving with slice comparisons (C): a character
    loop in Python (os.path.commonprefix's too) took 45-53 ms over a 60,000-character system
    prompt, this 0.02 ms."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Accumulator:
    """Exact per-token accumulation for one session (one agent episode).

    An extending turn renders a window of the conversation, not all of it: the leading system
    messages and everything from a user message on (`window`). Rendering all of it made every turn
    cost time linear in the conversation (two template renders per turn, ~10 us per message). The
    window starts at the first message and moves to the last user message once it holds more than
    `window_messages` messages; a shorter conversation renders whole. Exact where a message renders
    the same whatever precedes that user message, besides the system messages: the rewrites that
    templates make of earlier turns (Qwen3 strips reasoning before the last user message, Mistral
    moves the system prompt and tools to it) touch only messages from the previous user message on,
    which the window holds (tests/test_tokens.py: the same plans and records with the window
    moved at every user turn as with the whole conversation, on the real templates' shapes).
    Where that fails, the move is refused: it is kept only if the messages it keeps render the
    same (Qwen3's "last user message" is the last *query*, and a user message holding a
    <tool_response> is none: a window starting there rendered the turns it kept otherwise; see
    _move_window). A template that numbers turns or counts earlier messages needs `window_messages = None`.
    Small windows render less: 4 rather than 32 cut the server's CPU per request in the last 8
    turns of 64-turn episodes from 1.41-1.65 to 1.18-1.19 ms (bench/loopback.py's history cost;
    a move's extra render is of a short window).

    A session may hold several conversations (a summarizer or sub-agent called through the same
    client: A, B, A, B...). Each keeps its own open segment, up to `open_conversations` of them; a
    request extends whichever it extends. With one open segment, each switch sealed it and the next
    request re-rendered its whole history into a new segment (5 one-turn segments for A, B, A, B, A,
    each re-prefilling and training its history again: quadratic in the turns)."""

    window_messages: int | None = 4
    open_conversations: int = 4  # a new one past these closes (seals) the least recently extended

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.segments: list[Segment] = []
        self.lock = asyncio.Lock()  # turns of one session are serialised
        # the current conversation (the last one planned): _CONVERSATION_STATE
        self._segment: Segment | None = None  # its segment
        self._conversation: list[dict] | None = None  # request + returned assistant message
        self._conversation_text = ""  # render of _conversation's window (no generation prompt)
        self._window_start = 0  # the window of _conversation_text (see window)
        self._closing_text = ""  # template text owed after the last sampled token
        self._last_turn: tuple | None = None  # (prompt text, sampled ids) of the last turn, in the current window
        self._last_turn_moved: tuple | None = None  # (conversation, start, tools): a window move _last_turn awaits
        self._unrendered: tuple | None = None  # (prompt text, tools, sampled ids, stopped) of a turn not yet rendered
        self._parked: list[dict] = []  # the other open conversations' _CONVERSATION_STATE, least recent first
        # parked segments a request rewrote (id -> the seal reason): sealed so at the episode's end or
        # eviction unless a later request extends them again (see record)
        self._rewritten: dict[int, str] = {}
        self._last_request: tuple | None = None
        self._last_reply: Any = None
        # the stop string that ended the last recorded reply, "" for one it does not name (the policy's;
        # the seal's label: kept apart from the retry cache, which a failed request clears, and the
        # retry's seal read as the template's)
        self._last_stop_sequence: str | None = None
        # set by the server: the last turn was cut by the context (the conversation outgrew
        # max_model_len), or the last recorded reply ran out of the policy's max_tokens (a later
        # reply not cut clears either: the episode went on past the cut, as a multi-turn Env or an
        # agent that compacts may). The session's, whichever conversation recorded last: a compaction
        # that opens beside the cut conversation (a summary first) is indistinguishable from a
        # summarizer called after it, and the agent that compacted went on (it was an episode with a
        # real reward, masked or dropped)
        self.context_cut = False
        self.last_reply_cut = False
        self.engine_calls = 0  # engine calls made for the session (the server mixes it into a seeded turn's seed)

    @property
    def open_segment(self) -> Segment | None:
        """The current conversation's segment while it is open."""
        seg = self._segment
        return seg if seg is not None and seg.seal_reason is None else None

    def plan(self, messages: list[dict], tools: list | None = None, retry: bool = False) -> TurnPlan:
        """Decide the engine prompt for a request. Records nothing until `record` (it may make another
        open conversation the current one: the one the request extends or rewrites). `retry`: the
        client says this request is a retry of its previous one (rule 4); only then is a
        repeat of the last request served from the cache."""
        canonical = getattr(self.fmt, "canonical", canonical_message)  # a format without a profile: the defaults
        msgs = [canonical(m) for m in messages]
        if retry and self._make_current_retried(msgs, tools):
            return TurnPlan([], msgs, tools, "", 0, False, None, cached=self._last_reply)  # nothing to render
        beside = not self._make_current(msgs)
        seg, reason = self.open_segment, None
        if seg is not None and self._conversation is not None and not beside:
            self._render_recorded()
            reason = _why_not_extending(self._conversation, msgs)
            if reason == "assistant_changed" and not self._extends_as_recorded(msgs):
                # a seal the template makes whatever the agent sent back (Qwen3 drops an earlier turn's
                # reasoning at a new user turn: an agent leaving reasoning_content out, as Qwen advises,
                # rendered the same prompt and was blamed: the audit flagged every such turn)
                reason = "template_rewrite"
            if reason is None:
                start = self._window_start
                text = self.fmt.render(self.window(msgs, start), tools, add_generation_prompt=True)
                if self._extends(self._conversation_text, text):
                    delta = self.fmt.encode(self._closing_text + text[len(self._conversation_text):])
                    return TurnPlan(seg.token_ids + delta, msgs, tools, text, len(delta), False, None, window_start=start)
                turn_text = self._turn_text()
                if turn_text is not None and self._extends(turn_text, text):
                    # the template renders the reply one way as the last message and another inside the
                    # conversation (Qwen3 gives its last assistant message an empty <think> block, which a
                    # reply that skipped thinking did not sample): the request still continues the very
                    # text of the recorded ids, so it extends (it sealed, re-prefilling the history)
                    delta = self.fmt.encode(text[len(turn_text):])
                    return TurnPlan(seg.token_ids + delta, msgs, tools, text, len(delta), False, None, window_start=start)
                # the agent's own change (tools dropped for a final "now answer" request), not the
                # template's: labelled the template's, the audit never flagged it
                # (the segment's: its last recorded turn's tools, whatever request failed since)
                # a reply ended by a stop string: the agent holds its text without the string, which the ids hold
                # (labelled the template's: the audit blamed the template for the agent's stop strings)
                # (as JSON text in the order sent, as templates render it (tojson keeps key order): an agent
                # re-serializing the tools or its call's arguments with sorted keys sealed as the template's)
                # (the agent's change only where the request as recorded would have extended: a turn the
                # template seals anyway, Mistral's new user turn with tools, was labelled tools_changed)
                n = len(self._conversation)
                tools_changed = _as_sent(seg.tools or None) != _as_sent(tools or None)
                reply_changed = _as_sent(msgs[n - 1]) != _as_sent(self._conversation[n - 1])
                agents = (tools_changed or reply_changed) and self._extends_as_recorded(msgs)  # (a render more: seals only)
                reason = ("tools_changed" if agents and tools_changed else "assistant_changed" if agents and reply_changed else
                          "stop_string" if self._last_stop_sequence is not None else "template_rewrite")
        full, ids = self.fmt.prompt(msgs, tools)
        return TurnPlan(ids, msgs, tools, full, len(ids), True, reason, beside=beside and seg is not None)

    def _extends_as_recorded(self, msgs: list[dict]) -> bool:
        """Whether the request would extend the open conversation with its last assistant message and
        its tools put back as recorded: where not, the template seals it whatever the agent changed."""
        n = len(self._conversation)
        restored = msgs[: n - 1] + [self._conversation[n - 1]] + msgs[n:]
        text = self.fmt.render(self.window(restored, self._window_start), self._segment.tools or None, add_generation_prompt=True)
        turn_text = self._turn_text()
        return self._extends(self._conversation_text, text) or (turn_text is not None and self._extends(turn_text, text))

    def _make_current_retried(self, msgs: list[dict], tools: list | None) -> bool:
        """Make current the open conversation whose last request this one repeats (a retry of it),
        if any: with sub-agents in flight, A's retry can come after B's request."""
        key = request_key(msgs, tools)
        for k, state in self._conversations():
            if state["_last_reply"] is not None and key == request_key(*state["_last_request"]):
                if k is not None:
                    self._swap_in(k)
                return True
        return False

    def _state(self) -> dict:
        """The current conversation's state (_CONVERSATION_STATE)."""
        return {a: getattr(self, a) for a in _CONVERSATION_STATE}

    def _conversations(self) -> list[tuple[int | None, dict]]:
        """(parked index, None for the current one; its state): the current first, then the most
        recently parked."""
        return [(None, self._state())] + [(k, self._parked[k]) for k in range(len(self._parked) - 1, -1, -1)]

    def _swap_in(self, k: int) -> None:
        """Make parked conversation k the current one, parking the current one."""
        state = self._parked.pop(k)
        self._parked.append(self._state())
        for a, v in state.items():
            setattr(self, a, v)

    @property
    def truncated(self) -> bool:
        """The session was cut short: by the context, or its last reply by the policy's max_tokens."""
        return self.context_cut or self.last_reply_cut

    def _make_current(self, msgs: list[dict]) -> bool:
        """Make current the open conversation that `msgs` extends, else the one it rewrites; False
        when it belongs to none (it opens otherwise than every open conversation). Switching
        records nothing: the states swap whole (_CONVERSATION_STATE)."""
        if not self._parked:  # one conversation (most sessions): no swapping
            return self._conversation is None or _same_conversation(self._conversation, msgs)
        candidates = [(k, state["_conversation"]) for k, state in self._conversations()]
        for test in (lambda c: _why_not_extending(c, msgs) is None, lambda c: _same_conversation(c, msgs)):
            k = next((k for k, conv in candidates if conv is not None and test(conv)), False)
            if k is not False:
                if k is not None:  # a parked conversation
                    self._swap_in(k)
                return True
        return False

    def _turn_text(self) -> str | None:
        """The last turn's prompt text followed by the text of its sampled ids (decoded only when
        the first extension test failed: most turns never need it)."""
        if self._last_turn_moved is not None:  # the window moved since: its prompt, rendered in the new window
            self._last_turn, self._last_turn_moved = self._last_turn_in(*self._last_turn_moved), None
        return None if self._last_turn is None else self._last_turn[0] + self.fmt.decode(self._last_turn[1])

    @staticmethod
    def window(messages: list[dict], start: int) -> list[dict]:
        """What a turn renders: the leading system messages and messages[start:] (start 0: all)."""
        if start == 0:
            return messages
        head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        return messages[:head] + messages[start:]

    @staticmethod
    def _extends(recorded_text: str, render: str) -> bool:
        """Whether a fresh render of the request extends the text the open segment recorded (else the
        segment is sealed: template_rewrite). Notebook 04's exercise overrides it."""
        return render.startswith(recorded_text)

    def record(self, plan: TurnPlan, sample, assistant_message: dict, reply: Any = None,
               sampling_overridden: bool = False, temperature: float | None = None, top_p: float | None = None) -> Segment:
        """Append one turn: the plan's delta (non-trainable) and the engine's sampled ids
        (trainable, with their log-probs and versions), then remember the conversation.
        `sampling_overridden`: the request asked for other sampling than the policy's (counted).
        `temperature`: what the engine sampled at (stats["temperatures"]: the trainer's must match);
        `top_p` likewise (stats["top_ps"]: under importance correction or distillation it must be 1)."""
        if plan.cached is not None:
            return self._segment
        if plan.new_segment:
            rewrite = plan.seal_reason in (None, "history_rewritten", "assistant_changed")
            if self.open_segment is not None and (plan.beside or rewrite):
                # the current conversation stays open, parked: beside another one, or rewritten by this
                # request, which may be another conversation sharing its first message (two sub-agents
                # given one brief, a side call quoting the task): sealed, each switch between them sealed
                # and re-prefilled the other's whole history. One no later request extends keeps the
                # rewrite's seal at the episode's end (a compaction's old history: history_rewritten)
                state = self._state()
                if not plan.beside:
                    self._rewritten[id(self._segment)] = plan.seal_reason or "history_rewritten"
                    state["_last_request"] = state["_last_reply"] = None  # superseded: no retry's answer
                self._parked.append(state)
                if len(self._parked) >= self.open_conversations:
                    # a rewritten one first, the least recent (repeated compaction, a system prompt with a
                    # clock, best-of-n re-asks each park one: they evicted a live sub-agent), else the least recent
                    k = next((i for i, s in enumerate(self._parked) if id(s["_segment"]) in self._rewritten), 0)
                    evicted = self._parked.pop(k)["_segment"]
                    evicted.seal_reason = self._rewritten.pop(id(evicted), "evicted")
            elif self.open_segment is not None:  # the template's render, the tools, a stop string: this
                # conversation goes on in the new segment
                self.seal(plan.seal_reason)
            self._segment = Segment()
            self.segments.append(self._segment)
        else:  # extended: a rewritten conversation a later request resumed is open again
            self._rewritten.pop(id(self._segment), None)
        seg = self._segment
        seg.append(plan.prompt_ids[len(seg):], trainable=False)
        start = len(seg)
        self._append_sampled(seg, sample)
        # measured on the record itself (what the segment now holds for the turn), not on what
        # the append reports: a broken append that returns the engine's ids is caught too
        sampled = seg.token_ids[start:]
        seg.stats["identity_mismatch"] += _mismatch(sampled, list(sample.token_ids))
        try:  # (a measurement that raised left the turn half recorded: its ids in, the conversation not)
            seg.stats["retokenization_drift"] += retokenization_drift(self.fmt, sampled)
        except Exception:
            logging.getLogger(__name__).warning("retokenization drift not measured for a turn", exc_info=True)
        seg.stats["sampled_tokens"] += len(sampled)
        seg.stats["turns"] += 1
        seg.stats["sampling_overridden"] = seg.stats.get("sampling_overridden", 0) + int(bool(sampling_overridden))
        if temperature is not None and temperature not in seg.stats.setdefault("temperatures", []):
            seg.stats["temperatures"].append(temperature)
        if top_p is not None and top_p not in seg.stats.setdefault("top_ps", []):
            seg.stats["top_ps"].append(top_p)
        self._merge_experts(seg, sample, start)
        # Remember what the server returned. The template text owed after the sampled ids needs a
        # render of the conversation: done when the next request comes (_render_recorded), as an
        # episode's last turn (every turn of a single-turn episode) never needs it.
        assistant = getattr(self.fmt, "canonical", canonical_message)(assistant_message)
        self._conversation = plan.messages + [assistant]
        self._window_start = plan.window_start
        self._unrendered = (plan.prompt_text, plan.tools, sampled, getattr(sample, "finish_reason", "stop") == "stop")
        self._last_request = (plan.messages, plan.tools)  # keyed only when a retry comes (request_key)
        self._last_reply = reply
        self._last_stop_sequence = getattr(reply, "stop_sequence", None)
        seg.messages = list(self._conversation)
        seg.tools = plan.tools
        seg.check()
        return seg

    def _render_recorded(self) -> None:
        """The recorded conversation's render (its window, no generation prompt) and the template
        text owed after the last sampled ids (`_closing_text`), for the turn record() left."""
        if self._unrendered is None:
            return
        prompt_text, tools, sampled, stopped = self._unrendered
        self._unrendered = None
        self._last_turn, self._last_turn_moved = (prompt_text, sampled), None
        try:
            self._conversation_text = self.fmt.render(self.window(self._conversation, self._window_start), tools,
                                                      add_generation_prompt=False)
        except Exception:  # the template refuses the reply as history: the ids are recorded; the next request
            self._conversation_text = ""  # renders afresh (and is refused by the template, or seals)
        turn_text = self._conversation_text[len(prompt_text):] if self._conversation_text.startswith(prompt_text) else ""
        ends = dict(zip(getattr(self.fmt, "turn_end_ids", (self.fmt.end_of_turn_id,)),
                        getattr(self.fmt, "turn_end_tokens", (self.fmt.end_of_turn,))))
        special_end = stopped and sampled and sampled[-1] not in ends and sampled[-1] in getattr(self.fmt, "special_ids", ())
        if special_end:
            # the turn ended on a special token that is no turn end (an engine stop id: Llama's
            # <|eom_id|>, Qwen's <|endoftext|>). It closes the turn only where the template renders
            # it there too; else the next request re-renders (template_rewrite), where the cut-reply
            # branch below would have appended the template's end of turn after it: ids like
            # <|eom_id|><|eot_id|> that no template renders and no inference produces. Only a turn the
            # engine *stopped* on it: a reply cut by max_tokens (ignore_eos) can end on any token, and
            # the template's end of turn does close it
            ends[sampled[-1]] = self.fmt.decode([sampled[-1]])
        if sampled and sampled[-1] in ends:  # the turn ended: the template must render that very token
            eot = ends[sampled[-1]]
            cut = turn_text.rfind(eot)
        else:  # cut by max_tokens / a stop string: the template's last end of turn closes it
            eot, cut = max(((e, turn_text.rfind(e)) for e in ends.values()), key=lambda x: x[1])
        if special_end and cut >= 0 and _more_than_closing(turn_text[cut + len(eot):], ends.values()):
            # a special token the engine stopped on closes the turn only where the template puts nothing
            # but its end of turn after it: the one rfind found may be a copy inside the rendered content
            # (a parser that keeps special tokens handed it to the agent), with a tool call rendered after
            # it, which the closing text would then have recorded a second time
            cut = -1
        if cut < 0 or not turn_text:  # the template does not append the turn as rendered (gpt-oss renders a
            # sampled <|return|> as <|end|>): the next request re-renders (template_rewrite)
            self._conversation_text = "\0"  # never a prefix: forces a template_rewrite seal
            self._closing_text = ""
        elif sampled and sampled[-1] in ends:
            self._closing_text = turn_text[cut + len(eot):]  # e.g. "\n" after <|im_end|>
        else:  # cut by max_tokens / a stop string: end-of-turn and closing enter as template text, and
            # what the template writes between the sampled text and it where the render continues the
            # sampled text (Qwen3 cut inside its reasoning: "\n</think>\n\n"; from the end of turn on, the
            # context read "<think>...I am thin<|im_end|>", a block no render or server ever closes so)
            text = self.fmt.decode(sampled) if sampled else ""
            # (a cut after a paragraph break: the template strips the reasoning's trailing newlines, which
            # the sampled text holds; the rest of the render after them. Not for a stop string: one of
            # newlines alone ("\n\n") was taken off so, and the turn extended as "4.\n\n<|eot_id|>")
            kept = text if stopped else text.rstrip("\n")
            if kept and turn_text.startswith(kept):
                rest = turn_text[len(kept):]
                self._closing_text = rest[min(len(rest) - len(rest.lstrip("\n")), len(text) - len(kept)):]
            elif stopped:  # ended on a stop string, whose text the ids hold and the message sent back does not:
                # the next request re-renders (stop_string). Extended, the stop text stood in the context closed
                # by an end of turn the model never sampled ("calc(2+2)\nObservation:<|eot_id|>"), a context no
                # server builds, under every later turn of a ReAct agent's episode
                self._conversation_text, self._closing_text = "\0", ""
                if self._last_stop_sequence is None:  # (the policy's own stop string: the reply names none)
                    self._last_stop_sequence = ""
            else:
                self._closing_text = turn_text[cut:]
        self._move_window(tools)

    def _move_window(self, tools: list | None) -> None:
        """Start the window at the last user message once it holds more than window_messages."""
        conv, start = self._conversation, self._window_start
        if self.window_messages is None or len(conv) - start <= self.window_messages or self._conversation_text in ("", "\0"):
            return
        last_user = next((i for i in range(len(conv) - 1, start, -1) if conv[i]["role"] == "user"), None)
        if last_user is None or all(m["role"] == "system" for m in conv[:last_user]):
            return  # no user message since the window's start (a long run of tool calls): it keeps growing
        try:
            text = self.fmt.render(self.window(conv, last_user), tools, add_generation_prompt=False)
        except Exception:
            return  # the template refuses the shorter window: keep the one it renders
        # The move must not change how the messages it keeps render. A template that reads the
        # messages before the window would render them otherwise, and the next request would then
        # extend that render instead of sealing at the template's rewrite: Qwen3 strips the
        # reasoning of every turn before the last *query*, and a user message holding a
        # <tool_response> is not one, so a window starting there had no query and rendered the
        # turns stripped, while the whole conversation kept their reasoning until the next real
        # question (tests/test_tokens.py). Past the system head both renders share, the new render
        # must be the old one's end.
        if not _ends_the_same(self._conversation_text, text):
            return  # keep the wider window (it grows until a move keeps the render)
        self._window_start, self._conversation_text = last_user, text
        # the last turn's prompt in the new window is rendered only if the second extension test needs it
        self._last_turn_moved = (conv, last_user, tools)

    def _last_turn_in(self, conv: list[dict], start: int, tools: list | None) -> tuple | None:
        """The last turn's (prompt text, sampled ids) in the window starting at `start`: its prompt
        rendered there, kept only where it is the old prompt's end past the head both share (the
        move's own test), so the second extension test goes on working after a move."""
        if self._last_turn is None:
            return None
        old, sampled = self._last_turn
        try:
            new = self.fmt.render(self.window(conv[:-1], start), tools, add_generation_prompt=True)
        except Exception:
            return None
        return (new, sampled) if _ends_the_same(old, new) else None

    def forget_last_request(self, plan: "TurnPlan | None" = None) -> None:
        """A request failed after planning (engine error): a retry of it must not be answered
        with the reply of an older, identical request. Not for a plan beside the open
        conversations (a sub-agent's first request): it never became the current one, whose
        cached reply is another conversation's (the main agent's, whose SDK retry then sampled
        again and sealed, the reply it never received trained)."""
        if plan is not None and plan.beside:
            return
        self._last_request = self._last_reply = None

    def _append_sampled(self, seg: Segment, sample) -> list[int]:
        """Append the ids to train on: exactly the engine's, with their log-probs and versions, and
        return them. (A test and notebook 01 override this with the classic retokenizing bug to show
        the statistic catch it; record measures what the segment holds, whatever this returns.)"""
        seg.append(sample.token_ids, trainable=True, logprobs=sample.logprobs, versions=sample.versions)
        return list(sample.token_ids)

    def _merge_experts(self, seg: Segment, sample, start: int | None = None) -> None:
        """The sample's routing into the segment's column (the sample's ids appended from `start`;
        None: its last len(sample.token_ids) positions)."""
        ex = getattr(sample, "routed_experts", None)
        if ex is None and seg.routed_experts is None:  # no routing (a dense model): nothing to merge (the
            return  # scan below walked the whole segment at every turn: ~2.5 ms a turn at 42k tokens)
        start = len(seg) - len(sample.token_ids) if start is None else start
        earlier = [v for v, m in zip(seg.versions[:start], seg.loss_mask[:start]) if m]
        newer = bool(earlier) and min(sample.versions, default=-1) > max(earlier)  # sampled wholly after a sync
        # ... or wholly at the segment's newest version while older tokens precede it (an earlier turn
        # straddled the sync): its request's prefill routed the whole context under that version too.
        # Merged, the earlier turn's recording was kept and then masked to live routing up to its first
        # new-version token (replay.latest_version_routing), the routing this turn saw thrown away
        supersedes = newer or (bool(earlier) and min(sample.versions, default=-1) >= max(earlier) > min(earlier))
        if ex is None:
            if seg.routed_experts is not None:  # keep the column aligned: unknown routing is -1 (and the
                # earlier turns' routing is not what a turn sampled after a sync saw)
                old = np.full_like(seg.routed_experts, -1) if supersedes else seg.routed_experts
                pad = np.full((len(seg) - old.shape[0], *old.shape[1:]), -1, np.int16)
                seg.routed_experts = np.concatenate([old, pad])
            return
        ex = np.asarray(ex, dtype=np.int16)[: len(seg)]
        if ex.shape[0] < len(seg):
            ex = np.concatenate([ex, np.full((len(seg) - ex.shape[0], *ex.shape[1:]), -1, np.int16)])
        if seg.routed_experts is None or supersedes:
            # a turn sampled wholly after a sync: its request prefilled the whole context under the
            # new weights (the sync dropped every cached K/V), so its routing is what its tokens saw
            # at every earlier position. Keeping the earlier turns' recording there left the trainer
            # nothing to replay for them (latest_version_routing) but live routing
            seg.routed_experts = ex
        else:  # routing recorded when a token's logits were produced wins; fill only the gaps
            old = seg.routed_experts
            merged = ex.copy()
            keep = (old >= 0).all(axis=(1, 2))
            merged[: old.shape[0]][keep] = old[keep]
            seg.routed_experts = merged

    def seal(self, reason: str) -> None:
        """Seal the current conversation's segment."""
        if reason not in SEAL_REASONS:
            raise ValueError(f"unknown seal reason {reason!r}")
        seg = self.open_segment
        if seg is not None:
            seg.seal_reason = reason

    def close(self) -> list[Segment]:
        """End the episode: seal every open segment and return all segments (copies), in the order
        they were opened."""
        for seg in self.segments:
            if seg.seal_reason is None:
                seg.seal_reason = self._rewritten.pop(id(seg), "episode_end")
        return [s.copy() for s in self.segments]


def json_value(x):
    """What JSON cannot hold, as the record keeps it: a numpy value as its Python value (str()
    made np.bool_(False) the string 'False', true when read back), anything else as its str()."""
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    return str(x)


def _as_sent(x) -> str:
    """JSON text of a message or tools as sent, key order kept (what a template's tojson renders)."""
    return json.dumps(x, default=str, ensure_ascii=False)


def _why_not_extending(conv: list[dict], msgs: list[dict]) -> str | None:
    """Why a request's messages do not extend a recorded conversation (request + returned reply)."""
    n = len(conv)
    if len(msgs) <= n or msgs[: n - 1] != conv[: n - 1]:
        return "history_rewritten"
    # (as JSON text too: Python's == holds 1 == 1.0 == True, so arguments an agent re-serialized, 1.0 as 1,
    # passed here and sealed at the render check as a template rewrite)
    if msgs[n - 1] != conv[n - 1] or json.dumps(msgs[n - 1], default=str, sort_keys=True) != json.dumps(
            conv[n - 1], default=str, sort_keys=True):
        return "assistant_changed"
    return None


def _same_conversation(conv: list[dict], msgs: list[dict]) -> bool:
    """Whether a request that does not extend a conversation rewrites it (a compaction that keeps
    the task, an edit, a changed system prompt, a new sample of the same request, a window that
    dropped the oldest turns): its first non-system message is one of the conversation's (a
    request of system messages only: the same first message). A request opening otherwise is
    another conversation (a summarizer, a sub-agent). The system prompt alone does not decide:
    a sub-agent or a side question under the agent's own system prompt read as a rewrite of the
    main conversation, sealed at every switch; a compaction whose first non-system message is new
    (a summary first) now opens beside the conversation it replaced, which stays open (its tokens
    train once either way) until the episode ends or it is evicted."""
    if not msgs or not conv:
        return False
    first_turn = next((m for m in msgs if m["role"] != "system"), None)
    return first_turn in conv if first_turn is not None else msgs[0] == conv[0]


def request_key(messages: list[dict], tools: list | None) -> tuple[str, str]:
    """What makes two requests the same request (rule 4): their canonical messages and tools as
    JSON text (JSON, not ==: 1 and 1.0 or true and 1 are different requests), keys in the order
    sent: a template renders them in that order (transformers' tojson does not sort), so two
    requests that differ only in key order render two prompts (sorted, the server's PromptMemo
    gave the second the first's)."""
    return json.dumps(messages), json.dumps(tools)


def _mismatch(recorded: list[int], sampled: list[int]) -> int:
    return sum(a != b for a, b in zip(recorded, sampled)) + abs(len(recorded) - len(sampled))


SEGMENT_TOTALS = ("identity_mismatch", "retokenization_drift", "sampled_tokens", "sampling_overridden")


def segment_stats(segments: list[Segment]) -> dict:
    """Totals of the token-identity measurements over segments."""
    # a segment without a measurement is a bug, not a 0; only files older than sampling_overridden lack it
    totals = {k: sum(s.stats[k] if k != "sampling_overridden" else s.stats.get(k, 0) for s in segments)
              for k in SEGMENT_TOTALS}
    return {"segments": len(segments), **totals, "seals": dict(Counter(s.seal_reason for s in segments if s.seal_reason))}

