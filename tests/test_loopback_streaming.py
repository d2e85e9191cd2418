"""Real streaming through the stock OpenAI and Anthropic SDK streaming clients, the real loopback
server and the real engines (the session's vLLM actor; a reference-engine actor): text arrives
while the engine is still sampling, the recorded trajectory of a streamed episode is the
unstreamed one's token for token (same seed), and tool calls put together by each SDK's stream
are the unstreamed reply's."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import numpy as np
import openai
import pytest

from workbench.loopback.server import LoopbackServer
from workbench.rollout.actor import STREAM_ITEMS_PER_S, STREAM_WINDOW_S, stream_generate, stream_window
from workbench.rollout.engine import Sample, SamplingConfig
from workbench.toy.tasks import CALC_TOOL, TOOL_SYSTEM_PROMPT

ANTHROPIC_CALC = {"name": "calc", "description": CALC_TOOL["function"]["description"],
                  "input_schema": CALC_TOOL["function"]["parameters"]}
BOOKS = [{"role": "user", "content": "Say something about books."}]


class Timed:
    """The engine actor, streamed to the server (Ray's streaming generator), noting when each
    finished sample reaches the server: a tap, not a fake. `window_s`: the actor's merge window
    (None: its default)."""

    def __init__(self, actor, experts: bool = False, window_s: float | None = None):
        self.actor, self.experts, self.finished_at, self.samples = actor, experts, [], []
        self.window_s = window_s

    async def generate(self, prompt_ids, sampling, return_routed_experts=False):
        sample = await self.actor.generate.remote(prompt_ids, sampling, None, return_routed_experts)
        self.samples.append(sample)
        return sample

    async def generate_stream(self, prompt_ids, sampling, return_routed_experts=False):
        async for item in stream_generate(self.actor, prompt_ids, sampling, return_routed_experts, window_s=self.window_s):
            if isinstance(item, Sample):
                self.finished_at.append(time.monotonic())
                self.samples.append(item)
            yield item


@pytest.fixture(scope="module", params=["vllm", "reference"])
def server(request, tokenizer):
    actor = request.getfixturevalue("vllm_moe") if request.param == "vllm" else request.getfixturevalue("reference_engines")[0]
    experts = request.param == "reference"  # the reference engine records MoE routing: compared too
    srv = LoopbackServer(Timed(actor), tokenizer, return_routed_experts=experts).start()
    yield srv
    srv.stop()


def test_text_arrives_while_the_engine_samples(server, tokenizer):
    """Content deltas reach the client before the finished sample reaches the server: the reply
    is sent as the engine produces it, not replayed once it is done. (Replies of 96 tokens: the
    policy ignores EOS here, so that both protocols get the same length; the actor sends every
    engine output, as its default 100 ms window would merge most of a short fast reply. At 24
    tokens the reply took ~0.1 s, and a client delayed that long on a loaded machine read every
    delta after it: one clean-clone CI run in six.)"""
    timed = Timed(server.engine.actor, window_s=0.0)
    with LoopbackServer(timed, tokenizer, policy_sampling=SamplingConfig(ignore_eos=True)) as srv:
        arrived, text_at = asyncio.run(_timed_streams(srv))
    done_openai, done_anthropic = timed.finished_at
    assert sum(t < done_openai for t in arrived) >= 2, (arrived, done_openai)
    assert sum(t < done_anthropic for t in text_at) >= 2, (text_at, done_anthropic)


async def _timed_streams(server):
    """The arrival times of the content deltas of one streamed reply per protocol (recorded
    turns: the policy's sampling applies)."""
    sid = server.open_session()
    oai = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
    arrived = []
    stream = await oai.chat.completions.create(model="policy", messages=BOOKS, max_tokens=96, stream=True, seed=3)
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            arrived.append(time.monotonic())
    await server.close_session_async(sid)
    sid = server.open_session()
    ant = anthropic.AsyncAnthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
    text_at = []
    async with ant.messages.stream(model="policy", max_tokens=96, messages=BOOKS) as s:
        async for e in s:
            if e.type == "content_block_delta" and e.delta.type == "text_delta" and e.delta.text:
                text_at.append(time.monotonic())
    await server.close_session_async(sid)
    await oai.close()
    await ant.close()
    return arrived, text_at


def _episode(server, stream: bool, protocol: str, seed: int):
    """Two turns, the second on the first's reply as the SDK put it together; returns the
    session's segments and the replies' texts. The session id is the seed's: a recorded turn's
    seed is the agent's mixed with its session id (server.session_seed), so the same seed and id
    sample the same."""
    sid = server.open_session(f"seeded-{seed}")
    texts = []
    if protocol == "openai":
        client = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0)
        msgs = list(BOOKS)
        for t in range(2):
            kw = dict(model="policy", messages=msgs, max_tokens=16, seed=seed + t)
            if stream:
                with client.chat.completions.stream(**kw) as s:
                    for _ in s:
                        pass
                    msg = s.current_completion_snapshot.choices[0].message
            else:
                msg = client.chat.completions.create(**kw).choices[0].message
            texts.append(msg.content)
            msgs += [{"role": "assistant", "content": msg.content or ""}, {"role": "user", "content": "And more."}]
    else:
        client = anthropic.Anthropic(base_url=server.base_url(sid, "anthropic"), api_key=server.api_key, max_retries=0)
        msgs = list(BOOKS)
        for t in range(2):
            kw = dict(model="policy", messages=msgs, max_tokens=16, extra_body={"seed": seed + t})
            if stream:
                with client.messages.stream(**kw) as s:
                    msg = s.get_final_message()
            else:
                msg = client.messages.create(**kw)
            texts.append("".join(b.text for b in msg.content if b.type == "text"))
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                     {"role": "user", "content": "And more."}]
    return server.close_session(sid), texts


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_streamed_episode_records_the_unstreamed_trajectory(server, protocol):
    """Same seed, streamed and not: the same segments token for token (ids, loss mask,
    behaviour log-probs, versions, and the routed experts where the engine records them), and
    the SDK's streamed replies equal the unstreamed ones."""
    plain, plain_texts = _episode(server, False, protocol, seed=11)
    streamed, streamed_texts = _episode(server, True, protocol, seed=11)
    assert streamed_texts == plain_texts and any(plain_texts)
    assert len(streamed) == len(plain) == 1 and streamed[0].stats["turns"] == 2
    a, b = plain[0], streamed[0]
    assert b.token_ids == a.token_ids and b.loss_mask == a.loss_mask
    assert b.logprobs == a.logprobs and b.versions == a.versions
    if a.routed_experts is not None:
        assert np.array_equal(a.routed_experts, b.routed_experts)
    assert b.seal_reason == a.seal_reason == "episode_end"


def test_tool_call_deltas_assemble_to_the_unstreamed_call(server):
    """The toy answers the tool prompt with a call: through each SDK's stream helper the call is
    the unstreamed reply's (name, arguments), and the stop reason says tool use."""
    msgs = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": "Compute 6*7."}]
    oai = openai.OpenAI(base_url=server.base_url(None), api_key=server.api_key, max_retries=0)
    kw = dict(model="policy", messages=msgs, tools=[CALC_TOOL], max_tokens=40, seed=5)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    with oai.chat.completions.stream(**kw) as s:
        final = s.get_final_completion().choices[0]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == want
    # the same content, None for a call alone (the stream opened with content "": '' in the SDK's message)
    assert final.message.content == whole.message.content

    ant = anthropic.Anthropic(base_url=server.base_url(None, "anthropic"), api_key=server.api_key, max_retries=0)
    kw = dict(model="policy", system=TOOL_SYSTEM_PROMPT, messages=msgs[1:], tools=[ANTHROPIC_CALC], max_tokens=40,
              extra_body={"seed": 5})
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    uses = lambda m: [(b.name, b.input) for b in m.content if b.type == "tool_use"]  # noqa: E731
    assert final.stop_reason == whole.stop_reason == "tool_use" and uses(final) == uses(whole) == want
    assert "input_json_delta" in kinds


def test_a_streamed_request_refused_before_any_token_gets_its_status(server, tokenizer):
    """The response starts with the first sampled ids, so an engine that refuses the request
    (a prompt over its 1024-token context; the server believes in 4096) is a 400 through both
    SDKs' streaming clients, as unstreamed, and nothing is recorded."""
    long_msgs = [{"role": "user", "content": "books and code " * 500}]
    with LoopbackServer(server.engine.actor, tokenizer, max_model_len=4096) as srv:
        sid = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            for _ in client.chat.completions.create(model="p", messages=long_msgs, max_tokens=4, stream=True):
                pass
        assert e.value.body["code"] == "engine_refused"
        a = anthropic.Anthropic(base_url=srv.base_url(sid, "anthropic"), api_key=srv.api_key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="the engine refused the request"):
            with a.messages.stream(model="p", messages=long_msgs, max_tokens=4) as s:
                s.get_final_message()
        assert srv.close_session(sid) == []


def test_streaming_through_the_router(reference_engines, tokenizer):
    """The runner's path: the EngineRouter streams from its engine actors; the streamed episode
    records the unstreamed one's ids, log-probs and versions."""
    from workbench.rollout.router import EngineRouter

    router = EngineRouter(reference_engines)
    with LoopbackServer(router, tokenizer) as srv:
        plain, plain_texts = _episode(srv, False, "openai", seed=21)
        streamed, streamed_texts = _episode(srv, True, "openai", seed=21)
    assert streamed_texts == plain_texts
    a, b = plain[0], streamed[0]
    assert (b.token_ids, b.logprobs, b.versions) == (a.token_ids, a.logprobs, a.versions)
    assert router.state()["outstanding"] == [0, 0] and router.failovers == 0


def test_the_engine_actor_merges_streamed_ids_after_the_first(reference_engines, tokenizer):
    """actor.generate_stream sends the first new ids at once and merges the rest over its window:
    a window longer than the reply gives the first item and one merged item, window 0 one item
    per engine output, the default (None) lies between; every way the items put together the
    Sample's ids, the record. The default window grows with the streams in flight, so that one
    actor sends at most STREAM_ITEMS_PER_S items a second however many agents stream."""
    prompt = tokenizer.apply_chat_template(BOOKS, add_generation_prompt=True)["input_ids"]
    sampling = SamplingConfig(max_tokens=24, ignore_eos=True, seed=5)

    async def items(window_s):
        return [i async for i in stream_generate(reference_engines[0], prompt, sampling, window_s=window_s)]

    counts = []
    for window_s in (60.0, 0.0, None):
        t0 = time.monotonic()
        *lists, sample = asyncio.run(items(window_s))
        elapsed = time.monotonic() - t0
        assert isinstance(sample, Sample) and [t for ids in lists for t in ids] == sample.token_ids
        counts.append(len(lists))
    # merged: the first output, then the rest in one item; per output: as many as the engine gave
    # (the reference engine gives a step's id, or the steps that came while nobody read, together)
    assert counts[0] <= 2 and counts[1] >= counts[2] >= counts[0], counts
    # the default window: after the first item, at most one per STREAM_WINDOW_S, then the last ids
    assert counts[2] <= 2 + elapsed / STREAM_WINDOW_S, (counts, elapsed)
    assert stream_window(1) == STREAM_WINDOW_S and stream_window(8 * STREAM_ITEMS_PER_S) == 8.0


def test_an_unforeseen_engine_failure_mid_stream_is_counted(tokenizer):
    """An engine error no check foresaw, after the stream started: the unstreamed path counts it
    (unexpected_errors["internal"], 0 is the expectation) and names an error id in the log and the
    message; the streamed path answered 500 uncounted, logged as a warning."""

    class Boom:
        async def generate(self, prompt_ids, sampling):
            raise RuntimeError("kaboom")

        async def generate_stream(self, prompt_ids, sampling):
            yield [100]
            await asyncio.sleep(0.01)
            raise RuntimeError("kaboom")

    with LoopbackServer(Boom(), tokenizer) as srv:
        client = openai.OpenAI(base_url=srv.base_url(srv.open_session()), api_key=srv.api_key, max_retries=0)
        with pytest.raises(openai.APIError, match="error id"):
            for _ in client.chat.completions.create(model="p", messages=BOOKS, max_tokens=4, stream=True):
                pass
        assert srv.summary()["unexpected_errors"] == {"internal": 1}


def test_a_stop_strings_held_back_tail_is_found_in_linear_passes():
    """The longest tail of the text that may begin a stop string (held back from the stream): the
    same answer as every length tried, which cost 7.5 ms a streamed token with 64 stop strings of
    1,024 characters (the request's limits), on the server's event loop."""
    import random

    from workbench.loopback.streaming import _partial

    def every_length(text, markers):
        best = 0
        for m in markers:
            for k in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:k]):
                    best = k
                    break
        return best

    rng = random.Random(0)
    for _ in range(5000):
        markers = ["".join(rng.choice("ab<|") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab<|") for _ in range(rng.randint(0, 10)))
        assert _partial(text, markers) == every_length(text, markers), (text, markers)


def test_a_client_leaving_mid_stream_frees_its_session(tokenizer):
    """A client that closes a stream after its first deltas (no SDK retries a started stream):
    the turn sampled on to max_tokens holding the session's lock, and the agent's next request
    waited for it (3 s in review). The turn is cancelled now: the next request is answered at
    once, and only it is recorded."""

    class Slow:
        async def generate(self, prompt_ids, sampling):
            return Sample(list(prompt_ids), [72, 105], [-0.5, -0.5], [0, 0], "stop")

        async def generate_stream(self, prompt_ids, sampling):
            ids = []
            for _ in range(60):  # 3 s of sampling
                ids.append(72)
                yield [72]
                await asyncio.sleep(0.05)
            yield Sample(list(prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), "length")

    with LoopbackServer(Slow(), tokenizer) as srv:
        sid = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        stream = client.chat.completions.create(model="p", messages=BOOKS, max_tokens=60, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        t0 = time.monotonic()
        r = client.chat.completions.create(model="p", messages=BOOKS + [{"role": "user", "content": "Again."}], max_tokens=4)
        assert time.monotonic() - t0 < 1.5 and r.choices[0].finish_reason == "stop"
        segments = srv.close_session(sid)
        assert sum(sum(s.loss_mask) for s in segments) == 2  # the answered request's two ids only
