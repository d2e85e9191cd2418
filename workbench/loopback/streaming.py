"""Real streaming: a reply's text sent while the engine samples it.

The engine streams sampled ids (RolloutEngine.generate_stream); the turn still records the
finished Sample, exactly as unstreamed (server.call_engine). Here the ids become text deltas,
decoded incrementally and sent as far as the finished reply's parse cannot change them; the
rest comes from the finished reply, so the deltas always put together the unstreamed reply.
docs/ARCHITECTURE.md ("The loopback server", "Streaming is real") has what is held back and why.
"""

from __future__ import annotations

import asyncio
import logging

from .protocol import Reply, pieces
from .toolcalls import TOOL_PARSERS

log = logging.getLogger(__name__)
TOOL_MARKERS = {"hermes": ("<tool_call>",)}  # where a tool call may begin, per tool parser of ours


class TokenFeed:
    """Filled by the engine call of a streamed turn (server.call_engine): the prompt's length,
    then the sampled ids as the engine produces them; `changed` is set on each."""

    def __init__(self):
        self.prompt_tokens: int | None = None
        self.prompt_tail: list[int] = []  # the prompt's last ids: does the generation prompt open a reasoning block?
        self.ids: list[int] = []
        self.changed = asyncio.Event()
        self.gone = False  # the client left before the stream's end (its response was cancelled)

    def prompt(self, ids: list[int]) -> None:
        self.prompt_tokens, self.prompt_tail = len(ids), list(ids[-8:])
        self.changed.set()

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.changed.set()


def _partial(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`. Only the
    tail's places holding the marker's first character are tried (every length was, each a slice:
    64 stop strings of 1,024 characters cost 7.5 ms a streamed token on the server's loop)."""
    best = 0
    for m in markers:
        tail = text[-(len(m) - 1):] if len(m) > 1 else ""
        i = tail.find(m[0]) if tail else -1
        while i != -1 and len(tail) - i > best:
            if m.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(m[0], i + 1)
    return best


class ReplyStream:
    """The text deltas of one streamed reply: `feed(ids)` as ids arrive, `finish(reply)` once the
    finished reply is parsed; each returns [(kind, text)], kind "reasoning" or "content"."""

    def __init__(self, fmt, parser, req, prompt_tail: list[int] = ()):
        self.parser, self.stops = parser, [s for s in req.sampling.stop if s]
        backend = getattr(fmt, "_backend", None)
        self.live = backend is not None and parser.tool_parser in TOOL_PARSERS
        self.markers = TOOL_MARKERS.get(parser.tool_parser, ()) if req.parse_tools else ()
        # (none where the parser reads no reasoning under the profile's kwargs, Qwen3 with thinking off:
        # a <think> block the reply writes anyway is content, and streamed as reasoning the agent got it
        # twice, once in each, and a session sent back sealed as the agent's change)
        splits = getattr(parser, "splits_reasoning", True)
        self.reasoning = parser.reasoning_markers if self.live and splits else None
        if self.live and getattr(parser, "_reasoning_cls", None) is not None and splits and self.reasoning is None:
            self.live = False  # a reasoning parser whose markers we cannot name: everything at the finish
        # a generation prompt that opens the reasoning block (Qwen3 thinking): the reply starts inside it
        self.opened = self.reasoning is not None and parser.prompt_opens_reasoning(fmt, prompt_tail)
        self.lag = not parser.skip_special_tokens
        self.text, self.pending, self.closed = "", [], False
        self.sent = {"reasoning": "", "content": ""}
        if self.live:
            from tokenizers.decoders import DecodeStream

            self._step = DecodeStream(skip_special_tokens=parser.skip_special_tokens).step
            self._backend = backend

    def feed(self, ids: list[int]) -> list[tuple[str, str]]:
        if not self.live or self.closed:
            return []
        self.pending.extend(ids)
        ready = self.pending[:-1] if self.lag else self.pending
        for i in ready:
            self.text += self._step(self._backend, i) or ""
        self.pending = self.pending[len(ready):]
        return self._deltas()

    def _deltas(self) -> list[tuple[str, str]]:
        text, out = (self.reasoning[0] if self.opened else "") + self.text, []
        for s in self.stops:  # the reply's text ends at a stop string
            if s in text:
                text, self.closed = text[: text.find(s)], True
        hold = _partial(text, self.stops)
        c0 = 0
        if self.reasoning is not None:
            start, end = self.reasoning
            if not text.startswith(start):
                if not start.startswith(text):
                    self.closed = True  # no explicit reasoning block: the parse decides at the finish
                return []
            r_end = text.find(end, len(start))
            inner = text[len(start): r_end if r_end >= 0 else len(text)]
            # where vLLM's reasoning parser reads otherwise than "start to end" (qwen3: a tool call's
            # marker ends the reasoning without the end marker, tools or not; a second start marker
            # is dropped from it), the finish decides: streamed on, the agent got text the finished
            # reply does not hold, and an Anthropic agent sending its thinking back sealed the session
            risky = [*TOOL_MARKERS.get(self.parser.tool_parser, ()), start]
            odd = min([p for p in (inner.find(m) for m in risky) if p >= 0], default=-1)
            if odd >= 0:
                self.closed = True
                return out + self._send("reasoning", inner[:odd])
            if r_end < 0:
                return out + self._send("reasoning", inner[: len(inner) - max(hold, _partial(inner, [end, *risky]))])
            out += self._send("reasoning", inner)
            c0 = r_end + len(end)
        body = text[c0:]
        # (in the content, a reasoning marker is dropped by the parser: the finish decides there too)
        marks = [*self.markers, *(getattr(self.parser, "reasoning_markers", None) or ())]
        cut = min([p for p in (body.find(m) for m in marks) if p >= 0], default=-1)
        if cut >= 0:
            body, self.closed = body[:cut], True
        else:
            body = body[: len(body) - _partial(body, [*marks, *self.stops])]
        if self.markers:
            body = body.rstrip()  # a call after it would strip trailing whitespace
        if body[:1].isspace() and self.sent["content"] == "":
            self.closed = True  # see the module docstring: the finish sends it
            return out
        return out + self._send("content", body)

    def _send(self, kind: str, body: str) -> list[tuple[str, str]]:
        sent = self.sent[kind]
        if len(body) <= len(sent) or not body.startswith(sent):
            return []
        self.sent[kind] = body
        return [(kind, body[len(sent):])]

    def finish(self, reply: Reply) -> list[tuple[str, str]]:
        """The rest of the finished reply's reasoning and content, in pieces (its tool calls the
        protocol writes from the reply). What was sent is always a prefix of the reply's text;
        should a parser disagree, the rest is dropped and the disagreement logged."""
        out = []
        for kind, final in (("reasoning", reply.reasoning or ""), ("content", reply.content or "")):
            sent = self.sent[kind]
            if not final.startswith(sent):
                log.warning("streamed %s is not a prefix of the finished reply's (%r vs %r)", kind, sent[:80], final[:80])
                continue
            out += [(kind, p) for p in pieces(final[len(sent):])]
        return out
