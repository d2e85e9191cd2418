"""The template linter: what a chat template does to exact token accumulation, before training.

    python -m workbench.lint qwen3                 # a real family (workbench.real_models), offline
    python -m workbench.lint path/to/tokenizer_dir # any HF tokenizer directory with a chat template
    report = workbench.lint.lint("llama3.1"); report   # a table in the terminal, HTML in a notebook

For a fixed set of conversation shapes (SHAPES) it plays the agent and the model against the real
`Accumulator`: each request is planned, the model's reply is the template's own rendering of that
reply up to the engine's stop token (what a model trained on the template samples), the server
returns it as the loopback does, and the next request is planned. Per shape and turn it reports
whether accumulation extends the exact sampled prefix or which seal happens and why, with the
first token where the recorded ids and a fresh render of the request part, shown in context:

    extends     the engine prompt is the recorded ids + the template's delta, and equals a fresh render
    extends*    it extends (token identity holds), but a fresh render of the same messages tokenizes
                differently: the policy is trained on a context the template itself would not produce
    seal:R      the segment is sealed with reason R (tokens.SEAL_REASONS) and a new one starts
    error       the template cannot render the conversation, or the server cannot make it (its
                parse returned fewer tool calls than the model made: no agent can answer them all);
                `--strict` makes the command line exit 1 on one

Plus retokenization traps of the tokenizer (TRAPS): BOS doubling, text after a control token that
tokenizes differently from running text (leading spaces), merged boundaries, control-token strings in text,
and decode/encode round trips; and two of the template: tools= it does not render, and a system
prompt it drops from the request after a tool result (Mistral v3).

The model played writes the template's own form of each reply. A real model may not: from recorded
outputs, gpt-oss writes its call header `<|channel|>commentary to=functions.f <|constrain|>json`
(the template renders ` to=functions.f<|channel|>commentary json`) and Mistral-7B-v0.3 writes no
call id, so their tool results are `extends*` (30 of 35, and every one) where the linter says
`extends`: docs/ARCHITECTURE.md's table of recorded outputs has the real verdicts.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .tokens import Accumulator, ChatFormat

# ------------------------------------------------------------------ conversation shapes
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _user(text):
    return {"role": "user", "content": text}


def _tool(text, call_id="call_0", name="get_weather"):
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": text}


def _reply(content="", calls=(), reasoning=None, cut=None):
    return {"content": content, "calls": list(calls), "reasoning": reasoning, "cut": cut}


# Each shape: (description, tools, steps); a step is (messages the agent adds, the model's reply).
# A step whose first added message is a system message replaces the system prompt instead.
SHAPES: dict[str, tuple[str, list | None, list]] = {
    "plain": ("plain multi-turn chat", None, [
        ([{"role": "system", "content": "You are a helpful assistant."}, _user("What is the capital of France?")],
         _reply("The capital of France is Paris.")),
        ([_user("And of Italy?")], _reply("Rome.")),
        ([_user("Thanks!")], _reply("You're welcome.")),
    ]),
    "tool_one": ("one tool call, one result, then a new user turn", TOOLS, [
        ([_user("What's the weather in Paris?")], _reply(calls=[("get_weather", {"city": "Paris"})])),
        ([_tool("sunny, 21 C")], _reply("It is sunny and 21 C in Paris.")),
        ([_user("And tomorrow?")], _reply("I can only see today's weather.")),
    ]),
    "tool_many": ("two tool calls in one turn, two results", TOOLS, [
        ([_user("Weather in Paris and in Rome?")],
         _reply(calls=[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])),
        ([_tool("sunny, 21 C", "call_0"), _tool("rain, 14 C", "call_1")], _reply("Paris: sunny, 21 C. Rome: rain, 14 C.")),
        ([_user("Thanks!")], _reply("You're welcome.")),
    ]),
    "reasoning_on": ("reasoning before a tool call, after its result, then a new user turn", TOOLS, [
        ([_user("What's the weather in Paris?")],
         _reply(calls=[("get_weather", {"city": "Paris"})], reasoning="The user wants the weather; call get_weather.")),
        ([_tool("sunny, 21 C")], _reply("It is sunny in Paris.", reasoning="The tool says sunny.")),
        ([_user("Is that warm?")], _reply("Yes, 21 C is mild and warm.", reasoning="21 C is mild.")),
    ]),
    "reasoning_off": ("the same turns without reasoning", TOOLS, [
        ([_user("What's the weather in Paris?")], _reply(calls=[("get_weather", {"city": "Paris"})])),
        ([_tool("sunny, 21 C")], _reply("It is sunny in Paris.")),
        ([_user("Is that warm?")], _reply("Yes, 21 C is mild and warm.")),
    ]),
    "system_changed": ("the system prompt changes between requests", None, [
        ([{"role": "system", "content": "You are terse."}, _user("Hi")], _reply("Hello.")),
        ([{"role": "system", "content": "You are verbose."}, _user("How are you?")], _reply("Very well, thank you.")),
    ]),
    "max_tokens_cut": ("a reply cut by max_tokens, then a new user turn", None, [
        ([_user("Tell me a story.")], _reply("Once upon a time a tiny robot counted every star in the sky.", cut=6)),
        ([_user("Go on.")], _reply("It found one more.")),
    ]),
}


# ------------------------------------------------------------------ results
@dataclass
class TurnResult:
    turn: int
    verdict: str  # "start" (first turn), "extends", "extends*", "seal:<reason>", "error"
    detail: str = ""
    diff_at: int | None = None  # first differing token index (recorded ids vs fresh render)
    context: str = ""  # that token in context


@dataclass
class ShapeResult:
    shape: str
    description: str
    verdict: str  # "error" if a turn errs, else the first non-"extends" turn verdict, or "extends"
    turns: list[TurnResult] = field(default_factory=list)
    segments: int = 0

    @property
    def first(self) -> TurnResult | None:
        return next((t for t in self.turns if t.verdict == self.verdict and t.verdict != "start"), None)


@dataclass
class Trap:
    name: str
    found: bool
    detail: str


@dataclass
class LintReport:
    name: str
    end_of_turn: str
    stops: list[str]
    shapes: list[ShapeResult]
    traps: list[Trap]

    def verdicts(self) -> dict[str, str]:
        return {s.shape: s.verdict for s in self.shapes}

    def traps_found(self) -> dict[str, bool]:
        return {t.name: t.found for t in self.traps}

    def to_dict(self) -> dict:
        return {"name": self.name, "end_of_turn": self.end_of_turn, "stops": self.stops,
                "verdicts": self.verdicts(), "traps": self.traps_found(),
                "shapes": [asdict(s) for s in self.shapes], "trap_details": [asdict(t) for t in self.traps]}

    def table(self, width: int = 110) -> str:
        rows = [f"template lint: {self.name}   (end of turn {self.end_of_turn!r}, stops {self.stops})", ""]
        rows.append(f"{'shape':<16}{'verdict':<24}{'turn':<6}why / first differing token")
        rows.append("-" * width)
        for s in self.shapes:
            t = s.first
            why = "" if t is None else (t.detail + (f"  @{t.diff_at}: {t.context}" if t.context else ""))
            rows.append(f"{s.shape:<16}{s.verdict:<24}{'' if t is None else t.turn:<6}{why}"[: 4 * width])
        rows += ["", f"{'trap':<22}{'found':<7}detail", "-" * width]
        for t in self.traps:
            rows.append(f"{t.name:<22}{'YES' if t.found else 'no':<7}{t.detail}")
        return "\n".join(rows)

    def __repr__(self) -> str:  # (str() too)
        return self.table()

    def _repr_html_(self) -> str:
        colour = {"extends": "#d8f0d8", "extends*": "#fff1c2", "error": "#f4c7c7"}
        e = html.escape
        out = [f"<div><b>template lint: {e(self.name)}</b> <small>end of turn <code>{e(self.end_of_turn)}</code>, "
               f"stops <code>{e(', '.join(self.stops))}</code></small>",
               "<table style='border-collapse:collapse;font-size:90%'><tr><th style='text-align:left'>shape</th>"
               "<th style='text-align:left'>verdict</th><th>turn</th><th style='text-align:left'>why</th>"
               "<th style='text-align:left'>first differing token</th></tr>"]
        for s in self.shapes:
            t = s.first
            bg = colour.get(s.verdict, "#f9d9c9" if s.verdict.startswith("seal") else "#ffffff")
            out.append(f"<tr style='background:{bg}'><td title='{e(s.description)}'>{e(s.shape)}</td><td><b>{e(s.verdict)}</b></td>"
                       f"<td>{'' if t is None else t.turn}</td><td>{e('' if t is None else t.detail)}</td>"
                       f"<td><code>{e('' if t is None or t.diff_at is None else f'@{t.diff_at} ' + t.context)}</code></td></tr>")
        out.append("</table><table style='border-collapse:collapse;font-size:90%;margin-top:6px'>"
                   "<tr><th style='text-align:left'>trap</th><th>found</th><th style='text-align:left'>detail</th></tr>")
        for t in self.traps:
            out.append(f"<tr style='background:{'#f9d9c9' if t.found else '#d8f0d8'}'><td>{e(t.name)}</td>"
                       f"<td>{'yes' if t.found else 'no'}</td><td><code>{e(t.detail)}</code></td></tr>")
        out.append("</table></div>")
        return "".join(out)


# ------------------------------------------------------------------ the simulation
@dataclass
class _Sample:  # what the accumulator reads from an engine sample
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"
    routed_experts: object = None


def sample_of(ids: list[int], finish_reason: str = "stop") -> _Sample:
    return _Sample(list(ids), [0.0] * len(ids), [0] * len(ids), finish_reason)


def _tok(fmt: ChatFormat, i: int) -> str:
    return fmt.decode([i])


def diff_context(fmt: ChatFormat, a: list[int], b: list[int], k: int = 5) -> tuple[int | None, str]:
    """First index where a and b differ, and both sides in context: `...ctx [a_i | b_i] ...`."""
    n = min(len(a), len(b))
    i = next((j for j in range(n) if a[j] != b[j]), None)
    if i is None:
        if len(a) == len(b):
            return None, ""
        i = n
    before = fmt.decode(a[max(0, i - k):i])
    mine = fmt.decode(a[i:i + 2]) or "<end>"
    theirs = fmt.decode(b[i:i + 2]) or "<end>"
    if mine == theirs:  # (a character cut between byte tokens decodes to U+FFFD on both sides: the bytes differ)
        mine, theirs = text_bytes(fmt, a[i:i + 2]), text_bytes(fmt, b[i:i + 2])
    return i, f"{before!r} then recorded {mine!r} vs render {theirs!r}"


def text_bytes(fmt: ChatFormat, ids: list[int]) -> bytes:
    """The bytes `ids` stand for (their vocabulary pieces: a character split over byte tokens is its
    bytes, where a decode gives U+FFFD for each part); a decode's UTF-8 where the format has no pieces."""
    try:
        return b"".join(fmt.token_bytes(ids))
    except (AttributeError, NotImplementedError, KeyError, ValueError):
        return fmt.decode(ids).encode()


class _Model:
    """Plays the model and the loopback server for one template."""

    def __init__(self, fmt: ChatFormat, stops: list[str], reasoning_in_content: bool, parser=None):
        self.fmt, self.stops, self.reasoning_in_content = fmt, stops, reasoning_in_content
        self.parser = parser  # the loopback's ReplyParser of the model profile (None: no profile known)
        self.id_style = getattr(fmt, "message_form", {}).get("tool_call_ids")
        self.specials = set(getattr(fmt.tokenizer, "all_special_tokens", []) or [])
        self.specials |= {str(t) for t in (getattr(fmt.tokenizer, "added_tokens_decoder", {}) or {}).values()}
        self.special_ids = {i for i, t in (getattr(fmt.tokenizer, "added_tokens_decoder", {}) or {}).items()
                            if getattr(t, "special", False)}

    def sampled_ids(self, msgs, tools, reply, prompt_text) -> list[int]:
        """The ids a model trained on this template samples for `reply`: the template's own
        rendering of the reply as the last turn of `msgs` (the plan's canonical messages), after
        the generation prompt, up to a stop token."""
        m = {"role": "assistant", "content": reply["content"]}
        if reply["calls"]:
            m["tool_calls"] = [{"id": self.call_id(k), "type": "function", "function": {"name": n, "arguments": a}}
                               for k, (n, a) in enumerate(reply["calls"])]
        if self.parser is not None:  # the render the template gets: what canonical messages keep
            m = self.fmt.canonical({**m, "tool_calls": m.get("tool_calls") or []})
        if reply["reasoning"]:
            m["reasoning_content"] = m["thinking"] = reply["reasoning"]
        full = self.fmt.render(msgs + [m], tools, add_generation_prompt=False)
        start = len(prompt_text) if full.startswith(prompt_text) else None
        opening = ""  # what the model samples first where the prompt opened a reasoning block the render omits
        if start is None:  # the reply changes how earlier turns render (gpt-oss drops a tool call's analysis
            # once a final answer follows): the reply starts after the last request message's render
            base = self.fmt.render(msgs, tools, add_generation_prompt=False)
            gen = prompt_text[len(base):] if prompt_text.startswith(base) else ""
            tail = base[-40:]
            p = full.rfind(tail) if tail else -1
            if p >= 0 and full[p + len(tail):].startswith(gen):
                start = p + len(tail) + len(gen)
            elif p >= 0:
                # a generation prompt that opens <think> (QwQ, R1) over a history render without it: the reply
                # starts where the two part, cut back to a line's or a special token's end (at the first
                # differing character it started inside a shared '<': '<t|ool_call>' read as no call), after
                # the reasoning the model writes to close the block the prompt opened
                after = full[p + len(tail):]
                k = next((i for i, (x, y) in enumerate(zip(after, gen)) if x != y), min(len(after), len(gen)))
                cut = max([after.rfind("\n", 0, k) + 1] + [after.find(s) + len(s) for s in self.specials
                                                           if s and 0 <= after.find(s) and after.find(s) + len(s) <= k])
                start = p + len(tail) + cut
                markers = self.parser.reasoning_markers if self.parser is not None else None
                if markers and gen[cut:].rstrip().endswith(markers[0]):
                    opening = (reply["reasoning"] or "") + "\n" + markers[1] + "\n\n"
            else:
                start = next((i for i, (x, y) in enumerate(zip(full, prompt_text)) if x != y), min(len(full), len(prompt_text)))
        turn = opening + full[start:]
        hits = [(turn.find(s), s) for s in self.stops if s and s in turn]
        if hits:
            pos, s = min(hits)
            text = turn[: pos + len(s)]
        else:  # the template ends the turn with another control token (e.g. harmony's <|end|>)
            text = turn.rstrip()
            last = next((s for s in sorted(self.specials, key=len, reverse=True) if s and text.endswith(s)), None)
            text = (text[: -len(last)] if last else text) + self.stops[0]
        ids = self.fmt.encode(text)
        return ids[: reply["cut"]] if reply["cut"] else ids

    def call_id(self, k: int) -> str:
        """The k-th tool-call id, of the shape the loopback hands out for the profile (fixed here)."""
        return f"call{k:05d}" if self.id_style == "alnum9" else f"call_{k}"

    def returned_message(self, reply, ids, tools=None, prompt_ids=()) -> dict:
        """The assistant message as the loopback returns it (and the agent sends it back). With a
        profile: the server's own parse of the sampled ids (loopback.parsing: reasoning, content,
        tool calls), after the prompt `prompt_ids` (does it open the reasoning block?)."""
        if self.parser is not None:
            from .loopback.parsing import reply_text

            text, body = reply_text(self.fmt, ids, "length" if reply["cut"] else "stop", self.parser.skip_special_tokens)
            opened = self.parser.prompt_opens_reasoning(self.fmt, list(prompt_ids)[-8:]) if prompt_ids else True
            p = self.parser.parse(text, body, tools=tools, opened=opened)
            msg = {"role": "assistant", "content": p.content}
            if p.reasoning:
                msg["reasoning_content"] = p.reasoning
            if p.calls:
                msg["tool_calls"] = [{"id": self.call_id(k), "type": "function", "function": {
                    "name": c["name"], "arguments": json.dumps(c["arguments"])}} for k, c in enumerate(p.calls)]
            return msg
        calls = [{"id": self.call_id(k), "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                 for k, (n, a) in enumerate(reply["calls"])]
        if reply["cut"]:  # the text after the last control token (a parser strips channel markup)
            k = max((j + 1 for j, i in enumerate(ids) if i in self.special_ids), default=0)
            content = self.fmt.decode(ids[k:], skip_special_tokens=True)
        elif self.reasoning_in_content:  # the reasoning markup is plain text the server keeps in content
            text = self.fmt.decode(ids, skip_special_tokens=True)
            content = text if not calls else (text[: text.find("</think>") + 8] if "</think>" in text else "")
            if calls:
                content = (content + "\n\n" + reply["content"]).strip()
        else:
            content = reply["content"]
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg


def run_shape(fmt: ChatFormat, name: str, stops: list[str], reasoning_in_content: bool = False,
              accumulator_cls=Accumulator, parser=None) -> ShapeResult:
    desc, tools, steps = SHAPES[name]
    model = _Model(fmt, stops, reasoning_in_content, parser)
    acc = accumulator_cls(fmt)
    msgs: list[dict] = []
    res = ShapeResult(name, desc, "extends")
    last_ids, last_cut = [], False
    for turn, (incoming, reply) in enumerate(steps, 1):
        if incoming and incoming[0]["role"] == "system" and msgs:
            msgs = [incoming[0]] + [m for m in msgs if m["role"] != "system"] + incoming[1:]
        else:  # tool results answer the calls the server returned, by their ids (as an agent does)
            returned = [c["id"] for c in (msgs[-1].get("tool_calls") or [])] if msgs else []
            answered = sum(m["role"] == "tool" for m in incoming)
            if answered and len(returned) < answered:
                # the server returned fewer calls than the model made (its parser missed them, or the
                # template renders one call of several): no agent can send these results, and grading
                # accumulation on them passed a conversation the server never makes
                res.turns.append(TurnResult(turn, "error", f"the server returned {len(returned)} tool call(s) where the "
                                            f"shape's turn makes {answered} (a stop token or the parser ended it "
                                            f"first): their results cannot all be sent"))
                break
            ids_back = iter(returned)
            msgs = msgs + [{**m, "tool_call_id": next(ids_back, m["tool_call_id"])} if m["role"] == "tool" else m
                           for m in incoming]
        before = list(acc.open_segment.token_ids) if acc.open_segment is not None else None
        try:
            plan = acc.plan(msgs, tools)
            # the whole request's render (an extending turn renders only its window: Accumulator.window)
            prompt_text = fmt.render(plan.messages, tools, add_generation_prompt=True) if plan.window_start else plan.prompt_text
            fresh = fmt.encode(prompt_text)
            ids = model.sampled_ids(plan.messages, tools, reply, prompt_text)
        except Exception as e:  # the template refuses the conversation
            res.turns.append(TurnResult(turn, "error", f"{type(e).__name__}: {str(e)[:160]}"))
            break
        if before is None:
            tr = TurnResult(turn, "start", f"{len(plan.prompt_ids)} prompt ids")
        elif plan.new_segment:
            i, ctx = diff_context(fmt, before, fresh)
            why = _why(plan.seal_reason, fmt)
            ends = getattr(fmt, "turn_end_ids", (fmt.end_of_turn_id,))
            if plan.seal_reason == "template_rewrite" and last_ids and last_ids[-1] not in ends and not last_cut:
                why = (f"the last turn ended with {fmt.decode(last_ids[-1:])!r}, which is not the ChatFormat's end of turn "
                       f"{fmt.end_of_turn!r}: the accumulator cannot place the turn's closing text")
            tr = TurnResult(turn, f"seal:{plan.seal_reason}", why, i, ctx)
        elif plan.prompt_ids == fresh:
            tr = TurnResult(turn, "extends", f"+{plan.delta_len} template ids")
        else:
            i, ctx = diff_context(fmt, plan.prompt_ids, fresh)
            # (by bytes: a reply cut inside a character decodes to U+FFFD, as does the render's replacement
            # character for it, and "same text" was said of two texts)
            same_text = text_bytes(fmt, plan.prompt_ids) == text_bytes(fmt, fresh)
            tr = TurnResult(turn, "extends*", "same text, other ids (retokenization)" if same_text else
                            "the template renders the earlier turn differently from what was sampled", i, ctx)
        res.turns.append(tr)
        msg = model.returned_message(reply, ids, tools, plan.prompt_ids)
        acc.record(plan, sample_of(ids, "length" if reply["cut"] else "stop"), msg)
        last_ids, last_cut = ids, bool(reply["cut"])
        msgs = msgs + [msg]
    bad = [t for t in res.turns if t.verdict not in ("start", "extends")]
    # an error anywhere is the shape's verdict (a seal or extends* before it hid it, and --strict
    # passed a conversation the template or the server cannot carry); else the first break
    errors = [t for t in bad if t.verdict == "error"]
    res.verdict = (errors or bad)[0].verdict if bad else "extends"
    res.segments = len(acc.segments)
    return res


def _why(reason: str | None, fmt: ChatFormat) -> str:
    return {"template_rewrite": "the template renders earlier turns differently once new messages are added",
            "history_rewritten": "earlier messages changed (system prompt, a compaction that kept the task)",
            "assistant_changed": "the assistant message sent back differs from the one returned",
            "tools_changed": "the request's tools differ from the previous request's"}.get(reason or "", str(reason))


# ------------------------------------------------------------------ retokenization traps
def traps(fmt: ChatFormat, shapes: list[ShapeResult], renders: list[str]) -> list[Trap]:
    tok, out = fmt.tokenizer, []
    bos = getattr(tok, "bos_token", None)
    bos_id = tok.convert_tokens_to_ids(bos) if bos else None
    r0 = renders[0] if renders else ""
    if getattr(tok, "is_tekken", False):  # (vLLM's MistralTokenizer has no bos_token: "no BOS token" was wrong)
        out.append(Trap("bos_doubling", False, "n/a: mistral-common encodes the request to ids (one BOS)"))
    elif bos and r0.startswith(bos):
        n_wrapper = tok(r0, add_special_tokens=True)["input_ids"][:3].count(bos_id)
        n_acc = fmt.encode(r0)[:3].count(bos_id)
        out.append(Trap("bos_doubling", n_wrapper > 1, f"the render starts with {bos!r}: tokenizer(text) gives "
                        f"{n_wrapper} BOS, the accumulator's encode (add_special_tokens=False) {n_acc}"))
    else:
        out.append(Trap("bos_doubling", False, "the template renders no BOS text" if bos else "no BOS token"))
    # Text after a control token that tokenizes differently from the same text in running text
    # (a legacy SentencePiece normalizer adds a '▁' after every control token).
    specials = sorted({s for s in getattr(tok, "all_special_tokens", [])} |
                      {str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()}, key=len, reverse=True)
    found = []
    for r in renders:
        for s in specials:
            k = r.find(s + " ")
            if k < 0 or not s:
                continue
            tail = r[k + len(s):k + len(s) + 24]
            nxt = min([tail.find(x) for x in specials if x and x in tail] + [len(tail)])
            piece = tail[:nxt]
            ctx = fmt.encode(s + piece)[1:]
            base, mid = fmt.encode("."), fmt.encode("." + piece)  # the same text inside running text
            if mid[: len(base)] != base:
                continue
            running = mid[len(base):]
            if ctx != running:
                conv = getattr(tok, "convert_ids_to_tokens", lambda ids: [_tok(fmt, i) for i in ids])
                found.append(f"{s}|{piece!r}: after the token {conv(ctx)[:4]}, in running text {conv(running)[:4]}")
                break
        if found:
            break
    out.append(Trap("leading_space", bool(found), found[0] if found else
                    "text after control tokens tokenizes as it does in running text"))
    # the retokenized turn itself (the shape's first verdict may be another turn's: a seal before it)
    merged = [(s, t) for s in shapes for t in s.turns if t.verdict == "extends*" and "retokenization" in t.detail]
    out.append(Trap("merged_boundary", bool(merged), f"{merged[0][0].shape} turn {merged[0][1].turn}: {merged[0][1].context}"
                    if merged else
                    "sampled ids + template deltas equal a fresh encoding of the same text in every shape"))
    # through the render, as a message's text reaches the engine: raw text through encode() was no
    # request's path (Tekken's encode splits at control names; its render escapes them: a false alarm)
    eot = fmt.end_of_turn

    def ends(text: str) -> int:
        return fmt.encode(fmt.render([{"role": "user", "content": text}], None, True)).count(fmt.end_of_turn_id)

    spelled = ends(f"say {eot} now") > ends("say it now")
    out.append(Trap("special_in_text", spelled,
                    f"a message's text 'say {eot} now' renders to the control id {fmt.end_of_turn_id}: a model writing "
                    f"the marker as text and a retokenizer disagree" if spelled else
                    "control-token strings in text stay text"))
    # a template that ignores tools= prompts the policy without the schemas of the tools the agent
    # passes (the server warns once and counts such requests, tools_unrendered): the tool shapes
    # still extend, so only this says the model never saw them
    probe = [{"role": "user", "content": "."}]
    unrendered = fmt.render(probe, TOOLS, True, refuse_dropped=False) == fmt.render(probe, None, True, refuse_dropped=False)
    out.append(Trap("tools_unrendered", unrendered,
                    "a request's tools= leave the prompt unchanged: the policy never sees the tools' schemas "
                    "(describe them in the system message, or give a template that renders them)" if unrendered else
                    "tools= are rendered into the prompt"))
    # a template that renders the system prompt only before the last user message (Mistral v3's HF
    # template): the request after a tool call's result has none, so the policy answers tool results, and
    # is trained on those turns, without the agent's instructions (mistral-common, the format the model
    # was trained on, keeps it: not refused, said here)
    instructions = "Answer in French, always."
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    after_tool = [{"role": "system", "content": instructions}, {"role": "user", "content": "Weather in Paris?"},
                  fmt.canonical(call), {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 C"}]
    try:
        dropped = instructions not in fmt.render(after_tool, TOOLS, True, refuse_dropped=False)
    except Exception:  # (a template that cannot render a tool turn: the tool shapes say so)
        dropped = False
    out.append(Trap("system_dropped", dropped,
                    "the request after a tool result has no system prompt (the template renders it only before the "
                    "last user message): the policy answers tool results without the agent's instructions (a Mistral "
                    "checkpoint's mistral-common encoding, which it was trained on, keeps it)" if dropped else
                    "the system prompt stays in the request after a tool result"))
    bad = next((r for r in renders if fmt.decode(fmt.encode(r)) != r), None)
    out.append(Trap("roundtrip", bad is not None, "decode(encode(render)) != render" if bad is not None else
                    "decode(encode(render)) == render for every shape"))
    return out


# ------------------------------------------------------------------ entry points
def _known_end(name: str, fmt):
    """`fmt`, where its end of turn is a token of its tokenizer: one that is not (a misspelt
    --end-of-turn) passed, and the checks that count it read "no" (a message's text spelling the end
    of turn counted None ids), where a session refuses it (profiles: the tokenizer has no token)."""
    tok = getattr(fmt, "tokenizer", None)
    unk, unk_name = getattr(tok, "unk_token_id", None), getattr(tok, "unk_token", None)
    # (a SentencePiece tokenizer maps an unknown name to <unk>'s id: a misspelt '</S>' linted as id 0;
    # where <unk> is itself the end of turn, GPT-2's and SmolLM2's <|endoftext|>, it is one)
    if getattr(fmt, "end_of_turn_id", 0) is None or (unk is not None and fmt.end_of_turn_id == unk
                                                     and fmt.end_of_turn != unk_name):
        raise ValueError(f"{name}: the end of turn {fmt.end_of_turn!r} is no token of the tokenizer")
    return fmt


def _resolve(target, end_of_turn=None, stops=None, template_kwargs=None, reasoning_in_content=None, profile=None):
    """(name, ChatFormat, stops, reasoning_in_content) for a family name, a directory or a tokenizer."""
    from . import real_models

    if isinstance(target, str) and target in real_models.FAMILIES:
        from .loopback.parsing import ReplyParser

        fam = real_models.load_family(target)
        spec = fam.spec
        kw = {**spec.template_kwargs, **(template_kwargs or {})}
        # the family's model profile: its ends of turn, what canonical messages keep, and the
        # loopback's parsers (the linter returns what the server would)
        prof = fam.profile().replace(chat_template_kwargs=kw, **({"end_of_turn": end_of_turn} if end_of_turn else {}))
        fmt = _known_end(target, ChatFormat.for_profile(fam.tokenizer, prof))
        return (target, fmt, list(stops or spec.stops),
                spec.reasoning_in_content if reasoning_in_content is None else reasoning_in_content,
                ReplyParser(fam.tokenizer, prof.tool_parser, prof.reasoning_parser, kw))
    extra, eos_stops = {}, []
    if isinstance(target, (str, Path)):
        from .toy.models import load_tokenizer as load_hf_tokenizer

        path = Path(target)
        if not path.is_dir():
            raise FileNotFoundError(f"{target!r} is neither a family ({sorted(real_models.FAMILIES)}) nor a directory")
        if (path / "lint.json").is_file():
            extra = json.loads((path / "lint.json").read_text())
        # the model profile the server would run this directory with (its ids, message form and
        # parsers): a saved family's, else the checkpoint's own (profile_for, as connect() does).
        # Without it a Mistral directory's tool turns errored ("call ids must be 9 alphanumerics")
        if profile is None and extra.get("family") in real_models.FAMILIES:
            profile = real_models.load_family(extra["family"]).profile()
        elif profile is None and (path / "config.json").is_file():
            from .profiles import ProfileError, profile_for

            try:
                profile = profile_for(path)
            except ProfileError:
                pass  # a family no profile claims: the template alone
        if (path / "tekken.json").is_file():  # Mistral's Tekken: mistral-common renders, no template (workbench.tekken)
            from .tekken import load_tokenizer, tekken_profile

            name, tok = str(target), load_tokenizer(path)
            profile = profile or tekken_profile(path)
        else:
            name, tok = str(target), load_hf_tokenizer(path)
        if not stops and (path / "generation_config.json").is_file():  # the engine's stop ids
            eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
            eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
            eos_stops = [tok.convert_ids_to_tokens([i])[0] for i in eos]  # (a list: Tekken's MistralTokenizer takes no int)
    else:
        name, tok = type(target).__name__, target
    if not getattr(tok, "chat_template", None) and getattr(profile, "chat_format", "template") != "tekken":
        raise ValueError(f"{name}: the tokenizer has no chat template")
    kw = {**extra.get("template_kwargs", {}), **(template_kwargs or {})}
    parser = None
    if profile is not None:  # a model profile (wb.lint(): the policy's): its format and the loopback's parsers
        from .loopback.parsing import ReplyParser

        prof = profile.replace(chat_template_kwargs={**profile.chat_template_kwargs, **kw},
                               **({"end_of_turn": end_of_turn} if end_of_turn else {}))
        fmt = ChatFormat.for_profile(tok, prof)
        parser = ReplyParser(tok, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
        # the engine stops on every id the profile names and the checkpoint's EOS ids (generation_config's
        # alone, a base checkpoint's <|endoftext|>, dropped Qwen3's <|im_end|>: every reply ran to
        # <|endoftext|>, and a seal the engine never makes was reported)
        stops = stops or list(dict.fromkeys([*eos_stops, *fmt.turn_end_tokens, *prof.stop_tokens]))
    else:
        fmt = ChatFormat(tok, end_of_turn, kw)
    stops = list(stops or eos_stops or extra.get("stops") or [fmt.end_of_turn])
    if fmt.end_of_turn in stops:  # the ChatFormat's end of turn first: what a plain stop samples
        stops = [fmt.end_of_turn] + [s for s in stops if s != fmt.end_of_turn]
    _known_end(name, fmt)
    ric = reasoning_in_content
    if ric is None:
        ric = extra.get("reasoning_in_content", "</think>" in (getattr(tok, "chat_template", None) or "") and
                        "</think>" in {str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()})
    return name, fmt, stops, ric, parser


def lint(tokenizer_or_path, shapes: list[str] | None = None, *, end_of_turn: str | None = None,
         stops: list[str] | None = None, template_kwargs: dict | None = None,
         reasoning_in_content: bool | None = None, profile=None, accumulator_cls=Accumulator) -> LintReport:
    """Lint a chat template for exact accumulation. `tokenizer_or_path`: a real family name
    (workbench.real_models.FAMILIES: "qwen3", "llama3.1", ...; linted with the family's model
    profile), a tokenizer directory, or a tokenizer object with a chat template. `stops`: the
    engine's stop tokens (default: the family's, the directory's generation_config.json eos ids, or
    the end of turn). `profile` (a workbench.profiles.ModelProfile, for a directory or tokenizer):
    its ends of turn, message form and the loopback's parsers, as the server would run them.
    `accumulator_cls`: an Accumulator subclass to play instead (notebook 04's exercise)."""
    name, fmt, stops_, ric, parser = _resolve(tokenizer_or_path, end_of_turn, stops, template_kwargs,
                                              reasoning_in_content, profile)
    results, renders = [], []
    for s in shapes or list(SHAPES):
        results.append(run_shape(fmt, s, stops_, ric, accumulator_cls, parser=parser))
        _, tools, steps = SHAPES[s]
        try:
            renders.append(fmt.render(steps[0][0], tools, add_generation_prompt=True))
        except Exception:
            pass
    return LintReport(name, fmt.end_of_turn, stops_, results, traps(fmt, results, renders))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench.lint", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="+", help="a real family (qwen3, qwen3-nothink, llama3.1, mistral-v3, gpt-oss, "
                                             "deepseek-v3.1) or a tokenizer directory")
    p.add_argument("--shape", action="append", choices=list(SHAPES), help="only these shapes (default: all)")
    p.add_argument("--end-of-turn", default=None, help="the ChatFormat's end-of-turn token (default: eos_token)")
    p.add_argument("--stop", action="append", default=None, help="an engine stop token (repeatable)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 where a shape errs (a script or CI job gates on it)")
    a = p.parse_args(argv)
    try:
        reports = [lint(t, a.shape, end_of_turn=a.end_of_turn, stops=a.stop) for t in a.target]
    except (ValueError, FileNotFoundError) as e:  # (a bad target or token: said, not a traceback)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        print("\n\n".join(r.table() for r in reports))
    # --strict: 1 where a shape errs (a conversation the server refuses or cannot make), for a script or
    # CI job to gate on (not by default: some families cannot make some shapes, Llama 3.1 two calls)
    return 1 if a.strict and any(s.verdict == "error" for r in reports for s in r.shapes) else 0


if __name__ == "__main__":
    sys.exit(main())
