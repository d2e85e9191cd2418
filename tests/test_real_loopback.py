"""(b) of the real-template tier: the loopback server parses reasoning and tool calls of recorded
real-model outputs as the recorded parse says, whole and streamed in pieces, through the stock
OpenAI and Anthropic SDK clients. The engine replays a recorded output's token ids (plus the stop
token that ended it), so each reply is exactly a real model's; the server runs the family's model
profile (workbench.real_models.Family.profile: its tool and reasoning parsers, tool-call ids).
The real vLLM path is tests/test_real_qwen3.py's. Offline: no network, no model weights."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import real_fixtures as rf

from workbench import real_models as rm
from workbench.loopback.server import LoopbackServer
from workbench.rollout.engine import Sample

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


class Replay:
    """An engine that answers the next request with a recorded output's ids."""

    def __init__(self):
        self.queue: list[tuple[list[int], str]] = []

    def push(self, ids, finish="stop"):
        self.queue.append((list(ids), finish))

    async def generate(self, prompt_ids, sampling):
        ids, finish = self.queue.pop(0)
        return Sample(list(prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), finish)

    async def generate_stream(self, prompt_ids, sampling):
        """The ids one at a time, as an engine samples them (the server streams them live), then
        the sample."""
        sample = await self.generate(prompt_ids, sampling)
        for i in sample.token_ids:
            yield [i]
            await asyncio.sleep(0)
        yield sample


def _ended(fam, d) -> tuple[list[int], str]:
    """The recorded ids as the engine returns them: with the token that ended the turn."""
    if "truncated" in d["tags"]:
        return list(d["output_token_ids"]), "length"
    prof = fam.profile()
    stop = prof.end_of_turn
    if fam.name == "gpt-oss" and d["expected"]["tool_calls"]:
        stop = "<|call|>"
    if fam.name == "llama3.1" and "<|python_tag|>" in d["raw_output"]:
        stop = "<|eom_id|>"
    return list(d["output_token_ids"]) + [fam.tokenizer.convert_tokens_to_ids(stop)], "stop"


def _norm(x: str | None):
    return (x or "").strip() or None


def _expected(d):
    e = d["expected"]
    return (_norm(e.get("reasoning_content")), _norm(e.get("content")),
            [(c["name"], c["arguments"] if isinstance(c["arguments"], dict) else json.loads(c["arguments"] or "{}"))
             for c in e.get("tool_calls") or []])


def _thinking(d) -> bool:
    t = d.get("thinking")
    return ("<think>" in (d.get("generation_prompt") or "")) if t is None else bool(t)


# family -> recorded outputs the server reads as recorded (those that vLLM's parser, or our hermes,
# gets wrong are listed in test_real_templates.PARSE_XFAIL and left out here), and what they hold
CASES = {"qwen3": "qwen3-hermes", "mistral-v3": "mistral", "gpt-oss": "gpt-oss", "deepseek-v3.1": "deepseek",
         "llama3.1": "llama"}
SKIP = {"qwen3-hermes/marker-in-arguments", "qwen3-hermes/truncated-second-parallel-call",
        "gpt-oss/harmony-truncated-in-header", "llama/l3-sglang-text-before-python-tag"}
# (llama/l3-marker-in-arguments, <|python_tag|> inside a call's argument, is read with special tokens
# kept: parsing.KEEP_SPECIAL_TOKENS; vLLM's own server deletes it from the argument)


def _cases(fam, thinking=None):
    folder = CASES[fam.name]
    out = []
    for d in rf.fixtures(fam.name, folder=folder, with_expected=True):
        if d["id"] in SKIP or (fam.name == "deepseek-v3.1" and d["tokenizer"]["repo"] != "deepseek-ai/DeepSeek-V3.1"):
            continue
        if thinking is not None and _thinking(d) != thinking:
            continue
        out.append(d)
    return out


def _server(fam, engine, **profile):
    prof = fam.profile().replace(**profile)
    return LoopbackServer(engine, fam.tokenizer, profile=prof, max_model_len=1 << 20)


def _openai_turn(client, d, stream: bool):
    tools = d.get("tools") or None
    kw = dict(model="policy", messages=[{"role": "user", "content": "Please help."}], max_tokens=4096)
    if tools:
        kw["tools"] = [{**t, "function": {"description": "", **t["function"]}} for t in tools]
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        reasoning = getattr(m, "reasoning_content", None)
        # under both names agents read it by: vLLM 0.32's `reasoning`, the older `reasoning_content`
        assert getattr(m, "reasoning", None) == reasoning
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return _norm(reasoning), _norm(m.content), calls, (reasoning or "", m.content or "")
    reasoning, content, calls, n = "", "", {}, 0
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        n += 1
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return (_norm(reasoning), _norm(content), [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            (n, reasoning, content))


@pytest.mark.parametrize("name", ["qwen3", "mistral-v3", "gpt-oss", "deepseek-v3.1", "llama3.1"])
def test_b_openai_sdk_reads_recorded_replies(name):
    """Every recorded output of the family through the server: reasoning_content, content and
    tool calls equal the recorded parse, whole and streamed in pieces (the SDK's chunks put
    together); the recorded ids are the segment's trainable ids, untouched."""
    fam = rm.load_family(name)
    engine = Replay()
    cases = _cases(fam)
    assert len(cases) >= 8
    seen_reasoning = 0
    with _server(fam, engine) as server:
        for d in cases:
            if name == "qwen3" and not _thinking(d):
                continue  # thinking off: the other test (its own profile)
            if "<think>" in (d.get("generation_prompt") or "") and not any(m in d["raw_output"] for m in ("<think>", "</think>")):
                # its model's template opened <think> in the generation prompt (Qwen3-Thinking-2507); this
                # server renders the hybrid's, which does not, so a reply with no marker is its answer here
                # (test_c_qwen3_answer_without_think_reaches_the_agent_as_content: both prompts)
                continue
            ids, finish = _ended(fam, d)
            sid = server.open_session()
            client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
            engine.push(ids, finish)
            r, c, calls, whole = _openai_turn(client, d, stream=False)
            assert (r, c, calls) == _expected(d), d["id"]
            engine.push(ids, finish)
            r2, c2, calls2, (chunks, *streamed) = _openai_turn(client, d, stream=True)
            assert (r2, c2, calls2) == _expected(d), d["id"]
            assert tuple(streamed) == whole, d["id"]  # the deltas put together the unstreamed reply, exactly
            if len(r or "") + len(c or "") > 40:
                assert chunks > 4  # streamed in pieces, not one delta
            seen_reasoning += r is not None
            segs = server.close_session(sid)
            assert [s.token_ids[-len(ids):] for s in segs] == [ids, ids]  # the recorded ids, exactly
            assert all(set(s.loss_mask[-len(ids):]) == {1} for s in segs)
    if name in ("qwen3", "gpt-oss"):
        assert seen_reasoning >= 5


def test_b_qwen3_thinking_off_is_all_content():
    """enable_thinking=False (the generation prompt closes an empty <think> block): vLLM's qwen3
    parser reads no reasoning; tool calls and content as recorded."""
    fam = rm.load_family("qwen3-nothink")
    engine = Replay()
    cases = [d for d in _cases(rm.load_family("qwen3"), thinking=False)]
    assert len(cases) >= 15
    with _server(fam, engine) as server:
        sid = server.open_session()
        client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        for d in cases:
            engine.push(*_ended(fam, d))
            r, c, calls, _ = _openai_turn(client, d, stream=False)
            assert (r, c, calls) == _expected(d), d["id"]


def test_b_a_side_reply_ends_on_the_familys_stop_tokens_as_a_recorded_one_does():
    """A real Qwen3 checkpoint also ends a turn on <|endoftext|> (generation_config.json), and its
    reasoning parser keeps special tokens: the side route (a judge's calls) knew only the agent's
    stop ids, so the judge's "10<|endoftext|>" reached the judge agent, whose score then parsed as
    none (reward 0). The side route stops on the family's tokens, as a recorded turn does."""
    from workbench.rollout.engine import SamplingConfig

    fam = rm.load_family("qwen3")
    tok, prof = fam.tokenizer, fam.profile()
    engine = Replay()
    ids = tok.encode("<think>\nok\n</think>\n\n10", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|endoftext|>")]
    with LoopbackServer(engine, tok, profile=prof, max_model_len=4096,
                        policy_sampling=SamplingConfig(max_tokens=64, stop_token_ids=prof.stop_token_ids(tok))) as server:
        client = openai.OpenAI(base_url=server.base_url(None), api_key=server.api_key, max_retries=0)
        for _ in range(2):
            engine.push(ids)
        side = client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "Grade."}], max_tokens=64)
        sid = server.open_session()
        recorded = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Grade."}], max_tokens=64)
    assert side.choices[0].message.content.strip() == recorded.choices[0].message.content.strip() == "10"


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss", "mistral-v3"])
def test_b_anthropic_sdk_reads_recorded_replies(name):
    """The same through the Anthropic SDK: reasoning as a thinking block (thinking deltas when
    streamed, put together by the SDK's stream helper), tool calls as tool_use blocks."""
    fam = rm.load_family(name)
    engine = Replay()
    cases = [d for d in _cases(fam) if name != "qwen3" or _thinking(d)][:12]
    with _server(fam, engine) as server:
        sid = server.open_session()
        client = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
        for d in cases:
            tools = [{"name": t["function"]["name"], "description": t["function"].get("description") or "",
                      "input_schema": t["function"].get("parameters") or {"type": "object"}} for t in d.get("tools") or []]
            kw = dict(model="policy", max_tokens=4096, messages=[{"role": "user", "content": "Please help."}])
            if tools:
                kw["tools"] = tools
            whole = None
            for stream in (False, True):
                engine.push(*_ended(fam, d))
                if stream:
                    with client.messages.stream(**kw) as s:
                        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
                        msg = s.get_final_message()
                else:
                    msg = client.messages.create(**kw)
                thinking = "".join(b.thinking for b in msg.content if b.type == "thinking")
                text = "".join(b.text for b in msg.content if b.type == "text")
                calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
                assert (_norm(thinking), _norm(text), calls) == _expected(d), (d["id"], stream)
                assert whole in (None, (thinking, text)), d["id"]  # streamed == unstreamed, exactly
                whole = (thinking, text)
                if stream and thinking:
                    assert kinds.count("thinking_delta") >= -(-len(thinking) // 16) and "signature_delta" in kinds
                assert msg.stop_reason == ("tool_use" if calls else "max_tokens" if "truncated" in d["tags"] else "end_turn")
        server.close_session(sid)


def test_b_mistral_ids_and_echoed_reasoning_render_back():
    """Mistral v3: the server hands out 9-character alphanumeric tool-call ids (the template
    refuses others), on both protocols the same id; echoed back, the tool turn renders and the
    results extend the exact recorded ids. Qwen3 thinking on: the reasoning returned as
    reasoning_content / a thinking block, echoed back, renders the turn's <think> block again, so
    the tool results extend the recorded ids on both SDKs."""
    fam = rm.load_family("mistral-v3")
    d = next(x for x in _cases(fam) if x["expected"]["tool_calls"])
    engine = Replay()
    with _server(fam, engine) as server:
        for protocol in ("openai", "anthropic"):
            sid = server.open_session()
            ids, _ = _ended(fam, d)
            done = fam.tokenizer.encode("Done.", add_special_tokens=False) + [fam.tokenizer.eos_token_id]
            engine.push(ids)
            engine.push(done)
            if protocol == "openai":
                client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
                msgs = [{"role": "user", "content": "Please help."}]
                m = client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512).choices[0].message
                assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in m.tool_calls)
                msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in m.tool_calls]
                client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512)
            else:
                client = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
                tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in d["tools"]]
                msgs = [{"role": "user", "content": "Please help."}]
                r = client.messages.create(model="p", messages=msgs, tools=tools, max_tokens=512)
                uses = [b for b in r.content if b.type == "tool_use"]
                assert uses and all(re.fullmatch(r"toolu_[A-Za-z0-9]{9}", b.id) for b in uses)
                msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses]}]
                client.messages.create(model="p", messages=msgs, tools=tools, max_tokens=512)
            seg, = server.close_session(sid)
            assert seg.stats["turns"] == 2 and seg.seal_reason == "episode_end", protocol  # extended, no seal
            assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == ids + done  # exactly what was sampled


def test_b_mistral_tool_results_name_the_call_ids_the_model_wrote():
    """NeMo writes an id in each call of its [TOOL_CALLS] list; vLLM's parser ignores it and the
    server handed out fresh ids, so the recorded call kept the written id and every tool result
    named another: the policy trained on results pointing at no call. The server hands out the
    written ids where the template would take them (9 alphanumerics, unique), fresh ones elsewhere."""
    from workbench.loopback.parsing import sampled_call_ids

    fam = rm.load_family("mistral-v3")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    written = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Ab3dE6gH9"}, '
               '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "Zz9yX8wV7"}]')
    prompts = []

    class Seen(Replay):
        async def generate(self, prompt_ids, sampling):
            prompts.append(list(prompt_ids))
            return await super().generate(prompt_ids, sampling)

    engine = Seen()
    with _server(fam, engine) as server:
        sid = server.open_session()
        engine.push(fam.tokenizer.encode(written, add_special_tokens=False) + [fam.tokenizer.eos_token_id])
        engine.push(fam.tokenizer.encode("Done.", add_special_tokens=False) + [fam.tokenizer.eos_token_id])
        client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        m = client.chat.completions.create(model="p", messages=msgs, tools=tools, max_tokens=512).choices[0].message
        assert [c.id for c in m.tool_calls] == ["Ab3dE6gH9", "Zz9yX8wV7"]
        msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": t}
                                                     for c, t in zip(m.tool_calls, ("sunny", "rain"))]
        client.chat.completions.create(model="p", messages=msgs, tools=tools, max_tokens=512)
        seg, = server.close_session(sid)
    context = fam.tokenizer.decode(prompts[1])
    assert context.count("Ab3dE6gH9") == 2 and context.count("Zz9yX8wV7") == 2, context  # each call and its result
    assert seg.stats["turns"] == 2
    calls = [{"name": "get_weather"}, {"name": "get_weather"}]
    # a repeated id, one of another shape, none, another name: fresh ids for those
    assert sampled_call_ids('[TOOL_CALLS] [{"name": "get_weather", "id": "Ab3dE6gH9"}, {"name": "get_weather", "id": "Ab3dE6gH9"}]',
                            calls) == ["Ab3dE6gH9", None]
    assert sampled_call_ids('[TOOL_CALLS] [{"name": "get_weather", "id": "Ab3dE6gH90"}, {"name": "get_weather"}]', calls) == [None, None]
    assert sampled_call_ids('[TOOL_CALLS] [{"name": "other", "id": "Ab3dE6gH9"}, {"name": "get_weather", "id": "Zz9yX8wV7"}]',
                            calls) == [None, "Zz9yX8wV7"]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_b_qwen3_echoed_reasoning_renders_the_think_block_back(protocol):
    fam = rm.load_family("qwen3")
    d = next(x for x in _cases(fam, thinking=True) if x["expected"]["tool_calls"] and x["expected"]["reasoning_content"])
    engine = Replay()
    ids, _ = _ended(fam, d)
    done = fam.tokenizer.encode("Done.", add_special_tokens=False) + [fam.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with _server(fam, engine) as server:
        sid = server.open_session()
        engine.push(ids)
        engine.push(done)
        msgs = [{"role": "user", "content": "Please help."}]
        if protocol == "openai":
            client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
            m = client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512).choices[0].message
            assert m.reasoning_content and "<think>" not in (m.content or "")
            msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in m.tool_calls]
            client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512)
        else:
            client = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
            tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in d["tools"]]
            r = client.messages.create(model="p", messages=msgs, tools=tools, max_tokens=512)
            assert r.content[0].type == "thinking" and r.content[0].thinking
            uses = [b for b in r.content if b.type == "tool_use"]
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses]}]
            client.messages.create(model="p", messages=msgs, tools=tools, max_tokens=512)
        seg, = server.close_session(sid)
    assert seg.stats["turns"] == 2 and seg.seal_reason == "episode_end"  # the <think> block rendered back: extended
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == ids + done
    assert fam.tokenizer.decode(seg.token_ids).count("<think>") == 1


def test_b_reasoning_not_kept_seals():
    """Without the profile's reasoning_field (the default message form), the Qwen3 turn's reasoning
    is not rendered back: the same episode seals (template_rewrite), which is why the field exists."""
    fam = rm.load_family("qwen3")
    d = next(x for x in _cases(fam, thinking=True) if x["expected"]["tool_calls"] and x["expected"]["reasoning_content"])
    engine = Replay()
    ids, _ = _ended(fam, d)
    with _server(fam, engine, reasoning_field=None) as server:
        sid = server.open_session()
        engine.push(ids)
        engine.push(fam.tokenizer.encode("Done.", add_special_tokens=False) + [fam.tokenizer.convert_tokens_to_ids("<|im_end|>")])
        client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "Please help."}]
        m = client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512).choices[0].message
        msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in m.tool_calls]
        client.chat.completions.create(model="p", messages=msgs, tools=d["tools"], max_tokens=512)
        segs = server.close_session(sid)
    assert [s.seal_reason for s in segs] == ["template_rewrite", "episode_end"]


def test_b_gpt_oss_hides_the_stop_string_from_the_agent():
    """A stop string ends the reply's text; gpt-oss's harmony parser reads the ids, and was given
    all of them: the agent got "The answer is 4.\\nEND" back (the Anthropic reply said
    stop_sequence "END" beside it). The parser now gets the ids up to the stop string; the
    recorded ids keep it all."""
    fam = rm.load_family("gpt-oss")
    tok = fam.tokenizer
    ids = tok.encode("<|channel|>final<|message|>The answer is 4.\nEND", add_special_tokens=False)
    engine = Replay()
    with _server(fam, engine) as server:
        sid = server.open_session()
        o = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        engine.push(ids + tok.convert_tokens_to_ids(["<|return|>"]), "stop")
        r = o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2?"}], stop=["END"],
                                      max_tokens=64)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The answer is 4.\n", "stop")
        a = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
        engine.push(ids + tok.convert_tokens_to_ids(["<|return|>"]), "stop")
        m = a.messages.create(model="policy", messages=[{"role": "user", "content": "2+2?"}], stop_sequences=["END"],
                              max_tokens=64)
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "END", "The answer is 4.\n")
        segments = server.close_session(sid)
    assert all(set(ids) <= set(s.token_ids) for s in segments)  # recorded whole
    # a stop string whose first token also holds the character before it (" STOP" is one token)
    ids = tok.encode("<|channel|>final<|message|>Answer: 42 STOP here", add_special_tokens=False)
    with _server(fam, engine) as server:
        o = openai.OpenAI(base_url=server.base_url(server.open_session()), api_key=server.api_key, max_retries=0)
        engine.push(ids + tok.convert_tokens_to_ids(["<|return|>"]), "stop")
        r = o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "?"}], stop=["STOP"],
                                      max_tokens=64)
        assert r.choices[0].message.content.rstrip() == "Answer: 42", r.choices[0].message.content


def test_b_gpt_oss_takes_a_tool_without_description():
    """The OpenAI API's tool description is optional; gpt-oss's template concatenates it, so a tool
    sent without one (or with null) failed every render: each of such an agent's requests a 400. The
    profile renders it with "" (as vLLM's harmony path does); the record keeps the tools as sent."""
    fam = rm.load_family("gpt-oss")
    tok = fam.tokenizer
    bare = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    null = {"type": "function", "function": {**bare["function"], "description": None}}
    empty = {"type": "function", "function": {**bare["function"], "description": ""}}
    ids = tok.encode("<|channel|>final<|message|>4", add_special_tokens=False) + tok.convert_tokens_to_ids(["<|return|>"])
    engine = Replay()
    with _server(fam, engine) as server:
        prompts = []
        for tools in ([bare], [null], [empty]):
            sid = server.open_session()
            o = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
            engine.push(ids, "stop")
            r = o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+2?"}], tools=tools,
                                          max_tokens=16)
            assert r.choices[0].message.content == "4"
            (seg,) = server.close_session(sid)
            assert seg.tools == tools  # as sent
            prompts.append(seg.token_ids[:seg.loss_mask.index(1)])
    assert prompts[0] == prompts[1] == prompts[2]
    # the other families render the tools as sent (Qwen3's tojson: no description key added)
    assert rm.load_family("qwen3").chat_format()._template_tools([bare]) == [bare]


def test_b_a_reply_cut_by_max_tokens_runs_no_tool_call():
    """A reply cut in its second call: vLLM's qwen3_coder parser returned the cut call with {}
    arguments (an Env then ran it, a chat agent was told tool_calls). A cut reply is not read for
    calls: its markup stays content, and the reply says it was cut."""
    fam = rm.load_family("qwen3-nothink")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=ci")
    ids = fam.tokenizer.encode(text, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    engine = Replay()
    with _server(fam, engine, tool_parser="qwen3_coder") as server:
        o = openai.OpenAI(base_url=server.base_url(server.open_session()), api_key=server.api_key, max_retries=0)
        engine.push(ids, "length")
        r = o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                      max_tokens=len(ids))
        m = r.choices[0]
        assert (m.finish_reason, m.message.tool_calls, m.message.content) == ("length", None, text)
        engine.push(ids, "stop")  # the same ids, not cut (stopped there): vLLM's parser makes two calls of it,
        # the second get_weather({}); read only in part (parsing.COVERAGE), it goes out as written too
        r = o.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Weather?"}], tools=tools)
        assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", text)


def test_b_parallel_calls_the_template_cannot_render_back_are_text():
    """Llama 3.1: vLLM's llama3_json parser splits '{...}; {...}' into two calls, and its template
    refuses any history holding them ("only supports single tool-calls at once"): the agent got
    both, every later request was a 400, and the failed episode was dropped (parallel calls never
    trained). Such a reply goes out as text, counted as a parser failure, and the next turn works;
    Qwen3, whose template renders two calls, keeps them."""
    tools = [{"type": "function", "function": {"name": "calc", "description": "calc",
                                               "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
    for name, text, calls in (
            ("llama3.1", '{"name": "calc", "parameters": {"expr": "1+1"}}; {"name": "calc", "parameters": {"expr": "2+2"}}', 0),
            ("qwen3", '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>', 2)):
        fam = rm.load_family(name)
        engine = Replay()
        with _server(fam, engine) as server:
            o = openai.OpenAI(base_url=server.base_url(server.open_session()), api_key=server.api_key, max_retries=0)
            end = [server.fmt.end_of_turn_id]
            engine.push(fam.tokenizer.encode(text, add_special_tokens=False) + end, "stop")
            msgs = [{"role": "user", "content": "compute 1+1 and 2+2"}]
            r = o.chat.completions.create(model="policy", messages=msgs, tools=tools)
            got = r.choices[0].message
            assert len(got.tool_calls or []) == calls, name
            msgs.append(got.model_dump(exclude_none=True))
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": "2"} for c in got.tool_calls or []]
            if not calls:
                assert "calc" in got.content and server.summary()["parser_failures"] == 1
                msgs.append({"role": "user", "content": "Go on."})
            engine.push(fam.tokenizer.encode("Done.", add_special_tokens=False) + end, "stop")
            r = o.chat.completions.create(model="policy", messages=msgs, tools=tools)  # a 400 before
            assert r.choices[0].message.content == "Done.", name


CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
QWEN3_DRAFTED_CALLS = ("<think>\nThe call should be:\n" + CALL + "\nYes.\n</think>\n\n" + CALL,
                       "<think>\nI could " + CALL + " but no.\n</think>\n\nHello!",
                       "<think>\nMaybe <tool_call> is needed? No.</think>\n\nHi")


def test_a_mistral_v3_reply_with_more_than_its_call_list_hands_out_no_call():
    """vLLM's mistral parser read a second [TOOL_CALLS] block, or text after the call list, as
    nothing: the agent got the first list's calls and content '', while the trained context held
    both calls and then one result. Such a reply reaches the agent as its text (counted); one list
    of two calls is two calls."""
    fam = rm.load_family("mistral-v3")
    server = LoopbackServer(Replay(), fam.tokenizer, profile=fam.profile(), max_model_len=1 << 20)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("weather", "search")]
    call = lambda name: f'{{"name": "{name}", "arguments": {{"q": "x"}}}}'  # noqa: E731

    def parse(text):
        return server.reply_parser.parse(text, fam.tokenizer.encode(text, add_special_tokens=False), tools=tools)

    both = parse(f"[TOOL_CALLS] [{call('weather')}, {call('search')}]")
    assert [c["name"] for c in both.calls] == ["weather", "search"] and server.reply_parser.failures == 0
    for text in (f"[TOOL_CALLS] [{call('weather')}] [TOOL_CALLS] [{call('search')}]", f"[TOOL_CALLS] [{call('weather')}] Let me know."):
        p = parse(text)
        assert p.calls == [] and ("search" in p.content or "Let me know." in p.content), text
    assert server.reply_parser.failures == 2


def test_a_template_that_renders_no_tools_is_counted_and_said(caplog):
    """DeepSeek V3.1's template renders no tools=: every tool episode was sampled and trained on a
    prompt without the tools' schemas while its calls still parsed, the run looking healthy.
    The server's summary counts those renders and the log says it once; Qwen3's template, which
    renders them, counts none."""
    import logging

    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "compute 1+1"}]
    for name, unrendered in (("deepseek-v3.1", 2), ("qwen3", 0)):
        fam = rm.load_family(name)
        server = LoopbackServer(Replay(), fam.tokenizer, profile=fam.profile(), max_model_len=1 << 20)
        with caplog.at_level(logging.WARNING, logger="workbench.tokens"):
            caplog.clear()
            server.fmt.prompt(msgs, tools)
            server.fmt.prompt(msgs + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?"}], tools)
            server.fmt.prompt(msgs, None)
        assert server.summary()["tools_unrendered"] == unrendered, name
        assert len([r for r in caplog.records if "does not render tools=" in r.getMessage()]) == (1 if unrendered else 0), name


def test_a_call_qwen3_only_drafted_in_its_thinking_is_not_made():
    """vLLM's qwen3 parser ends the reasoning at a <tool_call> even inside a <think> the reply
    closes later: the drafted call was handed to the agent and run (twice where the reply then
    made it), and the rest of the thinking reached the agent as its answer. The reasoning ends at
    the reply's </think>; a reply with no </think> keeps the implicit end (the test below)."""
    fam = rm.load_family("qwen3")
    server = LoopbackServer(Replay(), fam.tokenizer, profile=fam.profile(), max_model_len=1 << 20)
    parse = lambda text: server.reply_parser.parse(text, fam.tokenizer.encode(text, add_special_tokens=False),
                                                   parse_tools=True, tools=None, opened=False)
    drafted_then_made, drafted_only, tag_only = (parse(t) for t in QWEN3_DRAFTED_CALLS)
    assert len(drafted_then_made.calls) == 1 and drafted_then_made.content == "" and "Yes." in drafted_then_made.reasoning
    assert (drafted_only.calls, drafted_only.content.strip()) == ([], "Hello!") and "but no." in drafted_only.reasoning
    assert (tag_only.calls, tag_only.content.strip(), tag_only.reasoning) == ([], "Hi", "\nMaybe <tool_call> is needed? No.")
    unclosed = parse("<think>\nI need calc.\n" + CALL)  # (the implicit end vLLM's parser is there for)
    assert (unclosed.reasoning, len(unclosed.calls)) == ("\nI need calc.\n", 1)
    # ... a </think> inside that call's arguments is no end of the reasoning (the call was made)
    strip = '<tool_call>\n{"name": "calc", "arguments": {"code": "s.split(\'</think>\')[-1]"}}\n</tool_call>'
    assert [c["name"] for c in parse("<think>\nI need calc.\n" + strip).calls] == ["calc"]
    # ... with its arguments as written: vLLM's parser deletes every later </think> from the rest, and
    # the agent ran s.split('') (a ValueError) where the tokens trained say s.split('</think>')
    code = {"code": "s.split('</think>')[-1]"}
    for reply in ("<think>\nI need calc.\n" + strip, "<think>\nI need calc.\n</think>\n\n" + strip, strip):
        assert parse(reply).calls == [{"name": "calc", "arguments": code}], reply
    named = parse("<think>\nR\n</think>\n\nIt writes </think> after its thinking.")
    assert (named.reasoning, named.content) == ("\nR\n", "\n\nIt writes </think> after its thinking.")


@pytest.mark.parametrize("name", ["qwen3", "qwen3-nothink"])
def test_b_qwen3_streams_only_what_the_finished_reply_holds(name):
    """vLLM's qwen3 reasoning parser ends the reasoning at a tool call's marker without </think>,
    and drops a second <think> / an extra </think>; the stream read "<think> to </think>" and
    had sent text the finished reply does not hold (an Anthropic agent sending its thinking back
    then sealed the session). Streamed deltas now always add up to the finished reply. With
    thinking off the parser reads no reasoning: a <think> block the reply writes is content, and
    streamed as reasoning the agent got it twice."""
    from workbench.loopback.protocol import ChatRequest
    from workbench.loopback.streaming import ReplyStream
    from workbench.rollout.engine import SamplingConfig

    fam = rm.load_family(name)
    prof = fam.profile()
    server = LoopbackServer(Replay(), fam.tokenizer, profile=prof, max_model_len=1 << 20)
    tok, end = fam.tokenizer, [server.fmt.end_of_turn_id]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    for opened in (False, True):  # the hybrid's prompt, and Qwen3-Thinking-2507's that opens <think>
        prompt = server.fmt.prompt([{"role": "user", "content": "hi"}], None)[1] + (tok.encode("<think>\n") if opened else [])
        for text in ('<think>\nI need calc.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>',
                     "<think>\nx\n</think>Close it with </think> then stop.", "<think>\nThe tag <think> opens it.</think>\n\nok",
                     "<think><tool_call>", "<think>\nplain\n</think>\n\nanswer", "I need calc.\n<tool_call>\n"
                     '{"name": "calc", "arguments": {"x": 1}}\n</tool_call>', "Paris is the capital.", *QWEN3_DRAFTED_CALLS):
            for with_tools in (True, False):
                ids = tok.encode(text, add_special_tokens=False) + end
                req = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=tools if with_tools else None,
                                  sampling=SamplingConfig(max_tokens=4096, stop_token_ids=end), max_tokens=4096,
                                  parse_tools=with_tools)
                stream, sent = ReplyStream(server.fmt, server.reply_parser, req, prompt[-8:]), {"reasoning": "", "content": ""}
                for i in ids:
                    for kind, piece in stream.feed([i]):
                        sent[kind] += piece
                if text == "Paris is the capital." and name == "qwen3-nothink":  # thinking off: the answer goes live
                    assert sent["content"].startswith("Paris is the"), (name, sent)
                reply = server._reply(Sample(prompt, ids, [0.0] * len(ids), [0] * len(ids), "stop"), req, prompt)
                for kind, piece in stream.finish(reply):
                    sent[kind] += piece
                assert sent == {"reasoning": reply.reasoning or "", "content": reply.content or ""}, (opened, text, with_tools)


def test_a_server_stops_on_its_profiles_stop_tokens_unless_told_to_run_on():
    """A server made with a profile stops on the profile's stop tokens (Llama's <|eom_id|>), as a runner's
    sampling does; with ignore_eos (a policy told to run on) it adds none, as the runner adds none."""
    from workbench.rollout.engine import SamplingConfig

    fam = rm.load_family("llama3.1")
    stops = fam.profile().stop_token_ids(fam.tokenizer)
    assert stops and set(LoopbackServer(Replay(), fam.tokenizer, profile=fam.profile()).policy_sampling.stop_token_ids) == set(stops)
    running_on = LoopbackServer(Replay(), fam.tokenizer, profile=fam.profile(), policy_sampling=SamplingConfig(ignore_eos=True))
    assert running_on.policy_sampling.stop_token_ids == []
    # without a profile, a Llama reply read with special tokens kept still ends before its <|eom_id|>
    from workbench.loopback.parsing import reply_text
    from workbench.tokens import ChatFormat

    fmt = ChatFormat(fam.tokenizer, "<|eot_id|>")
    ids = fam.tokenizer.encode('{"name": "f", "parameters": {}}<|eom_id|>', add_special_tokens=False)
    assert reply_text(fmt, ids, "stop", False)[0] == '{"name": "f", "parameters": {}}'


def test_a_reply_a_parser_reads_only_in_part_is_handed_out_as_written():
    """vLLM's llama3_json, deepseek_v31 and qwen3_coder parsers hand out the calls they find and drop
    the rest of the reply (text after the calls, a value holding the closing tag, a repeated
    parameter, a `<function=` written inside a value made a second call): the agent answered other
    calls, or text, than the trained tokens say, unsealed and uncounted. Such a reply is handed out
    as the model wrote it (a parser failure); a reply read whole still gives its calls."""
    import copy

    from workbench.loopback.parsing import ReplyParser

    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]

    def parsed(tok, parser, text, tools):
        ids = tok.encode(text, add_special_tokens=False)
        before = parser.failures
        got = parser.parse(tok.decode(ids, skip_special_tokens=parser.skip_special_tokens), ids, True, tools)
        return got.calls, parser.failures - before

    llama = rm.load_family("llama3.1")
    rp = ReplyParser(llama.tokenizer, llama.profile().tool_parser, llama.profile().reasoning_parser, {})
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parsed(llama.tokenizer, rp, call, weather) == ([{"name": "get_weather", "arguments": {"city": "Paris"}}], 0)
    assert len(parsed(llama.tokenizer, rp, call + "; " + call.replace("Paris", "Rome"), weather)[0]) == 2
    for partly in (call + " and then I will delete the old file.", "Here: " + call):
        assert parsed(llama.tokenizer, rp, partly, weather) == ([], 1), partly

    ds = rm.load_family("deepseek-v3.1")
    rp = ReplyParser(ds.tokenizer, ds.profile().tool_parser, ds.profile().reasoning_parser, {})
    block = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert parsed(ds.tokenizer, rp, "Sure." + block, weather) == ([{"name": "get_weather", "arguments": {"city": "Paris"}}], 0)
    for partly in ("Sure." + block + "After the call.", block + block.replace("Paris", "Rome")):
        assert parsed(ds.tokenizer, rp, partly, weather) == ([], 1), partly

    qwen = rm.load_family("qwen3")
    tok = copy.deepcopy(qwen.tokenizer)
    tok.chat_template = rm.template("Qwen-Qwen3-Coder-30B-A3B-Instruct")
    rp = ReplyParser(tok, "qwen3_coder", None, {})
    files = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}}]

    def xml(*params):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
        return f"<tool_call>\n<function=write_file>\n{body}</function>\n</tool_call>"

    assert parsed(tok, rp, xml(("path", "x.md"), ("content", "hi")), files) == (
        [{"name": "write_file", "arguments": {"path": "x.md", "content": "hi"}}], 0)
    # a reply a stop string cut at "</tool_call>" (the server cuts before parsing): its call is read
    cut = xml(("path", "x.md"), ("content", "hi"))[: -len("</tool_call>")]
    assert parsed(tok, rp, cut, files) == ([{"name": "write_file", "arguments": {"path": "x.md", "content": "hi"}}], 0)
    for partly in (xml(("path", "x.md"), ("content", "a</parameter>b")), xml(("path", "x.md"), ("path", "y.md")),
                   xml(("path", "x.md"), ("content", "Close with </function> then </tool_call>; open with <function=x>.")),
                   xml(("path", "x.md")) + "after the call"):
        assert parsed(tok, rp, partly, files) == ([], 1), partly


def test_b_a_reply_a_stop_string_ended_seals_where_the_template_cannot_continue_it():
    """A ReAct agent's stop=["Observation:"] on Llama 3.1: the ids hold "Observation:", the message
    sent back does not; the next request extended the ids with the template's end of turn, a
    context ("calc(2+2)\\nObservation:<|eot_id|>") no server builds, under every later turn. It seals
    (stop_string), the agent's stop string or the policy's."""
    from workbench.rollout.engine import SamplingConfig

    fam = rm.load_family("llama3.1")
    for own in (True, False):
        engine = Replay()
        policy = SamplingConfig(max_tokens=64, stop=[] if own else ["Observation:"])
        with LoopbackServer(engine, fam.tokenizer, profile=fam.profile(), policy_sampling=policy, max_model_len=1 << 20) as server:
            sid = server.open_session()
            client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
            msgs = [{"role": "user", "content": "What is 2+2?"}]
            for k in range(3):
                engine.push(fam.tokenizer.encode(f"Thought: step {k}.\nAction: calc(2+2)\nObservation:", add_special_tokens=False))
                r = client.chat.completions.create(model="policy", messages=msgs, **({"stop": ["Observation:"]} if own else {}))
                assert r.choices[0].message.content == f"Thought: step {k}.\nAction: calc(2+2)\n"
                msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Observation: 4"}]
            segs = server.close_session(sid)
        assert [s.seal_reason for s in segs] == ["stop_string", "stop_string", "episode_end"], own
        assert not any("Observation:<|eot_id|>" in fam.tokenizer.decode(s.token_ids) for s in segs), own


def test_a_template_control_that_renders_as_the_profile_is_served():
    """reasoning_effort / chat_template_kwargs the profile does not set were refused whatever they
    rendered: gpt-oss's template writes "Reasoning: medium" unasked and Qwen3's ignores the effort,
    so agents sending them failed every episode. Served where the render (as vLLM makes it: an
    effort sets enable_thinking = effort != "none") is the profile's; refused where it is not."""
    cases = [("gpt-oss", {"reasoning_effort": "medium"}, True), ("gpt-oss", {"reasoning_effort": "high"}, False),
             ("qwen3", {"reasoning_effort": "medium"}, True), ("qwen3", {"reasoning_effort": "none"}, False),
             ("qwen3", {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, True),
             ("qwen3-nothink", {"reasoning_effort": "none"}, True), ("qwen3-nothink", {"reasoning_effort": "medium"}, False),
             ("qwen3-nothink", {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, False),
             # 0 is not the profile's False to a template (`is false`: thinking on), and a kwarg's megabytes are not probed
             ("qwen3-nothink", {"extra_body": {"chat_template_kwargs": {"enable_thinking": 0}}}, False),
             ("qwen3", {"extra_body": {"chat_template_kwargs": {"enable_thinking": "x" * 5000}}}, False),
             # a kwarg that changes only a render with tools (tools to the system turn): refused
             ("llama3.1", {"extra_body": {"chat_template_kwargs": {"tools_in_user_message": False}}}, False),
             # a template of the client's own, smuggled as a kwarg: refused unrendered (two nested loops of
             # 1e5 ran on the server's event loop for minutes, every session waiting)
             ("qwen3", {"extra_body": {"chat_template_kwargs": {"chat_template": "{% for i in range(100000) %}{% for j in "
                                                                                  "range(100000) %}{% endfor %}{% endfor %}"}}}, False)]
    for name, control, served in cases:
        fam = rm.load_family(name)
        engine = Replay()
        with _server(fam, engine) as server:
            client = openai.OpenAI(base_url=server.base_url(server.open_session()), api_key=server.api_key, max_retries=0)
            engine.push(fam.tokenizer.encode("ok", add_special_tokens=False), "length")
            ask = lambda: client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Hi"}],  # noqa: E731
                                                         max_tokens=4, **control)
            if served:
                assert ask().choices[0].finish_reason == "length", (name, control)
            else:
                with pytest.raises(openai.BadRequestError, match="but the policy's profile"):
                    ask()
    # a template using jinja's loop controls (Qwen3.5's {% break %}) parses as transformers renders it
    # (a plain environment's TemplateSyntaxError refused every such request as malformed)
    import copy

    from workbench.tokens import ChatFormat

    tok = copy.deepcopy(rm.load_family("qwen3").tokenizer)
    tok.chat_template = ("{%- for m in messages %}{%- if loop.index > 1 %}{%- break %}{%- endif %}{%- endfor %}"
                         + tok.chat_template)
    fmt = ChatFormat(tok)
    assert fmt.renders_the_same_with({"enable_thinking": True}) and not fmt.renders_the_same_with({"enable_thinking": False})
    # Anthropic's output_config.effort is the same control
    fam = rm.load_family("gpt-oss")
    engine = Replay()
    with _server(fam, engine) as server:
        import httpx

        for effort, status in (("medium", 200), ("high", 400)):
            engine.push(fam.tokenizer.encode("ok", add_special_tokens=False), "length")
            r = httpx.post(server.base_url(server.open_session()) + "/messages", headers={"x-api-key": server.api_key},
                           json={"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                                 "output_config": {"effort": effort}})
            assert r.status_code == status, (effort, r.text[:200])
