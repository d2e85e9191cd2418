"""The loopback server driven by the real OpenAI and Anthropic SDKs (sync and async, streaming
and not), backed by the session's real vLLM engine on the tiny MoE."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
import ray
import torch

from workbench.loopback.server import LoopbackServer, session_seed
from workbench.rollout.engine import SamplingConfig
from workbench.tokens import Accumulator
from workbench.toy.models import load_hf_model, load_tokenizer
from workbench.toy.tasks import CALC_TOOL, TOOL_SYSTEM_PROMPT

SYS = {"role": "system", "content": TOOL_SYSTEM_PROMPT}
ANTHROPIC_CALC = {"name": "calc", "description": CALC_TOOL["function"]["description"],
                  "input_schema": CALC_TOOL["function"]["parameters"]}


class Tap:
    """Passes every request to the real engine actor and keeps what it sampled, so tests can
    compare the recorded trajectory with the engine's own output (a tap, not a fake)."""

    def __init__(self, actor):
        self.actor, self.samples, self.sampling = actor, [], []

    async def generate(self, prompt_ids, sampling):
        self.sampling.append(copy.deepcopy(sampling))  # what the engine was asked to sample with
        sample = await self.actor.generate.remote(prompt_ids, sampling)
        self.samples.append(sample)
        return sample

    async def generate_stream(self, prompt_ids, sampling):  # streamed requests: ids as the engine samples them
        from workbench.rollout.actor import stream_generate

        self.sampling.append(copy.deepcopy(sampling))
        async for item in stream_generate(self.actor, prompt_ids, sampling):
            if not isinstance(item, list):
                self.samples.append(item)
            yield item


@pytest.fixture(scope="module")
def server(vllm_moe, tokenizer):
    srv = LoopbackServer(Tap(vllm_moe), tokenizer).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hot(vllm_moe, tokenizer):
    """A server whose policy samples at temperature 1.6: non-canonical splits show up soon."""
    srv = LoopbackServer(Tap(vllm_moe), tokenizer, policy_sampling=SamplingConfig(temperature=1.6)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def greedy(vllm_moe, tokenizer):
    """A server whose policy samples greedily (temperature 0)."""
    srv = LoopbackServer(Tap(vllm_moe), tokenizer, policy_sampling=SamplingConfig(temperature=0.0)).start()
    yield srv
    srv.stop()


def oai(server, sid):
    return openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)


def runs(seg, trainable: bool):
    """The maximal runs of trainable (or template) ids of a segment, in order."""
    out, cur = [], []
    for t, m in zip(seg.token_ids, seg.loss_mask):
        if bool(m) == trainable:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def round_trips(server, ids) -> bool:
    return server.fmt.encode(server.fmt.decode(ids)) == list(ids)


def tool_turns(server, client, temperature, seed, turns=3):
    """A multi-turn tool-use conversation as an agent would run it; returns the messages."""
    msgs = [SYS, {"role": "user", "content": "Compute 12*7."}]
    for t in range(turns):
        r = client.chat.completions.create(model="policy", messages=msgs, tools=[CALC_TOOL], max_tokens=32,
                                           temperature=temperature, seed=seed + t)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))  # sent back exactly as the SDK gave it
        for call in m.tool_calls or []:
            assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
        # two tool results after one assistant turn: both must reach the next prompt (without ids, whatever
        # calls the toy made: matched by position; results with ids answer the turn's calls one each,
        # protocol.order_tool_results, tests/test_loopback_faults.py)
        msgs += [{"role": "tool", "content": f"{84 + t}"}, {"role": "tool", "content": f"{90 + t}"}]
    return msgs


def test_openai_multi_turn_tools_records_exactly_the_sampled_ids(hot):
    """Multi-turn tool use where the tokenizer does not round-trip the sampled ids: the record
    is exactly the engine's sampled ids plus the template deltas, not the transcript's tokens."""
    server = hot
    for attempt in range(8):  # high temperature: non-canonical splits show up within a few tries
        sid = server.open_session()
        n0 = len(server.engine.samples)
        msgs = tool_turns(server, oai(server, sid), temperature=1.6, seed=100 * attempt)
        seg, = server.close_session(sid)
        samples = server.engine.samples[n0:]
        if not all(round_trips(server, s.token_ids) for s in samples):
            break
    else:
        pytest.fail("no sample in 8 sessions failed to round-trip; cannot show drift")
    assert seg.seal_reason == "episode_end"
    assert runs(seg, trainable=True) == [s.token_ids for s in samples]  # exactly what was sampled
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == [lp for s in samples for lp in s.logprobs]
    assert [v for v, m in zip(seg.versions, seg.loss_mask) if m] == [v for s in samples for v in s.versions]
    template = runs(seg, trainable=False)
    for delta, t in zip(template[1:], range(3)):
        text = server.fmt.decode(delta)
        assert f"<|im_start|>tool\n{84 + t}<|im_end|>\n<|im_start|>tool\n{90 + t}<|im_end|>\n<|im_start|>assistant\n" in text
        assert server.fmt.encode(text) == delta  # deltas are tokenized template text, nothing else
    assert seg.token_ids != server.fmt.encode(server.fmt.decode(seg.token_ids))  # the transcript re-tokenizes differently
    assert seg.stats["retokenization_drift"] > 0 and seg.stats["identity_mismatch"] == 0
    assert len(msgs) == 2 + 3 * 3


def test_openai_streaming_async_and_usage(server):
    sid = server.open_session()

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        stream = await client.chat.completions.create(
            model="policy", messages=[SYS, {"role": "user", "content": "Compute 3*4."}], tools=[CALC_TOOL],
            max_tokens=32, stream=True, stream_options={"include_usage": True}, logprobs=True)
        chunks = [c async for c in stream]
        await client.close()
        return chunks

    chunks = asyncio.run(main())
    seg, = server.close_session(sid)
    sample = server.engine.samples[-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(sample.token_ids) and chunks[-1].usage.prompt_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"], ["tool_calls"])
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    if finish == ["tool_calls"]:
        assert calls and json.loads(calls[0].function.arguments) is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text or calls
    assert runs(seg, True) == [sample.token_ids]


def test_sync_stream_and_logprobs_match_the_engine(server):
    sid = server.open_session()
    client = oai(server, sid)
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Say something about books."}],
                                       max_completion_tokens=12, logprobs=True, temperature=1.0, extra_body={"ignore_eos": True})
    sample = server.engine.samples[-1]
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(sample.logprobs)
    assert r.usage.completion_tokens == len(sample.token_ids) == 12 and r.choices[0].finish_reason == "length"
    with client.chat.completions.stream(model="policy", max_tokens=8,
                                        messages=[{"role": "user", "content": "Say something about books."},
                                                  r.choices[0].message.model_dump(exclude_none=True),
                                                  {"role": "user", "content": "More."}]) as s:
        try:
            final = s.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the helper refuses to parse a reply cut by max_tokens
            final = e.completion
    assert final.choices[0].finish_reason in ("stop", "length")
    seg, = server.close_session(sid)
    assert seg.stats["turns"] == 2


def test_anthropic_tool_use_and_two_tool_results(server):
    sid = server.open_session()
    client = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Compute 51*8."}]
    n0 = len(server.engine.samples)
    r = client.messages.create(model="policy", max_tokens=40, system=TOOL_SYSTEM_PROMPT, messages=msgs,
                               tools=[ANTHROPIC_CALC], extra_body={"temperature": 0.7})
    assert r.stop_reason in ("tool_use", "end_turn", "max_tokens") and r.usage.output_tokens == len(server.engine.samples[-1].token_ids)
    uses = [b for b in r.content if b.type == "tool_use"]
    if r.stop_reason == "tool_use":
        assert uses and uses[0].name == "calc" and isinstance(uses[0].input, dict) and uses[0].id.startswith("toolu_")
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    second = {"type": "tool_result", "tool_use_id": "y", "content": [{"type": "text", "text": "409"}]}
    msgs.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id if uses else "x", "content": "408"}, second]})
    if uses:  # results match calls by id, as Anthropic's: one for no call of the turn's is refused, recording nothing
        with pytest.raises(anthropic.BadRequestError, match=r"results for no call of it: \['y'\]"):
            client.messages.create(model="policy", max_tokens=24, system=TOOL_SYSTEM_PROMPT, messages=msgs, tools=[ANTHROPIC_CALC])
        msgs[-1]["content"][1] = {"type": "text", "text": "409"}  # (text after the results: a user turn after them)
    r2 = client.messages.create(model="policy", max_tokens=24, system=TOOL_SYSTEM_PROMPT, messages=msgs, tools=[ANTHROPIC_CALC])
    assert r2.role == "assistant" and r2.type == "message"
    seg, = server.close_session(sid)
    assert seg.stats["turns"] == 2 and seg.seal_reason == "episode_end"
    assert runs(seg, True) == [s.token_ids for s in server.engine.samples[n0:]]
    delta = server.fmt.decode(runs(seg, False)[1])
    after = "user" if uses else "tool"
    assert f"<|im_start|>tool\n408<|im_end|>\n<|im_start|>{after}\n409<|im_end|>\n<|im_start|>assistant\n" in delta


def test_anthropic_async_streaming_events(server):
    sid = server.open_session()

    async def main():
        client = anthropic.AsyncAnthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
        async with client.messages.stream(model="policy", max_tokens=40, system=TOOL_SYSTEM_PROMPT,
                                          messages=[{"role": "user", "content": "Compute 9*9."}], tools=[ANTHROPIC_CALC]) as s:
            events = [e.type async for e in s]
            final = await s.get_final_message()
        await client.close()
        return events, final

    events, final = asyncio.run(main())
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_stop" in events
    assert final.usage.output_tokens == len(server.engine.samples[-1].token_ids)
    assert final.stop_reason in ("tool_use", "end_turn", "max_tokens") and final.content
    seg, = server.close_session(sid)
    assert runs(seg, True) == [server.engine.samples[-1].token_ids]


def test_compaction_opens_beside_and_an_edited_assistant_seals(server):
    sid = server.open_session()
    client = oai(server, sid)
    msgs = [SYS, {"role": "user", "content": "Compute 2*3."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=16)
    msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    # the agent compacts its history into a summary: every non-system message replaced, so a
    # conversation of its own beside the first (which stays open, its tokens trained once)
    compacted = [SYS, {"role": "user", "content": "Earlier: computed 2*3. Now compute 4*5."}]
    r = client.chat.completions.create(model="policy", messages=compacted, max_tokens=16)
    compacted.append(r.choices[0].message.model_dump(exclude_none=True))
    # the agent edits what the model said, then goes on
    edited = compacted[:-1] + [{"role": "assistant", "content": "I edited this."}, {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="policy", messages=edited, max_tokens=16)
    segs = server.close_session(sid)
    assert [s.seal_reason for s in segs] == ["episode_end", "assistant_changed", "episode_end"]
    assert server.fmt.decode(segs[1].token_ids).startswith(server.fmt.render(compacted[:2], None, True))
    assert all(s.stats["identity_mismatch"] == 0 for s in segs)


def test_a_summarizer_beside_the_main_conversation_extends_its_own_segment(server):
    """An agent that calls a summarizer through the same client between its turns (main, summary,
    main, summary, main) records two segments, one per conversation, each the engine's samples
    of that conversation in order: before, every switch sealed the open segment (5 segments, each
    re-prefilling its history)."""
    sid = server.open_session()
    client = oai(server, sid)
    main = [SYS, {"role": "user", "content": "Compute 2*3."}]
    summary = [{"role": "system", "content": "You summarize."}, {"role": "user", "content": "Summarize: 2*3."}]
    n0, mine = len(server.engine.samples), {"main": [], "summary": []}
    for name, msgs in [("main", main), ("summary", summary), ("main", main), ("summary", summary), ("main", main)]:
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
        mine[name].append(server.engine.samples[-1].token_ids)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    assert len(server.engine.samples) == n0 + 5
    segs = server.close_session(sid)
    assert [s.seal_reason for s in segs] == ["episode_end", "episode_end"]
    assert [runs(s, True) for s in segs] == [mine["main"], mine["summary"]]
    assert server.fmt.decode(segs[0].token_ids).startswith(server.fmt.render(main[:2], None, True))
    assert all(s.stats["identity_mismatch"] == 0 and s.stats["turns"] == len(mine[n]) for s, n in zip(segs, mine))


def test_template_that_rewrites_earlier_turns_seals(vllm_moe, moe_path):
    """A template that renders earlier assistant turns differently once a later turn exists
    (like templates that strip old reasoning) cannot be extended: it must seal."""
    tok = load_tokenizer(moe_path)
    tok.chat_template = tok.chat_template.replace(
        "{%- if message.content is string -%}{{- message.content -}}",
        "{%- if message.role == 'assistant' and not loop.last -%}{{- '[earlier reply]' -}}"
        "{%- elif message.content is string -%}{{- message.content -}}")
    with LoopbackServer(Tap(vllm_moe), tok) as srv:
        sid = srv.open_session()
        client = oai(srv, sid)
        msgs = [{"role": "user", "content": "Say something about books."}]
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
        segs = srv.close_session(sid)
    assert [s.seal_reason for s in segs] == ["template_rewrite", "episode_end"]
    assert "[earlier reply]" in srv.fmt.decode(segs[1].token_ids)


def test_reply_cut_by_max_tokens_then_closing_tokens_are_template(greedy):
    server = greedy
    sid = server.open_session()
    client = oai(server, sid)
    msgs = [{"role": "user", "content": "Say something about books."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason == "length"
    cut = server.engine.samples[-1]
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    seg, = server.close_session(sid)
    first, second = runs(seg, False)[:2]
    assert runs(seg, True)[0] == cut.token_ids and cut.token_ids[-1] != server.fmt.end_of_turn_id
    assert server.fmt.decode(second).startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_sdk_retry_of_a_lost_reply_is_served_from_the_cache(server, vllm_moe):
    """A real retry, as the stock SDK makes it: the engine is paused, so the first attempt times
    out at the client while the server still holds the turn; the SDK retries (sending
    x-stainless-retry-count: 1), the retry waits for the turn in flight and gets its reply. The
    engine sampled once and the trajectory holds one turn."""
    sid = server.open_session()
    msgs = [{"role": "user", "content": "Say something about code."}]
    n0, seen0, cached0 = len(server.engine.samples), server.stats.requests["openai:session"], server.stats.retries_served_from_cache

    def resume_once_retried():
        deadline = time.time() + 60
        while server.stats.requests["openai:session"] < seen0 + 2 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the retry is now waiting for the session's turn in flight
        ray.get(vllm_moe.resume.remote())

    ray.get(vllm_moe.pause.remote())
    waiter = threading.Thread(target=resume_once_retried)
    waiter.start()
    try:
        client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=3, timeout=2.0)
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
    finally:
        waiter.join()
        ray.get(vllm_moe.resume.remote())
    assert server.stats.requests["openai:session"] >= seen0 + 2  # the SDK really sent it again
    assert len(server.engine.samples) == n0 + 1 and server.stats.retries_served_from_cache > cached0
    seg, = server.close_session(sid)
    sample = server.engine.samples[-1]
    assert seg.stats["turns"] == 1 and runs(seg, True) == [sample.token_ids]
    assert r.usage.completion_tokens == len(sample.token_ids)


def test_identical_requests_without_retry_header_are_new_samples(server):
    """An agent that asks the same thing twice wants two samples: without the SDK's retry
    header (x-stainless-retry-count 0) an identical request is sampled again; with it (a retry)
    it is served from the cache."""
    sid = server.open_session()
    client = oai(server, sid)
    msgs = [{"role": "user", "content": "Say something about code."}]
    n0 = len(server.engine.samples)
    a = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, temperature=1.0)
    b = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, temperature=1.0)
    c = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, extra_headers={"x-stainless-retry-count": "1"})
    assert a.id != b.id and b.id == c.id
    assert len(server.engine.samples) == n0 + 2
    segs = server.close_session(sid)
    assert [s.seal_reason for s in segs] == ["history_rewritten", "episode_end"]
    assert [runs(s, True) for s in segs] == [[x.token_ids] for x in server.engine.samples[n0:]]


def test_concurrent_sessions_do_not_mix(server):
    sids = [server.open_session() for _ in range(8)]

    async def episode(k, sid):
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        msgs = [{"role": "user", "content": f"marker{k} says hello"}]
        r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"marker{k} again"}]
        await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
        await client.close()

    async def main():
        await asyncio.gather(*[episode(k, sid) for k, sid in enumerate(sids)])

    asyncio.run(main())
    for k, sid in enumerate(sids):
        seg, = server.close_session(sid)
        text = server.fmt.decode([t for t, m in zip(seg.token_ids, seg.loss_mask) if not m])
        assert text.count(f"marker{k} ") == 2, text
        assert not any(f"marker{j} " in text for j in range(8) if j != k)
        assert seg.stats["turns"] == 2 and seg.stats["identity_mismatch"] == 0



def test_a_groups_identical_first_requests_share_one_render(server):
    """A group's episodes open with the same messages: the server renders and encodes that prompt
    once (PromptMemo) and every episode records the same prompt ids as a fresh render gives; a
    request over the memo's size limit is rendered as it is. A single-turn episode records
    exactly its prompt and sampled ids (the history render record() defers is never needed)."""
    from workbench.tokens import ChatFormat

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    fresh = ChatFormat.prompt(server.fmt, msgs, None)[1]
    hits = server.prompts.hits
    sids = [server.open_session() for _ in range(4)]

    async def main():
        clients = [openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0) for sid in sids]
        await asyncio.gather(*[c.chat.completions.create(model="policy", messages=msgs, max_tokens=4) for c in clients])
        for c in clients:
            await c.close()

    asyncio.run(main())
    assert server.prompts.hits == hits + 3
    for sid in sids:
        seg, = server.close_session(sid)
        prompt = [t for t, m in zip(seg.token_ids, seg.loss_mask) if not m]
        assert prompt == fresh and seg.stats["turns"] == 1 and seg.stats["identity_mismatch"] == 0
    long = [{"role": "user", "content": "x" * (server.prompts.max_chars + 1)}]
    text, ids = server.prompts.get(server.fmt, long, None)
    assert ids == ChatFormat.prompt(server.fmt, long, None)[1] and server.prompts.hits == hits + 3
    assert not any(len(k[0]) > server.prompts.max_chars for k in server.prompts._memo)

def test_bad_input_gets_protocol_errors_and_loses_nothing(server):
    sid = server.open_session()
    client = oai(server, sid)
    msgs = [{"role": "user", "content": "Say something about tools."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    before = [list(s.token_ids) for s in server.sessions[sid].segments]
    url = server.base_url(sid)
    key = {"Authorization": f"Bearer {server.api_key}"}
    akey = {"x-api-key": server.api_key, "anthropic-version": "2023-06-01"}
    cases = [  # (url, headers, body bytes, expected status, expected text in the message)
        (f"{url}/chat/completions", key, b"{not json", 400, "not valid JSON"),
        (f"{url}/chat/completions", key, b"[1, 2]", 400, "JSON object"),
        (f"{url}/chat/completions", key, json.dumps({"model": "p"}).encode(), 400, "'messages'"),
        (f"{url}/chat/completions", key, json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "unknown role"),
        (f"{url}/chat/completions", key, json.dumps({"messages": "hi"}).encode(), 400, "must be list"),
        (f"{url}/chat/completions", key, json.dumps({"messages": msgs, "temperature": "hot"}).encode(), 400, "temperature"),
        (f"{url}/chat/completions", key, json.dumps({"messages": msgs, "n": 2}).encode(), 400, "n > 1"),
        (f"{url}/chat/completions", key, json.dumps({"messages": msgs, "tool_choice": "required"}).encode(), 400, "tool_choice"),
        # a side request with no room left in the context (a recorded turn ends as truncated instead)
        (server.base_url(None) + "/chat/completions", key, json.dumps({"messages": [{"role": "user", "content": "x " * 1500}]}).encode(), 400, "context"),
        (server.base_url(None) + "/chat/completions", key, json.dumps({"messages": msgs, "top_k": 5}).encode(), 400, "top_k"),
        (f"{url}/chat/completions", {"Authorization": "Bearer wrong"}, json.dumps({"messages": msgs}).encode(), 401, "API key"),
        (server.base_url("nosuch") + "/chat/completions", key, json.dumps({"messages": msgs}).encode(), 404, "unknown session"),
        (f"{url}/nowhere", key, b"{}", 404, "no route"),
    ]
    aurl = server.base_url(sid, "anthropic") + "/v1/messages"
    acases = [
        (aurl, akey, b"{oops", 400, "not valid JSON"),
        (aurl, akey, json.dumps({"messages": msgs}).encode(), 400, "max_tokens"),
        (aurl, akey, json.dumps({"max_tokens": 5, "messages": [{"role": "developer", "content": "x"}]}).encode(), 400, "unknown role"),
        (aurl, akey, json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}).encode(), 400, "unsupported block"),
        (aurl, {"x-api-key": "nope"}, json.dumps({"max_tokens": 5, "messages": msgs}).encode(), 401, "API key"),
        (server.base_url("nosuch", "anthropic") + "/v1/messages", akey, json.dumps({"max_tokens": 5, "messages": msgs}).encode(), 404, "unknown session"),
        # an Anthropic route this server has not (messages.count_tokens): a 404 in Anthropic's shape (it was OpenAI's)
        (aurl + "/count_tokens", akey, json.dumps({"messages": msgs}).encode(), 404, "no route"),
    ]
    with httpx.Client() as http:
        for u, h, body, status, text in cases:
            resp = http.post(u, headers={**h, "content-type": "application/json"}, content=body)
            assert resp.status_code == status, (body[:60], resp.text)
            err = resp.json()["error"]
            assert text in err["message"] and err["type"], resp.text
        for u, h, body, status, text in acases:
            resp = http.post(u, headers={**h, "content-type": "application/json"}, content=body)
            assert resp.status_code == status, (body[:60], resp.text)
            j = resp.json()
            assert j["type"] == "error" and text in j["error"]["message"] and j["error"]["type"], resp.text
    # the SDKs surface them as their own typed errors
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(model="p", messages=msgs)
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=server.base_url(None, "anthropic"), api_key=server.api_key, max_retries=0).messages.create(
            model="p", max_tokens=5, messages=[{"role": "user", "content": "x " * 1500}])
    # nothing recorded was lost or changed, and the server keeps serving the session
    assert [list(s.token_ids) for s in server.sessions[sid].segments] == before
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    seg, = server.close_session(sid)
    assert seg.token_ids[: len(before[0])] == before[0] and seg.stats["turns"] == 2


def test_models_health_and_side_route_records_nothing(server):
    sid = server.open_session()
    assert oai(server, sid).models.list().data[0].id == server.model_name
    a = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
    assert a.models.list().data[0].id == server.model_name
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = server.summary()["sampled_tokens"]
    judge = openai.OpenAI(base_url=server.base_url(None), api_key=server.api_key, max_retries=0)
    verdict = judge.chat.completions.create(model="judge", messages=[{"role": "user", "content": "Is 12 right?"}], max_tokens=4)
    assert verdict.usage.completion_tokens > 0
    ajudge = anthropic.Anthropic(base_url=server.base_url(None, "anthropic"), api_key=server.api_key, max_retries=0)
    assert ajudge.messages.create(model="judge", max_tokens=4, messages=[{"role": "user", "content": "Rate it."}]).content is not None
    assert server.summary()["sampled_tokens"] == before and server.sessions[sid].segments == []
    server.close_session(sid)


class RetokenizingAccumulator(Accumulator):
    """TEST ONLY: the classic bug. Trains on a retokenization of the decoded reply instead of
    the ids the engine sampled."""

    def _append_sampled(self, seg, sample):
        ids = self.fmt.encode(self.fmt.decode(sample.token_ids))
        logprobs = (list(sample.logprobs) + [0.0] * len(ids))[: len(ids)]  # misaligned, as such code is
        seg.append(ids, trainable=True, logprobs=logprobs, versions=[sample.versions[0]] * len(ids))
        return ids


def test_identity_statistic_catches_a_retokenizing_accumulator(vllm_moe, tokenizer):
    with LoopbackServer(Tap(vllm_moe), tokenizer, accumulator_cls=RetokenizingAccumulator,
                        policy_sampling=SamplingConfig(temperature=1.8)) as broken:
        for attempt in range(8):
            sid = broken.open_session()
            oai(broken, sid).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "Say something about numbers."}],
                max_tokens=32, temperature=1.8, seed=attempt)
            seg, = broken.close_session(sid)
            if not round_trips(broken, broken.engine.samples[-1].token_ids):
                break
        else:
            pytest.fail("no sample failed to round-trip in 8 tries")
    stats = broken.summary()
    assert seg.stats["identity_mismatch"] > 0 and stats["identity_mismatch"] > 0
    # ...while the drift measured on what it recorded looks perfect: drift alone cannot catch it
    assert seg.stats["retokenization_drift"] == 0
    assert runs(seg, True)[0] != broken.engine.samples[-1].token_ids


def test_stop_strings_in_both_protocols(greedy):
    server = greedy
    msgs = [{"role": "user", "content": "Say something about books."}]
    sid = server.open_session()
    r = oai(server, sid).chat.completions.create(model="policy", messages=msgs, max_tokens=24, temperature=0, stop=[" "])
    sample = server.engine.samples[-1]
    assert r.choices[0].finish_reason == "stop" and " " not in r.choices[0].message.content
    seg, = server.close_session(sid)
    assert runs(seg, True) == [sample.token_ids]  # the ids that produced the stop string are recorded
    sid = server.open_session()
    a = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
    with a.messages.stream(model="policy", max_tokens=24, messages=msgs, stop_sequences=[" "],
                           extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " "
    assert " " not in final.content[0].text
    server.close_session(sid)


def test_turns_of_one_session_are_serialised(server):
    """The same request sent twice at once (two samples: no retry header): the second is
    planned only after the first is recorded, so it sees that turn and seals it into its own
    segment; without the lock both would be planned on the empty session."""
    sid = server.open_session()
    n0 = len(server.engine.samples)

    async def main():
        client = anthropic.AsyncAnthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "Say something about code."}]
        replies = await asyncio.gather(*[client.messages.create(model="policy", max_tokens=16, messages=msgs) for _ in range(2)])
        await client.close()
        return replies

    a, b = asyncio.run(main())
    assert a.id != b.id
    assert len(server.engine.samples) == n0 + 2
    segs = server.close_session(sid)
    assert [s.seal_reason for s in segs] == ["history_rewritten", "episode_end"]
    assert [runs(s, True) for s in segs] == [[x.token_ids] for x in server.engine.samples[n0:]]


def teacher_forced(model, prompt_ids, token_ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return np.asarray([lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(token_ids)])


def test_a_group_sending_one_seed_samples_independently(server):
    """A group's episodes send the same first request; an agent that sets `seed` would draw the
    same sample in every one of them (a group without reward variance: no signal, silently).
    The recorded turn's seed is the agent's mixed with the session id: distinct per session."""
    sids = [server.open_session() for _ in range(4)]
    replies = []
    for sid in sids:
        r = oai(server, sid).chat.completions.create(model="policy", max_tokens=12, seed=7,
                                                     messages=[{"role": "user", "content": "Tell me a story."}])
        replies.append(r.choices[0].message.content)
        assert server.engine.sampling[-1].seed == session_seed(7, sid) != 7
    # old: one reply four times; the toy may draw one short reply twice by chance (seen in CI)
    assert len(set(replies)) >= 3
    assert len({session_seed(7, s) for s in sids}) == 4 and session_seed(None, sids[0]) is None
    # the session's next turns, with the same seed: each its own seed (one seed drew every turn's
    # tokens from the same noise); a cached retry makes no engine call, so it takes no seed
    client = oai(server, sids[0])
    msgs = [{"role": "user", "content": "Tell me a story."}]
    for turn in (1, 2):
        r = client.chat.completions.create(model="policy", max_tokens=12, seed=7, messages=msgs)
        assert server.engine.sampling[-1].seed == session_seed(7, sids[0], turn) != session_seed(7, sids[0], turn - 1)
        if turn == 2:  # the SDK's retry of it: the cached reply, no engine call, so the next turn's seed is call 3's
            asked = len(server.engine.sampling)
            client.chat.completions.create(model="policy", max_tokens=12, seed=7, messages=msgs,
                                           extra_headers={"x-stainless-retry-count": "1"})
            assert len(server.engine.sampling) == asked
        msgs = msgs + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="policy", max_tokens=12, seed=7, messages=msgs)
    assert server.engine.sampling[-1].seed == session_seed(7, sids[0], 3)
    assert len({session_seed(7, sids[0], c) for c in range(4)}) == 4
    for sid in sids:
        server.close_session(sid)


def test_policy_owns_the_sampling_of_recorded_turns(vllm_moe, tokenizer, moe_path):
    """An agent sends temperature 0.7 and top_p 0.95: its recorded turn is sampled at the
    policy's temperature (0.9, top_p 1), so its behaviour log-probs are the trainer's
    log_softmax(logits / 0.9); its max_tokens, seed, stop strings and ignore_eos are kept. The
    override is counted per turn; a request that sends no temperature (or the policy's) is no
    override; the side route keeps the agent's 0.7."""
    with LoopbackServer(Tap(vllm_moe), tokenizer, policy_sampling=SamplingConfig(temperature=0.9)) as srv:
        sid = srv.open_session()
        client = oai(srv, sid)
        msgs = [{"role": "user", "content": "Say something about books."}]
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=16, temperature=0.7, top_p=0.95,
                                           seed=5, stop=["zzz"], logprobs=True, extra_body={"ignore_eos": True})
        first, asked = srv.engine.samples[-1], srv.engine.sampling[-1]
        assert (asked.temperature, asked.top_p) == (0.9, 1.0)
        assert (asked.max_tokens, asked.seed, asked.stop, asked.ignore_eos) == (16, session_seed(5, sid), ["zzz"], True)
        assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(first.logprobs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)  # sends no temperature
        r3 = client.chat.completions.create(model="policy", max_tokens=8, temperature=0.9, messages=msgs[:1] + [  # the policy's value
            r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Other."}])
        assert r3.choices[0].finish_reason in ("stop", "length") and srv.engine.sampling[-1].temperature == 0.9
        sid2 = srv.open_session()
        anthropic.Anthropic(base_url=srv.base_url(sid2, "anthropic"), api_key=srv.api_key, max_retries=0).messages.create(
            model="policy", max_tokens=8, extra_body={"temperature": 0.5, "top_k": 5}, messages=[{"role": "user", "content": "Hi."}])
        assert (srv.engine.sampling[-1].temperature, srv.engine.sampling[-1].top_p) == (0.9, 1.0)
        side = openai.OpenAI(base_url=srv.base_url(None), api_key=srv.api_key, max_retries=0)
        side.chat.completions.create(model="judge", messages=msgs[:1], max_tokens=4, temperature=0.7)
        assert srv.engine.sampling[-1].temperature == 0.7  # a side call keeps the agent's sampling
        # top_p 0 (an agent's "deterministic", in the public APIs' [0, 1]) was a 400 on every request, its
        # episodes dropped: recorded, the policy's replaces it; on the side route it is the smallest nucleus
        side.chat.completions.create(model="judge", messages=msgs[:1], max_tokens=4, top_p=0)
        assert 0 < srv.engine.sampling[-1].top_p <= 1e-6
        sid3 = srv.open_session()
        oai(srv, sid3).chat.completions.create(model="policy", messages=msgs[:1], max_tokens=4, top_p=0)
        assert srv.engine.sampling[-1].top_p == 1.0
        segs = srv.close_session(sid)
        assert [s.stats["sampling_overridden"] for s in segs] == [1, 0] and segs[0].stats["turns"] == 2
        srv.close_session(sid2)
        srv.close_session(sid3)
        assert srv.summary()["sampling_overridden"] == 3
    model = load_hf_model(moe_path)
    at_policy = teacher_forced(model, first.prompt_ids, first.token_ids, 0.9)
    at_agent = teacher_forced(model, first.prompt_ids, first.token_ids, 0.7)
    assert np.max(np.abs(at_policy - np.asarray(first.logprobs))) <= 1e-4
    assert np.max(np.abs(at_agent - np.asarray(first.logprobs))) > 1e-2


def test_strict_sampling_refuses_other_sampling_with_a_400(vllm_moe, tokenizer):
    with pytest.raises(ValueError, match="sampling_mode"):
        LoopbackServer(Tap(vllm_moe), tokenizer, sampling_mode="lenient")
    with LoopbackServer(Tap(vllm_moe), tokenizer, policy_sampling=SamplingConfig(temperature=0.9), sampling_mode="strict") as srv:
        sid = srv.open_session()
        client = oai(srv, sid)
        msgs = [{"role": "user", "content": "Say something about books."}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, temperature=0.7)
        err = e.value.body
        assert err["param"] == "temperature" and "temperature 0.9" in err["message"] and "0.7" in err["message"]
        a = anthropic.Anthropic(base_url=srv.base_url(sid, "anthropic"), api_key=srv.api_key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="top_k"):
            a.messages.create(model="policy", max_tokens=8, extra_body={"top_k": 5}, messages=msgs)
        with pytest.raises(anthropic.BadRequestError, match="top_p"):
            a.messages.create(model="policy", max_tokens=8, extra_body={"top_p": 0.5}, messages=msgs)
        assert srv.engine.samples == [] and srv.sessions[sid].segments == []  # nothing sampled or recorded
        assert srv.summary()["sampling_refused"] == {"temperature": 1, "top_k": 1, "top_p": 1}
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=4, temperature=0.9)  # the policy's: fine
        openai.OpenAI(base_url=srv.base_url(None), api_key=srv.api_key, max_retries=0).chat.completions.create(
            model="judge", messages=msgs, max_tokens=4, temperature=0.7)  # the side route is not the policy's
        assert [x.temperature for x in srv.engine.sampling] == [0.9, 0.7]
        seg, = srv.close_session(sid)
        assert seg.stats["turns"] == 1 and seg.stats["sampling_overridden"] == 0


def test_context_clamps_max_tokens_and_a_full_context_ends_the_turn(vllm_moe, tokenizer):
    """max_tokens beyond the room the context leaves is clamped; a turn cut there, and a turn
    with no room at all (empty reply, finish "length" in both protocols, no engine call,
    nothing recorded) mark the session truncated, as does a reply cut by the policy's max_tokens
    (the loop's generation budget). The agent's own smaller max_tokens cut is not."""
    with LoopbackServer(Tap(vllm_moe), tokenizer, max_model_len=64) as srv:
        sid = srv.open_session()
        client = oai(srv, sid)
        msgs = [{"role": "user", "content": "Say something about books."}]
        room = 64 - len(srv.fmt.encode(srv.fmt.render(msgs, None, True)))
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=500, extra_body={"ignore_eos": True})
        sample = srv.engine.samples[-1]
        assert srv.engine.sampling[-1].max_tokens == room == len(sample.token_ids) and r.choices[0].finish_reason == "length"
        assert srv.sessions[sid].truncated
        n = len(srv.engine.samples)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        full = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
        assert full.choices[0].finish_reason == "length" and full.choices[0].message.content == ""
        assert full.usage.completion_tokens == 0 and full.usage.prompt_tokens > 64
        a = anthropic.Anthropic(base_url=srv.base_url(sid, "anthropic"), api_key=srv.api_key, max_retries=0)
        m = a.messages.create(model="policy", max_tokens=8, messages=msgs)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 0 and [b.text for b in m.content] == [""]
        assert len(srv.engine.samples) == n  # the engine was not called
        segs, state = srv.close_session(sid, details=True)
        assert state["truncated"] and len(segs) == 1 and runs(segs[0], True) == [sample.token_ids]
        assert segs[0].stats["turns"] == 1
        sid = srv.open_session()  # the agent's own max_tokens: a cut reply, not a truncated session
        r = oai(srv, sid).chat.completions.create(model="policy", messages=msgs[:1], max_tokens=2, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        _, state = srv.close_session(sid, details=True)
        assert not state["truncated"] and srv.summary()["truncated_sessions"] == 1
        # a context cut the agent went on from (it compacted and finished): not the episode's end,
        # as for a reply cut by the budget; it stayed truncated, and on_truncated masked or dropped
        # an episode that finished with a real reward
        sid = srv.open_session()
        client = oai(srv, sid)
        r = client.chat.completions.create(model="policy", messages=msgs[:1], max_tokens=500, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and srv.sessions[sid].truncated
        compacted = [{"role": "user", "content": "In short: books. Go on."}]
        client.chat.completions.create(model="policy", messages=compacted, max_tokens=2)
        segs, state = srv.close_session(sid, details=True)
        assert not state["truncated"] and len(segs) == 2 and srv.summary()["truncated_sessions"] == 1
    # the policy's budget: the agent sends none (or one at least the policy's) and the reply runs out of it
    with LoopbackServer(Tap(vllm_moe), tokenizer, max_model_len=64, policy_sampling=SamplingConfig(max_tokens=3)) as srv:
        for sent in ({}, {"max_tokens": 3}, {"max_tokens": 2}):
            sid = srv.open_session()
            r = oai(srv, sid).chat.completions.create(model="policy", messages=msgs[:1], extra_body={"ignore_eos": True}, **sent)
            assert r.choices[0].finish_reason == "length" and len(srv.engine.samples[-1].token_ids) == sent.get("max_tokens", 3)
            _, state = srv.close_session(sid, details=True)
            assert state["truncated"] == (sent != {"max_tokens": 2}), sent
        # the episode's end decides: a cut reply it went on from (the next one not cut by the
        # policy's budget) leaves the session untruncated, as an Env that terminates later does
        sid = srv.open_session()
        client = oai(srv, sid)
        r = client.chat.completions.create(model="policy", messages=msgs[:1], extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and srv.sessions[sid].truncated
        again = msgs[:1] + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        client.chat.completions.create(model="policy", messages=again, max_tokens=2, extra_body={"ignore_eos": True})
        _, state = srv.close_session(sid, details=True)
        assert not state["truncated"]


def test_text_parts_are_joined_as_vllm_joins_them():
    """vLLM renders a message's text parts (OpenAI content parts, Anthropic text blocks) and a
    tool result's text blocks joined with "\\n", Anthropic system blocks with "": the prompt the
    policy is trained on is the one it is deployed with. Before, every join was "", gluing an
    agent's reminder block and its question into one word."""
    from workbench.loopback import anthropic_api, openai_api

    oai_req = openai_api.parse_request({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<reminder>be brief</reminder>"}, {"type": "text", "text": "Fix it."}]}]})
    assert oai_req.messages[0]["content"] == "<reminder>be brief</reminder>\nFix it."
    ant = anthropic_api.parse_request({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                                       "messages": [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]}]}]})
    assert [m["content"] for m in ant.messages] == ["AB", "one\ntwo", "x\ny", "a.py\nb.py"]
