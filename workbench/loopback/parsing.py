"""Replies from sampled ids: reasoning, content and tool calls, as the model profile says.

The engine returns a whole sample (ids); the server parses it once, then writes it in either wire
format (whole or streamed in pieces). The recorded trajectory is the ids, never this text.

Which parser does what (docs/ARCHITECTURE.md, "Model profiles"):
- tool parser `hermes` (the toy's, Qwen's `<tool_call>{json}</tool_call>`) is ours
  (workbench.loopback.toolcalls): on Qwen3's recorded outputs it reads 41/43 tool calls, as vLLM's.
  With a reasoning parser, vLLM's registered reasoning parser of that name
  (`vllm.reasoning.ReasoningParserManager`, e.g. `qwen3`) splits the reasoning off first, and ours
  reads the tool calls in the rest.
- any other tool parser is vLLM's: `vllm.parser.ParserManager.get_parser(tool, reasoning)`, the
  same composition vLLM's OpenAI server uses (reasoning first, tool calls from the rest), run
  standalone with the policy's tokenizer. gpt-oss's names (`openai`, `openai_gptoss`) are vLLM's
  harmony stubs: vLLM parses harmony from the ids (its HarmonyParser), and so do we.
- no reasoning parser and hermes (the toy): the text is content and tool calls, exactly as before.

Text: the sampled ids without the token that ended the turn, decoded with special tokens skipped,
unless vLLM's parser asks to keep them (its `adjust_request` sets skip_special_tokens=False:
Mistral's [TOOL_CALLS], Qwen3's parser engine), as vLLM's server decodes for it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import RequestError, loads
from .toolcalls import get_tool_parser

log = logging.getLogger(__name__)
# gpt-oss: vLLM's tool/reasoning parser names that only declare harmony (its HarmonyParser parses)
HARMONY_PARSERS = {"openai", "openai_gptoss"}


@dataclass
class Parsed:
    reasoning: str | None
    content: str
    calls: list[dict]  # {"name", "arguments" (dict)}


def _request(tools: list | None = None):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}], tools=tools or None)


# tool parsers whose replies are read with special tokens kept, where vLLM's own request adjustment
# skips them: Llama 3 writing `<|python_tag|>` inside a call's string argument (a file about tool
# calls) had it deleted, the agent wrote another file than the trained call says, unsealed and
# uncounted. vLLM's llama3_json parser reads the marker itself where it opens a call; the turn's end
# token is left out as for any parser keeping special tokens (reply_text). Measured on the 23 recorded
# Llama 3.3 outputs: each parses as before, the marker case as written.
KEEP_SPECIAL_TOKENS = {"llama3_json"}

_PROBE_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def reply_text(fmt, ids: list[int], finish: str, skip_special_tokens: bool, stop_ids=()) -> tuple[str, list[int]]:
    """The text a parser reads, and the ids it covers: the sampled ids decoded without special
    tokens, or, where the parser keeps them, without the one token that ended the turn (an end of
    turn of the format, a stop id, EOS), as vLLM's detokenizer leaves a stop token out."""
    ids = list(ids)
    if not skip_special_tokens and ids and finish == "stop":
        ends = set(getattr(fmt, "turn_end_ids", (fmt.end_of_turn_id,))) | set(stop_ids)
        ends.add(getattr(fmt.tokenizer, "eos_token_id", None))
        # any special token a stopped reply ends on: an engine stops on its generation_config's EOS ids too
        # (Llama's <|eom_id|>), which a server made without a profile does not name (kept, a call read as text)
        ends |= set(getattr(fmt, "special_ids", ()))
        ids = ids[:-1] if ids[-1] in ends else ids
    return fmt.decode(ids, skip_special_tokens=skip_special_tokens), ids


def ids_before(fmt, ids: list[int], chars: int, skip_special_tokens: bool) -> list[int]:
    """The longest prefix of `ids` whose text (decoded as reply_text decodes) stays within `chars`
    characters: the ids of a reply cut at a stop string, for a parser that reads ids (gpt-oss's
    harmony parser read the whole reply, and the agent got the stop string's text back). A token
    that holds both the text's last characters and the stop string's first (" STOP") is left
    out with it: the stop string never reaches the agent, a space before it may not either."""
    lo, hi = 0, len(ids)
    while lo < hi:  # decoded prefixes only grow: a binary search over their lengths
        mid = (lo + hi + 1) // 2
        if len(fmt.decode(ids[:mid], skip_special_tokens=skip_special_tokens)) <= chars:
            lo = mid
        else:
            hi = mid - 1
    return ids[:lo]


_ALNUM9 = re.compile(r"[A-Za-z0-9]{9}")


def sampled_call_ids(text: str, calls: list[dict]) -> list[str | None]:
    """The ids a Mistral model wrote in its `[TOOL_CALLS]` JSON list (NeMo writes
    `{"name", "arguments", "id"}`), one per parsed call: None where it wrote none, or one its
    template would refuse (not 9 alphanumerics), or one already used in the reply. vLLM's parser
    ignores them and hands out fresh ids; the template renders the call with the sampled id (it
    stays in the recorded ids) and each tool result with the id handed out, so every result
    pointed at a call id that was nowhere in the context the policy trained on."""
    at = text.rfind("[TOOL_CALLS]")
    if at < 0 or not calls:
        return [None] * len(calls)
    try:
        written, _ = json.JSONDecoder().raw_decode(text[at + len("[TOOL_CALLS]"):].lstrip())
    except ValueError:
        return [None] * len(calls)
    if not isinstance(written, list) or len(written) != len(calls):
        return [None] * len(calls)
    out, seen = [], set()
    for w, c in zip(written, calls):
        cid = w.get("id") if isinstance(w, dict) and w.get("name") == c["name"] else None
        ok = isinstance(cid, str) and _ALNUM9.fullmatch(cid) is not None and cid not in seen
        out.append(cid if ok else None)
        seen.add(cid)
    return out


def _special(tokenizer, token: str) -> bool:
    """Whether `token` is one of the tokenizer's special tokens (decoding skips it)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return token in (getattr(tokenizer, "all_special_tokens", None) or []) or any(
        str(t) == token and getattr(t, "special", False) for t in added.values())


class ReplyParser:
    """`parse(text, ids, parse_tools)` -> Parsed. `text`: the reply decoded as `skip_special_tokens`
    says (the server decodes it so). `template_kwargs`: the profile's chat-template kwargs (Qwen3's
    enable_thinking tells vLLM's qwen3 parser whether the reply opens with reasoning)."""

    def __init__(self, tokenizer, tool_parser: str = "hermes", reasoning_parser: str | None = None,
                 template_kwargs: dict | None = None):
        self.tokenizer, self.tool_parser, self.reasoning_parser = tokenizer, tool_parser, reasoning_parser
        self.template_kwargs = dict(template_kwargs or {})
        self.skip_special_tokens = True
        self.failures = 0  # replies a parser raised on (returned as content)
        self._ours = get_tool_parser(tool_parser)  # a clear error for an unknown name
        self._reasoning_cls = self._combined_cls = None
        self._harmony = False
        if self._ours is not None:  # ours (hermes), with vLLM's reasoning parser before it
            if reasoning_parser is not None:
                from vllm.reasoning import ReasoningParserManager

                try:
                    self._reasoning_cls = ReasoningParserManager.get_reasoning_parser(reasoning_parser)
                except KeyError:
                    raise ValueError(f"unknown reasoning parser {reasoning_parser!r}: not one of vLLM's "
                                     f"({sorted(ReasoningParserManager.list_registered())})") from None
                if reasoning_parser in HARMONY_PARSERS:
                    raise ValueError(f"reasoning parser {reasoning_parser!r} is harmony's: use tool parser 'openai'")
                self.skip_special_tokens = self._skip_special(self._reasoning_cls(tokenizer, chat_template_kwargs=self.template_kwargs))
            if self.skip_special_tokens and _special(tokenizer, "<tool_call>"):
                # a tokenizer marking the call markers special (vLLM's hermes parser keeps special tokens
                # for a request with tools for this): decoded without them, every call read as content,
                # the agent ran no tool, and parser_failures stayed 0
                self.skip_special_tokens = False
        else:  # vLLM's composition of its tool and reasoning parsers, as its OpenAI server runs them
            from vllm.parser.parser_manager import ParserManager

            harmony = self._harmony = tool_parser in HARMONY_PARSERS or reasoning_parser in HARMONY_PARSERS
            self._combined_cls = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                                                          enable_auto_tools=True, is_harmony=harmony)
            self.skip_special_tokens = self._skip_special(self._new(None))
            if tool_parser in KEEP_SPECIAL_TOKENS:
                self.skip_special_tokens = False

    def _new(self, tools):
        return self._combined_cls(self.tokenizer, tools, chat_template_kwargs=dict(self.template_kwargs))

    @staticmethod
    def _skip_special(parser) -> bool:
        """Whether vLLM would decode this parser's replies without special tokens (its
        adjust_request on a request with tools decides)."""
        try:
            return bool(parser.adjust_request(_request([_PROBE_TOOL])).skip_special_tokens)
        except Exception:  # a parser that cannot adjust a plain request: vLLM's default
            return True

    @functools.cached_property
    def reasoning_markers(self) -> tuple[str, str] | None:
        """(start, end) marker text of the reasoning parser: vLLM's thinking parsers name them
        (start_token / end_token); the parser-engine adapters (qwen3) keep their ids."""
        if self._reasoning_cls is None:
            return None
        try:
            p = self._reasoning_cls(self.tokenizer, chat_template_kwargs=dict(self.template_kwargs))
        except Exception:
            return None
        start, end = getattr(p, "start_token", None), getattr(p, "end_token", None)
        engine = getattr(p, "_parser_engine", None)
        if not (isinstance(start, str) and isinstance(end, str)) and engine is not None:
            ids = getattr(engine, "_reasoning_start_token_id", None), getattr(engine, "_reasoning_end_token_id", None)
            if all(isinstance(i, int) for i in ids):
                start, end = (self.tokenizer.convert_ids_to_tokens(i) for i in ids)
        return (start, end) if isinstance(start, str) and isinstance(end, str) and start and end else None

    @functools.cached_property
    def splits_reasoning(self) -> bool:
        """Whether the reasoning parser reads a marked block as reasoning under the profile's template
        kwargs: vLLM's qwen3 reads none with enable_thinking off (`qwen3-nothink`), and a reply that
        writes `<think>...</think>` anyway is content whole. (Markers unknown: assumed to.)"""
        markers = self.reasoning_markers
        if self._reasoning_cls is None or markers is None:
            return self._reasoning_cls is not None
        try:
            rp = self._reasoning_cls(self.tokenizer, chat_template_kwargs=dict(self.template_kwargs))
            reasoning, _ = rp.extract_reasoning(f"{markers[0]}x{markers[1]}y", _request(None))
        except Exception:
            return True
        return bool(reasoning)

    def prompt_opens_reasoning(self, fmt, prompt_tail) -> bool:
        """Whether the generation prompt (its last ids) opens the reasoning block, so that the reply
        starts inside it (Qwen3-Thinking-2507, DeepSeek R1)."""
        markers = self.reasoning_markers
        return markers is not None and fmt.decode(list(prompt_tail)).rstrip().endswith(markers[0])

    def parse(self, text: str, ids: list[int], parse_tools: bool = True, tools: list | None = None,
              opened: bool = True) -> Parsed:
        """Never raises: a parser that fails on a reply (a random model's bytes) leaves the text as
        the model wrote it, as content (logged; `failures` counts them). `opened`: whether the
        reply may start inside a reasoning block (prompt_opens_reasoning; True: as vLLM reads it).
        A reply that neither opens nor closes one, after a prompt that did not open one, has no
        reasoning: vLLM's qwen3 parser read all of it as reasoning (Qwen3 with thinking on may
        answer without <think>), and the agent got content '' for a right answer."""
        try:
            return self._parse(text, ids, parse_tools, tools, opened)
        except Exception:
            self.failures += 1
            log.warning("reply parser (%s, %s) failed; the reply is returned as content", self.tool_parser,
                        self.reasoning_parser, exc_info=True)
            return Parsed(None, text, [])

    def _parse(self, text: str, ids: list[int], parse_tools: bool, tools: list | None, opened: bool = True) -> Parsed:
        if self._combined_cls is not None:
            reasoning, content, calls = self._new(tools).parse(text, _request(tools), enable_auto_tools=parse_tools,
                                                               model_output_token_ids=list(ids))
            out = []
            for c in (calls or []) if parse_tools else []:
                try:
                    args = json.loads(c.arguments or "{}")
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict) or not self._sendable(c.name, args):  # as hermes: a call we cannot read
                    return self.as_text(text, ids, tools)  # leaves the text as written
                out.append({"name": c.name, "arguments": args})
            # (read after the reasoning: a call only drafted there is no call the reply makes)
            after = text[text.find(reasoning) + len(reasoning):] if reasoning and reasoning in text else text
            if out and not COVERAGE.get(self.tool_parser, lambda text, calls: True)(after, out):
                self.failures += 1  # (counted as a reply no call of which is handed out)
                return self.as_text(text, ids, tools)
            return Parsed(reasoning or None, (content or "").strip() if out else (content or ""), out)
        reasoning, markers = None, self.reasoning_markers
        # (the block opened by the prompt, or by the reply's start, or closed in it: a marker elsewhere,
        # "Note the <think> tag.", made the whole answer reasoning again)
        if self._reasoning_cls is not None and (opened or markers is None or text.lstrip().startswith(markers[0])
                                                or markers[1] in text):
            rp = self._reasoning_cls(self.tokenizer, chat_template_kwargs=dict(self.template_kwargs))
            reasoning, rest = rp.extract_reasoning(text, _request(tools))
            reasoning, rest = _closed_where_written(text, reasoning, rest, markers)
            text = _rest_as_written(text, reasoning, rest, markers) or ""
        content, calls = self._ours(text) if parse_tools else (text, [])
        if not all(self._sendable(c["name"], c["arguments"]) for c in calls):
            return Parsed(reasoning or None, text, [])  # the reasoning kept, as streaming sent it
        return Parsed(reasoning or None, content, calls)

    def as_text(self, text: str, ids: list[int], tools: list | None, opened: bool = True) -> Parsed:
        """A reply whose tool call cannot be handed out, as vLLM's parser reads it with tools off:
        the reasoning apart, the rest as the model wrote it (call markup included). The whole
        decoded reply went out as content, the reasoning and its end marker in it a second time
        (`R</think>OK.<｜tool▁calls▁begin｜>...` with DeepSeek V3.1), or, for arguments that were no
        JSON, the content without the call's text. Harmony (gpt-oss) has no such text: its reply,
        decoded without special tokens, is its channel headers glued to the analysis and the call
        ('analysisNeed calc.assistantcommentary to=functions.calc json{...'), so the reply is the
        final channel's text, none where the call was all. Ours (hermes): the reply read with tools
        off (`opened` as parse takes it)."""
        if self._combined_cls is None:
            return self._parse(text, ids, False, tools, opened)
        reasoning, content, _ = self._new(tools).parse(text, _request(tools), enable_auto_tools=False,
                                                         model_output_token_ids=list(ids))
        return Parsed(reasoning or None, ("" if self._harmony else text) if content is None else content, [])

    def _sendable(self, name, arguments) -> bool:
        """Whether the agent can send this call back: its history's next request is held to the
        body's bounds (a 120-digit number, NaN, nesting past MAX_JSON_DEPTH: a 400 at every later
        turn of the episode). A call that is not is left as the text the model wrote (counted).
        The name too: a JSON-escaped lone surrogate in it ("calc\\ud800") could not be encoded, the
        recorded turn's reply was a 500 the SDK retried into the same 500."""
        try:
            if not isinstance(name, str):
                raise TypeError
            loads(json.dumps({"name": name, "arguments": arguments}), what="the tool call")
            return True
        except (RequestError, ValueError, TypeError):
            self.failures += 1
            return False


def _closed_where_written(text: str, reasoning: str | None, rest: str | None, markers) -> tuple:
    """(reasoning, rest) with the reasoning ending at the reply's first end marker where the parser
    ended it sooner. vLLM's qwen3 parser takes a <tool_call> as an implicit end of the reasoning
    (a reply that calls without closing its <think>), even inside a block the reply closes later:
    a call Qwen3 only drafted in its thinking was handed to the agent and run (once more where the
    reply then made it), the rest of the reasoning sent as the answer. A reply with no end marker
    keeps the parser's implicit end."""
    end = text.find(markers[1]) if markers is not None and reasoning is not None else -1
    if end < 0:
        return reasoning, rest
    head = text[:end]
    last = head.rfind("<tool_call>")
    if last > head.rfind("</tool_call>") and head[last + len("<tool_call>"):].lstrip().startswith("{"):
        # the marker is inside an open call's arguments (code that strips think tags): the reasoning did
        # end at that call, as the parser read it (a tag only named, "<tool_call> is needed?", opens none)
        return reasoning, rest
    opened = head.find(markers[0])
    head = head[opened + len(markers[0]):] if opened >= 0 else head
    if len(reasoning) < len(head) and head.startswith(reasoning):  # (cut sooner: the same text's prefix)
        return head, text[end + len(markers[1]):]
    return reasoning, rest


def _rest_as_written(text: str, reasoning: str | None, rest: str | None, markers) -> str | None:
    """The reply after its reasoning as the model wrote it. vLLM's qwen3 parser deletes every later
    end marker from the rest: an answer that names `</think>`, or a call whose code splits on it
    (`s.split("</think>")` handed out as `s.split("")`, a ValueError), reached the agent otherwise
    than the tokens trained say, unsealed and uncounted. The rest is taken from the text after the
    reasoning (and its end marker) wherever the parser's equals it but for those deletions."""
    if rest is None or markers is None:
        return rest
    start, end = markers
    if reasoning is None:  # (none found: the whole reply, `</think>` in a call's code deleted all the same)
        after = text
    else:
        base = text.find(start) + len(start) if text.lstrip().startswith(start) else 0
        at = text.find(reasoning, base)
        if at < 0:
            return rest
        after = text[at + len(reasoning):]
        after = after[len(end):] if after.startswith(end) else after
    return after if after != rest and after.replace(end, "") == rest.replace(end, "") else rest


# Whether vLLM's parse of a reply with calls covers all of it, per tool parser: vLLM's parsers hand
# out the calls they find and drop what else the reply holds (text after the calls, a second call
# block, a parameter whose value holds the closing tag), while the trained context holds it all: the
# agent then answers calls, or text, other than the tokens say, unsealed and uncounted. A reply that
# is not covered is handed out as the text the model wrote (ReplyParser.as_text), counted.
COVERAGE: dict[str, Callable[[str, list[dict]], bool]] = {}


def _covers(*names: str):
    def register(fn):
        for name in names:
            COVERAGE[name] = fn
        return fn
    return register


@_covers("mistral")
def _one_call_list(text: str, calls: list[dict] | None = None, marker: str = "[TOOL_CALLS]") -> bool:
    """False for a Mistral v3 reply whose [TOOL_CALLS] JSON list is followed by more than
    whitespace: vLLM's mistral parser hands out the first list's calls alone, a second
    [TOOL_CALLS] block or text after the list dropped, while the trained context holds them all
    (two calls, one result). True for anything else (the [TOOL_CALLS]name[ARGS]{...} form repeats
    its marker per call)."""
    at = text.find(marker)
    rest = text[at + len(marker):].lstrip() if at >= 0 else ""
    if not rest.startswith("["):
        return True
    try:
        _, end = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return True  # (the parser's own reading decides)
    return not rest[end:].strip()


@_covers("llama3_json")
def _json_calls_only(text: str, calls: list[dict]) -> bool:
    """Llama 3's JSON calls: the reply is `<|python_tag|>`? then its calls' objects, `;` between
    them, and nothing else (vLLM's llama3_json parser drops text before, between and after them:
    "Here: {...}", "{...} and then I will delete it")."""
    rest = text.strip()
    rest = rest[len("<|python_tag|>"):].lstrip() if rest.startswith("<|python_tag|>") else rest
    found, decoder = 0, json.JSONDecoder()
    while rest:
        try:
            _, end = decoder.raw_decode(rest)
        except ValueError:
            return False
        found, rest = found + 1, rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return False
    return found == len(calls)


@_covers("deepseek_v3", "deepseek_v31")
def _deepseek_blocks_only(text: str, calls: list[dict]) -> bool:
    """DeepSeek V3 / V3.1: after the content, one calls block of complete calls, and nothing after it
    (vLLM's parsers drop text after the block, a second block, and a call the reply cut)."""
    begin, end, call, call_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    at = text.find(begin)
    if at < 0:
        return True
    body, found = text[at + len(begin):], 0
    while True:
        body = body.lstrip()
        if not body or body.startswith(end):
            return found == len(calls) and not body[len(end):].strip()
        closed = body.find(call_end)
        if not body.startswith(call) or closed < 0:
            return False
        found, body = found + 1, body[closed + len(call_end):]


@_covers("qwen3_coder")
def _xml_calls_only(text: str, calls: list[dict]) -> bool:
    """Qwen3-Coder's XML calls: one `<function=` per call handed out, one `<parameter=` ... `</parameter>`
    per argument (its `</parameter>` may be missing: the parser ends it at the next tag, as the model
    meant), nothing but whitespace between and after the call blocks (vLLM's qwen3_coder parser cut a
    value holding `</parameter>`, kept a repeated parameter's last value, made a call of a
    `<function=` written inside a value, and dropped the text after the calls)."""
    params, opened = sum(len(c["arguments"]) for c in calls), text.count("<parameter=")
    if text.count("<function=") != len(calls) or opened != params or text.count("</parameter>") > opened:
        return False
    first = text.find("<tool_call>")
    blocks = text[first:] if first >= 0 else ""
    # (the last block may be unclosed: a stop string the agent set at "</tool_call>" cut it, and vLLM's parser
    # reads that call, as vLLM's server hands it out)
    return not re.sub(r"<tool_call>.*?(?:</tool_call>|\Z)", "", blocks, flags=re.S).strip()
