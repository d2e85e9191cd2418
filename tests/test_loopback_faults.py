"""Bad input and engine faults at the loopback server: every bad request is a 4xx and every
outage a 503 (with Retry-After), in the protocol's own error shape, with no traceback, process
id, address or actor id in the message; none of them changes anything already recorded.

Real components throughout: the session's vLLM engine (tiny MoE), a reference engine actor that
is killed for real, the stock SDKs and real HTTP. The cases are the ones a review found drawing
500s: JSON nested 2,000-100,000 levels, integers of thousands of digits in temperature / seed /
max_tokens, seeds outside vLLM's int64 range, `stop: [""]` and lone surrogates, a list as an
OpenAI role, engine errors leaking Ray tracebacks, unbounded bodies tokenized on the event loop,
and dead engines answering 500."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time

import anthropic
import httpx
import openai
import pytest
import ray

from workbench.loopback.protocol import INT64_MAX, INT64_MIN, MAX_JSON_DEPTH, MAX_NUMBER_CHARS, MAX_STOP, MAX_STOP_CHARS
from workbench.loopback.server import LoopbackServer
from workbench.rollout.engine import SamplingConfig
from workbench.rollout.router import EngineRouter

# what must never reach a client: tracebacks, file paths of frames, pids, IPv4 addresses, Ray
# task names, actor/object ids (long hex)
LEAK = re.compile(r"Traceback|File \"|\bpid\b|pid=|\b\d{1,3}(?:\.\d{1,3}){3}\b|ray::|actor_id|\b(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b")
USER = [{"role": "user", "content": "Say something about books."}]


class SessionTap:
    """Passes every request to the real engine actor and keeps (session id, sample), so tests can
    compare what a session recorded with what the engine sampled for it (a tap, not a fake)."""

    routes_sessions = True  # the server passes the session id

    def __init__(self, actor):
        self.actor, self.samples = actor, []

    async def generate(self, prompt_ids, sampling, session_id=None, return_routed_experts=False):
        sample = await self.actor.generate.remote(prompt_ids, sampling)
        self.samples.append((session_id, sample))
        return sample


@pytest.fixture(scope="module")
def server(vllm_moe, tokenizer):
    srv = LoopbackServer(SessionTap(vllm_moe), tokenizer).start()
    yield srv
    srv.stop()


def snapshot(server) -> dict:
    """Everything recorded in every open session."""
    return {sid: ([dataclasses.asdict(s) for s in acc.segments], acc.truncated) for sid, acc in server.sessions.items()}


def sessions_with_a_turn(server):
    """An OpenAI and an Anthropic session, each with one recorded turn."""
    o, a = server.open_session(), server.open_session()
    openai.OpenAI(base_url=server.base_url(o), api_key=server.api_key, max_retries=0).chat.completions.create(
        model="p", messages=USER, max_tokens=4)
    anthropic.Anthropic(base_url=server.base_url(a, "anthropic"), api_key=server.api_key, max_retries=0).messages.create(
        model="p", messages=USER, max_tokens=4)
    assert all(len(server.sessions[s].segments) == 1 for s in (o, a))
    return o, a


def nest(depth: int, kind: str = "array") -> str:
    return ("[" * depth + "]" * depth) if kind == "array" else ('{"a":' * depth + "1" + "}" * depth)


MSGS = json.dumps(USER)
# (name, raw JSON body of an OpenAI request, text the message must hold, param or None)
OPENAI_CASES = [
    ("array nested 2,000 deep", f'{{"messages": {MSGS}, "max_tokens": 4, "x": {nest(2000)}}}', f"deeper than {MAX_JSON_DEPTH}", None),
    ("array nested 100,000 deep", nest(100_000), f"deeper than {MAX_JSON_DEPTH}", None),
    ("object nested 2,000 deep", f'{{"messages": {MSGS}, "metadata": {nest(2000, "object")}}}', f"deeper than {MAX_JSON_DEPTH}", None),
    ("object nested 100,000 deep", nest(100_000, "object"), f"deeper than {MAX_JSON_DEPTH}", None),
    ("nested 100 deep (parses, over the bound)", f'{{"messages": {MSGS}, "x": {nest(100)}}}', f"deeper than {MAX_JSON_DEPTH}", None),
    ("content nested 3,000 deep", '{"messages": [{"role": "user", "content": ' + nest(3000) + "}]}", "deeper than", None),
    ("temperature of 5,000 digits", f'{{"messages": {MSGS}, "temperature": {"7" * 5000}}}', f"at most {MAX_NUMBER_CHARS}", None),
    ("seed of 5,000 digits", f'{{"messages": {MSGS}, "seed": {"9" * 5000}}}', "number literal of 5000 characters", None),
    ("max_tokens of 5,000 digits", f'{{"messages": {MSGS}, "max_tokens": {"9" * 5000}}}', "number literal", None),
    ("temperature 10**60", f'{{"messages": {MSGS}, "temperature": {10**60}}}', "'temperature' must be a number in [0, 2]", "temperature"),
    ("temperature 1e999 (inf)", f'{{"messages": {MSGS}, "temperature": 1e999}}', "'temperature' must be a finite number", "temperature"),
    ("temperature NaN", f'{{"messages": {MSGS}, "temperature": NaN}}', "not a JSON number", None),
    ("top_p -Infinity", f'{{"messages": {MSGS}, "top_p": -Infinity}}', "not a JSON number", None),
    ("seed 2**63", f'{{"messages": {MSGS}, "seed": {2**63}}}', "'seed' must be an integer in [-2**63, 2**63-1]", "seed"),
    ("seed -2**63-1", f'{{"messages": {MSGS}, "seed": {INT64_MIN - 1}}}', "'seed' must be an integer in [-2**63, 2**63-1]", "seed"),
    ("seed 2**64", f'{{"messages": {MSGS}, "seed": {2**64}}}', "'seed' must be an integer", "seed"),
    ("seed 1.5", f'{{"messages": {MSGS}, "seed": 1.5}}', "'seed' must be int", "seed"),
    ("max_tokens 2**63", f'{{"messages": {MSGS}, "max_tokens": {INT64_MAX + 1}}}', "'max_tokens' must be an integer in [1, 2**63-1]", "max_tokens"),
    ("max_tokens 0", f'{{"messages": {MSGS}, "max_tokens": 0}}', "'max_tokens' must be an integer in [1,", "max_tokens"),
    ("max_completion_tokens -5", f'{{"messages": {MSGS}, "max_completion_tokens": -5}}', "'max_completion_tokens' must be", "max_completion_tokens"),
    ("n 10**40", f'{{"messages": {MSGS}, "n": {10**40}}}', "'n' must be an integer in [1, 2**63-1]", "n"),
    ("top_logprobs 10**30", f'{{"messages": {MSGS}, "top_logprobs": {10**30}}}', "'top_logprobs' must be an integer in [0, 20]", "top_logprobs"),
    ("top_k 1.5", f'{{"messages": {MSGS}, "top_k": 1.5}}', "'top_k' must be int", "top_k"),
    ("top_k -7", f'{{"messages": {MSGS}, "top_k": -7}}', "'top_k' must be an integer in [-1,", "top_k"),
    ("min_p 2", f'{{"messages": {MSGS}, "min_p": 2}}', "'min_p' must be a number in [0, 1]", "min_p"),
    ("presence_penalty 10**50", f'{{"messages": {MSGS}, "presence_penalty": {10**50}}}', "in [-2, 2]", "presence_penalty"),
    ("repetition_penalty 0", f'{{"messages": {MSGS}, "repetition_penalty": 0}}', "in (0, inf)", "repetition_penalty"),
    ("logit_bias key not a token id", f'{{"messages": {MSGS}, "logit_bias": {{"x": 1}}}}', "token ids", "logit_bias"),
    ("logit_bias value 1000", f'{{"messages": {MSGS}, "logit_bias": {{"5": 1000}}}}', "[-100, 100]", "logit_bias"),
    ('stop [""]', f'{{"messages": {MSGS}, "stop": [""]}}', "empty stop string", "stop"),
    ('stop ""', f'{{"messages": {MSGS}, "stop": ""}}', "empty stop string", "stop"),
    ("stop with a lone surrogate", f'{{"messages": {MSGS}, "stop": ["ab\\ud800"]}}', "lone surrogate", "stop[0]"),
    ("stop a lone low surrogate", f'{{"messages": {MSGS}, "stop": "\\udfff"}}', "lone surrogate", "stop"),
    ("too many stop strings", json.dumps({"messages": USER, "stop": [f"s{i}" for i in range(MAX_STOP + 1)]}), f"at most {MAX_STOP}", "stop"),
    ("stop string too long", json.dumps({"messages": USER, "stop": ["x" * (MAX_STOP_CHARS + 1)]}), f"at most {MAX_STOP_CHARS}", "stop"),
    ("stop a number", f'{{"messages": {MSGS}, "stop": [5]}}', "'stop' must be a string or a list of strings", "stop"),
    ("role is a list", json.dumps({"messages": [{"role": ["user"], "content": "x"}]}), "unknown role", "messages[0].role"),
    ("role is an object", json.dumps({"messages": [{"role": {"a": 1}, "content": "x"}]}), "unknown role", "messages[0].role"),
    ("content with a lone surrogate", '{"messages": [{"role": "user", "content": "hi \\ud83d there"}]}', "lone surrogate", "messages[0].content"),
    ("key with a lone surrogate", '{"messages": [{"role": "user", "content": "hi", "\\udc00": 1}]}', "lone surrogate", None),
    ("tool_call_id an object", json.dumps({"messages": USER + [{"role": "assistant", "content": "x"}, {"role": "tool", "tool_call_id": {"a": 1}, "content": "5"}]}),
     "tool_call_id must be a string", None),
    ("tool-call arguments nested 200 deep", json.dumps({"messages": USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": nest(200)}}]},
        {"role": "user", "content": "ok"}]}), "deeper than", None),
    ("tool-call arguments with a 300-digit number", json.dumps({"messages": USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"a": ' + "1" * 300 + "}"}}]},
        {"role": "user", "content": "ok"}]}), "number literal of 300", None),
    ("tool-call arguments a list", json.dumps({"messages": USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": [1]}}]}]}),
     "must be a JSON string", None),
    ("tool parameters a string", json.dumps({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
     "'parameters' an object", "tools"),
    ("stream_options.include_usage a string", json.dumps({"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}}),
     "include_usage", None),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid UTF-8", None),
    # vLLM's template extras: every turn renders with the profile's template (they were ignored)
    # (template kwargs and an effort that render otherwise than the profile: tests/test_real_loopback.py; the
    # toy's template reads none, so any renders as the profile's and is served)
    ("continue_final_message", json.dumps({"messages": USER, "continue_final_message": True}), "'continue_final_message' is not supported",
     "continue_final_message"),
    ("a per-request chat_template", json.dumps({"messages": USER, "chat_template": "{{ messages }}"}), "per-request chat_template", "chat_template"),
    ("documents", json.dumps({"messages": USER, "documents": [{"title": "t", "text": "x"}]}), "'documents' is not supported", "documents"),
    # decoding constraints: nothing constrains decoding (they were ignored: unconstrained replies)
    ("response_format json_object", json.dumps({"messages": USER, "response_format": {"type": "json_object"}}),
     "'response_format' other than", "response_format"),
    ("parallel_tool_calls false", json.dumps({"messages": USER, "parallel_tool_calls": False}), "'parallel_tool_calls' is False", "parallel_tool_calls"),
    ("legacy functions", json.dumps({"messages": USER, "functions": [{"name": "f", "parameters": {}}]}), "'functions' is", "functions"),
    ("a legacy function_call in history", json.dumps({"messages": USER + [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, {"role": "user", "content": "ok"}]}),
     "function_call (the legacy functions API)", "messages[1].function_call"),
    ("vLLM's guided_json", json.dumps({"messages": USER, "guided_json": {"type": "object"}}), "'guided_json' is", "guided_json"),
    ("vLLM's min_tokens", json.dumps({"messages": USER, "min_tokens": 5}), "'min_tokens' is 5", "min_tokens"),
    ("vLLM's stop_token_ids", json.dumps({"messages": USER, "stop_token_ids": [5]}), "'stop_token_ids' is [5]", "stop_token_ids"),
    # vLLM's extras that were accepted and ignored (bad_words ["y"] got "y")
    ("vLLM's bad_words", json.dumps({"messages": USER, "bad_words": ["y"]}), "'bad_words' is", "bad_words"),
    ("vLLM's allowed_token_ids", json.dumps({"messages": USER, "allowed_token_ids": [5]}), "'allowed_token_ids' is", "allowed_token_ids"),
    ("vLLM's use_beam_search", json.dumps({"messages": USER, "use_beam_search": True}), "'use_beam_search' is", "use_beam_search"),
    ("vLLM's add_special_tokens", json.dumps({"messages": USER, "add_special_tokens": True}), "'add_special_tokens' is", "add_special_tokens"),
]
ANTHROPIC_CASES = [
    ("array nested 100,000 deep", nest(100_000), f"deeper than {MAX_JSON_DEPTH}", None),
    ("object nested 2,000 deep", f'{{"messages": {MSGS}, "max_tokens": 4, "metadata": {nest(2000, "object")}}}', "deeper than", None),
    ("max_tokens of 5,000 digits", f'{{"messages": {MSGS}, "max_tokens": {"9" * 5000}}}', "number literal", None),
    ("max_tokens 2**64", f'{{"messages": {MSGS}, "max_tokens": {2**64}}}', "'max_tokens' must be an integer in [1, 2**63-1]", None),
    ("temperature of 5,000 digits", f'{{"messages": {MSGS}, "max_tokens": 4, "temperature": {"1" * 5000}}}', "number literal", None),
    ("temperature 10**60", f'{{"messages": {MSGS}, "max_tokens": 4, "temperature": {10**60}}}', "'temperature' must be a number in [0, 2]", None),
    ("seed 2**63 (an extra field)", f'{{"messages": {MSGS}, "max_tokens": 4, "seed": {2**63}}}', "'seed' must be an integer in [-2**63, 2**63-1]", None),
    ("top_k 2.5", f'{{"messages": {MSGS}, "max_tokens": 4, "top_k": 2.5}}', "'top_k' must be int", None),
    ('stop_sequences [""]', f'{{"messages": {MSGS}, "max_tokens": 4, "stop_sequences": [""]}}', "empty stop string", None),
    ("stop_sequences with a lone surrogate", f'{{"messages": {MSGS}, "max_tokens": 4, "stop_sequences": ["\\ud800"]}}', "lone surrogate", None),
    ("role is a list", json.dumps({"max_tokens": 4, "messages": [{"role": ["user"], "content": "x"}]}), "unknown role", None),
    ("text block with a number as text", json.dumps({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
     "text must be a string", None),
    ("block type a list", json.dumps({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": ["text"]}]}]}), "with a 'type'", None),
    ("system with a lone surrogate", f'{{"messages": {MSGS}, "max_tokens": 4, "system": "\\udbff"}}', "lone surrogate", None),
    ("tool input_schema a list", json.dumps({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": [1]}]}), "'input_schema' must be an object", None),
    ("tool without input_schema", json.dumps({"max_tokens": 4, "messages": USER, "tools": [{"name": "f"}]}), "'input_schema' must be an object", None),
    ("Anthropic's bash tool", json.dumps({"max_tokens": 4, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
     "Anthropic's 'bash_20250124' tool", None),
    ("disable_parallel_tool_use", json.dumps({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
     "disable_parallel_tool_use is not supported", None),
    ("a prefill", json.dumps({"max_tokens": 4, "messages": USER + [{"role": "assistant", "content": "{"}]}), "(prefill) is not supported", None),
    ("thinking on a policy that does not reason", json.dumps({"max_tokens": 40, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 20}}),
     "thinking.type is 'enabled', but the policy's profile renders every turn without reasoning", None),
    ("thinking of an unknown type", json.dumps({"max_tokens": 4, "messages": USER, "thinking": {"type": "sometimes"}}), "thinking.type must be", None),
    ("output_config.format", json.dumps({"max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "json_schema", "schema": {}}}}),
     "output_config.format is not supported", None),
    ("MCP servers", json.dumps({"max_tokens": 4, "messages": USER, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
     "'mcp_servers' is not supported", None),
    ("context editing", json.dumps({"max_tokens": 4, "messages": USER, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}),
     "'context_management' is not supported", None),
    ("tool_use_id an object", json.dumps({"max_tokens": 4, "messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "calc", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": {"a": 1}, "content": "5"}]}]}), "tool_use_id must be a string", None),
    ("vLLM's watermarking", json.dumps({"max_tokens": 4, "messages": USER, "watermarking": True}), "'watermarking' is", None),
]


def _post(http, url, headers, body):
    return http.post(url, headers={**headers, "content-type": "application/json"},
                     content=body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass"))


def test_bad_requests_are_400s_in_both_shapes_and_change_nothing(server):
    """Each case above, to a recorded session of its protocol and to the side route: a 400 in
    the protocol's error shape naming the field and the bound, no leak, no unforeseen failure,
    and every session's record (segments, truncated) exactly as before. The sessions then go on."""
    o, a = sessions_with_a_turn(server)
    before, n_samples = snapshot(server), len(server.engine.samples)
    key = {"Authorization": f"Bearer {server.api_key}"}
    akey = {"x-api-key": server.api_key, "anthropic-version": "2023-06-01"}
    with httpx.Client(timeout=60) as http:
        for name, body, text, param in OPENAI_CASES:
            for url in (server.base_url(o) + "/chat/completions", server.base_url(None) + "/chat/completions"):
                r = _post(http, url, key, body)
                assert r.status_code == 400, (name, r.status_code, r.text[:300])
                err = r.json()["error"]
                assert text in err["message"] and err["type"] == "invalid_request_error", (name, err)
                assert param is None or err["param"] == param, (name, err)
                assert not LEAK.search(err["message"]) and len(err["message"]) < 400, (name, err)
        for name, body, text, _ in ANTHROPIC_CASES:
            for url in (server.base_url(a, "anthropic") + "/v1/messages", server.base_url(None, "anthropic") + "/v1/messages"):
                r = _post(http, url, akey, body)
                assert r.status_code == 400, (name, r.status_code, r.text[:300])
                j = r.json()
                assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", (name, j)
                assert text in j["error"]["message"] and not LEAK.search(j["error"]["message"]), (name, j)
    assert snapshot(server) == before and len(server.engine.samples) == n_samples  # nothing sampled, nothing changed
    assert server.summary()["unexpected_errors"] == {}  # every case met a check that names it
    # the SDKs surface them as their own 400s
    with pytest.raises(openai.BadRequestError, match="seed"):
        openai.OpenAI(base_url=server.base_url(o), api_key=server.api_key, max_retries=0).chat.completions.create(
            model="p", messages=USER, max_tokens=4, seed=2**64)
    with pytest.raises(anthropic.BadRequestError, match="empty stop string"):
        anthropic.Anthropic(base_url=server.base_url(a, "anthropic"), api_key=server.api_key, max_retries=0).messages.create(
            model="p", messages=USER, max_tokens=4, stop_sequences=[""])
    # accepted edges: vLLM's seed range ends, a stop string at the bound
    client = openai.OpenAI(base_url=server.base_url(None), api_key=server.api_key, max_retries=0)
    for seed in (INT64_MIN, INT64_MAX, -1):
        assert client.chat.completions.create(model="p", messages=USER, max_tokens=2, seed=seed).usage.completion_tokens > 0
    client.chat.completions.create(model="p", messages=USER, max_tokens=2, stop=["y" * MAX_STOP_CHARS] * MAX_STOP)
    assert snapshot(server) == before
    for sid in (o, a):
        seg, = server.close_session(sid)
        assert seg.stats["turns"] == 1 and seg.stats["identity_mismatch"] == 0


def test_engine_refusal_is_a_400_and_an_engine_bug_a_500_without_internals(vllm_moe, tokenizer):
    """Real engine-side errors. The server believes in a 4096-token context, the vLLM engine
    has 1024: vLLM's own validation refuses the long prompt (VLLMValidationError inside the Ray
    actor, a RayTaskError here, whose text carries the traceback, pid, IP and actor id): a 400
    naming vLLM's reason and nothing else. Asking the CPU engine for routed experts raises
    NotImplementedError inside the actor: a 500 naming the class and an error id, no internals."""
    long_msgs = [{"role": "user", "content": "books and code " * 500}]
    with LoopbackServer(SessionTap(vllm_moe), tokenizer, max_model_len=4096) as srv:
        o = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(o), api_key=srv.api_key, max_retries=0)
        client.chat.completions.create(model="p", messages=USER, max_tokens=4)
        before = snapshot(srv)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="p", messages=long_msgs, max_tokens=4)
        msg = e.value.body["message"]
        assert msg.startswith("the engine refused the request:") and "maximum context length is 1024" in msg and not LEAK.search(msg), msg
        assert e.value.body["code"] == "engine_refused"
        a = anthropic.Anthropic(base_url=srv.base_url(o, "anthropic"), api_key=srv.api_key, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="maximum context length is 1024") as e:
            a.messages.create(model="p", messages=long_msgs, max_tokens=4)
        assert not LEAK.search(e.value.body["error"]["message"])
        assert snapshot(srv) == before
        # the session goes on: its retry cache was cleared, its record is intact
        r = client.chat.completions.create(model="p", messages=USER + [{"role": "assistant", "content": "x"}], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        srv.close_session(o)
    with LoopbackServer(vllm_moe, tokenizer, return_routed_experts=True) as srv:  # the actor itself: its real error
        o = srv.open_session()
        with pytest.raises(openai.InternalServerError) as e:
            openai.OpenAI(base_url=srv.base_url(o), api_key=srv.api_key, max_retries=0).chat.completions.create(
                model="p", messages=USER, max_tokens=4)
        msg = e.value.body["message"]
        assert e.value.status_code == 500 and "NotImplementedError" in msg and "error id" in msg and not LEAK.search(msg), msg
        assert srv.sessions[o].segments == [] and srv.summary()["unexpected_errors"] == {"internal": 1}


def test_a_reply_that_fails_after_sampling_is_not_answered_by_an_older_identical_request(vllm_moe, tokenizer):
    """The reply's building fails after the engine sampled (a fake fault: a parser that raises
    once). That request recorded nothing, so its retry must be sampled anew, not answered from
    the cache with the reply of an older, identical request of the session."""

    class FailingOnce(LoopbackServer):
        fail = False

        def _reply(self, sample, req, prompt_ids):
            if self.fail:
                self.fail = False
                raise RuntimeError("reply parser bug")
            return super()._reply(sample, req, prompt_ids)

    body = {"model": "p", "messages": USER, "max_tokens": 4}
    with FailingOnce(SessionTap(vllm_moe), tokenizer) as srv, httpx.Client(timeout=60) as http:
        o = srv.open_session()
        url, key = srv.base_url(o) + "/chat/completions", {"Authorization": f"Bearer {srv.api_key}"}
        assert http.post(url, headers=key, json=body).status_code == 200  # recorded; the session's last request
        srv.fail = True
        assert http.post(url, headers=key, json=body).status_code == 500  # the same request again: sampled, then failed
        r = http.post(url, headers={**key, "x-stainless-retry-count": "1"}, json=body)  # the SDK's retry of it
        assert r.status_code == 200 and srv.stats.retries_served_from_cache == 0
        assert len(srv.engine.samples) == 3 and len(srv.close_session(o)) == 2  # the retry sampled and recorded anew


@pytest.fixture
def doomed_engine(ray_local, moe_path):
    """A reference engine actor of this test's own, to be killed."""
    from workbench.rollout.actor import launch_engine

    actor = launch_engine("reference", model_path=str(moe_path), seed=3)
    yield actor
    ray.kill(actor)


def test_dead_engines_are_503s_with_retry_after(doomed_engine, tokenizer):
    """The engine actor is killed for real (ray.kill): a recorded turn and a side call get a 503
    with Retry-After in both protocols (the SDKs: InternalServerError / ServiceUnavailableError),
    no Ray internals; the stock SDK honours the hint when it retries. Through an EngineRouter whose
    engines are all dead: the same. The framework's own loop (turn()) still sees the engine's
    exception. Nothing recorded changes."""
    srv = LoopbackServer(doomed_engine, tokenizer).start()
    routed = LoopbackServer(EngineRouter([doomed_engine]), tokenizer).start()
    try:
        o = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(o), api_key=srv.api_key, max_retries=0)
        client.chat.completions.create(model="p", messages=USER, max_tokens=4)
        before = snapshot(srv)
        ray.kill(doomed_engine)
        time.sleep(0.5)
        for s in (srv, routed):
            sid = o if s is srv else s.open_session()
            with pytest.raises(openai.InternalServerError) as e:
                openai.OpenAI(base_url=s.base_url(sid), api_key=s.api_key, max_retries=0).chat.completions.create(
                    model="p", messages=USER + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}], max_tokens=4)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
            assert e.value.body["code"] == "engine_unavailable" and not LEAK.search(e.value.body["message"]), e.value.body
            with pytest.raises(anthropic.ServiceUnavailableError) as e:
                anthropic.Anthropic(base_url=s.base_url(None, "anthropic"), api_key=s.api_key, max_retries=0).messages.create(
                    model="p", messages=USER, max_tokens=4)
            assert e.value.response.headers["retry-after"] == "1" and e.value.body["error"]["type"] == "overloaded_error"
            assert not LEAK.search(e.value.body["error"]["message"])
        assert snapshot(srv) == before
        # the SDK retries a 503 after the Retry-After it was given (1 s), not its own shorter backoff
        n0, t0 = srv.stats.requests["openai:session"], time.perf_counter()
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=srv.base_url(o), api_key=srv.api_key, max_retries=1).chat.completions.create(
                model="p", messages=USER, max_tokens=4)
        assert srv.stats.requests["openai:session"] == n0 + 2 and time.perf_counter() - t0 >= 1.0
        with pytest.raises(ray.exceptions.RayActorError):  # turn(): the engine's own exception
            asyncio.run(srv.turn(o, USER, None, SamplingConfig(max_tokens=4)))
        # (the turn's failure counted with the requests': an Env run's summary read no errors)
        assert snapshot(srv) == before and srv.summary()["errors"] == {503: 5} and srv.summary()["unexpected_errors"] == {}
    finally:
        srv.stop()
        routed.stop()


def test_request_size_limit_is_a_413_read_incrementally(server):
    """A body over max_request_bytes gets a 413 in the protocol's shape: declared
    (Content-Length) or streamed without a length (chunked), and through both SDKs; a body at the
    limit is served. The server buffers no more than the limit and keeps serving."""
    assert LoopbackServer.max_request_bytes == 4 * 2**20
    server.max_request_bytes = 64 * 1024
    try:
        o, a = sessions_with_a_turn(server)
        before = snapshot(server)
        big = [{"role": "user", "content": "x" * 70_000}]
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=server.base_url(o), api_key=server.api_key, max_retries=0).chat.completions.create(
                model="p", messages=big, max_tokens=4)
        assert e.value.status_code == 413 and "65536 bytes" in e.value.body["message"] and e.value.body["code"] == "request_too_large"
        with pytest.raises(anthropic.RequestTooLargeError) as e:
            anthropic.Anthropic(base_url=server.base_url(a, "anthropic"), api_key=server.api_key, max_retries=0).messages.create(
                model="p", messages=big, max_tokens=4)
        assert e.value.body["error"]["type"] == "request_too_large"

        def chunks():  # no Content-Length: Transfer-Encoding chunked
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(40):
                yield b"y" * 4096
            yield b'"}]}'

        with httpx.Client(timeout=60) as http:
            r = http.post(server.base_url(o) + "/chat/completions", content=chunks(),
                          headers={"Authorization": f"Bearer {server.api_key}", "content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            at_limit = json.dumps({"messages": [{"role": "user", "content": "z"}], "max_tokens": 2, "pad": ""}).encode()
            at_limit = at_limit[:-2] + b"p" * (64 * 1024 - len(at_limit)) + b'"}'
            assert len(at_limit) == 64 * 1024
            r = http.post(server.base_url(None) + "/chat/completions", content=at_limit,
                          headers={"Authorization": f"Bearer {server.api_key}", "content-type": "application/json"})
            assert r.status_code == 200, r.text
        assert snapshot(server) == before
    finally:
        del server.max_request_bytes  # back to the class default
    for sid in (o, a):
        server.close_session(sid)


def test_a_huge_request_is_tokenized_off_the_event_loop(server):
    """A 3 MB request (2M tokens: about 4 s of tokenizing on 2 busy cores) to one session
    while another session's agent keeps working: the template render and the encode run in a
    worker thread with the GIL released, so the event loop keeps answering (/health, at most
    1 s apart) and the other session's turns complete meanwhile. (Planned on the event loop, as
    before, or in a thread with tokenizers' GIL-holding `encode`, every other request waits
    for the whole tokenization: both fail this test.)"""
    big_sid, sid = server.open_session(), server.open_session()
    client, msgs = openai.OpenAI(base_url=server.base_url(sid), api_key=server.api_key, max_retries=0), list(USER)
    r = client.chat.completions.create(model="p", messages=msgs, max_tokens=2)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    huge = [{"role": "user", "content": "words and more words, " * 140_000}]
    done, out = threading.Event(), {}

    def huge_request():
        t = time.perf_counter()
        r = openai.OpenAI(base_url=server.base_url(big_sid), api_key=server.api_key, max_retries=0, timeout=120).chat.completions.create(
            model="p", messages=huge, max_tokens=4)
        out["seconds"], out["reply"] = time.perf_counter() - t, r
        done.set()

    pings = []  # when each /health answer arrived: a stalled event loop (or a held GIL) is a long interval

    def pinger():
        with httpx.Client() as http:
            while not done.is_set():
                assert http.get(server.url + "/health").status_code == 200
                pings.append(time.perf_counter())
                time.sleep(0.01)

    n0 = server.stats.requests["openai:session"]
    threads = [threading.Thread(target=huge_request), threading.Thread(target=pinger)]
    for th in threads:
        th.start()
    turns = 0
    while server.stats.requests["openai:session"] == n0:  # the huge request has arrived
        time.sleep(0.01)
    time.sleep(0.3)  # ... and is being tokenized
    while turns < 3 and not done.is_set():  # the other session's agent goes on meanwhile
        r = client.chat.completions.create(model="p", messages=msgs, max_tokens=2)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"more {turns}"}]
        turns += 1
    turns_during = turns if not done.is_set() else turns - 1
    for th in threads:
        th.join()
    gap = max((b - a for a, b in zip(pings, pings[1:])), default=float("inf"))
    # it really was a long tokenization (1.96 s on a fast day, ~4 s on a busy one): long enough that
    # a stalled event loop would show as a gap of about all of it, which the gap bound rules out
    assert out["seconds"] > 1.2, out
    assert out["reply"].choices[0].finish_reason == "length" and out["reply"].usage.prompt_tokens > 1_500_000  # no room: truncated, nothing sampled
    assert turns_during == 3 and gap < min(1.0, out["seconds"] / 2), (gap, turns_during, out["seconds"])
    assert server.sessions[big_sid].segments == [] and server.sessions[big_sid].truncated
    seg, = server.close_session(sid)
    assert seg.stats["turns"] == 4 and seg.seal_reason == "episode_end"
    server.close_session(big_sid)


class Scripted:
    """An engine that answers with the text it is given, encoded, and the finish reason given (a
    fake: replies a test needs exactly, and an abort, which a real engine gives only at its
    shutdown). Keeps each request's sampling."""

    def __init__(self, tokenizer):
        self.tokenizer, self.replies, self.sampling = tokenizer, [], []

    async def generate(self, prompt_ids, sampling):
        from workbench.rollout.engine import Sample

        self.sampling.append(sampling)
        if isinstance(self.replies[0], BaseException):  # (a failure the test scripts)
            raise self.replies.pop(0)
        text, finish = self.replies.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Sample(list(prompt_ids), ids, [-0.1] * len(ids), [0] * len(ids), finish)


def test_a_tool_call_the_agent_could_not_send_back_is_left_as_text(tokenizer):
    """A call whose arguments the server would refuse when the agent sends its history back (a
    number past MAX_NUMBER_CHARS, NaN) reached the agent as a call: every later request of the
    episode was a 400 and the episode died. It is the model's text now, as any call a parser
    cannot read (counted), and the next request extends the recorded turn."""
    from workbench.toy.tasks import CALC_TOOL

    big = "1" * (MAX_NUMBER_CHARS + 20)
    engine = Scripted(tokenizer)
    with LoopbackServer(engine, tokenizer) as srv:
        # (and a name with a JSON-escaped lone surrogate: it could not be encoded, the recorded turn's reply
        # was a plain-text 500 the SDK retried into the same 500)
        for name, bad in (("calc", big), ("calc", "NaN"), ("calc\\ud800", '"1"')):
            sid = srv.open_session()
            client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
            call = '<tool_call>\n{"name": "%s", "arguments": {"expression": %s}}\n</tool_call>' % (name, bad)
            engine.replies += [(call + "<|im_end|>", "stop"), ("2<|im_end|>", "stop")]
            failures = srv.summary()["parser_failures"]
            r = client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL], max_tokens=200)
            m = r.choices[0].message
            assert (m.content, m.tool_calls, r.choices[0].finish_reason) == (call, None, "stop"), bad
            assert srv.summary()["parser_failures"] == failures + 1
            msgs = USER + [m.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
            r = client.chat.completions.create(model="p", messages=msgs, tools=[CALC_TOOL], max_tokens=8)
            assert r.choices[0].message.content == "2"
            seg, = srv.close_session(sid)
            assert seg.stats["turns"] == 2  # extended: one segment
            assert seg.stats["temperatures"] == [1.0]  # what the engine sampled at (the policy's), stamped
            assert seg.stats["top_ps"] == [1.0]


def test_logprob_bytes_rebuild_a_split_character_and_a_nan_log_prob_is_no_500(tokenizer):
    """logprobs=True: each entry's `bytes` are the token's own (joined, the text: an emoji split over
    byte tokens decoded token by token gave U+FFFD's bytes); a non-finite log-prob (NaN logits of a
    diverging run) is -9999 as vLLM clamps, not a body that failed to render after the turn was
    recorded (a 500, then the same from every SDK retry). And a side-route request without
    max_tokens may use the context's room, as OpenAI and vLLM give (the server's 256 cut a judge
    that reasons first: paid 0)."""
    from workbench.rollout.engine import Sample

    class NanEngine(Scripted):
        async def generate(self, prompt_ids, sampling):
            s = await super().generate(prompt_ids, sampling)
            return Sample(s.prompt_ids, s.token_ids, [float("nan")] + s.logprobs[1:], s.versions, s.finish_reason)

    engine = NanEngine(tokenizer)
    text = "ok \U0001F99C done \u00e9"
    with LoopbackServer(engine, tokenizer, max_model_len=1024) as srv:
        sid = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        engine.replies.append((text + "<|im_end|>", "stop"))
        r = client.chat.completions.create(model="p", messages=USER, max_tokens=64, logprobs=True)
        entries = r.choices[0].logprobs.content
        assert len(entries) > len(text.split()) + 2  # the emoji is several byte tokens
        assert b"".join(bytes(e.bytes) for e in entries).decode() == text + "<|im_end|>" and r.choices[0].message.content == text
        assert entries[0].logprob == -9999.0 and all(e.logprob == -0.1 for e in entries[1:])
        seg, = srv.close_session(sid)
        assert seg.stats["turns"] == 1
        side = openai.OpenAI(base_url=srv.base_url(None), api_key=srv.api_key, max_retries=0)
        engine.replies.append(("fine<|im_end|>", "stop"))
        side.chat.completions.create(model="p", messages=USER)
        assert engine.sampling[-1].max_tokens > 900  # the room the 1024-token context leaves


def test_a_turn_a_stop_string_ended_seals_as_such_not_as_the_templates():
    """The recorded ids hold the stop string's text, the message the agent sends back does not: on
    Qwen3 (its last assistant message rendered with an empty think block) the next request cannot
    extend the ids, and a ReAct agent's stop=["Observation:"] seals every turn. The seal said
    template_rewrite, blaming the template; it says stop_string (expected, not flagged)."""
    from workbench.real_models import load_family
    from workbench.tokens import UNEXPECTED_SEALS

    tokenizer = load_family("qwen3-nothink").tokenizer
    engine = Scripted(tokenizer)
    with LoopbackServer(engine, tokenizer) as srv:
        sid = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        # (the next request fails once in the engine, and the agent sends it again: the failure cleared
        # the retry cache, where the stop string was read, and the retry's seal read as the template's)
        engine.replies += [("Thought: add. Observation:", "stop"), RuntimeError("the engine failed"), ("42<|im_end|>", "stop")]
        r = client.chat.completions.create(model="p", messages=USER, max_tokens=64, stop=["Observation:"])
        assert r.choices[0].message.content == "Thought: add. " and r.choices[0].finish_reason == "stop"
        msgs = USER + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Observation: 42"}]
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="p", messages=msgs, max_tokens=64)
        client.chat.completions.create(model="p", messages=msgs, max_tokens=64)
        first, second = srv.close_session(sid)
        assert first.seal_reason == "stop_string" and "stop_string" not in UNEXPECTED_SEALS
        assert second.seal_reason == "episode_end"
    # a stop string of newlines alone: the allowance for a reasoning cut by max_tokens (the template
    # strips its trailing newlines) took it off, and the turn extended as "4.\n\n<|eot_id|>", an end of
    # turn after the stop text that no server builds
    for family in ("llama3.1", "qwen3-nothink"):
        tokenizer = load_family(family).tokenizer
        engine = Scripted(tokenizer)
        with LoopbackServer(engine, tokenizer) as srv:
            sid = srv.open_session()
            client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
            engine.replies += [("The answer is 4.\n\n", "stop"), ("Yes.", "length")]
            r = client.chat.completions.create(model="p", messages=USER, max_tokens=64, stop=["\n\n"])
            msgs = USER + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            client.chat.completions.create(model="p", messages=msgs, max_tokens=64)
            assert [s.seal_reason for s in srv.close_session(sid)] == ["stop_string", "episode_end"], family


class Slow(Scripted):
    """Scripted, each id after `delay_s` (streamed one at a time): a reply a client may give up on."""

    def __init__(self, tokenizer, delay_s: float):
        super().__init__(tokenizer)
        self.delay_s, self.calls, self.first_s = delay_s, 0, 0.0  # first_s: a wait before the first id (a prefill)

    async def generate(self, prompt_ids, sampling):
        self.calls += 1
        sample = await super().generate(prompt_ids, sampling)
        await asyncio.sleep(self.delay_s * len(sample.token_ids))
        return sample

    async def generate_stream(self, prompt_ids, sampling):
        self.calls += 1
        sample = await super().generate(prompt_ids, sampling)
        await asyncio.sleep(self.first_s)
        for i in sample.token_ids:
            await asyncio.sleep(self.delay_s)
            yield [i]
        yield sample


def test_a_reply_the_client_gave_up_on_is_not_recorded(tokenizer):
    """An agent's call that times out on its side (or is cancelled): the server finished the
    engine call and recorded the reply the agent never received; the agent's own re-ask was a new
    sample recorded after it, and the episode's reward trained both. It is held now: the SDK's
    own retry of the request takes it (tests/test_loopback.py, the retry cache); anything else
    drops it (counted in `undelivered`), streamed or not, and the re-ask is the turn."""
    import httpx

    engine = Slow(tokenizer, 0.05)
    with LoopbackServer(engine, tokenizer) as srv:
        sid = srv.open_session()
        engine.replies += [("Slow and long reply<|im_end|>", "stop"), ("Quick<|im_end|>", "stop")]
        impatient = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0, timeout=0.2)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="p", messages=USER, max_tokens=32)
        deadline = time.time() + 10
        while sid not in srv._undelivered and time.time() < deadline:
            time.sleep(0.05)
        assert sid in srv._undelivered and engine.calls == 1
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        assert client.chat.completions.create(model="p", messages=USER, max_tokens=32).choices[0].message.content == "Quick"
        assert srv.summary()["undelivered"] == 1
        seg, = srv.close_session(sid)
        recorded = tokenizer.decode([t for t, m in zip(seg.token_ids, seg.loss_mask) if m])
        assert recorded == "Quick<|im_end|>" and seg.stats["turns"] == 1, recorded
        # streamed: the client reads the first ids and leaves; the turn is cancelled (no SDK retries a
        # started stream), nothing recorded, counted undelivered
        sid = srv.open_session()
        engine.replies += [("One two three four five six seven eight<|im_end|>", "stop")]
        with httpx.stream("POST", srv.base_url(sid) + "/chat/completions", headers={"Authorization": f"Bearer {srv.api_key}"},
                          json={"model": "p", "messages": USER, "max_tokens": 32, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.time() + 10
        while srv.summary()["undelivered"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert srv.close_session(sid) == [] and srv.summary()["undelivered"] == 2
        # a side call (a judge's, never recorded) left the same way is no undelivered reply
        engine.replies += [("One two three four five six seven eight<|im_end|>", "stop")]
        calls = engine.calls
        with httpx.stream("POST", srv.base_url(None) + "/chat/completions", headers={"Authorization": f"Bearer {srv.api_key}"},
                          json={"model": "p", "messages": USER, "max_tokens": 32, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.time() + 10
        while engine.calls == calls and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # (the stream's end read)
        assert srv.summary()["undelivered"] == 2
        # streamed, the client gone before the first ids (a read timeout during a long prefill):
        # its response never starts, so the stream's own marker never ran
        engine.delay_s, engine.first_s = 0.0, 0.5  # every id at once after the wait: the turn ends before any response
        sid = srv.open_session()
        engine.replies += [("Late<|im_end|>", "stop")]
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", srv.base_url(sid) + "/chat/completions", timeout=0.2,
                              headers={"Authorization": f"Bearer {srv.api_key}"},
                              json={"model": "p", "messages": USER, "max_tokens": 32, "stream": True}) as r:
                r.read()
        deadline = time.time() + 10
        while sid not in srv._undelivered and time.time() < deadline:
            time.sleep(0.05)
        assert srv.close_session(sid) == [] and srv.summary()["undelivered"] == 3


def test_a_sub_agents_failed_request_keeps_the_main_agents_retry_cache(tokenizer):
    """The main agent's reply is lost on the wire; a sub-agent's first request (another system
    prompt: a conversation beside the main one) fails at the engine; then the main agent's SDK
    retries. The failure cleared the cache of the *current* conversation, the main agent's, which
    its request never became: the retry was sampled again and sealed the segment, the reply the
    agent never received trained. The retry is served from the cache now."""
    class FailsOnce(Scripted):
        async def generate(self, prompt_ids, sampling):
            if self.replies and self.replies[0] is None:
                self.replies.pop(0)
                raise TimeoutError("engine busy")
            return await super().generate(prompt_ids, sampling)

    engine = FailsOnce(tokenizer)
    main = [{"role": "system", "content": "You solve."}, {"role": "user", "content": "2+2?"}]
    sub = [{"role": "system", "content": "You summarise."}, {"role": "user", "content": "Summarise it."}]
    with LoopbackServer(engine, tokenizer) as srv:
        sid = srv.open_session()
        url, auth = srv.base_url(sid) + "/chat/completions", {"Authorization": f"Bearer {srv.api_key}"}
        engine.replies += [("4<|im_end|>", "stop"), None]
        assert httpx.post(url, headers=auth, json={"model": "p", "messages": main}).status_code == 200  # (lost)
        assert httpx.post(url, headers=auth, json={"model": "p", "messages": sub}).status_code >= 500
        r = httpx.post(url, headers={**auth, "x-stainless-retry-count": "1"}, json={"model": "p", "messages": main})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "4"
        assert srv.stats.retries_served_from_cache == 1 and not engine.replies
        seg, = srv.close_session(sid)
        assert seg.seal_reason == "episode_end" and seg.stats["turns"] == 1


def test_a_failure_planning_a_turn_is_a_400_and_only_a_templates_refusal_goes_uncounted(tokenizer):
    """A role the template refuses is the request's 400. Any other exception while planning (a bug
    of the recording code, Accumulator.plan) is a 400 too, but counted in unexpected_errors["plan"]
    and logged: it answered as a template refusal, nothing in the statistics saw it."""
    engine = Scripted(tokenizer)
    with LoopbackServer(engine, tokenizer) as srv:
        sid = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(sid), api_key=srv.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="unknown role"):
            client.chat.completions.create(model="p", messages=[{"role": "critic", "content": "x"}], max_tokens=4)
        assert srv.summary()["unexpected_errors"] == {}

        def broken(*a, **k):
            raise IndexError("list index out of range")

        srv.sessions[sid].plan = broken
        with pytest.raises(openai.BadRequestError, match="list index out of range"):
            client.chat.completions.create(model="p", messages=USER, max_tokens=4)
        assert srv.summary()["unexpected_errors"] == {"plan": 1} and not engine.sampling


def test_replies_without_tools_aborts_defaults_and_anthropic_edges(tokenizer):
    """What real agents send and got wrong answers to. A request without tools gets tool-call
    syntax back as text (it was parsed into calls the agent never declared); an agent sending no
    max_tokens gets the policy's; an aborted sample is a 503 and records nothing (it was recorded
    and answered as a finished turn); Claude Code's per-request billing header does not seal every
    turn; a tool call's stop string is no stop_sequence; thinking "disabled" on a policy that does
    not reason is accepted."""
    from workbench.toy.tasks import CALC_TOOL

    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'
    engine = Scripted(tokenizer)
    with LoopbackServer(engine, tokenizer, policy_sampling=SamplingConfig(max_tokens=300)) as srv:
        o = srv.open_session()
        client = openai.OpenAI(base_url=srv.base_url(o), api_key=srv.api_key, max_retries=0)
        engine.replies += [(call + "<|im_end|>", "stop")] * 2
        r = client.chat.completions.create(model="p", messages=USER)  # no tools, no max_tokens
        assert r.choices[0].message.content == call and not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
        assert engine.sampling[-1].max_tokens == 300
        r = client.chat.completions.create(model="p", messages=USER, tools=[CALC_TOOL])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "calc"
        # a parser that raises on a reply (a fake fault): the reply reaches the agent as content, counted
        parse, srv.reply_parser._parse = srv.reply_parser._parse, lambda *a: 1 / 0
        engine.replies.append((call + "<|im_end|>", "stop"))
        r = client.chat.completions.create(model="p", messages=USER + [{"role": "user", "content": "again"}], tools=[CALC_TOOL])
        srv.reply_parser._parse = parse
        assert r.choices[0].message.content == call and srv.summary()["parser_failures"] == 1
        before = snapshot(srv)
        for reason in ("abort", "error", "repetition"):  # vLLM's unfinished ends: none is a turn to train on
            engine.replies.append(("partial", reason))
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="p", messages=USER + [{"role": "user", "content": "more"}], max_tokens=8)
            assert e.value.status_code == 503 and "EngineAborted" in e.value.body["message"] and snapshot(srv) == before

        a = srv.open_session()
        ac = anthropic.Anthropic(base_url=srv.base_url(a, "anthropic"), api_key=srv.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "Compute 1+1."}]
        for k in range(2):  # the header's hash changes at every request
            system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={k}a9f;"},
                      {"type": "text", "text": "You are a calculator."}]
            engine.replies.append((call + " END<|im_end|>", "stop"))
            m = ac.messages.create(model="p", max_tokens=40, system=system, messages=msgs, stop_sequences=["END"],
                                   tools=[{"name": "calc", "input_schema": CALC_TOOL["function"]["parameters"]}],
                                   thinking={"type": "disabled"})
            assert (m.stop_reason, m.stop_sequence) == ("tool_use", None)
            use = m.content[-1]
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "2"}]}]
        assert "billing" not in tokenizer.decode(srv.sessions[a].segments[0].token_ids)
        assert len(srv.close_session(a)) == 1  # the second turn extended the first
        srv.close_session(o)
    # the policy's stop string (LoopConfig's, merged into a recorded turn's sampling) ends the text, but
    # is no stop_sequence of a request that sent none: it read stop_sequence '</answer>', one it never had
    with LoopbackServer(engine, tokenizer, policy_sampling=SamplingConfig(max_tokens=30, stop=["</answer>"])) as srv:
        s = srv.open_session()
        ac = anthropic.Anthropic(base_url=srv.base_url(s, "anthropic"), api_key=srv.api_key, max_retries=0)
        engine.replies += [("<answer>5</answer> more<|im_end|>", "stop")] * 2
        m = ac.messages.create(model="p", max_tokens=30, messages=[{"role": "user", "content": "2+3?"}])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("end_turn", None, "<answer>5")
        m = ac.messages.create(model="p", max_tokens=30, stop_sequences=["</answer>"],  # its own: said
                               messages=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<answer>5"},
                                         {"role": "user", "content": "again"}])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "</answer>", "<answer>5")
        srv.close_session(s)


def test_anthropic_empty_text_blocks_are_skipped_as_vllm_does():
    """vLLM's Anthropic server skips an empty text block; joined here, it put a "\\n" before the
    next one, a prompt vLLM never renders. A message of empty text stays an empty message."""
    from workbench.loopback.anthropic_api import _messages

    msgs = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "x"}]},
            {"role": "user", "content": ""}]
    assert _messages(msgs, None) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": ""}]


def test_anthropic_inline_system_messages_stand_where_they_are():
    """The Anthropic SDK's MessageParam allows a system message among the messages (Claude Code's
    per-turn reminders): refused with a 400, every such request's episode failed. Kept in place,
    as vLLM's Anthropic server keeps it (billing header dropped, blocks joined with "", an empty
    one left out), not merged into the leading system prompt (that would change the prefix)."""
    from workbench.loopback.anthropic_api import _messages
    from workbench.loopback.protocol import RequestError

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                                           {"type": "text", "text": "<system-reminder>"}, {"type": "text", "text": "be brief</system-reminder>"}]},
            {"role": "system", "content": ""}, {"role": "user", "content": "again"}]
    assert _messages(msgs, "S") == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"},
                                    {"role": "system", "content": "<system-reminder>be brief</system-reminder>"},
                                    {"role": "user", "content": "again"}]
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\]: a system message holds text blocks only"):
        _messages([{"role": "system", "content": [{"type": "image", "source": {}}]}], None)
    with pytest.raises(RequestError, match="unknown role 'developer'"):
        _messages([{"role": "developer", "content": "x"}], None)


def test_the_servers_timings_are_bounded():
    """Per-request timings were kept for the whole run: a float a request in the runner, forever
    (~640 MB at 10M requests), each summary() sorting them all. The last TIMINGS_KEPT are kept."""
    from workbench.loopback.server import TIMINGS_KEPT, ServerStats

    stats = ServerStats()
    for i in range(TIMINGS_KEPT + 10):
        stats.overhead_s.append(float(i))
        stats.engine_s.append(float(i))
    assert len(stats.overhead_s) == len(stats.engine_s) == TIMINGS_KEPT and stats.overhead_s[0] == 10.0


def test_a_closed_sessions_turns_stop_and_answer_404(tokenizer):
    """A session closed without waiting (a timed-out episode): its turn waiting for the engine is
    cancelled there (uvicorn does not cancel a request whose client left: it sampled on to
    max_tokens) and answers a 404 (its handler cancelled, uvicorn logged an ASGI error and sent a
    500); a turn queued behind it makes no engine call at all. (A fake engine: the slow reply.)"""
    from workbench.rollout.engine import Sample

    class Slow:
        def __init__(self):
            self.calls = self.cancelled = 0

        async def generate(self, prompt_ids, sampling):
            self.calls += 1
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return Sample(list(prompt_ids), [7, 8], [-0.1, -0.1], [0, 0], "stop")

    engine = Slow()
    srv = LoopbackServer(engine, tokenizer).start()
    try:
        sid = srv.open_session()
        got = {}

        def ask(name, content):
            r = httpx.post(srv.base_url(sid) + "/chat/completions", headers={"authorization": f"Bearer {srv.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}, timeout=30)
            got[name] = (r.status_code, r.json()["error"]["message"])

        first = threading.Thread(target=ask, args=("in flight", "hi"))
        first.start()
        deadline = time.monotonic() + 10
        while engine.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        queued = threading.Thread(target=ask, args=("queued", "hello"))
        queued.start()
        time.sleep(0.3)
        srv.close_session(sid, wait=False)
        first.join(10)
        queued.join(10)
        assert (engine.calls, engine.cancelled) == (1, 1)
        assert got["in flight"][0] == got["queued"][0] == 404 and "was closed" in got["queued"][1], got
        assert not srv._engine_waits and srv.summary()["unexpected_errors"] == {}
    finally:
        srv.stop()


def test_a_bounded_close_is_bounded_when_a_turn_is_queued_behind_a_released_lock(tokenizer):
    """close_session(wait=s) with the session's lock just released and a turn queued for it (a
    woken waiter that has not run yet): the lock read unlocked, the close took the unbounded path,
    queued behind that turn and waited out its whole engine call (3 s here), then recorded the
    turn its agent had left. It returns within its bound. (And a session id of dots alone is refused.)"""
    srv = LoopbackServer(object(), tokenizer)  # (not started: _close driven on this test's loop)
    for dots in (".", ".."):  # (path segments a client removes: /s/../v1 reached /v1, every request 404)
        with pytest.raises(ValueError, match="not dots alone"):
            srv.open_session(dots)

    async def main():
        sid = srv.open_session()
        lock, took = srv.sessions[sid].lock, {}

        async def close():
            t = time.perf_counter()
            await srv._close(sid, 0.2)
            took["s"] = time.perf_counter() - t

        async def turn(hold, then=None):
            async with lock:
                await asyncio.sleep(hold)
                if then:
                    took["close"] = asyncio.ensure_future(then())  # the close arrives as the turn releases

        a = asyncio.ensure_future(turn(0.05, close))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(turn(3.0))  # a turn the agent left behind, queued on the lock
        await a
        await took["close"]
        b.cancel()
        return took["s"]

    assert asyncio.run(main()) < 1.0


def test_an_env_turns_requests_and_engine_failures_are_counted(tokenizer):
    """The framework's Env loop calls LoopbackServer.turn directly: its turns and their engine
    failures were in no counter (an Env run's summary read no requests and no errors while every
    engine call failed). Counted as a request's are, and the engine's own exception reaches the loop."""
    from workbench.rollout.engine import TornWeights

    engine = Scripted(tokenizer)
    with LoopbackServer(engine, tokenizer) as srv:
        sid = srv.open_session()
        engine.replies += [("7<|im_end|>", "stop"), TornWeights("a sync failed part-way (put in by the test)")]
        msgs = [{"role": "user", "content": "3+4?"}]
        assert asyncio.run(srv.turn(sid, msgs, None, SamplingConfig(max_tokens=4))).content == "7"
        with pytest.raises(TornWeights):
            asyncio.run(srv.turn(sid, msgs + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "5+5?"}],
                                 None, SamplingConfig(max_tokens=4)))
        summary = srv.summary()
        assert summary["requests"] == {"env:session": 2} and sum(summary["errors"].values()) == 1, summary
        srv.close_session(sid)


def test_tool_results_are_matched_to_their_calls_by_id():
    """OpenAI and Anthropic match a tool result to its call by id, in any order; templates render
    results in the order sent, with no id: results sent as they finished gave each call the other's
    result in the trained context (1+1 -> 9). They are put in call order; a call left unanswered, a
    result for no call or a call answered twice is refused (both APIs refuse them); results without
    ids keep their places. An Anthropic text block before a tool_result is refused, as Anthropic does
    (it rendered as a user turn between the calls and their results)."""
    from workbench.loopback import anthropic_api, openai_api
    from workbench.loopback.protocol import RequestError

    def call(cid, expr):
        return {"id": cid, "type": "function", "function": {"name": "calc", "arguments": json.dumps({"expr": expr})}}

    def body(*results, ids=True):
        return {"messages": [{"role": "user", "content": "?"},
                             {"role": "assistant", "content": None, "tool_calls": [call("A", "1+1"), call("B", "3*3")]},
                             *[{"role": "tool", "content": c, **({"tool_call_id": i} if ids else {})} for i, c in results],
                             {"role": "user", "content": "and?"}]}

    got = openai_api.parse_request(body(("B", "9"), ("A", "2"))).messages
    assert [(m["role"], m["content"]) for m in got[2:]] == [("tool", "2"), ("tool", "9"), ("user", "and?")]
    assert [m["content"] for m in openai_api.parse_request(body(("B", "9"), ("A", "2"), ids=False)).messages[2:4]] == ["9", "2"]
    for results, said in (((("B", "9"),), r"calls left unanswered: \['A'\]"),
                          ((("A", "2"), ("x", "9")), r"results for no call of it: \['x'\]"),
                          ((("A", "2"), ("A", "2"), ("B", "9")), r"calls answered twice: \['A'\]")):
        with pytest.raises(RequestError, match=said) as refused:
            openai_api.parse_request(body(*results))
        assert refused.value.status == 400
    # Anthropic: the same rule over tool_use / tool_result ids
    uses = [{"type": "tool_use", "id": "toolu_A", "name": "calc", "input": {"expr": "1+1"}},
            {"type": "tool_use", "id": "toolu_B", "name": "calc", "input": {"expr": "3*3"}}]
    results = [{"type": "tool_result", "tool_use_id": "toolu_B", "content": "9"},
               {"type": "tool_result", "tool_use_id": "toolu_A", "content": "2"}]
    an = {"max_tokens": 8, "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": uses},
                                        {"role": "user", "content": results}]}
    assert [m["content"] for m in anthropic_api.parse_request(an).messages[2:]] == ["2", "9"]
    an["messages"][2]["content"] = [{"type": "text", "text": "here you go"}, *results]
    with pytest.raises(RequestError, match=r"a tool_result after a text block"):
        anthropic_api.parse_request(an)


def test_a_side_call_whose_client_left_stops_sampling(tokenizer):
    """A judge call (the side route: no session) whose client gave up (its episode timed out, its
    SDK's timeout): uvicorn does not cancel the handler, and no session's end cancels it, so the
    engine sampled on to its max_tokens (the room left in the context) beside the live episodes.
    The call is cancelled once the client has gone."""

    class Held(Slow):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, 0.0)
            self.ended = None  # "cancelled" or "finished"

        async def generate(self, prompt_ids, sampling):
            try:
                await asyncio.sleep(30)  # a long judge reply
            except asyncio.CancelledError:
                self.ended = "cancelled"
                raise
            self.ended = "finished"
            return await super().generate(prompt_ids, sampling)

    engine = Held(tokenizer)
    with LoopbackServer(engine, tokenizer) as srv:
        impatient = openai.OpenAI(base_url=srv.base_url(None), api_key=srv.api_key, max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="judge", messages=USER, max_tokens=1024)
        deadline = time.time() + 10
        while engine.ended is None and time.time() < deadline:
            time.sleep(0.05)
        assert engine.ended == "cancelled"
