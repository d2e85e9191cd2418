"""Mistral's Tekken tokenizer as a real family (issue 11), offline: mistral-common's own Tekken file
(NeMo's tekken_240911.json, loaded from site-packages at run time, never copied) in a checkpoint
directory, vLLM's MistralTokenizer over it, the `mistral` profile with chat_format="tekken" and
workbench.tekken.TekkenFormat.

(a) the rendered text encodes back to exactly the ids mistral-common's request encoding produces;
(c) the Accumulator with Tekken, on a constructed sampled reply (a [TOOL_CALLS] call parsed by vLLM's
    `mistral` tool parser), extends exactly or seals with the reason written down below.
Tokenizer level only: no engine, no Ray (vLLM's import is most of the time)."""

from __future__ import annotations

import functools
import json

import pytest

from workbench.lint import diff_context, sample_of
from workbench.profiles import ProfileError, profile_for
from workbench.real_models import _pkg_dir
from workbench.tokens import Accumulator, ChatFormat, retokenization_drift

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Tekken checkpoint directory: config.json and tekken.json (a link into mistral-common)."""
    d = tmp_path_factory.mktemp("nemo")
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", "max_position_embeddings": 131072}))
    (d / "tekken.json").symlink_to(_pkg_dir("mistral_common") / "data" / "tekken_240911.json")
    return d


@pytest.fixture(scope="module")
def fmt(ckpt):
    from workbench.tekken import load_tokenizer

    prof = profile_for(ckpt)
    return ChatFormat.for_profile(load_tokenizer(ckpt), prof)


def test_profile_says_tekken(ckpt, fmt, tmp_path):
    from workbench.tekken import TekkenFormat

    prof = profile_for(ckpt)
    assert (prof.family, prof.chat_format, prof.tool_parser, prof.tool_call_ids) == ("mistral", "tekken", "mistral", "alnum9")
    assert isinstance(fmt, TekkenFormat) and fmt.tokenizer.is_tekken  # ChatFormat.for_profile chose it
    assert (fmt.end_of_turn, fmt.end_of_turn_id, fmt.message_form["tool_call_ids"]) == ("</s>", 2, "alnum9")
    # the same config without tekken.json is the SentencePiece/template Mistral
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    assert profile_for(tmp_path).chat_format == "template"
    with pytest.raises(ValueError, match="chat_format"):
        prof.replace(chat_format="jinja")
    # a stop token Tekken's vocabulary lacks is refused (it became stop id 0, <unk>: the token never stopped a turn)
    assert prof.stop_token_ids(fmt.tokenizer) == [2]
    with pytest.raises(ProfileError, match="has no token '<|im_end|>'"):
        prof.replace(stop_tokens=("<|im_end|>",)).stop_token_ids(fmt.tokenizer)


# ------------------------------------------------------------------ (a) text <-> mistral-common's ids
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TWO_CALLS = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "xyzXYZ789", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
CONVERSATIONS = {
    "plain multi-turn": ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                          {"role": "user", "content": "Tell me a joke, in Français: «ça va»?"}], None),
    "tool call and result": ([{"role": "user", "content": "Weather in Paris?"}, CALL,
                              {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'}], TOOLS),
    "two results, then a user turn": ([{"role": "user", "content": "Paris and Oslo?"}, TWO_CALLS,
                                       {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21}'},
                                       {"role": "tool", "tool_call_id": "xyzXYZ789", "content": '{"temp": 3}'},
                                       {"role": "assistant", "content": "21 and 3 degrees."},
                                       {"role": "user", "content": "Thanks!"}], TOOLS),
    "system prompt": ([{"role": "system", "content": "You are terse.\nAnswer in one line."},
                       {"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "Rayleigh."},
                       {"role": "user", "content": "  And at sunset?  "}], TOOLS),
}


@functools.lru_cache(maxsize=1)
def _mistral_common(path: str):
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(path, mode=ValidationMode.test)


def _mistral_common_ids(ckpt, messages, tools):
    """The ground truth, independently of TekkenFormat: mistral-common's own file and request
    classes, as vLLM's MistralTokenizer serves a request."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    return _mistral_common(str(ckpt / "tekken.json")).encode_chat_completion(ChatCompletionRequest.from_openai(messages, tools)).tokens


@pytest.mark.parametrize("shape", list(CONVERSATIONS))
def test_a_rendered_text_encodes_to_mistral_commons_ids(ckpt, fmt, shape):
    messages, tools = CONVERSATIONS[shape]
    text = fmt.render(messages, tools, add_generation_prompt=True)
    ids = _mistral_common_ids(ckpt, messages, tools)
    assert fmt.encode(text) == ids, shape
    assert fmt.decode(ids) == text and ids[0] == 1 and text.startswith("<s>")  # one BOS, spelled in the text
    # a history ending with the assistant's reply (what the accumulator renders after a turn) too
    hist = messages + [{"role": "assistant", "content": "Fine."}]
    tk = fmt.tokenize_request(hist, tools, add_generation_prompt=False)
    assert fmt.encode(tk.text) == tk.tokens and tk.tokens[-1] == fmt.end_of_turn_id
    assert tk.tokens[: len(ids)] == ids or shape != "plain multi-turn"  # plain: the reply just appends


def test_a_encode_splits_at_control_tokens_only(fmt):
    # a text piece is encoded without BOS/EOS, control tokens by their special ids
    t = fmt.tekken
    assert fmt.encode("[INST]Hi[/INST]") == [3] + t.encode("Hi", bos=False, eos=False) + [4]
    assert fmt.encode("[TOOL_CALLS][") == [9] + t.encode("[", bos=False, eos=False)


def test_a_text_that_spells_a_control_token_stays_text(ckpt, fmt):
    """mistral-common (so vLLM) encodes a user's or a tool's '<s>', '</s>', '[INST]' as text. The
    render escapes them, and encode gives mistral-common's ids: before, they became BOS, EOS and
    [INST] mid-prompt (17 ids where mistral-common has 22, for the first message). A literal
    escape character round-trips too."""
    from workbench.tekken import ESCAPE

    user = f"Summarise: <s>old price</s> new price [INST] ok {ESCAPE}[/INST]{ESCAPE}{ESCAPE} [{ESCAPE}INST]"
    msgs = [{"role": "user", "content": user}, CALL,
            {"role": "tool", "tool_call_id": "abcDEF123", "content": "<html><s>21</s> [TOOL_CALLS] degrees</html>"}]
    for k in (1, 3):
        text = fmt.render(msgs[:k], TOOLS, add_generation_prompt=True)
        assert fmt.encode(text) == _mistral_common_ids(ckpt, msgs[:k], TOOLS), k
    # in the accumulator: the tool result extends the recorded ids, which are mistral-common's
    acc = Accumulator(fmt)
    first = acc.plan(msgs[:1], TOOLS)
    assert first.prompt_ids == _mistral_common_ids(ckpt, msgs[:1], TOOLS) and first.prompt_ids.count(1) == 1
    call = fmt.tekken.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]', bos=False, eos=False)
    acc.record(first, sample_of([9] + call + [2]), CALL)
    second = acc.plan(msgs, TOOLS)
    assert not second.new_segment and second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert second.prompt_ids[-12:] == _mistral_common_ids(ckpt, msgs, TOOLS)[-12:]  # the result's ids, as text


def test_a_text_units_and_drift_without_an_hf_backend(fmt):
    # Tekken has no HF `tokenizers` backend: TekkenFormat cuts ids at character boundaries itself.
    # '€' is 3 UTF-8 bytes; as byte tokens it only decodes after the third: one unit of 3 ids.
    t = fmt.tekken
    byte_ids = [t.num_special_tokens + b for b in "€".encode()]  # Tekken's first ranks are the 256 bytes
    assert t.decode(byte_ids) == "€"
    ids = t.encode("a ", bos=False, eos=False) + byte_ids + [2]
    units = fmt.text_units(ids)
    assert units[-2] == (2, 3, tuple(byte_ids)) and units[-1] == (3, 7, (2,))  # '</s>' is 4 characters
    # the bytes of '€' sampled one by one retokenize to its single token: those 3 sampled ids drift
    assert fmt.encode("€") != byte_ids and retokenization_drift(fmt, byte_ids) == 3
    assert retokenization_drift(fmt, fmt.encode("Hello, «ça va»?")) == 0
    # text spelling a control name is text (mistral-common encodes a message's "<s>" so): decoded plainly,
    # it read back as the control, and a reply's HTML strikethrough counted as drift (6 of 15)
    html = t.encode("Price: <s>10</s> 8 dollars.", bos=False, eos=False) + [2]
    assert 1 not in html[:-1] and retokenization_drift(fmt, html) == 0


# ------------------------------------------------------------------ (c) accumulation
def _parse(fmt, ids):
    """vLLM's `mistral` tool parser on the sampled text, as the loopback server runs it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    got = ToolParserManager.get_tool_parser("mistral")(fmt.tokenizer, tools=req.tools).extract_tool_calls(
        fmt.decode(ids), req)
    return got


def _reply(fmt, text):
    return fmt.tekken.encode(text, bos=False, eos=False) + [fmt.end_of_turn_id]


def _step(acc, fmt, msgs, tools, sample_ids, message):
    """plan + record; returns the verdict of the plan: extends / extends* / seal:<reason>."""
    before = list(acc.open_segment.token_ids) if acc.open_segment else []
    plan = acc.plan(msgs, tools)
    fresh = fmt.encode(plan.prompt_text)
    if plan.new_segment:
        verdict = "new" if not before else f"seal:{plan.seal_reason}"
    else:
        assert plan.prompt_ids[: len(before)] == before  # the exact recorded ids stay the prefix
        verdict = "extends" if plan.prompt_ids == fresh else "extends*"
    seg = acc.record(plan, sample_of(sample_ids), message)
    assert seg.token_ids[len(plan.prompt_ids):] == sample_ids  # the sampled ids, as sampled
    # where the recorded ids and a fresh render first differ ("" when they do not)
    return verdict, diff_context(fmt, before if plan.new_segment else plan.prompt_ids, fresh)[1] if before else ""


# The sampled call with the id NeMo writes, and without one. vLLM's `mistral` parser hands out a
# fresh id either way (it ignores the sampled one), and mistral-common renders the call back with
# that id: the tool result extends the exact sampled ids but a fresh render differs at the id
# ("extends*", token identity holds; the sampled bytes stay in the prompt). The loopback server
# hands out the written id instead (parsing.sampled_call_ids; the round-trip test below, and
# test_real_loopback's), so only a call written without an id stays "extends*" there.
@pytest.mark.parametrize("sampled,first_diff", [
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Ab3dE6gH9"}]', "recorded 'Ab3'"),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "recorded '\"}}]' vs render '\"}, \"'"),
])
def test_c_tool_call_extends_then_user_turn_seals(fmt, sampled, first_diff):
    # Tekken writes [TOOL_CALLS] then the JSON list with no leading space (the SentencePiece v3
    # tokenizer's trap), then </s>
    call_ids = [9] + fmt.tekken.encode(sampled, bos=False, eos=False)
    assert fmt.decode(call_ids) == "[TOOL_CALLS]" + sampled
    got = _parse(fmt, call_ids)
    assert got.tools_called and [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    cid = got.tool_calls[0].id
    assert len(cid) == 9 and cid.isalnum() and cid != "Ab3dE6gH9"  # a fresh Mistral-shaped id, not the sampled one
    assert retokenization_drift(fmt, call_ids) == 0
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"role": "assistant", "content": got.content or "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": got.tool_calls[0].function.arguments}}]}
    assert _step(acc, fmt, msgs, TOOLS, call_ids + [fmt.end_of_turn_id], call)[0] == "new"
    msgs += [call, {"role": "tool", "tool_call_id": cid, "content": '{"temp": 21}'}]
    answer = {"role": "assistant", "content": "21 degrees."}
    verdict, ctx = _step(acc, fmt, msgs, TOOLS, _reply(fmt, "21 degrees."), answer)
    assert verdict == "extends*" and first_diff in ctx, ctx
    # a new user turn: mistral-common drops the tool call and its result before the last user
    # message and moves [AVAILABLE_TOOLS] in front of it: the history is rewritten
    msgs += [answer, {"role": "user", "content": "And Oslo?"}]
    verdict, ctx = _step(acc, fmt, msgs, TOOLS, _reply(fmt, "Cold."), {"role": "assistant", "content": "Cold."})
    assert verdict == "seal:template_rewrite" and "recorded '[AVAILABLE_TOOLS]" in ctx
    assert [s.seal_reason for s in acc.segments] == ["template_rewrite", None]


def test_c_tool_result_extends_exactly_when_the_id_round_trips(fmt):
    """The one difference above is the id: with the sampled id in the returned message (what a server
    that kept the model's id would return), the tool result extends exactly (a fresh render equals it)."""
    sampled = '[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Ab3dE6gH9"}]'
    call_ids = [9] + fmt.tekken.encode(sampled, bos=False, eos=False) + [fmt.end_of_turn_id]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    _step(acc, fmt, msgs, TOOLS, call_ids, call)
    msgs += [call, {"role": "tool", "tool_call_id": "Ab3dE6gH9", "content": '{"temp": 21}'}]
    assert _step(acc, fmt, msgs, TOOLS, _reply(fmt, "21."), {"role": "assistant", "content": "21."}) == ("extends", "")


@pytest.mark.parametrize("system,tools,verdicts", [
    (None, None, ["extends", "extends"]),  # plain multi-turn: every turn appends
    (None, TOOLS, ["seal:template_rewrite", "seal:template_rewrite"]),  # [AVAILABLE_TOOLS] moves to the last user turn
    ("Be terse.", None, ["seal:template_rewrite", "seal:template_rewrite"]),  # so does the system prompt
])
def test_c_plain_multi_turn(fmt, system, tools, verdicts):
    acc = Accumulator(fmt)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi!"}]
    got = []
    for k, text in enumerate(["Hello. How can I help?", "Sure: «ça va».", "Bye."]):
        v, _ = _step(acc, fmt, msgs, tools, _reply(fmt, text), {"role": "assistant", "content": text})
        got.append(v)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"More {k}?"}]
    assert got == ["new"] + verdicts


def test_c_replies_mistral_common_refuses_as_history_go_on(fmt):
    """Text before [TOOL_CALLS] (the `mistral` parser hands out content and the call) and a bare
    </s> (empty content) are what the policy samples, but mistral-common's validator refuses both
    as an assistant message (the v3 validator of NeMo's file): sent back, every later request of the
    episode was a 400. They render without the text / as a space now, and the next turn extends
    the sampled ids."""
    said = "Let me check."
    call_ids = fmt.tekken.encode(said, bos=False, eos=False) + [9] + fmt.tekken.encode(
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', bos=False, eos=False) + [fmt.end_of_turn_id]
    got = _parse(fmt, call_ids[:-1])
    assert got.content.strip() == said and got.tools_called  # both handed out
    cid = got.tool_calls[0].id
    call = {"role": "assistant", "content": got.content, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": got.tool_calls[0].function.arguments}}]}
    for msgs, tools, sample, message, nxt in [
        ([{"role": "user", "content": "Paris?"}], TOOLS, call_ids, call, [{"role": "tool", "tool_call_id": cid, "content": "sunny"}]),
        ([{"role": "user", "content": "Hi"}], None, [fmt.end_of_turn_id], {"role": "assistant", "content": ""},
         [{"role": "user", "content": "again"}]),
    ]:
        acc = Accumulator(fmt)
        _step(acc, fmt, msgs, tools, sample, message)
        verdict, _ = _step(acc, fmt, msgs + [message] + nxt, tools, _reply(fmt, "Ok."), {"role": "assistant", "content": "Ok."})
        assert verdict in ("extends", "extends*"), verdict  # planned (no 400), on the sampled ids
        assert [t for t, m in zip(acc.segments[0].token_ids, acc.segments[0].loss_mask) if m][:len(sample)] == sample


def test_c_cut_by_max_tokens_closes_with_eos(fmt):
    # no </s> sampled: the closing </s> enters the next delta as template text, not as trainable
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Count."}]
    cut = fmt.tekken.encode("1 2 3", bos=False, eos=False)
    plan = acc.plan(msgs)
    acc.record(plan, sample_of(cut, "length"), {"role": "assistant", "content": "1 2 3"})
    plan = acc.plan(msgs + [{"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "Go on."}])
    assert not plan.new_segment and plan.prompt_ids == fmt.encode(plan.prompt_text)
    seg = acc.open_segment
    assert plan.prompt_ids[len(seg):][0] == fmt.end_of_turn_id and set(seg.loss_mask[-len(cut):]) == {1}


def test_lint_tekken_directory(ckpt):
    """`python -m workbench.lint DIR` on a Tekken directory: the mistral profile, TekkenFormat and the
    loopback's `mistral` parser. The verdicts, written down: mistral-common puts the system prompt and
    [AVAILABLE_TOOLS] in front of the LAST user message and drops tool calls and results before it, so
    every shape with a system prompt or tools seals at the next user turn (template_rewrite; a changed
    system prompt is history_rewritten first); the tool results themselves extend (turn 2), and a reply
    cut by max_tokens extends. No leading-space trap after control tokens (SentencePiece v3 has one)."""
    from workbench.lint import lint

    report = lint(str(ckpt))
    # a Tekken directory with a generation_config.json (NeMo's, eos 2): its stop ids read as a list
    # (MistralTokenizer takes no int: the linter raised TypeError, wb.lint() too); an unknown end of
    # turn is the linter's error line, not a KeyError's traceback
    import shutil

    from workbench.lint import main

    with_gc = ckpt.parent / "nemo_gc"
    shutil.copytree(ckpt, with_gc, symlinks=True, dirs_exist_ok=True)
    (with_gc / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert lint(str(with_gc), ["plain"]).stops == ["</s>"]
    assert main([str(with_gc), "--shape", "plain", "--end-of-turn", "</S>"]) == 2
    assert report.verdicts() == {"plain": "seal:template_rewrite", "tool_one": "seal:template_rewrite",
                                 "tool_many": "seal:template_rewrite", "reasoning_on": "seal:template_rewrite",
                                 "reasoning_off": "seal:template_rewrite", "system_changed": "seal:history_rewritten",
                                 "max_tokens_cut": "extends"}
    turns = {s.shape: [t.verdict for t in s.turns] for s in report.shapes}
    assert turns["tool_one"][:3] == ["start", "extends", "seal:template_rewrite"], turns
    assert turns["tool_many"][:3] == ["start", "extends", "seal:template_rewrite"], turns
    plain = next(s for s in report.shapes if s.shape == "plain")
    assert "recorded 'You are' vs render 'What is'" in plain.first.context  # the system prompt moved
    found = report.traps_found()
    assert not found["leading_space"] and not found["merged_boundary"] and not found["roundtrip"]
    # mistral-common keeps a control name in text as text (the render escapes it: no id 2), and it
    # encodes the request's BOS itself: neither was a trap (both read as one, or as "no BOS token")
    assert not found["special_in_text"] and not found["bos_doubling"]
    assert not found["tools_unrendered"]  # ([AVAILABLE_TOOLS])
    assert "mistral-common encodes the request" in next(t.detail for t in report.traps if t.name == "bos_doubling")


def test_c_v7_tekken_renders_text_beside_a_call_as_mistral_common_does(tmp_path):
    """v7 and later validators take content beside tool calls: there the message renders whole, as
    vLLM would build it (the v3 rewrite above applied to every version, a prompt vLLM never builds)."""
    from workbench.tekken import load_tokenizer

    cfg = json.loads((_pkg_dir("mistral_common") / "data" / "tekken_240911.json").read_text())
    cfg["config"]["version"] = "v7"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "max_position_embeddings": 131072}))
    (tmp_path / "tekken.json").write_text(json.dumps(cfg))
    fmt = ChatFormat.for_profile(load_tokenizer(tmp_path), profile_for(tmp_path))
    call = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    msgs = [{"role": "user", "content": "Paris?"}, call, {"role": "tool", "tool_call_id": "Ab3dE6gH9", "content": "sunny"}]
    assert fmt._both_or_neither and "Let me check.[TOOL_CALLS]" in fmt.render(msgs, TOOLS, True)
    # an empty reply (a bare </s>) sent back: v7's encoder refuses a message with neither content nor calls,
    # and every later request of the episode was a 400 (the episode dropped); it renders as nothing
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Hi"}]
    plan = acc.plan(msgs)
    eos = fmt.end_of_turn_id  # (</s>: id 2)
    acc.record(plan, sample_of([eos]), {"role": "assistant", "content": ""})
    again = acc.plan(msgs + [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"}])
    assert not again.new_segment, again.seal_reason


def test_template_kwargs_a_request_sends_are_read_by_no_tekken_render(fmt):
    """chat_template_kwargs (Qwen agents send enable_thinking) and reasoning_effort: the check read a
    Jinja template Tekken has not, and every such request was a 400 naming a schema error. mistral-common
    reads no template kwargs; an effort this version does not encode is refused by name."""
    from workbench.loopback.protocol import RequestError, check_template_controls

    check_template_controls({"chat_template_kwargs": {"enable_thinking": False}}, fmt.template_kwargs, False,
                            fmt.renders_the_same_with)
    with pytest.raises(RequestError, match="reasoning_effort is 'low'"):
        check_template_controls({"reasoning_effort": "low"}, fmt.template_kwargs, False, fmt.renders_the_same_with)


def test_messages_mistral_common_refuses_are_the_requests_400_not_an_unexpected_error(ckpt):
    """The Tekken format refuses through mistral-common's validation and a ValueError (an unknown
    role), not a template error: every such bad request was counted in unexpected_errors["plan"]
    (whose expectation is 0) and logged with a traceback."""
    import openai

    from workbench.loopback.server import LoopbackServer
    from workbench.tekken import load_tokenizer

    class NoEngine:
        async def generate(self, prompt_ids, sampling):
            raise AssertionError("a refused request must not reach the engine")

    with LoopbackServer(NoEngine(), load_tokenizer(ckpt), profile=profile_for(ckpt), max_model_len=4096) as srv:
        client = openai.OpenAI(base_url=srv.base_url(srv.open_session()), api_key=srv.api_key, max_retries=0)
        for msgs in ([{"role": "critic", "content": "x"}],
                     [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "abcDEF123", "content": "r"}]):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="p", messages=msgs, max_tokens=4)
        assert srv.summary()["unexpected_errors"] == {} and srv.summary()["errors"] == {400: 2}
    from workbench.tekken import TekkenFormat

    assert not TekkenFormat.is_refusal(ValueError("a ValueError of our own code is no refusal: counted"))


def test_a_tekken_checkpoint_runs_through_a_rollout_runner_and_its_session_lint(ckpt):
    """The runner loaded every checkpoint's tokenizer through transformers, and TekkenFormat needs
    vLLM's MistralTokenizer: a Tekken checkpoint's runner (so connect()) failed at start. The
    runner takes mistral-common's for a tekken profile (and wb.lint() reads the directory). (A stand-in engine handle:
    nothing is sampled.)"""
    from workbench.rollout.runner import RolloutRunner
    from workbench.tekken import TekkenFormat

    from pathlib import Path

    agent = Path(__file__).resolve().parents[1] / "workbench" / "examples" / "calculator_openai.py"
    runner = RolloutRunner(str(agent), [object()], str(ckpt))
    assert isinstance(runner.server.fmt, TekkenFormat) and runner.sampling.stop_token_ids == [2]


def test_a_tool_result_without_its_call_id_is_refused_by_name(fmt):
    """A tool result without tool_call_id (an agent that forgot it): mistral-common's from_openai
    raised a bare KeyError, which the loopback answered "cannot render these messages:
    'tool_call_id'" and counted as its own unexpected error. It is Mistral's refusal now, naming
    the message and the field (the loopback answers it 400, uncounted)."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}, CALL, {"role": "tool", "content": "21 degrees"}]
    with pytest.raises(Exception, match=r"messages\[2\] is a tool result without a tool_call_id") as e:
        fmt.render(msgs, TOOLS, add_generation_prompt=True)
    assert fmt.is_refusal(e.value)
    msgs[2]["tool_call_id"] = "abcDEF123"  # with it, it renders
    assert fmt.render(msgs, TOOLS, add_generation_prompt=True).count("[TOOL_RESULTS]") == 1
    # an id of the wrong shape: Mistral's refusal named the id, not the message
    bad = [msgs[0], {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": "call_0"}]}, {**msgs[2], "tool_call_id": "call_0"}]
    with pytest.raises(Exception, match=r"messages\[1\]: Tool call id was call_0") as e:
        fmt.render(bad, TOOLS, add_generation_prompt=True)
    assert fmt.is_refusal(e.value)
